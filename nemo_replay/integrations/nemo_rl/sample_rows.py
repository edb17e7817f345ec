"""``generation_support`` in NeMo-RL's batches: one compact entry per sample, response positions only
(docs/design.md §2, §9).

The policy batches NeMo-RL builds (``train_data``, ``logprob_data``) travel from the driver
through Ray to every policy worker and are cut there into micro-batches. A token-aligned
``(B, S, k)`` int32 tensor would carry ``4 k`` bytes for every token, prompt and tool output
included. Here the key holds a Python ``list`` of B :class:`SampleRows`, one per sample: the
token columns of its recorded rows and the rows themselves in the compact codec
(:mod:`nemo_replay.support.codec`). The rows keep their sampled ids: the list travels apart
from ``input_ids``, and decoding checks every row against the token now at its column. A list is what NeMo-RL's ``BatchedDataDict`` keeps aligned with its samples
through ``from_batches``, slicing, sharding (dynamic batching and sequence packing included),
Ray and the micro-batch iterators, and what no sequence-length check or truncation touches.

Columns are absolute in the sample's flattened message log. NeMo-RL right-pads, and every cut
it makes (dynamic batching, a packed sequence's ``[:, :L_i]``) trims the right end only, so a
token's column is the same in every micro-batch that holds it. Example, a sample of a 3-token
prompt and a 4-token response whose third token could not be recorded::

    column            0  1  2 | 3  4  5  6
    rows              -  -  - | r0 r1 -  r2     columns 3 4 6: runs [[3, 2], [6, 1]], three rows in the buffer

The columns are stored as runs of consecutive columns (start, count): a response is one run
unless tokens in it were flagged or a tool turn interrupts it, so they cost bytes a turn, not a
token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from nemo_replay.support.codec import CompactRows, decode_support, encode_kept, header_of, row_lengths
from nemo_replay.support.dtypes import is_integer
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["GeneratedRows", "MessageRows", "SampleRows", "sample_rows", "batch_rows", "message_log_rows"]


@dataclass(frozen=True)
class SampleRows:
    """One sample's recorded support rows.

    Attributes:
        runs: (n, 2), int32: runs of consecutive token columns ``(start, count)``, increasing
            and apart, of the R rows in the sample's flattened message log.
        data: uint8: the R rows in the compact codec
            (:func:`~nemo_replay.support.codec.encode_support`), sampled ids kept.
    """

    runs: np.ndarray
    data: np.ndarray

    @property
    def columns(self) -> np.ndarray:
        """(R,), int64: the token column of each row."""
        runs = np.asarray(self.runs, dtype=np.int64).reshape(-1, 2)
        if not runs.size:
            return np.zeros(0, np.int64)
        starts, counts = runs[:, 0], runs[:, 1]
        first = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        return first + np.arange(int(counts.sum()), dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return int(self.runs.nbytes + self.data.nbytes)


@dataclass(frozen=True)
class GeneratedRows:
    """One sample's rows as replay's vLLM worker returns them (what crosses Ray to the driver): the
    generated tokens' rows, columns ``[start, start + n)`` of the worker's ``logprobs`` layout, compact.

    The patched rollout code slices it as it slices ``logprobs`` (``rows[i][input_length:total_length]``):
    a column slice is a :class:`MessageRows`, the message's window of the same buffer (no row where a
    column holds no generated token or its support could not be recorded).

    Attributes:
        start: the column of the first generated token (the prompt's length).
        width: the row width the message's rows are padded to.
        data: uint8, the n rows in the compact codec (sampled ids kept: the message's tokens are checked
            against them downstream).
    """

    start: int
    width: int
    data: np.ndarray

    @classmethod
    def of(cls, rows: RaggedSupport, start: int, width: int) -> "GeneratedRows":
        """From the generated tokens' CSR rows (empty where nothing was recorded) and the ``width``
        messages pad them to."""
        return cls(int(start), int(width), encode_kept(rows.resegment([0, rows.num_rows])))

    def __getitem__(self, columns: slice) -> "MessageRows":
        if not isinstance(columns, slice) or columns.step not in (None, 1):
            raise ValueError(f"GeneratedRows are sliced by a column range, as logprobs are; got {columns!r}")
        lo = 0 if columns.start is None else int(columns.start)
        hi = self.start + self.num_rows if columns.stop is None else int(columns.stop)
        return MessageRows(self, lo, max(hi, lo))

    @property
    def num_rows(self) -> int:
        return header_of(self.data).rows


@dataclass(frozen=True)
class MessageRows:
    """A generated message's rows as the patched rollout code slices them out of a :class:`GeneratedRows`
    (``rows[i][input_length:total_length]``): columns ``[lo, hi)`` of the worker's ``logprobs`` layout,
    still compact (the message log holds a reference to the sample's buffer, not ``(n, width)`` int32).

    A column outside the generated tokens has no row. :meth:`recorded` reads the rows' lengths alone;
    :meth:`rows` decodes the window, once, where the message log is flattened (:func:`sample_rows`).
    """

    source: GeneratedRows
    lo: int
    hi: int

    @property
    def shape(self) -> tuple:
        return (self.hi - self.lo, self.source.width)

    def _window(self) -> tuple[int, int]:
        """The window's generated rows ``[a, b)``, as row indices of the source."""
        start = self.source.start
        a = min(max(self.lo, start), start + self.source.num_rows) - start
        b = max(min(self.hi, start + self.source.num_rows) - start, a)
        return a, b

    def recorded(self) -> torch.Tensor:
        """(hi - lo,) bool: columns whose support was recorded (a non-empty row)."""
        out = torch.zeros(self.hi - self.lo, dtype=torch.bool)
        a, b = self._window()
        if b > a:
            at = a + self.source.start - self.lo
            out[at:at + b - a] = torch.from_numpy(row_lengths(self.source.data)[a:b] > 0)
        return out

    def rows(self) -> RaggedSupport:
        """The window's rows, one segment of ``hi - lo`` rows (empty outside the generated tokens)."""
        got = decode_support(self.source.data)
        a, b = self._window()
        offsets = got.row_offsets
        lead = a + self.source.start - self.lo
        lengths = torch.zeros(self.hi - self.lo, dtype=torch.int64)
        lengths[lead:lead + b - a] = offsets[a + 1:b + 1] - offsets[a:b]
        members = got.member_ids[int(offsets[a]):int(offsets[b])]
        return RaggedSupport(members, torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]),
                             torch.tensor([0, self.hi - self.lo], dtype=torch.int32))

    def dense(self) -> torch.Tensor:
        """``(hi - lo, width)`` int32, -1 padded: the rows as a token-aligned tensor."""
        return self.rows().to_padded(self.source.width).values.to(torch.int32)


