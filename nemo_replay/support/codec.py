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

Decoding is torch operations on any device, over several buffers at once (their rows back to
back), in two parts:

- on the host, everything a header says, before anything is copied or sized: the magic and
  version, every size against the buffer (a truncated or oversized buffer), the CRC-32 (a bit
  flipped in transit or at rest, which could otherwise decode to another valid row), the
  trajectory offsets, and the bounds that size every array (values each stream can hold, and the
  row width, which sizes a fixed-width decode, no more than the ids the rows hold).
  The host then regroups the streams by kind (every buffer's length unary stream back to
  back, and so on) and lays a table of every per-buffer integer the device needs beside them:
  one copy to the device, through pinned memory on CUDA (a copy from pageable memory would
  wait for every kernel queued before it);
- on the device, the array steps, with no host read: each size comes from the headers, every
  index is clamped into its tensor, and what depends on the bits is a flag per check: the
  unary streams' counts and padding, each length against the header's maximum (a count past
  the row width), the low-bit stream's size, each row's ids against ``U`` (a gap past the
  vocabulary), the sampled tokens against ``V``. A unary stream's set bits come from
  ``nonzero_static`` (its size from the header); each row gathers what its buffer says, and
  each id what its row says, in one gather. Each step between ids is clamped below ``2**31``
  (no gap reaches ``U``), so ids rise within a row whatever the bits hold once the counts
  hold: a row's first and last id bound all of it.

:func:`decode_support` and :func:`decode_batch` read the flags at once and raise a
:class:`CodecError` naming what and where; :class:`CompactRows` hands them to the scorer,
which reads them with its own guards in its one host read (the ``decode`` guard). A decoded
batch carries the record of a passed §2 check (ids distinct and in range, each sampled token
in its row).

Worked example, ``V = 10``, one row ``{2, 5, 7}`` whose sampled token is 5: ``{2, 7}`` shift
to ``{2, 6}`` in ``U = 9``; ``m = 2``, ``b = floor(log2(7 / 3)) = 1``; gaps ``2, 3`` ->
unary ``(1, 1)``, low bits ``0, 1``.
"""

from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from nemo_replay.support import fused as _fused
from nemo_replay.support.checked import record_checked
from nemo_replay.support.codec_table import (  # the per-buffer table's columns (codec_table.py)
    AT as _AT, COLUMNS as _COLUMNS, DROP as _DROP, END_ROW as _END_ROW, FIRST_ROW as _FIRST_ROW, GAP_LOW as _GAP_LOW,
    GAP_UNARY as _GAP_UNARY, IDS as _IDS, LB as _LB, LEN_LOW as _LEN_LOW, LEN_UNARY as _LEN_UNARY, MASK as _MASK,
    MAX_V as _MAX_V, NEVER as _NEVER, ROWS as _ROWS, SIZE as _SIZE, UNIVERSE as _UNIVERSE, V as _V, WIDTH as _WIDTH)
from nemo_replay.support.dtypes import first_outside, is_integer
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.nonzero import nonzero_static
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport, is_support
from nemo_replay.support.validate import describe_row

__all__ = [
    "MAGIC", "VERSION", "CodecError", "CompactRows", "DecodedRows", "encode_support", "encode_kept", "decode_support",
    "decode_batch",
    "row_lengths", "header_of", "rice_parameter",
]

MAGIC = b"NRSC"
VERSION = 1
_HEAD = struct.Struct("<4sBBBBIQQQII4Q")
_DROPPED = 1
_CRC_AT = 40  # the CRC's offset in the header


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


# ---------------------------------------------------------------------------- encode
def _rows(support: Union[RaggedSupport, PackedTensor], where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not is_support(support):
        raise ValueError(f"{where}: expected a RaggedSupport or a PackedTensor, got {type(support).__name__}")
    support = RaggedSupport.checked_of(support, where=where)
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
    ids, offsets, cu = _rows(support, "encode_support")
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
        sampled = _sampled_ids(sampled_ids, "encode_support").cpu().numpy().astype(np.int64)
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


def encode_kept(support: Union[RaggedSupport, PackedTensor], sampled_ids: Optional[torch.Tensor] = None, *,
                where: str = "support") -> np.ndarray:
    """Rows coded where the model's vocabulary is not known (a rollout worker, a driver): ``V`` the
    largest id or sampled token + 1, the sampled ids kept in their rows.

    Kept, not dropped: such rows travel apart from their tokens, and a row decoded against other
    tokens must fail the membership check, not be rebuilt around them. Given ``sampled_ids``
    (rows,), each non-empty row must hold its own (SupportAlignmentError naming ``where`` and the row).
    """
    if not is_support(support):
        raise ValueError(f"{where}: expected a RaggedSupport or a PackedTensor, got {type(support).__name__}")
    support = RaggedSupport.checked_of(support, where=where)
    ids = support.member_ids
    sampled = None if sampled_ids is None else _sampled_ids(sampled_ids, where).to(torch.int64)
    bound = max(int(ids.max()) if ids.numel() else 0, int(sampled.max()) if sampled is not None and sampled.numel() else 0)
    if sampled is not None:
        support.validate(sampled_ids=sampled, where=where)
    return encode_support(support, vocab_size=bound + 1)


def _sampled_ids(sampled_ids, where: str) -> torch.Tensor:
    """``sampled_ids`` as a tensor of an integer dtype: a float id would be cut to another token (3.7 -> 3)."""
    sampled = torch.as_tensor(sampled_ids)
    if not is_integer(sampled):
        raise ValueError(f"{where}: sampled_ids of dtype {sampled.dtype}; expected integer token ids (the tokens sampled "
                         f"from the rows, as the engine returned them)")
    return sampled


# ---------------------------------------------------------------------------- decode: the host's part
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


def _unary_columns(first: np.ndarray, count: np.ndarray, total: int, start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """(buffers, 7) what :func:`_read_unary` reads of one stream kind: the index of the set bit after a
    buffer's last value and of its last one, where its first value's predecessor goes and the bit
    before its stream, its stream's end bit, the bound its last set bit must stay under and the one it
    must reach (never failing for a buffer without values); ``start``: in bytes of the kind's streams."""
    has = count > 0
    end = 8 * (start + size)
    return np.stack([first + count, np.maximum(first + count - 1, 0), np.where(has, first, total), 8 * start - 1, end,
                     np.where(has, end, _NEVER), np.where(has, end - 8, -1)], 1)


