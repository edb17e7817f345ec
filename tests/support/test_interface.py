"""Fixed-width and CSR rows answer the same support methods with the same results (docs/design.md §2)."""

import pytest
import torch

from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport

# Two trajectories: rows {4, 9}, {} | {2, 3, 7}, {5}.
PADDED = torch.tensor([[4, 9, -1], [-1, -1, -1], [2, 3, 7], [5, -1, -1]], dtype=torch.int32)
CU = [0, 2, 4]


def both():
    fixed = PackedTensor(PADDED.clone(), CU)
    return fixed, RaggedSupport.from_padded(fixed)


@pytest.mark.parametrize("form", [0, 1], ids=["fixed", "ragged"])
def test_views_agree(form):
    support = both()[form]
    assert support.nonempty_rows().tolist() == [True, False, True, True]
    width = max(support.width_bound, 3)
    got = support.gather_padded(torch.tensor([2, 0, 1]), width)
    assert got.tolist() == [[2, 3, 7], [4, 9, -1], [-1, -1, -1]]
    assert sorted(i for i in support.all_ids.flatten().tolist() if i >= 0) == [2, 3, 4, 5, 7, 9]
    assert RaggedSupport.of(support) == both()[1]
    assert not bool(support.invalid_flag(vocab_size=10))
    assert bool(support.invalid_flag(vocab_size=9))  # id 9 is out of range


@pytest.mark.parametrize("form", [0, 1], ids=["fixed", "ragged"])
def test_validate_names_the_row_in_both_forms(form):
    support = both()[form]
    support.validate(vocab_size=10, sampled_ids=torch.tensor([9, 0, 3, 5]), where="here")
    with pytest.raises(SupportAlignmentError, match=r"here: trajectory 1, row 1.*sampled token 6"):
        support.validate(vocab_size=10, sampled_ids=torch.tensor([9, 0, 3, 6]), where="here")
    with pytest.raises(ValueError, match=r"here: trajectory 0, row 0.*vocab_size=9"):
        support.validate(vocab_size=9, where="here")


@pytest.mark.parametrize("form", [0, 1], ids=["fixed", "ragged"])
def test_resegment_and_widen_keep_rows_and_record(form):
    from nemo_replay.rollout.boundary import validate_support

    support = both()[form]
    validate_support(support, vocab_size=10, where="entry")
    per_row = support.resegment(torch.arange(support.num_rows + 1))
    assert per_row.batch_size == 4 and per_row.checked is not None
    swapped = per_row.gather([3, 2, 1, 0]).resegment([0, 1, 4])
    assert swapped.lengths.tolist() == [1, 3]
    assert swapped.gather_padded(torch.arange(4), 3).tolist() == [[5, -1, -1], [2, 3, 7], [-1, -1, -1], [4, 9, -1]]
    wide = support.widen(5)
    assert wide.checked is not None and wide.width_bound >= 3
    assert wide.gather_padded(torch.tensor([0]), 5).tolist() == [[4, 9, -1, -1, -1]]
    assert RaggedSupport.of(wide) == RaggedSupport.of(support)
    joined = type(support).cat([wide, wide])
    assert joined.batch_size == 4 and joined.checked is not None