def _message_rows(r: Any, n: int, key: str, where: str) -> RaggedSupport:
    """A generated message's rows as one segment of ``n`` CSR rows: compact (:class:`MessageRows`) or
    dense ``(n, k)`` integer rows, -1 padded."""
    if isinstance(r, MessageRows):
        if r.shape[0] != n:
            raise ValueError(f"{where}: {key} holds {r.shape[0]} rows for {n} tokens; slice the worker's rows as "
                             f"generation_logprobs is sliced")
        return r.rows()
    if not (is_integer(r) and r.dim() == 2 and r.shape[0] == n):
        got = f"{r.dtype} {tuple(r.shape)}" if isinstance(r, torch.Tensor) else type(r).__name__
        raise ValueError(f"{where}: {key} must be integer rows ({n}, k), one per token, got {got}")
    return RaggedSupport.checked_of(r.cpu(), where=f"{where}: {key}")  # -1 only as a trailing pad


def sample_rows(messages: Sequence[dict], key: str, *, where: str) -> SampleRows:
    """The compact entry of one sample from its message log.

    Args:
        messages: the sample's messages in order, each with ``token_ids (n,)``; generated ones
            also ``key``: a :class:`MessageRows` or ``(n, k)`` int rows (-1 padded). An empty row is
            a token whose support could not be recorded, left out.
        where: names the sample in errors.

    Raises:
        ValueError naming the message when its rows are not one per token, or a recorded row does
        not hold its token.
    """
    offset, columns, parts, sampled = 0, [], [], []
    for j, message in enumerate(messages):
        tokens = message["token_ids"]
        n = int(tokens.shape[0])
        if key in message:
            rows = _message_rows(message[key], n, key, f"{where}, message {j}")
            recorded = torch.nonzero(rows.row_lengths > 0).flatten()
            columns.append(recorded + offset)
            parts.append(rows.resegment(torch.arange(n + 1)).gather(recorded))  # one segment a recorded row
            sampled.append(tokens.cpu()[recorded])  # their dtype as given: encode_kept refuses a float
        offset += n
    support = RaggedSupport.cat(parts) if parts else RaggedSupport.from_rows([])
    support = support.resegment([0, support.num_rows])
    sampled = torch.cat(sampled) if sampled else torch.zeros(0, dtype=torch.int64)
    try:
        # Sampled ids kept in the rows: the list travels apart from input_ids, and a row that drifted from the token
        # now at its column fails the membership check by name.
        data = encode_kept(support, sampled, where=where)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    cols = torch.cat(columns).numpy() if columns else np.zeros(0, np.int64)
    breaks = np.flatnonzero(np.diff(cols) != 1) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64) if cols.size else np.zeros(0, np.int64)
    counts = np.diff(np.concatenate([starts, [cols.size]]))
    return SampleRows(np.stack([cols[starts], counts], 1).astype(np.int32).reshape(-1, 2), data)


