"""Ulysses sequence parallelism: sequence shards, and the all-to-all around attention.

The ranks of one SP group hold the same micro-batch. Each keeps one contiguous slice of
the sequence dimension of every token-aligned tensor; attention needs the whole sequence,
so around it an all-to-all trades the sequence shard for a head shard (DeepSpeed-Ulysses):

    before attention   q (B, H, S/sp, D)   all heads, my sequence slice
    seq_to_heads       q (B, H/sp, S, D)   my heads, the whole sequence
    heads_to_seq       o (B, H, S/sp, D)   back after attention

Worked example, sp = 2, a [B=1, S=5] channel with fill -1:

    full           [r0, r1, r2, r3, r4]
    padded (S=6)   [r0, r1, r2, r3, r4, -1]     S padded up to a multiple of sp
    rank 0 slice   [r0, r1, r2]
    rank 1 slice   [r3, r4, -1]
    gather_sequence(slice, seq_len=5) -> [r0, r1, r2, r3, r4] on both ranks

Every token-aligned tensor ``[B, S, ...]`` goes through :func:`pad_and_slice` with its own
fill (``0`` for ids and masks, ``-1`` for support row ids and trajectory ids), so all of
them take exactly the same slice. The SP group is always an explicit argument; ``None``
means no sequence parallelism (size 1, no collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_replay.distributed.groups import group_size_rank

__all__ = [
    "padded_length",
    "pad_and_slice",
    "gather_sequence",
    "all_to_all",
    "seq_to_heads",
    "heads_to_seq",
]


def padded_length(seq_len: int, sp_size: int) -> int:
    """``seq_len`` rounded up to a multiple of ``sp_size`` (7, 2 -> 8; 6, 2 -> 6)."""
    return -(-seq_len // sp_size) * sp_size


def pad_and_slice(x: torch.Tensor, group, *, fill, dim: int = 1) -> torch.Tensor:
    """This rank's slice of ``x`` along the sequence dimension, after padding with ``fill``.

    Args:
        x: (B, S, ...) any dtype (the sequence is ``dim``, 1 by default). Every rank of
            ``group`` must pass the same S.
        group: the SP process group, or None (returns ``x`` itself).
        fill: value of the padded positions: 0 for token ids, position ids and masks, -1
            for support row ids and trajectory ids.

    Returns:
        (B, S_pad / sp, ...) with S_pad = :func:`padded_length` (S, sp); rank r holds
        padded positions ``[r * S_pad / sp, (r + 1) * S_pad / sp)``. Differentiable in
        ``x``; ``x`` is not modified.
    """
    sp, rank = group_size_rank(group)
    if sp == 1:
        return x
    dim = dim % x.dim()
    S = x.shape[dim]
    S_pad = padded_length(S, sp)
    if S_pad != S:
        tail = x.new_full((*x.shape[:dim], S_pad - S, *x.shape[dim + 1 :]), fill)
        x = torch.cat([x, tail], dim)
    local = S_pad // sp
    return x.narrow(dim, rank * local, local)


def _to_wire(t: torch.Tensor) -> torch.Tensor:
    # gloo has no bool collectives; bytes travel instead and are cast back.
    return t.to(torch.uint8) if t.dtype == torch.bool else t


class _GatherSequence(torch.autograd.Function):
    """y = concatenation along ``dim`` of every SP rank's slice.

    Forward: one all-gather over the SP group. Backward: no collective; this rank's slice
    of the incoming gradient, times ``grad_scale``. Naive equivalent on one process:
    ``y = torch.cat([x_0, ..., x_{sp-1}], dim)``.

    Every rank of the group computes the same loss from ``y``, so the exact gradient of
    this rank's slice is its slice of ``dy``; ``grad_scale`` lets a caller undo a later
    average over the same ranks (FSDP averages gradients over all ranks, including the
    SP ranks that share one batch: pass the SP size there). ``x`` is not modified.
    """

    @staticmethod
    def forward(ctx, x, group, dim, grad_scale):
        sp, rank = group_size_rank(group)
        ctx.dim, ctx.rank, ctx.local, ctx.grad_scale = dim, rank, x.shape[dim], grad_scale
        wire = _to_wire(x).contiguous()
        parts = [torch.empty_like(wire) for _ in range(sp)]
        dist.all_gather(parts, wire, group=group)
        return torch.cat(parts, dim).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        g = grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local)
        if ctx.grad_scale != 1.0:
            g = g * ctx.grad_scale
        return g.contiguous(), None, None, None


def gather_sequence(
    x: torch.Tensor,
    group,
    *,
    dim: int = 1,
    seq_len: int | None = None,
    grad_scale: float = 1.0,
) -> torch.Tensor:
    """Undo :func:`pad_and_slice`: all-gather the slices and drop the padding.

    Args:
        x: (B, S_pad / sp, ...), this rank's slice, any dtype.
        group: the SP process group, or None (returns ``x`` trimmed to ``seq_len``).
        seq_len: S before padding; None keeps the padded length.
        grad_scale: multiplies the gradient of ``x`` (see :class:`_GatherSequence`).

    Returns:
        (B, S, ...), the same on every rank; differentiable in ``x`` for float dtypes.
    """
    dim = dim % x.dim()
    sp, _ = group_size_rank(group)
    if sp > 1:
        x = _GatherSequence.apply(x, group, dim, float(grad_scale))
    if seq_len is not None:
        if seq_len > x.shape[dim]:
            raise ValueError(
                f"seq_len {seq_len} is longer than the gathered sequence ({x.shape[dim]} positions along "
                f"dimension {dim}, SP size {sp}); pass the length S that pad_and_slice was given"
            )
        x = x.narrow(dim, 0, seq_len)
    return x


def _all_to_all_forward(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    sp, _ = group_size_rank(group)
    # Chunk j of my scatter dimension goes to rank j; chunk r of the result came from rank r.
    send = torch.stack([c.contiguous() for c in x.chunk(sp, scatter_dim)], 0)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), gather_dim)


class _AllToAll(torch.autograd.Function):
    """Split ``x`` along ``scatter_dim`` into sp chunks, send chunk j to rank j, and
    concatenate the chunks received along ``gather_dim`` in rank order.

    Forward: one ``all_to_all_single``. Backward: one ``all_to_all_single``, the same
    exchange with the two dimensions swapped (it is the transpose of the forward).
    Naive equivalent on one process, with ``xs[r]`` the input of rank r:
    ``y[j] = torch.cat([xs[r].chunk(sp, scatter_dim)[j] for r in range(sp)], gather_dim)``.
    ``x`` is not modified.
    """

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all_forward(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_forward(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Autograd-aware all-to-all over the SP group (see :class:`_AllToAll`)."""
    sp, _ = group_size_rank(group)
    if sp == 1:
        return x
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if x.shape[scatter_dim] % sp:
        raise ValueError(
            f"all_to_all splits dimension {scatter_dim} of size {x.shape[scatter_dim]} over {sp} ranks; "
            f"it must be a multiple of the SP size; pad it with pad_and_slice first or choose an SP size that divides it"
        )
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, heads, S / sp, D) -> (B, heads / sp, S, D): my heads over the whole sequence.

    Rank g keeps heads ``[g * heads / sp, (g + 1) * heads / sp)``.
    """
    return all_to_all(x, group, scatter_dim=1, gather_dim=2)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, heads / sp, S, D) -> (B, heads, S / sp, D): the inverse of :func:`seq_to_heads`."""
    return all_to_all(x, group, scatter_dim=2, gather_dim=1)
