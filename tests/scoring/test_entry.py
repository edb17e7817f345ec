"""The scorer's one entry point, ``score_positions``: the support-or-vocabulary choice, the
context its errors carry, and the channels type every caller builds (docs/design.md §4).

Two gloo ranks failing together through it run in ``test_collectives.py`` (one spawn)."""

from __future__ import annotations

import pytest
import torch

from nemo_replay.scoring.entry import ScorerChannels, check_together, flag_device, score_positions
from nemo_replay.support.errors import SupportAlignmentError
from tests.scoring.batches import make_case
from tests.scoring.reference import reference_scores

T = 0.7


@pytest.fixture(scope="module")
def case():
    return make_case(B=3, T=29, V=211, k=6, seed=3, eos=(1,))


def channels_of(case) -> ScorerChannels:
    return ScorerChannels(case.sampled_ids, case.row_ids, case.loss_mask, case.trajectory_ids)


def test_replay_scores_each_position_over_its_row_forward_and_backward(case):
    logits = case.logits.clone().requires_grad_(True)
    got = score_positions(logits, channels_of(case), case.support, temperature=T, compute_entropy=True)
    want = reference_scores(case.logits, case.sampled_ids, case.row_ids, case.loss_mask, case.sets, temperature=T)
    assert torch.equal(got.valid_mask, want["valid"]) and torch.equal(got.fallback_mask, want["fallback"])
    assert got.fallback_mask.any()  # the synthetic EOS of trajectory 1 is scored over the vocabulary
    torch.testing.assert_close(got.logprobs, want["logprobs"], rtol=0, atol=1e-12)
    torch.testing.assert_close(got.entropy, want["entropy"], rtol=0, atol=1e-12)
    weights = torch.randn(got.logprobs.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad((got.logprobs * weights).sum(), logits)
    ref_logits = case.logits.clone().requires_grad_(True)
    ref = reference_scores(ref_logits, case.sampled_ids, case.row_ids, case.loss_mask, case.sets, temperature=T)
    (ref_grad,) = torch.autograd.grad((ref["logprobs"] * weights).sum(), ref_logits)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)


def test_without_replay_every_real_position_is_scored_over_the_vocabulary(case):
    got = score_positions(case.logits, channels_of(case), None, replay=False, temperature=T)
    real = case.trajectory_ids >= 0
    z = torch.log_softmax(case.logits / T, dim=-1).gather(-1, case.sampled_ids.clamp_min(0)[..., None]).squeeze(-1)
    assert torch.equal(got.fallback_mask, real) and not got.valid_mask.any()
    torch.testing.assert_close(got.logprobs, torch.where(real, z, torch.zeros_like(z)), rtol=0, atol=1e-12)


def test_a_replaying_call_without_rows_names_the_fix(case):
    with pytest.raises(ValueError, match=r"support=None.*replay=False"):
        score_positions(case.logits, channels_of(case), None)


def test_errors_carry_the_caller_s_context_and_keep_their_type(case):
    sampled = case.sampled_ids.clone()
    b, t = (int(v) for v in torch.nonzero(case.loss_mask & (case.row_ids >= 0))[0])
    members = set(case.sets[int(case.row_ids[b, t])])
    sampled[b, t] = next(v for v in range(211) if v not in members)
    bad = channels_of(case)._replace(sampled_ids=sampled)
    with pytest.raises(SupportAlignmentError, match=rf"^my trainer \(trajectory = completion\): trajectory {b}, "):
        score_positions(case.logits, bad, case.support, context="my trainer (trajectory = completion)")


def test_token_positions_name_the_caller_s_column(case):
    sampled = case.sampled_ids.clone()
    b, t = (int(v) for v in torch.nonzero(case.loss_mask & (case.row_ids >= 0))[0])
    sampled[b, t] = next(v for v in range(211) if v not in set(case.sets[int(case.row_ids[b, t])]))
    columns = torch.arange(case.sampled_ids.shape[1]).expand_as(sampled) + 100
    bad = ScorerChannels(sampled, case.row_ids, case.loss_mask, case.trajectory_ids, columns)
    with pytest.raises(SupportAlignmentError, match=rf"trajectory {b}, token position {t + 100}:"):
        score_positions(case.logits, bad, case.support)


def test_without_a_group_checks_run_once_and_the_flag_stays_with_the_tensors():
    calls = []
    assert check_together(lambda: calls.append(1) or "ok", None, name="worker", device="cpu") == "ok" and calls == [1]
    assert flag_device(None, torch.device("meta")) == torch.device("meta")
