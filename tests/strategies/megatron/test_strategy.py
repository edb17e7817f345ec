"""The megatron strategy on real megatron-core GPTModels (local spec), CPU, gloo.

One spawn of two gloo ranks runs every multi-process check, re-initialising megatron's
parallel state between phases (building megatron is the slow part, so it happens once):

A. TP=1: rollouts sampled from the model's own logits (top-k capture); ``recompute``
   reproduces the sampler's log-probs; every role against float64 references from
   plain single-trajectory forwards; ``policy`` (first ratio 1) and its gradients
   against an autograd reference of the same objective; a caller-supplied objective
   (GSPO) on the same trajectories right-padded, token-aligned, against its own reference.
B. TP=2, same full weights sharded: log-probs and gathered gradients equal TP=1's, in
   logits and hidden mode (untied and tied embeddings); explicit groups are the ones
   used; a real CP all-gather of the layout's outputs, and the policy path's
   differentiable gather (its backward the adjoint of the scatter); CP without packing refused.
C. PP=2: megatron's 1F1B schedule on gloo; log-probs on both stages and gradients equal TP=1's.
D. MoE with routing replay: recorded routes installed through megatron's RouterReplay
   reproduce the recording forward; under changed gate weights the routers still take
   the recorded experts, token for token; virtual PP refused.

The tests below assert on what the ranks return.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_replay.batch import ReplayBatch
from nemo_replay.objectives import SequenceRatioObjective, TokenRatioObjective, clipped_policy_loss
from nemo_replay.strategies.base import RoleSettings
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport
from tests.strategies.megatron.batches import (
    TEMPERATURE,
    make_batch,
    naive_policy_logprobs,
    naive_response,
    right_padded,
    with_policy_inputs,
)
from tests.spawn import run_workers

pytest.importorskip("megatron.core")

TOP_K = 8
PROMPTS = [3, 5, 4, 2]
RESPONSES = [4, 3, 5, 6]
ADVANTAGES = [torch.tensor([0.5, -1.0]), torch.tensor([1.5, -0.25])]
POLICY = RoleSettings(temperature=TEMPERATURE)
OBJECTIVE = TokenRatioObjective(clip_eps=0.2, kl_coef=0.1)  # the policy role's loss_fn
GSPO = SequenceRatioObjective(clip_eps=0.05, clip_eps_high=0.08, kl_coef=0.1)


# ---------------------------------------------------------------------------- phases


def _outputs(results, batches):
    return [
        {k: getattr(r.response(b.loss_mask.shape[1]), k) for k in ("logprobs", "valid_mask", "fallback_mask", "entropy", "support_logmass")}
        | {"loss": r.loss, "metrics": r.metrics}
        for r, b in zip(results, batches)
    ]


def _zero_grads(model):
    for p in model.parameters():
        p.grad = None


def _phase_tp1(out):
    from tests.strategies.megatron import harness as H
    from nemo_replay import get_strategy

    H.init_parallel(tp=1)
    model = H.build_model(H.make_config())
    H.load_full_weights(model, 1, 0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, H.VOCAB - 1, (p,), generator=g) for p in PROMPTS]
    rolls = H.generate(model, prompts, RESPONSES, top_k=TOP_K, temperature=TEMPERATURE, seed=1)
    batches = [make_batch(rolls[:2], PROMPTS[:2], synthetic_eos=0), make_batch(rolls[2:], PROMPTS[2:])]
    out["batches"] = batches
    out["sampler_logprobs"] = [r[1] for r in rolls]
    strategy = get_strategy("megatron").factory()
    stats = RoleSettings(temperature=TEMPERATURE, compute_entropy=True, compute_support_mass=True)
    out["tp1_recompute"] = _outputs(strategy.run_role("recompute", model, batches, stats), batches)
    # The same rows in CSR form (the synthetic EOS's all -1 row becomes an empty one).
    csr = [dataclasses.replace(b, support=RaggedSupport.of(b.support)) for b in batches]
    out["tp1_recompute_csr"] = _outputs(strategy.run_role("recompute", model, csr, stats), csr)
    out["tp1_reference_full"] = _outputs(
        strategy.run_role("reference", model, batches, RoleSettings(temperature=TEMPERATURE, reference_full_vocab=True)), batches
    )
    out["tp1_replay_off"] = _outputs(strategy.run_role("recompute", model, batches, RoleSettings(temperature=TEMPERATURE, replay=False)), batches)
    with torch.no_grad():
        out["naive_support"] = [naive_response(model, b, full_vocab=False) for b in batches]
        out["naive_full"] = [naive_response(model, b, full_vocab=True) for b in batches]
    policy_batches = [
        with_policy_inputs(b, o["logprobs"], a) for b, o, a in zip(batches, out["tp1_recompute"], ADVANTAGES)
    ]
    out["policy_batches"] = policy_batches
    _zero_grads(model)
    out["tp1_policy"] = _outputs(strategy.run_role("policy", model, policy_batches, POLICY, loss_fn=OBJECTIVE), policy_batches)
    out["tp1_grads"] = H.full_grads(model, 1, None)
    _zero_grads(model)
    csr_policy = [dataclasses.replace(b, support=RaggedSupport.of(b.support)) for b in policy_batches]
    out["tp1_policy_csr"] = _outputs(strategy.run_role("policy", model, csr_policy, POLICY, loss_fn=OBJECTIVE), csr_policy)
    out["tp1_grads_csr"] = H.full_grads(model, 1, None)
    # Autograd reference of the same objective: plain forwards, float64 scoring, 1/num_microbatches.
    _zero_grads(model)
    for b in policy_batches:
        loss, _ = clipped_policy_loss(naive_policy_logprobs(model, b), b.old_logprobs, b.advantages, b.loss_mask,
                                      clip_eps=OBJECTIVE.clip_eps, kl_coef=OBJECTIVE.kl_coef, ref_logprobs=b.ref_logprobs)
        (loss / len(policy_batches)).backward()
    out["naive_grads"] = H.full_grads(model, 1, None)
    # A caller-supplied objective (GSPO) on the same trajectories right-padded, token-aligned.
    right = [right_padded(b) for b in policy_batches]
    out["right_batches"] = right
    _zero_grads(model)
    out["tp1_gspo_right"] = _outputs(strategy.run_role("policy", model, right, POLICY, loss_fn=GSPO), right)
    out["tp1_gspo_grads"] = H.full_grads(model, 1, None)
    _zero_grads(model)
    for b in policy_batches:
        loss, _ = GSPO(naive_policy_logprobs(model, b), b, b.loss_mask)
        (loss / len(policy_batches)).backward()
    out["naive_gspo_grads"] = H.full_grads(model, 1, None)
    out["tp1_right_recompute"] = _outputs(strategy.run_role("recompute", model, right, RoleSettings(temperature=TEMPERATURE)), right)
    return batches, policy_batches


def _phase_tp2(out, rank, batches, policy_batches):
    import torch.distributed as dist

    from tests.strategies.megatron import harness as H
    from nemo_replay import get_strategy
    from nemo_replay.strategies.megatron.token_layout import TokenMetadataLayout
    from nemo_replay.strategies.megatron import MegatronParallel
    from megatron.core import parallel_state as ps

    H.init_parallel(tp=2)
    model = H.build_model(H.make_config(tp=2))
    tp_rank = ps.get_tensor_model_parallel_rank()
    H.load_full_weights(model, 2, tp_rank)
    strategy = get_strategy("megatron").factory()
    for source in ("logits", "hidden"):
        recompute = RoleSettings(temperature=TEMPERATURE, source=source, compute_entropy=True)
        out[f"tp2_{source}_recompute"] = _outputs(strategy.run_role("recompute", model, batches, recompute), batches)
        _zero_grads(model)
        policy = RoleSettings(temperature=TEMPERATURE, source=source)
        out[f"tp2_{source}_policy"] = _outputs(
            strategy.run_role("policy", model, policy_batches, policy, loss_fn=OBJECTIVE), policy_batches
        )
        out[f"tp2_{source}_grads"] = H.full_grads(model, 2, ps.get_tensor_model_parallel_group())
    _zero_grads(model)
    right = [right_padded(b) for b in policy_batches]
    out["tp2_gspo_right"] = _outputs(strategy.run_role("policy", model, right, POLICY, loss_fn=GSPO), right)
    out["tp2_gspo_grads"] = H.full_grads(model, 2, ps.get_tensor_model_parallel_group())
    # Tied embeddings: hidden mode must project against the shared embedding shard.
    tied = H.build_model(H.make_config(tp=2), share=True)
    H.load_full_weights(tied, 2, tp_rank)
    for source in ("logits", "hidden"):
        settings = RoleSettings(temperature=TEMPERATURE, source=source)
        out[f"tied_{source}"] = _outputs(strategy.run_role("recompute", tied, batches, settings), batches)
    out["tp2_replay_off"] = _outputs(strategy.run_role("recompute", model, batches, RoleSettings(temperature=TEMPERATURE, replay=False)), batches)
    # The explicit groups are the ones used: told tp_size=1 (a group of this rank alone), the
    # scorer takes this rank's 32-id shard for the whole vocabulary and rejects the rows.
    alone = [dist.new_group([r]) for r in range(2)][rank]
    wrong = MegatronParallel(tp_group=alone, tp_size=1, tp_rank=0, pp_last_rank=rank)
    try:
        get_strategy("megatron").factory(parallel=wrong).run_role("recompute", model, batches, RoleSettings())
        out["tp2_wrong_group"] = None
    except ValueError as exc:
        out["tp2_wrong_group"] = str(exc)
    # Context parallel: the CP layout's outputs gathered over a real gloo group of 2.
    world = dist.group.WORLD
    b = batches[1]
    lay = TokenMetadataLayout.build(b.attention_mask, tp_size=2, cp_size=2, cp_rank=rank, packed=True)
    x = torch.arange(b.sequences.shape[0] * (b.sequences.shape[1] - 1), dtype=torch.float32).view(b.sequences.shape[0], -1) + 1
    real = b.attention_mask[:, :-1] & b.attention_mask[:, 1:]
    out["cp_gather"] = (lay.to_canonical(lay.align_logits(x, 0.0), -1.0, cp_group=world), x, b.attention_mask)
    out["cp_gather_bool"] = (lay.to_canonical(lay.align_logits(real, False), False, cp_group=world), real)
    # Every scorer output of a micro-batch in one gather: floats, masks and an absent field.
    from types import SimpleNamespace

    from nemo_replay.strategies.megatron.steps import _canonical_outputs

    third = real & (x.long() % 3 == 0)
    scores = SimpleNamespace(valid_mask=lay.align_logits(real & ~third, False), fallback_mask=lay.align_logits(third, False),
                             entropy=lay.align_logits(x.double() / 7, 0.0), support_logmass=None)
    out["cp_outputs"] = (_canonical_outputs(scores, lay.align_logits(-x, 0.0), lay, world), x, real, third)
    # The policy path's differentiable gather: forward = to_canonical, backward = its adjoint, no collective.
    from nemo_replay.strategies.megatron.steps import gather_logits_to_canonical

    local = torch.randn(lay.local_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))
    local.requires_grad_()
    g = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(99))  # same on both ranks
    y = gather_logits_to_canonical(local, lay, world)
    (y * g).sum().backward()
    inner = (local.detach() * local.grad).sum().reshape(1)
    dist.all_reduce(inner, group=world)
    out["cp_gather_grad"] = dict(
        y=y.detach(), plain=lay.to_canonical(local.detach(), 0.0, cp_group=world), grad=local.grad,
        aligned=lay.align_logits(g, 0.0), y_dot_g=float((y.detach() * g).sum()), x_dot_grad=float(inner),
    )
    out["cp_one_rank_fails"] = _cp_one_rank_fails(rank, world, b)
    out["cp_precheck"] = _cp_misaligned_row(rank, b)
    cp = MegatronParallel(cp_group=world, cp_size=2, cp_rank=rank, pp_last_rank=rank)
    try:
        get_strategy("megatron").factory(parallel=cp).run_role("recompute", model, batches, RoleSettings())
        out["cp_unpacked_error"] = None
    except ValueError as exc:
        out["cp_unpacked_error"] = str(exc)


def _cp_one_rank_fails(rank, world, b):
    """A guard that only the scorer sees, failing in the slice of one CP rank only, through the role
    step's loss closure (the scorer, then the CP gather): every rank raises the same error, or the others
    wait in the gather (gloo: a raw RuntimeError after the timeout). Membership and the synthetic-EOS rule
    are checked on whole sequences before the split (every rank alike); a sampled id outside the
    vocabulary at a synthetic EOS is known only where the logits are."""
    from types import SimpleNamespace

    from nemo_replay.layout.canonical import canonical_channels
    from nemo_replay.strategies.megatron import MegatronParallel
    from nemo_replay.strategies.megatron.batch import prepare_micro_batch
    from nemo_replay.strategies.megatron.steps import RoleForwardStep

    ch = canonical_channels(b)
    i, c = 0, int(torch.nonzero(ch.loss_mask[0]).flatten()[-1])  # trajectory 0's last loss-active logit
    token = 70  # outside the vocabulary of 64
    values = b.support.values.clone()
    values[int(ch.row_ids[i, c])] = -1  # no row: a synthetic EOS, scored over the vocabulary
    sequences = b.sequences.clone()
    sequences[i, c + 1] = token
    bad = ReplayBatch(sequences, b.attention_mask, b.response_lengths, b.loss_mask,
                      support=PackedTensor(values, b.support.cu_seqlens))
    parallel = MegatronParallel(cp_group=world, cp_size=2, cp_rank=rank, pp_last_rank=rank)
    mb = prepare_micro_batch(0, bad, role="recompute", settings=RoleSettings(), tp_size=1, cp_size=2, cp_rank=rank,
                             fp8=False, packed=True, device="cpu")
    held = bool(mb.layout.align_logits(torch.nn.functional.one_hot(torch.tensor(i * ch.row_ids.shape[1] + c),
                                                                     ch.row_ids.numel()).view(ch.row_ids.shape).bool(),
                                       False).any())
    step = RoleForwardStep("recompute", RoleSettings(), parallel, SimpleNamespace(sequence_parallel=False))
    inner = SimpleNamespace(output_layer=SimpleNamespace(weight=torch.zeros(64, 8)))
    logits = torch.randn(*mb.layout.local_shape, 64, generator=torch.Generator().manual_seed(rank))
    try:
        step._loss(mb, inner, False, logits)
        return dict(error=None, held=held, token=token, column=c + 1)
    except ValueError as exc:
        return dict(error=str(exc), kind=type(exc).__name__, held=held, token=token, column=c + 1)


def _cp_misaligned_row(rank, b):
    """A sampled token outside its row, in one CP rank's slice: the whole-sequence check before the split
    names it on every rank alike, in the caller's coordinates."""
    from nemo_replay.layout.canonical import canonical_channels
    from nemo_replay.strategies.megatron.batch import prepare_micro_batch

    ch = canonical_channels(b)
    i, c = (int(v) for v in torch.nonzero(ch.row_ids == 0)[0])  # trajectory 0's first response row
    token = int(ch.sampled_ids[i, c])
    values = b.support.values.clone()
    values[0] = -1
    values[0, 0] = (token + 1) % 64
    bad = ReplayBatch(b.sequences, b.attention_mask, b.response_lengths, b.loss_mask,
                      support=PackedTensor(values, b.support.cu_seqlens))
    try:
        prepare_micro_batch(0, bad, role="recompute", settings=RoleSettings(), tp_size=1, cp_size=2, cp_rank=rank,
                            fp8=False, packed=True, device="cpu")
        return dict(error=None)
    except ValueError as exc:
        return dict(error=str(exc), kind=type(exc).__name__, token=token, column=c + 1)