@dataclass(frozen=True)
class _Batch:
    """Buffers whose every header-level fact was checked on the host, ready for one copy to a device.

    blob: what the device gets, in one copy: ``raw``, then (8-byte aligned) the table and cu, all
    read through :meth:`split`. raw: the buffers' streams regrouped by kind (every buffer's length
    unary stream back to back, then every length low-bit stream, every gap unary stream, every gap
    low-bit stream), then 8 zero bytes (a bit field's window never leaves them); kinds: (5,) where
    each kind starts in raw, and where the last ends. table: (buffers, 34) int64 (above); cu:
    (trajectories + 1,) int64, the batch's trajectory offsets over its rows; nbytes: the buffers'
    own size.
    """

    blob: np.ndarray
    kinds: tuple
    buffers: int
    nbytes: int

    def split(self, blob):
        """``(raw, table, cu)``: views of ``blob``, this batch's blob or its copy on a device."""
        n = self.kinds[-1] + 8
        ints = blob[n + (-n) % 8:].view(torch.int64 if isinstance(blob, torch.Tensor) else np.int64)
        return blob[:n], ints[:self.buffers * _COLUMNS].reshape(-1, _COLUMNS), ints[self.buffers * _COLUMNS:]

    @property
    def raw(self) -> np.ndarray:
        return self.split(self.blob)[0]

    @property
    def table(self) -> np.ndarray:
        return self.split(self.blob)[1]

    @property
    def cu(self) -> np.ndarray:
        return self.split(self.blob)[2]

    @property
    def rows(self) -> int:
        return int(self.table[:, _ROWS].sum())

    @property
    def ids(self) -> int:
        return int(self.table[:, _IDS].sum())

    @property
    def width(self) -> int:
        return int(self.table[:, _WIDTH].max()) if self.buffers else 0

    @property
    def vocab_size(self) -> int:
        return int(self.table[:, _V].max()) if self.buffers else 1

    @property
    def dropped(self) -> bool:
        return bool(self.table[:, _DROP].any())


