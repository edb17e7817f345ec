"""The tensor-parallel collectives of the scorer, as autograd functions.

The scorer's loss is replicated on every rank of ``tp_group`` while each rank holds one
vocabulary shard. Two regions follow (the same pair Megatron-Core uses around its
vocab-parallel layers):

- :func:`reduce_sum_from_shards`: forward SUM all-reduce of per-shard partial sums,
  backward identity (each rank's partial enters the replicated total with weight 1).
- :func:`copy_to_shards`: forward identity on a replicated input (hidden states feeding a
  vocab-sharded projection), backward SUM all-reduce of the per-shard gradient parts.

Both return a new tensor and never modify their input. With ``group=None`` or a group of
size 1 they issue no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_replay.distributed.groups import group_size_rank

__all__ = ["all_reduce_max", "reduce_sum_from_shards", "copy_to_shards"]


def all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    """MAX all-reduce of a detached copy (no gradient flows through a stabiliser)."""
    out = t.detach().clone()
    if group_size_rank(group)[0] > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


class _ReduceSumFromShards(torch.autograd.Function):
    """y = sum over ranks of x_r.  Forward: 1 SUM all-reduce.  Backward: identity, 0 collectives.

    Naive equivalent on one process: ``y = torch.stack(xs).sum(0)`` with each rank
    back-propagating ``dL/dy`` into its own ``x_r``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _CopyToShards(torch.autograd.Function):
    """y = x (replicated).  Forward: identity, 0 collectives.  Backward: 1 SUM all-reduce."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def reduce_sum_from_shards(x: torch.Tensor, group) -> torch.Tensor:
    if group_size_rank(group)[0] == 1:
        return x
    return _ReduceSumFromShards.apply(x, group)


def copy_to_shards(x: torch.Tensor, group) -> torch.Tensor:
    if group_size_rank(group)[0] == 1 or not x.requires_grad:
        return x
    return _CopyToShards.apply(x, group)