def _phase_pp2(out, batches, policy_batches):
    from tests.strategies.megatron import harness as H
    from nemo_replay import get_strategy

    H.init_parallel(pp=2)
    model = H.build_model(H.make_config(pp=2))
    H.load_full_weights(model, 1, 0)
    strategy = get_strategy("megatron").factory()
    out["pp2_recompute"] = _outputs(strategy.run_role("recompute", model, batches, RoleSettings(temperature=TEMPERATURE)), batches)
    _zero_grads(model)
    out["pp2_policy"] = _outputs(strategy.run_role("policy", model, policy_batches, POLICY, loss_fn=OBJECTIVE), policy_batches)
    out["pp2_grads"] = H.full_grads(model, 1, None)


def _routing_maps(model):
    """Forward hooks capturing each router's routing_map [tokens, experts], per layer number."""
    from nemo_replay.strategies.megatron.routing import moe_routers

    maps: dict[int, list] = {}
    for router in moe_routers([model]):
        router.register_forward_hook(lambda m, args, output: maps.setdefault(m.layer_number, []).append(output[1].detach()))
    return maps


def _phase_moe(out, batches):
    from tests.strategies.megatron import harness as H
    from nemo_replay import get_strategy
    from nemo_replay.strategies.megatron.routing import moe_routers
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    H.init_parallel()
    config = H.make_config(moe=True)
    model = H.build_model(config, moe=True)
    H.load_full_weights(model, 1, 0)
    routers = moe_routers([model])
    # The recording forward: one plain forward per trajectory with megatron's RECORD action.
    recorded, reference = [], []
    with torch.no_grad():
        for b in batches:
            segs = []
            for i in range(b.batch_size):
                seq = b.sequences[i][b.attention_mask[i]]
                for r in routers:
                    r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
                H.forward_logits(model, seq)
                segs.append(torch.stack([r.router_replay.get_recorded_indices() for r in routers], 1))
                for r in routers:
                    r.router_replay.clear_indices()
                    r.router_replay.clear_router_replay_action()
            recorded.append(PackedTensor.from_segments(segs))
            reference.append(naive_response(model, b, full_vocab=False))
    routed = [
        ReplayBatch(b.sequences, b.attention_mask, b.response_lengths, b.loss_mask, support=b.support, routes=rt)
        for b, rt in zip(batches, recorded)
    ]
    out["moe_reference"] = reference
    out["moe_routes"] = recorded
    settings = RoleSettings(temperature=TEMPERATURE)
    replaying = get_strategy("megatron").factory(route_replay=True)
    out["moe_replay_same_weights"] = _outputs(replaying.run_role("recompute", model, routed, settings), routed)
    # The trained forward under replayed routes: ratio 1, gradients reach the gates.
    trained = [
        ReplayBatch(b.sequences, b.attention_mask, b.response_lengths, b.loss_mask, support=b.support, routes=b.routes,
                    old_logprobs=o["logprobs"], advantages=a)
        for b, o, a in zip(routed, out["moe_replay_same_weights"], ADVANTAGES)
    ]
    _zero_grads(model)
    out["moe_policy"] = _outputs(replaying.run_role("policy", model, trained, RoleSettings(temperature=TEMPERATURE)), trained)
    out["moe_gate_grads"] = [r.weight.grad.clone() for r in routers]
    # Change the gates: ordinary routing now picks other experts for some tokens; replay must not.
    gate = {name: 2.0 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7))
            for name, p in H.global_names(model).items() if name.endswith("router.weight")}
    H.load_full_weights(model, 1, 0, perturb=gate)
    maps = _routing_maps(model)
    get_strategy("megatron").factory().run_role("recompute", model, routed, settings)
    out["moe_free_maps"] = {k: list(v) for k, v in maps.items()}
    maps.clear()
    out["moe_replay_changed_gate"] = _outputs(replaying.run_role("recompute", model, routed, settings), routed)
    out["moe_replay_maps"] = {k: list(v) for k, v in maps.items()}
    out["moe_layer_numbers"] = [r.layer_number for r in routers]
    out["moe_after_clear"] = [r.router_replay.router_replay_action for r in routers]
    # run_role checks the recorded routes before any forward: trajectory 1's token 0 was never routed.
    b = routed[1]
    unrouted = b.routes.values.clone()
    unrouted[int(b.routes.cu_seqlens[1])] = -1
    b = ReplayBatch(b.sequences, b.attention_mask, b.response_lengths, b.loss_mask, support=b.support,
                    routes=PackedTensor(unrouted, b.routes.cu_seqlens))
    try:
        replaying.run_role("recompute", model, [routed[0], b], settings)
        out["moe_unrouted_error"] = None
    except ValueError as exc:
        out["moe_unrouted_error"] = str(exc)
    try:
        replaying.run_role("recompute", [model, model], routed, settings)
        out["moe_vpp_error"] = None
    except ValueError as exc:
        out["moe_vpp_error"] = str(exc)


