"""Two real gloo ranks: Ulysses collectives, and the fsdp strategy under FSDP2 with SP = 1 and 2.

One spawn runs every multi-process check (start-up dominates the cost). Both ranks hold
the same micro-batches. SP = 1: each rank runs them whole (FSDP averages two equal
gradients). SP = 2: each rank holds one sequence slice and attention exchanges heads with
real ``all_to_all_single``. Every configuration is compared with a single-process float64
reference that scores each trajectory alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_replay.strategies.base import RoleSettings
from tests.strategies.fsdp.fixtures import (
    BATCH_A,
    BATCH_B,
    canonical_from_response,
    make_batch,
    plain_copy,
    reference_full_positions,
    OBJECTIVE,
    reference_policy_grads,
    reference_scores,
    tiny_llama,
    tiny_qwen2,
    with_old_and_ref,
)
from tests.spawn import run_workers

TOL = dict(rtol=1e-9, atol=1e-10)
SETTINGS = dict(temperature=0.7)
SEED = 3


def _collectives(rank: int, group) -> dict:
    from nemo_replay.layout.ulysses import gather_sequence, heads_to_seq, pad_and_slice, seq_to_heads

    out = {}
    # The module's worked example: S = 5 over 2 ranks, fill -1.
    full = torch.tensor([[10, 11, 12, 13, 14]])
    local = pad_and_slice(full, group, fill=-1)
    out["slice"] = local.tolist()
    out["gathered"] = gather_sequence(local, group, seq_len=5).tolist()

    # seq_to_heads against slicing the full tensor; gradient against its transpose.
    g = torch.Generator().manual_seed(7)
    x_full = torch.randn(2, 4, 6, 3, generator=g, dtype=torch.float64)  # [B, H, S, D]
    w_full = torch.randn(2, 4, 6, 3, generator=g, dtype=torch.float64)
    x = x_full[:, :, rank * 3 : rank * 3 + 3].clone().requires_grad_(True)
    y = seq_to_heads(x, group)
    out["seq_to_heads_err"] = float((y.detach() - x_full[:, rank * 2 : rank * 2 + 2]).abs().max())
    (y * w_full[:, rank * 2 : rank * 2 + 2]).sum().backward()
    # d/dx of sum_r <y_r, w_r> is w_full at the positions x holds.
    out["seq_to_heads_grad_err"] = float((x.grad - w_full[:, :, rank * 3 : rank * 3 + 3]).abs().max())
    out["round_trip_err"] = float((heads_to_seq(y, group) - x).detach().abs().max())

    # gather_sequence backward: this rank's slice of the gradient, times grad_scale.
    v = torch.arange(3, dtype=torch.float64).add(10 * rank).requires_grad_(True)
    gathered = gather_sequence(v[None], group, seq_len=5, grad_scale=2.0)
    (gathered * torch.arange(1, 6, dtype=torch.float64)).sum().backward()
    out["gather_values"] = gathered.detach().tolist()
    out["gather_grad"] = v.grad.tolist()
    return out


def _full_grads(model) -> dict:
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    model.zero_grad(set_to_none=True)
    return grads


def _expect_error(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def _worker(rank: int, world_size: int, batches, eos_misplaced):
    """``batches``: [batch_a, batch_b, batch_b with its two supports swapped]."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nemo_replay.strategies.fsdp import FSDPStrategy

    sp_group = dist.new_group(ranks=list(range(world_size)))
    singletons = [dist.new_group(ranks=[r]) for r in range(world_size)]
    results = {"collectives": _collectives(rank, sp_group)}

    # Heads must divide by the SP size (3 heads over 2 ranks), raised on every rank.
    odd = tiny_llama(seed=SEED, heads=3, kv_heads=1)
    results["odd_heads"] = _expect_error(
        lambda: FSDPStrategy(sp_group=sp_group).run_role("recompute", odd, batches[:1], RoleSettings(**SETTINGS))
    )

    # The explicit group is the one used: a one-rank SP group slices nothing, although
    # the default (world) group has two ranks.
    own = FSDPStrategy(sp_group=singletons[rank])
    assert own.sp_size == 1
    results["singleton"] = own.run_role("recompute", tiny_llama(seed=SEED), batches[:1], RoleSettings(**SETTINGS))[0].logprobs

    # A Qwen2 model (attention with biases, a sliding_window argument) under SP = 2.
    results["qwen2"] = (
        FSDPStrategy(sp_group=sp_group).run_role("recompute", tiny_qwen2(seed=SEED), batches[:1], RoleSettings(**SETTINGS))[0].logprobs
    )

    model = tiny_llama(seed=SEED)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)

    runs = {}
    for sp in (1, 2):
        for remove_padding in (True, False):
            strategy = FSDPStrategy(sp_group=sp_group if sp == 2 else None, remove_padding=remove_padding)
            for source in ("logits", "hidden"):
                settings = RoleSettings(source=source, **SETTINGS)
                policy = strategy.run_role("policy", model, batches[:2], settings, loss_fn=OBJECTIVE)
                grads = _full_grads(model)
                recompute = strategy.run_role("recompute", model, batches[:1], settings)[0]
                runs[(sp, remove_padding, source)] = dict(
                    policy=[(o.logprobs, o.valid_mask, o.fallback_mask, o.loss) for o in policy],
                    recompute=(recompute.logprobs, recompute.valid_mask, recompute.fallback_mask),
                    grads=grads,
                )
    results["runs"] = runs

    sp2 = FSDPStrategy(sp_group=sp_group)
    results["replay_off"] = sp2.run_role("recompute", model, batches[:1], RoleSettings(replay=False, temperature=0.7))[0].logprobs
    results["swapped"] = _expect_error(lambda: sp2.run_role("recompute", model, [batches[2]], RoleSettings(**SETTINGS)))
    results["eos_misplaced"] = _expect_error(lambda: sp2.run_role("recompute", model, [eos_misplaced], RoleSettings(**SETTINGS)))
    # Still in step after the rejected batches: the same answer as before.
    again = sp2.run_role("recompute", model, batches[:1], RoleSettings(**SETTINGS))[0].logprobs
    results["after_errors_err"] = float((again - runs[(2, True, "logits")]["recompute"][0]).abs().max())
    return results


