"""The host's part of a decode: every check a buffer's header allows, and the batch laid out for one
copy to the device (its streams regrouped by kind, and the per-buffer table beside them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from nemo_replay.support.codec.header import HEAD, CodecError, as_bytes, crc, header_of
from nemo_replay.support.codec_table import COLUMNS as _COLUMNS, DROP as _DROP, IDS as _IDS, NEVER as _NEVER
from nemo_replay.support.codec_table import ROWS as _ROWS, V as _V, WIDTH as _WIDTH

def unary_columns(first: np.ndarray, count: np.ndarray, total: int, start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """(buffers, 7) what :func:`_read_unary` reads of one stream kind: the index of the set bit after a
    buffer's last value and of its last one, where its first value's predecessor goes and the bit
    before its stream, its stream's end bit, the bound its last set bit must stay under and the one it
    must reach (never failing for a buffer without values); ``start``: in bytes of the kind's streams."""
    has = count > 0
    end = 8 * (start + size)
    return np.stack([first + count, np.maximum(first + count - 1, 0), np.where(has, first, total), 8 * start - 1, end,
                     np.where(has, end, _NEVER), np.where(has, end - 8, -1)], 1)


@dataclass(frozen=True)
class Batch:
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


def parse_buffers(buffers: Sequence, vocab_size: Optional[int], labels: Sequence[str]) -> Batch:
    """Every check a header allows, per buffer, on the host: nothing data-dependent is left to size
    an array by (the counts of values and bytes each stream holds are all fixed here)."""
    streams, heads, cus, rows, ids, nbytes = [[], [], [], []], [], [np.zeros(1, np.int64)], 0, 0, 0
    for i, buf in enumerate(buffers):
        try:
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
    offsets = kinds[:4] + np.cumsum(sizes, 0) - sizes  # each stream's offset in raw
    lb, V, drop, width, first_row, count, coded, first_id = np.asarray(heads, np.int64).reshape(-1, 8).T
    table = np.concatenate([
        np.stack([lb, V, drop, width, first_row, V - drop, (1 << lb) - 1, 8 * offsets[:, 1], 8 * offsets[:, 3],
                  count, coded, first_row + count], 1),
        offsets, sizes,
        unary_columns(first_row, count, rows, offsets[:, 0] - kinds[0], sizes[:, 0]),
        unary_columns(first_id, coded, ids, offsets[:, 2] - kinds[2], sizes[:, 2])], 1)
    ints = np.concatenate([table.reshape(-1), *cus])
    n = int(kinds[-1]) + 8
    blob = np.zeros(n + (-n) % 8 + 8 * ints.size, np.uint8)
    np.concatenate([s for kind in streams for s in kind] + [np.zeros(8, np.uint8)], out=blob[:n])
    blob[n + (-n) % 8:] = ints.view(np.uint8)
    return Batch(blob, tuple(int(k) for k in kinds), len(table), nbytes)