def _worker(rank, world_size):
    out = {}
    batches, policy_batches = _phase_tp1(out)
    _phase_tp2(out, rank, batches, policy_batches)
    _phase_pp2(out, batches, policy_batches)
    _phase_moe(out, batches)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_workers(_worker, 2)


# ---------------------------------------------------------------------------- assertions


def _close(a, b, atol, rtol=0.0):
    torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol)


def test_recompute_reproduces_the_sampler_and_the_float64_reference(ranks):
    r = ranks[0]
    for k, (b, o) in enumerate(zip(r["batches"], r["tp1_recompute"])):
        A = b.loss_mask.shape[1]
        for i in range(b.batch_size):
            sampled = r["sampler_logprobs"][2 * k + i]
            R = sampled.numel()
            start = A - int(b.response_lengths[i])
            # Sampled tokens: the processed (temperature, top-k) distribution, within 1e-5 in fp32.
            _close(o["logprobs"][i, start : start + R], sampled, atol=1e-5)
            assert o["valid_mask"][i, start : start + R].all()
        _close(o["logprobs"], r["naive_support"][k], atol=1e-5)
        assert torch.equal(o["valid_mask"] | o["fallback_mask"], b.loss_mask)
    # The synthetic EOS of trajectory 0 is scored over the full vocabulary.
    eos = r["tp1_recompute"][0]
    assert eos["fallback_mask"][0, -1] and eos["fallback_mask"].sum() == 1
    _close(eos["logprobs"][0, -1], r["naive_full"][0][0, -1], atol=1e-5)
    assert all(o["entropy"] is not None and (o["entropy"] >= 0).all() for o in r["tp1_recompute"])
    assert all((o["support_logmass"] <= 0).all() for o in r["tp1_recompute"])


