"""Support-row invariants (docs/design.md §2): every violation is a ValueError naming trajectory and row."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_replay.support.validate import describe_row, validate_support_rows

CU = torch.tensor([0, 2, 5], dtype=torch.int32)  # trajectory 0: rows 0-1, trajectory 1: rows 2-4


def _rows(*edits):
    """Five valid rows of width 4; ``edits`` are (row, values) replacements."""
    v = torch.tensor([[3, 1, -1, -1], [7, 0, 2, 9], [-1, -1, -1, -1], [4, -1, -1, -1], [8, 6, 5, -1]], dtype=torch.int32)
    for r, vals in edits:
        v[r] = torch.tensor(vals, dtype=torch.int32)
    return v


def test_valid_rows_pass():
    validate_support_rows(_rows(), vocab_size=10, cu_seqlens=CU, sampled_ids=torch.tensor([1, 9, 0, 4, 5]))
    validate_support_rows(torch.empty(0, 4, dtype=torch.int32), vocab_size=1)
    validate_support_rows(torch.tensor([[2], [-1]]), vocab_size=3)  # width 1
    validate_support_rows(_rows(), vocab_size=10, cu_seqlens=CU, sampled_ids=torch.tensor([1, 9, 123, 4, 5]))  # an empty row has no member to check


@pytest.mark.parametrize(
    "edit, vocab, match",
    [
        ((3, [4, -2, -1, -1]), None, r"trajectory 1, row 1 holds an id below -1 \(only -1 may pad\): \[4, -2, -1, -1\]"),
        ((1, [7, 0, 2, 10]), 10, r"trajectory 0, row 1 holds an id >= vocab_size=10: \[7, 0, 2, 10\]"),
        ((4, [8, -1, 5, -1]), None, r"trajectory 1, row 2 has a member after -1 padding \(padding must be trailing\)"),
        ((2, [-1, 3, -1, -1]), None, r"trajectory 1, row 0 has a member after -1 padding"),
        ((0, [3, 1, 3, -1]), None, r"trajectory 0, row 0 holds a duplicate id: \[3, 1, 3, -1\]"),
        ((4, [8, 6, 5, 8]), None, r"trajectory 1, row 2 holds a duplicate id"),
    ],
)
def test_each_violation_is_named(edit, vocab, match):
    with pytest.raises(ValueError, match=r"wire decode: " + match):
        validate_support_rows(_rows(edit), vocab_size=vocab, cu_seqlens=CU, where="wire decode")


def test_sampled_token_must_be_a_member():
    with pytest.raises(ValueError, match=r"support: trajectory 1, row 2: sampled token 7 is not a member of its support "
                                         r"row \[8, 6, 5, -1\]; rows and tokens are misaligned"):
        validate_support_rows(_rows(), cu_seqlens=CU, sampled_ids=torch.tensor([1, 9, 0, 4, 7]))
    # -1 does not match a row's -1 padding.
    with pytest.raises(ValueError, match=r"trajectory 1, row 2: sampled token -1 is not a member"):
        validate_support_rows(_rows(), cu_seqlens=CU, sampled_ids=torch.tensor([1, 9, 0, 4, -1]))
    with pytest.raises(ValueError, match=r"sampled_ids has shape \(4,\), expected \(5,\)"):
        validate_support_rows(_rows(), sampled_ids=torch.tensor([1, 9, 0, 4]))


def test_without_offsets_rows_are_named_globally():
    assert describe_row(None, 3) == "row 3"
    assert describe_row(CU, 3) == "trajectory 1, row 1"
    assert describe_row(torch.tensor([0, 0, 2]), 1) == "trajectory 1, row 1"  # empty trajectory 0 skipped
    with pytest.raises(ValueError, match=r"^support: row 4 holds a duplicate id"):
        validate_support_rows(_rows((4, [8, 8, -1, -1])))


@pytest.mark.parametrize(
    "values, match",
    [
        ([[1, 2]], r"support rows must be a torch.Tensor, got list"),
        (torch.tensor([1, 2]), r"support rows must be 2-D \(rows, k\), got shape \(2,\)"),
        (torch.zeros(2, 3, 1, dtype=torch.int32), r"must be 2-D \(rows, k\), got shape \(2, 3, 1\)"),
        (torch.zeros(2, 3), r"must be an integer tensor \(int32\), got torch.float32"),
        (torch.zeros(2, 3, dtype=torch.bool), r"must be an integer tensor \(int32\), got torch.bool"),
    ],
)
def test_bad_types(values, match):
    with pytest.raises(ValueError, match=match):
        validate_support_rows(values)


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 11), unique=True, min_size=0, max_size=5), min_size=1, max_size=8),
    data=st.data(),
)
def test_valid_rows_pass_and_one_corruption_fails(rows, data):
    k = 5
    values = torch.tensor([r + [-1] * (k - len(r)) for r in rows], dtype=torch.int32)
    validate_support_rows(values, vocab_size=12)
    # Corrupt one row in one of the four ways; the check must name that row.
    r = data.draw(st.integers(0, len(rows) - 1))
    kind = data.draw(st.sampled_from(["below", "vocab", "gap", "dup"]))
    bad = values.clone()
    members = rows[r]
    if kind == "below":
        bad[r, -1] = -3
    elif kind == "vocab":
        bad[r, 0] = 12
    elif kind == "gap":
        if len(members) >= k - 1:
            return
        bad[r, len(members) + 1] = 0 if 0 not in members else 11
    else:
        if not members or len(members) == k:
            return
        bad[r, len(members)] = members[0]
    with pytest.raises(ValueError, match=rf"row {r} "):
        validate_support_rows(bad, vocab_size=12)


def test_narrow_rows_and_sampled_ids_are_compared_widened():
    """uint8 rows: a sampled id of 300 would wrap to 44 in uint8 and pass as the member 44."""
    rows = torch.tensor([[44, 7], [1, 2]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"sampled token 300 is not a member"):
        validate_support_rows(rows, sampled_ids=torch.tensor([300, 1]))
    with pytest.raises(ValueError, match=r"sampled_ids must be an integer tensor of token ids, got torch.float32"):
        validate_support_rows(rows, sampled_ids=torch.tensor([44.4, 1.0]))
    from nemo_replay.support.validate import support_row_flags

    assert not bool(support_row_flags(rows, vocab_size=300))  # 300 would wrap to 44 in uint8
    assert bool(support_row_flags(rows, vocab_size=40))


def test_required_support_arguments():
    from nemo_replay import PackedTensor, RaggedSupport

    with pytest.raises(ValueError, match=r"PackedTensor cu_seqlens is required.*pass \[0, 2\]"):
        PackedTensor(torch.zeros(2, 3, dtype=torch.int32), None)
    with pytest.raises(ValueError, match=r"RaggedSupport row_offsets is required"):
        RaggedSupport(torch.tensor([1, 2]), None, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"segment index is required"):
        PackedTensor(torch.zeros(2, 3, dtype=torch.int32), [0, 2]).gather(None)
    with pytest.raises(ValueError, match=r"outside int32"):
        RaggedSupport(torch.tensor([2**32 + 5]), torch.tensor([0, 1]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"padded_rows: rows must be an integer tensor"):
        RaggedSupport(torch.tensor([1, 2]), torch.tensor([0, 2]), torch.tensor([0, 1])).padded_rows(None)


def test_valid_rows_cost_two_host_reads_and_a_late_duplicate_is_still_named():
    """Valid rows: one read for the row checks (whatever the number of sort blocks), one for membership."""
    from benchmarks.syncs import HostReads
    from nemo_replay.support.validate import SORT_BLOCK

    k = 8
    n = 3 * SORT_BLOCK // k + 5  # four sort blocks
    g = torch.Generator().manual_seed(0)
    rows = (torch.randint(0, 1000, (n, 1), generator=g) + torch.arange(k) * 1009).to(torch.int32)  # distinct per row
    sampled = rows[:, 3].long()
    with HostReads() as reads:
        validate_support_rows(rows, vocab_size=1000 + 1009 * k, sampled_ids=sampled)
    assert reads.total == 2, dict(reads.where)
    rows[n - 2, 5] = rows[n - 2, 1]  # a duplicate in the last block
    with pytest.raises(ValueError, match=rf"row {n - 2} holds a duplicate id"):
        validate_support_rows(rows, vocab_size=1000 + 1009 * k)
