"""``generation_support`` in verl's batches: one uint8 buffer a sample (docs/design.md §2, §9.3).

A ``[B, response_length, K]`` int32 field costs ``4 K`` bytes a response position, padding
included, in the ``DataProto``, over Ray and in TransferQueue. Here the field holds one uint8
buffer a sample, what replay's agent loops write: the compact buffers the rollout server
encoded (:func:`encode_response_rows`, magic ``NRSC``), one a turn, as they came, with the
response position of each of their rows that verl kept
(:meth:`~nemo_replay.support.rows.SampleRows.to_bytes`, magic ``NRSR``). A row is encoded once,
by the server, and decoded once, by the scorer.

The sampled tokens stay in the rows: the buffers travel apart from ``responses``, and the
scorer's decode checks each row holds the token now at its position, so rows that drifted from
their tokens fail by name instead of being rebuilt around the wrong token (a dropped id would
be). verl carries a per-sample object with its sample through union, repeat, reorder, chunk and
concat, into the engine's TensorDict (a ``NonTensorStack``) and through its micro-batching, fixed
or dynamic; TransferQueue stores a numpy buffer as raw bytes.

Build the ``non_tensor_batch`` column with :func:`object_column`: ``np.array(buffers,
dtype=object)`` turns equal-length buffers into a 2-D array of objects.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from nemo_replay.support.codec import CompactRows, encode_kept, header_of, row_lengths
from nemo_replay.support.ragged import RaggedSupport
from nemo_replay.support.rows import SampleRows, batch_rows

__all__ = ["encode_response_rows", "turn_rows", "object_column", "buffers_of", "compact_rows"]


def encode_response_rows(rows: Any, response_ids: Sequence[int]) -> np.ndarray:
    """One response's rows as a uint8 buffer: ``(R, K)`` int rows (-1 padded; an all -1 row records
    nothing) or one segment of R CSR rows (a :class:`RaggedSupport`; an empty row records nothing).

    Raises:
        ValueError naming the row when a recorded row does not hold its response token.
    """
    where = "replay: a response's support rows"
    ids = list(response_ids)
    sampled = torch.as_tensor(ids) if ids else torch.zeros(0, dtype=torch.int64)  # dtype checked by encode_kept
    if not isinstance(rows, RaggedSupport):
        rows = torch.as_tensor(np.asarray(rows))  # the caller's dtype: a cast here would cut floats and wrap ids
        if rows.dim() != 2:
            raise ValueError(f"replay: support rows of shape {tuple(rows.shape)}; expected (R, K)")
    support = RaggedSupport.checked_of(rows, where=where)  # -1 only as a trailing pad
    if support.num_rows != sampled.numel():
        raise ValueError(f"replay: {support.num_rows} support rows for a response of {sampled.numel()} tokens")
    # Sampled ids kept: the buffer travels apart from ``responses``.
    return encode_kept(support.resegment([0, support.num_rows]), sampled, where=where)


def turn_rows(buf: Any, token_ids: Sequence[int], width: int, *, where: str) -> tuple[np.ndarray, torch.Tensor]:
    """One turn's buffer as the server wrote it (:func:`encode_response_rows`), checked and kept
    compact, with each row's length (from the length streams: no id is decoded).

    Raises:
        ValueError naming ``where``: not a uint8 buffer, a buffer whose header, CRC or lengths do not
        check, rows of another count than ``token_ids``, a row wider than ``width``, rows coded
        without their sampled ids (the rows travel apart from the response).
    """
    buf = _buffer(buf, where)
    n = len(token_ids)
    try:
        head = header_of(buf)
        if head.rows != n:
            raise ValueError(f"{head.rows} support rows for {n} generated tokens")
        if head.dropped:
            raise ValueError("rows coded without their sampled ids; the server keeps them (encode_response_rows)")
        if head.max_length > width:
            raise ValueError(f"a support row holds {head.max_length} ids, wider than the row width {width}")
        lengths = torch.from_numpy(row_lengths(buf))
    except ValueError as exc:
        raise type(exc)(f"{where}: {exc}") from exc
    return buf, lengths


def object_column(buffers: Sequence[Any]) -> np.ndarray:
    """A 1-D object array of ``buffers``, one element each, whatever their lengths."""
    out = np.empty(len(buffers), dtype=object)
    for i, buf in enumerate(buffers):
        out[i] = buf
    return out


def buffers_of(value: Any, key: str = "generation_support") -> list:
    """The per-sample buffers of a batch's field.

    Takes what verl hands the engines: a ``NonTensorStack`` or the list a TensorDict returns for
    it, or ``non_tensor_batch``'s object array.

    Raises:
        ValueError for a tensor (a dense ``[B, R, K]`` form, which replay's agent loops never write)
        or another type.
    """
    if isinstance(value, torch.Tensor):
        raise ValueError(
            f"replay: batch[{key!r}] is a {tuple(value.shape)} tensor; replay's agent loops write one uint8 "
            f"buffer a sample (SampleRows.to_bytes), the form the engines read: run the rollout with "
            f"nemo_replay.integrations.verl's agent loops (configs/verl/)"
        )
    if isinstance(value, np.ndarray) and value.dtype == object:
        return list(value)
    if isinstance(value, (list, tuple)):
        return list(value)
    if hasattr(value, "tolist"):
        return list(value.tolist())
    raise ValueError(f"replay: batch[{key!r}] is a {type(value).__name__}; expected one uint8 buffer a sample")


def compact_rows(buffers: list, tokens: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor, *,
                 key: str) -> tuple[CompactRows, torch.Tensor]:
    """A batch's rows kept compact, one trajectory a sample: ``(rows, row_ids)``
    (:func:`~nemo_replay.support.rows.batch_rows`, verl's response positions as the columns).

    The buffers' headers and CRCs are checked here, on the host, and their row counts against
    the responses; the rows are decoded where the scorer runs, and checked there against the
    tokens now at their positions (membership).

    Args:
        tokens: (B, W) the response tokens. lengths: (B,) ``R_i``. mask: (B, W) bool, the response mask.

    Returns:
        the rows (sample i's ``R_i`` rows after those of the samples before it) and ``row_ids``
        (B, W) int64 on ``mask``'s device: the row of response position j of sample i, -1 where
        none.

    A sample with no position in the mask may hold rows of another length (verl's V1 trainer
    pads a batch with copies of sample 0 cut to one token): it gets none.

    Raises:
        ValueError naming the sample: not a uint8 buffer, a buffer whose header or CRC does not
        check, or rows of another count than its response.
    """
    B, W = mask.shape
    if len(buffers) != B:
        raise ValueError(f"batch[{key!r}] holds {len(buffers)} buffers for {B} samples; one a sample")
    lengths = lengths.cpu().to(torch.int64)
    samples = []
    for i, buf in enumerate(buffers):
        sample = SampleRows.from_bytes(_buffer(buf, f"batch[{key!r}][{i}]"), where=f"batch[{key!r}][{i}] (sample {i})")
        R = int(lengths[i])
        if sample.length != R and bool(mask[i].any()):
            raise ValueError(
                f"batch[{key!r}] holds {sample.length} rows for sample {i}, whose response has {R} tokens: one row per "
                f"response token, sliced and reordered with 'responses'"
            )
        samples.append(sample if sample.length == R else SampleRows.none(R))
    out, row_ids = batch_rows(samples, tokens, lengths, name=f"batch[{key!r}]", unit="sample")
    return out, row_ids.to(mask.device)


def _buffer(buf: Any, where: str) -> np.ndarray:
    """A sample's field as a 1-D uint8 buffer."""
    if isinstance(buf, (bytes, bytearray)):
        buf = np.frombuffer(buf, np.uint8)
    if not (isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1):
        got = f"{buf.dtype} {buf.shape}" if isinstance(buf, np.ndarray) else type(buf).__name__
        raise ValueError(
            f"{where} is {got}; expected a 1-D uint8 buffer (build the column with "
            f"nemo_replay.integrations.verl.response_rows.object_column: np.array(buffers, dtype=object) makes "
            f"equal-length buffers a 2-D array)"
        )
    return buf
