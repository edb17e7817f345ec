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


# ------------------------------------------------------------------ the objective plug point

from types import SimpleNamespace  # noqa: E402

from nemo_replay.objectives import SequenceRatioObjective, TokenRatioObjective, TruncatedISObjective  # noqa: E402


def _naive_gspo(lp, old, adv, mask, low, high, kl_coef=0.0, ref=None):
    """Sequence loop: -mean_i mean_t min(s A_it, clip(s) A_it), s_i = exp(mean_t (lp - old)).

    The per-token ratio is s_i * exp(lp_t - sg(lp_t)): value s_i, gradient s_i * d lp_t.
    """
    B, A = lp.shape
    seq_terms, kls = [], []
    for b in range(B):
        idx = [a for a in range(A) if mask[b, a]]
        if not idx:
            continue
        s = math.exp(sum(float(lp[b, a].detach() - old[b, a]) for a in idx) / len(idx))
        toks = []
        for a in idx:
            adv_ba = adv[b] if adv.dim() == 1 else adv[b, a]
            r = s * torch.exp(lp[b, a] - lp[b, a].detach())
            clipped = min(max(float(s), 1 - low), 1 + high)
            unclipped_wins = float(s) * float(adv_ba) <= clipped * float(adv_ba)
            toks.append(r * adv_ba if unclipped_wins else torch.tensor(clipped, dtype=lp.dtype) * adv_ba)
            if ref is not None:
                d = ref[b, a] - lp[b, a]
                kls.append(torch.exp(d) - d - 1)
        seq_terms.append(sum(toks) / len(toks))
    loss = -sum(seq_terms) / len(seq_terms)
    if kl_coef > 0:
        loss = loss + kl_coef * sum(kls) / len(kls)
    return loss


def _naive_tis(lp, old, rollout, adv, mask, cap, clip_eps):
    """Token loop: -mean_t min(exp(old - rollout), cap) * min(r A, clip(r) A)."""
    B, A = lp.shape
    terms = []
    for b in range(B):
        for a in range(A):
            if not mask[b, a]:
                continue
            w = min(float(torch.exp(old[b, a] - rollout[b, a])), cap)
            r = torch.exp(lp[b, a] - old[b, a])
            clipped = min(max(float(r.detach()), 1 - clip_eps), 1 + clip_eps)
            adv_ba = adv[b] if adv.dim() == 1 else adv[b, a]
            unclipped_wins = float((r * adv_ba).detach()) <= clipped * float(adv_ba)
            terms.append(w * (r * adv_ba if unclipped_wins else torch.tensor(clipped, dtype=lp.dtype) * adv_ba))
    return -sum(terms) / len(terms)


def _objective_batch(seed, per_token):
    lp, old, ref, mask, g = _batch(seed, B=5, A=11)
    adv = torch.randn(lp.shape if per_token else lp.shape[:1], generator=g, dtype=torch.float64)
    rollout = old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.5
    return lp, SimpleNamespace(old_logprobs=old, ref_logprobs=ref, advantages=adv, rollout_logprobs=rollout), mask


@pytest.mark.parametrize("per_token", [False, True])
def test_token_ratio_objective_is_the_clipped_loss(per_token):
    lp, batch, mask = _objective_batch(5, per_token)
    obj = TokenRatioObjective(clip_eps=0.2, kl_coef=0.1)
    loss, metrics = obj(lp, batch, mask)
    naive = _naive_loss(lp, batch.old_logprobs, batch.advantages, mask, 0.2, 0.1, batch.ref_logprobs)
    assert abs(float(loss.detach()) - float(naive.detach())) < 1e-12
    torch.testing.assert_close(torch.autograd.grad(loss, lp)[0], torch.autograd.grad(naive, lp)[0], atol=1e-12, rtol=0)
    assert 0 < metrics["clip_fraction"] < 1
    # Without old log-probs the objective is on-policy: ratio 1 in value.
    on_policy, m = obj(lp, SimpleNamespace(**{**vars(batch), "old_logprobs": None}), mask)
    assert m["ratio_max_dev"] == 0.0 and torch.isfinite(on_policy)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_sequence_ratio_objective_against_a_sequence_loop(per_token, kl_coef):
    lp, batch, mask = _objective_batch(6, per_token)
    # A clip range the sequence ratios straddle: some sequences clip, others do not.
    obj = SequenceRatioObjective(clip_eps=0.05, clip_eps_high=0.08, kl_coef=kl_coef)
    loss, metrics = obj(lp, batch, mask)
    naive = _naive_gspo(lp, batch.old_logprobs, batch.advantages, mask, 0.05, 0.08, kl_coef, batch.ref_logprobs)
    assert abs(float(loss.detach()) - float(naive.detach())) < 1e-12
    (g1,) = torch.autograd.grad(loss, lp)
    (g2,) = torch.autograd.grad(naive, lp)
    torch.testing.assert_close(g1, g2, atol=1e-12, rtol=0)
    assert g1.abs().sum() > 0 and (g1[~mask] == 0).all()
    seq = torch.exp(((lp.detach() - batch.old_logprobs) * mask).sum(1) / mask.sum(1).clamp(min=1))[mask.any(1)]
    assert metrics["ratio_mean"] == pytest.approx(float(seq.mean()))
    assert 0 < metrics["clip_fraction"] < 1


