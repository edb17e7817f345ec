"""Rows are checked once, where they enter (docs/design.md §2): the record and its uses.

A support that passed ``rollout.boundary.validate_support`` (capture, engine adapters, wire
decode, traces, collation all call it) or the scorer's own check records it, with the
vocabulary size; batch operations carry the record, an in-place edit voids it, and the
scorer skips the sort of every row for recorded supports while still checking the rest.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nemo_replay import PackedTensor, RaggedSupport, capture, score_aligned_support
from nemo_replay.rollout.boundary import validate_support
from nemo_replay.rollout.collate import collate_support
from nemo_replay.support.checked import Checked, checked
from tests.scoring.batches import make_case

ROWS = torch.tensor([[3, 1, -1], [7, 0, 2], [-1, -1, -1], [4, -1, -1], [8, 6, 5]], dtype=torch.int32)
CU = [0, 2, 5]


class _Sorts(TorchFunctionMode):
    """Counts sorts of fixed-width rows (2-D: the cost of a full check) made inside the block."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("sort", "argsort") and args[0].dim() == 2:
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_validation_records_and_batch_operations_carry_it():
    sup = PackedTensor(ROWS.clone(), CU)
    assert checked(sup) is None and sup.checked is None
    validate_support(sup, vocab_size=10, where="test")
    assert sup.checked == Checked(10)
    derived = {
        "slice": sup[1:], "index list": sup[[1, 0, 1]], "gather": sup.gather([1]), "repeat": sup.repeat(2),
        "repeat_interleave": sup.repeat_interleave(3), "to int64": sup.to(torch.int64), "to device": sup.to("cpu"),
        "re-wrapped": PackedTensor(sup.values, [0, 5]), "ragged": RaggedSupport.from_padded(sup),
    }
    for name, d in derived.items():
        assert d.checked == Checked(10), name
    other = PackedTensor(ROWS.clone(), CU)
    validate_support(other, vocab_size=12, where="test")
    assert PackedTensor.cat([sup, other]).checked == Checked(12)  # the looser bound
    assert PackedTensor.cat([sup, PackedTensor(ROWS.clone(), CU)]).checked is None  # one part unchecked
    assert sup.to(torch.int16).checked is None  # a narrower dtype could change ids
    validate_support(other, where="test")  # checked without a vocabulary: invariants only
    assert other.checked == Checked(None)


def test_an_in_place_edit_voids_the_record():
    sup = PackedTensor(ROWS.clone(), CU)
    validate_support(sup, vocab_size=10, where="test")
    view = sup.values[1:]
    view[0, 2] = 7  # through another view: a duplicate 7 in row 1
    assert sup.checked is None
    case = make_case(B=1, T=8, V=10, k=3, eos=(), seed=0)
    with pytest.raises(ValueError, match=r"holds a duplicate id"):
        score_aligned_support(case.logits[0, :5], torch.tensor([1, 7, 0, 4, 8]), torch.arange(5), torch.ones(5, dtype=torch.bool), sup)


def test_ragged_records_and_carries():
    sup = RaggedSupport.from_rows([[[4, 9], []], [[2, 3, 7]]])
    validate_support(sup, sampled_ids=torch.tensor([9, 0, 3]), vocab_size=10, where="test")
    for d in (sup[[1, 0]], sup.repeat(2), sup.to("cpu"), RaggedSupport.cat([sup, sup]),
              RaggedSupport(sup.member_ids, sup.row_offsets, torch.tensor([0, 3]))):
        assert d.checked == Checked(10)
    assert sup.width_bound == 3 and sup[[0]].width_bound == 3  # a bound inherited from the source
    sup.row_offsets[1] = 1  # rows change: the record and the cached width no longer apply
    assert sup.checked is None


def test_capture_and_collation_outputs_are_recorded():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    fixed = capture.sample(logits, temperature=1.0, top_k=8, top_p=0.9, generator=g)
    ragged = capture.sample(logits, temperature=1.0, top_k=None, top_p=0.5, generator=g)
    assert fixed.support.checked == Checked(50) and ragged.support.checked == Checked(50)
    rows = fixed.support.to_padded().values  # fixed-width rows, as an engine adapter hands them over
    batch = collate_support([rows[:3], rows[3:]], response_lengths=[3, 3, 3],
                            sampled_ids=[fixed.ids[:3], fixed.ids[3:]], index=[1, 0, 1], vocab_size=50)
    assert batch.checked == Checked(50)


def _score(case, support, **kw):
    return score_aligned_support(case.logits, case.sampled_ids, case.row_ids, case.loss_mask, support, **kw)


def test_the_scorer_skips_the_sort_for_recorded_rows_and_records_its_own_check():
    case = make_case(B=3, T=19, V=61, k=5, eos=(1,), seed=21)
    fresh = PackedTensor(case.support.values.clone(), case.support.cu_seqlens)
    with _Sorts() as first:
        ref = _score(case, fresh)
    with _Sorts() as second:
        again = _score(case, fresh)  # the first call recorded its check
    assert first.n >= 1 and second.n == 0, (first.n, second.n)
    assert fresh.checked == Checked(61)
    torch.testing.assert_close(again.logprobs, ref.logprobs, atol=0, rtol=0)
    entered = PackedTensor(case.support.values.clone(), case.support.cu_seqlens)
    validate_support(entered, vocab_size=61, where="collation")
    with _Sorts() as recorded:
        _score(case, entered)
    assert recorded.n == 0


