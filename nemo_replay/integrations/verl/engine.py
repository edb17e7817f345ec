"""Replay in verl 0.9.1's engine workers: what the FSDP and Megatron engines share (docs/design.md §9.3).

verl's actor and reference workers build their engine by name (``EngineRegistry.new`` in
``workers/engine_workers.py``); :mod:`.fsdp` and :mod:`.megatron` register replay engines
under the vendor key :data:`VENDOR`, which verl looks up before its own engines when
``VERL_ENGINE_VENDOR=nemo_replay`` is set (``workers/engine/base.py``
``EngineRegistry.get_engine_cls``). Without that variable verl picks its own engines, so
registering changes nothing. Every pass of a replay engine -- the old-policy recompute
(``compute_log_prob``), the reference pass (``compute_ref_log_prob``) and the policy forward
(``update_actor``) -- returns the log-probs of the sampled tokens over their recorded supports
in verl's own ``log_probs`` layout, so verl's ``ppo_loss`` and its rollout correction run
unchanged on top.

This module holds the engine-independent pieces and imports no verl: reading the support
from a batch (:func:`check_replay_batch`, whole batch, before any micro-batching),
a micro-batch's coordinates (:func:`micro_batch_layout`), the scorer call on a model
output's slots (:func:`score_slots`), and the metrics hook on verl's loss function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from nemo_replay.distributed.groups import check_together
from nemo_replay.integrations.verl.keys import SUPPORT_KEY
from nemo_replay.integrations.verl.metrics import FULL_VOCAB_LOG_PROBS
from nemo_replay.integrations.verl.response_layout import ResponseLayout, response_layout, slot_channels
from nemo_replay.integrations.verl.response_rows import buffers_of, compact_rows
from nemo_replay.layout.checks import Where, check_canonical
from nemo_replay.scoring.entry import ScorerChannels, score_positions
from nemo_replay.scoring.shard import VocabShard
from nemo_replay.support.checked import SupportCheck
from nemo_replay.support.codec import CompactRows

__all__ = [
    "ReplayEngineMixin",
    "VENDOR",
    "SAMPLE_INDEX_KEY",
    "FULL_VOCAB_KEY",
    "FUSED_KERNELS_FIX",
    "ReplayOutputs",
    "Responses",
    "read_responses",
    "response_lengths_of",
    "check_replay_batch",
    "prepare_replay_batch",
    "micro_batch_layout",
    "scalar_temperature",
    "score_slots",
    "with_replay_metrics",
]

#: The ``VERL_ENGINE_VENDOR`` value that selects the replay engines.
VENDOR = "nemo_replay"
#: Per-sample int64 key the engines add to a batch so errors name each sample by its index
#: in the batch the engine was handed, whatever verl's micro-batching reorders.
SAMPLE_INDEX_KEY = "replay_sample_index"
#: ``model_output`` key of verl's own full-vocabulary log-probs of the same tokens, from the
#: same forward (the replayed log-probs plus the log support mass), for the metrics.
FULL_VOCAB_KEY = FULL_VOCAB_LOG_PROBS

FUSED_KERNELS_FIX = (
    "actor_rollout_ref.model.use_fused_kernels=True scores each token over the full vocabulary inside the model's "
    "fused forward, from hidden states the engine never receives, so replay cannot score the recorded support there. "
    "Set actor_rollout_ref.model.use_fused_kernels=False: replay gathers only the support's logits"
)


# ---------------------------------------------------------------------------- the batch


def response_lengths_of(data) -> torch.Tensor:
    """(B,) int64 ``R_i``, as verl's ``no_padding_2_padding`` reads them (``workers/utils/padding.py``)."""
    prompts, responses = data["prompts"], data["responses"]
    if getattr(prompts, "is_nested", False):
        return responses.offsets().diff().to(torch.int64)
    mask = data["attention_mask"]
    return mask[:, prompts.shape[1]:].sum(dim=1).to(torch.int64)


@dataclass
class Responses:
    """A batch's response tensors, ``(B, W)`` whatever verl's layout.

    The legacy trainer hands the engines dense right-padded ``responses`` and ``response_mask``,
    the TransferQueue trainer nested ones (``(B, R_i)``), padded here (tokens with -1, the mask
    with 0) to ``W``, the widest response. ``generation_support`` is one uint8 buffer a sample
    (:mod:`~nemo_replay.integrations.verl.response_rows`: what replay's agent loops write), kept
    compact until the scorer decodes it.

    Attributes:
        tokens: (B, W), int64. mask: (B, W), bool. lengths: (B,), int64, ``R_i``.
        rows: the rows (:class:`~nemo_replay.support.codec.CompactRows`, one trajectory a sample).
        row_ids: (B, W), int64: the row of response position j of sample i, -1 where none.
    """

    tokens: torch.Tensor
    rows: CompactRows
    mask: torch.Tensor
    lengths: torch.Tensor
    row_ids: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


