"""PackedTensor: ragged per-trajectory rows in one buffer (construction, batch ops, errors)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_replay import PackedTensor
from nemo_replay.support.packed import check_cu_seqlens, lengths_to_cu_seqlens, segment_row_index


def _example() -> PackedTensor:
    # The module docstring's example: 2, 0 and 3 rows of width 2.
    return PackedTensor(torch.tensor([[5, 7], [9, -1], [1, 2], [3, -1], [4, 8]], dtype=torch.int32), [0, 2, 2, 5])


def _segs(pt: PackedTensor) -> list:
    return [s.tolist() for s in pt.segments()]


def test_docstring_example():
    pt = _example()
    assert pt.batch_size == len(pt) == 3 and pt.num_rows == 5
    assert pt.cu_seqlens.dtype == torch.int32 and pt.lengths.tolist() == [2, 0, 3]
    assert pt[2].tolist() == [[1, 2], [3, -1], [4, 8]]
    assert pt[-3].tolist() == [[5, 7], [9, -1]]
    assert pt[1].shape == (0, 2)
    g = pt[[2, 0]]
    assert g.values.tolist() == [[1, 2], [3, -1], [4, 8], [5, 7], [9, -1]] and g.cu_seqlens.tolist() == [0, 3, 5]
    assert _segs(pt.repeat_interleave(2)) == [_segs(pt)[i] for i in (0, 0, 1, 1, 2, 2)]
    assert _segs(pt.repeat(2)) == [_segs(pt)[i] for i in (0, 1, 2, 0, 1, 2)]
    assert pt.segment_ids().tolist() == [0, 0, 2, 2, 2]
    assert "batch_size=3" in repr(pt) and "rows=5" in repr(pt)


def test_from_segments_and_row_shapes():
    segs = [torch.arange(6).view(3, 2), torch.empty(0, 2, dtype=torch.int64), torch.arange(2).view(1, 2)]
    pt = PackedTensor.from_segments(segs)
    assert pt.dtype == torch.int64 and pt.lengths.tolist() == [3, 0, 1]
    assert _segs(pt) == [s.tolist() for s in segs]
    routes = PackedTensor.from_segments([torch.zeros(4, 3, 2), torch.ones(1, 3, 2)], dtype=torch.int16)
    assert routes.values.shape == (5, 3, 2) and routes.dtype == torch.int16
    empty = PackedTensor.from_segments([], row_shape=(7,), dtype=torch.int32)
    assert empty.batch_size == 0 and empty.values.shape == (0, 7) and empty.cu_seqlens.tolist() == [0]
    all_empty = PackedTensor.from_segments([torch.empty(0, 4)] * 2, row_shape=(4,))
    assert all_empty.lengths.tolist() == [0, 0]


def test_slicing_masks_and_gather_with_repeats():
    pt = _example()
    assert _segs(pt[1:]) == _segs(pt)[1:]
    assert _segs(pt[::-1]) == _segs(pt)[::-1]
    assert _segs(pt[torch.tensor([True, False, True])]) == [_segs(pt)[0], _segs(pt)[2]]
    assert _segs(pt.gather([2, 2, 0, -1])) == [_segs(pt)[i] for i in (2, 2, 0, 2)]
    assert _segs(pt.gather(torch.tensor([], dtype=torch.int64))) == []
    assert pt.gather([]).values.shape == (0, 2)


def test_cat_to_and_equality():
    a, b = _example(), _example()[[0, 2]]
    c = PackedTensor.cat([a, b])
    assert _segs(c) == _segs(a) + _segs(b) and c.cu_seqlens.tolist() == [0, 2, 2, 5, 7, 10]
    assert PackedTensor.cat([a]) == a
    f = a.to(torch.float64)
    assert f.dtype == torch.float64 and f.cu_seqlens.dtype == torch.int32 and f.values.tolist() == a.values.tolist()
    assert a == _example() and not (a != _example())
    assert a != f  # dtype differs
    assert a != PackedTensor(a.values, [0, 1, 2, 5])  # same buffer, other segmentation
    other = a.values.clone()
    other[4, 1] = 0
    assert a != PackedTensor(other, a.cu_seqlens)
    assert (a == a.values) is False  # not a PackedTensor
    with pytest.raises(TypeError):
        hash(a)


def test_batch_ops_do_not_share_or_mutate():
    pt = _example()
    before = pt.values.clone()
    out = pt.gather([0, 2])
    out.values.zero_()
    rep = pt.repeat(2)
    rep.values.fill_(3)
    assert torch.equal(pt.values, before)


def test_lengths_and_segment_row_index():
    assert lengths_to_cu_seqlens([3, 0, 2]).tolist() == [0, 3, 3, 5]
    assert lengths_to_cu_seqlens(torch.tensor([], dtype=torch.int64)).tolist() == [0]
    rows, lengths = segment_row_index(torch.tensor([0, 2, 2, 5], dtype=torch.int32), torch.tensor([2, 0]))
    assert rows.tolist() == [2, 3, 4, 0, 1] and lengths.tolist() == [3, 2]


# ------------------------------------------------------------------ malformed input


@pytest.mark.parametrize(
    "values, cu, match",
    [
        ([[1, 2]], [0, 1], r"values must be a torch.Tensor, got list"),
        (torch.tensor(3), [0, 1], r"leading row dimension, got a scalar"),
        (torch.zeros(3, 2), [1, 3], r"cu_seqlens must start at 0, got 1"),
        (torch.zeros(3, 2), [0, 2, 1, 3], r"non-decreasing: segment 1 has offsets 2 -> 1"),
        (torch.zeros(3, 2), [0, 2], r"ends at 2 but the buffer holds 3 rows"),
        (torch.zeros(3, 2), [0, 4], r"ends at 4 but the buffer holds 3 rows"),
        (torch.zeros(3, 2), [[0, 3]], r"must be 1-D with batch_size \+ 1 entries, got shape \(1, 2\)"),
        (torch.zeros(3, 2), torch.tensor([], dtype=torch.int32), r"must be 1-D with batch_size \+ 1 entries, got shape \(0,\)"),
        (torch.zeros(3, 2), [0.0, 3.0], r"must be an integer tensor, got torch.float32"),
        (torch.zeros(3, 2), torch.tensor([False, True]), r"must be an integer tensor, got torch.bool"),
    ],
)
def test_malformed_construction(values, cu, match):
    with pytest.raises(ValueError, match=match):
        PackedTensor(values, cu)


def test_malformed_from_segments():
    with pytest.raises(ValueError, match=r"segments disagree on row shape: \[\(2,\), \(3,\)\]"):
        PackedTensor.from_segments([torch.zeros(1, 2), torch.zeros(2, 3)])
    with pytest.raises(ValueError, match=r"cannot infer row_shape from an empty list of segments: pass row_shape="):
        PackedTensor.from_segments([])
    with pytest.raises(ValueError, match=r"every segment needs a leading row dimension"):
        PackedTensor.from_segments([torch.zeros(1, 2), torch.tensor(1)])
    with pytest.raises(ValueError, match=r"segments have row shape \(2,\), expected \(3,\)"):
        PackedTensor.from_segments([torch.zeros(1, 2)], row_shape=(3,))


def test_malformed_indexing_and_ops():
    pt = _example()
    with pytest.raises(ValueError, match=r"boolean segment mask must have shape \(3,\), got \(2,\)"):
        pt[torch.tensor([True, False])]
    with pytest.raises(ValueError, match=r"segment index must be an int, slice, 1-D int list/tensor or bool mask"):
        pt.gather(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"segment index must be"):
        pt.gather(torch.tensor([[0, 1]]))
    with pytest.raises(IndexError, match=r"segment index \[0, 3\] out of range for a batch of 3"):
        pt.gather([0, 3])
    with pytest.raises(IndexError, match=r"segment 3 out of range for a batch of 3"):
        pt[3]
    for n in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match=r"repeat count must be a positive int"):
            pt.repeat(n)
        with pytest.raises(ValueError, match=r"repeat count must be a positive int"):
            pt.repeat_interleave(n)
    with pytest.raises(ValueError, match=r"needs at least one batch"):
        PackedTensor.cat([])
    with pytest.raises(ValueError, match=r"different row shapes"):
        PackedTensor.cat([pt, PackedTensor(torch.zeros(1, 3, dtype=torch.int32), [0, 1])])
    with pytest.raises(ValueError, match=r"different dtypes"):
        PackedTensor.cat([pt, pt.to(torch.int64)])
    with pytest.raises(ValueError, match=r"lengths must be >= 0"):
        lengths_to_cu_seqlens([2, -1])
    with pytest.raises(ValueError, match=r"lengths must be 1-D"):
        lengths_to_cu_seqlens([[1, 2]])


# ------------------------------------------------------------------ properties

segment_lists = st.lists(st.lists(st.tuples(st.integers(-1, 50), st.integers(-1, 50)), max_size=5), max_size=6)


def _pack(segs):
    return PackedTensor.from_segments(
        [torch.tensor(s, dtype=torch.int32).view(-1, 2) for s in segs], row_shape=(2,), dtype=torch.int32
    )


@settings(max_examples=60, deadline=None)
@given(segs=segment_lists, data=st.data())
def test_batch_ops_address_whole_segments(segs, data):
    pt = _pack(segs)
    as_lists = [[list(r) for r in s] for s in segs]
    assert _segs(pt) == as_lists
    if segs:
        idx = data.draw(st.lists(st.integers(0, len(segs) - 1), max_size=8))
        assert _segs(pt.gather(idx)) == [as_lists[i] for i in idx]
    n = data.draw(st.integers(1, 3))
    assert _segs(pt.repeat(n)) == as_lists * n
    assert _segs(pt.repeat_interleave(n)) == [s for s in as_lists for _ in range(n)]
    other = _pack(data.draw(segment_lists))
    assert _segs(PackedTensor.cat([pt, other])) == as_lists + _segs(other)
    assert PackedTensor.cat([pt, other]).num_rows == pt.num_rows + other.num_rows


def test_check_cu_seqlens():
    check_cu_seqlens(torch.tensor([0, 0, 3, 3]), 3)
    check_cu_seqlens(torch.tensor([0]), 0)
    with pytest.raises(ValueError, match=r"offsets must be a torch.Tensor, got list"):
        check_cu_seqlens([0, 3], 3, name="offsets")
    with pytest.raises(ValueError, match=r"cu_seqlens ends at 3 but the buffer holds 4 rows"):
        check_cu_seqlens(torch.tensor([0, 3]), 4)


def test_uint8_offsets_are_compared_widened():
    """uint8 offsets [0, 5, 3]: 3 - 5 wraps to 254 in uint8; the decrease must still be caught."""
    with pytest.raises(ValueError, match=r"must be non-decreasing: segment 1 has offsets 5 -> 3"):
        check_cu_seqlens(torch.tensor([0, 5, 3], dtype=torch.uint8), 3)
    check_cu_seqlens(torch.tensor([0, 2, 3], dtype=torch.uint8), 3)
