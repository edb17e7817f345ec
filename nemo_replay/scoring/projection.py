"""Hidden-state mode: project only the (position, id) pairs a support needs.

Legend: N positions, H hidden size, V vocabulary rows held by this rank, n scored
positions, w support width, e positions scored over the whole (local) vocabulary
(synthetic EOS), P present pairs, U distinct ids among them.

    z[i, j]  = hidden[pos[i]] . weight[ids[i, j]]      for present[i, j], else 0
    ze[i, v] = hidden[eos[i]] . weight[v]

Naive equivalent (what it never builds): ``full = hidden @ weight.T`` (an ``[N, V]``
matrix), ``z = full[pos[:, None], ids] * present``, ``ze = full[eos]``.

Forward, in chunks of at most ``chunk_size`` pairs:
    each pair is one H-long dot product of a hidden row and a weight row read in place
    (a sampled dense-dense product over a CSR pattern, ``torch.sparse.sampled_addmm``):
    no ``[pairs, H]`` copy of weight rows. A bf16/fp16 weight first has the chunk's
    distinct rows converted to the compute dtype (``[U_chunk, H]``).
Backward, recomputing from ``hidden`` and ``weight`` (nothing ``[pairs, H]`` is kept):
    grad hidden[pos[i]] = sum_j g[i, j] weight[ids[i, j]]
        an ``embedding_bag`` with per-sample weights ``g`` (one bag per position);
    grad weight[u] = sum over pairs (i, j) with ids[i, j] = u of g[i, j] hidden[pos[i]]
        pairs sorted by id, one ``embedding_bag`` over hidden rows (one bag per distinct
        id), so every gradient row is summed completely in the compute dtype before it is
        written: a bf16 weight gradient is rounded once;
    plus ``ge.T @ hidden[eos]`` for the full-vocabulary rows,
    all written into ONE weight-sized gradient in the weight's dtype (no float32 copy of a
    bf16 weight): without full-vocabulary rows and with a weight in the compute dtype, one
    ``embedding_bag`` with a bag per vocabulary row writes every row exactly once (zeros
    included); otherwise vocabulary chunk by vocabulary chunk.

No collectives (the caller all-reduces the hidden gradient under tensor parallelism).
Inputs are not modified.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

__all__ = ["project_support"]


def _rows_per_chunk(width: int, chunk_size: int) -> int:
    return max(1, chunk_size // max(width, 1))


def _table(weight: torch.Tensor, ids: torch.Tensor, cd: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to read and indices into them: the weight itself when it is already in the compute
    dtype, else the chunk's distinct rows converted (``[U, H]``) and the inverse indices."""
    if weight.dtype == cd and weight.is_contiguous():
        return weight, ids
    uniq, inv = torch.unique(ids, return_inverse=True)
    return weight.index_select(0, uniq).to(cd), inv


