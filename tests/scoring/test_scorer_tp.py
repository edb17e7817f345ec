"""Tensor parallel scoring on real gloo ranks: TP=2 over an uneven vocab split equals TP=1.

One spawn (2 ranks) runs every check: logits and hidden mode, fixed-width and ragged
support, entropy, support mass, the synthetic-EOS fallback, the full-vocabulary path. In
each rank ``torch.distributed.all_reduce`` is wrapped by a counter that forwards to the
real collective, so the test also counts the collectives of forward and backward and
sees which group object they ran on (a subgroup from ``dist.new_group``, never WORLD), and
the host reads of each forward (one: benchmarks/syncs.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.syncs import HostReads
from nemo_replay import PackedTensor, RaggedSupport, score_aligned_support, score_full_vocabulary
from nemo_replay.layout.checks import has_support_row
from nemo_replay.scoring.shard import VocabShard
from tests.scoring.batches import make_case
from tests.spawn import run_workers

V = 423
SPLIT = (0, 200, V)  # rank 0 holds ids [0, 200), rank 1 holds [200, 423): uneven
TEMPERATURE = 0.7


def _case():
    return make_case(B=3, T=37, V=V, k=7, H=16, eos=(0, 1, 2), seed=31)


def _weights(shape):
    g = torch.Generator().manual_seed(5)
    return torch.rand(shape, generator=g, dtype=torch.float64) + 0.5, torch.rand(shape, generator=g, dtype=torch.float64) - 0.5


def _loss(out, shape):
    w1, w2 = _weights(shape)
    return (out.logprobs * w1).sum() + (out.entropy * w2).sum()


def _scenarios(case):
    """name -> (hidden mode?, scorer call taking (source, weight, shard))."""
    ragged = RaggedSupport.from_padded(case.support)
    ch = (case.sampled_ids, case.row_ids, case.loss_mask)

    def aligned(support, **kw):
        def call(src, w, shard):
            return score_aligned_support(src, *ch, support, lm_head_weight=w, shard=shard,
                                         temperature=TEMPERATURE, compute_entropy=True, **kw)
        return call

    def full(src, w, shard):
        return score_full_vocabulary(src, case.sampled_ids, loss_mask=case.loss_mask, lm_head_weight=w,
                                     shard=shard, temperature=TEMPERATURE, compute_entropy=True)

    return {
        "logits_packed": (False, aligned(case.support, compute_support_mass=True)),
        "logits_ragged": (False, aligned(ragged, compute_support_mass=True)),
        "hidden_packed": (True, aligned(case.support)),
        "hidden_ragged_chunked": (True, aligned(ragged, chunk_size=9)),
        "full_logits": (False, full),
        "full_hidden": (True, full),
    }


def _run(case, hidden, call, shard):
    """Forward + backward on the vocab shard; returns outputs and gradients."""
    lo, hi = shard.start, shard.end
    if hidden:
        h = case.hidden.clone().requires_grad_()
        w = case.weight[lo:hi].clone().requires_grad_()
        out = call(h, w, shard)
        leaves = (h, w)
    else:
        z = case.logits[..., lo:hi].clone().requires_grad_()
        out = call(z, None, shard)
        leaves = (z,)
    return out, leaves


def _tp_worker(rank, world_size):
    case = _case()
    lo, hi = SPLIT[rank], SPLIT[rank + 1]
    group = dist.new_group(ranks=list(range(world_size)))
    # The uneven split is learnt from the local sizes alone (one all-gather).
    shard = VocabShard.from_group(group, hi - lo)
    assert (shard.start, shard.end, shard.group) == (lo, hi, group)
    real_all_reduce = dist.all_reduce
    calls = []

    def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        name = "MAX" if op == dist.ReduceOp.MAX else "SUM" if op == dist.ReduceOp.SUM else str(op)
        calls.append((name, group))
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting_all_reduce
    results = {}
    try:
        for name, (hidden, call) in _scenarios(case).items():
            calls.clear()
            with HostReads() as reads:
                out, leaves = _run(case, hidden, call, shard)
            forward = list(calls)
            calls.clear()
            grads = torch.autograd.grad(_loss(out, case.loss_mask.shape), leaves)
            backward = list(calls)
            results[name] = {
                "logprobs": out.logprobs.detach(),
                "entropy": out.entropy.detach(),
                "logmass": None if out.support_logmass is None else out.support_logmass,
                "fallback": out.fallback_mask,
                "grads": [g.detach() for g in grads],
                "forward_ops": [op for op, _ in forward],
                "backward_ops": [op for op, _ in backward],
                "on_subgroup": all(g is group for _, g in forward + backward),
                "group_is_world": any(g is None or g is dist.group.WORLD for _, g in forward + backward),
                "host_reads": reads.total,
            }
    finally:
        dist.all_reduce = real_all_reduce
    results["hand_built_shard"] = _hand_built_shard(case, VocabShard(lo, hi, group))
    results["masked_shard_mass"] = _masked_shard_mass(case, shard)
    return results


def _masked_logits(case):
    """The case's logits with rank 1's whole shard at -inf: that rank's full rows hold no finite score."""
    z = case.logits.clone()
    z[..., SPLIT[1]:] = float("-inf")
    return z


