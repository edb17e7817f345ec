"""Support rows at the size of their information: one byte buffer for a whole batch (docs/design.md §2).

A support row is a set of vocabulary ids that holds the token sampled from it. Given the
sampled tokens (the trainer has them), a row of ``n`` ids is the choice of ``n - 1`` ids among
the ``V - 1`` others: ``log2 C(V - 1, n - 1)`` bits, plus its length. The codec comes within a
few percent of that (docs/design.md §2 gives the argument and benchmarks/transport.py the
figures):

- each row is sorted; the sampled id is dropped and the ids above it shifted down by one,
  so the ``m = n - 1`` ids left lie in ``[0, U)`` with ``U = V - 1`` (without sampled tokens
  every id is kept and ``U = V``);
- the gaps between consecutive ids (``g_0 = id_0``, ``g_i = id_i - id_{i-1} - 1``) are Rice
  coded with a parameter ``b`` fixed by ``(U, m)`` alone: ``b = floor(log2((U - m) / (m + 1)))``
  (0 when that is below 1), the typical gap of ``m`` ids spread over ``U``. A gap costs its
  ``b`` low bits plus ``(g >> b) + 1`` bits of unary: about ``m * (2 + log2(U / m))`` bits a
  row, against ``log2 C(U, m) ~ m * (log2(U / m) + 1.44)``;
- the lengths ``n`` are Rice coded too, with one parameter for the batch (in the header).

Unary parts and low bits go to separate streams, so every step decodes with array
operations over the whole batch (the unary values are the gaps between the set bits of
their stream; the low bits sit at offsets that the lengths fix): no Python loop over rows
or tokens. Layout, all integers little-endian::

    magic b"NRSC" | version u8 | flags u8 (1: sampled ids dropped) | length parameter u8 | 0 u8
    V u32 | rows u64 | ids u64 (sum of the coded m) | trajectories u64 | max row length u32
    CRC-32 u32 of the whole buffer with these four bytes zero
    the four stream sizes in bytes, u64 each: length unary, length low bits, gap unary, gap low bits
    cu_seqlens int64 (trajectories + 1) | the four streams

Decoding checks everything it reads before any index is formed from it: the magic and
version, every size against the buffer (a truncated or oversized buffer), the CRC-32 (a bit
flipped in transit or at rest, which could otherwise decode to another valid row), the
unary streams' counts and padding, each length against the header's maximum (a count past the row width),
each id against ``U`` (a gap past the vocabulary), and the sampled tokens against ``V``; a
failure is a :class:`CodecError` naming what and where. A decoded batch carries the record
of a passed §2 check (ids distinct and in range, each sampled token in its row).

Worked example, ``V = 10``, one row ``{2, 5, 7}`` whose sampled token is 5: ``{2, 7}`` shift
to ``{2, 6}`` in ``U = 9``; ``m = 2``, ``b = floor(log2(7 / 3)) = 1``; gaps ``2, 3`` ->
unary ``(1, 1)``, low bits ``0, 1``.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from nemo_replay.support.checked import record_checked
from nemo_replay.support.dtypes import first_outside, is_integer
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport, is_support
from nemo_replay.support.validate import describe_row

__all__ = ["MAGIC", "VERSION", "CodecError", "encode_support", "decode_support", "header_of", "rice_parameter"]

MAGIC = b"NRSC"
VERSION = 1
_HEAD = struct.Struct("<4sBBBBIQQQII4Q")
_DROPPED = 1
_CRC_AT = 40  # the CRC's offset in the header
_MAX_V = 2**31 - 1


class CodecError(ValueError):
    """A compact support buffer that cannot be what :func:`encode_support` wrote (truncated, corrupted)."""


@dataclass(frozen=True)
class Header:
    dropped: bool
    length_bits: int
    vocab_size: int
    rows: int
    ids: int
    trajectories: int
    max_length: int
    crc: int
    streams: tuple


def rice_parameter(universe: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``floor(log2((U - m) // (m + 1)))``, 0 where that quotient is below 2 (module doc); int64."""
    q = np.maximum((universe - m) // (m + 1), 1).astype(np.int64)
    return (np.frexp(q.astype(np.float64))[1] - 1).astype(np.int64)  # exact: q < 2**53


# ---------------------------------------------------------------------------- bit streams
def _unary(values: np.ndarray) -> np.ndarray:
    """``v`` zeros then a one for each value, packed big-endian into bytes."""
    if values.size == 0:
        return np.zeros(0, np.uint8)
    ones = np.cumsum(values + 1) - 1
    out = np.bincount(ones >> 3, weights=(128 >> (ones & 7)).astype(np.float64), minlength=int(ones[-1] >> 3) + 1)
    return out.astype(np.uint8)


def _fields(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Each value in its width of bits (<= 31), back to back, packed big-endian into bytes."""
    keep = widths > 0
    values, widths = values[keep].astype(np.uint64), widths[keep].astype(np.int64)
    if values.size == 0:
        return np.zeros(0, np.uint8)
    ends = np.cumsum(widths)
    starts = ends - widths
    nbytes = int(-(-int(ends[-1]) // 8))
    # Left-aligned in a 64-bit word whose first byte is the field's first byte (at most 5 bytes used).
    word = values << (64 - widths - (starts & 7)).astype(np.uint64)
    first = starts >> 3
    out = np.zeros(nbytes + 8, np.float64)
    for j in range(5):
        part = ((word >> np.uint64(56 - 8 * j)) & np.uint64(0xFF)).astype(np.float64)
        out += np.bincount(first + j, weights=part, minlength=nbytes + 8)
    return out[:nbytes].astype(np.uint8)


def _read_unary(stream: np.ndarray, count: int, what: str) -> np.ndarray:
    """The first ``count`` unary values of ``stream``; everything after them must be zero padding."""
    ones = np.flatnonzero(np.unpackbits(stream).view(bool))
    if ones.size != count:
        raise CodecError(f"compact support: the {what} stream holds {ones.size} values, the header says {count}; "
                         f"a corrupted buffer")
    if count and int(ones[-1]) < 8 * stream.size - 8:
        raise CodecError(f"compact support: the {what} stream runs {8 * stream.size - 1 - int(ones[-1])} bits past its "
                         f"last value; a corrupted buffer")
    if count == 0 and stream.size:
        raise CodecError(f"compact support: the {what} stream holds {stream.size} bytes for no value; a corrupted buffer")
    return np.diff(ones, prepend=-1) - 1


def _read_fields(stream: np.ndarray, widths: np.ndarray, what: str) -> np.ndarray:
    """The fields of widths ``widths`` back to back in ``stream`` (:func:`_fields`'s inverse); int64."""
    ends = np.cumsum(widths)
    total = int(ends[-1]) if widths.size else 0
    if -(-total // 8) != stream.size:
        raise CodecError(f"compact support: the {what} stream holds {stream.size} bytes where its fields need "
                         f"{-(-total // 8)}; a corrupted buffer")
    out = np.zeros(widths.size, np.int64)
    wide = np.flatnonzero(widths > 0)
    starts, widths = (ends - widths)[wide], widths[wide].astype(np.uint64)
    # The stream as big-endian 64-bit words; each field lies in the 64-bit window that starts at its
    # first bit, made of its word and the next.
    words = np.concatenate([stream, np.zeros(16 - stream.size % 8, np.uint8)]).view(">u8").astype(np.uint64)
    q, r = starts >> 6, (starts & 63).astype(np.uint64)
    hi, lo = words[q], words[q + 1]
    window = np.where(r > 0, (hi << r) | (lo >> (np.uint64(64) - r)), hi)  # r == 0: the shift by 64 is discarded
    out[wide] = (window >> (np.uint64(64) - widths)).astype(np.int64)
    return out


# ---------------------------------------------------------------------------- encode
def _rows(support: Union[RaggedSupport, PackedTensor]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not is_support(support):
        raise ValueError(f"encode_support: expected a RaggedSupport or a PackedTensor, got {type(support).__name__}")
    support = RaggedSupport.of(support)
    return (support.member_ids.cpu().numpy().astype(np.int64), support.row_offsets.cpu().numpy(),
            support.cu_seqlens.cpu().numpy().astype(np.int64))


def encode_support(
    support: Union[RaggedSupport, PackedTensor],
    *,
    vocab_size: int,
    sampled_ids: Optional[torch.Tensor] = None,
) -> np.ndarray:
    """The rows of ``support`` as one uint8 buffer (module doc).

    Args:
        support: the batch's rows (fixed-width rows are read as their members).
        vocab_size: ``V``; every id must lie below it.
        sampled_ids: (rows,) the token sampled from each row; given, it is dropped from its row
            (each non-empty row must hold it) and the decoder needs the same tokens back.

    Raises:
        ValueError naming the row: an id outside ``[0, V)``, an id twice in a row, a non-empty
        row without its sampled token.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= _MAX_V:
        raise ValueError(f"encode_support: vocab_size={vocab_size!r}, expected an int in [1, 2**31 - 1]")
    ids, offsets, cu = _rows(support)
    n = offsets.size - 1
    lengths = np.diff(offsets)
    row_of = np.repeat(np.arange(n, dtype=np.int64), lengths)
    j = first_outside(ids, vocab_size)
    if j is not None:
        raise ValueError(f"encode_support: row {int(row_of[j])} holds id {int(ids[j])}, outside [0, {vocab_size})")
    key = row_of * vocab_size + ids
    if key.size > 1 and not bool(np.all(key[1:] > key[:-1])):
        order = np.argsort(key, kind="stable")
        ids, key = ids[order], key[order]
        if bool(np.any(key[1:] == key[:-1])):
            j = int(np.flatnonzero(key[1:] == key[:-1])[0])
            raise ValueError(f"encode_support: row {int(row_of[j])} holds id {int(ids[j])} twice; a support is a set")
    universe = vocab_size
    coded = ids
    if sampled_ids is not None:
        sampled = torch.as_tensor(sampled_ids).cpu().numpy().astype(np.int64)
        if sampled.shape != (n,):
            raise ValueError(f"encode_support: sampled_ids has shape {sampled.shape}, expected ({n},): one per row")
        is_sampled = ids == sampled[row_of]
        hits = np.bincount(row_of[is_sampled], minlength=n)
        missing = (lengths > 0) & (hits == 0)
        if missing.any():
            r = int(np.flatnonzero(missing)[0])
            raise ValueError(f"encode_support: row {r} does not hold its sampled token {int(sampled[r])}; only rows "
                             f"that hold their sampled token can drop it")
        keep = ~is_sampled
        coded = ids[keep] - (ids[keep] > sampled[row_of[keep]])
        row_of = row_of[keep]
        universe = vocab_size - 1
    m = np.bincount(row_of, minlength=n).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(m)[:-1]]) if n else np.zeros(0, np.int64)
    prev = np.empty_like(coded)
    if coded.size:
        prev[1:] = coded[:-1]
        prev[starts[m > 0]] = -1
    gaps = coded - prev - 1
    b = rice_parameter(np.int64(universe), m)[row_of] if coded.size else np.zeros(0, np.int64)
    lb = max(0, int(lengths.mean()).bit_length() - 2) if n else 0  # about log2(0.7 x the mean length)
    streams = (_unary(lengths >> lb), _fields(lengths & ((1 << lb) - 1), np.full(n, lb, np.int64)),
               _unary(gaps >> b), _fields(gaps & ((np.int64(1) << b) - 1), b))
    fields = [MAGIC, VERSION, _DROPPED if sampled_ids is not None else 0, lb, 0, vocab_size, n, int(coded.size),
              cu.size - 1, int(lengths.max()) if n else 0, 0, *(s.size for s in streams)]
    out = np.concatenate([np.frombuffer(_HEAD.pack(*fields), np.uint8), cu.astype("<i8").view(np.uint8), *streams])
    out[_CRC_AT:_CRC_AT + 4] = np.frombuffer(struct.pack("<I", zlib.crc32(out)), np.uint8)
    return out


# ---------------------------------------------------------------------------- decode
def header_of(buf: Union[np.ndarray, bytes, torch.Tensor]) -> Header:
    """The header of a compact buffer, checked against the buffer's size."""
    raw = _as_bytes(buf)
    if raw.size < _HEAD.size:
        raise CodecError(f"compact support: {raw.size} bytes, fewer than the {_HEAD.size}-byte header; a truncated buffer")
    magic, version, flags, lb, _, V, rows, ids, trajectories, max_length, crc, *streams = _HEAD.unpack(raw[:_HEAD.size].tobytes())
    if magic != MAGIC:
        raise CodecError(f"compact support: magic {magic!r}, expected {MAGIC!r}; not a compact support buffer")
    if version != VERSION:
        raise CodecError(f"compact support: version {version}; this reader knows {VERSION} (upgrade nemo_replay)")
    if flags & ~_DROPPED or lb > 31 or not 1 <= V <= _MAX_V:
        raise CodecError(f"compact support: header flags {flags}, length parameter {lb}, V {V} out of range; a corrupted buffer")
    need = _HEAD.size + 8 * (trajectories + 1) + sum(streams)
    if need != raw.size:
        raise CodecError(f"compact support: the header describes {need} bytes, the buffer holds {raw.size} "
                         f"({'truncated' if raw.size < need else 'oversized'})")
    return Header(bool(flags & _DROPPED), lb, V, rows, ids, trajectories, max_length, crc, tuple(streams))


def _crc(raw: np.ndarray) -> int:
    """CRC-32 of ``raw`` with its CRC field read as zero."""
    crc = zlib.crc32(raw[:_CRC_AT])
    crc = zlib.crc32(b"\0\0\0\0", crc)
    return zlib.crc32(raw[_CRC_AT + 4:], crc)


def _as_bytes(buf) -> np.ndarray:
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise CodecError(f"compact support: expected a 1-D uint8 buffer, got {buf.dtype} {tuple(buf.shape)}")
        return buf.cpu().numpy()
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return np.frombuffer(buf, np.uint8)
    if isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1:
        return buf
    raise CodecError(f"compact support: expected a uint8 buffer, got {type(buf).__name__}")


def decode_support(
    buf: Union[np.ndarray, bytes, torch.Tensor],
    *,
    sampled_ids: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    device=None,
) -> RaggedSupport:
    """A batch's rows back from :func:`encode_support`'s buffer (sorted ids, record of a passed check).

    Args:
        sampled_ids: (rows,) the sampled tokens, required when the encoder dropped them; given
            for rows coded with them, each non-empty row must hold its own.
        vocab_size: when given, must equal the buffer's ``V``.
        device: where the rows go (default CPU).

    Raises:
        CodecError (a ValueError) for a buffer that is not one the encoder wrote (module doc);
        SupportAlignmentError (a ValueError) for a sampled token missing from its row.
    """
    raw = _as_bytes(buf)
    h = header_of(raw)
    if vocab_size is not None and vocab_size != h.vocab_size:
        raise CodecError(f"compact support: the rows were coded for V = {h.vocab_size}, this model has {vocab_size}")
    at = _HEAD.size
    if _crc(raw) != h.crc:
        raise CodecError("compact support: the buffer's CRC-32 does not match its header; corrupted in transit or at rest")
    cu = raw[at:at + 8 * (h.trajectories + 1)].view("<i8").astype(np.int64)
    if cu.size == 0 or cu[0] != 0 or bool(np.any(np.diff(cu) < 0)) or cu[-1] != h.rows:
        raise CodecError(f"compact support: trajectory offsets are not 0 .. {h.rows} non-decreasing; a corrupted buffer")
    at += 8 * (h.trajectories + 1)
    parts = []
    for size in h.streams:
        parts.append(raw[at:at + size])
        at += size
    len_high, len_low, gap_high, gap_low = parts
    n = h.rows
    lengths = (_read_unary(len_high, n, "length") << h.length_bits) | _read_fields(
        len_low, np.full(n, h.length_bits, np.int64), "length low-bit")
    if n and int(lengths.max()) > h.max_length:
        r = int(np.argmax(lengths))
        raise CodecError(f"compact support: row {r} decodes to {int(lengths[r])} ids, past the header's row width "
                         f"{h.max_length}; a corrupted buffer")
    if h.max_length > h.vocab_size:
        raise CodecError(f"compact support: row width {h.max_length} exceeds V = {h.vocab_size}; a corrupted buffer")
    m = np.maximum(lengths - 1, 0) if h.dropped else lengths
    if h.ids > 8 * gap_high.size:  # each id takes at least one unary bit: bounds every array below
        raise CodecError(f"compact support: the header says {h.ids} ids, the gap stream holds at most "
                         f"{8 * gap_high.size}; a corrupted buffer")
    if int(m.sum()) != h.ids:
        raise CodecError(f"compact support: the lengths give {int(m.sum())} ids, the header says {h.ids}; a corrupted buffer")
    universe = h.vocab_size - 1 if h.dropped else h.vocab_size
    row_of = np.repeat(np.arange(n, dtype=np.int64), m)
    b = rice_parameter(np.int64(universe), m)[row_of] if h.ids else np.zeros(0, np.int64)
    gaps = (_read_unary(gap_high, h.ids, "gap") << b) | _read_fields(gap_low, b, "gap low-bit")
    steps = np.cumsum(gaps + 1)
    starts = np.concatenate([[0], np.cumsum(m)[:-1]]) if n else np.zeros(0, np.int64)
    base = np.where(starts > 0, steps[np.maximum(starts - 1, 0)], 0) if h.ids else np.zeros(n, np.int64)
    coded = steps - base[row_of] - 1 if h.ids else np.zeros(0, np.int64)
    if coded.size and int(coded.max()) >= universe:
        j = int(np.argmax(coded))
        raise CodecError(f"compact support: row {int(row_of[j])} decodes id {int(coded[j])}, past the {universe} ids it "
                         f"is coded among; a corrupted buffer")
    if h.dropped and sampled_ids is None:
        raise CodecError("compact support: the rows were coded without their sampled tokens; pass sampled_ids "
                         "(the tokens sampled from them, one per row)")
    if sampled_ids is not None:
        sampled_t = torch.as_tensor(sampled_ids)
        if not is_integer(sampled_t):
            raise CodecError(f"compact support: sampled_ids have dtype {sampled_t.dtype}, expected integer token ids; "
                             f"pass the response's token ids as they came (torch.long)")
        sampled = sampled_t.cpu().numpy().astype(np.int64)
        if sampled.shape != (n,):
            raise CodecError(f"compact support: sampled_ids has shape {sampled.shape}, expected ({n},): one per row")
        r = first_outside(sampled, h.vocab_size)
        if r is not None:
            raise CodecError(f"compact support: sampled token {int(sampled[r])} of row {r} is outside [0, {h.vocab_size})")
        own = sampled[row_of]
    if h.dropped:
        above = coded >= own
        ids = coded + above
        # Insert each non-empty row's sampled token at its sorted place: a coded id moves up by the
        # non-empty rows before its row, and by one more when it lies above its row's sampled token.
        full = lengths.astype(np.int64)
        has = full > 0
        before = np.cumsum(has) - has
        members = np.empty(int(full.sum()), np.int64)
        members[np.arange(ids.size) + before[row_of] + above] = ids
        below = m - np.bincount(row_of, weights=above, minlength=n).astype(np.int64)
        out_starts = np.cumsum(full) - full
        members[out_starts[has] + below[has]] = sampled[has]
    else:
        members = coded
        full = lengths
        if sampled_ids is not None:
            # Coded with the sampled tokens in: each non-empty row must hold its own (docs/design.md §2).
            hit = np.bincount(row_of, weights=coded == own, minlength=n) > 0
            missing = np.flatnonzero((lengths > 0) & ~hit)
            if missing.size:
                r = int(missing[0])
                raise SupportAlignmentError(
                    f"compact support: {describe_row(torch.from_numpy(cu), r)}: sampled token {int(sampled[r])} is "
                    f"not a member of its support row {coded[row_of == r][:16].tolist()}; rows and tokens are "
                    f"misaligned -- pass this response's own token ids")
    row_offsets = np.concatenate([[0], np.cumsum(full)]).astype(np.int64)
    out = RaggedSupport(torch.from_numpy(members.astype(np.int32)), torch.from_numpy(row_offsets),
                        torch.from_numpy(cu.astype(np.int32)))
    if device is not None:
        out = out.to(device)
    record_checked(out, h.vocab_size)
    return out
