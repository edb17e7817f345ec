"""What the TRL integration carries per completion, and the scorer channels built from it.

TRL-independent (no ``trl`` import), so it is tested on its own.

One :class:`CompletionRecord` per generated completion travels in TRL's batch dict as a
Python list under :data:`RECORDS_KEY`, its rows encoded once, compact
(:class:`~nemo_replay.support.rows.SampleRows`, the sampled tokens dropped: the record holds
them; about 11 B a token for typical top-p supports where int32 rows of k = 64 hold 256), while
they wait in TRL's buffer, and decoded once, by the scorer, when a batch is scored: TRL's ``shuffle_sequence_dict`` permutes lists with
the tensors and ``split_tensor_dict`` slices them, so record ``i`` stays with row ``i``.
Every scoring call checks that it did (:func:`completion_channels`).

Coordinates (docs/design.md §3). TRL scores ``input_ids = [prompt_ids | completion_ids]``
``(B, P + C)``, prompts left-padded, completions right-padded, and keeps the last ``C``
log-prob positions: the logit at column ``P - 1 + j`` predicts completion token ``j``. Here
every channel is ``(B, C)`` in those completion coordinates -- sampled ids are the
completion ids, the loss mask is the completion mask, and row ``j`` of completion ``i``'s
record sits at column ``j``::

    completion ids   [a b EOS pad]        R_0 = 3   row ids [0 1 2 -1]
                     [c d e   f  ]        R_1 = 4           [3 4 5  6]
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from nemo_replay.rollout.capture.hf import CapturedSupport
from nemo_replay.scoring.entry import ScorerChannels
from nemo_replay.support.codec import CompactRows
from nemo_replay.support.rows import SampleRows, batch_rows

__all__ = [
    "RECORDS_KEY",
    "CompletionRecord",
    "records_from_capture",
    "records_from_vllm",
    "completion_channels",
]

#: Key of the per-completion records in TRL's batch dict.
RECORDS_KEY = "replay_records"


class CompletionRecord(NamedTuple):
    """One completion as the engine sampled it.

    Attributes:
        token_ids: (R,), int64 -- the sampled tokens (a stop token included).
        logprobs: (R,), float32 -- each token's processed log-prob over its row.
        support: its rows, encoded once (:class:`~nemo_replay.support.rows.SampleRows`, columns
            ``0 .. R - 1``, the sampled tokens dropped).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    support: SampleRows


def _record(tokens: torch.Tensor, logprobs: torch.Tensor, rows, vocab_size: int, where: str) -> CompletionRecord:
    """A record, its rows encoded for ``vocab_size`` (fixed-width rows decode as wide as they were captured)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"{where}: vocab_size must be the model's vocabulary size (an int >= 1), got {vocab_size!r}")
    width = 0 if rows.csr else rows.width_bound
    return CompletionRecord(tokens, logprobs, SampleRows.encode(rows, tokens, vocab_size=vocab_size, width=width,
                                                                where=where))


def records_from_capture(completions: Sequence[Sequence[int]], captured: CapturedSupport, *,
                         vocab_size: int) -> list[CompletionRecord]:
    """Split a batch capture (:meth:`SupportRecorder.finish`) into one record per completion, its rows
    encoded for the model's ``vocab_size``."""
    lengths = captured.lengths.tolist()
    if len(lengths) != len(completions):
        raise ValueError(f"{len(completions)} completions for a capture of {len(lengths)}")
    lps = captured.logprobs.split(lengths)
    out = []
    for i, (c, lp) in enumerate(zip(completions, lps)):
        tokens = torch.as_tensor(list(c), dtype=torch.int64)
        out.append(_record(tokens, lp, captured.support.gather([i]), vocab_size, f"completion {i}"))
    return out


def _engine_order(token: int, ids: Sequence[int], values: Sequence[Optional[float]], where: str) -> dict:
    """One position's entries in vLLM's own order: the sampled token first, then by rank.

    TRL's ``extract_logprobs`` re-sorts each position by rank (trl/generation/vllm_generation.py,
    ``extract_logprobs``); vLLM lists the sampled token first and de-duplicates by id
    (vllm/logprobs.py), so moving it back to the front restores what vLLM returned.
    Example: sampled 7, TRL ids [3, 7, 9] values [-0.5, -1.2, -inf] -> {7: -1.2, 3: -0.5, 9: -inf}.
    """
    if token not in ids:
        raise ValueError(f"{where}: the sampled token {token} is missing from its log-prob entries {list(ids)[:8]}")
    j = list(ids).index(token)
    out = {token: values[j]}
    out.update((t, v) for t, v in zip(ids, values) if t != token)
    return out


