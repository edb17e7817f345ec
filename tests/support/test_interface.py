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


def test_first_outside_names_the_first_id_out_of_range_in_every_integer_dtype():
    """support/dtypes.first_outside: in the ids' own dtype when torch's aminmax takes it (no widened copy of a
    long prompt: tests/rollout/transport/test_server.py measures the server's memory), widened otherwise."""
    import numpy as np

    from nemo_replay.support.dtypes import first_outside

    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        ids = torch.tensor([1, 2, 9, 3, 100], dtype=dtype)
        assert first_outside(ids, 200) is None and first_outside(ids, 9) == 2 and first_outside(ids, 200, low=2) == 0
        assert first_outside(ids[:0], 1) is None
    assert first_outside(torch.tensor([[5, -1], [0, 7]]), 8) == 1  # flat index of a 2-D tensor
    assert first_outside(torch.tensor([2**40, 5]), 2**31) == 0  # int64 ids past int32
    assert first_outside(np.array([3, 4, 12]), 10) == 2 and first_outside(np.array([], np.int64), 1) is None