def test_csr_rows_score_and_train_bit_for_bit_as_the_fixed_width_rows(ranks):
    """Rows that cost what they hold change no number: recompute and policy (log-probs, every
    output channel, every gradient) on CSR rows equal the fixed-width run's exactly."""
    r = ranks[0]
    for fixed, csr in ((r["tp1_recompute"], r["tp1_recompute_csr"]), (r["tp1_policy"], r["tp1_policy_csr"])):
        for a, b in zip(fixed, csr):
            assert a.keys() == b.keys()
            for key in a:
                same = torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key]
                assert same, (key, a[key], b[key])
    assert r["tp1_grads"].keys() == r["tp1_grads_csr"].keys()
    for name, grad in r["tp1_grads"].items():
        assert torch.equal(grad, r["tp1_grads_csr"][name]), name


def test_full_vocabulary_paths_match_the_reference(ranks):
    r = ranks[0]
    for k, b in enumerate(r["batches"]):
        ref = r["naive_full"][k]
        m = b.loss_mask
        for name in ("tp1_reference_full", "tp1_replay_off", "tp2_replay_off"):
            o = r[name][k]
            _close(torch.where(m, o["logprobs"], 0), ref, atol=1e-5)
            assert not o["valid_mask"].any() and o["fallback_mask"][m].all()
        # Replay changes the numbers (the truncation correction is not zero here).
        assert (r["tp1_recompute"][k]["logprobs"] - ref).abs().max() > 1e-2


