"""Hidden-state mode: project only the (position, id) pairs a support needs.

Legend: N positions, H hidden size, V vocabulary rows held by this rank, n scored
positions, w support width, P present pairs (the members this rank holds), e positions
scored over the whole (local) vocabulary (synthetic EOS), U distinct ids among the pairs.

    z[i, j]  = hidden[pos[i]] . weight[ids[i, j]] / T      for present pairs, else ``fill``
    ze[i, v] = hidden[full_pos[i]] . weight[v] / T

(``fill`` is written after the division, so a fill of the dtype's lowest value never
overflows to -inf.)

Naive equivalent (what it never builds): ``full = hidden @ weight.T`` (an ``(N, V)``
matrix), ``z = torch.where(present, full[pos[:, None], ids], fill)``, ``ze = full[full_pos]``.

Pairs. Only present pairs are projected: ``flat`` lists them as indices into the
``n * w`` grid, row-major, so their rows never decrease. Rows cut by top-p / min-p (a few
members in a width of 64) and, under tensor parallelism, the members of other ranks'
shards cost nothing. Worked example, w = 3::

    ids   = [[4, 1, -1], [2, -1, -1]]    present = [[T, T, F], [T, F, F]]
    flat  = [0, 1, 3]   ->  pair rows flat // w = [0, 0, 1], pair ids [4, 1, 2]

Chunks. The caller cuts the pairs into chunks of at most ``chunk_size`` pairs
(:class:`PairChunk`: pairs ``[p0, p1)`` of ``flat``, rows ``[r0, r1)`` of ``pos``); a row
whose pairs straddle two chunks is simply in both. Each chunk converts only its own
hidden rows to the compute dtype (``[r1 - r0, H]``) and, for a weight not in the compute
dtype, only its own distinct weight rows (``(U_chunk, H)``, at most ``chunk_size``).

Forward, per chunk: each pair is one H-long dot product. On the CPU a sampled
dense-dense product over a CSR pattern (``torch.sparse.sampled_addmm``) reads each weight
row in place: no ``[pairs, H]`` copy. Its pattern keeps repeated columns in a row (ids of
other shards, rows that name one table row twice), which it only accepts when the table
has at least ``nnz / rows`` rows (it sizes its output as a dense ``rows x table_rows``
matrix first), so a short table is padded with zero rows. On other devices the chunk's
weight rows are gathered (``[pairs_chunk, H]``) and multiplied.

Backward, recomputing from ``hidden`` and ``weight`` (nothing ``[pairs, H]`` is kept):
    grad hidden[pos[i]] = sum_j g[i, j] weight[ids[i, j]]
        per chunk an ``embedding_bag`` with per-sample weights ``g`` (one bag per row);
    grad weight[u] = sum over pairs (i, j) with ids[i, j] = u of g[i, j] hidden[pos[i]]
        pairs sorted by id and cut into runs of one id (:func:`_runs`), the runs into blocks
        of about a thousand ids, sized by the plan's host read (:class:`RunSizes`, counted
        from a histogram of the ids: the backward reads nothing); per block one
        ``embedding_bag`` over hidden rows (one bag per distinct id) whose sums, still in
        cache, go straight into the buffer's rows (:func:`_block_sums`). Every gradient row
        is summed completely in the compute dtype before it is written: a bf16 weight
        gradient is rounded once;
    plus ``ge.T @ hidden[full_pos]`` for the full-vocabulary rows, all written into ONE
    weight-sized gradient in the weight's dtype (vocabulary chunk by vocabulary chunk when
    the weight is not in the compute dtype or full-vocabulary rows exist).

Sparse weight gradient. Only the support's rows (about U of V) are non-zero, yet a dense
gradient writes all V rows (plus the page faults of a fresh tensor), and the trainer then
adds it into its own gradient buffer, another full pass. When the trainer keeps a
persistent buffer, the backward accumulates the U rows into it instead
(:func:`persistent_grad_buffer` says which buffer, :func:`_accumulate_rows` does it):

- megatron-core's protocol: the weight carries ``main_grad`` and ``grad_added_to_main_grad``
  (its DistributedDataParallel sets them up, with or without gradient-accumulation fusion).
  Rows go into ``main_grad``, ``grad_added_to_main_grad`` is set, and autograd gets what
  megatron's fused linear layers hand it: an uninitialised dummy its backward hook drops
  (so the hook still runs on the main thread), or nothing when ``zero_out_wgrad`` marks an
  embedding tied to the LM head (the embedding's own gradient then carries the hook; megatron
  hands zeros there, which that hook adds to ``main_grad`` as nothing). Source, megatron-core
  0.16.1: ``tensor_parallel/layers.py`` ``LinearWithGradAccumulationAndAsyncCommunication.backward``
  (the dummy, lines 581-610) and ``distributed/distributed_data_parallel.py``
  ``_make_backward_post_hook`` (adds ``.grad`` to ``main_grad`` when ``grad_added_to_main_grad``
  is unset or ``zero_out_wgrad`` is set, lines 427-445);
- an existing ``.grad`` on a leaf weight whose gradient autograd is about to accumulate
  (``loss.backward()`` with ``.grad`` kept between micro-batches): rows are added to it in
  place and autograd gets nothing (its accumulation has nothing left to add).

Everything else gets the dense gradient: a weight with tensor hooks (``register_hook``,
``register_post_accumulate_grad_hook``: a hook that scales, clips or zeroes the gradient, or
records it, sees what it would see without replay; rows added behind its back would skip it),
``torch.autograd.grad`` (the caller wants the
gradient returned, also under ``create_graph``; the backward is once differentiable), no
buffer yet (the first micro-batch after ``zero_grad(set_to_none=True)``), a buffer of
another shape, dtype or device, and FSDP2 in its default mode (it reduce-scatters the unsharded gradient as one
dense tensor and frees it after every backward, so no buffer persists; under
``set_requires_gradient_sync(False)`` with the parameter's own dtype as reduce dtype the
unsharded ``.grad`` persists and the second micro-batch on is accumulated in place).

No collectives (the caller all-reduces the hidden gradient under tensor parallelism).
Inputs are not modified; a persistent gradient buffer is, as autograd would.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from nemo_replay.support.nonzero import nonzero_static

__all__ = [
    "PairChunk", "RunSizes", "project_support", "persistent_grad_buffer", "run_sizes_after_read",
    "run_sizes_before_read", "weight_grad_sizes",
]


class PairChunk(NamedTuple):
    """Pairs ``flat[p0:p1]`` (at most ``chunk_size``) whose rows lie in ``pos[r0:r1]``."""

    p0: int
    p1: int
    r0: int
    r1: int


def _table(weight: torch.Tensor, ids: torch.Tensor, cd: torch.dtype, min_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to read and indices into them.

    The weight itself when it is already in the compute dtype, else the chunk's distinct
    rows converted (``(U, H)``) and the inverse indices. Padded with zero rows up to
    ``min_rows`` (the sampled product's requirement, see the module docstring).
    """
    if weight.dtype == cd and weight.is_contiguous():
        table, idx = weight, ids
    elif ids.device.type != "cpu":
        return weight, ids  # the gather path converts the rows it reads
    else:
        uniq, idx = torch.unique(ids, return_inverse=True)
        table = weight.index_select(0, uniq).to(cd)
    if table.shape[0] < min_rows:
        table = torch.cat([table, table.new_zeros(min_rows - table.shape[0], table.shape[1])])
    return table, idx


