"""Hidden mode's LM-head weight gradient, summed block by block of distinct ids
(nemo_replay/scoring/projection.py: ``run_sizes_before_read``, ``_runs``, ``_block_sums``).

The backward sorts the present pairs by id, cuts them into runs of one id and the runs
into blocks of a few ids whose row sums stay in cache, and adds each block to the
trainer's buffer (a kept ``.grad``, megatron's ``main_grad``) or writes it into the dense
gradient. Checked against the float64 dense loop (tests/scoring/reference.py) on ragged
batches with distinct ids and synthetic-EOS rows, for blocks of 1, 2 and 3 ids and the
default size, forward and backward; the run sizes' worked example and their agreement with
sorting; and the host reads: the sizes go with the plan's one read, the backward makes none.
"""

from __future__ import annotations

import pytest
import torch

import nemo_replay.scoring.projection as projection
from benchmarks.syncs import HostReads, ProfiledReads
from nemo_replay import score_aligned_support
from tests.scoring.batches import make_case
from tests.scoring.reference import reference_scores

TEMPERATURE = 0.8


def _coefficients(shape):
    g = torch.Generator().manual_seed(11)
    return torch.rand(shape, generator=g, dtype=torch.float64) + 0.5, torch.rand(shape, generator=g, dtype=torch.float64) - 0.5


def _loss(lp, ent, shape):
    c1, c2 = _coefficients(shape)
    return (lp.double() * c1).sum() + (ent.double() * c2).sum()


def _reference_grads(case, hidden, weight):
    """d loss / d (hidden, weight) of the dense float64 loop, on the same (rounded) inputs."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    ref = reference_scores(h @ w.T, case.sampled_ids, case.row_ids, case.loss_mask, case.sets, temperature=TEMPERATURE)
    return torch.autograd.grad(_loss(ref["logprobs"], ref["entropy"], case.loss_mask.shape), (h, w))


def _force_block(monkeypatch, ids_per_block, H, cd):
    """Make ``_block_ids(H, cd)`` return ``ids_per_block`` (None: the default size)."""
    if ids_per_block is not None:
        monkeypatch.setattr(projection, "_BLOCK_BYTES", ids_per_block * H * torch.finfo(cd).bits // 8)
        assert projection._block_ids(H, cd) == ids_per_block


class _Blocks:
    """Counts the blocks the backward summed (wraps the real generator)."""

    def __init__(self, monkeypatch):
        self.sizes = []
        real = projection._block_sums

        def observed(runs, table, rows):
            for ids, sums in real(runs, table, rows):
                self.sizes.append(ids.numel())
                yield ids, sums

        monkeypatch.setattr(projection, "_block_sums", observed)


def _sizes(keys, V, block, step):
    """run_sizes_before_read, the plan's read of its values, run_sizes_after_read."""
    with HostReads() as reads:
        values = projection.run_sizes_before_read(keys, V, block, step)
    assert reads.total == 0, dict(reads.where)  # the plan reads them with its guards
    return projection.run_sizes_after_read({name: t.tolist() for name, t in values.items()}, block)


def test_run_sizes_worked_example():
    """The example of ``run_sizes_before_read``'s docstring (an unscored row between the pairs),
    and the runs the backward builds from those sizes with no host read."""
    V = 8
    keys = torch.tensor([[4, 1, 7], [V, V, V], [2, 4, V]])  # pairs: ids 4, 1, 7, then 2, 4
    sizes = _sizes(keys, V, 2, 3)
    assert sizes.num_ids == 4
    assert sizes.edges == [0, 2, 5]  # blocks: ids {1, 2} = pairs [0, 2), ids {4, 7} = pairs [2, 5)
    assert sizes.vocab == [0, 2, 3, 4]  # first run with id >= 0, 3, 6, 8
    ids = torch.tensor([[4, 1, 7], [2, 4, -1]])  # the scored rows; pairs flat 0..4 in the (2, 3) grid
    g = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5], dtype=torch.float64)
    with HostReads() as reads:
        runs = projection._runs(ids, torch.arange(5), g, sizes)
    assert reads.total == 0, dict(reads.where)
    assert runs.pairs.ids.tolist() == [1, 2, 4, 4, 7]
    assert runs.pairs.rows.tolist() == [0, 1, 0, 1, 0]  # stable: the two 4s keep their order
    assert runs.pairs.g.tolist() == [0.2, 0.4, 0.1, 0.5, 0.3]
    assert runs.uniq.tolist() == [1, 2, 4, 7] and runs.starts.tolist() == [0, 1, 2, 4]