def test_first_policy_ratio_is_one_and_gradients_match_the_autograd_reference(ranks):
    r = ranks[0]
    for o in r["tp1_policy"]:
        assert o["metrics"]["ratio_max_dev"] < 1e-5 and o["metrics"]["clip_fraction"] == 0.0
        assert o["loss"] is not None and torch.isfinite(o["loss"])
    grads, ref = r["tp1_grads"], r["naive_grads"]
    assert grads.keys() == ref.keys()
    scale = max(float(g.abs().max()) for g in ref.values())
    assert scale > 1e-3
    for name in ref:
        _close(grads[name], ref[name], atol=2e-5 * scale, rtol=1e-4)


@pytest.mark.parametrize("source", ["logits", "hidden"])
def test_tp2_equals_tp1_log_probs_and_gradients(ranks, source):
    for r in ranks:
        for o1, o2 in zip(r["tp1_recompute"], r[f"tp2_{source}_recompute"]):
            _close(o2["logprobs"], o1["logprobs"], atol=1e-5)
            assert torch.equal(o2["valid_mask"], o1["valid_mask"])
            _close(o2["entropy"], o1["entropy"], atol=1e-5)
        for o1, o2 in zip(r["tp1_policy"], r[f"tp2_{source}_policy"]):
            _close(o2["loss"], o1["loss"], atol=1e-6)
        ref = r["tp1_grads"]
        scale = max(float(g.abs().max()) for g in ref.values())
        for name, g in r[f"tp2_{source}_grads"].items():
            _close(g, ref[name], atol=2e-5 * scale, rtol=1e-4)


def test_hidden_mode_with_tied_embeddings(ranks):
    for r in ranks:
        for lo, hi, untied in zip(r["tied_logits"], r["tied_hidden"], r["tp1_recompute"]):
            _close(hi["logprobs"], lo["logprobs"], atol=1e-5)
            assert (lo["logprobs"] - untied["logprobs"]).abs().max() > 1e-3  # other weights, other numbers


