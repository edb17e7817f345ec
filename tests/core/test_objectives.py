"""The policy objective: clipped surrogate, KL k3, GRPO group advantages, against naive loops."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_replay.objectives import clipped_policy_loss, group_advantages, kl_k3


def _naive_loss(lp, old, adv, mask, clip_eps, kl_coef=0.0, ref=None):
    """Token loop: -mean over masked tokens of min(r A, clip(r) A) (+ kl_coef * mean k3)."""
    B, A = lp.shape
    terms, kls = [], []
    for b in range(B):
        for a in range(A):
            if not mask[b, a]:
                continue
            adv_ba = adv[b] if adv.dim() == 1 else adv[b, a]
            r = torch.exp(lp[b, a] - old[b, a])
            clipped = min(max(float(r.detach()), 1 - clip_eps), 1 + clip_eps)
            # min(r A, clip(r) A): where the clipped branch wins it is a constant in r.
            unclipped_wins = float((r * adv_ba).detach()) <= clipped * float(adv_ba)
            terms.append(r * adv_ba if unclipped_wins else torch.tensor(clipped, dtype=lp.dtype) * adv_ba)
            if ref is not None:
                d = ref[b, a] - lp[b, a]
                kls.append(torch.exp(d) - d - 1)
    n = max(len(terms), 1)
    loss = -sum(terms) / n if terms else lp.sum() * 0
    if kl_coef > 0:
        loss = loss + kl_coef * sum(kls) / n
    return loss


def _batch(seed, B=4, A=9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, A, generator=g, dtype=torch.float64) * 3
    lp = (old + torch.randn(B, A, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    ref = old + torch.randn(B, A, generator=g, dtype=torch.float64) * 0.2
    mask = torch.rand(B, A, generator=g) < 0.7
    mask[0] = False  # one trajectory with nothing to learn from
    return lp, old, ref, mask, g


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_matches_naive_loop_values_and_grads(per_token, kl_coef):
    lp, old, ref, mask, g = _batch(1)
    adv = torch.randn(lp.shape if per_token else lp.shape[:1], generator=g, dtype=torch.float64)
    loss, metrics = clipped_policy_loss(lp, old, adv, mask, clip_eps=0.2, kl_coef=kl_coef, ref_logprobs=ref)
    naive = _naive_loss(lp, old, adv, mask, 0.2, kl_coef, ref)
    assert abs(float(loss.detach()) - float(naive.detach())) < 1e-12
    (g1,) = torch.autograd.grad(loss, lp)
    (g2,) = torch.autograd.grad(naive, lp)
    torch.testing.assert_close(g1, g2, atol=1e-12, rtol=0)
    r = torch.exp(lp.detach() - old)[mask]
    assert metrics["ratio_mean"] == pytest.approx(float(r.mean()))
    assert metrics["ratio_max_dev"] == pytest.approx(float((r - 1).abs().max()))
    assert metrics["clip_fraction"] == pytest.approx(float(((r - 1).abs() > 0.2).double().mean()))
    assert 0 < metrics["clip_fraction"] < 1  # the batch exercises both branches
    d = ref - lp.detach()
    kl = torch.exp(d) - d - 1
    assert metrics["kl"] == pytest.approx(float(kl[mask].mean()))


def test_ratio_one_gives_minus_mean_advantage():
    lp, _, _, mask, g = _batch(2)
    adv = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    loss, metrics = clipped_policy_loss(lp, lp.detach(), adv, mask)
    assert float(loss.detach()) == pytest.approx(-float(adv[mask].mean()), abs=1e-12)
    assert metrics["ratio_mean"] == 1.0 and metrics["ratio_max_dev"] == 0.0 and metrics["clip_fraction"] == 0.0
    (grad,) = torch.autograd.grad(loss, lp)
    # d/d lp of -mean(r A) at r = 1 is -A / n on masked tokens, 0 elsewhere.
    torch.testing.assert_close(grad, torch.where(mask, -adv / mask.sum(), 0.0), atol=1e-15, rtol=0)


def test_empty_mask_and_kl_errors():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = clipped_policy_loss(lp, lp.detach(), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    assert float(loss.detach()) == 0.0 and not math.isnan(metrics["ratio_mean"])
    with pytest.raises(ValueError, match=r"kl_coef > 0 needs ref_logprobs: run the reference role first or set kl_coef=0"):
        clipped_policy_loss(lp, lp.detach(), torch.ones(2), torch.ones(2, 3, dtype=torch.bool), kl_coef=0.1)


def test_kl_k3_is_nonnegative_and_zero_at_equality():
    a = torch.linspace(-5, 0, 11, dtype=torch.float64)
    b = a.flip(0)
    assert torch.all(kl_k3(a, a) == 0)
    k = kl_k3(a, b)
    torch.testing.assert_close(k, torch.exp(b - a) - (b - a) - 1)
    assert torch.all(k >= 0) and torch.all(k[a != b] > 0)


def test_group_advantages_against_loop():
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(12, generator=g)
    got = group_advantages(rewards, 4)
    raw = group_advantages(rewards, 4, scale=False)
    for grp in range(3):
        r = rewards[grp * 4 : grp * 4 + 4].tolist()
        mean = sum(r) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / 3)  # unbiased, like torch.std
        for i, x in enumerate(r):
            assert float(raw[grp * 4 + i]) == pytest.approx(x - mean, abs=1e-6)
            assert float(got[grp * 4 + i]) == pytest.approx((x - mean) / (std + 1e-6), abs=1e-5)
    assert got.dtype == torch.float32
    assert torch.all(group_advantages(rewards, 1) == 0)
    same = group_advantages(torch.ones(6), 3)
    assert torch.all(same == 0) and not torch.isnan(same).any()


@pytest.mark.parametrize("rewards, size", [(torch.ones(7), 2), (torch.ones(2, 4), 4), (torch.ones(4), 0)])
def test_group_advantages_errors(rewards, size):
    with pytest.raises(ValueError, match=rf"cannot be split into groups of {size}; expected a 1-D tensor"):
        group_advantages(rewards, size)