def test_run_sizes_of_no_pairs():
    sizes = _sizes(torch.full((2, 3), 9), 9, 4, 9)
    assert sizes.num_ids == 0 and sizes.edges == [0] and sizes.vocab == [0, 0]


def test_run_sizes_of_pairs_filling_every_entry_and_blocks_of_one_id():
    """No entry past the pairs, the vocabulary's end at U, a block per id."""
    sizes = _sizes(torch.tensor([[3, 0], [3, 5]]), 6, 1, 4)
    assert sizes.num_ids == 3 and sizes.edges == [0, 1, 3, 4] and sizes.vocab == [0, 2, 3]


@pytest.mark.parametrize("seed", range(4))
def test_run_sizes_agree_with_the_sorted_runs(seed):
    """Counted sizes against sorting: random ragged pairs, several blocks and vocabulary edges."""
    gen = torch.Generator().manual_seed(seed)
    V, N, w = 50, 9, 7
    ids = torch.randint(0, V, (N, w), generator=gen)
    present = torch.rand(N, w, generator=gen) < 0.6
    keys = torch.where(present, ids, V)
    for block, step in ((1, 7), (3, 16), (16, 50)):
        edges = list(range(0, V, step)) + [V]
        sizes = _sizes(keys, V, block, step)
        pair_ids = torch.sort(ids[present]).values
        uniq = torch.unique(pair_ids)
        assert sizes.num_ids == uniq.numel()
        starts = [int(torch.searchsorted(pair_ids, u)) for u in uniq[::block]] + [pair_ids.numel()]
        assert sizes.edges == starts
        assert sizes.vocab == [int((uniq < e).sum()) for e in edges]


