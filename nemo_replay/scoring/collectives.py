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

import importlib

import torch
import torch.distributed as dist

__all__ = ["group_size", "all_reduce_max", "reduce_sum_from_shards", "copy_to_shards", "agree", "RankError"]


def group_size(group) -> int:
    """World size of ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    """MAX all-reduce of a detached copy (no gradient flows through a stabiliser)."""
    out = t.detach().clone()
    if group_size(group) > 1:
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
    if group_size(group) == 1:
        return x
    return _ReduceSumFromShards.apply(x, group)


def copy_to_shards(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1 or not x.requires_grad:
        return x
    return _CopyToShards.apply(x, group)


class RankError(RuntimeError):
    """What another rank raised inside :func:`agree`, when its type cannot be rebuilt from its message."""


# Never held back for the others: the process is being stopped (its peers see the group fail).
_PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit)


def _rebuilt(kind: tuple, message: str) -> BaseException:
    """An exception of the type ``kind`` (module, qualified name) with ``message``; a
    :class:`RankError` naming that type when the type cannot be imported or built from one string."""
    module, qualname = kind
    try:
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(cls, _PASS_THROUGH):
            return cls(message)
    except Exception:
        pass
    return RankError(f"{message} ({module}.{qualname})")


def agree(fn, group, *, device, name: str):
    """Run ``fn`` on every rank of ``group``; when any rank raises, every rank raises the same error.

    A check that fails on one rank only (its slice of a sequence under context or sequence
    parallelism, a batch check, an out-of-memory error) would leave the others waiting in the
    next collective until the group's timeout. Here one int32 MAX all-reduce tells every rank
    (plus one object all-gather when some rank failed); each then raises an exception of the
    first failing rank's type (a :class:`RankError` naming the type when it cannot be rebuilt
    from a message) with that rank's message prefixed with ``"<name> rank r of n: "``, chained
    on the failing rank to its own error. ``KeyboardInterrupt``, ``SystemExit`` and
    ``GeneratorExit`` propagate at once. With ``group`` None or of size 1 it is ``fn()``.

    Args:
        device: where the flag lives (the group's backend: CUDA for NCCL, CPU for gloo).
        name: the group's name in the message (``"CP"``, ``"SP"``).
    """
    size = group_size(group)
    if size == 1:
        return fn()
    error, result = None, None
    try:
        result = fn()
    except _PASS_THROUGH:
        raise
    except BaseException as exc:
        error = exc
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag) == 0:
        return result
    got = [None] * size
    mine = None if error is None else ((type(error).__module__, type(error).__qualname__), str(error))
    dist.all_gather_object(got, mine, group=group)
    rank = next(r for r, m in enumerate(got) if m is not None)
    kind, message = got[rank]
    raise _rebuilt(kind, f"{name} rank {rank} of {size}: {message}") from error