def _masked_shard_mass(case, shard):
    z = _masked_logits(case)[..., shard.start : shard.end]
    out = score_aligned_support(z, case.sampled_ids, case.row_ids, case.loss_mask, case.support, shard=shard,
                                compute_support_mass=True, validate=False)
    return out.support_logmass


def _hand_built_shard(case, shard):
    """A shard without the global vocabulary size learns it from the MAX all-reduce: the ids
    are still checked against it, after that collective (one more host read)."""
    z = case.logits[..., shard.start : shard.end]
    with HostReads() as reads:
        out = score_aligned_support(z, case.sampled_ids, case.row_ids, case.loss_mask, case.support, shard=shard)
    vals = case.support.values.clone()
    unused = next(r for r, members in enumerate(case.sets) if not members and r not in case.row_ids[case.loss_mask])
    vals[unused, 0] = V  # an id one past the vocabulary (no rank holds it) in a row no position scores
    try:
        score_aligned_support(z, case.sampled_ids, case.row_ids, case.loss_mask, PackedTensor(vals, case.support.cu_seqlens),
                              shard=shard)
        error = None
    except ValueError as e:
        error = str(e)
    # A negative sampled id at a synthetic EOS is caught before the collective, without the size.
    sampled = case.sampled_ids.clone()
    eos = torch.nonzero(case.loss_mask & ~has_support_row(case.support, case.row_ids))[0]
    sampled[eos[0], eos[1]] = -1
    try:
        score_aligned_support(z, sampled, case.row_ids, case.loss_mask, case.support, shard=shard)
        negative = None
    except ValueError as e:
        negative = str(e)
    return {"logprobs": out.logprobs, "host_reads": reads.total, "error": error, "negative": negative}


def test_tp2_uneven_split_equals_tp1_and_counts_collectives():
    ranks = run_workers(_tp_worker, 2)
    case = _case()
    for name, (hidden, call) in _scenarios(case).items():
        out, leaves = _run(case, hidden, call, VocabShard.whole(V))
        grads = torch.autograd.grad(_loss(out, case.loss_mask.shape), leaves)
        assert out.fallback_mask.any() and (name.startswith("full") or int(out.fallback_mask.sum()) == 3)
        for rank, res in enumerate(ranks):
            r = res[name]
            where = f"{name}, rank {rank}"
            torch.testing.assert_close(r["logprobs"], out.logprobs.detach(), atol=1e-10, rtol=0, msg=where)
            torch.testing.assert_close(r["entropy"], out.entropy.detach(), atol=1e-10, rtol=0, msg=where)
            assert torch.equal(r["fallback"], out.fallback_mask), where
            if out.support_logmass is not None:
                torch.testing.assert_close(r["logmass"], out.support_logmass, atol=1e-10, rtol=0, msg=where)
            lo, hi = SPLIT[rank], SPLIT[rank + 1]
            assert all(g.abs().sum() > 0 for g in r["grads"]), where  # both shards carry gradient
            if hidden:
                gh, gw = r["grads"]
                torch.testing.assert_close(gh, grads[0], atol=1e-10, rtol=0, msg=where)
                torch.testing.assert_close(gw, grads[1][lo:hi], atol=1e-10, rtol=0, msg=where)
            else:
                torch.testing.assert_close(r["grads"][0], grads[0][..., lo:hi], atol=1e-10, rtol=0, msg=where)
            # Forward: one MAX then one SUM all-reduce. Backward: none for logits, one SUM
            # (the hidden-state gradient) in hidden mode. All on the explicit subgroup.
            assert r["forward_ops"] == ["MAX", "SUM"], (where, r["forward_ops"])
            assert r["backward_ops"] == (["SUM"] if hidden else []), (where, r["backward_ops"])
            assert r["on_subgroup"] and not r["group_is_world"], where
            # The shard knows the global vocabulary size (from_group): one host read per call.
            assert r["host_reads"] == 1, (where, r["host_reads"])
    whole = score_aligned_support(case.logits, case.sampled_ids, case.row_ids, case.loss_mask, case.support)
    for rank, res in enumerate(ranks):
        r = res["hand_built_shard"]
        torch.testing.assert_close(r["logprobs"], whole.logprobs, atol=1e-10, rtol=0)
        assert r["host_reads"] == 2, r["host_reads"]
        assert r["error"] is not None and f"holds an id >= vocab_size={V}" in r["error"], (rank, r["error"])
        # A rank whose shard is all -inf adds nothing to the full-vocabulary mass (no NaN).
        masked = score_aligned_support(_masked_logits(case), case.sampled_ids, case.row_ids, case.loss_mask, case.support,
                                       compute_support_mass=True, validate=False).support_logmass
        assert not torch.isnan(res["masked_shard_mass"]).any(), rank
        torch.testing.assert_close(res["masked_shard_mass"], masked, atol=1e-10, rtol=0)
        assert r["negative"] is not None and "sampled id -1 outside the vocabulary [0, V)" in r["negative"], r["negative"]