@pytest.mark.parametrize("ids_per_block", [1, 2, 3, None])
@pytest.mark.parametrize("buffer", ["grad", "main_grad"])
def test_rows_added_to_a_persistent_buffer_match_the_dense_loop(monkeypatch, ids_per_block, buffer):
    """float64: the buffer ends as what it held plus the float64 dense loop's weight gradient."""
    case = make_case(eos=(0, 2), seed=21)
    _force_block(monkeypatch, ids_per_block, case.hidden.shape[-1], torch.float64)
    blocks = _Blocks(monkeypatch)
    h = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    before = torch.randn(w.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    if buffer == "grad":
        w.grad = before.clone()
    else:
        w.main_grad, w.grad_added_to_main_grad = before.clone(), False
    out = score_aligned_support(h, *case.channels(), lm_head_weight=w, temperature=TEMPERATURE, compute_entropy=True)
    _loss(out.logprobs, out.entropy, case.loss_mask.shape).backward()
    gh_ref, gw_ref = _reference_grads(case, case.hidden, case.weight)
    got = w.grad if buffer == "grad" else w.main_grad
    torch.testing.assert_close(got, before + gw_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(h.grad, gh_ref, atol=1e-10, rtol=0)
    if buffer == "main_grad":
        assert w.grad_added_to_main_grad
    present = {i for row in case.support.values.tolist() for i in row if i >= 0}
    assert sum(blocks.sizes) <= len(present) and blocks.sizes  # each distinct id in one block, once
    if ids_per_block is not None:
        assert max(blocks.sizes) <= ids_per_block and len(blocks.sizes) >= sum(blocks.sizes) / ids_per_block


@pytest.mark.parametrize("ids_per_block", [1, 3, None])
@pytest.mark.parametrize("weight_dtype", [torch.float64, torch.bfloat16])
def test_dense_gradient_from_blocks_matches_the_dense_loop(monkeypatch, ids_per_block, weight_dtype):
    """No buffer (torch.autograd.grad): the dense gradient, built vocabulary chunk by chunk from the
    blocks' sums (synthetic-EOS rows touch every row; a bf16 weight is converted chunk by chunk)."""
    case = make_case(eos=(0, 1), seed=22)
    cd = torch.float32 if weight_dtype == torch.bfloat16 else torch.float64
    _force_block(monkeypatch, ids_per_block, case.hidden.shape[-1], cd)
    blocks = _Blocks(monkeypatch)
    h = case.hidden.to(weight_dtype).requires_grad_()
    w = case.weight.to(weight_dtype).requires_grad_()
    out = score_aligned_support(h, *case.channels(), lm_head_weight=w, temperature=TEMPERATURE, compute_entropy=True,
                                chunk_size=50)  # several vocabulary chunks
    gh, gw = torch.autograd.grad(_loss(out.logprobs, out.entropy, case.loss_mask.shape), (h, w))
    gh_ref, gw_ref = _reference_grads(case, h, w)
    assert gw.dtype == weight_dtype and gh.dtype == weight_dtype
    if weight_dtype == torch.float64:
        torch.testing.assert_close(gw, gw_ref, atol=1e-10, rtol=0)
        torch.testing.assert_close(gh, gh_ref, atol=1e-10, rtol=0)
    else:  # float32 math on bf16 inputs, each gradient entry rounded once to bf16 (relative 2**-8)
        torch.testing.assert_close(gw.double(), gw_ref, atol=2e-3, rtol=2**-7)
        torch.testing.assert_close(gh.double(), gh_ref, atol=2e-3, rtol=2**-7)
    assert blocks.sizes


def test_bf16_buffer_gets_each_row_sum_rounded_once(monkeypatch):
    """A bf16 ``.grad``: each touched row's sum is complete in float32 before it is added, so
    blocks of 1 id and the default blocks give the same buffer bit for bit."""
    case = make_case(eos=(), seed=23)
    results = []
    for ids_per_block in (1, None):
        with monkeypatch.context() as m:
            _force_block(m, ids_per_block, case.hidden.shape[-1], torch.float32)
            h = case.hidden.to(torch.bfloat16).requires_grad_()
            w = case.weight.to(torch.bfloat16).requires_grad_()
            w.grad = torch.zeros_like(w)
            out = score_aligned_support(h, *case.channels(), lm_head_weight=w, temperature=TEMPERATURE,
                                        compute_entropy=True)
            _loss(out.logprobs, out.entropy, case.loss_mask.shape).backward()
            results.append(w.grad.clone())
    assert torch.equal(results[0], results[1])
    _, gw_ref = _reference_grads(case, case.hidden.to(torch.bfloat16), case.weight.to(torch.bfloat16))
    torch.testing.assert_close(results[0].double(), gw_ref, atol=2e-3, rtol=2**-7)


@pytest.mark.parametrize("buffer", [True, False])
def test_forward_makes_one_host_read_and_the_backward_none(buffer):
    """Rows into a buffer, or a dense gradient with synthetic-EOS rows: the runs' sizes are read
    with the plan's guards, so the backward never waits for the device."""
    case = make_case(eos=(1,), seed=24)
    h = case.hidden.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    if buffer:
        w.grad = torch.zeros_like(w)
    with ProfiledReads() as reads:
        out = score_aligned_support(h, *case.channels(), lm_head_weight=w, temperature=TEMPERATURE)
    assert reads.total == 1, dict(reads.where)
    loss = out.logprobs.sum()
    with ProfiledReads() as reads:
        if buffer:
            loss.backward()
        else:
            torch.autograd.grad(loss, (h, w))
    assert reads.total == 0, dict(reads.where)