def _parse(buffers: Sequence, vocab_size: Optional[int], labels: Sequence[str]) -> _Batch:
    """Every check a header allows, per buffer, on the host: nothing data-dependent is left to size
    an array by (the counts of values and bytes each stream holds are all fixed here)."""
    streams, heads, cus, rows, ids, nbytes = [[], [], [], []], [], [np.zeros(1, np.int64)], 0, 0, 0
    for i, buf in enumerate(buffers):
        try:
            raw = _as_bytes(buf)
            h = header_of(raw)
            if vocab_size is not None and vocab_size != h.vocab_size:
                raise CodecError(f"compact support: the rows were coded for V = {h.vocab_size}, this model has {vocab_size}")
            if _crc(raw) != h.crc:
                raise CodecError("compact support: the buffer's CRC-32 does not match its header; corrupted in transit or at rest")
            cu = raw[_HEAD.size:_HEAD.size + 8 * (h.trajectories + 1)].view("<i8").astype(np.int64)
            if cu.size == 0 or cu[0] != 0 or bool(np.any(np.diff(cu) < 0)) or cu[-1] != h.rows:
                raise CodecError(f"compact support: trajectory offsets are not 0 .. {h.rows} non-decreasing; a corrupted buffer")
            len_high, len_low, gap_high, gap_low = h.streams
            if -(-h.rows * h.length_bits // 8) != len_low:
                raise CodecError(f"compact support: the length low-bit stream holds {len_low} bytes where its fields need "
                                 f"{-(-h.rows * h.length_bits // 8)}; a corrupted buffer")
            if h.rows > 8 * len_high or h.ids > 8 * gap_high or h.ids > h.rows * h.max_length:
                # Each value takes at least one unary bit, each row at most max_length ids: bounds every array.
                raise CodecError(f"compact support: the header says {h.rows} rows and {h.ids} ids, the streams hold at most "
                                 f"{8 * len_high} and {min(8 * gap_high, h.rows * h.max_length)}; a corrupted buffer")
            if h.max_length > min(h.vocab_size, h.ids + h.dropped):
                # A row holds at most every coded id (and its dropped sampled token): the width sizes each
                # fixed-width decode (rows x width), so it is held to what the gap stream holds.
                raise CodecError(f"compact support: row width {h.max_length} exceeds V = {h.vocab_size} or the "
                                 f"{h.ids} ids the rows hold{' plus the sampled token' if h.dropped else ''}; a "
                                 f"corrupted buffer")
            for count, size, what in ((h.rows, len_high, "length"), (h.ids, gap_high, "gap")):
                if count == 0 and size:
                    raise CodecError(f"compact support: the {what} stream holds {size} bytes for no value; a corrupted buffer")
        except CodecError as exc:
            raise CodecError(f"{labels[i] + ': ' if labels else ''}{exc}") from None
        at = _HEAD.size + 8 * (h.trajectories + 1)
        for kind, size in enumerate(h.streams):
            streams[kind].append(raw[at:at + size])
            at += size
        heads.append([h.length_bits, h.vocab_size, int(h.dropped), h.max_length, rows, h.rows, h.ids, ids])
        cus.append(cu[1:] + rows)
        rows, ids, nbytes = rows + h.rows, ids + h.ids, nbytes + raw.size
    if ids >= 2**32:  # each step below 2**31: their sums stay inside int64
        raise CodecError(f"compact support: {ids} ids in one batch, more than the 2**32 - 1 one decode takes; decode "
                         f"its buffers in parts")
    sizes = np.array([[s.size for s in kind] for kind in streams], np.int64).reshape(4, -1).T  # (buffers, 4)
    kinds = np.concatenate([[0], np.cumsum(sizes.sum(0))])
    offsets = kinds[:4] + np.cumsum(sizes, 0) - sizes  # each stream's offset in raw
    lb, V, drop, width, first_row, count, coded, first_id = np.asarray(heads, np.int64).reshape(-1, 8).T
    table = np.concatenate([
        np.stack([lb, V, drop, width, first_row, V - drop, (1 << lb) - 1, 8 * offsets[:, 1], 8 * offsets[:, 3],
                  count, coded, first_row + count], 1),
        offsets, sizes,
        _unary_columns(first_row, count, rows, offsets[:, 0] - kinds[0], sizes[:, 0]),
        _unary_columns(first_id, coded, ids, offsets[:, 2] - kinds[2], sizes[:, 2])], 1)
    ints = np.concatenate([table.reshape(-1), *cus])
    n = int(kinds[-1]) + 8
    blob = np.zeros(n + (-n) % 8 + 8 * ints.size, np.uint8)
    np.concatenate([s for kind in streams for s in kind] + [np.zeros(8, np.uint8)], out=blob[:n])
    blob[n + (-n) % 8:] = ints.view(np.uint8)
    return _Batch(blob, tuple(int(k) for k in kinds), len(table), nbytes)


# ---------------------------------------------------------------------------- decode: array steps, any device
def _exclusive(t: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums with the total appended: ``(n + 1,)``."""
    return torch.cat([t.new_zeros(1), torch.cumsum(t, 0)])


def _segments(sizes: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) the segment of each element of segments sized ``sizes`` (their sum, ``total``, read on
    the host from headers: no device sync)."""
    return torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), sizes, output_size=total)


