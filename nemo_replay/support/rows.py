"""Recorded rows and the token columns they belong to: the one carrier from the engine to the scorer
(docs/design.md §2).

A sample's rows are encoded once, where they are recorded, into compact buffers
(:mod:`nemo_replay.support.codec`), and decoded once, where they are scored. Between the two
they travel as a :class:`SampleRows`: the buffers and, in runs, the token column of each row.
Every integration hands a batch of them to :func:`batch_rows`, which checks them on the host
and returns the scorer's rows (:class:`~nemo_replay.support.codec.CompactRows`, decoded by the
scorer on its own device) with the row of every token column. An integration adds only its
framework's coordinates: what a column is (NeMo-RL: the sample's flattened message log; verl:
the response position; TRL: the completion position) and how its batches pad.

Runs are ``(column, row, count)``: rows ``row .. row + count - 1`` of the buffers (their rows
back to back) belong to columns ``column .. column + count - 1``. Columns increase; rows need
not cover every buffer row (a window of a generation, a row left unrecorded). Example, one
buffer of three rows recorded for a sample whose columns 3, 4 and 6 were sampled (column 5
could not be recorded)::

    column   0  1  2 | 3  4  5  6
    row      -  -  - | 0  1  -  2         runs [[3, 0, 2], [6, 2, 1]], length 7

The sampled-id convention is the buffer's own: rows that travel apart from their tokens keep
the sampled ids (a row that drifted from its token then fails the membership check by name);
rows that travel with their tokens may drop them (about a byte a row less), and
:func:`batch_rows` puts back the token at each row's column.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from nemo_replay.support.codec import CompactRows, encode_kept, encode_support, header_of
from nemo_replay.support.codec.header import as_bytes, crc
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["SampleRows", "batch_rows"]

_NO_RUNS = np.zeros((0, 3), np.int32)
# The byte form (SampleRows.to_bytes): magic | version u8 | 3 zero bytes | length u64 | width u32 | runs u32 |
# buffers u32 | CRC-32 u32 of the whole form with these four bytes zero; then each buffer's size (u64), the runs
# ((runs, 3) int32) and the buffers back to back. Little-endian.
BYTES_MAGIC, BYTES_VERSION = b"NRSR", 1
_BYTES_HEAD = struct.Struct("<4sB3xQIIII")
_BYTES_CRC_AT = _BYTES_HEAD.size - 4
_EMPTY = encode_kept(RaggedSupport.from_rows([[]]))  # one trajectory, no row


def _runs_of(columns: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """(n, 3) int32 runs of increasing ``columns`` paired with increasing ``rows``."""
    if not columns.size:
        return _NO_RUNS
    breaks = np.flatnonzero((np.diff(columns) != 1) | (np.diff(rows) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    counts = np.diff(np.concatenate([starts, [columns.size]]))
    return np.stack([columns[starts], rows[starts], counts], 1).astype(np.int32)


@dataclass(frozen=True)
class SampleRows:
    """One sample's recorded rows, compact, with the token column of each (module doc).

    Attributes:
        buffers: the compact buffers (1-D uint8 arrays), their rows back to back.
        runs: (n, 3) int32 ``(column, row, count)``, columns increasing.
        length: the columns the sample spans, ``[0, length)``.
        width: decode to at least this many ids a row (rows captured at a fixed width score bit
            for bit as those rows when decoded as wide); 0 for ragged rows.
    """

    buffers: tuple
    runs: np.ndarray
    length: int
    width: int = 0

    @classmethod
    def encode(cls, rows: Any, sampled_ids: Optional[torch.Tensor] = None, *, start: int = 0, length: Optional[int] = None,
               vocab_size: Optional[int] = None, width: int = 0, where: str = "support rows") -> "SampleRows":
        """Encode a sample's rows where they are recorded: one row a sampled token, in order.

        Args:
            rows: one segment of n rows (a RaggedSupport or a PackedTensor; an empty row is a
                token whose support could not be recorded: it is coded empty and gets no column).
            sampled_ids: (n,) the tokens sampled from them (each recorded row must hold its own);
                may be None only where they are kept (``vocab_size`` None).
            start: the column of the first token; length: the columns spanned (default ``start + n``).
            vocab_size: given, the sampled ids are dropped from their rows (the rows travel with
                their tokens); None keeps them (the rows travel apart, coded for the largest id).
            width: as the attribute.

        Raises:
            ValueError naming ``where`` and the row when a recorded row does not hold its token.
        """
        rows = RaggedSupport.checked_of(rows, where=where)
        n = rows.num_rows
        sampled = None if sampled_ids is None else torch.as_tensor(sampled_ids).reshape(-1)
        if sampled is None and vocab_size is not None:
            raise ValueError(f"{where}: rows coded without their sampled ids (vocab_size given) need sampled_ids")
        if sampled is not None and sampled.numel() != n:
            raise ValueError(f"{where}: {n} support rows for {sampled.numel()} sampled tokens; one row a token")
        recorded = torch.nonzero(rows.row_lengths > 0).flatten()
        one = rows.resegment([0, n])
        if vocab_size is None:
            data = encode_kept(one, sampled, where=where)  # every row, the unrecorded ones empty: errors name row j
        elif recorded.numel() != n:
            raise ValueError(f"{where}: row {int(torch.nonzero(rows.row_lengths == 0)[0])} is empty (not recorded); rows "
                             f"coded without their sampled ids are used whole: leave the token out before it is encoded, "
                             f"or keep the sampled ids (vocab_size=None)")
        else:
            data = encode_support(one, vocab_size=vocab_size, sampled_ids=sampled)
        columns = recorded.numpy().astype(np.int64)
        runs = _runs_of(columns + int(start), columns)
        return cls((data,), runs, int(start) + n if length is None else int(length), int(width))

    @classmethod
    def whole(cls, buffer: np.ndarray, length: int, *, width: int = 0) -> "SampleRows":
        """A buffer whose row j belongs to column j, for every one of its ``length`` rows."""
        runs = np.array([[0, 0, length]], np.int32) if length else _NO_RUNS
        return cls((buffer,), runs, int(length), int(width))

    @classmethod
    def none(cls, length: int) -> "SampleRows":
        """A sample of ``length`` columns without a row (a prompt, a tool's output)."""
        return cls((_EMPTY,), _NO_RUNS, int(length))

    @classmethod
    def placed(cls, buffers: Sequence[np.ndarray], columns: Any, rows: Any, length: int, *, width: int = 0,
               where: str = "support rows") -> "SampleRows":
        """Rows of ``buffers`` (their rows back to back) placed at columns: buffer row ``rows[i]`` belongs to
        column ``columns[i]``; buffer rows not named belong to none (a window a framework cut, a token
        taken out of the loss). Nothing is decoded or encoded.

        Raises:
            ValueError naming ``where``: columns not increasing or outside ``[0, length)``, a row
            outside the buffers' rows or named twice.
        """
        columns = np.asarray(columns, np.int64).reshape(-1)
        rows = np.asarray(rows, np.int64).reshape(-1)
        held = sum(header_of(b).rows for b in buffers)
        if columns.size != rows.size:
            raise ValueError(f"{where}: {columns.size} columns for {rows.size} rows; one column a placed row")
        if columns.size and (int(columns[0]) < 0 or int(columns[-1]) >= length or bool((np.diff(columns) < 1).any())):
            raise ValueError(f"{where}: row columns must increase within [0, {length}), got {columns[:16].tolist()}")
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= held or np.unique(rows).size != rows.size):
            raise ValueError(f"{where}: placed rows {rows[:16].tolist()} must be distinct rows of buffers holding {held}")
        return cls(tuple(buffers) or (_EMPTY,), _runs_of(columns, rows), int(length), int(width))

    @property
    def num_rows(self) -> int:
        """The rows that belong to a column."""
        return int(np.asarray(self.runs)[:, 2].sum(dtype=np.int64))

    def columns(self) -> np.ndarray:
        """(num_rows,) int64: the column of each row that belongs to one, in order."""
        return _expand(np.asarray(self.runs, np.int64), 0)

    def rows(self) -> np.ndarray:
        """(num_rows,) int64: the buffer row (rows back to back) of each column in :meth:`columns`."""
        return _expand(np.asarray(self.runs, np.int64), 1)

    def recorded(self) -> torch.Tensor:
        """(length,) bool: the columns that hold a row (no id is decoded)."""
        out = torch.zeros(self.length, dtype=torch.bool)
        out[torch.from_numpy(self.columns())] = True
        return out

    @property
    def nbytes(self) -> int:
        return int(sum(b.nbytes for b in self.buffers) + np.asarray(self.runs).nbytes)

    def to_bytes(self) -> np.ndarray:
        """The sample as one uint8 buffer (its buffers as they are, the runs beside them, one CRC-32
        over all): for a framework that carries one buffer a sample (verl's ``non_tensor_batch``)."""
        bufs = [as_bytes(b) for b in self.buffers]
        runs = np.ascontiguousarray(np.asarray(self.runs), dtype="<i4").reshape(-1)
        sizes = np.array([b.size for b in bufs], dtype="<u8")
        parts = [sizes.view(np.uint8), runs.view(np.uint8)] + bufs
        out = np.empty(_BYTES_HEAD.size + sum(p.size for p in parts), np.uint8)
        out[:_BYTES_HEAD.size] = np.frombuffer(
            _BYTES_HEAD.pack(BYTES_MAGIC, BYTES_VERSION, self.length, self.width, runs.size // 3, len(bufs), 0), np.uint8)
        at = _BYTES_HEAD.size
        for part in parts:
            out[at:at + part.size] = part
            at += part.size
        out[_BYTES_CRC_AT:_BYTES_CRC_AT + 4] = np.frombuffer(struct.pack("<I", crc(out, _BYTES_CRC_AT)), np.uint8)
        return out

    @classmethod
    def from_bytes(cls, buf: Any, *, where: str = "support rows") -> "SampleRows":
        """The inverse of :meth:`to_bytes`; the compact buffers are views of ``buf``.

        Raises:
            ValueError naming ``where``: not a uint8 buffer, another magic or version, sizes that
            do not add up to the buffer's, a CRC-32 that does not match (a flipped bit).
        """
        try:
            raw = as_bytes(buf)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc} (SampleRows.to_bytes)") from exc
        if raw.size < _BYTES_HEAD.size:
            raise ValueError(f"{where}: {raw.size} bytes, fewer than the {_BYTES_HEAD.size}-byte header of "
                             f"SampleRows.to_bytes; a truncated buffer")
        magic, version, length, width, n_runs, n_bufs, stored = _BYTES_HEAD.unpack(raw[:_BYTES_HEAD.size].tobytes())
        if magic != BYTES_MAGIC or version != BYTES_VERSION:
            raise ValueError(f"{where}: magic {magic!r} version {version}, expected {BYTES_MAGIC!r} version "
                             f"{BYTES_VERSION} (SampleRows.to_bytes); a bare compact buffer whose row j belongs to "
                             f"column j is written as SampleRows.whole(buffer, length).to_bytes()")
        at = _BYTES_HEAD.size + 8 * n_bufs
        sizes = [int(x) for x in np.frombuffer(raw[_BYTES_HEAD.size:at].tobytes(), "<u8")] if at <= raw.size else None
        need = None if sizes is None else at + 12 * n_runs + sum(sizes)  # Python ints: no size wraps
        if need != raw.size:
            raise ValueError(f"{where}: the header describes {need or 'more than'} bytes, the buffer holds {raw.size}; "
                             f"a truncated or corrupted buffer")
        if crc(raw, _BYTES_CRC_AT) != stored:
            raise ValueError(f"{where}: CRC-32 mismatch; the buffer changed after SampleRows.to_bytes wrote it")
        runs = np.frombuffer(raw[at:at + 12 * n_runs].tobytes(), "<i4").reshape(n_runs, 3).astype(np.int32)
        ends = np.cumsum([at + 12 * n_runs] + sizes)
        buffers = tuple(raw[int(a):int(b)] for a, b in zip(ends[:-1], ends[1:]))
        return cls(buffers or (_EMPTY,), runs, int(length), int(width))

    def __getitem__(self, columns: slice) -> "SampleRows":
        """Columns ``[lo, hi)`` as a sample of their own, renumbered from 0, over the same buffers
        (sliced as the framework slices its per-token tensors, e.g. ``logprobs[input_length:total_length]``)."""
        if not isinstance(columns, slice) or columns.step not in (None, 1):
            raise ValueError(f"SampleRows are sliced by a column range, as the per-token tensors are; got {columns!r}")
        lo = 0 if columns.start is None else int(columns.start)
        hi = self.length if columns.stop is None else int(columns.stop)
        if lo < 0 or hi < 0:
            raise ValueError(f"SampleRows[{lo}:{hi}]: column bounds are counted from 0 (no negative index)")
        hi = max(hi, lo)
        col, row = self.columns(), self.rows()
        inside = (col >= lo) & (col < hi)
        return SampleRows(self.buffers, _runs_of(col[inside] - lo, row[inside]), hi - lo, self.width)

    @classmethod
    def cat(cls, parts: Sequence["SampleRows"]) -> "SampleRows":
        """Samples side by side: part j's columns after those of the parts before it. A buffer that
        several parts share (windows of one generation) is held once."""
        buffers, first_row, columns, rows = [], {}, [], []
        offset = 0
        for part in parts:
            base = []
            for buf in part.buffers:
                if id(buf) not in first_row and header_of(buf).rows == 0:
                    first_row[id(buf)] = 0  # holds no row: nothing to keep
                elif id(buf) not in first_row:
                    first_row[id(buf)] = sum(header_of(b).rows for b in buffers)
                    buffers.append(buf)
                base.append(first_row[id(buf)])
            own = np.cumsum([0] + [header_of(b).rows for b in part.buffers])
            r = part.rows()
            which = np.searchsorted(own, r, side="right") - 1  # the part's buffer each row lies in
            rows.append(np.asarray(base, np.int64)[which] + r - own[which] if r.size else r)
            columns.append(part.columns() + offset)
            offset += part.length
        col = np.concatenate(columns) if columns else np.zeros(0, np.int64)
        row = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        return cls(tuple(buffers) or (_EMPTY,), _runs_of(col, row), offset, max((p.width for p in parts), default=0))


def _expand(runs: np.ndarray, field: int) -> np.ndarray:
    """Each run's ``field`` (0: column, 1: row) counted up over its ``count``."""
    if not runs.size:
        return np.zeros(0, np.int64)
    starts, counts = runs[:, field], runs[:, 2]
    first = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return first + np.arange(int(counts.sum()), dtype=np.int64)


def _check_runs(s: Any, label: str, limit: int, width: int, held: int) -> None:
    """Sample ``s``'s runs against its bounds, before a column is made (a run's count sizes what
    :meth:`SampleRows.columns` allocates): integer ``(column, row, count >= 1)``, columns increasing
    below ``min(limit, width)``, rows inside the ``held`` rows of its buffers."""
    runs = np.asarray(s.runs)
    if runs.dtype.kind not in "iu" or runs.ndim != 2 or runs.shape[1] != 3 or (runs.size and int(runs[:, 2].min()) < 1):
        raise ValueError(f"{label}: runs of dtype {runs.dtype}, shape {runs.shape}; expected (n, 3) integer "
                         f"(column, row, count >= 1) as SampleRows.encode writes them")
    if not runs.size:
        return
    runs = runs.astype(np.int64)
    col, row, count = runs[:, 0], runs[:, 1], runs[:, 2]
    bound = min(int(limit), width)
    if int(col[0]) < 0 or bool((col[1:] < col[:-1] + count[:-1]).any()) or int(col[-1] + count[-1]) > bound:
        raise ValueError(f"{label}: row columns from {int(col[0])} to {int(col[-1] + count[-1]) - 1} in {len(runs)} "
                         f"runs must increase and lie below the sample's {bound} token columns ({limit} tokens, a batch "
                         f"of {width} columns): the rows belong to another sample (reordered apart from the tokens?)")
    if int(row.min()) < 0 or int((row + count).max()) > held:
        raise ValueError(f"{label}: runs name rows up to {int((row + count).max()) - 1} of buffers holding {held}; a "
                         f"corrupted entry (its runs and buffers come from one SampleRows.encode)")


def batch_rows(samples: Sequence[Any], tokens: torch.Tensor, limits: torch.Tensor, *, name: str,
               unit: str = "sample") -> tuple[CompactRows, torch.Tensor]:
    """A batch's rows as the scorer takes them, still compact, and the row of every token column.

    Everything is checked here on the host (each buffer's header and CRC, runs against the
    rows their buffers hold and the sample's columns, before a column is made); the rows are
    decoded by the scorer on its own device, where each is checked against the token at its
    column.

    Args:
        samples: N :class:`SampleRows`, one a batch row.
        tokens: (N, W) int, the batch's tokens in the samples' column coordinates: a row that
            dropped its sampled id gets the token at its column back.
        limits: (N,) int, each sample's token columns (every column lies below its limit).
        name, unit: name sample i in errors as ``{name}[i] ({unit} i)`` (e.g.
            ``data['generation_support'][3] (data row 3)``).

    Returns:
        ``(rows, row_ids)``: the samples' buffers back to back, and (N, W) int64 on the host,
        the row of column t of sample i, -1 where none.

    Raises:
        ValueError naming the sample: not N SampleRows, runs that are not integer
        ``(column, row, count)``, a row past its buffers' rows, columns not increasing or past the
        sample's limit, a buffer that does not decode; a row without its sampled id whose column
        is not given.
    """
    N, W = tokens.shape
    if not isinstance(samples, (list, tuple)) or len(samples) != N:
        got = f"a list of {len(samples)}" if isinstance(samples, (list, tuple)) else type(samples).__name__
        raise ValueError(f"{name} must be a list of {N} SampleRows, one a {unit} (the framework slices lists with its "
                         f"{unit}s), got {got}: encode each {unit}'s rows once with "
                         f"nemo_replay.support.rows.SampleRows.encode where they are recorded")
    labels = [f"{name}[{i}] ({unit} {i})" for i in range(N)]
    for s, label in zip(samples, labels):
        if not isinstance(s, SampleRows) or not isinstance(s.buffers, tuple) or not s.buffers:
            got = type(s).__name__ if not isinstance(s, SampleRows) else f"SampleRows of {len(s.buffers or ())} buffers"
            raise ValueError(f"{label} is a {got}, expected SampleRows of one or more compact buffers "
                             f"(nemo_replay.support.rows)")
    names = [labels[i] if len(s.buffers) == 1 else f"{labels[i]} buffer {j}"
             for i, s in enumerate(samples) for j in range(len(s.buffers))]
    heads = [_header(b, name) for b, name in zip((b for s in samples for b in s.buffers), names)]
    first = np.cumsum([0] + [h.rows for h in heads])
    at = np.cumsum([0] + [len(s.buffers) for s in samples])
    limits = torch.as_tensor(limits).cpu().to(torch.int64)
    for i, s in enumerate(samples):
        _check_runs(s, labels[i], int(limits[i]), W, int(first[at[i + 1]] - first[at[i]]))
    row_ids = torch.full((N, W), -1, dtype=torch.int64)
    sampled = torch.full((int(first[-1]),), -1, dtype=torch.int64)
    host_tokens = tokens.cpu().to(torch.int64)
    for i, s in enumerate(samples):
        rows_t, cols_t = torch.from_numpy(s.rows() + first[at[i]]), torch.from_numpy(s.columns())
        row_ids[i, cols_t] = rows_t
        sampled[rows_t] = host_tokens[i, cols_t]
    drops = any(h.dropped for h in heads)
    if drops and bool((sampled < 0).any()):
        b = int(np.searchsorted(first, int(torch.nonzero(sampled < 0)[0]), side="right")) - 1
        raise ValueError(f"{names[b]}: a row coded without its sampled token belongs to no column (or its column "
                         f"holds padding); a buffer that dropped them is used whole, over its tokens")
    width = max((s.width for s in samples), default=0) or None
    buffers = [b for s in samples for b in s.buffers]
    return CompactRows(buffers, labels=names, sampled_ids=sampled if drops else None, width=width), row_ids


def _header(buf: Any, name: str):
    """A buffer's header, its error naming the sample."""
    try:
        return header_of(buf)
    except ValueError as exc:
        raise type(exc)(f"{name}: {exc}") from exc