def test_a_caller_objective_on_right_padded_batches_matches_its_autograd_reference(ranks):
    r = ranks[0]
    # Right-padded batches score the same numbers, in token-aligned [B, S] columns.
    for k, (left, right) in enumerate(zip(r["tp1_recompute"], r["tp1_right_recompute"])):
        b, rb = r["batches"][k], r["right_batches"][k]
        for i in range(b.batch_size):
            n = int(rb.attention_mask[i].sum())
            got = right["logprobs"][i][rb.loss_mask[i]]
            want = left["logprobs"][i][b.loss_mask[i]]
            _close(got, want, atol=1e-6)
            assert got.numel() == int(b.loss_mask[i].sum()) and n == int(b.attention_mask[i].sum())
    grads, ref = r["tp1_gspo_grads"], r["naive_gspo_grads"]
    scale = max(float(g.abs().max()) for g in ref.values())
    assert scale > 1e-3
    for name in ref:
        _close(grads[name], ref[name], atol=2e-5 * scale, rtol=1e-4)
    # GSPO's gradient is not the token objective's: the caller's loss is the one that ran.
    assert max(float((grads[n] - r["tp1_grads"][n]).abs().max()) for n in ref) > 1e-3 * scale
    for rk in ranks:  # TP=2 equals TP=1 under the caller's objective too
        for name, g in rk["tp2_gspo_grads"].items():
            _close(g, ref[name], atol=2e-5 * scale, rtol=1e-4)
        for o1, o2 in zip(r["tp1_gspo_right"], rk["tp2_gspo_right"]):
            _close(o2["loss"], o1["loss"], atol=1e-6)
            assert "ratio_mean" in o2["metrics"] and "kl" in o2["metrics"]


def test_all_scorer_outputs_gather_back_to_canonical_over_cp_in_one_call(ranks):
    for r in ranks:
        got, x, real, third = r["cp_outputs"]
        assert got["logprobs"].dtype == torch.float32 and torch.equal(got["logprobs"][real], -x[real])
        assert (got["logprobs"][~real] == 0).all()
        assert torch.equal(got["valid_mask"], real & ~third) and torch.equal(got["fallback_mask"], third)
        assert third.any() and (real & ~third).any()
        assert got["entropy"].dtype == torch.float64 and torch.equal(got["entropy"][real], x[real].double() / 7)
        assert got["support_logmass"] is None


def test_the_cp_gather_of_the_policy_path_is_the_adjoint_of_align_logits(ranks):
    for r in ranks:
        c = r["cp_gather_grad"]
        assert torch.equal(c["y"], c["plain"])
        assert torch.equal(c["grad"], c["aligned"])
        assert c["y_dot_g"] == pytest.approx(c["x_dot_grad"], rel=1e-12)  # <gather(x), g> = sum_r <x_r, grad_r>


def test_the_explicit_tp_group_is_the_one_used(ranks):
    for r in ranks:
        assert "holds an id >= vocab_size=32" in r["tp2_wrong_group"]


def test_context_parallel_outputs_gather_back_to_canonical(ranks):
    for r in ranks:
        back, x, am = r["cp_gather"]
        real = am[:, :-1] & am[:, 1:]
        assert torch.equal(back[real], x[real]) and (back[~real] == -1).all()
        mask, real = r["cp_gather_bool"]
        assert mask.dtype == torch.bool and torch.equal(mask, real)
        assert "needs packed THD sequences" in r["cp_unpacked_error"]
        assert "packed=True" in r["cp_unpacked_error"]


def test_a_check_one_cp_rank_fails_raises_the_same_named_error_on_every_rank(ranks):
    got = [r["cp_one_rank_fails"] for r in ranks]
    holder = [g["held"] for g in got].index(True)
    assert [g["held"] for g in got].count(True) == 1  # one rank's slice holds the bad token
    for g in got:
        assert g["kind"] == "ValueError" and g["error"] == got[0]["error"]
        assert g["error"].startswith(f"CP rank {holder} of 2: trajectory 0, token position {g['column']}: sampled id "
                                     f"{g['token']} outside the vocabulary [0, 64)")


def test_a_misaligned_row_under_cp_is_named_on_every_rank_before_the_split(ranks):
    got = [r["cp_precheck"] for r in ranks]
    for g in got:
        assert g["kind"] == "SupportAlignmentError" and g["error"] == got[0]["error"]
        assert g["error"].startswith(f"trajectory 0, token position {g['column']}: token {g['token']} is not a member "
                                     f"of its support row")


def test_pipeline_parallel_2_matches_tp1(ranks):
    ref = ranks[0]
    for r in ranks:  # both stages return the broadcast results
        for o1, o2 in zip(ref["tp1_recompute"], r["pp2_recompute"]):
            _close(o2["logprobs"], o1["logprobs"], atol=1e-5)
        for o1, o2 in zip(ref["tp1_policy"], r["pp2_policy"]):
            _close(o2["loss"], o1["loss"], atol=1e-6)
            assert o2["metrics"]["ratio_max_dev"] < 1e-5
    stages = {**ranks[0]["pp2_grads"], **ranks[1]["pp2_grads"]}
    tp1 = ref["tp1_grads"]
    scale = max(float(g.abs().max()) for g in tp1.values())
    # Each stage owns its layers; embedding on stage 0, output layer on stage 1.
    assert set(stages) == set(tp1)
    for name, g in stages.items():
        _close(g, tp1[name], atol=2e-5 * scale, rtol=1e-4)


def _real_routes(batch, layout_maps, routes, layer_index):
    """Per canonical real token: the experts chosen by the router, from its [s*B+b, E] map."""
    from nemo_replay.strategies.megatron.token_layout import TokenMetadataLayout

    lay = TokenMetadataLayout.build(batch.attention_mask)
    B, S_out = lay.local_shape
    chosen = layout_maps.view(S_out, B, -1).transpose(0, 1).reshape(B * S_out, -1)
    got, want = [], []
    for slot, (t, q) in enumerate(zip(lay.slot_trajectory.tolist(), lay.slot_position.tolist())):
        if t >= 0:
            got.append(torch.nonzero(chosen[slot]).flatten().sort().values)
            want.append(routes.segment(t)[q, layer_index].sort().values)
    return torch.stack(got), torch.stack(want)


