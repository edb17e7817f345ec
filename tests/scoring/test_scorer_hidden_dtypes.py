"""Hidden mode for every dtype, chunk size, row shape and TP split, against float64.

The grid: {float32, bfloat16, float16} x {chunk 1, chunk 5, the default} x {full rows,
rows cut to 1-3 members of a width of 24, a width (9) larger than the vocabulary (6)} x
{TP 1, TP 2 over uneven splits, each shape with a one-row shard}. Every case scores a
ragged batch with a synthetic EOS, values and gradients (hidden states and this rank's
LM-head rows), against the float64 dense loop on the same rounded inputs
(tests/scoring/reference.py). Low precision gets ml-cross-entropy's budget: the naive loop run
in that dtype, its error against float64, plus a tolerance.

The cut rows and the narrow shards are what broke ``torch.sparse.sampled_addmm``: a chunk
whose projection table holds fewer rows than the pairs of one row (bf16 / fp16 weights with
rows cut by top-p, a shard of one row, other shards' ids collapsing onto one local row).
The TP=2 part runs in one spawn: both ranks score the whole grid.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_replay import PackedTensor, VocabShard, score_aligned_support
from tests.scoring.reference import reference_scores
from tests.spawn import run_workers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHUNKS = {"chunk1": 1, "chunk5": 5, "default": None}
# shape -> (V, width k, members per row (lo, hi), TP=2 split with a one-row shard)
SHAPES = {
    "full": (97, 8, (8, 8), (0, 96, 97)),
    "cut": (97, 24, (1, 3), (0, 1, 97)),
    "wide": (6, 9, (1, 6), (0, 1, 6)),
}
B, T, H = 2, 13, 16
TEMPERATURE = 0.9
GRID = [(d, c, s) for d in DTYPES for c in CHUNKS for s in SHAPES]


def _case(shape: str, seed: int = 0):
    """Float64 inputs, channels and a [B, T] batch: trajectory b's last 9 columns carry rows,
    the last of trajectory 1 is a synthetic EOS (loss-active, no row)."""
    V, k, (lo, hi), _ = SHAPES[shape]
    g = torch.Generator().manual_seed(seed + 17 * list(SHAPES).index(shape))
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    sampled = torch.randint(V, (B, T), generator=g)
    rows = torch.full((B, T), -1, dtype=torch.int64)
    lmask = torch.zeros(B, T, dtype=torch.bool)
    values, sets = [], []
    for b in range(B):
        for t in range(T - 9, T):
            rows[b, t] = len(values)
            lmask[b, t] = True
            if b == 1 and t == T - 1:  # synthetic EOS
                values.append(torch.full((k,), -1, dtype=torch.int32))
                sets.append([])
                continue
            width = int(torch.randint(lo, hi + 1, (1,), generator=g))
            members = torch.randperm(V, generator=g)[:width]
            values.append(torch.cat([members, torch.full((k - width,), -1)]).to(torch.int32))
            sets.append(members.tolist())
            sampled[b, t] = members[int(torch.randint(width, (1,), generator=g))]
    support = PackedTensor(torch.stack(values), [0, 9, 18])
    coeff = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    return hidden, weight, sampled, rows, lmask, support, sets, coeff


def _score(dtype, chunk, shape, shard=None, lo=0, hi=None):
    """The scorer's log-probs and gradients (hidden, this rank's weight rows [lo:hi])."""
    hidden, weight, sampled, rows, lmask, support, _, coeff = _case(shape)
    h = hidden.to(DTYPES[dtype]).requires_grad_()
    w = weight[lo:hi].to(DTYPES[dtype]).requires_grad_()
    out = score_aligned_support(h, sampled, rows, lmask, support, lm_head_weight=w, shard=shard,
                                temperature=TEMPERATURE, chunk_size=CHUNKS[chunk])
    gh, gw = torch.autograd.grad((out.logprobs.double() * coeff).sum(), (h, w))
    return out.logprobs.detach(), gh, gw


def _expected(dtype, shape):
    """(float64 truth, naive same-dtype loop): log-probs and gradients (hidden, full weight)."""
    hidden, weight, sampled, rows, lmask, _, sets, coeff = _case(shape)
    lowp = DTYPES[dtype]
    out = {}
    for name, cast in (("truth", torch.float64), ("naive", lowp)):
        h = hidden.to(lowp).to(cast).requires_grad_()
        w = weight.to(lowp).to(cast).requires_grad_()
        lp = reference_scores(h @ w.T, sampled, rows, lmask, sets, temperature=TEMPERATURE)["logprobs"]
        gh, gw = torch.autograd.grad((lp * coeff.to(cast)).sum(), (h, w))
        out[name] = (lp.detach().double(), gh.double(), gw.double())
    return out


def _check(got, exp, dtype, where, lo=0, hi=None):
    lp, gh, gw = got
    truth, naive = exp["truth"], exp["naive"]
    assert not torch.isnan(lp).any() and gh.dtype == DTYPES[dtype] and gw.dtype == DTYPES[dtype], where
    if dtype == "float32":
        torch.testing.assert_close(lp.double(), truth[0], atol=2e-5, rtol=0, msg=where)
        torch.testing.assert_close(gh.double(), truth[1], atol=2e-5, rtol=1e-5, msg=where)
        torch.testing.assert_close(gw.double(), truth[2][lo:hi], atol=2e-5, rtol=1e-5, msg=where)
        return
    err = (lp.double() - truth[0]).abs()
    naive_err = (naive[0] - truth[0]).abs()
    assert torch.all(err <= naive_err + 1e-4), (where, float((err - naive_err).max()))
    for k, (mine, nv, ref) in enumerate(((gh, naive[1], truth[1]), (gw, naive[2][lo:hi], truth[2][lo:hi]))):
        g_err = float((mine.double() - ref).abs().max())
        n_err = float((nv - ref).abs().max())
        assert g_err <= n_err + 1e-3, (where, "grad hidden" if k == 0 else "grad weight", g_err, n_err)


@pytest.mark.parametrize("dtype, chunk, shape", GRID)
def test_hidden_mode_tp1(dtype, chunk, shape):
    _check(_score(dtype, chunk, shape), _expected(dtype, shape), dtype, f"{dtype} {chunk} {shape} tp1")


def _tp_worker(rank, world_size):
    group = dist.new_group(ranks=list(range(world_size)))
    results = {}
    for dtype, chunk, shape in GRID:
        split = SHAPES[shape][3]
        lo, hi = split[rank], split[rank + 1]
        shard = VocabShard.from_group(group, hi - lo)
        results[(dtype, chunk, shape)] = _score(dtype, chunk, shape, shard, lo, hi)
    return results


def test_hidden_mode_tp2_uneven_splits_with_a_one_row_shard():
    ranks = run_workers(_tp_worker, 2)
    expected = {(d, s): _expected(d, s) for d in DTYPES for s in SHAPES}
    for dtype, chunk, shape in GRID:
        split = SHAPES[shape][3]
        assert 1 in (split[1] - split[0], split[2] - split[1])
        for rank, res in enumerate(ranks):
            lo, hi = split[rank], split[rank + 1]
            _check(res[(dtype, chunk, shape)], expected[(dtype, shape)], dtype,
                   f"{dtype} {chunk} {shape} tp2 rank {rank} rows [{lo}, {hi})", lo, hi)


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 8, 40])
def test_chunks_hold_at_most_chunk_size_pairs(monkeypatch, chunk_size):
    """Hidden mode's bound "chunks of at most chunk_size pairs" also holds below the row width (8).

    Every pair product the forward computes is observed through a wrapper that calls the
    real kernel; the chunks must cover the present pairs exactly once.
    """
    import nemo_replay.scoring.projection as projection

    real = projection._pair_dots
    sizes = []

    def observed(*args):
        out = real(*args)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(projection, "_pair_dots", observed)
    hidden, weight, sampled, rows, lmask, support, sets, _ = _case("full")
    out = score_aligned_support(hidden, sampled, rows, lmask, support, lm_head_weight=weight, chunk_size=chunk_size)
    present = sum(len(sets[int(r)]) for r in rows[lmask & (rows >= 0)].tolist())
    assert sizes and max(sizes) <= chunk_size and sum(sizes) == present, (sizes, present)
    ref = score_aligned_support(hidden, sampled, rows, lmask, support, lm_head_weight=weight, chunk_size=10**6)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-12, rtol=0)
