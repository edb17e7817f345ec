"""The policy objective shared by every strategy's ``policy`` role: GRPO/PPO clip + KL.

All tensors are response-aligned and broadcastable to ``logprobs``; reductions are token
means over ``loss_mask``.
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "clipped_policy_loss", "kl_k3"]


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


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate with an optional KL-to-reference penalty.

    Args:
        logprobs: (B, A) float, differentiable.
        old_logprobs: (B, A) float, no grad.
        advantages: (B,) or (B, A) float.
        loss_mask: (B, A) bool.
        ref_logprobs: (B, A) float, required when ``kl_coef > 0``.

    Returns:
        loss: scalar, ``-mean(min(ratio * A, clip(ratio) * A)) + kl_coef * mean(kl)``.
        metrics: ``ratio_mean``, ``ratio_max_dev`` (max |ratio - 1|), ``clip_fraction``,
            ``kl`` (when a reference is given), as Python floats.
    """
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs: run the reference role first or set kl_coef=0")
    mask = loss_mask.bool()
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    denom = mask.sum().clamp(min=1)
    log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    surr = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    loss = -(surr * mask).sum() / denom
    metrics = {}
    with torch.no_grad():
        r = ratio[mask]
        metrics["ratio_mean"] = float(r.mean()) if r.numel() else 1.0
        metrics["ratio_max_dev"] = float((r - 1).abs().max()) if r.numel() else 0.0
        metrics["clip_fraction"] = float(((r - 1).abs() > clip_eps).float().mean()) if r.numel() else 0.0
    if ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs.detach())
        kl_mean = (kl * mask).sum() / denom
        metrics["kl"] = float(kl_mean.detach())
        if kl_coef > 0:
            loss = loss + kl_coef * kl_mean
    return loss, metrics