def test_moe_route_replay_reproduces_the_recording_forward(ranks):
    for r in ranks:
        assert r["moe_layer_numbers"] == [1, 2]
        assert all(a is None for a in r["moe_after_clear"])
        for o, ref in zip(r["moe_replay_same_weights"], r["moe_reference"]):
            _close(o["logprobs"], ref, atol=1e-5)
        batches, routes = r["batches"], r["moe_routes"]
        free_differs = False
        for layer_index, layer in enumerate(r["moe_layer_numbers"]):
            for k, b in enumerate(batches):
                got, want = _real_routes(b, r["moe_replay_maps"][layer][k], routes[k], layer_index)
                assert torch.equal(got, want)  # the installed routes, token for token
                free, _ = _real_routes(b, r["moe_free_maps"][layer][k], routes[k], layer_index)
                free_differs |= not torch.equal(free, want)
        assert free_differs, "the changed gates should route some tokens elsewhere without replay"
        assert all(o["metrics"]["ratio_max_dev"] < 1e-5 for o in r["moe_policy"])
        assert all(torch.isfinite(g).all() and g.abs().max() > 0 for g in r["moe_gate_grads"])
        assert "virtual pipeline" in r["moe_vpp_error"]
        assert r["moe_unrouted_error"].startswith("micro-batch 1, trajectory 1, token position 0, MoE layer 0: ")


# ---------------------------------------------------------------------------- single process


def test_missing_support_and_policy_inputs_are_refused():
    from nemo_replay.strategies.base import check_policy_batches
    from nemo_replay.strategies.megatron.batch import prepare_micro_batch

    seq = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    am = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    lm = torch.tensor([[False, True], [True, True]])  # response tokens only
    batch = ReplayBatch(seq, am, torch.tensor([1, 2]), lm)
    common = dict(tp_size=1, cp_size=1, cp_rank=0, fp8=False, packed=False, device="cpu")
    with pytest.raises(ValueError, match=r"role 'recompute' replays the recorded support.*support=None.*replay=False"):
        prepare_micro_batch(0, batch, role="recompute", settings=RoleSettings(), **common)
    with pytest.raises(ValueError, match="reference_full_vocab=True"):
        prepare_micro_batch(0, batch, role="reference", settings=RoleSettings(), **common)
    prepare_micro_batch(0, batch, role="reference", settings=RoleSettings(reference_full_vocab=True), **common)
    # The objective names what it reads, before any forward (run_role calls this first).
    with pytest.raises(ValueError, match=r"micro-batch 0: the policy objective TokenRatioObjective needs advantages, "
                                         r"ref_logprobs on the batch"):
        check_policy_batches([batch], TokenRatioObjective(kl_coef=0.1))
    prepare_micro_batch(0, batch, role="policy", settings=RoleSettings(replay=False), **common)
    with pytest.raises(ValueError, match="route replay is on but the batch carries no routes"):
        prepare_micro_batch(0, batch, role="recompute", settings=RoleSettings(replay=False), with_routes=True, **common)
    # One synthetic EOS per trajectory (its last token) is fine.
    rows = PackedTensor.from_segments([torch.tensor([[-1, -1]]), torch.tensor([[10, 3], [-1, -1]])])
    eos = ReplayBatch(seq, am, torch.tensor([1, 2]), lm, support=rows)
    assert prepare_micro_batch(0, eos, role="recompute", settings=RoleSettings(), **common).replay
    rows = PackedTensor.from_segments([torch.tensor([[7, -1]]), torch.tensor([[-1, -1], [11, 3]])])
    early = ReplayBatch(seq, am, torch.tensor([1, 2]), lm, support=rows)
    # Under context parallelism the rule is checked on whole sequences before the split (without it,
    # the scorer sees whole sequences and checks it there).
    split = dict(common, cp_size=2, packed=True)
    with pytest.raises(ValueError, match="trajectory 1, token position 2: .*not the trajectory's last loss-active"):
        prepare_micro_batch(0, early, role="recompute", settings=RoleSettings(), **split)
    rows = PackedTensor.from_segments([torch.tensor([[7, -1]]), torch.tensor([[-1, -1], [-1, -1]])])
    many = ReplayBatch(seq, am, torch.tensor([1, 2]), lm, support=rows)
    with pytest.raises(ValueError, match=r"trajectories \[1\] have \[2\] loss-active positions without a support row"):
        prepare_micro_batch(0, many, role="recompute", settings=RoleSettings(), **split)


