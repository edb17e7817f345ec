"""The scorer on every device the machine has: CPU always, CUDA (NCCL for TP) where present.

The CUDA cases carry the ``gpu`` marker and are skipped on machines without CUDA; on a GPU
machine ``python -m pytest -m gpu`` runs them. Each case is checked against the float64
dense-loop reference on the CPU, values and gradients, in float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_replay import VocabShard, score_aligned_support
from tests.scoring.batches import make_case
from tests.scoring.reference import reference_scores
from tests.spawn import devices, run_workers

SPLIT = (0, 200, 423)  # uneven TP=2 vocabulary split
TEMPERATURE = 0.8


def _case():
    return make_case(B=3, T=29, V=423, k=7, H=16, seed=5, eos=(2,))


def _reference(case):
    logits = case.logits.clone().requires_grad_()
    ref = reference_scores(logits, case.sampled_ids, case.row_ids, case.loss_mask, case.sets, temperature=TEMPERATURE)
    (grad,) = torch.autograd.grad(ref["logprobs"].sum(), logits)
    return ref["logprobs"].detach(), grad


def _score(case, device, dtype, hidden: bool, shard: VocabShard):
    """Log-probs and the gradient of their sum w.r.t. this rank's logits slice (or hidden and weight)."""
    lo, hi = shard.start, shard.end
    channels = [t.to(device) for t in (case.sampled_ids, case.row_ids, case.loss_mask)]
    support = case.support.to(device)
    if hidden:
        h = case.hidden.to(device, dtype).requires_grad_()
        w = case.weight[lo:hi].to(device, dtype).requires_grad_()
        out = score_aligned_support(h, *channels, support, shard=shard, lm_head_weight=w, temperature=TEMPERATURE)
        leaves = (h, w)
    else:
        z = case.logits[..., lo:hi].to(device, dtype).requires_grad_()
        out = score_aligned_support(z, *channels, support, shard=shard, temperature=TEMPERATURE)
        leaves = (z,)
    grads = torch.autograd.grad(out.logprobs.sum(), leaves)
    return out.logprobs.detach().cpu(), [g.float().cpu() for g in grads]


def _tp_worker(rank, world_size, device):
    case = _case()
    group = dist.new_group(ranks=list(range(world_size)))
    shard = VocabShard.from_group(group, SPLIT[rank + 1] - SPLIT[rank], device=device)
    return {
        (hidden, str(dtype)): _score(case, device, dtype, hidden, shard)
        for hidden in (False, True)
        for dtype in (torch.float32, torch.bfloat16)
    }


@pytest.mark.parametrize("device", devices(min_gpus=1))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
def test_scorer_on_device_matches_the_float64_reference(device, dtype, hidden):
    case = _case()
    ref_lp, ref_grad = _reference(case)
    lp, grads = _score(case, device, dtype, hidden, VocabShard.whole(423))
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(lp.double(), ref_lp, atol=tol, rtol=0), (lp.double() - ref_lp).abs().max()
    if not hidden:
        assert torch.allclose(grads[0].double(), ref_grad, atol=tol / 10 if dtype == torch.float32 else 0.02)


@pytest.mark.parametrize("device", devices(min_gpus=2))
def test_tensor_parallel_scorer_on_device_equals_one_rank(device):
    """TP=2 over gloo (CPU) or NCCL (CUDA) equals TP=1 on the same device, shard by shard."""
    case = _case()
    ranks = run_workers(_tp_worker, 2, device, device=device)
    for hidden in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            one_lp, one_grads = _score(case, device, dtype, hidden, VocabShard.whole(423))
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            for rank, result in enumerate(ranks):
                lp, grads = result[(hidden, str(dtype))]
                where = f"rank {rank}, hidden={hidden}, {dtype}"
                assert torch.allclose(lp, one_lp, atol=tol, rtol=0), where
                lo, hi = SPLIT[rank], SPLIT[rank + 1]
                if hidden:  # hidden-state gradient is whole on every rank; weight gradient is this shard's rows
                    assert torch.allclose(grads[0], one_grads[0], atol=tol * 10, rtol=0), where
                    assert torch.allclose(grads[1], one_grads[1][lo:hi], atol=tol * 10, rtol=0), where
                else:
                    assert torch.allclose(grads[0], one_grads[0][..., lo:hi], atol=tol, rtol=0), where
