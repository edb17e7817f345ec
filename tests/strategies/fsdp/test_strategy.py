"""The fsdp strategy on one process (no FSDP wrapping): roles against float64 references."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_replay import get_strategy
from nemo_replay.batch import ReplayBatch
from nemo_replay.strategies.base import RoleSettings
from nemo_replay.strategies.fsdp import FSDPStrategy
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport
from tests.strategies.fsdp.fixtures import (
    BATCH_A,
    BATCH_B,
    canonical_from_response,
    make_batch,
    reference_entropy_and_mass,
    reference_full_positions,
    OBJECTIVE,
    reference_policy_grads,
    reference_scores,
    tiny_llama,
    with_old_and_ref,
)

TOL = dict(rtol=1e-9, atol=1e-10)
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


@pytest.fixture(scope="module")
def reference_model(model):
    from tests.strategies.fsdp.fixtures import plain_copy

    return plain_copy(model)


def _batches(ref):
    return [with_old_and_ref(ref, make_batch(**spec), TEMPERATURE) for spec in (BATCH_A, BATCH_B)]


def test_registry_builds_the_strategy():
    strategy = get_strategy("fsdp").factory(remove_padding=False)
    assert isinstance(strategy, FSDPStrategy) and strategy.name == "fsdp" and not strategy.remove_padding


@pytest.mark.parametrize("remove_padding", [True, False], ids=["unpadded", "padded"])
def test_roles_match_reference_hidden_equals_logits(model, reference_model, remove_padding):
    batches = _batches(reference_model)
    strategy = FSDPStrategy(remove_padding=remove_padding)
    want_grads = reference_policy_grads(reference_model, batches, TEMPERATURE)
    got = {}
    for source in ("logits", "hidden"):
        settings = RoleSettings(temperature=TEMPERATURE, source=source)
        for role in ("recompute", "reference"):
            outs = strategy.run_role(role, model, batches, settings)
            for batch, out in zip(batches, outs):
                with torch.no_grad():
                    want, valid, fallback = reference_scores(reference_model, batch, temperature=TEMPERATURE)
                S = batch.seq_len
                torch.testing.assert_close(out.logprobs, canonical_from_response(want, S), **TOL)
                assert torch.equal(out.valid_mask, canonical_from_response(valid, S))
                assert torch.equal(out.fallback_mask, canonical_from_response(fallback, S))
                assert not out.logprobs.requires_grad
            assert fallback.any(), "the batch must exercise the synthetic-EOS fallback"
        # Entropy (and, from logits, the support's log-mass) come back in canonical columns too.
        extra = RoleSettings(
            temperature=TEMPERATURE, source=source, compute_entropy=True, compute_support_mass=source == "logits"
        )
        for batch, out in zip(batches, strategy.run_role("recompute", model, batches, extra)):
            with torch.no_grad():
                entropy, logmass = reference_entropy_and_mass(reference_model, batch, temperature=TEMPERATURE)
            torch.testing.assert_close(out.entropy, canonical_from_response(entropy, batch.seq_len), **TOL)
            if source == "logits":
                torch.testing.assert_close(out.support_logmass, canonical_from_response(logmass, batch.seq_len), **TOL)
            else:
                assert out.support_logmass is None
        model.zero_grad(set_to_none=True)
        outs = strategy.run_role("policy", model, batches, settings, loss_fn=OBJECTIVE)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        for name, g in want_grads.items():
            torch.testing.assert_close(grads[name], g, **TOL, msg=lambda m: f"{source} grad {name}: {m}")
        got[source] = (outs, grads)
    # Hidden mode equals logits mode, values and gradients.
    for a, b in zip(got["logits"][0], got["hidden"][0]):
        torch.testing.assert_close(a.logprobs, b.logprobs, **TOL)
        torch.testing.assert_close(a.loss, b.loss, **TOL)
    for name in got["logits"][1]:
        torch.testing.assert_close(got["logits"][1][name], got["hidden"][1][name], **TOL)
    assert got["logits"][1]["lm_head.weight"].abs().max() > 0


@pytest.mark.parametrize("source", ["logits", "hidden"])
def test_csr_rows_score_and_train_bit_for_bit_as_the_fixed_width_rows(model, reference_model, source):
    """Rows that cost what they hold change no number: every output and gradient is the fixed-width run's."""
    fixed = _batches(reference_model)
    assert all(isinstance(b.support, PackedTensor) for b in fixed)
    csr = [dataclasses.replace(b, support=RaggedSupport.of(b.support)) for b in fixed]
    strategy = FSDPStrategy()
    settings = RoleSettings(temperature=TEMPERATURE, source=source, compute_entropy=True,
                            compute_support_mass=source == "logits")
    runs = []
    for batches in (fixed, csr):
        outs = strategy.run_role("recompute", model, batches, settings)
        model.zero_grad(set_to_none=True)
        policy = strategy.run_role("policy", model, batches, settings, loss_fn=OBJECTIVE)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        runs.append((outs + policy, grads))
    (outs_a, grads_a), (outs_b, grads_b) = runs
    for a, b in zip(outs_a, outs_b):
        for key in ("logprobs", "valid_mask", "fallback_mask", "entropy", "support_logmass", "loss"):
            x, y = getattr(a, key), getattr(b, key)
            assert (x is None and y is None) or torch.equal(x, y), key
    for name, g in grads_a.items():
        assert torch.equal(g, grads_b[name]), name