def _missing_support() -> ValueError:
    return ValueError(
        f"the batch has no {SUPPORT_KEY!r} while replay is on (the engine was selected with "
        f"VERL_ENGINE_VENDOR={VENDOR}); every actor and reference pass needs the support rows recorded at "
        f"rollout (one uint8 buffer a sample). Run the rollout with "
        f"nemo_replay.integrations.verl's servers and agent loop (configs/verl/), or unset VERL_ENGINE_VENDOR "
        f"to score over the full vocabulary"
    )


def read_responses(data) -> Responses:
    """The response tokens, mask and support rows of a verl batch or micro-batch, checked for shape.

    Raises:
        ValueError: no ``generation_support``, a support that is not one uint8 buffer a sample,
            a buffer whose row count differs from its response length (naming the sample), a
            response mask of another shape than ``responses``.
    """
    if SUPPORT_KEY not in data.keys():
        raise _missing_support()
    nested = getattr(data["responses"], "is_nested", False) if "responses" in data.keys() else False
    need = ("responses", "response_mask", "prompts") + (() if nested else ("attention_mask",))
    absent = [key for key in need if key not in data.keys()]
    if absent:
        raise ValueError(
            f"the batch has no {', '.join(repr(k) for k in absent)}; replay reads {', '.join(need)} as verl's agent "
            f"loop writes them (agent_loop.py, _postprocess) -- pass the batch as the trainer built it, not a subset of "
            f"its keys"
        )
    responses = data["responses"]
    B = int(responses.size(0))
    buffers = buffers_of(data[SUPPORT_KEY], SUPPORT_KEY)  # one uint8 buffer a sample (response_rows.py)
    lengths = response_lengths_of(data)
    if getattr(responses, "is_nested", False):
        width = int(responses.offsets().diff().max()) if B else 0
        tokens = torch.nested.to_padded_tensor(responses, -1, output_size=(B, width)).to(torch.int64)
        mask = _nested_mask(data["response_mask"], responses, B, width)
    else:
        width = int(responses.shape[1])
        tokens = responses.to(torch.int64)
        mask = data["response_mask"]
        if getattr(mask, "is_nested", False) or tuple(mask.shape) != (B, width):
            raise ValueError(
                f"batch['response_mask'] has shape {tuple(mask.shape)}, expected [{B}, {width}] like 'responses': one "
                f"flag per response column, sliced as 'responses' is"
            )
    mask = mask.to(tokens.device) != 0
    rows, row_ids = compact_rows(buffers, tokens, lengths, mask, key=SUPPORT_KEY)
    return Responses(tokens, rows, mask, lengths.to(tokens.device), row_ids)


def _nested_mask(mask_in, responses, B: int, width: int) -> torch.Tensor:
    """The response mask of a nested batch, ``(B, width)``, 0 past each response."""
    if mask_in.is_nested:
        if int(mask_in.size(0)) != B or not torch.equal(mask_in.offsets(), responses.offsets()):
            raise ValueError(
                "batch['response_mask'] is nested with other lengths than 'responses'; one flag per response token, "
                "as verl's left_right_2_no_padding makes it"
            )
        return torch.nested.to_padded_tensor(mask_in, 0, output_size=(B, width))
    if mask_in.dim() != 2 or int(mask_in.shape[0]) != B or int(mask_in.shape[1]) < width:
        raise ValueError(
            f"batch['response_mask'] has shape {tuple(mask_in.shape)}, expected [{B}, >= {width}] (the widest "
            f"response): one flag per response position"
        )
    return mask_in[:, :width]


def _name(data, i: int) -> str:
    """``sample i`` plus its ``uid`` when the batch carries one (errors only)."""
    try:
        uid = data["uid"][i]
        uid = getattr(uid, "data", uid)
        return f"sample {i} (uid {uid})"
    except Exception:  # noqa: BLE001 - a name is best effort, the index is always there
        return f"sample {i}"