def records_from_vllm(
    completions: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[Sequence[Optional[float]]]],
    token_ids: Sequence[Sequence[Sequence[int]]],
    *,
    width: Optional[int],
    vocab_size: int,
    sampling_params: dict,
) -> list[CompletionRecord]:
    """Records from what TRL's ``VLLMGeneration.generate`` returns with ``logprobs >= top_k + 1``.

    Args:
        completions: B lists of generated token ids.
        logprobs, token_ids: ``(B, R_i, n)`` nested lists, each position's entries sorted by
            rank (``None`` for a NaN log-prob), as ``VLLMGeneration.generate`` returns them.
        width: fixed row width, or None for ragged rows.
        vocab_size: ids must be below it.
        sampling_params: the request's sampling parameters (checked: processed log-probs
            need ``logprobs >= top_k + 1`` and no penalties).

    Each completion goes through the vLLM processed-logprobs adapter
    (:func:`nemo_replay.rollout.engines.vllm.support_from_vllm_logprobs`). A position whose support
    is not fully visible is an error here: TRL's loss has no way to leave one token out.
    """
    from nemo_replay.rollout.engines.vllm import support_from_vllm_logprobs

    if not isinstance(sampling_params, dict):
        raise ValueError(
            f"records_from_vllm: sampling_params must be the request's parameters as a dict (temperature, top_k, top_p, "
            f"min_p, logprobs, ...), got {type(sampling_params).__name__}; they are checked before any row is read"
        )
    if token_ids is None or logprobs is None:
        raise ValueError(
            "ReplayGRPOTrainer (vLLM): the generation returned no log-probs; the trainer requests logprobs >= top_k + 1 "
            "from vLLM -- is the server started by `trl vllm-serve` with --logprobs-mode processed_logprobs?"
        )
    records = []
    for i, (comp, lps, ids) in enumerate(zip(completions, logprobs, token_ids)):
        where = f"ReplayGRPOTrainer (vLLM), completion {i}"
        positions = [_engine_order(int(t), p_ids, p_lps, f"{where}, position {j}") for j, (t, p_ids, p_lps) in enumerate(zip(comp, ids, lps))]
        got = support_from_vllm_logprobs(
            positions, list(comp), width=width, vocab_size=vocab_size, sampling_params=sampling_params
        )
        if got.num_flagged:
            at = torch.nonzero(got.flagged).flatten().tolist()
            raise ValueError(
                f"{where}: positions {at[:8]} do not show their whole support ({got.reasons}); request more log-probs "
                f"(ReplaySettings(vllm_logprobs=...)) or ragged rows (ReplaySettings(row_width=None) with top_k ties)"
            )
        tokens = torch.as_tensor(list(comp), dtype=torch.int64)
        records.append(_record(tokens, got.logprobs, got.support, vocab_size, where))
    return records


class Completions(NamedTuple):
    """B completions in TRL's completion coordinates, as the scorer reads them (module doc).

    Attributes:
        channels: the scorer's channels, each (B, C): ``sampled_ids`` the completion ids,
            ``row_ids`` the row of ``support`` per position (-1 past R_i), ``loss_mask`` TRL's
            completion mask, ``trajectory_ids`` the completion's index b.
        support: the B records' rows, completion-major, still compact
            (:class:`~nemo_replay.support.codec.CompactRows`, decoded by the scorer).
        rollout_logprobs: (B, C), float32 -- the engine's processed log-probs, 0 past R_i.
    """

    channels: ScorerChannels
    support: CompactRows
    rollout_logprobs: torch.Tensor


def completion_channels(
    records: Sequence[CompletionRecord],
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    where: str = "ReplayGRPOTrainer",
) -> Completions:
    """Build the (B, C) scorer channels and check records and rows still belong together.

    Args:
        records: B records, record ``i`` for row ``i``.
        completion_ids: (B, C), int -- TRL's right-padded completion ids (``input_ids[:, -C:]``).
        completion_mask: (B, C), int or bool -- TRL's completion mask: ``R_i`` leading ones,
            or all zeros for a completion TRL left out (``mask_truncated_completions``).

    Raises:
        ValueError when row ``i`` does not hold record ``i``'s tokens, or its mask
        does not cover exactly them.
    """
    B, C = completion_ids.shape
    if len(records) != B:
        raise ValueError(
            f"{where}: {len(records)} support records for a batch of {B} completions; the records travel in the "
            f"batch dict under {RECORDS_KEY!r} -- a batch built or split without them cannot be replayed"
        )
    device = completion_ids.device
    lengths = torch.tensor([r.token_ids.numel() for r in records], dtype=torch.int64)
    if B and int(lengths.max()) > C:
        i = int(lengths.argmax())
        raise ValueError(f"{where}: completion {i} was recorded with {int(lengths[i])} tokens but the batch holds {C} columns")
    cols = torch.arange(C)
    inside = cols[None, :] < lengths[:, None]  # (B, C)
    tokens = torch.full((B, C), -1, dtype=torch.int64)
    rollout = torch.zeros(B, C, dtype=torch.float32)
    if B and int(lengths.sum()):
        tokens[inside] = torch.cat([r.token_ids for r in records])
        rollout[inside] = torch.cat([r.logprobs.float() for r in records])
    ids = completion_ids.cpu().to(torch.int64)
    wrong = inside & (ids != tokens)
    if wrong.any():
        i, j = (int(v) for v in torch.nonzero(wrong)[0])
        raise ValueError(
            f"{where}: completion {i}, token {j} is {int(ids[i, j])} but its record says {int(tokens[i, j])}; the "
            f"batch rows and their support records were separated (a shuffle or split that moved one without the other)"
        )
    mask = completion_mask.cpu().bool()
    covered = mask.sum(1)
    bad = (covered != 0) & ((covered != lengths) | (mask & ~inside).any(1))
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"{where}: completion {i} has {int(covered[i])} loss-active positions but {int(lengths[i])} recorded tokens; "
            f"the completion mask must cover exactly the sampled tokens (TRL's right-padded completion layout)"
        )
    # The records' rows in completion coordinates: row j of completion i at column j; the tokens there give the
    # dropped sampled ids back (docs/design.md §2).
    support, row_ids = batch_rows([r.support for r in records], ids, lengths, name=f"{where}: {RECORDS_KEY}",
                                  unit="completion")
    channels = ScorerChannels(ids, row_ids, mask, torch.arange(B)[:, None].expand(B, C)).to(device)
    return Completions(channels, support, rollout.to(device))