def test_replay_off_and_full_vocab_reference(model, reference_model):
    batch = make_batch(**BATCH_A)
    strategy = FSDPStrategy()
    with torch.no_grad():
        want = reference_full_positions(reference_model, batch, temperature=TEMPERATURE)
        replay_lp, _, _ = reference_scores(reference_model, batch, temperature=TEMPERATURE)
    real = batch.attention_mask[:, :-1]
    for source in ("logits", "hidden"):
        off = strategy.run_role("recompute", model, [batch], RoleSettings(replay=False, temperature=TEMPERATURE, source=source))[0]
        torch.testing.assert_close(off.logprobs, want, **TOL)
        assert torch.equal(off.fallback_mask, real) and not off.valid_mask.any()
        ref = strategy.run_role(
            "reference", model, [batch], RoleSettings(temperature=TEMPERATURE, source=source, reference_full_vocab=True)
        )[0]
        torch.testing.assert_close(ref.logprobs, want, **TOL)
    # Replay changes the answer: the support normalisation is not the full vocabulary's.
    active = batch.loss_mask
    assert (replay_lp[active] - want[:, -batch.response_width :][active]).abs().max() > 1e-3


def test_swapped_support_trips_the_alignment_guard(model):
    batch = make_batch(**BATCH_B)  # two trajectories with 4 response rows each
    swapped = make_batch(**BATCH_B)
    swapped.support = batch.support.gather([1, 0])
    strategy = FSDPStrategy()
    settings = RoleSettings(temperature=TEMPERATURE)
    strategy.run_role("recompute", model, [batch], settings)
    # The error names the first bad token by trajectory and its column in sequences (a loop over the
    # canonical channels: column c of the logits predicts the token at column c + 1).
    from nemo_replay.layout.canonical import canonical_channels

    ch = canonical_channels(swapped)
    bad = next((b, c) for b in range(ch.row_ids.shape[0]) for c in range(ch.row_ids.shape[1])
               if ch.loss_mask[b, c] and int(ch.row_ids[b, c]) >= 0
               and int(ch.sampled_ids[b, c]) not in swapped.support.values[int(ch.row_ids[b, c])].tolist())
    for remove_padding in (True, False):
        with pytest.raises(ValueError, match=rf"trajectory {bad[0]}, token position {bad[1] + 1}: sampled token "
                                             rf"{int(ch.sampled_ids[bad])} is not a member of its support row"):
            FSDPStrategy(remove_padding=remove_padding).run_role("recompute", model, [swapped], settings)


def test_replay_needs_support_and_policy_needs_advantages(model):
    batch = make_batch(**BATCH_B)
    batch.support = None
    with pytest.raises(ValueError, match="carries none"):
        FSDPStrategy().run_role("recompute", model, [batch], RoleSettings())
    # A later micro-batch without rows is refused, by index, before the first one's forward runs.
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=r"^micro-batch 1: role 'recompute' replays .* carries none"):
            FSDPStrategy().run_role("recompute", model, [make_batch(**BATCH_B), batch], RoleSettings())
    finally:
        hook.remove()
    assert forwards == []
    batch = make_batch(**BATCH_B)
    batch.advantages = None
    with pytest.raises(ValueError, match="advantages"):
        FSDPStrategy().run_role("policy", model, [batch], RoleSettings())


# ------------------------------------------------------------------ the loss plug point, other paddings