def check_replay_batch(data, *, vocab_size: Optional[int]) -> None:
    """Every check that needs the whole batch, before verl cuts it into micro-batches.

    Args:
        data: the TensorDict an engine's ``forward_backward_batch`` receives (after verl's
            ``left_right_2_no_padding``): ``responses (B, R)``, ``response_mask (B, R)``,
            ``prompts``, ``attention_mask`` (or their nested forms) and ``generation_support``, one
            compact buffer a sample (:func:`read_responses`).
        vocab_size: ids must lie below it (the model's vocabulary); None skips that bound.

    Raises:
        ValueError naming the key, what came and the fix (a missing or misshapen support, rows
        breaking docs/design.md §2); SupportAlignmentError naming the sample, the response
        position and the token (a sampled token missing from its row, a loss-active response
        token without a row that is not its response's last).
    """
    resp = read_responses(data)
    tokens, mask, lengths, width = resp.tokens, resp.mask, resp.lengths, resp.width
    B = int(tokens.shape[0])
    if B == 0 or width == 0:
        return  # no response token: no row to check
    # The whole batch's agreed check needs its rows: decoded here, and each micro-batch's again where it is
    # scored (holding the batch's decoded rows through the step would cost rows x width x 4 bytes of device memory).
    rows = resp.rows.decode(tokens.device, check=True)
    # The scorer's check: decoded rows carry their record (only a V below their codec's is news), others are sorted.
    check = SupportCheck.begin(rows, vocab_size, validate=True)
    if bool(check.flag):
        try:
            check.raise_first_bad_row(where=f"batch[{SUPPORT_KEY!r}]")
        except ValueError as exc:
            raise ValueError(f"{exc} (trajectory = sample index in this batch, row = response position)") from exc
    # Response coordinates: position (i, j) predicts the response token j of sample i over its row.
    col = torch.arange(width, device=tokens.device).expand(B, width)
    traj = torch.arange(B, dtype=torch.int64, device=tokens.device)[:, None].expand(B, width)
    channels = ScorerChannels(
        sampled_ids=tokens, row_ids=resp.row_ids,
        loss_mask=mask.to(tokens.device) & (col < lengths[:, None].to(tokens.device)), trajectory_ids=traj,
        token_positions=col,
    )
    where = Where(traj.reshape(-1), channels.loss_mask.shape, col.reshape(-1), trajectory=lambda i: _name(data, i),
                  position="response position")
    check_canonical(
        channels, rows, where=where,
        hint=f"row j of {SUPPORT_KEY} must be the support response token j was sampled from, padded and sliced exactly "
             f"like 'responses' (rows swapped between samples, or shifted by one position?); a response position whose "
             f"support could not be recorded must leave response_mask, its row all -1",
    )


def prepare_replay_batch(data, *, vocab_size: Optional[int], group, device) -> None:
    """:func:`check_replay_batch` on every rank of ``group`` at once, then name the samples.

    The ranks of a worker group run ``forward_backward_batch`` together and a bad sample
    sits in one rank's shard of the batch; inside :func:`~nemo_replay.distributed.groups.check_together`
    every rank raises the same error instead of leaving the others in the next collective.
    Then ``data[SAMPLE_INDEX_KEY] = arange(B)``, which verl's micro-batching carries with
    each sample, so errors raised per micro-batch name the sample's index in this batch.
    """
    check_together(lambda: check_replay_batch(data, vocab_size=vocab_size), group, device=device, name="worker")
    data[SAMPLE_INDEX_KEY] = torch.arange(int(data["responses"].size(0)), dtype=torch.int64,
                                          device=data["input_ids"].device)


def micro_batch_layout(micro_batch) -> tuple[ResponseLayout, Any]:
    """The coordinates and support rows of one micro-batch (``input_ids`` nested, no padding).

    Returns:
        the :class:`~nemo_replay.integrations.verl.response_layout.ResponseLayout` (with the row of
        each response position), and the rows, compact: the scorer decodes them on its device.
    """
    input_ids = micro_batch["input_ids"]
    if not getattr(input_ids, "is_nested", False):
        raise ValueError(
            "replay reads verl's no-padding micro-batches (input_ids a nested tensor, pad_mode no_padding); got a "
            f"dense input_ids {tuple(input_ids.shape)}"
        )
    resp = read_responses(micro_batch)
    sample_ids = micro_batch[SAMPLE_INDEX_KEY] if SAMPLE_INDEX_KEY in micro_batch.keys() else None
    cu = input_ids.offsets()
    layout = response_layout(cu, resp.lengths.to(cu.device), resp.mask.to(cu.device),
                             None if sample_ids is None else sample_ids.to(cu.device), row_ids=resp.row_ids.to(cu.device))
    return layout, resp.rows


def scalar_temperature(temperature) -> Optional[float]:
    """The one temperature of a micro-batch, or None when its samples differ.

    verl hands the engines ``temperature`` as a host scalar (the rollout config's) or a
    per-sample tensor. Replay's scores need a positive finite temperature: the sampler's.
    """
    if isinstance(temperature, torch.Tensor):
        flat = temperature.detach().reshape(-1).to(torch.float64).cpu()
        if flat.numel() == 0:
            raise ValueError("the micro-batch's temperature tensor is empty")
        bad = ~torch.isfinite(flat) | (flat <= 0)
        if bool(bad.any()):
            raise ValueError(
                f"temperature {float(flat[bad][0])} (sample {int(torch.nonzero(bad)[0])}) cannot be replayed: replay "
                f"scores the sampler's softmax z / T over the support, which needs a finite T > 0 (greedy sampling "
                f"has no support to replay)"
            )
        return float(flat[0]) if bool((flat == flat[0]).all()) else None
    value = float(temperature)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"temperature {value} cannot be replayed: replay scores the sampler's softmax z / T over the support, "
            f"which needs a finite T > 0 (set actor_rollout_ref.rollout.temperature)"
        )
    return value


