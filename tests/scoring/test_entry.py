"""The scorer's one entry point, ``score_positions``: the support-or-vocabulary choice, the
context its errors carry, and the channels type every caller builds (docs/design.md §4).

Two gloo ranks failing together through it run in ``tests/distributed/test_groups.py`` (one spawn)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_replay.scoring.entry import ScorerChannels, score_positions
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.packed import PackedTensor
from tests.scoring.batches import make_case
from tests.scoring.reference import reference_scores

T = 0.7


@pytest.fixture(scope="module")
def case():
    return make_case(B=3, T=29, V=211, k=6, seed=3, eos=(1,))


def channels_of(case) -> ScorerChannels:
    return ScorerChannels(case.sampled_ids, case.row_ids, case.loss_mask, case.trajectory_ids)


def test_replay_scores_each_position_over_its_row_forward_and_backward(case):
    logits = case.logits.clone().requires_grad_(True)
    got = score_positions(logits, channels_of(case), case.support, temperature=T, compute_entropy=True)
    want = reference_scores(case.logits, case.sampled_ids, case.row_ids, case.loss_mask, case.sets, temperature=T)
    assert torch.equal(got.valid_mask, want["valid"]) and torch.equal(got.fallback_mask, want["fallback"])
    assert got.fallback_mask.any()  # the synthetic EOS of trajectory 1 is scored over the vocabulary
    torch.testing.assert_close(got.logprobs, want["logprobs"], rtol=0, atol=1e-12)
    torch.testing.assert_close(got.entropy, want["entropy"], rtol=0, atol=1e-12)
    weights = torch.randn(got.logprobs.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad((got.logprobs * weights).sum(), logits)
    ref_logits = case.logits.clone().requires_grad_(True)
    ref = reference_scores(ref_logits, case.sampled_ids, case.row_ids, case.loss_mask, case.sets, temperature=T)
    (ref_grad,) = torch.autograd.grad((ref["logprobs"] * weights).sum(), ref_logits)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)


def test_without_replay_every_real_position_is_scored_over_the_vocabulary(case):
    got = score_positions(case.logits, channels_of(case), None, replay=False, temperature=T)
    real = case.trajectory_ids >= 0
    z = torch.log_softmax(case.logits / T, dim=-1).gather(-1, case.sampled_ids.clamp_min(0)[..., None]).squeeze(-1)
    assert torch.equal(got.fallback_mask, real) and not got.valid_mask.any()
    torch.testing.assert_close(got.logprobs, torch.where(real, z, torch.zeros_like(z)), rtol=0, atol=1e-12)


def test_a_replaying_call_without_rows_names_the_fix(case):
    with pytest.raises(ValueError, match=r"support=None.*replay=False"):
        score_positions(case.logits, channels_of(case), None)


def test_errors_carry_the_caller_s_context_and_keep_their_type(case):
    sampled = case.sampled_ids.clone()
    b, t = (int(v) for v in torch.nonzero(case.loss_mask & (case.row_ids >= 0))[0])
    members = set(case.sets[int(case.row_ids[b, t])])
    sampled[b, t] = next(v for v in range(211) if v not in members)
    bad = channels_of(case)._replace(sampled_ids=sampled)
    with pytest.raises(SupportAlignmentError, match=rf"^my trainer \(trajectory = completion\): trajectory {b}, "):
        score_positions(case.logits, bad, case.support, context="my trainer (trajectory = completion)")


def test_token_positions_name_the_caller_s_column(case):
    sampled = case.sampled_ids.clone()
    b, t = (int(v) for v in torch.nonzero(case.loss_mask & (case.row_ids >= 0))[0])
    sampled[b, t] = next(v for v in range(211) if v not in set(case.sets[int(case.row_ids[b, t])]))
    columns = torch.arange(case.sampled_ids.shape[1]).expand_as(sampled) + 100
    bad = ScorerChannels(sampled, case.row_ids, case.loss_mask, case.trajectory_ids, columns)
    with pytest.raises(SupportAlignmentError, match=rf"trajectory {b}, token position {t + 100}:"):
        score_positions(case.logits, bad, case.support)


def _compact(case, *, drop: bool):
    """The case's rows as one compact buffer a trajectory (sampled ids dropped or kept)."""
    from nemo_replay.support.codec import CompactRows, encode_support
    from nemo_replay.support.ragged import RaggedSupport

    ragged = RaggedSupport.from_padded(case.support)
    row_sampled = torch.zeros(case.support.num_rows, dtype=torch.int64)
    has = case.row_ids >= 0
    row_sampled[case.row_ids[has]] = case.sampled_ids[has]
    cu = case.support.cu_seqlens.tolist()
    buffers = [encode_support(ragged[[i]], vocab_size=211, sampled_ids=row_sampled[cu[i]:cu[i + 1]] if drop else None)
               for i in range(len(cu) - 1)]
    labels = [f"completion {i}" for i in range(len(buffers))]
    return CompactRows(buffers, sampled_ids=row_sampled if drop else None, labels=labels), buffers, row_sampled


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("hidden", [False, True])
def test_compact_rows_decode_at_the_entry_and_score_bit_for_bit_as_the_fixed_rows(case, drop, hidden):
    """Rows handed over compact are decoded on the scorer's device; scores and gradients equal
    (bitwise) those from the same fixed-width rows, in logits and hidden mode."""
    compact, _, _ = _compact(case, drop=drop)

    def run(support):
        src = (case.hidden if hidden else case.logits).clone().requires_grad_(True)
        weight = case.weight.clone().requires_grad_(True) if hidden else None
        got = score_positions(src, channels_of(case), support, temperature=T, lm_head_weight=weight,
                              compute_entropy=True)
        w = torch.randn(got.logprobs.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        grads = torch.autograd.grad((got.logprobs * w).sum(), [src] + ([weight] if hidden else []))
        return got, grads

    got, grads = run(compact)
    # The fixed rows with each row's members sorted, as the codec returns them (member order moves last bits).
    big = torch.iinfo(torch.int32).max
    v = case.support.values
    v = torch.where(v < 0, big, v).sort(1).values
    want, want_grads = run(PackedTensor(torch.where(v == big, -1, v), case.support.cu_seqlens))
    assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.entropy, want.entropy)
    assert torch.equal(got.valid_mask, want.valid_mask) and torch.equal(got.fallback_mask, want.fallback_mask)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))


def test_corrupted_compact_rows_stop_the_scorer_by_name_whatever_validate_says(case):
    """A buffer whose header passes (CRC recomputed: a writer's bug) but whose rows do not decode is
    named by its label through the scorer's one flag, with validate on or off."""
    import struct

    from nemo_replay.support.codec import CodecError, CompactRows, header

    _, buffers, _ = _compact(case, drop=False)
    head = list(header.HEAD.unpack(buffers[1][:header.HEAD.size].tobytes()))
    head[9] -= 1  # the row width: the widest row now decodes past it
    head[10] = 0
    bad = np.concatenate([np.frombuffer(header.HEAD.pack(*head), np.uint8), buffers[1][header.HEAD.size:]])
    bad[header.CRC_AT:header.CRC_AT + 4] = np.frombuffer(struct.pack("<I", header.crc(bad)), np.uint8)
    rows = CompactRows([buffers[0], bad, buffers[2]], labels=["completion 0", "completion 1", "completion 2"])
    for validate in (True, False):
        with pytest.raises(CodecError, match=r"completion 1: compact support: row \d+ decodes to \d+ ids, past the "
                                             r"header's row width"):
            score_positions(case.logits, channels_of(case), rows, validate=validate)
