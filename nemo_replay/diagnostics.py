"""Per-step diagnostics of the train/inference mismatch (docs/design.md §1).

All inputs are ``(B, A)`` tensors in the batch's columns (the last A token columns, see
:class:`~nemo_replay.layout.canonical.ReplayBatch`: a right-aligned response window, or the
whole row token-aligned) with a ``(B, A)`` bool mask of the positions that count
(loss-active response tokens).

- mismatch: ``|rollout log-prob - trainer log-prob|`` with the weights the rollout used
  (the old-policy recompute, before the first update). With replay on it sits at float
  noise; without, it is about ``-log(support mass)`` per token.
- first-step ratio: ``exp(policy log-prob - rollout log-prob)`` in the first policy forward
  of a step, before any update: the PPO ratio against the behaviour policy. With replay
  on it is 1 to float noise.
- support mass: ``exp(support_logmass)``, the probability the truncation kept.

:func:`record_mismatch` and :func:`record_policy` add one micro-batch's values to a
:class:`StepStats`; the reference trainer and :class:`~nemo_replay.roles.ReplayRoles`
both go through them. Each function returns sums / counts / maxima so ranks and micro-batches combine exactly
(:class:`StepStats`), then :meth:`StepStats.reduce` all-reduces them once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["StepStats", "masked_abs_diff", "ratio_deviation", "record_mismatch", "record_policy"]


def masked_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, int]:
    """(sum, max, count) of ``|a - b|`` over ``mask``; a, b (B, A) float, mask (B, A) bool."""
    d = (a.double() - b.double().to(a.device)).abs()[mask.to(a.device).bool()]
    if d.numel() == 0:
        return 0.0, 0.0, 0
    return float(d.sum()), float(d.max()), int(d.numel())


def ratio_deviation(logprobs: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, int]:
    """(sum of ratios, max |ratio - 1|, count) of ``exp(logprobs - behaviour)`` over ``mask``."""
    r = torch.exp(logprobs.double() - behaviour.double().to(logprobs.device))[mask.to(logprobs.device).bool()]
    if r.numel() == 0:
        return 0.0, 0.0, 0
    return float(r.sum()), float((r - 1).abs().max()), int(r.numel())


def record_mismatch(stats: "StepStats", rollout_logprobs: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    """``mismatch_mean`` / ``mismatch_max`` of one micro-batch; all (B, A), mask bool."""
    total, peak, n = masked_abs_diff(rollout_logprobs, logprobs, mask)
    stats.add_mean("mismatch_mean", total, n)
    stats.add_max("mismatch_max", peak)


def record_policy(stats: "StepStats", batch, out, *, first_forward: bool = True) -> None:
    """The diagnostics of one policy-role output.

    Args:
        batch: the :class:`~nemo_replay.layout.canonical.ReplayBatch` it scored.
        out: its :class:`~nemo_replay.strategies.base.RoleOutput` (canonical coordinates).
        first_forward: the forward ran before any update of this step; only then is its
            ratio against ``batch.rollout_logprobs`` the first-step ratio (``ratio_mean``,
            ``ratio_max_dev``).

    Adds ``loss``, ``clip_fraction`` and ``kl`` weighted by loss-active tokens, and
    ``ratio_old_max_dev`` (the ratio against the old log-probs the objective used).
    """
    mask = batch.loss_mask.bool()
    n = int(mask.sum())
    if first_forward and batch.rollout_logprobs is not None:
        total, dev, count = ratio_deviation(out.response(batch.response_width).logprobs, batch.rollout_logprobs, mask)
        stats.add_mean("ratio_mean", total, count)
        stats.add_max("ratio_max_dev", dev)
    if out.loss is not None:
        stats.add_mean("loss", float(out.loss) * n, n)
    for key in ("clip_fraction", "kl"):
        if key in out.metrics:
            stats.add_mean(key, out.metrics[key] * n, n)
    if "ratio_max_dev" in out.metrics:
        stats.add_max("ratio_old_max_dev", out.metrics["ratio_max_dev"])


@dataclass
class StepStats:
    """Accumulates one step's diagnostics on a rank; :meth:`reduce` combines ranks.

    ``sums[name]`` / ``counts[name]`` give a mean, ``maxima[name]`` a maximum.
    """

    sums: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    maxima: dict = field(default_factory=dict)

    def add_mean(self, name: str, total: float, count: int) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(total)
        self.counts[name] = self.counts.get(name, 0) + int(count)

    def add_max(self, name: str, value: float) -> None:
        self.maxima[name] = max(self.maxima.get(name, float("-inf")), float(value))

    def reduce(self, group=None, device: Optional[torch.device] = None, *, across_ranks: bool = True) -> dict[str, float]:
        """Means and maxima over every rank of ``group`` (two all-reduces; none without a process
        group or with ``across_ranks=False``, which gives this rank's values).

        Every rank must have added the same names (the loop adds them unconditionally).
        """
        names = sorted(self.sums)
        maxes = sorted(self.maxima)
        device = device or torch.device("cpu")
        summed = torch.tensor([[self.sums[n], self.counts[n]] for n in names] or [[0.0, 0.0]], dtype=torch.float64, device=device)
        peak = torch.tensor([self.maxima[n] for n in maxes] or [0.0], dtype=torch.float64, device=device)
        if across_ranks and dist.is_available() and dist.is_initialized():
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        out = {}
        for i, n in enumerate(names):
            total, count = float(summed[i, 0]), float(summed[i, 1])
            out[n] = total / count if count > 0 else float("nan")
        for i, n in enumerate(maxes):
            out[n] = float(peak[i])
        return out
