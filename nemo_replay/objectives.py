"""Policy objectives: the loss plug point of the ``policy`` role (docs/design.md §6).

A strategy owns scoring, coordinates and the context/sequence-parallel normalisation; the
objective owns only the loss. The ``policy`` role hands a :class:`PolicyLoss` the
micro-batch's differentiable log-probs in the caller's coordinates and back-propagates
what it returns::

    loss, metrics = loss_fn(logprobs, batch, mask)

- ``logprobs``: (B, A) float32 (float64 for float64 models), differentiable; column a is
  token column ``S - A + a`` of ``batch.sequences`` (the coordinates of ``batch.loss_mask``),
  0 where nothing was scored.
- ``batch``: the :class:`~nemo_replay.batch.ReplayBatch` (advantages, old,
  reference and rollout log-probs, all in the same (B, A) coordinates).
- ``mask``: (B, A) bool, the loss-active tokens (``batch.loss_mask != 0``).
- returns a scalar loss (this micro-batch's objective, a mean over its own tokens or
  sequences; strategies scale it by ``1 / num_micro_batches``) and Python-float metrics.

Any callable with that signature is a loss. An objective may also define
``check(batch) -> list[str]``, the batch fields it misses; strategies call it before any
forward so a missing field is reported with the micro-batch index, not mid-schedule.

Three built-in objectives (all with an optional KL-to-reference term, k3 estimator):

- :class:`TokenRatioObjective` -- PPO/GRPO: per-token ratio ``r_t = exp(logp_t - old_t)``,
  ``-mean_t min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t)`` over loss-active tokens;
- :class:`SequenceRatioObjective` -- GSPO: one ratio per sequence, the geometric mean
  ``s_i = exp(mean_t (logp_t - old_t))``, clipped per sequence, averaged over sequences;
  with token advantages it is GSPO-token (``s_i * exp(logp_t - sg(logp_t))`` per token,
  the same value and, for a sequence-constant advantage, the same gradient);
- :class:`TruncatedISObjective` -- the token ratio objective weighted per token by the
  truncated importance weight ``min(exp(old_t - rollout_t), cap)`` (no gradient), which
  corrects for the engine's log-probs differing from the trainer's (TIS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

__all__ = [
    "PolicyLoss",
    "TokenRatioObjective",
    "SequenceRatioObjective",
    "TruncatedISObjective",
    "group_advantages",
    "clipped_policy_loss",
    "kl_k3",
    "missing_fields",
]


class PolicyLoss(Protocol):
    """What the ``policy`` role calls (module doc)."""

    def __call__(self, logprobs: torch.Tensor, batch, mask: torch.Tensor) -> tuple[torch.Tensor, dict]: ...


def group_advantages(rewards: torch.Tensor, group_size: int, *, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO advantages: reward minus its group mean (divided by the group std when ``scale``).

    Args:
        rewards: (num_groups * group_size,), float; groups are consecutive.
    Returns:
        (num_groups * group_size,), float32.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of {group_size}; "
            f"expected a 1-D tensor whose length is a multiple of the group size"
        )
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(1, keepdim=True)
    if scale and group_size > 1:
        centred = centred / (grouped.std(1, keepdim=True) + eps)
    return centred.reshape(-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimator ``exp(r) - r - 1`` with ``r = ref - logp`` (>= 0, unbiased)."""
    r = ref_logprobs - logprobs
    return torch.exp(r) - r - 1


def _surrogate(ratio, advantages, clip_low: float, clip_high: float):
    """``min(r A, clip(r, 1 - low, 1 + high) A)`` elementwise."""
    return torch.minimum(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, empty: float) -> torch.Tensor:
    """0-d float64 mean of ``x`` over ``mask``, ``empty`` when the mask is empty; no host sync."""
    n = mask.sum()
    mean = torch.where(mask, x.double(), 0.0).sum() / n.clamp(min=1)
    return torch.where(n > 0, mean, torch.full_like(mean, empty))