def test_recorded_routes_are_checked_where_they_were_recorded():
    from megatron.core.transformer import TransformerConfig

    from nemo_replay.strategies.megatron.routing import check_recorded_routes

    config = TransformerConfig(
        num_layers=3, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
        moe_layer_freq=[1, 0, 1], use_cpu_initialization=True,
    )
    # Two MoE layers (1 and 3), top-2 of 4 experts; trajectories of 3 and 4 real tokens.
    segs = [torch.arange(3 * 4).view(3, 2, 2) % 4, (torch.arange(4 * 4).view(4, 2, 2) + 1) % 4]
    check_recorded_routes(PackedTensor.from_segments(segs), config, micro_batch=0)
    # Packed row 5 = trajectory 1, token 2; its second MoE layer names expert 4 of 4.
    segs[1][2, 1, 0] = 4
    with pytest.raises(ValueError, match=r"micro-batch 3, trajectory 1, token position 2, MoE layer 1: .*\[4, .*num_moe_experts=4"):
        check_recorded_routes(PackedTensor.from_segments(segs), config, micro_batch=3)
    # A real token without a recorded route (-1) is an error, not a padding slot.
    segs[1][2, 1, 0] = 1
    segs[0][0] = -1
    with pytest.raises(ValueError, match=r"trajectory 0, token position 0, MoE layer 0: recorded experts \[-1, -1\]"):
        check_recorded_routes(PackedTensor.from_segments(segs), config, micro_batch=0)
    with pytest.raises(ValueError, match=r"routes must be \(tokens, layers=2, topk=2\).*got \(7, 3, 2\)"):
        check_recorded_routes(PackedTensor.from_segments([torch.zeros(3, 3, 2, dtype=torch.int64), torch.zeros(4, 3, 2, dtype=torch.int64)]), config, micro_batch=0)


def test_registry_builds_the_strategy_without_importing_megatron_at_import_time():
    import subprocess
    import sys

    code = (
        "import sys, nemo_replay; s = nemo_replay.get_strategy('megatron'); "
        "st = s.factory(packed=True, route_replay=True); "
        "print(type(st).__name__, st.packed, 'megatron.core' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["MegatronReplayStrategy", "True", "False"]


def test_the_loss_closure_keeps_float64_log_probs():
    """A float64 model's log-probs reach the canonical outputs in float64: the closure cast them to
    float32 (5e-7 off instead of the scorer's 1e-15)."""
    from types import SimpleNamespace

    from nemo_replay import score_aligned_support
    from nemo_replay.layout.canonical import canonical_channels
    from nemo_replay.strategies.megatron import MegatronParallel
    from nemo_replay.strategies.megatron.batch import prepare_micro_batch
    from nemo_replay.strategies.megatron.steps import RoleForwardStep
    from tests.strategies.fsdp.fixtures import BATCH_A, VOCAB as V, make_batch as fsdp_batch

    batch = fsdp_batch(**BATCH_A)
    B, S = batch.sequences.shape
    settings = RoleSettings(temperature=TEMPERATURE)
    mb = prepare_micro_batch(0, batch, role="recompute", settings=settings, tp_size=1, cp_size=1, cp_rank=0,
                             fp8=False, packed=False, device="cpu")
    logits = torch.randn(B, S, V, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    step = RoleForwardStep("recompute", settings, MegatronParallel(), SimpleNamespace(sequence_parallel=False))
    step._loss(mb, SimpleNamespace(output_layer=SimpleNamespace(weight=torch.zeros(V, 8))), False, logits)
    got = step.results[0]["logprobs"]
    ch = mb.channels
    local = score_aligned_support(logits, ch.sampled_ids, ch.row_ids, ch.loss_mask, mb.support,
                                  trajectory_ids=ch.trajectory_ids, temperature=TEMPERATURE).logprobs
    want = mb.layout.to_canonical(local, 0.0)
    assert got.dtype == torch.float64 and want.dtype == torch.float64
    assert torch.equal(got, want) and (got != 0).sum() == int(canonical_channels(batch).loss_mask.sum())


@pytest.mark.parametrize("replay", [False, True])
def test_a_bad_token_in_a_packed_micro_batch_is_named_by_the_callers_trajectory_and_column(replay):
    """Packed THD puts every trajectory in one row: with replay off the scorer named a bad token by
    its packed index ("trajectory 0, logit position 7"); now by the caller's trajectory and column,
    as with replay on and as every other strategy does. Through the role step's loss closure."""
    from types import SimpleNamespace

    from nemo_replay.strategies.megatron import MegatronParallel
    from nemo_replay.strategies.megatron.batch import prepare_micro_batch
    from nemo_replay.strategies.megatron.steps import RoleForwardStep

    seq = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    am = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    lm = torch.tensor([[False, True], [True, True]])
    seq[1, 3] = 70  # trajectory 1, column 3: outside the vocabulary of 64
    rows = PackedTensor.from_segments([torch.tensor([[7, -1]]), torch.tensor([[10, 3], [-1, -1]])])  # its last: synthetic EOS
    batch = ReplayBatch(seq, am, torch.tensor([1, 2]), lm, support=rows if replay else None)
    settings = RoleSettings(replay=replay)
    mb = prepare_micro_batch(0, batch, role="recompute", settings=settings, tp_size=1, cp_size=1, cp_rank=0,
                             fp8=False, packed=True, device="cpu")
    assert mb.layout.local_shape[0] == 1  # one packed row
    step = RoleForwardStep("recompute", settings, MegatronParallel(), SimpleNamespace(sequence_parallel=False))
    inner = SimpleNamespace(output_layer=SimpleNamespace(weight=torch.zeros(64, 8)))
    logits = torch.randn(*mb.layout.local_shape, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"^trajectory 1, token position 3: sampled id 70 outside the vocabulary \[0, 64\)"):
        step._loss(mb, inner, False, logits)