def _crow(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """CSR row offsets (num_rows + 1,) of non-decreasing pair rows: pairs of row i are crow[i]:crow[i+1]."""
    return torch.searchsorted(rows, torch.arange(num_rows + 1, device=rows.device, dtype=rows.dtype))


def _pair_dots(h: torch.Tensor, table: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[p] = h[rows[p]] . table[idx[p]]`` for h (r, H), table (R, H), idx and rows (p,) -> (p,).

    ``rows`` never decreases. On the CPU: a sampled dense-dense product over the CSR
    pattern whose row i holds the columns ``idx`` of the pairs of row i (order and repeats
    kept), each value one dot product with a table row read in place.
    """
    if idx.device.type != "cpu":
        return (table[idx].to(h.dtype) * h[rows]).sum(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        pattern = torch.sparse_csr_tensor(
            _crow(rows, h.shape[0]), idx, torch.zeros(idx.numel(), dtype=h.dtype, device=h.device),
            size=(h.shape[0], table.shape[0]), check_invariants=False,
        )
        out = torch.sparse.sampled_addmm(pattern, h, table.t())
    return out.values()


def _chunk_pairs(weight, ids, flat, c: PairChunk, cd):
    """(table, table index of each pair (p,), row of each pair within the chunk (p,))."""
    w = ids.shape[1]
    f = flat[c.p0 : c.p1]
    rows = torch.div(f, w, rounding_mode="floor") - c.r0
    table, idx = _table(weight, ids.reshape(-1)[f], cd, min_rows=-(-(c.p1 - c.p0) // max(c.r1 - c.r0, 1)))
    return table, idx, rows


class _SupportProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, pos, ids, flat, full_pos, chunks, sizes, fill, temperature, chunk_size, compute_dtype):
        cd = compute_dtype
        n, w = ids.shape
        values = torch.empty(flat.numel(), dtype=cd, device=hidden.device)
        for c in chunks:
            table, idx, rows = _chunk_pairs(weight, ids, flat, c, cd)
            values[c.p0 : c.p1] = _pair_dots(hidden[pos[c.r0 : c.r1]].to(cd), table, idx, rows)
        if temperature != 1.0:
            values.div_(temperature)
        out = torch.full((n * w,), fill, dtype=cd, device=hidden.device).index_copy_(0, flat, values).view(n, w)
        ctx.save_for_backward(hidden, weight, pos, ids, flat, full_pos)
        ctx.chunks, ctx.chunk_size, ctx.compute_dtype, ctx.temperature = chunks, chunk_size, cd, temperature
        ctx.sizes = sizes
        ze = _full_rows(hidden[full_pos].to(cd), weight, chunk_size, cd)
        return out, ze.div_(temperature) if temperature != 1.0 else ze

    @staticmethod
    @once_differentiable  # a first-order gradient (also under create_graph); no double backward
    def backward(ctx, grad_out, grad_eos):
        hidden, weight, pos, ids, flat, full_pos = ctx.saved_tensors
        cd, chunk_size = ctx.compute_dtype, ctx.chunk_size
        g = grad_out.reshape(-1)[flat].to(cd) / ctx.temperature  # (P,): absent entries get no gradient
        ge = grad_eos.to(cd) / ctx.temperature
        grad_h = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_h = _hidden_grad(hidden, weight, pos, ids, flat, full_pos, g, ge, ctx.chunks, chunk_size, cd)
        if ctx.needs_input_grad[1]:
            if ctx.sizes is None:
                raise RuntimeError("project_support: the LM-head weight needs a gradient but no RunSizes were given "
                                   "(the plan reads them when grad mode is on and the weight requires grad)")
            buffer = persistent_grad_buffer(weight)
            if buffer is None:
                grad_w = _weight_grad(hidden, weight, pos, ids, flat, g, hidden[full_pos].to(cd), ge, ctx.sizes,
                                      chunk_size, cd)
            else:
                _accumulate_rows(buffer, hidden, pos, ids, flat, g, hidden[full_pos].to(cd), ge, ctx.sizes, chunk_size, cd)
                grad_w = _handed_to_autograd(weight, buffer)
        return grad_h, grad_w, None, None, None, None, None, None, None, None, None, None


def _hidden_grad(hidden, weight, pos, ids, flat, full_pos, g, ge, chunks, chunk_size, cd) -> torch.Tensor:
    """(N, H) in the hidden states' dtype: the pairs' weight rows weighted by g, plus the EOS rows'."""
    grad_h = torch.zeros(hidden.shape, dtype=cd, device=hidden.device)
    for c in chunks:
        table, idx, rows = _chunk_pairs(weight, ids, flat, c, cd)
        gc = g[c.p0 : c.p1]
        if idx.device.type == "cpu":
            bags = F.embedding_bag(idx, table, _crow(rows, c.r1 - c.r0)[:-1], mode="sum", per_sample_weights=gc)
            grad_h.index_add_(0, pos[c.r0 : c.r1], bags)
        else:
            grad_h.index_add_(0, pos[c.r0 : c.r1][rows], table[idx].to(cd) * gc[:, None])
    if full_pos.numel():
        grad_h.index_add_(0, full_pos, _rows_times_weight(ge, weight, chunk_size, cd))
    return grad_h.to(hidden.dtype)


def _vocab_step(V: int, chunk_size: int) -> int:
    """Vocabulary rows per step when weight-sized data is converted: at most ``chunk_size`` and at
    most 1/32 of the vocabulary, so a converted chunk stays a small fraction of the weight."""
    return max(1, min(chunk_size, -(-V // 32)))


def _full_rows(h_eos: torch.Tensor, weight: torch.Tensor, chunk_size: int, cd: torch.dtype) -> torch.Tensor:
    """``h_eos @ weight.T`` (e, V) in the compute dtype, converting weight rows chunk by chunk."""
    V = weight.shape[0]
    out = torch.empty(h_eos.shape[0], V, dtype=cd, device=h_eos.device)
    if h_eos.shape[0] == 0:
        return out
    if weight.dtype == cd:
        return torch.mm(h_eos, weight.t(), out=out)
    step = _vocab_step(V, chunk_size)
    for v0 in range(0, V, step):
        out[:, v0 : v0 + step] = h_eos @ weight[v0 : v0 + step].to(cd).t()
    return out


def _rows_times_weight(ge: torch.Tensor, weight: torch.Tensor, chunk_size: int, cd: torch.dtype) -> torch.Tensor:
    """``ge @ weight`` (e, H) in the compute dtype, converting weight rows chunk by chunk."""
    if weight.dtype == cd:
        return ge @ weight
    acc = torch.zeros(ge.shape[0], weight.shape[1], dtype=cd, device=ge.device)
    step = _vocab_step(weight.shape[0], chunk_size)
    for v0 in range(0, weight.shape[0], step):
        acc.addmm_(ge[:, v0 : v0 + step], weight[v0 : v0 + step].to(cd))
    return acc


class _SortedPairs(NamedTuple):
    """The present pairs sorted by id: ids (P,) int64, their row in ``pos`` (P,), g (P,) in cd."""

    ids: torch.Tensor
    rows: torch.Tensor
    g: torch.Tensor


def _sorted_pairs(ids, flat, g) -> _SortedPairs:
    """Sort the pairs by id (stable), keeping each pair's row in ``pos`` and its gradient."""
    w = ids.shape[1]
    pair_ids = ids.reshape(-1)[flat]
    order = torch.argsort(pair_ids, stable=True)
    return _SortedPairs(pair_ids[order], torch.div(flat[order], w, rounding_mode="floor"), g[order])


# Bytes of row sums per block of distinct ids (1024 ids at H = 2048 in float32): few enough to
# stay in the last-level cache between the bag that sums them and the index_add_ that adds them
# to the buffer, many enough that index_add_ runs on every thread (it runs on one below a few
# thousand rows). Against one (U, H) scratch (86 MB at T=512 V=128k H=2048 k=64) the blocks
# were 10-20% faster with one thread and within +-10% with two, depending on the harness
# (2 MiB blocks: the same spread).
_BLOCK_BYTES = 8 << 20


class _Runs(NamedTuple):
    """The sorted pairs cut into runs of one id, the runs cut into blocks of ``block`` ids.

    uniq: (U,) int64 distinct local ids, increasing; starts: (U,) int64 the pair offset of
    each run; edges: host ints, block b holds runs ``[b block, (b + 1) block)`` = sorted pairs
    ``[edges[b], edges[b + 1])``; vocab: host ints, the run index of each requested vocabulary
    edge (the first run whose id is >= it).
    """

    pairs: _SortedPairs
    uniq: torch.Tensor
    starts: torch.Tensor
    block: int
    edges: list
    vocab: list


class RunSizes(NamedTuple):
    """The host sizes of the weight gradient's runs, read with the plan's guards (so the
    backward reads nothing): U distinct ids, ``block`` ids per block, ``edges`` the pair
    offsets of the blocks (block b = sorted pairs ``[edges[b], edges[b + 1])``), ``vocab`` the
    run index of each vocabulary chunk edge (:func:`_vocab_edges`)."""

    num_ids: int
    block: int
    edges: list
    vocab: list


def weight_grad_sizes(weight: torch.Tensor, chunk_size: int, cd: torch.dtype) -> tuple[int, int]:
    """(ids per block, vocabulary rows per chunk) of the weight gradient of ``weight`` (V, H)."""
    return _block_ids(weight.shape[1], cd), max(chunk_size, 1)


def _vocab_edges(V: int, step: int) -> list:
    """Host edges of the vocabulary chunks: ``[0, step, 2 step, ..., V]``."""
    return list(range(0, V, step)) + [V]


def run_sizes_before_read(keys: torch.Tensor, V: int, block: int, step: int) -> dict:
    """The device values :class:`RunSizes` is read from, by counting ids: no sort, no host read.

    keys: (N, w) int64, each present pair's local id and ``V`` elsewhere; the vocabulary
    edges are :func:`_vocab_edges` ``(V, step)``, built on the device (a tensor made from a
    host list would be a copy the device stream waits for).
    From the pairs per id (a histogram over V + 1 bins, by ``scatter_add_``: ``bincount``
    reads the largest key on the host): ``distinct[v]`` = distinct ids
    ``<= v``; block b starts at the first id whose ``distinct`` reaches ``b block + 1``, that
    is after the pairs of every smaller id (P when there is none: at most ``min(V, N w)``
    distinct ids, so the marks' count is fixed before the read); vocabulary edge e starts
    at run ``distinct[e - 1]``. Worked example, V = 8, pair ids [4, 1, 7, 2, 4], block 2, step 3:
    pairs per id [0 1 1 0 2 0 0 1]; distinct [0 1 2 2 3 3 3 4], U = 4; pairs before each id
    [0 0 1 2 2 4 4 4]; marks [0 2 4 6 8] reach distinct 1, 3, 5, ... at ids 1, 4, none ->
    edges [0 2 5 5 5] (blocks: ids {1, 2} = pairs [0, 2), ids {4, 7} = pairs [2, 5)); vocab
    edges [0 3 6 8] -> runs [0 2 3 4].
    """
    flat = keys.reshape(-1)
    ones = torch.ones(1, dtype=torch.int64, device=keys.device).expand(flat.numel())
    counts = torch.zeros(V + 1, dtype=torch.int64, device=keys.device).scatter_add_(0, flat, ones)[:V]  # bincount would sync
    distinct = torch.cumsum(counts > 0, 0)
    U = distinct[-1] if V else counts.sum()
    before = torch.cat([torch.cumsum(counts, 0) - counts, counts.sum().reshape(1)])  # (V + 1,) P last
    marks = torch.arange(0, min(V, keys.numel()) + block, block, device=keys.device)
    edges = before[torch.searchsorted(distinct, marks + 1)]
    vocab_edges = torch.arange(0, V + step, step, device=keys.device).clamp_(max=V)
    vocab = torch.cat([distinct.new_zeros(1), distinct])[vocab_edges]
    return {"runs_u": U, "runs_edges": edges, "runs_vocab": vocab}


def run_sizes_after_read(got: dict, block: int) -> RunSizes:
    """:class:`RunSizes` from the values of :func:`run_sizes_before_read` as read (``got``)."""
    U = got["runs_u"]
    return RunSizes(U, block, got["runs_edges"][: -(-U // block) + 1], got["runs_vocab"])


def _runs(ids, flat, g, sizes: RunSizes) -> _Runs:
    """Sorted pairs, their runs and blocks; the sizes come from the plan's read, so no host read.

    Worked example, sorted ids [1, 2, 4, 4, 7], U = 4: first-of-run [T, T, T, F, T] -> starts
    [0, 1, 2, 4], uniq [1, 2, 4, 7].
    """
    p = _sorted_pairs(ids, flat, g)
    P, device = p.ids.numel(), p.ids.device
    first = torch.ones(P, dtype=torch.bool, device=device)
    first[1:] = p.ids[1:] != p.ids[:-1]
    starts = nonzero_static(first, sizes.num_ids)
    return _Runs(p, p.ids[starts], starts, sizes.block, sizes.edges, sizes.vocab)


def _block_ids(H: int, cd: torch.dtype) -> int:
    return max(1, _BLOCK_BYTES // (H * torch.finfo(cd).bits // 8))


def _hidden_table(hidden, pos, rows, cd):
    """(table, row of each pair in it): ``hidden`` itself in the compute dtype (pair rows mapped
    through ``pos``), else its scored rows converted, ``(n, H)``."""
    if hidden.dtype == cd and hidden.is_contiguous():
        return hidden, pos[rows]
    return hidden[pos].to(cd), rows


def _block_sums(runs: _Runs, table: torch.Tensor, rows: torch.Tensor):
    """Yield (ids (b,), sums (b, H)) per block: each distinct id's ``sum g * table[row]`` over its
    pairs, one ``embedding_bag`` per block, summed completely in the compute dtype.

    Worked example (w = 2, pairs as (row, id, g)):
        pairs  (0, 4, a) (0, 1, b) (1, 4, c) (1, 2, d)
        sorted by id:  ids [1, 2, 4, 4]  rows [0, 1, 0, 1]  g [b, d, a, c]
        runs (distinct ids) [1, 2, 4] with starts [0, 1, 2]
        sums[1] = b h0,  sums[2] = d h1,  sums[4] = a h0 + c h1
    """
    g, U = runs.pairs.g, runs.uniq.numel()
    for b in range(len(runs.edges) - 1):
        r0, r1 = b * runs.block, min((b + 1) * runs.block, U)
        p0, p1 = runs.edges[b], runs.edges[b + 1]
        sums = F.embedding_bag(rows[p0:p1], table, runs.starts[r0:r1] - p0, mode="sum", per_sample_weights=g[p0:p1])
        yield runs.uniq[r0:r1], sums


def _weight_grad(hidden, weight, pos, ids, flat, g, h_eos, ge, sizes: RunSizes, chunk_size, cd) -> torch.Tensor:
    """The one weight-sized gradient (V, H) in the weight's dtype.

    Without full-vocabulary rows and with the weight in the compute dtype, one
    ``embedding_bag`` with a bag per vocabulary row writes every row exactly once. Otherwise
    vocabulary chunk [v0, v1) starts as the EOS rows' ``ge.T @ h_eos`` (or zeros) and adds
    the sums of the ids that fall in it, then is written once (converted, for a weight not in
    the compute dtype, from a chunk-sized scratch buffer). No host read (``sizes``).
    """
    V, H = weight.shape
    direct = weight.dtype == cd
    if direct and ge.shape[0] == 0:
        # One bag per vocabulary row (empty bags give zero rows): every row written exactly once.
        p = _sorted_pairs(ids, flat, g)
        table, rows = _hidden_table(hidden, pos, p.rows, cd)
        offsets = torch.searchsorted(p.ids, torch.arange(V, device=p.ids.device))
        return F.embedding_bag(rows, table, offsets, mode="sum", per_sample_weights=p.g)
    _, vchunk = weight_grad_sizes(weight, chunk_size, cd)
    edges = _vocab_edges(V, vchunk)  # the edges sizes.vocab was read at
    runs = _runs(ids, flat, g, sizes)
    table, rows = _hidden_table(hidden, pos, runs.pairs.rows, cd)
    U = runs.uniq.numel()
    # All U sums at once: a dense gradient writes all V rows anyway, the (U, H) scratch is small next to it.
    sums = torch.cat([s for _, s in _block_sums(runs, table, rows)]) if U else table.new_zeros(0, H)
    grad_w = torch.empty(V, H, dtype=weight.dtype, device=weight.device)
    scratch = None if direct else torch.empty(min(vchunk, V), H, dtype=cd, device=weight.device)
    for c in range(len(edges) - 1):
        v0, v1, b0, b1 = edges[c], edges[c + 1], runs.vocab[c], runs.vocab[c + 1]
        dst = grad_w[v0:v1] if direct else scratch[: v1 - v0]
        if ge.shape[0]:
            torch.mm(ge[:, v0:v1].t(), h_eos, out=dst)
        else:
            dst.zero_()
        if b1 > b0:
            dst.index_add_(0, runs.uniq[b0:b1] - v0, sums[b0:b1])
        if not direct:
            grad_w[v0:v1].copy_(dst)
    return grad_w


def persistent_grad_buffer(weight: torch.Tensor):
    """The gradient buffer a backward may accumulate the weight's rows into, or None (dense gradient).

    Call only inside a backward. See the module docstring for the cases.
    """
    if not (weight.is_leaf and weight.requires_grad):
        return None  # not a parameter: nothing accumulates its gradient
    try:
        if not torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(weight).node):
            return None  # backward(inputs=...) without this weight
    except RuntimeError:
        return None  # torch.autograd.grad: the gradient is returned to the caller, not accumulated
    if getattr(weight, "_backward_hooks", None) or getattr(weight, "_post_accumulate_grad_hooks", None):
        return None  # tensor hooks (register_hook, register_post_accumulate_grad_hook) see the dense gradient
    main = getattr(weight, "main_grad", None)
    if hasattr(weight, "grad_added_to_main_grad") and isinstance(main, torch.Tensor):
        fits = main.shape == weight.shape and main.device == weight.device and main.layout == torch.strided
        return main if fits else None
    g = weight.grad
    if isinstance(g, torch.Tensor) and g.layout == torch.strided and not g.requires_grad:
        if g.shape == weight.shape and g.dtype == weight.dtype and g.device == weight.device:
            return g
    return None


def _handed_to_autograd(weight: torch.Tensor, buffer: torch.Tensor):
    """What the backward returns for the weight once its rows are in ``buffer``."""
    if buffer is not getattr(weight, "main_grad", None):
        return None  # rows are in .grad already
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return None  # a tied embedding: its own (defined) gradient reaches the hook
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)  # dropped by the hook, never read


def _accumulate_rows(buffer, hidden, pos, ids, flat, g, h_eos, ge, sizes: RunSizes, chunk_size, cd) -> None:
    """``buffer += dense weight gradient``, writing only the U touched rows (and, for
    full-vocabulary rows, every row, vocabulary chunk by vocabulary chunk).

    The touched rows go in block by block of distinct ids (:func:`_block_sums`): each block's
    sums, summed completely in the compute dtype, are added to the buffer's rows while they
    are still in cache; no (U, H) scratch. No host read (``sizes``, read by the plan).
    """
    runs = _runs(ids, flat, g, sizes)
    table, rows = _hidden_table(hidden, pos, runs.pairs.rows, cd)
    for uniq, sums in _block_sums(runs, table, rows):
        buffer.index_add_(0, uniq, sums.to(buffer.dtype))
    if ge.shape[0]:
        V = buffer.shape[0]
        step = _vocab_step(V, chunk_size)
        for v0 in range(0, V, step):
            v1 = min(v0 + step, V)
            if buffer.dtype == cd:
                buffer[v0:v1].addmm_(ge[:, v0:v1].t(), h_eos)  # in place: no temporary
            else:
                buffer[v0:v1].add_((ge[:, v0:v1].t() @ h_eos).to(buffer.dtype))


def project_support(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    pos: torch.Tensor,
    ids: torch.Tensor,
    flat: torch.Tensor,
    full_pos: torch.Tensor,
    chunks: Sequence[PairChunk],
    *,
    sizes: Optional[RunSizes],
    fill: float,
    temperature: float = 1.0,
    chunk_size: int,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the present support pairs, and full local-vocabulary scores of a few rows.

    Args:
        hidden: (N, H), float. Not modified.
        weight: (V, H), float, this rank's LM-head rows. Not modified.
        pos: (n,), int64 rows of ``hidden`` scored over a support, increasing.
        ids: (n, w), int64 local rows of ``weight`` (anything where not present).
        flat: (P,), int64 increasing indices into the ``n * w`` grid: the present pairs.
        full_pos: (e,), int64 rows of ``hidden`` scored over the whole local vocabulary.
        chunks: host-side bounds covering ``flat`` in order, each at most ``chunk_size``
            pairs (see :class:`PairChunk`).
        sizes: the weight gradient's run sizes (:func:`run_sizes_before_read`, read by the
            plan) when the weight's gradient can be asked for, else None.
        fill: the score of an absent pair.
        temperature: divides every score.
        chunk_size: also the vocabulary rows per step of the full-vocabulary rows.
        compute_dtype: float32 or float64.

    Returns:
        z: (n, w), compute_dtype; ``fill`` where not present.
        ze: (e, V), compute_dtype.
    """
    return _SupportProjection.apply(
        hidden, weight, pos, ids, flat, full_pos, tuple(chunks), sizes, float(fill), float(temperature), int(chunk_size),
        compute_dtype,
    )