def _split_padded(batch):
    """Left-padded prompts ending at one column, right-padded completions; token-aligned [B, S'] fields.

    The layout of a generation buffer: ``_ p0 p1 | r0 r1 r2 _`` with ``|`` at a fixed column.
    """
    B, S = batch.sequences.shape
    A = batch.response_width
    L = batch.attention_mask.sum(1)
    R = batch.response_lengths
    P = L - R
    cut, width = int(P.max()), int(P.max() + R.max()) + 1
    seq = torch.zeros(B, width, dtype=torch.int64)
    am = torch.zeros(B, width, dtype=torch.bool)
    fields = {n: torch.zeros(B, width, dtype=torch.float64) for n in ("old_logprobs", "ref_logprobs", "rollout_logprobs")}
    lm = torch.zeros(B, width, dtype=torch.bool)
    for i in range(B):
        s, n = cut - int(P[i]), int(L[i])
        seq[i, s : s + n] = batch.sequences[i, S - n :]
        am[i, s : s + n] = True
        # Response column a of the left-padded [B, A] window is token S - A + a there, s + n - A + a here.
        lo = max(A - n, 0)
        lm[i, s + n - A + lo : s + n] = batch.loss_mask[i, lo:]
        for name in fields:
            fields[name][i, s + n - A + lo : s + n] = getattr(batch, name)[i, lo:]
    return ReplayBatch(seq, am, R.clone(), lm, support=batch.support, advantages=batch.advantages, **fields)


def _tis_batches(ref):
    out = []
    for spec in (BATCH_A, BATCH_B):
        b = with_old_and_ref(ref, make_batch(**spec), TEMPERATURE)
        b.rollout_logprobs = b.old_logprobs + 0.4 * torch.cos(torch.arange(b.old_logprobs.numel(), dtype=torch.float64)).view_as(b.old_logprobs)
        out.append(b)
    return out


def test_caller_objective_on_split_padding_matches_its_naive_reference(model, reference_model):
    from nemo_replay.objectives import TruncatedISObjective

    batches = _tis_batches(reference_model)
    tis = TruncatedISObjective(cap=1.3, clip_eps=0.2, kl_coef=0.1)
    reference_model.zero_grad(set_to_none=True)
    for b in batches:
        lp, _, _ = reference_scores(reference_model, b, temperature=TEMPERATURE)
        loss, metrics = tis(lp, b, b.loss_mask)
        (loss / len(batches)).backward()
        assert 0 < metrics["tis_truncated_fraction"] < 1  # the cap binds on some tokens, not all
    want = {n: p.grad.detach().clone() for n, p in reference_model.named_parameters()}
    reference_model.zero_grad(set_to_none=True)
    split = [_split_padded(b) for b in batches]
    settings = RoleSettings(temperature=TEMPERATURE)
    for remove_padding in (True, False):
        model.zero_grad(set_to_none=True)
        outs = FSDPStrategy(remove_padding=remove_padding).run_role("policy", model, split, settings, loss_fn=tis)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name], **TOL, msg=lambda m: f"{name}: {m}")
        assert all("tis_weight_mean" in o.metrics and o.loss is not None for o in outs)
    # Token-aligned outputs: each loss-active token's log-prob in its own column.
    out = FSDPStrategy().run_role("recompute", model, split, settings)
    for b, sb, o in zip(batches, split, out):
        with torch.no_grad():
            want_lp, _, _ = reference_scores(reference_model, b, temperature=TEMPERATURE)
        view = o.response(sb.response_width)
        assert view.logprobs.shape == sb.sequences.shape
        for i in range(b.batch_size):
            torch.testing.assert_close(view.logprobs[i][sb.loss_mask[i]], want_lp[i][b.loss_mask[i]], **TOL)
    model.zero_grad(set_to_none=True)


def test_score_hands_out_differentiable_logprobs_for_the_callers_backward(model, reference_model):
    from nemo_replay.objectives import SequenceRatioObjective

    batches = _batches(reference_model)
    gspo = SequenceRatioObjective(clip_eps=0.1, kl_coef=0.05)
    settings = RoleSettings(temperature=TEMPERATURE)
    strategy = FSDPStrategy()
    model.zero_grad(set_to_none=True)
    strategy.run_role("policy", model, batches, settings, loss_fn=gspo)
    inside = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for b in batches:  # the trainer owns the loss and the backward
        out = strategy.score(model, b, settings)
        assert out.logprobs.requires_grad
        loss, _ = gspo(out.response(b.response_width).logprobs, b, b.loss_mask)
        (loss / len(batches)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, inside[name], **TOL)
    assert max(float(g.abs().max()) for g in inside.values()) > 0
    assert not strategy.score(model, batches[0], settings, role="recompute").logprobs.requires_grad
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="loss_fn applies to the policy role only; the recompute role runs forward only"):
        strategy.run_role("recompute", model, batches, settings, loss_fn=gspo)
    with pytest.raises(ValueError, match=r"loss_fn must be callable as loss_fn\(logprobs \(B, A\), batch, mask \(B, A\)\)"):
        strategy.run_role("policy", model, batches, settings, loss_fn="gspo")


