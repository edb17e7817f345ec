"""Padding removal, the roll and the channel layout, pinned by hand-worked examples."""

from __future__ import annotations

import pytest
import torch

from nemo_replay.batch import ReplayBatch
from nemo_replay.layout.ulysses import gather_sequence, pad_and_slice, padded_length
from nemo_replay.layout.unpad import pad, packed_position_ids, shift_left, unpad, unpad_indices
from nemo_replay.scoring.scorer import score_aligned_support
from nemo_replay.strategies.fsdp.rolled_layout import build_layout
from nemo_replay.support.packed import PackedTensor
from tests.strategies.fsdp.fixtures import BATCH_B, make_batch


def test_unpad_worked_example():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    x = torch.tensor([[90, 1, 2, 3], [4, 5, 6, 7]])
    plan = unpad_indices(mask)
    assert plan.indices.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert plan.cu_seqlens.dtype == torch.int32 and plan.cu_seqlens.tolist() == [0, 3, 7]
    assert plan.max_seqlen == 4 and plan.nnz == 7
    packed = unpad(x, plan)
    assert packed.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert packed_position_ids(plan.cu_seqlens).tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert shift_left(packed, 0).tolist() == [2, 3, 4, 5, 6, 7, 0]
    assert pad(packed, plan, -1).tolist() == [[-1, 1, 2, 3], [4, 5, 6, 7]]


def test_unpad_pad_round_trip_with_features_and_gradient():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    x = torch.randn(3, 5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    plan = unpad_indices(mask)
    assert plan.max_seqlen == 5 and plan.cu_seqlens.tolist() == [0, 3, 8, 9]
    packed = unpad(x, plan)
    assert packed.shape == (9, 2)
    back = pad(packed, plan, 0.0)
    torch.testing.assert_close(back, torch.where(mask[..., None], x, torch.zeros_like(x)))
    weights = torch.randn(3, 5, 2, generator=g, dtype=torch.float64)
    (back * weights).sum().backward()
    torch.testing.assert_close(x.grad, torch.where(mask[..., None], weights, torch.zeros_like(weights)))
    with pytest.raises(ValueError, match="nnz"):
        pad(packed[:-1], plan)
    with pytest.raises(ValueError, match="share the token layout"):
        unpad(x[:, :4], plan)


def test_shift_left_along_a_dimension_does_not_wrap():
    x = torch.arange(12).view(3, 4)
    assert shift_left(x, -1, dim=1).tolist() == [[1, 2, 3, -1], [5, 6, 7, -1], [9, 10, 11, -1]]
    assert shift_left(x, 0, dim=0).tolist() == [[4, 5, 6, 7], [8, 9, 10, 11], [0, 0, 0, 0]]
    assert x[0, 0] == 0  # input untouched


def test_sequence_helpers_without_a_group():
    assert [padded_length(n, 2) for n in (5, 6, 7)] == [6, 6, 8]
    x = torch.arange(10).view(2, 5)
    assert pad_and_slice(x, None, fill=-1) is x
    assert gather_sequence(x, None, seq_len=3).tolist() == [[0, 1, 2], [5, 6, 7]]


def _hand_batch() -> ReplayBatch:
    # traj 0: _ 11 | 12 13   (prompt 1, response 2, one left pad); rows 0, 1
    # traj 1: 21 22 | 23 24  (prompt 2, response 2); rows 2, 3
    return ReplayBatch(
        sequences=torch.tensor([[0, 11, 12, 13], [21, 22, 23, 24]]),
        attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool),
        response_lengths=torch.tensor([2, 2]),
        loss_mask=torch.tensor([[1, 1], [1, 1]], dtype=torch.bool),
        support=PackedTensor(torch.tensor([[12, 5], [13, -1], [23, 7], [24, 8]], dtype=torch.int32), [0, 2, 4]),
    )


