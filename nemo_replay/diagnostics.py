"""Per-step diagnostics of the train/inference mismatch (docs/design.md §1).

All inputs are ``(B, A)`` tensors in the batch's columns (the last A token columns, see
:class:`~nemo_replay.batch.ReplayBatch`: a right-aligned response window, or the
whole row token-aligned) with a ``(B, A)`` bool mask of the positions that count
(loss-active response tokens).

- mismatch: ``|rollout log-prob - trainer log-prob|`` with the weights the rollout used
  (the old-policy recompute, before the first update). With replay on it sits at float
  noise; without, it is about ``-log(support mass)`` per token.
- first-step ratio: ``exp(policy log-prob - rollout log-prob)`` in the first policy forward
  of a step, before any update: the PPO ratio against the behaviour policy. With replay
  on it is 1 to float noise.
- support mass: ``exp(support_logmass)``, the probability the truncation kept, and the
  normalisation gap ``-log mass`` apart from the numeric mismatch (:func:`record_mismatch`).

One spelling everywhere: the reference trainer's rows use these names, TRL's and verl's
logs the same names under ``replay/``.

:func:`record_mismatch` and :func:`record_policy` add one micro-batch's values to a
:class:`StepStats`; the reference trainer and :class:`~nemo_replay.roles.ReplayRoles`
both go through them. Each function returns sums / counts / maxima so ranks and micro-batches combine exactly
(:class:`StepStats`), then :meth:`StepStats.reduce` all-reduces them once. Values stay
tensors on their device until then: a step's diagnostics cost one host read, not several
per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

__all__ = [
    "StepStats", "masked_abs_diff", "ratio_deviation", "record_mismatch", "record_gap", "record_policy", "MISMATCH_NAMES", "GAP_NAMES", "RATIO_BAND",
    "outside_share",
]


def masked_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum, max, count) of ``|a - b|`` over ``mask``; a, b (B, A) float, mask (B, A) bool.

    0-dim float64 / int64 tensors on a's device, no host read (:class:`StepStats` reads them
    once, in :meth:`StepStats.reduce`); the max of an empty mask is 0.
    """
    m = mask.to(a.device).bool()
    d = torch.where(m, (a.double() - b.double().to(a.device)).abs(), 0.0)
    return d.sum(), (d.amax() if d.numel() else d.new_zeros(())), m.sum()