def _check_runs(entry: Any, where: str) -> None:
    """An entry is a :class:`SampleRows` whose runs are ``(n, 2)`` integers with every count >= 1 (a float
    count would be cut to an integer when its columns are made)."""
    if not isinstance(entry, SampleRows):
        raise ValueError(f"{where} is a {type(entry).__name__}, expected SampleRows")
    runs = np.asarray(entry.runs)
    if runs.dtype.kind not in "iu":
        raise ValueError(f"{where}: runs of dtype {runs.dtype}; expected integer (start, count) pairs, as sample_rows "
                         f"writes them (int32)")
    if runs.ndim != 2 or runs.shape[1] != 2 or (runs.size and int(runs[:, 1].min()) < 1):
        raise ValueError(f"{where}: runs of shape {runs.shape}; expected (n, 2) (start, count >= 1)")


def batch_rows(entries: Any, input_ids: torch.Tensor, input_lengths: torch.Tensor, *, key: str) -> tuple[CompactRows, torch.Tensor]:
    """A micro-batch's rows, still compact: ``(support, token_rows)``.

    The buffers' headers, CRCs and columns are checked here, on the host; the rows are decoded
    where the scorer runs (:class:`~nemo_replay.support.codec.CompactRows`), and each recorded
    row is checked against the token now at its column there (``check_canonical``).

    Args:
        entries: ``data[key]``, a list of N :class:`SampleRows` (one per data row).
        input_ids: (N, W), int. The micro-batch's right-padded tokens (``W`` may be cut below
            the batch's longest sample; every recorded column lies below its ``input_lengths``).
        input_lengths: (N,), int.

    Returns:
        the rows (one segment per data row) and ``token_rows`` (N, W) int64, the global row of
        token t at column t, -1 where none.

    Raises:
        ValueError naming the data row and the fix: not a list of N entries, runs that are not
        integer ``(n, 2)`` pairs, run counts that add up to another count than the rows its buffer
        holds (checked before a column is made: the buffer's rows are held to its bytes), a column
        at or past the row's length, columns not increasing, a buffer that is not one the encoder wrote.
    """
    N, W = input_ids.shape
    if not isinstance(entries, list) or len(entries) != N:
        got = f"a list of {len(entries)}" if isinstance(entries, list) else type(entries).__name__
        raise ValueError(
            f"data[{key!r}] must be a list of {N} SampleRows, one per data row (NeMo-RL slices lists with its "
            f"samples), got {got}"
        )
    for i, entry in enumerate(entries):
        _check_runs(entry, f"data[{key!r}][{i}]")
    # Headers and CRCs first: each buffer's row count, held to what its bytes hold, bounds its columns.
    support = CompactRows([e.data for e in entries], labels=[f"data[{key!r}][{i}] (data row {i})" for i in range(N)])
    lengths = input_lengths.cpu().to(torch.int64)
    token_rows = torch.full((N, W), -1, dtype=torch.int64)
    start = 0
    for i, entry in enumerate(entries):
        count = int(np.asarray(entry.runs)[:, 1].sum(dtype=np.int64))  # before any column is made
        if count != support.rows_of(i):
            raise ValueError(f"data[{key!r}][{i}]: {support.rows_of(i)} rows for {count} columns; a corrupted entry (runs "
                             f"and rows of one SampleRows come from one sample_rows call)")
        cols = torch.from_numpy(entry.columns)  # a new array: Ray hands read-only ones
        if cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= int(lengths[i]) or bool((cols.diff() <= 0).any())):
            raise ValueError(
                f"data[{key!r}][{i}]: row columns {cols[:8].tolist()}... must increase and lie below the data row's "
                f"input_lengths {int(lengths[i])}: the rows belong to another sample (reordered apart from input_ids?)"
            )
        token_rows[i, cols] = start + torch.arange(cols.numel())
        start += cols.numel()
    return support, token_rows


def message_log_rows(message_logs: Sequence[Sequence[dict]], key: str) -> Optional[list]:
    """:func:`sample_rows` of every sample of a batch, or None when no message carries ``key``."""
    if not any(key in m for log in message_logs for m in log):
        return None
    return [sample_rows(log, key, where=f"trajectory {i}") for i, log in enumerate(message_logs)]