def test_fsdp_strategy_sp1_sp2_padded_unpadded_match_reference():
    reference = plain_copy(tiny_llama(seed=SEED))
    temperature = SETTINGS["temperature"]
    batch_a = with_old_and_ref(reference, make_batch(**BATCH_A), temperature)
    batch_b = with_old_and_ref(reference, make_batch(**BATCH_B), temperature)
    swapped = make_batch(**BATCH_B)
    swapped.support = swapped.support.gather([1, 0])
    # Trajectory 1 of BATCH_A loses the row of its first response token: a row-less
    # loss-active position that is not its last one (the two SP slices split trajectory 1).
    eos_misplaced = make_batch(**BATCH_A)
    values = eos_misplaced.support.values.clone()
    values[int(eos_misplaced.support.cu_seqlens[1])] = -1
    eos_misplaced.support = type(eos_misplaced.support)(values, eos_misplaced.support.cu_seqlens)

    results = run_workers(_worker, 2, [batch_a, batch_b, swapped], eos_misplaced)

    want_grads = reference_policy_grads(reference, [batch_a, batch_b], SETTINGS["temperature"])
    want = []
    with torch.no_grad():
        for batch in (batch_a, batch_b):
            lp, valid, fallback = reference_scores(reference, batch, temperature=temperature)
            want.append(tuple(canonical_from_response(t, batch.seq_len) for t in (lp, valid, fallback)))
        want_off = reference_full_positions(reference, batch_a, temperature=temperature)
        want_qwen2 = reference_scores(tiny_qwen2(seed=SEED), batch_a, temperature=temperature)[0]
    assert want[0][2].any() and want[1][2].any(), "both batches end a trajectory in a synthetic EOS"

    for rank, res in enumerate(results):
        c = res["collectives"]
        assert c["slice"] == ([[10, 11, 12]] if rank == 0 else [[13, 14, -1]])
        assert c["gathered"] == [[10, 11, 12, 13, 14]]
        assert max(c["seq_to_heads_err"], c["seq_to_heads_grad_err"], c["round_trip_err"]) == 0.0
        assert c["gather_values"] == [[0.0, 1.0, 2.0, 10.0, 11.0]]
        # d/dv of sum_p p * gathered[p-1], times 2; positions past seq_len get no gradient.
        assert c["gather_grad"] == ([2.0, 4.0, 6.0] if rank == 0 else [8.0, 10.0, 0.0])
        assert "not divisible by the SP size 2" in res["odd_heads"]

        assert len(res["runs"]) == 8
        for key, run in res["runs"].items():
            where = f"rank {rank}, (sp, remove_padding, source) = {key}"
            for (lp, valid, fallback, loss), (w_lp, w_valid, w_fallback) in zip(run["policy"], want):
                torch.testing.assert_close(lp, w_lp.to(lp.dtype), **TOL, msg=lambda m: f"{where} policy: {m}")
                assert torch.equal(valid, w_valid) and torch.equal(fallback, w_fallback), where
            lp, valid, fallback = run["recompute"]
            torch.testing.assert_close(lp, want[0][0], **TOL, msg=lambda m: f"{where} recompute: {m}")
            assert torch.equal(fallback, want[0][2]), where
            for name, g in want_grads.items():
                torch.testing.assert_close(run["grads"][name], g, **TOL, msg=lambda m: f"{where} grad {name}: {m}")

        torch.testing.assert_close(res["replay_off"], want_off, **TOL)
        torch.testing.assert_close(res["singleton"], want[0][0], **TOL)
        torch.testing.assert_close(res["qwen2"], canonical_from_response(want_qwen2, batch_a.seq_len), **TOL)
        assert "not a member of its support row" in res["swapped"]
        assert "not the trajectory's last loss-active token" in res["eos_misplaced"]
        assert res["after_errors_err"] == 0.0