def _pair_dots(h: torch.Tensor, table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``out[i, j] = h[i] . table[idx[i, j]]`` for h (r, H), table (R, H), idx (r, w) -> (r, w).

    A sampled dense-dense product: the CSR pattern has row i = the w columns idx[i]
    (order and repeats kept), so each value is one dot product with a table row read in place.
    """
    r, w = idx.shape
    crow = torch.arange(0, r * w + 1, w, dtype=torch.int64, device=idx.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        pattern = torch.sparse_csr_tensor(
            crow, idx.reshape(-1), torch.zeros(r * w, dtype=h.dtype, device=h.device),
            size=(r, table.shape[0]), check_invariants=False,
        )
        out = torch.sparse.sampled_addmm(pattern, h, table.t())
    return out.values().view(r, w)


class _SupportProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, pos, ids, present, eos, chunk_size, compute_dtype):
        cd = compute_dtype
        n, w = ids.shape
        out = torch.zeros(n, w, dtype=cd, device=hidden.device)
        if n and w:
            step = _rows_per_chunk(w, chunk_size)
            for start in range(0, n, step):
                sl = slice(start, start + step)
                table, idx = _table(weight, ids[sl], cd)
                out[sl] = _pair_dots(hidden[pos[sl]].to(cd), table, idx)
            out.masked_fill_(~present, 0)
        ctx.save_for_backward(hidden, weight, pos, ids, present, eos)
        ctx.chunk_size = chunk_size
        ctx.compute_dtype = cd
        return out, _full_rows(hidden[eos].to(cd), weight, chunk_size, cd)

    @staticmethod
    def backward(ctx, grad_out, grad_eos):
        hidden, weight, pos, ids, present, eos = ctx.saved_tensors
        cd, chunk_size = ctx.compute_dtype, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = torch.where(present, grad_out.to(cd), torch.zeros((), dtype=cd, device=grad_out.device))
        ge = grad_eos.to(cd)
        h_eos = hidden[eos].to(cd)
        grad_h = grad_w = None
        if need_h:
            grad_h = torch.zeros(hidden.shape, dtype=cd, device=hidden.device)
            n, w = ids.shape
            if n and w:
                step = _rows_per_chunk(w, chunk_size)
                for start in range(0, n, step):
                    sl = slice(start, start + step)
                    table, idx = _table(weight, ids[sl], cd)
                    grad_h.index_add_(0, pos[sl], F.embedding_bag(idx, table, per_sample_weights=g[sl], mode="sum"))
            if eos.numel():
                grad_h.index_add_(0, eos, _rows_times_weight(ge, weight, chunk_size, cd))
            grad_h = grad_h.to(hidden.dtype)
        if need_w:
            grad_w = _weight_grad(hidden, weight, pos, ids, present, g, h_eos, ge, chunk_size, cd)
        return grad_h, grad_w, None, None, None, None, None, None


def _full_rows(h_eos: torch.Tensor, weight: torch.Tensor, chunk_size: int, cd: torch.dtype) -> torch.Tensor:
    """``h_eos @ weight.T`` (e, V) in the compute dtype, converting weight rows chunk by chunk."""
    V = weight.shape[0]
    out = torch.empty(h_eos.shape[0], V, dtype=cd, device=h_eos.device)
    if h_eos.shape[0] == 0:
        return out
    if weight.dtype == cd:
        return torch.mm(h_eos, weight.t(), out=out)
    for v0 in range(0, V, chunk_size):
        out[:, v0 : v0 + chunk_size] = h_eos @ weight[v0 : v0 + chunk_size].to(cd).t()
    return out


def _rows_times_weight(ge: torch.Tensor, weight: torch.Tensor, chunk_size: int, cd: torch.dtype) -> torch.Tensor:
    """``ge @ weight`` (e, H) in the compute dtype, converting weight rows chunk by chunk."""
    if weight.dtype == cd:
        return ge @ weight
    acc = torch.zeros(ge.shape[0], weight.shape[1], dtype=cd, device=ge.device)
    for v0 in range(0, weight.shape[0], chunk_size):
        acc.addmm_(ge[:, v0 : v0 + chunk_size], weight[v0 : v0 + chunk_size].to(cd))
    return acc


def _weight_grad(hidden, weight, pos, ids, present, g, h_eos, ge, chunk_size, cd) -> torch.Tensor:
    """The one weight-sized gradient (V, H) in the weight's dtype.

    Worked example (V = 6, two positions, w = 2, pairs (row, id, g)):
        pairs  (0, 4, a) (0, 1, b) (1, 4, c) (1, 2, d)
        sorted by id:  ids [1, 2, 4, 4]  rows [0, 1, 0, 1]  g [b, d, a, c]
        bags (distinct ids) [1, 2, 4] with offsets [0, 1, 2]
        grad[1] = b h0,  grad[2] = d h1,  grad[4] = a h0 + c h1,  other rows 0
    Without full-vocabulary rows and with the weight in the compute dtype, one
    ``embedding_bag`` with a bag per vocabulary row (empty bags give zero rows) writes every
    gradient row exactly once. Otherwise, vocabulary chunk [v0, v1) starts as the EOS rows'
    ``ge.T @ h_eos`` (or zeros) and adds the bags whose id falls in it, a contiguous run of
    the sorted pairs found by ``searchsorted``.
    """
    V, H = weight.shape
    device = weight.device
    direct = weight.dtype == cd
    keep = torch.nonzero(present.reshape(-1)).flatten()
    w = ids.shape[1]
    flat_ids = ids.reshape(-1)[keep]
    order = torch.argsort(flat_ids, stable=True)
    ids_s = flat_ids[order]
    rows_s = torch.div(keep[order], max(w, 1), rounding_mode="floor")  # row of the pair in ``pos``
    g_s = g.reshape(-1)[keep][order]
    uniq, counts = torch.unique_consecutive(ids_s, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts  # first sorted pair of each bag
    h_sel = hidden[pos].to(cd) if uniq.numel() else None
    if direct and ge.shape[0] == 0:
        if h_sel is None:
            return torch.zeros(V, H, dtype=weight.dtype, device=device)
        per_row = torch.bincount(ids_s, minlength=V)
        return F.embedding_bag(rows_s, h_sel, torch.cumsum(per_row, 0) - per_row, mode="sum", per_sample_weights=g_s)
    grad_w = torch.empty(V, H, dtype=weight.dtype, device=device)
    vchunk = max(chunk_size, 1)
    edges = torch.arange(0, V + vchunk, vchunk, device=device).clamp_(max=V)
    bag_edges = torch.searchsorted(uniq, edges).tolist()
    pair_edges = torch.cat([starts, counts.sum().reshape(1)])  # sorted-pair bounds of the bags
    scratch = None if direct else torch.empty(min(vchunk, V), H, dtype=cd, device=device)
    for c in range(len(bag_edges) - 1):
        v0, v1 = int(edges[c]), int(edges[c + 1])
        if v1 <= v0:
            continue
        dst = grad_w[v0:v1] if direct else scratch[: v1 - v0]
        if ge.shape[0]:
            torch.mm(ge[:, v0:v1].t(), h_eos, out=dst)
        else:
            dst.zero_()
        b0, b1 = bag_edges[c], bag_edges[c + 1]
        if b1 > b0:
            p0, p1 = int(pair_edges[b0]), int(pair_edges[b1])
            sums = F.embedding_bag(
                rows_s[p0:p1], h_sel, starts[b0:b1] - p0, mode="sum", per_sample_weights=g_s[p0:p1]
            )  # (b1 - b0, H): complete per-id sums
            dst.index_add_(0, uniq[b0:b1] - v0, sums)
        if not direct:
            grad_w[v0:v1].copy_(dst)
    return grad_w


def project_support(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    pos: torch.Tensor,
    ids: torch.Tensor,
    present: torch.Tensor,
    eos: torch.Tensor,
    *,
    chunk_size: int,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the support pairs, and full local-vocabulary scores of a few rows, from hidden states.

    Args:
        hidden: (N, H), float. Not modified.
        weight: (V, H), float, this rank's LM-head rows. Not modified.
        pos: (n,), int64 rows of ``hidden`` scored over a support.
        ids: (n, w), int64 local rows of ``weight`` (any valid index where not present).
        present: (n, w), bool.
        eos: (e,), int64 rows of ``hidden`` scored over the whole local vocabulary.
        chunk_size: pairs per chunk (rows per chunk = chunk_size // w, at least 1); also
            the vocabulary rows per chunk of the backward.
        compute_dtype: float32 or float64.

    Returns:
        z: (n, w), compute_dtype; 0 where not present.
        ze: (e, V), compute_dtype.
    """
    return _SupportProjection.apply(hidden, weight, pos, ids, present, eos, chunk_size, compute_dtype)
