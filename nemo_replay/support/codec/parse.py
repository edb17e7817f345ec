"""The host's part of a decode: every check a buffer's header allows, and the batch laid out for one
copy to the device (its streams regrouped by kind, and the per-buffer table beside them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from nemo_replay.support.codec.header import (GAP_LOW, GAP_UNARY, HEAD, LEN_LOW, LEN_UNARY, CodecError, Header,
                                               as_bytes, crc, header_of)

NEVER = 2**62  # a bound no bit position or id reaches


class UnaryColumns:
    """The columns of one unary stream kind in the per-buffer table (:class:`TableColumns`), by name:
    what :func:`~nemo_replay.support.codec.decode.set_bits`' positions are read against, one buffer a row
    (:func:`unary_columns` fills them). Indices among the kind's set bits, positions in bits of the
    kind's streams (every buffer's stream of that kind, back to back)."""

    __slots__ = ()
    after = 0  # the index of the set bit after the buffer's last value (the next buffer's first)
    last = 1  # the index of its last value's set bit
    first = 2  # the index of its first value, whose predecessor is the bit before its stream
    bit_before = 3  # the bit before its stream: its first value counts from there
    end = 4  # its stream's end bit: the set bit after its last value lies at or past it
    last_below = 5  # the bound its last set bit must stay under (its end; never failing without values)
    last_from = 6  # the bound its last set bit must reach (its last byte's first bit; -1 without values)
    count = 7


UNARY = UnaryColumns()


class TableColumns:
    """The per-buffer table's columns, by name: the integers a device decode reads, one row a buffer
    (``table[:, COL.rows]``: every buffer's rows), laid out by :func:`parse_buffers` and read by both
    device decoders (:func:`~nemo_replay.support.codec.decode.decode_steps`,
    :mod:`~nemo_replay.support.codec.fused_kernels`).

    The first ``per_row`` columns are what each row takes from its buffer (the reference gathers them
    a row at a time, and reads the gathered rows with the same names).
    """

    __slots__ = ()
    lb = 0  # the length parameter
    vocab = 1  # V
    drop = 2  # 1 when the sampled ids were dropped
    width = 3  # the row width: the header's longest row
    first_row = 4  # the buffer's first row in the batch
    universe = 5  # the ids a row is coded among: V - drop
    mask = 6  # the length parameter's mask, 2**lb - 1
    len_low_bit = 7  # where the buffer's length low-bit stream starts, in bits of the batch's raw streams
    gap_low_bit = 8  # where its gap low-bit stream starts, likewise
    per_row = 9  # the columns above
    rows = 9  # the rows the buffer holds
    ids = 10  # the ids it codes
    end_row = 11  # the row after its last
    at = 12  # 4 columns, one a stream in the header's order (LEN_UNARY ...): where it starts in raw, in bytes
    size = at + 4  # 4 columns likewise: its size in bytes
    len_ones = size + 4  # UNARY.count columns: the length unary stream's (UnaryColumns)
    gap_ones = len_ones + UNARY.count  # likewise, the gap unary stream's
    count = gap_ones + UNARY.count


COL = TableColumns()


def unary_columns(first: np.ndarray, count: np.ndarray, total: int, start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """(buffers, UNARY.count) int64, one stream kind's :class:`UnaryColumns`: its buffers' ``first`` value
    and ``count`` of values (``total`` in all), ``start`` and ``size`` in bytes of the kind's streams."""
    has = count > 0
    end = 8 * (start + size)
    out = np.zeros((first.size, UNARY.count), np.int64)
    out[:, UNARY.after], out[:, UNARY.last] = first + count, np.maximum(first + count - 1, 0)
    out[:, UNARY.first], out[:, UNARY.bit_before] = np.where(has, first, total), 8 * start - 1
    out[:, UNARY.end], out[:, UNARY.last_below] = end, np.where(has, end, NEVER)
    out[:, UNARY.last_from] = np.where(has, end - 8, -1)
    return out


@dataclass(frozen=True)
class Batch:
    """Buffers whose every header-level fact was checked on the host, ready for one copy to a device.

    blob: what the device gets, in one copy: ``raw``, then (8-byte aligned) the table and cu, all
    read through :meth:`split`. raw: the buffers' streams regrouped by kind (every buffer's length
    unary stream back to back, then every length low-bit stream, every gap unary stream, every gap
    low-bit stream), then 8 zero bytes (a bit field's window never leaves them); kinds: (5,) where
    each kind starts in raw, and where the last ends. table: (buffers, COL.count) int64
    (:class:`TableColumns`); cu:
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
        return blob[:n], ints[:self.buffers * COL.count].reshape(-1, COL.count), ints[self.buffers * COL.count:]

    def section(self, raw, kind: int):
        """Every buffer's stream of ``kind`` (``LEN_UNARY`` ...), back to back: a view of ``raw``."""
        return raw[self.kinds[kind]:self.kinds[kind + 1]]

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
        return int(self.table[:, COL.rows].sum())

    @property
    def ids(self) -> int:
        return int(self.table[:, COL.ids].sum())

    @property
    def width(self) -> int:
        return int(self.table[:, COL.width].max()) if self.buffers else 0

    @property
    def vocab_size(self) -> int:
        return int(self.table[:, COL.vocab].max()) if self.buffers else 1

    @property
    def dropped(self) -> bool:
        return bool(self.table[:, COL.drop].any())


def parse_buffers(buffers: Sequence, vocab_size: Optional[int], labels: Sequence[str]) -> Batch:
    """Every check a header allows, per buffer, on the host: nothing data-dependent is left to size
    an array by (the counts of values and bytes each stream holds are all fixed here)."""
    streams, heads, cus, rows, ids, nbytes = [[], [], [], []], [], [np.zeros(1, np.int64)], 0, 0, 0
    for i, buf in enumerate(buffers):
        try:
            raw, h, cu = _checked(buf, vocab_size)
        except CodecError as exc:
            raise CodecError(f"{labels[i] + ': ' if labels else ''}{exc}") from None
        at = HEAD.size + 8 * (h.trajectories + 1)
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
    table = _table(np.asarray(heads, np.int64).reshape(-1, 8), sizes, kinds, rows, ids)
    ints = np.concatenate([table.reshape(-1), *cus])
    n = int(kinds[-1]) + 8
    blob = np.zeros(n + (-n) % 8 + 8 * ints.size, np.uint8)
    np.concatenate([s for kind in streams for s in kind] + [np.zeros(8, np.uint8)], out=blob[:n])
    blob[n + (-n) % 8:] = ints.view(np.uint8)
    return Batch(blob, tuple(int(k) for k in kinds), len(table), nbytes)


def _checked(buf, vocab_size: Optional[int]) -> tuple[np.ndarray, Header, np.ndarray]:
    """``(raw, header, cu)`` of one buffer whose header passed every check (CodecError naming the first
    that failed): its size, ``V``, CRC-32, trajectory offsets, and the bounds that size every array."""
    raw = as_bytes(buf)
    h = header_of(raw)
    if vocab_size is not None and vocab_size != h.vocab_size:
        raise CodecError(f"compact support: the rows were coded for V = {h.vocab_size}, this model has {vocab_size}")
    if crc(raw) != h.crc:
        raise CodecError("compact support: the buffer's CRC-32 does not match its header; corrupted in transit or at rest")
    cu = raw[HEAD.size:HEAD.size + 8 * (h.trajectories + 1)].view("<i8").astype(np.int64)
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
    return raw, h, cu


def _table(heads: np.ndarray, sizes: np.ndarray, kinds: np.ndarray, rows: int, ids: int) -> np.ndarray:
    """(buffers, COL.count) int64, the per-buffer table (:class:`TableColumns`) filled by name.

    heads: (buffers, 8) int64, each buffer's length parameter, V, drop, row width, first row, rows,
    ids and first id; sizes: (buffers, 4) int64, its streams' sizes in bytes; kinds: (5,) where each
    stream kind starts in raw; rows, ids: the batch's.
    """
    lb, V, drop, width, first_row, count, coded, first_id = heads.T
    offsets = kinds[:4] + np.cumsum(sizes, 0) - sizes  # each stream's offset in raw
    table = np.zeros((len(heads), COL.count), np.int64)
    table[:, COL.lb], table[:, COL.vocab], table[:, COL.drop], table[:, COL.width] = lb, V, drop, width
    table[:, COL.first_row], table[:, COL.universe], table[:, COL.mask] = first_row, V - drop, (1 << lb) - 1
    table[:, COL.len_low_bit], table[:, COL.gap_low_bit] = 8 * offsets[:, LEN_LOW], 8 * offsets[:, GAP_LOW]
    table[:, COL.rows], table[:, COL.ids], table[:, COL.end_row] = count, coded, first_row + count
    table[:, COL.at:COL.at + 4], table[:, COL.size:COL.size + 4] = offsets, sizes
    table[:, COL.len_ones:COL.len_ones + UNARY.count] = unary_columns(
        first_row, count, rows, offsets[:, LEN_UNARY] - kinds[LEN_UNARY], sizes[:, LEN_UNARY])
    table[:, COL.gap_ones:COL.gap_ones + UNARY.count] = unary_columns(
        first_id, coded, ids, offsets[:, GAP_UNARY] - kinds[GAP_UNARY], sizes[:, GAP_UNARY])
    return table