# ---------------------------------------------------------------------------- scoring


@dataclass
class ReplayOutputs:
    """Scores of one model output's slots, each shaped like the slots.

    Attributes:
        log_probs: float32, differentiable; the sampled token over its support, 0 where not scored.
        full_vocab_log_probs: float32, detached; the same tokens over the full vocabulary.
        entropy: entropy of the support distribution (differentiable), or None.
    """

    log_probs: torch.Tensor
    full_vocab_log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]


def score_slots(
    logits: torch.Tensor,
    shard: VocabShard,
    sampled_ids: torch.Tensor,
    predicted: torch.Tensor,
    layout: ResponseLayout,
    support: Any,
    *,
    temperature: float,
    compute_entropy: bool,
    group=None,
    group_name: str = "SP",
) -> ReplayOutputs:
    """Score the slots of one model output over the recorded supports (docs/design.md §4).

    Args:
        logits: (*, V_local), any float dtype: this rank's vocabulary shard, not yet divided
            by the temperature (or already divided, with ``temperature=1.0``). Not modified.
        shard: this rank's vocabulary slice and its tensor-parallel group.
        sampled_ids: (*,), int. verl's label of each slot (the token its logit predicts).
        predicted: (*,), int64. The packed token each slot predicts, -1 where none
            (:mod:`~nemo_replay.integrations.verl.response_layout`).
        layout, support: from :func:`micro_batch_layout`.
        group: the group the slots of one micro-batch are split over (Ulysses SP, Megatron
            CP), or None; every rank of it raises the same error.

    Returns:
        :class:`ReplayOutputs` shaped like ``predicted``.
    """
    shape = predicted.shape
    scores = score_positions(
        logits.reshape(-1, logits.shape[-1]), slot_channels(layout, predicted.to(logits.device), sampled_ids).flat(),
        support, shard=shard, temperature=temperature, compute_entropy=compute_entropy,
        compute_support_mass=True, validate=False, group=group, group_name=group_name,
        context="verl micro-batch (trajectory = sample index in the batch the engine was handed, token position = "
                "response position)",
    )
    logmass = torch.where(scores.valid_mask, scores.support_logmass, torch.zeros_like(scores.support_logmass))
    full = (scores.logprobs.detach() + logmass).view(shape)
    return ReplayOutputs(
        log_probs=scores.logprobs.view(shape),
        full_vocab_log_probs=full,
        entropy=None if scores.entropy is None else scores.entropy.view(shape),
    )


# ---------------------------------------------------------------------------- metrics


def with_replay_metrics(loss_function: Optional[Callable]) -> Optional[Callable]:
    """verl's loss function, with the replay metrics added to the metrics it returns.

    The policy pass's ``model_output`` holds the replayed ``log_probs`` and, under
    :data:`FULL_VOCAB_KEY`, verl's own full-vocabulary log-probs of the same tokens;
    :func:`nemo_replay.integrations.verl.metrics.engine_metrics` turns that pair (with the
    micro-batch's ``rollout_log_probs``) into ``replay/*`` metrics, which verl aggregates
    over micro-batches and data-parallel ranks and logs with the actor's (``actor/replay/*``).
    The loss is returned unchanged.
    """
    if loss_function is None:
        return None
    from nemo_replay.integrations.verl import metrics as replay_metrics

    def loss_with_replay_metrics(model_output, data, dp_group=None, **kwargs) -> tuple[Any, dict]:
        loss, metrics = loss_function(model_output=model_output, data=data, dp_group=dp_group, **kwargs)
        metrics = dict(metrics)
        metrics.update(replay_metrics.engine_metrics(model_output, data))
        return loss, metrics

    return loss_with_replay_metrics


class ReplayEngineMixin:
    """What both replay engines add to verl's LM-head engines, mixed in before them: the fused-kernel
    refusal at construction, and the whole-batch check (:func:`prepare_replay_batch`, every rank alike)
    before verl splits the batch into micro-batches."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.engine_config.use_fused_kernels:
            raise ValueError(FUSED_KERNELS_FIX)

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        from verl.utils.device import get_device_id, get_device_name

        name = get_device_name()
        device = torch.device("cpu") if name == "cpu" else torch.device(name, get_device_id())
        vocab = getattr(self.model_config.hf_config, "vocab_size", None)
        prepare_replay_batch(data, vocab_size=vocab, group=dist.group.WORLD, device=device)
        return super().forward_backward_batch(data, loss_function, forward_only)
