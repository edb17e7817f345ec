"""Hidden-state mode: project only the (position, id) pairs a support needs.

Legend: N positions, H hidden size, V vocabulary rows held by this rank, n scored
positions, w support width.

    z[i, j] = hidden[pos[i]] . weight[ids[i, j]]        for present[i, j], else 0

Naive equivalent (what it never builds): ``(hidden @ weight.T)[pos[:, None], ids]``, a
``[N, V]`` matrix. Here the work is split into chunks of at most ``chunk_size`` pairs; a
chunk gathers its weight rows ``[rows, w, H]``, runs one batched matmul, and drops them.
Backward recomputes the same gathers chunk by chunk, so no ``[pairs, H]`` activation is
kept between forward and backward, and it allocates one weight-sized gradient (in float32
when the weight is bf16/fp16, so that many small updates do not round away).
No collectives. Inputs are not modified.
"""

from __future__ import annotations

import torch

__all__ = ["project_support"]


def _rows_per_chunk(width: int, chunk_size: int) -> int:
    return max(1, chunk_size // max(width, 1))


class _SupportProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, pos, ids, present, chunk_size, compute_dtype):
        n, w = ids.shape
        out = torch.zeros(n, w, dtype=compute_dtype, device=hidden.device)
        step = _rows_per_chunk(w, chunk_size)
        for start in range(0, n, step):
            sl = slice(start, start + step)
            h = hidden[pos[sl]].to(compute_dtype)  # [r, H]
            rows = weight[ids[sl]].to(compute_dtype)  # [r, w, H]
            out[sl] = torch.bmm(rows, h.unsqueeze(2)).squeeze(2)
        out.masked_fill_(~present, 0)
        ctx.save_for_backward(hidden, weight, pos, ids, present)
        ctx.chunk_size = chunk_size
        ctx.compute_dtype = compute_dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, pos, ids, present = ctx.saved_tensors
        cd = ctx.compute_dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = torch.where(present, grad_out.to(cd), torch.zeros((), dtype=cd, device=grad_out.device))
        grad_h = torch.zeros(hidden.shape, dtype=cd, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=cd, device=weight.device) if need_w else None
        n, w = ids.shape
        step = _rows_per_chunk(w, ctx.chunk_size)
        H = hidden.shape[-1]
        for start in range(0, n, step):
            sl = slice(start, start + step)
            gc = g[sl]  # [r, w]
            if need_h:
                rows = weight[ids[sl]].to(cd)  # [r, w, H]
                grad_h.index_add_(0, pos[sl], torch.bmm(gc.unsqueeze(1), rows).squeeze(1))
            if need_w:
                h = hidden[pos[sl]].to(cd)  # [r, H]
                grad_w.index_add_(0, ids[sl].reshape(-1), (gc.unsqueeze(2) * h.unsqueeze(1)).reshape(-1, H))
        if grad_h is not None:
            grad_h = grad_h.to(hidden.dtype)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def project_support(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    pos: torch.Tensor,
    ids: torch.Tensor,
    present: torch.Tensor,
    *,
    chunk_size: int,
    compute_dtype: torch.dtype,
) -> torch.Tensor:
    """Scores of the support pairs from hidden states.

    Args:
        hidden: (N, H), float. Not modified.
        weight: (V, H), float, this rank's LM-head rows. Not modified.
        pos: (n,), int64 rows of ``hidden`` to score.
        ids: (n, w), int64 local rows of ``weight`` (any valid index where not present).
        present: (n, w), bool.
        chunk_size: pairs per chunk (rows per chunk = chunk_size // w, at least 1).
        compute_dtype: float32 or float64.

    Returns:
        (n, w), compute_dtype; 0 where not present.
    """
    return _SupportProjection.apply(hidden, weight, pos, ids, present, chunk_size, compute_dtype)
