"""Ulysses attention on one process (SP size 1): the mask and the full-sequence forward.

The SP = 2 exchange runs in test_distributed.py with real processes.
"""

from __future__ import annotations

import pytest
import torch

from nemo_replay.layout.unpad import packed_position_ids, unpad, unpad_indices
from nemo_replay.strategies.fsdp.attention import (
    ULYSSES_ATTENTION,
    UlyssesPlan,
    segment_attention_mask,
    ulysses_attention_forward,
    use_ulysses_attention,
)
from tests.strategies.fsdp.fixtures import BATCH_A, make_batch, plain_copy, tiny_llama

TOL = dict(rtol=1e-10, atol=1e-11)


def test_segment_mask_worked_example():
    mask = segment_attention_mask(torch.tensor([[0, 0, 1, 1, -1]]))
    assert mask.shape == (1, 1, 5, 5)
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]


def _per_trajectory_logits(model, batch):
    S = batch.seq_len
    out = []
    for i in range(batch.batch_size):
        L = int(batch.attention_mask[i].sum())
        out.append(model(input_ids=batch.sequences[i, S - L :][None]).logits[0])
    return out


@torch.no_grad()
def test_full_sequence_attention_matches_per_trajectory_forward():
    batch = make_batch(**BATCH_A)
    reference = tiny_llama(seed=5)
    model = plain_copy(reference)
    use_ulysses_attention(model)
    assert model.config._attn_implementation == ULYSSES_ATTENTION
    want = _per_trajectory_logits(reference, batch)

    # Packed row, trajectories restart: block-diagonal causal attention.
    real = batch.attention_mask
    unpadding = unpad_indices(real)
    ids = unpad(batch.sequences, unpadding)[None]
    seg = unpad(torch.where(real, torch.arange(3)[:, None], -1), unpadding)[None]
    plan = UlyssesPlan(None, seg)
    got = model(input_ids=ids, position_ids=packed_position_ids(unpadding.cu_seqlens)[None], ulysses_plan=plan).logits[0]
    assert plan.calls == model.config.num_hidden_layers
    cu = unpadding.cu_seqlens.tolist()
    for i, w in enumerate(want):
        torch.testing.assert_close(got[cu[i] : cu[i + 1]], w, **TOL)

    # Left-padded rows: padding keys never attended.
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    seg = torch.where(real, torch.arange(3)[:, None], -1)
    got = model(input_ids=batch.sequences, position_ids=positions, ulysses_plan=UlyssesPlan(None, seg)).logits
    S = batch.seq_len
    for i, w in enumerate(want):
        torch.testing.assert_close(got[i, S - w.shape[0] :], w, **TOL)

    # Without a plan the switched model is transformers' SDPA attention.
    torch.testing.assert_close(model(input_ids=batch.sequences[1:2]).logits[0], want[1], **TOL)


def test_plan_shape_and_sliding_window_are_checked():
    module = torch.nn.Module()
    q = torch.zeros(1, 4, 6, 8)
    with pytest.raises(ValueError, match="segment_ids"):
        ulysses_attention_forward(module, q, q, q, None, ulysses_plan=UlyssesPlan(None, torch.zeros(1, 5, dtype=torch.long)))
    with pytest.raises(ValueError, match="sliding window"):
        ulysses_attention_forward(module, q, q, q, None, ulysses_plan=UlyssesPlan(None, torch.zeros(1, 6, dtype=torch.long)), sliding_window=4)
