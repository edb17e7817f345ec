"""TokenMetadataLayout: alignment, CP chunks, channel alignment and the way back.

Property tests draw ragged batches and sizes (tp, cp in {1, 2, 4}, fp8 on/off, packed or
not) and compare the layout with naive per-sequence loops written here. The hand-worked
example of the module docstring is pinned value by value.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_replay.batch import ReplayBatch
from nemo_replay.layout.canonical import canonical_channels
from nemo_replay.strategies.megatron.token_layout import TokenMetadataLayout, layout_alignment
from nemo_replay.support.packed import PackedTensor

SIZES = st.sampled_from([1, 2, 4])


@st.composite
def ragged_batches(draw, left_padded: bool = True):
    """(attention_mask (B, S) bool, lengths, starts, response_lengths)."""
    B = draw(st.integers(1, 5))
    lengths = [draw(st.integers(2, 19)) for _ in range(B)]
    S = max(lengths) + draw(st.integers(0, 3))
    starts = [S - L if left_padded else draw(st.integers(0, S - L)) for L in lengths]
    am = torch.zeros(B, S, dtype=torch.bool)
    for b, (s, L) in enumerate(zip(starts, lengths)):
        am[b, s : s + L] = True
    R = [draw(st.integers(1, L - 1)) for L in lengths]
    return am, lengths, starts, R


@st.composite
def parallel_sizes(draw):
    tp, cp = draw(SIZES), draw(SIZES)
    packed = True if cp > 1 else draw(st.booleans())
    return tp, cp, draw(st.booleans()), packed


def all_ranks(am, tp, cp, fp8, packed):
    return [TokenMetadataLayout.build(am, tp_size=tp, cp_size=cp, cp_rank=r, fp8=fp8, packed=packed) for r in range(cp)]


def expected_alignment(tp, cp, fp8, packed):
    if not packed:
        return 16 * tp // math.gcd(16, tp) if fp8 else tp
    base = 2 * tp * cp if cp > 1 else tp
    return base * 16 * cp // math.gcd(base, 16 * cp) if fp8 else base


@settings(max_examples=80, deadline=None)
@given(ragged_batches(left_padded=False), parallel_sizes())
def test_padding_and_cp_chunks(batch, sizes):
    am, lengths, starts, _ = batch
    tp, cp, fp8, packed = sizes
    ranks = all_ranks(am, tp, cp, fp8, packed)
    lay = ranks[0]
    align = expected_alignment(tp, cp, fp8, packed)
    assert lay.alignment == align == layout_alignment(tp_size=tp, cp_size=cp, fp8=fp8, packed=packed)
    assert lay.lengths.tolist() == lengths and lay.starts.tolist() == starts
    Lp = lay.padded_lengths.tolist()
    if packed:
        assert all(p % align == 0 and L <= p < L + align for p, L in zip(Lp, lengths))
    else:
        assert Lp[0] % align == 0 and max(lengths) <= Lp[0] < max(lengths) + align
    cup = lay.cu_seqlens_padded.tolist()
    assert lay.cu_seqlens_padded.dtype == torch.int32 and cup[0] == 0
    assert [b - a for a, b in zip(cup, cup[1:])] == Lp
    assert lay.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    total = cup[-1]
    # Every rank holds exactly its two chunks of every padded sequence, in sequence order.
    seen = []
    for r, lr in enumerate(ranks):
        expect = []
        for i, p in enumerate(Lp if packed else []):
            c = p // (2 * cp) if cp > 1 else p
            chunks = [r, 2 * cp - 1 - r] if cp > 1 else [0]
            for k in chunks:
                expect += list(range(cup[i] + k * c, cup[i] + (k + 1) * c))
        if not packed:
            expect = list(range(total))
        assert lr.global_slots().tolist() == expect
        assert lr.num_local == total // cp and lr.num_local % tp == 0
        if fp8:
            assert lr.num_local % 16 == 0
        seen += expect
    assert sorted(seen) == list(range(total))


@settings(max_examples=80, deadline=None)
@given(ragged_batches(left_padded=False), parallel_sizes(), st.data())
def test_align_then_scatter_is_identity(batch, sizes, data):
    am, lengths, starts, _ = batch
    tp, cp, fp8, packed = sizes
    B, S = am.shape
    ranks = all_ranks(am, tp, cp, fp8, packed)
    # Distinct values so a swapped position changes the answer.
    x = torch.randperm(B * (S - 1)).view(B, S - 1) + 1
    parts = [lay.align_logits(x, fill=-7) for lay in ranks]
    back = ranks[data.draw(st.integers(0, cp - 1))].from_cp_parts(parts, fill=0)
    expect = torch.zeros_like(x)
    for b, (s, L) in enumerate(zip(starts, lengths)):
        expect[b, s : s + L - 1] = x[b, s : s + L - 1]
    assert torch.equal(back, expect)
    # Each logit position is held by exactly one rank.
    held = sum(int(lay.logit_valid().sum()) for lay in ranks)
    assert held == sum(L - 1 for L in lengths)
    # Token channels with trailing dims: every real token exactly once, at its position.
    tok = torch.arange(B * S * 2).view(B, S, 2)
    for lay in ranks:
        a = lay.align_tokens(tok, fill=-1).reshape(-1, 2)
        for t, q, v in zip(lay.slot_trajectory.tolist(), lay.slot_position.tolist(), a.tolist()):
            assert v == (tok[t, starts[t] + q].tolist() if t >= 0 else [-1, -1])


@settings(max_examples=60, deadline=None)
@given(ragged_batches(left_padded=False), parallel_sizes())
def test_next_token_shift_stays_inside_each_padded_sequence(batch, sizes):
    am, lengths, starts, _ = batch
    tp, cp, fp8, packed = sizes
    B, S = am.shape
    seq = torch.randint(1, 1000, (B, S))
    ranks = all_ranks(am, tp, cp, fp8, packed)
    lay = ranks[0]
    # The whole padded layout of input ids, then a roll by one inside each padded sequence.
    T = lay.total_padded
    ids = torch.zeros(T, dtype=torch.int64)
    for lr in ranks:
        ids[lr.global_slots()] = lr.input_ids(seq).reshape(-1)
    bounds = lay.cu_seqlens_padded.tolist() if packed else [i * lay.local_shape[1] for i in range(B + 1)]
    rolled = torch.zeros_like(ids)
    for a, b in zip(bounds, bounds[1:]):
        rolled[a : b - 1] = ids[a + 1 : b]
    for lr in ranks:
        valid = lr.logit_valid().reshape(-1)
        targets = lr.align_logits(seq[:, 1:], fill=0).reshape(-1)
        assert torch.equal(targets[valid], rolled[lr.global_slots()][valid])
        # The last real token of a trajectory predicts nothing.
        last = (lr.slot_trajectory >= 0) & (lr.slot_position == lr.lengths[lr.slot_trajectory.clamp(min=0)] - 1)
        assert not bool((valid & last).any())
        assert torch.equal(lr.position_ids().reshape(-1), lr.slot_position.clamp(min=0))


@settings(max_examples=60, deadline=None)
@given(ragged_batches(left_padded=True), parallel_sizes())
def test_support_rows_and_routes_land_on_their_positions(batch, sizes):
    am, lengths, starts, R = batch
    tp, cp, fp8, packed = sizes
    B, S = am.shape
    A = max(R)
    lm = torch.zeros(B, A, dtype=torch.bool)
    for b, r in enumerate(R):
        lm[b, A - r :] = True
    rows = PackedTensor.from_segments([torch.full((r, 2), 5, dtype=torch.int32) for r in R])
    seq = torch.randint(1, 50, (B, S))
    rb = ReplayBatch(seq * am, am, torch.tensor(R), lm, support=rows)
    canon = canonical_channels(rb)
    routes = PackedTensor.from_segments([torch.arange(L * 6).view(L, 3, 2) + 1000 * b for b, L in enumerate(lengths)])
    for lay in all_ranks(am, tp, cp, fp8, packed):
        ids = lay.support_row_ids(torch.tensor(R), rows.cu_seqlens)
        # The layout's own placement agrees with the canonical channels moved through it.
        assert torch.equal(ids, lay.align_logits(canon.row_ids, fill=-1))
        for t, q, r in zip(lay.slot_trajectory.tolist(), lay.slot_position.tolist(), ids.reshape(-1).tolist()):
            P = lengths[t] - R[t] if t >= 0 else 0
            j = q - (P - 1)
            assert r == (int(rows.cu_seqlens[t]) + j if t >= 0 and 0 <= j < R[t] else -1)
        aligned = lay.align_packed(routes, torch.zeros(B, dtype=torch.int64), shift=False, fill=-1).reshape(-1, 3, 2)
        for t, q, v in zip(lay.slot_trajectory.tolist(), lay.slot_position.tolist(), aligned):
            # Routes: no shift, every real token including the last one.
            assert torch.equal(v, routes.segment(t)[q] if t >= 0 else torch.full((3, 2), -1))


def test_hand_worked_example_pins_support_rows_to_logit_positions():
    # The module docstring: tp=1, cp=2, packed; a0..a4 (P=2, R=3) and b0..b2 (P=2, R=1).
    am = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    seq = torch.tensor([[10, 11, 12, 13, 14], [0, 0, 20, 21, 22]])
    r0, r1 = (TokenMetadataLayout.build(am, cp_size=2, cp_rank=r, packed=True) for r in (0, 1))
    assert r0.cu_seqlens.tolist() == [0, 5, 8] and r0.cu_seqlens_padded.tolist() == [0, 8, 12]
    assert r0.global_slots().tolist() == [0, 1, 6, 7, 8, 11]
    assert r1.global_slots().tolist() == [2, 3, 4, 5, 9, 10]
    assert r0.input_ids(seq).tolist() == [[10, 11, 0, 0, 20, 0]]
    assert r1.input_ids(seq).tolist() == [[12, 13, 14, 0, 21, 22]]
    assert r0.position_ids().tolist() == [[0, 1, 0, 0, 0, 0]]
    assert r1.position_ids().tolist() == [[2, 3, 4, 0, 1, 2]]
    # Targets: a1 -> a2 crosses from rank 0 to rank 1; a4 and b2 predict nothing.
    assert r0.align_logits(seq[:, 1:], fill=-1).tolist() == [[11, 12, -1, -1, 21, -1]]
    assert r1.align_logits(seq[:, 1:], fill=-1).tolist() == [[13, 14, -1, -1, 22, -1]]
    # Support rows: a's s0 s1 s2 (rows 0..2) at the logits of a1 a2 a3; b's s0 (row 3) at b1.
    cu = torch.tensor([0, 3, 4])
    assert r0.support_row_ids(torch.tensor([3, 1]), cu).tolist() == [[-1, 0, -1, -1, -1, -1]]
    assert r1.support_row_ids(torch.tensor([3, 1]), cu).tolist() == [[1, 2, -1, -1, 3, -1]]
    assert r0.logit_trajectory_ids().tolist() == [[0, 0, -1, -1, 1, -1]]
    assert r1.logit_trajectory_ids().tolist() == [[0, 0, -1, -1, 1, -1]]


def test_unpadded_example_moves_real_tokens_to_the_front():
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    seq = torch.arange(15).view(3, 5)
    lay = TokenMetadataLayout.build(am, tp_size=4)
    assert lay.local_shape == (3, 8)
    assert lay.input_ids(seq, pad_id=-1).tolist() == [
        [2, 3, 4, -1, -1, -1, -1, -1],
        [5, 6, 7, 8, 9, -1, -1, -1],
        [13, 14, -1, -1, -1, -1, -1, -1],
    ]
    assert TokenMetadataLayout.build(am, tp_size=4, fp8=True).local_shape == (3, 16)
    assert TokenMetadataLayout.build(am, tp_size=2, min_length=9).local_shape == (3, 10)
    packed = TokenMetadataLayout.build(am, tp_size=2, packed=True, min_length=16)
    assert packed.padded_lengths.tolist() == [4, 6, 6] and packed.local_shape == (1, 16)


def test_packed_seq_params_for_megatron():
    pytest.importorskip("megatron.core")
    am = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    p = TokenMetadataLayout.build(am, tp_size=2, cp_size=2, cp_rank=1, packed=True).packed_seq_params()
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == [0, 3, 7] and p.cu_seqlens_q_padded.tolist() == [0, 8, 16]
    assert p.cu_seqlens_q.dtype == torch.int32 and p.max_seqlen_q == 8
    with pytest.raises(ValueError, match="packed=True"):
        TokenMetadataLayout.build(am).packed_seq_params()


def test_errors_name_the_problem_and_the_fix():
    am = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match=r"context parallelism \(cp_size=2\) needs packed THD.*packed=True"):
        TokenMetadataLayout.build(am, cp_size=2)
    with pytest.raises(ValueError, match="trajectory 1: attention_mask holds 2 separate runs of real tokens"):
        TokenMetadataLayout.build(torch.tensor([[0, 1, 1, 1], [1, 0, 1, 1]], dtype=torch.bool), packed=True)
    with pytest.raises(ValueError, match="row 0 holds value 2 at column 2.*segment ids"):
        TokenMetadataLayout.build(torch.tensor([[1, 1, 2, 2], [1, 1, 1, 1]]), packed=True)
    with pytest.raises(ValueError, match="trajectory 1: attention_mask has no real token"):
        TokenMetadataLayout.build(torch.tensor([[1, 1], [0, 0]], dtype=torch.bool))
    with pytest.raises(ValueError, match=r"cp_rank must be an int in \[0, cp_size=2\)"):
        TokenMetadataLayout.build(am, cp_size=2, cp_rank=2, packed=True)
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        TokenMetadataLayout.build(am, tp_size=0)
    lay = TokenMetadataLayout.build(am)
    with pytest.raises(ValueError, match=r"logit channel must be \(B=2, 2"):
        lay.align_logits(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="cu_seqlens"):
        lay.packed_row_ids([0, 1], [0, 0], shift=True)
    with pytest.raises(ValueError, match=r"local outputs must be \(2, 3\) \+ extra dims .*got \(2, 4\)"):
        lay.to_canonical(torch.zeros(2, 4))
    cp = TokenMetadataLayout.build(am, cp_size=2, packed=True)
    local = torch.zeros(cp.local_shape)
    with pytest.raises(ValueError, match=r"cp_size=2 needs the context-parallel group .*got no group; pass cp_group="):
        cp.to_canonical(local)
    with pytest.raises(ValueError, match=r"one local tensor per CP rank \(2\), got 1"):
        cp.from_cp_parts([local])
    with pytest.raises(ValueError, match=r"cp_rank must be an int in \[0, cp_size=2\), got 2"):
        cp.for_cp_rank(2)


def test_rows_that_do_not_fit_their_trajectory_are_refused_naming_it():
    # Trajectory 1 is 3 tokens long: logit positions 0, 1 (token 2 predicts nothing).
    am = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    lay = TokenMetadataLayout.build(am)
    # A response as long as the whole sequence has no logit for its first row.
    with pytest.raises(ValueError, match=r"trajectory 1: response length 3 must be in \[0, L - 1\] with L=3"):
        lay.support_row_ids(torch.tensor([3, 3]), torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match=r"trajectory 0: response length -1"):
        lay.support_row_ids(torch.tensor([-1, 1]), torch.tensor([0, 0, 1]))
    empty = lay.support_row_ids(torch.tensor([0, 1]), torch.tensor([0, 0, 1]))  # an empty response: no row
    assert sorted(empty[empty >= 0].tolist()) == [0]
    with pytest.raises(ValueError, match=r"response_lengths must be \(2,\)"):
        lay.support_row_ids(torch.tensor([1]), torch.tensor([0, 1]))
    # Three route rows from token 1 of a 3-token trajectory would need token 3: refused, not dropped.
    routes = PackedTensor.from_segments([torch.zeros(5, 2, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"trajectory 1: 3 packed rows starting at token position 1 do not fit its 3 token"):
        lay.align_packed(routes, torch.tensor([0, 1]), shift=False)
    # The same rows read as logit positions from 0 need 3 logits where there are 2.
    rows = PackedTensor.from_segments([torch.zeros(4, 2, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"trajectory 1: 3 packed rows starting at logit position 0 do not fit its 2 logit"):
        lay.align_packed(rows, torch.tensor([0, 0]), shift=True)
    with pytest.raises(ValueError, match=r"trajectory 0: 5 packed rows starting at token position -1"):
        lay.align_packed(routes, torch.tensor([-1, 0]), shift=False)
    # Rows that fit still land where they belong.
    assert lay.align_packed(routes, torch.tensor([0, 0]), shift=False).shape == (2, 5, 2)


def test_one_cp_split_for_megatron_and_nemo_rl_against_a_chunk_loop():
    """layout/context_parallel.py is the one definition: rank r keeps chunks r and 2cp-1-r of every
    padded sequence; Megatron's layout and the NeMo-RL hooks both read it."""
    from nemo_replay.integrations.nemo_rl.token_aligned import local_slots
    from nemo_replay.layout.context_parallel import cp_local_positions

    for cp in (1, 2, 3, 4):
        padded = [2 * cp * m for m in (1, 3, 2, 5)]
        for r in range(cp):
            want_seq, want_pos = [], []
            for i, P in enumerate(padded):
                c = P // (2 * cp) if cp > 1 else P
                chunks = [r, 2 * cp - 1 - r] if cp > 1 else [0]
                for k in chunks:
                    want_pos += list(range(k * c, (k + 1) * c))
                    want_seq += [i] * c
            seq, pos = cp_local_positions(padded, cp, r)
            assert seq.tolist() == want_seq and pos.tolist() == want_pos, (cp, r)
            slots = local_slots(padded, cp, r, packed=True)
            assert slots.row.tolist() == want_seq and slots.position.tolist() == want_pos
    with pytest.raises(ValueError, match=r"a padded sequence of 6 tokens \(sequence 0\) cannot be cut into 2 \* cp = 4 chunks"):
        cp_local_positions([6], 2, 0)
