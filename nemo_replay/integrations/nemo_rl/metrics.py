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

__all__ = ["metric_parts", "merge_parts", "to_floats", "combine_parts", "policy_with_replay_metrics"]

_SUM, _COUNT = ":sum", ":count"


def metric_parts(next_token_logprobs: torch.Tensor, data: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """One scoring call's parts as 0-dim float64 tensors on the scores' device (no host read; :func:`to_floats`
    reads a micro-batch's at once); {} without ``generation_logprobs``.

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
    as64 = lambda v: torch.as_tensor(v, dtype=torch.float64, device=lp.device)  # noqa: E731
    out = {f"replay/{n}{_SUM}": as64(stats.sums[n]) for n in stats.sums}
    out.update({f"replay/{n}{_COUNT}": as64(stats.counts[n]) for n in stats.counts})
    out.update({f"replay/{n}": as64(stats.maxima[n]) for n in stats.maxima})
    return out


def merge_parts(parts: list[dict]) -> dict:
    """Several calls' parts as one (the sequences of a packed micro-batch): sums added, maxima maxed."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            if key not in out:
                out[key] = value
            elif key.endswith(_SUM) or key.endswith(_COUNT):
                out[key] = out[key] + value
            else:
                out[key] = torch.maximum(torch.as_tensor(out[key]), torch.as_tensor(value))
    return out


def to_floats(parts: dict) -> dict[str, float]:
    """Parts as the Python floats NeMo-RL's metrics hold, in one host read."""
    names = sorted(parts)
    values = torch.stack([torch.as_tensor(parts[n], dtype=torch.float64).reshape(()) for n in names]).tolist() if names else []
    return dict(zip(names, values))


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