def test_sequence_ratio_with_sequence_advantages_is_gspo():
    """With advantages (B,) the loss is -mean_i min(s_i A_i, clip(s_i) A_i) and its gradient GSPO's."""
    lp, batch, mask = _objective_batch(7, per_token=False)
    obj = SequenceRatioObjective(clip_eps=0.05, clip_eps_high=0.05)
    loss, _ = obj(lp, batch, mask)
    n = mask.sum(1)
    active = n > 0
    s = torch.exp(((lp - batch.old_logprobs) * mask).sum(1) / n.clamp(min=1))  # differentiable s_i
    adv = batch.advantages
    gspo = -(torch.minimum(s * adv, s.clamp(0.95, 1.05) * adv)[active]).mean()
    assert abs(float(loss.detach()) - float(gspo.detach())) < 1e-12
    torch.testing.assert_close(torch.autograd.grad(loss, lp)[0], torch.autograd.grad(gspo, lp)[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("per_token", [False, True])
def test_truncated_is_objective_against_a_token_loop(per_token):
    lp, batch, mask = _objective_batch(8, per_token)
    obj = TruncatedISObjective(cap=1.5, clip_eps=0.2)
    loss, metrics = obj(lp, batch, mask)
    naive = _naive_tis(lp, batch.old_logprobs, batch.rollout_logprobs, batch.advantages, mask, 1.5, 0.2)
    assert abs(float(loss.detach()) - float(naive.detach())) < 1e-12
    torch.testing.assert_close(torch.autograd.grad(loss, lp)[0], torch.autograd.grad(naive, lp)[0], atol=1e-12, rtol=0)
    w = torch.exp(batch.old_logprobs - batch.rollout_logprobs)[mask]
    assert metrics["tis_truncated_fraction"] == pytest.approx(float((w >= 1.5).double().mean()))
    assert 0 < metrics["tis_truncated_fraction"] < 1
    # Rollout log-probs equal to the old ones (what replay gives): weight 1, the token objective.
    same = SimpleNamespace(**{**vars(batch), "rollout_logprobs": batch.old_logprobs})
    plain, _ = TokenRatioObjective(clip_eps=0.2)(lp, same, mask)
    assert float(obj(lp, same, mask)[0].detach()) == pytest.approx(float(plain.detach()), abs=1e-15)


def test_objectives_name_what_they_need():
    empty = SimpleNamespace(advantages=None, old_logprobs=None, ref_logprobs=None, rollout_logprobs=None)
    assert TokenRatioObjective().check(empty) == ["advantages"]
    assert TokenRatioObjective(kl_coef=0.1).check(empty) == ["advantages", "ref_logprobs"]
    assert SequenceRatioObjective().check(empty) == ["advantages"]
    assert TruncatedISObjective().check(empty) == ["advantages", "old_logprobs", "rollout_logprobs"]
    with pytest.raises(ValueError, match=r"TruncatedISObjective: cap must be > 0"):
        TruncatedISObjective(cap=0.0)
    with pytest.raises(ValueError, match=r"TokenRatioObjective: clip_eps must be > 0, got 0.0; kl_coef must be >= 0"):
        TokenRatioObjective(clip_eps=0.0, kl_coef=-1.0)
    lp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"the policy objective needs batch.advantages"):
        TokenRatioObjective()(lp, empty, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"logprobs and mask of one shape \(B, A\), got \(2, 3\) and \(2, 2\)"):
        SequenceRatioObjective()(lp, empty, torch.ones(2, 2, dtype=torch.bool))


@pytest.mark.parametrize("make", [lambda: TokenRatioObjective(kl_coef=0.1), lambda: SequenceRatioObjective(kl_coef=0.1),
                                  lambda: TruncatedISObjective(kl_coef=0.1)])
def test_objective_metrics_cost_one_host_read(make):
    """Metrics are read in one host read per micro-batch (the backward waits behind each read), with the
    empty-mask defaults kept."""
    from benchmarks.syncs import HostReads

    lp, batch, mask = _objective_batch(9, per_token=True)
    obj = make()
    with HostReads() as reads:
        _, metrics = obj(lp, batch, mask)
    assert reads.total == 1, dict(reads.where)
    assert all(isinstance(v, float) for v in metrics.values()), metrics
    _, empty = obj(lp, batch, torch.zeros_like(mask))
    assert empty["ratio_mean"] == 1.0 and empty["ratio_max_dev"] == 0.0 and empty["clip_fraction"] == 0.0
    if isinstance(obj, TruncatedISObjective):
        assert empty["tis_weight_mean"] == 1.0 and empty["tis_truncated_fraction"] == 0.0


@pytest.mark.parametrize("make", [
    lambda: TokenRatioObjective(clip_eps=0.2, kl_coef=0.1),
    lambda: SequenceRatioObjective(clip_eps=0.05, clip_eps_high=0.08, kl_coef=0.1),
    lambda: TruncatedISObjective(cap=2.0, kl_coef=0.1),
], ids=["token", "sequence", "tis"])
def test_masked_positions_never_reach_the_loss_whatever_they_hold(make):
    """-inf reference / old / rollout log-probs and NaN advantages at masked positions (unscored
    tokens, a filtered trajectory) give the loss and gradient of finite values there, not NaN."""
    lp, batch, mask = _objective_batch(8, per_token=True)
    obj = make()
    clean_loss, _ = obj(lp, batch, mask)
    clean_grad = torch.autograd.grad(clean_loss, lp)[0]
    dirty = SimpleNamespace(**{k: v.clone() for k, v in vars(batch).items()})
    dirty.ref_logprobs[~mask] = -math.inf
    dirty.old_logprobs[~mask] = math.inf
    dirty.rollout_logprobs[~mask] = -math.inf
    dirty.advantages[~mask] = math.nan
    loss, _ = obj(lp, dirty, mask)
    grad = torch.autograd.grad(loss, lp)[0]
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert float(loss.detach()) == pytest.approx(float(clean_loss.detach()), abs=1e-12)
    torch.testing.assert_close(grad, clean_grad, atol=1e-12, rtol=0)
    # clipped_policy_loss itself, the public function, selects too.
    direct, _ = clipped_policy_loss(lp, dirty.old_logprobs, dirty.advantages, mask, kl_coef=0.1, ref_logprobs=dirty.ref_logprobs)
    assert torch.isfinite(direct)


def test_fields_set_after_the_batch_was_built_are_checked_for_shape():
    """With B = 1, advantages of shape (3,) broadcast over A and tripled the loss; a (B, A - 1)
    old_logprobs gave a raw broadcast error after the forward."""
    from nemo_replay.batch import ReplayBatch
    from nemo_replay.strategies.base import check_policy_batches

    lp, batch, mask = _objective_batch(9, per_token=False)
    one = SimpleNamespace(**{k: v[:1] for k, v in vars(batch).items()})
    one.advantages = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"batch.advantages has shape \(3,\), expected \(1,\) or \(1, 11\)"):
        TokenRatioObjective()(lp[:1], one, mask[:1])
    wrong = SimpleNamespace(**{**vars(batch), "old_logprobs": batch.old_logprobs[:, :-1]})
    with pytest.raises(ValueError, match=r"batch.old_logprobs has shape \(5, 10\), expected \(5, 11\)"):
        TokenRatioObjective()(lp, wrong, mask)
    seq = torch.arange(1, 13).view(2, 6)
    real = torch.ones(2, 6, dtype=torch.bool)
    built = ReplayBatch(seq, real, torch.tensor([3, 3]), torch.ones(2, 3, dtype=torch.bool), advantages=torch.ones(2))
    built.old_logprobs = torch.zeros(2, 2)  # set after construction, the wrong width
    with pytest.raises(ValueError, match=r"micro-batch 0: old_logprobs has shape \(2, 2\), expected \(2, 3\)"):
        check_policy_batches([built], TokenRatioObjective())
    with pytest.raises(ValueError, match=r"ReplayBatch.sequences must be a torch.Tensor, got numpy.ndarray; wrap it"):
        ReplayBatch(seq.numpy(), real, torch.tensor([3, 3]), torch.ones(2, 3, dtype=torch.bool))