def ratio_deviation(logprobs: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of ratios, max |ratio - 1|, count) of ``exp(logprobs - behaviour)`` over ``mask``, as :func:`masked_abs_diff`."""
    m = mask.to(logprobs.device).bool()
    r = torch.exp(logprobs.double() - behaviour.double().to(logprobs.device))
    dev = torch.where(m, (r - 1).abs(), 0.0)
    return torch.where(m, r, 0.0).sum(), (dev.amax() if dev.numel() else dev.new_zeros(())), m.sum()


#: Every name :func:`record_mismatch` adds; the integrations log them under ``replay/``.
MISMATCH_NAMES = ("mismatch_mean", "mismatch_max")
GAP_NAMES = ("support_mass_mean", "normalisation_gap_mean", "full_vocab_mismatch_mean", "full_vocab_mismatch_max",
             "ratio_outside_share", "full_vocab_ratio_outside_share")
#: The band of the ``*_ratio_outside_share`` metrics: the share of tokens whose trainer / rollout
#: probability ratio falls outside ``[1 - RATIO_BAND, 1 + RATIO_BAND]`` (the form TRL reports).
RATIO_BAND = 0.1


def outside_share(stats: "StepStats", name: str, rollout: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    """Add to ``name`` the tokens of ``mask`` whose ratio ``exp(logprobs - rollout)`` is outside
    ``[1 - RATIO_BAND, 1 + RATIO_BAND]``, as a share of the tokens (no host read)."""
    m = mask.to(logprobs.device).bool()
    ratio = torch.exp(logprobs.double() - rollout.double().to(logprobs.device))
    outside = m & ((ratio - 1).abs() > RATIO_BAND)
    stats.add_mean(name, outside.sum().double(), m.sum())


def record_mismatch(
    stats: "StepStats",
    rollout_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    log_mass: Optional[torch.Tensor] = None,
    mass_mask: Optional[torch.Tensor] = None,
) -> None:
    """The mismatch of one micro-batch (names :data:`MISMATCH_NAMES`); all (B, A), mask bool. No host read.

    With ``log_mass`` (the scorer's ``support_logmass``, <= 0) also the normalisation gap apart
    (:data:`GAP_NAMES`), over ``mass_mask`` (default ``mask``; the positions scored over a row):
    ``support_mass_mean`` (the kept probability), ``normalisation_gap_mean`` (mean ``-log mass``
    = ``log p_S(x) - log p_V(x)``, what full-vocabulary scoring adds to each token) and
    ``full_vocab_mismatch_{mean,max}`` (``|rollout - (replayed + log mass)|``: what the
    trainer would measure without replay). ``ratio_outside_share`` and
    ``full_vocab_ratio_outside_share``: the share of tokens whose ratio ``exp(trainer - rollout)``
    falls outside ``[0.9, 1.1]`` (:data:`RATIO_BAND`), with replay and over the full vocabulary.
    """
    total, peak, n = masked_abs_diff(rollout_logprobs, logprobs, mask)
    stats.add_mean("mismatch_mean", total, n)
    stats.add_max("mismatch_max", peak)
    if log_mass is None:
        return
    outside_share(stats, "ratio_outside_share", rollout_logprobs, logprobs.detach(), mask)
    m = (mask if mass_mask is None else mass_mask).to(log_mass.device).bool()
    lm = record_gap(stats, log_mass, m)
    full = logprobs.detach().double().to(lm.device) + lm
    total, peak, n = masked_abs_diff(rollout_logprobs, full, m)
    stats.add_mean("full_vocab_mismatch_mean", total, n)
    stats.add_max("full_vocab_mismatch_max", peak)
    outside_share(stats, "full_vocab_ratio_outside_share", rollout_logprobs, full, m)


def record_gap(stats: "StepStats", log_mass: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``support_mass_mean`` and ``normalisation_gap_mean`` over ``mask`` (no rollout log-probs
    needed); returns the log mass as float64, clamped at 0, 0 outside the mask. No host read."""
    m = mask.to(log_mass.device).bool()
    lm = torch.where(m, log_mass.detach().double().clamp(max=0.0), 0.0)
    count = m.sum()
    stats.add_mean("support_mass_mean", torch.where(m, lm.exp(), 0.0).sum(), count)
    stats.add_mean("normalisation_gap_mean", -lm.sum(), count)
    return lm


def record_policy(stats: "StepStats", batch, out, *, first_forward: bool = True) -> None:
    """The diagnostics of one policy-role output (no host read: values stay tensors until reduce).

    Args:
        batch: the :class:`~nemo_replay.batch.ReplayBatch` it scored.
        out: its :class:`~nemo_replay.strategies.base.RoleOutput` (canonical coordinates).
        first_forward: the forward ran before any update of this step; only then is its
            ratio against ``batch.rollout_logprobs`` the first-step ratio (``ratio_mean``,
            ``ratio_max_dev``).

    Adds ``loss``, ``clip_fraction``, ``kl`` (and truncated IS's ``tis_weight_mean`` and
    ``tis_truncated_fraction``) weighted by loss-active tokens, and
    ``ratio_old_max_dev`` (the ratio against the old log-probs the objective used).
    """
    mask = batch.loss_mask.bool()
    n = mask.sum().to(torch.float64)  # float64: a Python float times an int64 tensor would round to float32
    if first_forward and batch.rollout_logprobs is not None:
        total, dev, count = ratio_deviation(out.response(batch.response_width).logprobs, batch.rollout_logprobs, mask)
        stats.add_mean("ratio_mean", total, count)
        stats.add_max("ratio_max_dev", dev)
    if out.loss is not None:
        loss = out.loss.detach().double()
        stats.add_mean("loss", loss * n.to(loss.device), n)
    for key in ("clip_fraction", "kl", "tis_weight_mean", "tis_truncated_fraction"):
        if key in out.metrics:
            stats.add_mean(key, out.metrics[key] * n, n)
    if "ratio_max_dev" in out.metrics:
        stats.add_max("ratio_old_max_dev", out.metrics["ratio_max_dev"])


def _as_float64(values: list, device: torch.device) -> torch.Tensor:
    """(k,) float64 on ``device`` from numbers and 0-dim tensors: one copy per source device, no host read
    unless a source lives on another device than ``device``."""
    out = torch.zeros(max(1, len(values)), dtype=torch.float64, device=device)
    groups: dict = {}
    for i, v in enumerate(values):
        groups.setdefault(v.device if isinstance(v, torch.Tensor) else None, []).append(i)
    for source, index in groups.items():
        if source is None:
            part = torch.tensor([float(values[i]) for i in index], dtype=torch.float64)
        else:
            part = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in index])
        out[torch.tensor(index, device=device)] = part.to(device)
    return out


