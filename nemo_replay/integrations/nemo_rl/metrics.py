"""Replay's metrics in NeMo-RL's training logs (docs/design.md §6, §9).

NeMo-RL gathers each micro-batch's loss metrics into per-key lists and the driver then
*sums* every list (``grpo.py``, after ``policy.train``), except a few names it averages or
takes the extreme of; a worker divides each value by the number of global batches unless the
key holds ``_min`` / ``_max``. A mean or a maximum computed per micro-batch would come out
wrong. So the workers emit raw parts of :mod:`nemo_replay.diagnostics`' statistics
(:func:`metric_parts`: ``replay/<mean>:sum``, ``replay/<mean>:count``, ``replay/<max>``)
and the driver combines them over every micro-batch and data-parallel rank
(:func:`combine_parts`) into one-element lists under the names every integration logs:
``replay/mismatch_mean`` and ``replay/mismatch_max`` (NeMo-RL prefixes ``train/``). The
mismatch is ``|generation_logprobs - trainer|`` over the loss-active tokens
(``token_mask * sample_mask``), with the weights of that forward: with one global batch a
step (NeMo-RL's default), the old policy's.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, MutableMapping

import torch

from nemo_replay.diagnostics import StepStats, record_mismatch

__all__ = ["metric_parts", "merge_parts", "combine_parts", "policy_with_replay_metrics"]

_SUM, _COUNT = ":sum", ":count"


def metric_parts(next_token_logprobs: torch.Tensor, data: Mapping[str, Any]) -> dict[str, float]:
    """One scoring call's parts, as Python floats (one host read); {} without ``generation_logprobs``.

    Args:
        next_token_logprobs: (B, S - 1), the scores (column c predicts token c + 1).
        data: the (per-sequence) data dict: ``generation_logprobs (B, S)``, ``token_mask (B, S)``,
            ``sample_mask [B]``.
    """
    gen = data.get("generation_logprobs") if hasattr(data, "get") else None
    if gen is None:
        return {}
    lp = next_token_logprobs.detach()
    mask = (data["token_mask"][:, 1:] != 0) & (data["sample_mask"] != 0)[:, None]
    stats = StepStats()
    record_mismatch(stats, gen[:, 1:].to(lp.device), lp, mask.to(lp.device))
    names = sorted(stats.sums)
    values = torch.stack(
        [torch.as_tensor(stats.sums[n], dtype=torch.float64, device=lp.device) for n in names]
        + [torch.as_tensor(stats.counts[n], dtype=torch.float64, device=lp.device) for n in names]
        + [torch.as_tensor(stats.maxima[n], dtype=torch.float64, device=lp.device) for n in sorted(stats.maxima)]
    ).tolist()
    k = len(names)
    out = {f"replay/{n}{_SUM}": values[i] for i, n in enumerate(names)}
    out.update({f"replay/{n}{_COUNT}": values[k + i] for i, n in enumerate(names)})
    out.update({f"replay/{n}": values[2 * k + i] for i, n in enumerate(sorted(stats.maxima))})
    return out


def merge_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    """Several calls' parts as one (the sequences of a packed micro-batch): sums added, maxima maxed."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            if key in out and not (key.endswith(_SUM) or key.endswith(_COUNT)):
                out[key] = max(out[key], value)
            else:
                out[key] = out.get(key, 0.0) + value
    return out


def combine_parts(metrics: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """NeMo-RL's gathered training metrics (key -> list over micro-batches and ranks), in place: each
    ``replay/<mean>:sum`` / ``:count`` pair becomes ``replay/<mean>`` = pooled sum / pooled count, each
    ``replay/<max>`` list its maximum, every value a one-element list (NeMo-RL then sums it: itself).
    No scored token: the mean is left out rather than logged as NaN."""
    for key in [k for k in metrics if k.startswith("replay/") and k.endswith(_SUM)]:
        name = key[: -len(_SUM)]
        total = sum(float(v) for v in _as_list(metrics.pop(key)))
        count = sum(float(v) for v in _as_list(metrics.pop(name + _COUNT, [])))
        if count > 0 and math.isfinite(total):
            metrics[name] = [total / count]
    for key in [k for k in metrics if k.startswith("replay/") and k.endswith("_max")]:
        values = [float(v) for v in _as_list(metrics[key])]
        metrics[key] = [max(values)] if values else [0.0]
    return metrics


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def policy_with_replay_metrics(make_policy: Callable) -> Callable:
    """A policy factory whose policies' ``train`` combines the replay parts of its results' ``all_mb_metrics``."""

    def factory(*args, **kwargs):
        policy = make_policy(*args, **kwargs)
        train = policy.train

        def train_with_replay_metrics(*a, **k):
            results = train(*a, **k)
            if isinstance(results, dict) and isinstance(results.get("all_mb_metrics"), dict):
                combine_parts(results["all_mb_metrics"])
            return results

        policy.train = train_with_replay_metrics
        return policy

    return factory