def test_roll_semantics_hand_worked_padded():
    layout = build_layout(_hand_batch(), remove_padding=False)
    assert layout.input_ids.tolist() == [[0, 11, 12, 13], [21, 22, 23, 24]]
    assert layout.position_ids.tolist() == [[0, 0, 1, 2], [0, 1, 2, 3]]
    assert layout.attention_mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    # Targets: the tokens rolled left. Row ids stay at the logit that predicts their token.
    assert layout.channels.sampled_ids.tolist() == [[11, 12, 13, 0], [22, 23, 24, 0]]
    assert layout.channels.row_ids.tolist() == [[-1, 0, 1, -1], [-1, 2, 3, -1]]
    # Token loss mask [[0,0,1,1],[0,0,1,1]] moved with the targets.
    assert layout.channels.loss_mask.int().tolist() == [[0, 1, 1, 0], [0, 1, 1, 0]]
    assert layout.channels.trajectory_ids.tolist() == [[-1, 0, 0, 0], [1, 1, 1, 1]]


def test_roll_semantics_hand_worked_unpadded():
    layout = build_layout(_hand_batch(), remove_padding=True)
    assert layout.input_ids.tolist() == [[11, 12, 13, 21, 22, 23, 24]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert layout.attention_mask is None
    assert layout.channels.sampled_ids.tolist() == [[12, 13, 21, 22, 23, 24, 0]]
    assert layout.channels.row_ids.tolist() == [[0, 1, -1, -1, 2, 3, -1]]
    assert layout.channels.loss_mask.int().tolist() == [[1, 1, 0, 0, 1, 1, 0]]
    assert layout.channels.trajectory_ids.tolist() == [[0, 0, 0, 1, 1, 1, 1]]
    # Back to canonical [B, S-1]: packed position p -> its token column, pad filled.
    values = torch.arange(7, dtype=torch.float64)[None] + 1
    assert layout.to_canonical(values, fill=0).tolist() == [[0, 1, 2], [4, 5, 6]]
    canon = layout.canonical
    assert canon.sampled_ids.tolist() == [[11, 12, 13], [22, 23, 24]]
    assert canon.row_ids.tolist() == [[-1, 0, 1], [-1, 2, 3]]


def test_off_by_one_is_caught_by_the_guard():
    """Rolling the row ids (or not rolling the loss mask) misaligns rows and tokens."""
    batch = make_batch(**BATCH_B)
    layout = build_layout(batch, remove_padding=True)
    torch.manual_seed(0)
    logits = torch.randn(*layout.input_ids.shape, 96, dtype=torch.float64)
    args = dict(trajectory_ids=layout.channels.trajectory_ids)
    score_aligned_support(logits, layout.channels.sampled_ids, layout.channels.row_ids, layout.channels.loss_mask, batch.support, **args)
    with pytest.raises(ValueError, match="support row"):
        score_aligned_support(logits, layout.channels.sampled_ids, shift_left(layout.channels.row_ids, -1, dim=1), layout.channels.loss_mask, batch.support, **args)
    unrolled_mask = shift_left(layout.channels.loss_mask, False, dim=1)  # rolled twice: one column early
    with pytest.raises(ValueError, match="support row"):
        score_aligned_support(logits, shift_left(layout.channels.sampled_ids, 0, dim=1), layout.channels.row_ids, unrolled_mask, batch.support, **args)


def test_padded_and_unpadded_layouts_agree_in_canonical_coordinates():
    batch = make_batch(**BATCH_B)
    a = build_layout(batch, remove_padding=True)
    b = build_layout(batch, remove_padding=False)
    real = batch.attention_mask[:, :-1]
    for name in ("sampled_ids", "row_ids", "trajectory_ids"):
        fill = -1 if name != "sampled_ids" else 0
        back_a = a.to_canonical(getattr(a.channels, name), fill=fill)
        back_b = b.to_canonical(getattr(b.channels, name))
        assert torch.equal(torch.where(real, back_a, fill), torch.where(real, back_b, fill)), name
    assert torch.equal(a.to_canonical(a.channels.loss_mask, fill=False), a.canonical.loss_mask)
    assert torch.equal(b.to_canonical(b.channels.loss_mask), b.canonical.loss_mask)
    assert torch.equal(a.to_canonical(a.channels.row_ids, fill=-1), a.canonical.row_ids)
    assert torch.equal(b.to_canonical(b.channels.trajectory_ids), b.canonical.trajectory_ids)
    # Positions restart at every trajectory, in both layouts.
    assert torch.equal(a.position_ids[0], packed_position_ids(a.unpadding.cu_seqlens))
    assert torch.equal(unpad(b.position_ids, a.unpadding), a.position_ids[0])
