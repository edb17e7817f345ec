"""RaggedSupport: CSR support sets (construction, padding round trips, batch ops, errors)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_replay import PackedTensor, RaggedSupport


def _example() -> RaggedSupport:
    # The module docstring's example: trajectory 0 rows {4, 9}, {}; trajectory 1 row {2, 3, 7}.
    return RaggedSupport.from_rows([[[4, 9], []], [[2, 3, 7]]])


def _rows(rs: RaggedSupport) -> list:
    """Nested lists: trajectory -> rows -> members."""
    cu = rs.cu_seqlens.tolist()
    return [[rs.row(r).tolist() for r in range(cu[i], cu[i + 1])] for i in range(rs.batch_size)]


def test_docstring_example():
    rs = _example()
    assert rs.member_ids.tolist() == [4, 9, 2, 3, 7] and rs.member_ids.dtype == torch.int32
    assert rs.row_offsets.tolist() == [0, 2, 2, 5] and rs.row_offsets.dtype == torch.int64
    assert rs.cu_seqlens.tolist() == [0, 2, 3] and rs.cu_seqlens.dtype == torch.int32
    assert rs.batch_size == len(rs) == 2 and rs.num_rows == 3
    assert rs.row_lengths.tolist() == [2, 0, 3] and rs.lengths.tolist() == [2, 1]
    padded = rs.to_padded()
    assert padded.values.tolist() == [[4, 9, -1], [-1, -1, -1], [2, 3, 7]] and padded.cu_seqlens.tolist() == [0, 2, 3]
    assert padded.dtype == torch.int32
    assert "rows=3" in repr(rs) and "members=5" in repr(rs)


def test_padding_round_trips_and_widths():
    rs = _example()
    assert RaggedSupport.from_padded(rs.to_padded()) == rs
    assert RaggedSupport.from_padded(rs.to_padded(width=6)) == rs
    assert rs.to_padded(width=5).values.shape == (3, 5)
    assert rs.padded_rows(torch.tensor([2, 0, 2])).tolist() == [[2, 3, 7], [4, 9, -1], [2, 3, 7]]
    assert rs.padded_rows(torch.tensor([1])).tolist() == [[-1]]  # an empty row: width at least 1
    assert rs.padded_rows(torch.tensor([], dtype=torch.int64)).shape == (0, 1)
    packed = PackedTensor(torch.tensor([[5, 1, -1], [-1, -1, -1], [8, 0, 2]], dtype=torch.int32), [0, 1, 3])
    back = RaggedSupport.from_padded(packed)
    assert _rows(back) == [[[5, 1]], [[], [8, 0, 2]]]
    assert back.to_padded(width=3) == packed
    # A captured width: padded copies keep it (to_padded() round-trips the fixed-width rows) ...
    assert RaggedSupport.from_padded(packed).to_padded() == packed and back.width_bound == 3
    assert rs.bounded(4).width_bound == 4 and rs.to_padded().values.shape == (3, 4)
    # ... and may not be narrower than a row, which padding would cut.
    with pytest.raises(ValueError, match=r"width 2 is narrower than the widest row \(3 ids\); pass a width >= 3"):
        _example().bounded(2)
    empty = RaggedSupport.from_rows([[[], []]])
    assert empty.padded_rows(torch.tensor([0, 1])).tolist() == [[-1], [-1]]
    assert RaggedSupport.from_rows([]).batch_size == 0


def test_batch_ops():
    rs = RaggedSupport.from_rows([[[4, 9], []], [[2, 3, 7]], [[1], [5, 6]]])
    rows = _rows(rs)
    assert _rows(rs.gather([2, 0, 2])) == [rows[2], rows[0], rows[2]]
    assert _rows(rs[1]) == [rows[1]]
    assert _rows(rs[1:]) == rows[1:]
    assert _rows(rs[::-1]) == rows[::-1]
    assert _rows(rs[torch.tensor([True, False, True])]) == [rows[0], rows[2]]
    assert _rows(rs.repeat(2)) == rows * 2
    assert _rows(rs.repeat_interleave(2)) == [r for r in rows for _ in range(2)]
    cat = RaggedSupport.cat([rs, _example()])
    assert _rows(cat) == rows + _rows(_example())
    assert cat.row_offsets[-1] == cat.member_ids.numel()
    assert rs.to("cpu") == rs
    assert rs != _example() and rs == RaggedSupport.from_rows(rows)
    assert (rs == rs.to_padded()) is False
    with pytest.raises(TypeError):
        hash(rs)


def test_gather_does_not_mutate():
    rs = _example()
    before = [t.clone() for t in (rs.member_ids, rs.row_offsets, rs.cu_seqlens)]
    out = rs.repeat(3)
    out.member_ids.zero_()
    for a, b in zip(before, (rs.member_ids, rs.row_offsets, rs.cu_seqlens)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ malformed input


@pytest.mark.parametrize(
    "members, offsets, cu, match",
    [
        ([[1, 2]], [0, 2], [0, 1], r"member_ids must be 1-D \[num_members\], got shape \(1, 2\)"),
        ([1.0, 2.0], [0, 2], [0, 1], r"member_ids must be integer \(int32\), got torch.float32"),
        ([True], [0, 1], [0, 1], r"member_ids must be integer"),
        ([1, 2], [1, 2], [0, 1], r"RaggedSupport row_offsets must start at 0, got 1"),
        ([1, 2], [0, 2, 1, 2], [0, 3], r"row_offsets must be non-decreasing: segment 1 has offsets 2 -> 1"),
        ([1, 2], [0, 1], [0, 1], r"row_offsets ends at 1 but the buffer holds 2 rows"),
        ([1, 2], [0, 1, 2], [0, 1], r"RaggedSupport cu_seqlens ends at 1 but the buffer holds 2 rows"),
        ([1, 2], [0, 1, 2], [0, 2, 1, 2], r"cu_seqlens must be non-decreasing"),
        ([1, 2], [0, 1, 2], [[0, 2]], r"cu_seqlens must be 1-D"),
        ([1, 2], [0.0, 2.0], [0, 1], r"row_offsets must be an integer tensor"),
    ],
)
def test_malformed_construction(members, offsets, cu, match):
    with pytest.raises(ValueError, match=match):
        RaggedSupport(torch.tensor(members), torch.tensor(offsets), torch.tensor(cu))


def test_malformed_ops():
    rs = _example()
    with pytest.raises(ValueError, match=r"a chosen row holds 3 members, more than width=2"):
        rs.to_padded(width=2)
    with pytest.raises(ValueError, match=r"repeat count must be a positive int, got 0"):
        rs.repeat(0)
    with pytest.raises(ValueError, match=r"repeat count must be a positive int"):
        rs.repeat_interleave(2.0)
    with pytest.raises(ValueError, match=r"needs at least one batch"):
        RaggedSupport.cat([])
    with pytest.raises(IndexError, match=r"out of range for a batch of 2"):
        rs.gather([2])


def test_validate_names_trajectory_and_row():
    rs = RaggedSupport.from_rows([[[4, 9], []], [[2, 3, 7], [5, 1, 5]]])
    with pytest.raises(ValueError, match=r"collation: trajectory 1, row 1 holds a duplicate id: \[5, 1, 5\]"):
        rs.validate(where="collation")
    rs = RaggedSupport.from_rows([[[4, 9], []], [[2, 3, 70]]])
    rs.validate()
    with pytest.raises(ValueError, match=r"trajectory 1, row 0 holds an id >= vocab_size=50: \[2, 3, 70\]"):
        rs.validate(vocab_size=50)
    rs = RaggedSupport.from_rows([[[4, -1]]])
    with pytest.raises(ValueError, match=r"trajectory 0, row 0 holds a negative id \(CSR rows carry members only"):
        rs.validate()
    # The same id in two different rows is fine.
    RaggedSupport.from_rows([[[1, 2], [2, 1]], [[1]]]).validate(vocab_size=3)
    # Valid rows cost one host read.
    from benchmarks.syncs import HostReads

    rs = RaggedSupport.from_rows([[[4, 9], []], [[2, 3, 7], [5, 1, 6]]])
    with HostReads() as reads:
        rs.validate(vocab_size=10)
    assert reads.total == 1, dict(reads.where)
    RaggedSupport.from_rows([[[], []]]).validate(vocab_size=1)


# ------------------------------------------------------------------ properties


@st.composite
def ragged_sets(draw):
    """Trajectories of rows of distinct ids in [0, 40)."""
    row = st.lists(st.integers(0, 39), unique=True, max_size=6)
    return draw(st.lists(st.lists(row, max_size=5), max_size=5))


@settings(max_examples=60, deadline=None)
@given(sets=ragged_sets(), data=st.data())
def test_round_trips_and_gathers(sets, data):
    rs = RaggedSupport.from_rows(sets)
    assert _rows(rs) == sets
    rs.validate(vocab_size=40)
    width = data.draw(st.integers(6, 8))
    padded = rs.to_padded(width=width)
    assert padded.values.shape == (rs.num_rows, width)
    for r, members in enumerate(m for traj in sets for m in traj):
        assert padded.values[r].tolist() == members + [-1] * (width - len(members))
    assert RaggedSupport.from_padded(padded) == rs
    if sets:
        idx = data.draw(st.lists(st.integers(0, len(sets) - 1), max_size=7))
        got = rs.gather(idx)
        assert _rows(got) == [sets[i] for i in idx]
        # The padded form gathers the same segments.
        assert got.to_padded(width=width) == padded.gather(idx)


def _checked_bounded() -> RaggedSupport:
    """Checked against a vocabulary and bounded at width 4, as capture hands rows over."""
    from nemo_replay.rollout.boundary import validate_support

    rs = RaggedSupport.from_padded(PackedTensor(torch.tensor([[4, 9, -1, -1], [2, 3, 7, -1]], dtype=torch.int32), [0, 1, 2]))
    validate_support(rs, vocab_size=16, where="test")
    return rs


def _same_rows_unchecked(back: RaggedSupport, rs: RaggedSupport) -> None:
    from nemo_replay.support.checked import checked

    assert isinstance(back, RaggedSupport) and back == rs and _rows(back) == _rows(rs)
    assert back.width_bound == 4  # the capture width travels: padded copies score bit for bit alike
    assert checked(back) is None and checked(rs) is not None  # checked again where used; the original keeps its record
    assert back.gather([1, 0]).row(0).tolist() == [2, 3, 7]


def test_a_checked_support_pickles_and_comes_back_unchecked():
    """A checked RaggedSupport could not be pickled ("cannot pickle 'weakref.ReferenceType'"): Ray,
    multiprocessing and a saved rollout file all failed on it."""
    import pickle

    rs = _checked_bounded()
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        _same_rows_unchecked(pickle.loads(pickle.dumps(rs, protocol=protocol)), rs)
    unbounded = RaggedSupport.from_rows([[[4, 9], []]])
    assert pickle.loads(pickle.dumps(unbounded)).width_bound == 2  # computed again on first use


def test_a_checked_support_round_trips_through_torch_save(tmp_path):
    rs = _checked_bounded()
    torch.save({"support": rs}, tmp_path / "rollout.pt")
    _same_rows_unchecked(torch.load(tmp_path / "rollout.pt", weights_only=False)["support"], rs)
    with torch.serialization.safe_globals([RaggedSupport]):  # torch's default weights_only load, the class allowed
        _same_rows_unchecked(torch.load(tmp_path / "rollout.pt")["support"], rs)


def _echo(rs: RaggedSupport) -> tuple:
    return rs, _rows(rs)


def test_a_checked_support_crosses_a_process_both_ways():
    import multiprocessing

    rs = _checked_bounded()
    with multiprocessing.get_context("fork").Pool(1) as pool:  # a worker stays alive while its answer is read
        back, seen = pool.apply(_echo, (rs,))
    assert seen == _rows(rs)
    _same_rows_unchecked(back, rs)
