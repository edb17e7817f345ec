"""Replay's mismatch metrics in verl's logger (docs/design.md §6, §9.3).

verl logs ``training/rollout_probs_diff_{valid,max,mean,std}`` and
``training/rollout_actor_probs_pearson_corr`` (``utils/debug/metrics.py``,
``calculate_debug_metrics``): ``|exp(old_log_probs) - exp(rollout_log_probs)|`` over the
response mask -- a difference of *probabilities* -- in the old-policy step when
``rollout.calculate_log_probs`` is on. With replay on, ``old_log_probs`` are scored over the
recorded supports, so verl's own numbers measure the replayed mismatch. Replay adds, under
``replay/``:

- ``rollout_probs_diff_{valid,max,mean,std}``: verl's formula on the replayed log-probs;
- ``mismatch_{mean,max}``: ``|replayed - rollout|`` in log space, as the other integrations
  report it (docs/design.md §6);
- the normalisation gap apart, given verl's full-vocabulary scoring of the same tokens (or
  the log support mass, ``log p_V(x) = log p_S(x) + log mass``): ``support_mass_mean``,
  ``normalisation_gap_mean`` (mean ``-log mass``), ``full_vocab_probs_diff_{max,mean,std}``
  and ``full_vocab_mismatch_{mean,max}`` -- what verl would have logged without replay;
- ``flagged_tokens``: generated tokens left out of the loss because their support could not
  be recorded whole (the rollout's ``replay_flagged_tokens``).

Two entry points:

- :func:`engine_metrics` -- inside verl's loss function, per micro-batch, in the engine
  worker (the trainer side calls it from its ``ppo_loss`` wrapper and merges the result into
  the metrics ``ppo_loss`` returns; verl reduces them with its ``Metric`` aggregation: means
  averaged, maxima maxed over micro-batches and data-parallel ranks);
- :func:`replay_metrics_from_batch` -- on the driver, beside ``calculate_debug_metrics``,
  with the same batch (V1 ``trainer/ppo/v1/trainer_base.py`` ``_compute_old_log_prob``; V0
  ``trainer/ppo/ray_trainer.py``, the step's old-log-prob block).

Every call returns the same keys for the same inputs present (verl's data-parallel reduction
needs as many values from each rank); a micro-batch with no token in its mask gives 0 for
every value and ``rollout_probs_diff_valid = 0``, never NaN.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np
import torch

from nemo_replay.diagnostics import StepStats, record_gap, record_mismatch
from nemo_replay.integrations.verl.keys import LOG_SUPPORT_MASS_KEY

__all__ = ["FULL_VOCAB_LOG_PROBS", "engine_metrics", "replay_metrics", "replay_metrics_from_batch"]

#: ``model_output`` key of verl's full-vocabulary scoring of the same tokens (the trainer side's engines).
FULL_VOCAB_LOG_PROBS = "full_vocab_log_probs"


def _as_float(name: str, value: Any, shape: torch.Size, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) float64, detached; a non-finite value inside the mask is an error naming its place."""
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        raise ValueError(f"replay metrics: {name} must be a float tensor (B, R), got {type(value).__name__} {getattr(value, 'dtype', '')}")
    if value.shape != shape:
        raise ValueError(f"replay metrics: {name} has shape {tuple(value.shape)}, the response mask {tuple(shape)}")
    value = value.detach().to(torch.float64)
    bad = mask & ~torch.isfinite(value)
    if bad.any():
        b, r = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"replay metrics: {name} is {float(value[b, r])} at trajectory {b}, response position {r}, inside the "
            f"response mask; a scored token's log-prob is finite"
        )
    return value


def _summary(prefix: str, values: torch.Tensor, *, std: bool) -> dict:
    if values.numel() == 0:
        out = {f"{prefix}_max": 0.0, f"{prefix}_mean": 0.0}
    else:
        out = {f"{prefix}_max": values.max().item(), f"{prefix}_mean": values.mean().item()}
    if std:
        out[f"{prefix}_std"] = values.std().item() if values.numel() > 1 else 0.0
    return out


