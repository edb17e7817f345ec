"""The compact codec's encoder: a batch's rows into one buffer (the layout:
:mod:`nemo_replay.support.codec`)."""

from __future__ import annotations

import struct
import zlib
from typing import Optional, Union

import numpy as np
import torch

from nemo_replay.support.codec.header import CRC_AT, DROPPED, HEAD, MAGIC, MAX_V, VERSION, rice_parameter
from nemo_replay.support.dtypes import first_outside, is_integer
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport, is_support

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
    """The rows of ``support`` as one uint8 buffer (the layout: :mod:`nemo_replay.support.codec`).

    Args:
        support: the batch's rows (fixed-width rows are read as their members).
        vocab_size: ``V``; every id must lie below it.
        sampled_ids: (rows,) the token sampled from each row; given, it is dropped from its row
            (each non-empty row must hold it) and the decoder needs the same tokens back.

    Raises:
        ValueError naming the row: an id outside ``[0, V)``, an id twice in a row, a non-empty
        row without its sampled token.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= MAX_V:
        raise ValueError(f"encode_support: vocab_size={vocab_size!r}, expected an int in [1, 2**31 - 1]")
    ids, offsets, cu = _rows(support, "encode_support")
    lengths = np.diff(offsets)
    row_of = np.repeat(np.arange(offsets.size - 1, dtype=np.int64), lengths)
    ids = _sorted_sets(ids, row_of, vocab_size)
    coded, universe = ids, vocab_size
    if sampled_ids is not None:
        coded, row_of = _drop_sampled(ids, row_of, lengths, sampled_ids)
        universe = vocab_size - 1
    lb, streams = _streams(coded, row_of, lengths, universe)
    n = lengths.size
    fields = [MAGIC, VERSION, DROPPED if sampled_ids is not None else 0, lb, 0, vocab_size, n, int(coded.size),
              cu.size - 1, int(lengths.max()) if n else 0, 0, *(s.size for s in streams)]
    out = np.concatenate([np.frombuffer(HEAD.pack(*fields), np.uint8), cu.astype("<i8").view(np.uint8), *streams])
    out[CRC_AT:CRC_AT + 4] = np.frombuffer(struct.pack("<I", zlib.crc32(out)), np.uint8)
    return out


def _sorted_sets(ids: np.ndarray, row_of: np.ndarray, vocab_size: int) -> np.ndarray:
    """``ids`` (each row's, rows back to back; ``row_of`` their rows) sorted within each row; ValueError
    naming the row for an id outside ``[0, V)`` or an id twice in a row."""
    j = first_outside(ids, vocab_size)
    if j is not None:
        raise ValueError(f"encode_support: row {int(row_of[j])} holds id {int(ids[j])}, outside [0, {vocab_size})")
    key = row_of * vocab_size + ids
    if key.size > 1 and not bool(np.all(key[1:] > key[:-1])):
        order = np.argsort(key, kind="stable")  # rows stay in place: row_of is the same after the sort
        ids, key = ids[order], key[order]
        if bool(np.any(key[1:] == key[:-1])):
            j = int(np.flatnonzero(key[1:] == key[:-1])[0])
            raise ValueError(f"encode_support: row {int(row_of[j])} holds id {int(ids[j])} twice; a support is a set")
    return ids


def _drop_sampled(ids: np.ndarray, row_of: np.ndarray, lengths: np.ndarray, sampled_ids) -> tuple:
    """``(coded, row_of)``: the sorted ``ids`` without each row's sampled token, the ids above it one
    lower (:mod:`nemo_replay.support.codec`), and their rows; ValueError for a wrong shape or a
    non-empty row without it."""
    n = lengths.size
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
    return ids[keep] - (ids[keep] > sampled[row_of[keep]]), row_of[keep]


def _streams(coded: np.ndarray, row_of: np.ndarray, lengths: np.ndarray, universe: int) -> tuple:
    """``(lb, the four streams)``: the lengths Rice coded with one parameter ``lb``, the gaps between
    each row's ``coded`` ids (``row_of`` their rows) with the row's parameter for ``universe``."""
    n = lengths.size
    m = np.bincount(row_of, minlength=n).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(m)[:-1]]) if n else np.zeros(0, np.int64)
    prev = np.empty_like(coded)
    if coded.size:
        prev[1:] = coded[:-1]
        prev[starts[m > 0]] = -1
    gaps = coded - prev - 1
    b = rice_parameter(np.int64(universe), m)[row_of] if coded.size else np.zeros(0, np.int64)
    lb = max(0, int(lengths.mean()).bit_length() - 2) if n else 0  # about log2(0.7 x the mean length)
    return lb, (_unary(lengths >> lb), _fields(lengths & ((1 << lb) - 1), np.full(n, lb, np.int64)),
                _unary(gaps >> b), _fields(gaps & ((np.int64(1) << b) - 1), b))


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