def _ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor, clip_low: float, clip_high: float) -> dict:
    """``ratio_mean``, ``ratio_max_dev``, ``clip_fraction`` over ``mask`` as 0-d device tensors (read by :func:`_read`)."""
    with torch.no_grad():
        r = ratio.detach()
        clipped = (r < 1 - clip_low) | (r > 1 + clip_high)
        dev = torch.where(mask, (r.double() - 1).abs(), 0.0)
        return {
            "ratio_mean": _masked_mean(r, mask, 1.0),
            "ratio_max_dev": dev.amax() if dev.numel() else dev.new_zeros(()),
            "clip_fraction": _masked_mean(clipped, mask, 0.0),
        }


def _kl_term(logprobs, ref_logprobs, mask, kl_coef: float):
    """(kl_coef * mean k3 over ``mask``, its detached 0-d tensor) or (0, None) without a reference."""
    if ref_logprobs is None:
        return 0.0, None
    kl = kl_k3(logprobs, torch.where(mask, ref_logprobs.detach(), logprobs.detach()))
    kl_mean = torch.where(mask, kl, torch.zeros_like(kl)).sum() / mask.sum().clamp(min=1)
    return (kl_coef * kl_mean if kl_coef > 0 else 0.0), kl_mean.detach()


def _read(metrics: dict) -> dict:
    """The 0-d metric tensors as Python floats, in ONE host read (the backward is not queued until it returns)."""
    names = [n for n, v in metrics.items() if isinstance(v, torch.Tensor)]
    if not names:
        return dict(metrics)
    values = torch.stack([metrics[n].detach().to(torch.float64) for n in names]).tolist()
    return {**metrics, **dict(zip(names, values))}


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: Optional[float] = None,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate with an optional KL-to-reference penalty (token mean).

    Args:
        logprobs: (B, A) float, differentiable.
        old_logprobs: (B, A) float, no grad.
        advantages: (B,) or (B, A) float.
        loss_mask: (B, A) bool.
        clip_eps / clip_eps_high: clip range ``[1 - clip_eps, 1 + clip_eps_high]``
            (``clip_eps_high`` defaults to ``clip_eps``).
        ref_logprobs: (B, A) float, required when ``kl_coef > 0``.
        weights: (B, A) float, no grad: per-token weights of the surrogate (truncated IS).

    Returns:
        loss: scalar, ``-mean(w * min(ratio * A, clip(ratio) * A)) + kl_coef * mean(kl)``.
        metrics: ``ratio_mean``, ``ratio_max_dev`` (max |ratio - 1|), ``clip_fraction``,
            ``kl`` (when a reference is given), as Python floats read in one host read.
    """
    loss, metrics = _clipped_policy_loss(
        logprobs, old_logprobs, advantages, loss_mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
        kl_coef=kl_coef, ref_logprobs=ref_logprobs, weights=weights,
    )
    return loss, _read(metrics)


def _clipped_policy_loss(logprobs, old_logprobs, advantages, loss_mask, *, clip_eps, clip_eps_high, kl_coef,
                         ref_logprobs, weights) -> tuple[torch.Tensor, dict]:
    """:func:`clipped_policy_loss` with its metrics left as 0-d device tensors."""
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs: run the reference role first or set kl_coef=0")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = loss_mask.bool()
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    # Masked positions are selected out before any arithmetic: a -inf or NaN there (an unscored
    # position's old or reference log-prob, a filtered trajectory's advantage) never reaches the loss.
    advantages = torch.where(mask, advantages, 0.0)
    if ref_logprobs is not None:
        ref_logprobs = torch.where(mask, ref_logprobs, logprobs.detach())
    denom = mask.sum().clamp(min=1)
    log_ratio = torch.where(mask, logprobs - torch.where(mask, old_logprobs.detach(), logprobs.detach()),
                            torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    surr = _surrogate(ratio, advantages, clip_eps, high)
    if weights is not None:
        surr = surr * torch.where(mask, weights.detach(), torch.zeros_like(weights))
    loss = -torch.where(mask, surr, torch.zeros_like(surr)).sum() / denom
    metrics = _ratio_metrics(ratio, mask, clip_eps, high)
    kl_loss, kl = _kl_term(logprobs, ref_logprobs, mask, kl_coef)
    if kl is not None:
        metrics["kl"] = kl
    return loss + kl_loss, metrics


def missing_fields(batch, names: tuple[str, ...]) -> list[str]:
    """The names in ``names`` whose attribute on ``batch`` is None."""
    return [n for n in names if getattr(batch, n, None) is None]


def _field(batch, name: str, like: torch.Tensor, optional: bool = False) -> Optional[torch.Tensor]:
    """``batch.<name>`` as ``like``'s (B, A) dtype and device, checked.

    ``advantages`` may be (B,) (one per trajectory, expanded over A). Masked positions are
    taken as they are: the losses select them out before any arithmetic.

    Raises:
        ValueError when the field is missing (unless ``optional``), not array-like or of another shape.
    """
    value = getattr(batch, name, None)
    if value is None:
        if optional:
            return None
        raise ValueError(f"the policy objective needs batch.{name}; run the role that produces it first (recompute, reference) or set it")
    try:
        value = torch.as_tensor(value).to(device=like.device, dtype=like.dtype)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"batch.{name} must be a float tensor shaped like the log-probs {tuple(like.shape)}, got "
                         f"{type(value).__name__} ({exc})") from None
    B, A = like.shape
    if name == "advantages" and tuple(value.shape) == (B,):
        value = value[:, None].expand(B, A)
    if tuple(value.shape) != (B, A):
        want = f"({B},) or ({B}, {A})" if name == "advantages" else f"({B}, {A})"
        raise ValueError(
            f"batch.{name} has shape {tuple(value.shape)}, expected {want}: the columns of loss_mask (a field set after "
            f"the batch was built is checked here; broadcasting it would change the loss)"
        )
    return value


def _check_shapes(logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(
            f"the policy objective takes logprobs and mask of one shape (B, A), got {tuple(logprobs.shape)} and "
            f"{tuple(mask.shape)}"
        )


class _ClippedRatio:
    """What the clipped objectives share: their clip and KL settings checked at construction, and
    the batch fields every one of them reads (``advantages``; ``ref_logprobs`` with a KL term)."""

    def __post_init__(self) -> None:
        _check_clip(type(self).__name__, self.clip_eps, self.clip_eps_high, self.kl_coef)

    def check(self, batch) -> list[str]:
        return missing_fields(batch, ("advantages",) + (("ref_logprobs",) if self.kl_coef > 0 else ()))


@dataclass(frozen=True)
class TokenRatioObjective(_ClippedRatio):
    """PPO/GRPO clipped surrogate with per-token ratios, plus ``kl_coef`` * k3 KL.

    Reads ``batch.advantages`` ((B,) or (B, A)), ``batch.old_logprobs`` (None: on-policy,
    the detached current log-probs, ratio 1) and ``batch.ref_logprobs`` (required when
    ``kl_coef > 0``; the KL is reported whenever it is present).
    """

    clip_eps: float = 0.2
    clip_eps_high: Optional[float] = None
    kl_coef: float = 0.0

    def __call__(self, logprobs: torch.Tensor, batch, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        _check_shapes(logprobs, mask)
        old = _field(batch, "old_logprobs", logprobs, optional=True)
        return clipped_policy_loss(
            logprobs, logprobs.detach() if old is None else old, _field(batch, "advantages", logprobs), mask,
            clip_eps=self.clip_eps, clip_eps_high=self.clip_eps_high, kl_coef=self.kl_coef,
            ref_logprobs=_field(batch, "ref_logprobs", logprobs, optional=True),
        )


@dataclass(frozen=True)
class SequenceRatioObjective(_ClippedRatio):
    """GSPO: a clipped surrogate over sequence-level ratios, plus ``kl_coef`` * k3 KL.

    ``s_i = exp(sum_t m_it (logp_it - old_it) / sum_t m_it)`` over trajectory i's loss-active
    tokens; per token the ratio is ``s_i * exp(logp_it - sg(logp_it))`` (value ``s_i``) and
    the loss is ``-mean_i mean_t min(s A_it, clip(s) A_it)`` over trajectories with at least
    one loss-active token. With advantages (B,) this is GSPO's
    ``-mean_i min(s_i A_i, clip(s_i) A_i)``. The GSPO paper clips at ``3e-4`` / ``4e-4``.
    Reads the same batch fields as :class:`TokenRatioObjective`.
    """

    clip_eps: float = 3e-4
    clip_eps_high: Optional[float] = 4e-4
    kl_coef: float = 0.0

    def __call__(self, logprobs: torch.Tensor, batch, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        _check_shapes(logprobs, mask)
        ref = _field(batch, "ref_logprobs", logprobs, optional=True)
        if self.kl_coef > 0 and ref is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs: run the reference role first or set kl_coef=0")
        old = _field(batch, "old_logprobs", logprobs, optional=True)
        old = logprobs.detach() if old is None else old
        mask = mask.bool()
        adv = torch.where(mask, _field(batch, "advantages", logprobs), 0.0)  # selected before any product (NaN there)
        counts = mask.sum(1)
        log_ratio = torch.where(mask, logprobs - old, torch.zeros_like(logprobs))
        seq_log_ratio = log_ratio.sum(1) / counts.clamp(min=1)
        # Value s_i at every token, gradient s_i * d logp_it (GSPO-token).
        ratio = torch.exp(seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach())
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        surr = _surrogate(ratio, adv, self.clip_eps, high)
        per_seq = torch.where(mask, surr, torch.zeros_like(surr)).sum(1) / counts.clamp(min=1)
        active = counts > 0
        loss = -(per_seq * active).sum() / active.sum().clamp(min=1)
        seq_ratio = torch.exp(seq_log_ratio.detach())
        metrics = _ratio_metrics(seq_ratio, active, self.clip_eps, high)
        kl_loss, kl = _kl_term(logprobs, ref, mask, self.kl_coef)
        if kl is not None:
            metrics["kl"] = kl
        return loss + kl_loss, _read(metrics)


@dataclass(frozen=True)
class TruncatedISObjective(_ClippedRatio):
    """:class:`TokenRatioObjective` with each token's term weighted by ``min(exp(old - rollout), cap)``.

    ``old`` is the trainer's old-policy log-prob (``batch.old_logprobs``, required) and
    ``rollout`` the engine's (``batch.rollout_logprobs``, required); the weight carries no
    gradient. Reports ``tis_weight_mean`` and ``tis_truncated_fraction`` (weights at the cap).
    """

    cap: float = 2.0
    clip_eps: float = 0.2
    clip_eps_high: Optional[float] = None
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.cap > 0:
            raise ValueError(f"TruncatedISObjective: cap must be > 0 (the largest importance weight), got {self.cap}")

    def check(self, batch) -> list[str]:
        return super().check(batch) + missing_fields(batch, ("old_logprobs", "rollout_logprobs"))

    def __call__(self, logprobs: torch.Tensor, batch, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        _check_shapes(logprobs, mask)
        old = _field(batch, "old_logprobs", logprobs)
        rollout = _field(batch, "rollout_logprobs", logprobs)
        mask = mask.bool()
        log_w = torch.where(mask, old - rollout, torch.zeros_like(old))
        weights = torch.exp(log_w).clamp(max=self.cap)
        loss, metrics = _clipped_policy_loss(
            logprobs, old, _field(batch, "advantages", logprobs), mask, clip_eps=self.clip_eps,
            clip_eps_high=self.clip_eps_high, kl_coef=self.kl_coef,
            ref_logprobs=_field(batch, "ref_logprobs", logprobs, optional=True), weights=weights,
        )
        metrics["tis_weight_mean"] = _masked_mean(weights, mask, 1.0)
        metrics["tis_truncated_fraction"] = _masked_mean(weights >= self.cap, mask, 0.0)
        return loss, _read(metrics)


def _check_clip(name: str, low: float, high: Optional[float], kl_coef: float) -> None:
    problems = []
    if not low > 0:
        problems.append(f"clip_eps must be > 0, got {low}")
    if high is not None and not high > 0:
        problems.append(f"clip_eps_high must be > 0 or None (= clip_eps), got {high}")
    if not kl_coef >= 0:
        problems.append(f"kl_coef must be >= 0, got {kl_coef}")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems))