def replay_metrics(
    log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_log_probs: Optional[torch.Tensor] = None,
    full_vocab_log_probs: Optional[torch.Tensor] = None,
    log_support_mass: Optional[torch.Tensor] = None,
    flagged_tokens: Any = None,
) -> dict[str, float]:
    """The replayed mismatch and the normalisation gap, as ``{name: float}``.

    Args:
        log_probs: (B, R), float: the trainer's replayed log-probs (verl's ``old_log_probs``,
            or a policy pass's ``log_probs``).
        response_mask: (B, R), bool or 0/1 integers: the tokens scored.
        rollout_log_probs: (B, R), float, optional: the sampler's log-probs (verl's
            ``rollout_log_probs``); the ``rollout_probs_diff`` and ``mismatch`` entries need it.
        full_vocab_log_probs: (B, R), float, optional: verl's full-vocabulary scoring of the
            same tokens from the same forward.
        log_support_mass: (B, R), float, <= 0, optional: the log support mass (used when
            ``full_vocab_log_probs`` is not given).
        flagged_tokens: per-trajectory counts (``non_tensor_batch["replay_flagged_tokens"]``,
            None entries ignored) or a total, optional.

    Raises:
        ValueError on a shape other than the mask's, a non-float tensor, a non-finite value
        inside the mask, or a support mass above 1 (each naming where).
    """
    if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2:
        raise ValueError(
            f"replay metrics: response_mask must be a (B, R) tensor, got {getattr(response_mask, 'shape', type(response_mask).__name__)}"
        )
    mask = response_mask.detach() != 0
    replayed = _as_float("log_probs", log_probs, mask.shape, mask)
    out: dict[str, float] = {}
    if flagged_tokens is not None:
        counts = [flagged_tokens] if np.isscalar(flagged_tokens) else list(flagged_tokens)
        out["replay/flagged_tokens"] = float(sum(int(c) for c in counts if c is not None))
    rollout = None
    if rollout_log_probs is not None:
        rollout = _as_float("rollout_log_probs", rollout_log_probs, mask.shape, mask)
        out["replay/rollout_probs_diff_valid"] = int(bool(mask.any()))
        out.update(_summary("replay/rollout_probs_diff", (replayed.exp() - rollout.exp()).abs()[mask], std=True))
    log_mass = None
    if full_vocab_log_probs is not None:
        log_mass = _as_float(FULL_VOCAB_LOG_PROBS, full_vocab_log_probs, mask.shape, mask) - replayed
    elif log_support_mass is not None:
        log_mass = _as_float("log_support_mass", log_support_mass, mask.shape, mask)
    if log_mass is not None and (log_mass[mask] > 1e-5).any():
        b, r = (int(i) for i in torch.nonzero(mask & (log_mass > 1e-5))[0])
        raise ValueError(
            f"replay metrics: the support's log mass is {float(log_mass[b, r])} > 0 at trajectory {b}, response "
            f"position {r}: the full-vocabulary log-prob exceeds the replayed one, so they are not the same token's"
        )
    # The names every integration logs (nemo_replay.diagnostics), computed there.
    stats = StepStats()
    if rollout is not None:
        record_mismatch(stats, rollout, replayed, mask, log_mass=log_mass)
    elif log_mass is not None:
        record_gap(stats, log_mass, mask)
    for name, value in stats.reduce(across_ranks=False).items():
        out[f"replay/{name}"] = value if math.isfinite(value) else 0.0  # no token in the mask: 0, never NaN
    if rollout is not None and log_mass is not None:
        full = replayed + log_mass.clamp(max=0.0)
        out.update(_summary("replay/full_vocab_probs_diff", (full.exp() - rollout.exp()).abs()[mask], std=True))
    return out


def replay_metrics_from_batch(batch: Any) -> dict[str, float]:
    """:func:`replay_metrics` of a verl ``DataProto`` (or a mapping of its tensors), on the driver.

    Reads ``old_log_probs``, ``response_mask``, ``rollout_log_probs`` and, when present,
    ``LOG_SUPPORT_MASS_KEY`` and ``non_tensor_batch["replay_flagged_tokens"]``.
    """
    tensors: Mapping[str, Any] = getattr(batch, "batch", batch)
    extra: Mapping[str, Any] = getattr(batch, "non_tensor_batch", None) or {}
    keys = set(tensors.keys())
    missing = [k for k in ("rollout_log_probs", "old_log_probs", "response_mask") if k not in keys]
    if missing:
        raise ValueError(
            f"replay_metrics_from_batch: the batch has no {missing}; set actor_rollout_ref.rollout.calculate_log_probs="
            f"true and call it once old_log_probs are in the batch"
        )
    return replay_metrics(
        tensors["old_log_probs"], tensors["response_mask"], rollout_log_probs=tensors["rollout_log_probs"],
        log_support_mass=tensors[LOG_SUPPORT_MASS_KEY] if LOG_SUPPORT_MASS_KEY in keys else None,
        flagged_tokens=extra.get("replay_flagged_tokens"),
    )


def engine_metrics(model_output: Mapping[str, Any], data: Any) -> dict:
    """:func:`replay_metrics` of one micro-batch inside verl's loss function, as verl ``Metric``s.

    Args:
        model_output: the engine's outputs: ``log_probs`` (replayed) and, when the engine
            scored them, ``full_vocab_log_probs``; nested ``[b, L_i]`` or padded, as verl's
            ``ppo_loss`` receives them.
        data: the micro-batch ``TensorDict`` (``response_mask``, ``responses``, ``prompts``,
            ``attention_mask``, and ``rollout_log_probs`` when the rollout recorded them).

    Returns:
        ``{name: verl.utils.metric.Metric}``: maxima aggregate with MAX, everything else with
        MEAN, over micro-batches and data-parallel ranks.
    """
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    fields = ["response_mask"] + (["rollout_log_probs"] if "rollout_log_probs" in data.keys() else [])
    padded = data.select(*fields).to_padded_tensor()
    log_probs = no_padding_2_padding(model_output["log_probs"], data)
    full = model_output.get(FULL_VOCAB_LOG_PROBS)
    values = replay_metrics(
        log_probs, padded["response_mask"], rollout_log_probs=padded.get("rollout_log_probs", None),
        full_vocab_log_probs=None if full is None else no_padding_2_padding(full, data),
    )
    return {
        name: Metric(value=value, aggregation=AggregationType.MAX if name.endswith(("_max", "_valid")) else AggregationType.MEAN)
        for name, value in values.items()
    }