def _rice(universe: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """:func:`rice_parameter` as torch operations."""
    q = torch.clamp((universe - m) // (m + 1), min=1)
    return torch.frexp(q.to(torch.float64))[1].to(torch.int64) - 1  # exact: q < 2**53


_BIT_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)  # a byte's bits, most significant first
_BYTE_SHIFTS = torch.tensor([24, 16, 8, 0], dtype=torch.int64)  # four bytes as a big-endian word
_CONSTANTS: dict = {}  # device -> both, there


def _constants(device: torch.device) -> tuple:
    got = _CONSTANTS.get(device)
    if got is None:
        got = _CONSTANTS[device] = (_BIT_SHIFTS.to(device), _BYTE_SHIFTS.to(device))
    return got


def _set_bits(section: torch.Tensor, total: int) -> torch.Tensor:
    """(total + 1,) int64: where the set bits of ``section`` (one stream kind, ``total`` values) lie,
    found by ``nonzero_static`` (no host read); set bits missing from it, and a spare last slot, read
    as its end."""
    shifts, _ = _constants(section.device)
    bits = ((section.unsqueeze(1) >> shifts) & 1).reshape(-1)
    return nonzero_static(bits, total + 1, fill_value=bits.numel())


def _read_unary(ones: torch.Tensor, columns: torch.Tensor, total: int):
    """The ``total`` unary values of one stream kind from its :func:`_set_bits` ``ones``;
    ``columns``: (buffers, 7) the kind's :func:`_unary_columns`.

    Returns ``(values (total,), count flag (buffers,), padding flag (buffers,))``. A value is the
    distance between consecutive set bits, in bounds whatever the bits hold. The count flag: a
    buffer's stream does not hold exactly its count of set bits (checked as: the set bits before
    each stream's end are as many as the counts up to it); the padding flag: its last set bit is
    not in its last byte.
    """
    after, last = ones.index_select(0, columns[:, 0]), ones.index_select(0, columns[:, 1])
    prev = torch.cat([ones.new_full((1,), -1), ones[:-1]])  # its last slot spare, for empty streams
    prev.scatter_(0, columns[:, 2], columns[:, 3])
    return (ones - prev - 1)[:total], (after < columns[:, 4]) | (last >= columns[:, 5]), last < columns[:, 6]


def _windows(raw: torch.Tensor) -> torch.Tensor:
    """At every 4-byte boundary of ``raw`` (which ends in 8 zero bytes), the 8 bytes from there as one
    big-endian int64: a field of at most 31 bits lies in the window of its first bit's word."""
    _, shifts = _constants(raw.device)
    pad = torch.cat([raw, raw.new_zeros(-raw.numel() % 4)]) if raw.numel() % 4 else raw
    words = (pad.reshape(-1, 4).to(torch.int64) << shifts).sum(1)
    return (words[:-1] << 32) | words[1:]


def _read_fields(windows: torch.Tensor, bit: torch.Tensor, widths: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """The fields of ``widths`` bits (<= 31, ``masks`` their ``2**w - 1``) at absolute bits ``bit``;
    int64. The window's index is clamped: a corrupted stream reads its neighbour's bits, never
    outside the tensor. An arithmetic shift brings copies of the sign bit in at the top; the mask
    drops them."""
    window = windows.index_select(0, torch.clamp(bit >> 5, 0, windows.numel() - 1))
    return (window >> (64 - (bit & 31) - widths)) & masks


@dataclass
class _Decoded:
    """One batch's decode, every index in bounds, and its data-dependent checks as device flags.

    cu: the batch's trajectory offsets on the device; lengths, buf_row, universe (rows,): each row's length, buffer and the ids it is coded among;
    row_of, col, ids (coded ids,): each coded id's row, column and id; put (rows,): the column
    of a dropped sampled token (-1 where none goes in); sampled (rows,) or None; flags: check
    name -> (buffers,) or (rows,) bool; details: what the error of a failed check names.
    """

    batch: _Batch
    cu: torch.Tensor
    lengths: torch.Tensor
    buf_row: torch.Tensor
    universe: torch.Tensor
    row_of: torch.Tensor
    col: torch.Tensor
    ids: torch.Tensor
    put: torch.Tensor
    sampled: Optional[torch.Tensor]
    flags: dict
    details: dict

    def any_flag(self) -> torch.Tensor:
        """0-d bool: some check failed (no host read)."""
        return torch.cat([f.reshape(-1) for f in self.flags.values()]).any()

    def failed(self) -> list:
        """The names of the checks that failed, in order: one host read."""
        bad = torch.stack([f.any() for f in self.flags.values()]).tolist()
        return [name for name, b in zip(self.flags, bad) if b]

    def place(self, starts: Optional[torch.Tensor], total: int, width: int = 0) -> torch.Tensor:
        """(total,) int32: the members at ``starts[row] + column`` (``row * width + column`` without
        ``starts``), -1 elsewhere; a spare last slot takes what a corrupted batch would put out of range."""
        flat = torch.full((total + 1,), -1, dtype=torch.int32, device=self.lengths.device)
        first = self.row_of * width if starts is None else starts.index_select(0, self.row_of)
        flat.scatter_(0, torch.clamp(first + self.col, 0, total), self.ids.to(torch.int32))
        if self.sampled is not None:
            first = torch.arange(self.lengths.numel(), device=flat.device) * width if starts is None else starts
            at = torch.where(self.put >= 0, torch.clamp(first + self.put, 0, total), total)
            flat.scatter_(0, at, self.sampled.to(torch.int32))
        return flat[:total]


def _host_to(t: Union[np.ndarray, torch.Tensor], device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; from the host to a CUDA device through pinned memory, so the copy joins the
    stream instead of waiting for every kernel queued before it (what a copy from pageable memory does)."""
    t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _decode(batch: _Batch, sampled: Optional[torch.Tensor], device, *, lengths_only: bool = False) -> _Decoded:
    """The array steps of the module doc over every buffer of ``batch`` at once, on ``device``
    (``lengths_only``: the rows' lengths and their checks, no id decoded).

    One copy to the device (the streams and the table); sizes come from the headers (host), so
    nothing here waits for the device: the checks that depend on the bits are flags
    (``_Decoded.flags``), and every index is clamped into its tensor, so a corrupted batch decodes
    to garbage inside its tensors, flagged.
    """
    raw, t, cu = batch.split(_host_to(batch.blob, device))
    dev, windows, k = raw.device, _windows(raw), batch.kinds
    R, I = batch.rows, batch.ids
    buf_row = _segments(t[:, _ROWS], R)
    per_row = t[:, :_ROWS].index_select(0, buf_row)  # what each row takes from its buffer
    lb, V, drop, universe = per_row[:, _LB], per_row[:, _V], per_row[:, _DROP], per_row[:, _UNIVERSE]
    flags, details = {}, {}

    # Lengths: unary high parts, then lb low bits a row, back to back.
    high, flags["length count"], flags["length padding"] = _read_unary(_set_bits(raw[k[0]:k[1]], R),
                                                                           t[:, _LEN_UNARY:_GAP_UNARY], R)
    in_buf = torch.arange(R, device=dev) - per_row[:, _FIRST_ROW]
    # Clamped where no row reaches (lengths <= V < 2**31): a corrupted stream's value cannot overflow.
    lengths = (high.clamp_(max=_MAX_V) << lb) | _read_fields(windows, per_row[:, _LEN_LOW] + in_buf * lb, lb, per_row[:, _MASK])
    flags["row width"] = (lengths > per_row[:, _WIDTH]) | (lengths < 0)  # < 0: set bits missing from the stream
    details["row width"] = lengths
    lengths = lengths.clamp(min=0)
    if lengths_only:
        none = lengths.new_zeros(0)
        return _Decoded(batch, cu, lengths, buf_row, universe, none, none, none, torch.full_like(lengths, -1), None, flags,
                        details)
    m = lengths - drop * (lengths > 0)
    row_start = _exclusive(m)  # each row's first coded id, then their total
    first_row, end_row = t[:, _FIRST_ROW], t[:, _END_ROW]  # a buffer's first row, the row after its last
    coded_sum = row_start.index_select(0, end_row) - row_start.index_select(0, first_row)
    flags["id count"] = coded_sum != t[:, _IDS]
    details["id count"] = coded_sum
    row_start = row_start.clamp(max=I)

    # Each coded id's row: every row marks the id it starts at (the last of the rows starting there
    # owns it: the ones before are empty), and a running maximum carries the mark; in bounds
    # whatever the lengths say.
    marks = torch.zeros(I + 1, dtype=torch.int64, device=dev)
    marks.scatter_reduce_(0, row_start[:-1], torch.arange(R, device=dev), "amax")
    row_of = torch.cummax(marks[:I], 0).values if I else marks[:0]

    # A row's gaps share its Rice parameter b; their low bits run from the row's first one, in a
    # buffer's stream that starts on a byte.
    b = _rice(universe, m)
    low = _exclusive(m * b)
    low_bits = low.index_select(0, end_row) - low.index_select(0, first_row)
    flags["gap low size"] = (low_bits + 7) // 8 != t[:, _SIZE + 3]
    details["gap low size"] = low_bits
    low_at = per_row[:, _GAP_LOW] + low[:-1] - low.index_select(0, per_row[:, _FIRST_ROW]) - row_start[:-1] * b
    far = torch.full_like(m, _NEVER) if sampled is None else torch.where(drop > 0, sampled, _NEVER)
    # One gather of what each id needs from its row: b, its mask, its low bits' origin, its first id, the dropped token.
    per_id = torch.stack([b, (1 << b) - 1, low_at, row_start[:-1], far], 1).index_select(0, row_of)
    b_id, j = per_id[:, 0], torch.arange(I, device=dev)
    high, flags["gap count"], flags["gap padding"] = _read_unary(_set_bits(raw[k[2]:k[3]], I),
                                                                         t[:, _GAP_UNARY:_COLUMNS], I)
    # Each id's step from the one before (its gap + 1), clamped where no gap reaches (U < 2**31), so
    # that no sum overflows: a corrupted row still rises, its last id past U.
    steps = (high.clamp_(max=_MAX_V) << b_id) + _read_fields(windows, per_id[:, 2] + j * b_id, b_id, per_id[:, 1]) + 1
    steps = _exclusive(steps.clamp_(max=_MAX_V + 1))
    coded = steps[1:] - steps.index_select(0, row_start[:-1]).index_select(0, row_of) - 1

    # Ids rise within a row once the counts hold (every gap >= 0): a row's first and last bound it.
    ends = torch.stack([row_start[:-1], row_start[1:] - 1], 1).clamp(0, max(I - 1, 0))
    ends = coded.index_select(0, ends.reshape(-1)).reshape(-1, 2) if I else ends
    flags["id range"] = (m > 0) & ((ends[:, 0] < 0) | (ends[:, 1] >= universe))
    details["id range"] = torch.where(ends[:, 0] < 0, ends[:, 0], ends[:, 1])

    # The sampled token goes back into a row that dropped it, at its sorted place.
    col = j - per_id[:, 3]
    put = torch.full_like(lengths, -1)
    if sampled is not None:
        flags["sampled range"] = (sampled < 0) | (sampled >= V)
        above = coded >= per_id[:, 4]
        coded, col = coded + above, col + above
        below = m - torch.zeros_like(m).index_add_(0, row_of, above.to(torch.int64))
        put = torch.where((drop > 0) & (lengths > 0), below, -1)
    return _Decoded(batch, cu, lengths, buf_row, universe, row_of, col, coded, put, sampled, flags, details)


def _decode_fused(batch: _Batch, sampled: Optional[torch.Tensor], device: torch.device, width: int):
    """What :func:`_decode` and :meth:`_Decoded.place` give, fixed-width, by the two kernels of
    :mod:`~nemo_replay.support.fused`: ``(values (rows, width) int32, flags (9,) int32, cu)``, no host read."""
    raw, t, cu = batch.split(_host_to(batch.blob, device))
    k = batch.kinds
    ones_len, ones_gap = _set_bits(raw[k[0]:k[1]], batch.rows), _set_bits(raw[k[2]:k[3]], batch.ids)
    values, flags = _fused.decode_fixed(raw, t, ones_len, ones_gap, sampled, width)
    return values, flags, cu


def fused_decode_serves(device: torch.device) -> bool:
    """Whether :meth:`CompactRows.decode` decodes on ``device`` with the fused kernels by default: they
    are available there (:func:`~nemo_replay.support.fused.available`: switched on, CUDA, Triton) and
    passed their check on that device (:func:`_fused_passes`)."""
    return _fused.available(device) and _fused_passes(device)


@functools.lru_cache(maxsize=None)
def _fused_passes(device: torch.device) -> bool:
    """Whether the fused kernels decode a known batch on ``device`` to the reference's rows: run once
    a process and device before they serve by default. Both compiled forms are checked: with sampled
    ids (a batch that dropped them) and without (NeMo-RL's and verl's batches keep theirs in the
    rows). A Triton that cannot compile them, or compiles them wrongly, is named in a warning and
    the reference serves instead: the same rows, with more launches."""
    rows = RaggedSupport.from_rows([[[1, 5, 9], [4], []], [[0, 2, 3, 7, 8, 9]]])
    tokens = torch.tensor([5, 4, 6, 9])
    kept, dropped = encode_support(rows, vocab_size=10), encode_support(rows, vocab_size=10, sampled_ids=tokens)
    failed = ""
    for buffers, sampled in (([kept, dropped], torch.cat([tokens, tokens]).to(device)), ([kept, kept], None)):
        batch, form = _parse(buffers, None, ()), "with sampled ids" if sampled is not None else "without sampled ids"
        R, width = batch.rows, batch.width
        try:
            values, flags, _ = _decode_fused(batch, sampled, device, width)
            want = _decode(batch, sampled, device).place(None, R * width, width).reshape(R, width)
            if not torch.equal(values, want) or bool(flags.any()):
                failed = f"{form}, rows that differ from the reference's"
        except Exception as exc:  # a compiler's or a driver's error: named below, never swallowed silently
            failed = f"{form}, {type(exc).__name__}: {exc}"
        if failed:
            break
    if failed:
        import warnings

        import triton

        warnings.warn(f"nemo_replay: the fused compact decode failed its check on {device} (Triton {triton.__version__}: "
                      f"{failed[:300]}); CompactRows decode with the reference's steps there (the same rows, more kernel "
                      f"launches). {_fused.SWITCH}=0 skips the check.", RuntimeWarning, stacklevel=3)
    return not failed


# ---------------------------------------------------------------------------- decode: named errors
_PER_ROW = ("row width", "id range", "sampled range")  # the other flags are one a buffer


def _stream_facts(batch: _Batch, i: int, kind: int) -> tuple:
    """Buffer ``i``'s unary stream ``kind`` (0: lengths, 2: gaps), read on the host: its set bits and
    how many bits run past the last one."""
    at, size = int(batch.table[i, _AT + kind]), int(batch.table[i, _SIZE + kind])
    ones = np.flatnonzero(np.unpackbits(batch.raw[at:at + size]))
    return ones.size, 8 * size - 1 - (int(ones[-1]) if ones.size else -1)


def _raise_named(d: _Decoded, name: str, labels: Sequence[str]) -> None:
    """Name the first failure of check ``name`` (host reads: the failure path only)."""
    t = d.batch.table
    j = int(torch.nonzero(d.flags[name].cpu())[0])
    i = int(np.repeat(np.arange(len(t)), t[:, _ROWS])[j]) if name in _PER_ROW else j  # the row's buffer
    row = j - int(t[i, _FIRST_ROW])
    if name in ("length count", "length padding", "gap count", "gap padding"):
        what, kind, count = ("length", 0, t[i, _ROWS]) if name.startswith("length") else ("gap", 2, t[i, _IDS])
        pop, past = _stream_facts(d.batch, i, kind)
        msg = (f"the {what} stream holds {pop} values, the header says {int(count)}" if name.endswith("count") else
               f"the {what} stream runs {past} bits past its last value")
    elif name == "row width":
        msg = f"row {row} decodes to {int(d.details['row width'][j])} ids, past the header's row width {int(t[i, _WIDTH])}"
    elif name == "id count":
        msg = f"the lengths give {int(d.details['id count'][i])} ids, the header says {int(t[i, _IDS])}"
    elif name == "gap low size":
        need = -(-int(d.details["gap low size"][i]) // 8)
        msg = f"the gap low-bit stream holds {int(t[i, _SIZE + 3])} bytes where its fields need {need}"
    elif name == "id range":
        msg = f"row {row} decodes id {int(d.details['id range'][j])}, past the {int(d.universe[j])} ids it is coded among"
    else:  # sampled range
        raise CodecError(f"{labels[i] + ': ' if labels else ''}compact support: sampled token {int(d.sampled[j])} of "
                         f"row {row} is outside [0, {int(t[i, _V])})")
    raise CodecError(f"{labels[i] + ': ' if labels else ''}compact support: {msg}; a corrupted buffer")


def _check(d: _Decoded, labels: Sequence[str]) -> None:
    """Read every flag of ``d`` at once (one host read) and raise for the first set one, in the decode's order."""
    failed = d.failed()
    if failed:
        _raise_named(d, failed[0], labels)


def _sampled_arg(sampled_ids, rows: int, dropped: bool, device) -> Optional[torch.Tensor]:
    if sampled_ids is None:
        if dropped:
            raise CodecError("compact support: the rows were coded without their sampled tokens; pass sampled_ids "
                             "(the tokens sampled from them, one per row)")
        return None
    sampled = torch.as_tensor(sampled_ids)
    if not is_integer(sampled):
        raise CodecError(f"compact support: sampled_ids have dtype {sampled.dtype}, expected integer token ids; "
                         f"pass the response's token ids as they came (torch.long)")
    if sampled.shape != (rows,):
        raise CodecError(f"compact support: sampled_ids has shape {tuple(sampled.shape)}, expected ({rows},): one per row")
    return sampled.to(device=device, dtype=torch.int64)


def decode_batch(
    buffers: Sequence,
    *,
    sampled_ids: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    device=None,
    labels: Sequence[str] = (),
) -> RaggedSupport:
    """The rows of several buffers, back to back (their trajectories in order), decoded at once.

    Args:
        buffers: what :func:`encode_support` wrote, one or more.
        sampled_ids: (rows,) the sampled tokens of every row, in order; required when an encoder
            dropped them; given for rows coded with them, each non-empty row must hold its own.
        vocab_size: when given, every buffer's ``V`` must equal it.
        device: where the decode runs and the rows go (default CPU); one host read of the checks.
        labels: one name per buffer, prefixed to its errors.

    Raises:
        CodecError (a ValueError) for a buffer that is not one the encoder wrote (module doc);
        SupportAlignmentError (a ValueError) for a sampled token missing from its row.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    batch = _parse(buffers, vocab_size, labels)
    sampled = _sampled_arg(sampled_ids, batch.rows, batch.dropped, device)
    d = _decode(batch, sampled, device)
    _check(d, labels)
    kept = torch.from_numpy(batch.table[:, _DROP] == 0).to(device)
    starts = _exclusive(d.lengths)
    members = d.place(starts[:-1], int(starts[-1]))
    if sampled is not None and bool(kept.any()):
        # Coded with the sampled tokens in: each non-empty row must hold its own (docs/design.md §2).
        buf_row = d.buf_row
        hit = torch.zeros_like(d.lengths).index_add_(0, d.row_of, (d.ids == sampled[d.row_of]).to(torch.int64)) > 0
        missing = torch.nonzero((d.lengths > 0) & ~hit & kept[buf_row]).flatten()
        if missing.numel():
            r = int(missing[0])
            i = int(buf_row[r])
            row = members[int(starts[r]):int(starts[r + 1])]
            cu = torch.from_numpy(batch.cu)
            raise SupportAlignmentError(
                f"{labels[i] + ': ' if labels else ''}compact support: {describe_row(cu, r)}: sampled token "
                f"{int(sampled[r])} is not a member of its support row {row[:16].tolist()}; rows and tokens are "
                f"misaligned -- pass this response's own token ids")
    out = RaggedSupport(members, starts, torch.from_numpy(batch.cu.astype(np.int32)))
    record_checked(out, batch.vocab_size)
    return out


def row_lengths(buf: Union[np.ndarray, bytes, torch.Tensor]) -> np.ndarray:
    """(rows,) int64: each row's number of ids, from the length streams alone (no id is decoded).

    Raises:
        CodecError as :func:`decode_support` for a buffer whose header or lengths do not decode.
    """
    d = _decode(_parse([buf], None, ()), None, torch.device("cpu"), lengths_only=True)
    _check(d, ())
    return d.lengths.numpy()


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
        device: where the decode runs and the rows go (default CPU).

    Raises:
        CodecError (a ValueError) for a buffer that is not one the encoder wrote (module doc);
        SupportAlignmentError (a ValueError) for a sampled token missing from its row.
    """
    return decode_batch([buf], sampled_ids=sampled_ids, vocab_size=vocab_size, device=device)


# ---------------------------------------------------------------------------- decode: where the scorer runs
class DecodedRows(PackedTensor):
    """Fixed-width rows ``(rows, width)`` decoded on a device from :class:`CompactRows`, -1 padded, whose
    data-dependent checks are still a device flag (``decode_flag``, 0-d bool).

    The scorer reads the flag with its other guards in its one host read and, when it is set,
    :meth:`raise_decode_error` names the buffer and what is wrong. Until then the rows may be
    garbage, but every index the decode formed stayed inside its tensor (docs/design.md §2).

    Args:
        values: (rows, width) int32; cu_seqlens: (trajectories + 1,) int32, on the same device.
        decode_flag: 0-d bool, set when a check failed.
        name_failure: called on the failure path; raises the named error.
    """

    def __init__(self, values: torch.Tensor, cu_seqlens: torch.Tensor, decode_flag: torch.Tensor, name_failure):
        # The offsets were checked on the host (:func:`_parse`): PackedTensor's own check would read the device.
        self.values, self.cu_seqlens = values, cu_seqlens
        self._name_failure = name_failure
        self.decode_flag: Optional[torch.Tensor] = decode_flag

    def raise_decode_error(self) -> None:
        """Raise the named :class:`CodecError` of the first failed check (host reads: the failure path)."""
        self._name_failure()

    def check(self) -> None:
        """Read the flag now (one host read) and raise when it is set; the scorer then skips it."""
        if self.decode_flag is not None and bool(self.decode_flag):
            self.raise_decode_error()
        self.decode_flag = None


class CompactRows:
    """Several compact buffers as one batch of rows (their trajectories back to back), kept compact
    until the scorer's entry point decodes them on the device it runs on
    (:func:`~nemo_replay.scoring.entry.score_positions`, docs/design.md §2).

    Everything a header says is checked here, on the host (magic, version, sizes, CRC-32,
    trajectory offsets): the rest is the decode's device flag.

    Args:
        buffers: what :func:`encode_support` wrote, one or more.
        sampled_ids: (rows,) every row's sampled token, needed when an encoder dropped them.
        labels: one name per buffer for its errors (for example the caller's sample).
        width: decode to at least this many columns (rows captured at a fixed width score bit for
            bit as those rows when decoded as wide).
    """

    def __init__(self, buffers: Sequence, *, sampled_ids: Optional[torch.Tensor] = None, labels: Sequence[str] = (),
                 width: Optional[int] = None):
        if labels and len(labels) != len(buffers):
            raise ValueError(f"CompactRows: {len(labels)} labels for {len(buffers)} buffers; give one per buffer or none")
        self.labels, self._width = tuple(labels), width
        self._batch = _parse(list(buffers), None, self.labels)
        self._sampled = _sampled_arg(sampled_ids, self._batch.rows, self._batch.dropped, None)

    @property
    def num_rows(self) -> int:
        return self._batch.rows

    @property
    def width_bound(self) -> int:
        """The decoded rows' width: the widest row, or the ``width`` asked when that is wider."""
        return max(self._batch.width, self._width or 0, 1)

    def rows_of(self, i: int) -> int:
        """The rows buffer ``i`` holds (its header)."""
        return int(self._batch.table[i, _ROWS])

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.from_numpy(self._batch.cu)

    @property
    def nbytes(self) -> int:
        return self._batch.nbytes

    def decode(self, device, *, check: bool = False, fused: Optional[bool] = None) -> DecodedRows:
        """The rows on ``device`` as :class:`DecodedRows`: one copy to the device (the streams, a table
        of their headers and the trajectory offsets; the sampled ids too where they are on the host),
        array steps there, no host read; with ``check``, the decode's flag read at once (one host
        read: for a caller that reads the rows before the scorer does).

        ``fused``: None decodes with :mod:`~nemo_replay.support.fused`'s two kernels on CUDA where
        Triton imports (``NEMO_REPLAY_FUSED_DECODE=0`` turns them off) and with the reference's
        array steps elsewhere; True always with the kernels (on the CPU, under Triton's interpreter,
        ``TRITON_INTERPRET=1``); False always with the reference. Both give the same rows and flags.
        """
        device = torch.device(device)
        sampled = None if self._sampled is None else _host_to(self._sampled, device)
        R, width = self._batch.rows, self.width_bound
        if fused is None:
            fused = fused_decode_serves(device)
        elif fused and not _fused.importable():
            raise ValueError("CompactRows.decode(fused=True) needs Triton (pip install triton); pass fused=None to "
                             "decode with the kernels where they run and the reference elsewhere")
        if fused:
            values, flags, cu = _decode_fused(self._batch, sampled, device, width)
            flag, name = flags.any(), functools.partial(self._name_fused, sampled, device, flags)
        else:
            d = _decode(self._batch, sampled, device)
            values, cu = d.place(None, R * width, width).reshape(R, width), d.cu
            flag, name = d.any_flag(), functools.partial(_check, d, self.labels)
        out = DecodedRows(values, cu.to(torch.int32), flag, name)
        record_checked(out, self._batch.vocab_size)  # what the decode guarantees once its flag reads clear
        if check:
            out.check()
        return out

    def to(self, device) -> DecodedRows:
        """The rows decoded on ``device`` (:meth:`decode`): compact rows decode where they are moved to."""
        return self.decode(device)

    def _name_fused(self, sampled: Optional[torch.Tensor], device: torch.device, flags: torch.Tensor) -> None:
        """Name what the fused decode flagged by rerunning the reference, which sets the same flags."""
        _check(_decode(self._batch, sampled, device), self.labels)
        names = [name for name, bad in zip(_fused.FLAGS, flags.tolist()) if bad]
        raise RuntimeError(f"compact support: the fused decode flagged {names}, the reference decode finds every check "
                           f"holds; decode with the reference (NEMO_REPLAY_FUSED_DECODE=0) and report this batch")

    def __repr__(self) -> str:
        return (f"CompactRows(buffers={self._batch.buffers}, rows={self.num_rows}, width={self.width_bound}, "
                f"bytes={self.nbytes})")