def test_a_record_for_another_vocabulary_still_gets_the_bound():
    """Rows checked against a larger vocabulary (or none) skip the sort but not the id bound."""
    case = make_case(B=3, T=19, V=61, k=5, eos=(1,), seed=21)
    vals = case.support.values.clone()
    unused = next(r for r, members in enumerate(case.sets) if not members and r not in case.row_ids[case.loss_mask])
    vals[unused, 0] = 80
    for vocab in (100, None):
        sup = PackedTensor(vals.clone(), case.support.cu_seqlens)
        validate_support(sup, vocab_size=vocab, where="test")
        with _Sorts() as sorts, pytest.raises(ValueError, match=r"holds an id >= vocab_size=61"):
            _score(case, sup)
        assert sorts.n <= 1  # only the error path's own check sorts
    sup = PackedTensor(vals.clone(), case.support.cu_seqlens)
    validate_support(sup, vocab_size=100, where="test")
    torch.testing.assert_close(_score(case, sup, validate=False).logprobs, _score(case, case.support).logprobs)


def test_edits_the_version_counter_never_sees_are_caught_by_the_fingerprint():
    """Through ``.data``, a ``.numpy()`` alias and ``torch.from_numpy``: the record's version still
    matches, so only the fingerprint read with the guards notices; broken rows are refused, rows
    still valid are checked again (one sort), recorded anew and scored as they now are."""
    import numpy as np

    case = make_case(B=3, T=19, V=61, k=5, eos=(1,), seed=21)
    used = int(case.row_ids[case.loss_mask][0])
    members = case.support.values[used]
    for edit in ("data", "numpy", "from_numpy"):
        sup = PackedTensor(case.support.values.clone(), case.support.cu_seqlens)
        validate_support(sup, vocab_size=61, where="test")
        rows = {"data": sup.values.data, "numpy": torch.from_numpy(sup.values.numpy()),
                "from_numpy": torch.from_numpy(np.asarray(sup.values))}[edit]
        version = sup.values._version
        rows[used, 1] = rows[used, 0]  # a duplicate: [a, a, ...] would score -log 2 for a
        assert sup.values._version == version and sup.checked == Checked(61)  # the version counter saw nothing
        with pytest.raises(ValueError, match=r"holds a duplicate id"):
            _score(case, sup)
    sup = PackedTensor(case.support.values.clone(), case.support.cu_seqlens)
    validate_support(sup, vocab_size=61, where="test")
    active = torch.nonzero(case.loss_mask.reshape(-1)).flatten()
    for p in active.tolist():  # a scored row with a member besides its sampled token
        used, token = int(case.row_ids.reshape(-1)[p]), int(case.sampled_ids.reshape(-1)[p])
        cols = [c for c, t in enumerate(case.support.values[used].tolist()) if t >= 0 and t != token]
        if cols:
            col = cols[0]
            break
    spare = next(v for v in range(61) if v not in case.support.values[used].tolist())
    sup.values.data[used, col] = spare  # still a valid row, another support
    with _Sorts() as sorts:
        got = _score(case, sup)
    assert sorts.n >= 1 and sup.checked == Checked(61)
    fresh = PackedTensor(sup.values.clone(), case.support.cu_seqlens)
    torch.testing.assert_close(got.logprobs, _score(case, fresh).logprobs, atol=0, rtol=0)
    with _Sorts() as again:
        _score(case, sup)
    assert again.n == 0  # recorded anew


@pytest.mark.parametrize("hidden", [False, True])
def test_no_path_reads_outside_the_vocabulary(hidden):
    """An id >= V in a scored row, with validate=False or behind a stale record, is a ValueError naming
    the trajectory, the position and the id: it used to clamp to V - 1 (logits) or read out of bounds
    (hidden mode's sampled product, SIGSEGV at 5e7)."""
    case = make_case(B=2, T=11, V=61, k=5, eos=(), seed=3)
    p = int(torch.nonzero(case.loss_mask.reshape(-1))[0])
    row = int(case.row_ids.reshape(-1)[p])
    g = torch.Generator().manual_seed(0)
    H = 16
    src = torch.randn(*case.logits.shape[:-1], H, generator=g) if hidden else case.logits
    kw = {"lm_head_weight": torch.randn(61, H, generator=g)} if hidden else {}
    for bad in (61, 50_000_000):
        vals = case.support.values.clone()
        vals[row, (vals[row] >= 0).sum() - 1] = bad  # a member that is not the sampled token
        if int(case.sampled_ids.reshape(-1)[p]) not in vals[row].tolist():
            vals[row, 0] = int(case.sampled_ids.reshape(-1)[p])
        for validate in (False, True):
            sup = PackedTensor(vals.clone(), case.support.cu_seqlens)
            match = rf"holds id {bad}, outside \[-1, 61\)" if not validate else r"holds an id >= vocab_size=61"
            with pytest.raises(ValueError, match=match):
                score_aligned_support(src, case.sampled_ids, case.row_ids, case.loss_mask, sup, validate=validate, **kw)
        # A row no scored position reads is never indexed: the same row behind a masked position passes
        # unchecked (validate=False), and the scored positions' results are those of the clean rows.
        mask = case.loss_mask.clone().reshape(-1)
        mask[case.row_ids.reshape(-1) == row] = False
        mask = mask.view_as(case.loss_mask)
        args = (src, case.sampled_ids, case.row_ids, mask)
        got = score_aligned_support(*args, PackedTensor(vals.clone(), case.support.cu_seqlens), validate=False, **kw)
        want = score_aligned_support(*args, PackedTensor(case.support.values.clone(), case.support.cu_seqlens), **kw)
        assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.valid_mask, want.valid_mask)
