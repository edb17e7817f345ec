"""Logits mode: read the support pairs and the few full-vocabulary rows out of the logits.

Legend: N positions, V vocabulary entries held by this rank, n positions scored over a
support, w support width, e positions scored over the whole (local) vocabulary.

    z[i, j]  = src[pos[i], ids[i, j] - vocab_start] / T     for present[i, j], else ``fill``
    ze[i, :] = src[eos[i], :] / T

Naive equivalent: ``torch.where(present, src[pos[:, None], ids], fill) / T`` and
``src[eos] / T`` as two autograd graphs, whose backward builds two ``[N, V]`` gradients
and adds them. Here the backward allocates ONE zero ``[N, V]`` gradient in the source's
dtype and adds the pair gradients and the row gradients into it (the two sets are
disjoint: a position is scored over a support or over the vocabulary, never both).

Forward: one ``torch.gather`` along the vocabulary (a random read of n*w floats, the cost
floor of logits mode; :func:`_gather_rows`), then the temperature and the fill in place.
No collectives. Inputs are not modified.
"""

from __future__ import annotations

import torch

__all__ = ["select_scores"]


def _local_ids(ids: torch.Tensor, vocab_start: int, V: int) -> torch.Tensor:
    """(n, w) int64 columns of this rank's shard: ``ids - vocab_start``, clamped into ``[0, V)``.

    Entries that are not present (-1 padding, another shard's ids) land on the row's first or
    last column (one cache line) and are masked by the caller. No host sync. Example: V = 5,
    vocab_start = 10, ids = [[14, 11], [10, -1]] -> [[4, 1], [0, 0]].
    """
    local = ids.to(torch.int64, copy=True)  # one new tensor, then in place (never the caller's)
    local.clamp_(vocab_start, vocab_start + V - 1)
    return local.sub_(vocab_start) if vocab_start else local


def _gather_rows(src: torch.Tensor, pos: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``src[pos[i], local[i, j]]`` as (n, w), with ``torch.gather`` along the vocabulary.

    ``gather`` reads row i's columns from row i and runs on every thread (a flat
    ``index_select`` over ``N * V`` ran on one, about 1.6x slower for T = 4096, k = 64 here).
    When some positions are not scored (``n < N``), the others gather column 0 (one cache
    line each) and the scored rows are picked after. Example: N = 3, pos = [0, 2], local =
    [[4, 1], [0, 3]] -> index [[4, 1], [0, 0], [0, 3]], gathered, rows [0, 2].
    """
    N, n = src.shape[0], pos.numel()
    if local.numel() == 0:
        return src.new_zeros(local.shape)
    if n == N:  # every position scored: pos is arange(N) (the plan selects in order)
        return torch.gather(src, 1, local)
    index = torch.zeros(N, local.shape[1], dtype=torch.int64, device=local.device)
    index.index_copy_(0, pos, local)
    return torch.gather(src, 1, index).index_select(0, pos)


class _SelectScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, pos, ids, present, eos, vocab_start, temperature, fill, compute_dtype):
        N, V = src.shape
        local = _local_ids(ids, vocab_start, V)
        z = _gather_rows(src, pos, local)
        z = z.to(compute_dtype)
        ze = src[eos].to(compute_dtype)
        if temperature != 1.0:
            z.div_(temperature)
            ze.div_(temperature)
        if present is not None:
            z.masked_fill_(~present, fill)
        ctx.save_for_backward(pos, local, present, eos)
        ctx.shape, ctx.dtype, ctx.temperature = (N, V), src.dtype, temperature
        return z, ze

    @staticmethod
    def backward(ctx, grad_z, grad_ze):
        pos, local, present, eos = ctx.saved_tensors
        N, V = ctx.shape
        grad = torch.zeros(N * V, dtype=ctx.dtype, device=local.device)
        g = grad_z if present is None else grad_z.masked_fill(~present, 0)
        ge = grad_ze
        if ctx.temperature != 1.0:
            g = g / ctx.temperature
            ge = ge / ctx.temperature
        # index_add (not index_copy): repeated ids in a row (validate=False) still add up.
        flat = local + (pos * V)[:, None]
        grad.index_add_(0, flat.reshape(-1), g.reshape(-1).to(ctx.dtype))
        grad = grad.view(N, V)
        if eos.numel():
            grad.index_add_(0, eos, ge.to(ctx.dtype))
        return grad, None, None, None, None, None, None, None, None


def select_scores(
    src: torch.Tensor,
    pos: torch.Tensor,
    ids: torch.Tensor,
    present: torch.Tensor,
    eos: torch.Tensor,
    *,
    vocab_start: int,
    temperature: float,
    fill: float,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Support-pair scores and full rows from logits, divided by the temperature.

    Args:
        src: (N, V), float logits of this rank's vocabulary shard. Not modified.
        pos: (n,), int64 rows scored over a support.
        ids: (n, w), int (int32 support rows as they come) global vocabulary ids; anything
            where not present (-1 padding, another shard's ids).
        present: (n, w), bool, or None when every entry is present.
        eos: (e,), int64 rows scored over the whole local vocabulary (disjoint from ``pos``).
        vocab_start: first global id of this rank's shard.
        temperature: divides every score.
        fill: score where not present (the compute dtype's lowest value: ``exp`` gives 0).
        compute_dtype: float32 or float64.

    Returns:
        z: (n, w), compute_dtype.
        ze: (e, V), compute_dtype.
    """
    return _SelectScores.apply(src, pos, ids, present, eos, int(vocab_start), float(temperature), float(fill), compute_dtype)