@dataclass
class StepStats:
    """Accumulates one step's diagnostics on a rank; :meth:`reduce` combines ranks.

    ``sums[name]`` / ``counts[name]`` give a mean, ``maxima[name]`` a maximum.
    """

    sums: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    maxima: dict = field(default_factory=dict)

    def add_mean(self, name: str, total, count) -> None:
        """Add ``total`` over ``count`` items: numbers or 0-dim tensors (kept on their device until :meth:`reduce`)."""
        self.sums[name] = self.sums.get(name, 0.0) + total
        self.counts[name] = self.counts.get(name, 0) + count

    def add_max(self, name: str, value) -> None:
        """Raise the maximum ``name`` to ``value`` (a number or a 0-dim tensor, no host read)."""
        prev = self.maxima.get(name)
        if prev is None:
            self.maxima[name] = value
        elif isinstance(prev, torch.Tensor) or isinstance(value, torch.Tensor):
            # On the device of a tensor operand (a GPU one if either is), so nothing is read back.
            tensors = [t for t in (prev, value) if isinstance(t, torch.Tensor)]
            dev = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
            as64 = lambda t: torch.as_tensor(t, dtype=torch.float64).to(dev)  # noqa: E731
            self.maxima[name] = torch.maximum(as64(prev), as64(value))
        else:
            self.maxima[name] = max(prev, value)

    def reduce(self, group=None, device: Optional[torch.device] = None, *, across_ranks: bool = True) -> dict[str, float]:
        """Means and maxima over every rank of ``group`` (two all-reduces; none without a process
        group or with ``across_ranks=False``, which gives this rank's values).

        One host read in all: values added as tensors stay on their device until then.
        ``device`` is where the all-reduces run (default: a GPU the values live on, else the CPU).
        Every rank must have added the same names (the loop adds them unconditionally).
        """
        names = sorted(self.sums)
        maxes = sorted(self.maxima)
        values = [self.sums[n] for n in names] + [self.counts[n] for n in names] + [self.maxima[n] for n in maxes]
        if device is None:
            gpu = (v.device for v in values if isinstance(v, torch.Tensor) and v.device.type != "cpu")
            device = next(gpu, torch.device("cpu"))
        summed = _as_float64(values[: 2 * len(names)], device)
        peak = _as_float64(values[2 * len(names) :], device)
        if across_ranks and dist.is_available() and dist.is_initialized():
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        flat = torch.cat([summed, peak]).tolist()  # the one host read
        k = len(names)
        totals, counts, maxima = flat[:k], flat[k : 2 * k], flat[summed.numel() :]
        out = {n: (t / c if c > 0 else float("nan")) for n, t, c in zip(names, totals, counts)}
        out.update(zip(maxes, maxima))
        return out