def test_an_empty_response_contributes_nothing_and_trains_on(model, reference_model):
    """The engine returned no token (a prompt at the length limit, an aborted request): the trajectory
    has no rows and nothing is scored; the others score and train exactly as without it."""
    from tests.strategies.fsdp.fixtures import Trajectory

    from nemo_replay.strategies.megatron.batch import prepare_micro_batch

    spec = dict(trajs=[Trajectory(4, 3), Trajectory(5, 0), Trajectory(3, 2, eos=True)], seq_len=9, seed=4)
    batch = with_old_and_ref(reference_model, make_batch(**spec), TEMPERATURE)
    assert batch.response_lengths.tolist() == [3, 0, 2] and batch.support.num_rows == 5
    kept = [0, 2]
    alone = ReplayBatch(batch.sequences[kept], batch.attention_mask[kept], batch.response_lengths[kept],
                        batch.loss_mask[kept], support=batch.support.gather(kept), advantages=batch.advantages[kept],
                        old_logprobs=batch.old_logprobs[kept], ref_logprobs=batch.ref_logprobs[kept])
    strategy = FSDPStrategy()
    settings = RoleSettings(temperature=TEMPERATURE)
    got, want = strategy.run_role("recompute", model, [batch, alone], settings)
    assert not got.valid_mask[1].any() and not got.fallback_mask[1].any() and (got.logprobs[1] == 0).all()
    torch.testing.assert_close(got.logprobs[kept], want.logprobs, **TOL)
    model.zero_grad(set_to_none=True)
    with_empty = strategy.run_role("policy", model, [batch], settings, loss_fn=OBJECTIVE)[0]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    without = strategy.run_role("policy", model, [alone], settings, loss_fn=OBJECTIVE)[0]
    torch.testing.assert_close(with_empty.loss, without.loss, **TOL)
    for n, p in model.named_parameters():
        assert torch.isfinite(grads[n]).all()
    # The Megatron layout takes it too: no row for the empty trajectory (docs/design.md §3).
    mb = prepare_micro_batch(0, batch, role="recompute", settings=settings, tp_size=1, cp_size=1, cp_rank=0, fp8=False,
                             packed=True, device="cpu")
    ch = mb.channels
    rows = ch.row_ids[ch.trajectory_ids == 1]
    assert rows.numel() and (rows == -1).all() and set(ch.row_ids[ch.row_ids >= 0].tolist()) == set(range(5))


def test_one_hidden_mode_rule_for_the_fsdp_strategy_and_trl():
    """A logit scale, a biased or adapted head: refused by the fsdp strategy as by the TRL trainer (the
    strategy accepted a model with logit_scale that TRL refused)."""
    import inspect

    from nemo_replay.integrations.trl import trainer as trl_trainer
    from nemo_replay.strategies.fsdp.head import hidden_mode_problems

    assert "hidden_mode_problems(" in inspect.getsource(trl_trainer.ReplayGRPOTrainer._hidden_mode_problems)
    batch = make_batch(**BATCH_B)
    hidden = RoleSettings(temperature=TEMPERATURE, source="hidden")
    plain = tiny_llama(seed=5)
    assert hidden_mode_problems(plain) == []
    scaled = tiny_llama(seed=5)
    scaled.config.logit_scale = 0.5
    with pytest.raises(ValueError, match=r"source='hidden' cannot reproduce LlamaForCausalLM's logits: the model's "
                                         r"logit_scale=0.5 makes its logits differ from hidden @ W.T. Use source='logits'"):
        FSDPStrategy().run_role("recompute", scaled, [batch], hidden)
    biased = tiny_llama(seed=5)
    biased.lm_head.bias = torch.nn.Parameter(torch.zeros(biased.lm_head.out_features))
    assert hidden_mode_problems(biased) == ["the LM head has a bias, which hidden mode does not add"]

    class Adapted(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    adapted = tiny_llama(seed=5)
    adapted.lm_head.__class__ = Adapted
    assert "not a plain nn.Linear" in hidden_mode_problems(adapted)[0]
    FSDPStrategy().run_role("recompute", plain, [batch], hidden)  # the plain model still runs
