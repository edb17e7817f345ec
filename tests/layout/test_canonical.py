"""Canonical batch coordinates (docs/design.md §3): row ids at logit positions, the loss-mask shift."""

from __future__ import annotations

import pytest
import torch

from nemo_replay import PackedTensor, RaggedSupport, score_aligned_support
from nemo_replay.batch import ReplayBatch
from nemo_replay.layout.canonical import canonical_channels, from_caller_columns, position_ids, real_runs, response_columns, to_caller_columns, token_aligned_channels
from nemo_replay.strategies.base import RoleOutput

PAD = 0


def _docstring_batch() -> ReplayBatch:
    # S = 6: one left pad, prompt p0 p1 (ids 11, 12), response r0 r1 r2 (ids 21, 22, 23).
    support = PackedTensor(torch.tensor([[21, 5], [22, 6], [23, -1]], dtype=torch.int32), [0, 3])
    return ReplayBatch(
        sequences=torch.tensor([[PAD, 11, 12, 21, 22, 23]]),
        attention_mask=torch.tensor([[False, True, True, True, True, True]]),
        response_lengths=torch.tensor([3]),
        loss_mask=torch.tensor([[True, True, True]]),
        support=support,
    )


def test_docstring_example():
    ch = canonical_channels(_docstring_batch())
    #                       logit column:  0   1   2   3   4
    assert ch.sampled_ids.tolist() == [[11, 12, 21, 22, 23]]
    assert ch.row_ids.tolist() == [[-1, -1, 0, 1, 2]]  # row j (s_j) at logit column S - 1 - R + j
    assert ch.loss_mask.tolist() == [[False, False, True, True, True]]
    assert ch.trajectory_ids.tolist() == [[-1, 0, 0, 0, 0]]
    for c in (ch.sampled_ids, ch.row_ids, ch.trajectory_ids):
        assert c.dtype == torch.int64 and c.shape == (1, 5)
    assert ch.loss_mask.dtype == torch.bool
    # The logit that predicts response token r_j carries row j, whose members include r_j.
    for col in range(5):
        if ch.row_ids[0, col] >= 0:
            assert int(ch.sampled_ids[0, col]) in _docstring_batch().support.values[int(ch.row_ids[0, col])].tolist()


def _ragged_batch(support_form="packed") -> ReplayBatch:
    """B=3, S=9; real lengths 9, 5, 7; responses 4, 2, 5; loss mask [B, A=6] over the responses."""
    lengths, responses, S = [9, 5, 7], [4, 2, 5], 9
    g = torch.Generator().manual_seed(0)
    seq = torch.zeros(3, S, dtype=torch.int64)
    am = torch.zeros(3, S, dtype=torch.bool)
    rows = []
    for i, (L, R) in enumerate(zip(lengths, responses)):
        seq[i, S - L :] = torch.randperm(90, generator=g)[:L] + 10
        am[i, S - L :] = True
        traj_rows = []
        for j in range(R):
            token = int(seq[i, S - R + j])
            traj_rows.append([token, 100 + 10 * i + j])  # sampled token plus a distinct companion
        rows.append(traj_rows)
    # Token columns [S - 6, S); only response tokens are loss-active.
    token_mask = torch.tensor([[S - 6 + a >= S - R for a in range(6)] for R in responses])
    token_mask[2, -2] = False  # an observation token inside trajectory 2's response
    if support_form == "packed":
        support = PackedTensor.from_segments([torch.tensor(r, dtype=torch.int32) for r in rows])
    else:
        support = RaggedSupport.from_rows(rows)
    return ReplayBatch(seq, am, torch.tensor(responses), token_mask, support=support)


def test_ragged_batch_against_a_loop():
    batch = _ragged_batch()
    ch = canonical_channels(batch)
    B, S = batch.sequences.shape
    A = batch.loss_mask.shape[1]
    cu = batch.support.cu_seqlens.tolist()
    for i in range(B):
        L, R = int(batch.attention_mask[i].sum()), int(batch.response_lengths[i])
        for c in range(S - 1):
            assert int(ch.sampled_ids[i, c]) == int(batch.sequences[i, c + 1])
            # Logit column c predicts token column c + 1; response token j sits at token column S - R + j.
            j = c + 1 - (S - R)
            assert int(ch.row_ids[i, c]) == (cu[i] + j if 0 <= j < R else -1), (i, c)
            t = c + 1  # the token this logit predicts; its mask entry is token column t
            expected = t >= S - A and bool(batch.loss_mask[i, t - (S - A)]) and c >= S - L
            assert bool(ch.loss_mask[i, c]) == expected, (i, c)
            assert int(ch.trajectory_ids[i, c]) == (i if c >= S - L else -1)


@pytest.mark.parametrize("form", ["packed", "ragged"])
def test_channels_feed_the_scorer_and_a_shift_is_caught(form):
    """The scorer accepts canonical channels; rolling the row ids by one is an alignment error."""
    batch = _ragged_batch(form)
    ch = canonical_channels(batch)
    logits = torch.randn(3, 8, 200, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = score_aligned_support(logits, ch.sampled_ids, ch.row_ids, ch.loss_mask, batch.support,
                                trajectory_ids=ch.trajectory_ids)
    # Rows hold {token, companion}: log p = z[token] - logsumexp(z[token], z[companion]).
    expected = torch.zeros(3, 8, dtype=torch.float64)
    for i, c in torch.nonzero(ch.loss_mask).tolist():
        members = [int(ch.sampled_ids[i, c]), 100 + 10 * i + int(ch.row_ids[i, c]) - int(batch.support.cu_seqlens[i])]
        expected[i, c] = logits[i, c, members[0]] - torch.logsumexp(logits[i, c, members], 0)
    torch.testing.assert_close(out.logprobs, expected, atol=1e-12, rtol=0)
    assert torch.equal(out.valid_mask, ch.loss_mask)
    shifted = torch.roll(ch.row_ids, 1, dims=1)
    with pytest.raises(ValueError, match=r"trajectory \d, logit position \d: (sampled token \d+ is not a member|loss-active "
                                         r"with no support row)|trajectories \[.*\] have"):
        score_aligned_support(logits, ch.sampled_ids, shifted, ch.loss_mask, batch.support,
                              trajectory_ids=ch.trajectory_ids)


def test_response_columns():
    b, col = response_columns(torch.tensor([2, 0, 3]), 8)
    assert b.tolist() == [0, 0, 2, 2, 2] and col.tolist() == [6, 7, 5, 6, 7]


def test_without_support_rows_are_none():
    batch = _ragged_batch()
    batch.support = None
    ch = canonical_channels(batch)
    assert torch.all(ch.row_ids == -1)


def test_select_and_to():
    batch = _ragged_batch()
    sub = batch.select(torch.tensor([2, 0]))
    assert sub.batch_size == 2 and sub.response_lengths.tolist() == [5, 4]
    assert torch.equal(sub.sequences, batch.sequences[[2, 0]])
    assert [s.tolist() for s in sub.support.segments()] == [batch.support.segment(2).tolist(), batch.support.segment(0).tolist()]
    ch_sub, ch = canonical_channels(sub), canonical_channels(batch)
    assert torch.equal(ch_sub.loss_mask, ch.loss_mask[[2, 0]])
    # Row ids are renumbered for the new packing but point at the same rows.
    for k, i in enumerate([2, 0]):
        for c in range(8):
            if ch.row_ids[i, c] >= 0:
                assert torch.equal(sub.support.values[ch_sub.row_ids[k, c]], batch.support.values[ch.row_ids[i, c]])
    moved = batch.to("cpu")
    assert torch.equal(moved.sequences, batch.sequences) and moved.support == batch.support


# ------------------------------------------------------------------ validation


def _fields(**changes):
    b = _ragged_batch()
    kw = dict(sequences=b.sequences, attention_mask=b.attention_mask, response_lengths=b.response_lengths,
              loss_mask=b.loss_mask, support=b.support)
    kw.update(changes)
    return kw


def _two_runs():
    am = _ragged_batch().attention_mask.clone()
    am[1, 5] = False  # trajectory 1: columns 4, 6, 7, 8 real -- a hole inside the row
    return am


def _loss_at(i, a):
    """The batch's loss mask with trajectory i's loss_mask column a set as well."""
    lm = _ragged_batch().loss_mask.clone()
    lm[i, a] = True
    return lm


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(sequences=torch.zeros(3, 9)), r"sequences must be an integer \(B, S\) tensor, got torch.float32"),
        (dict(sequences=torch.zeros(27, dtype=torch.int64)), r"sequences must be an integer \(B, S\) tensor"),
        (dict(attention_mask=torch.ones(3, 8, dtype=torch.bool)), r"attention_mask has shape \(3, 8\), expected \(3, 9\)"),
        (dict(attention_mask=_two_runs()), r"trajectory 1: attention_mask holds 2 separate runs of real tokens"),
        (dict(attention_mask=torch.zeros(3, 9, dtype=torch.bool)), r"trajectory 0: attention_mask has no real token"),
        (dict(response_lengths=torch.tensor([4, 2])), r"response_lengths has shape \(2,\), expected \(3,\)"),
        (dict(response_lengths=torch.tensor([4, -1, 5])), r"trajectory 1: response_length -1 must be in \[0, L_i - 1\] with L_i=5"),
        (dict(response_lengths=torch.tensor([4, 5, 5])), r"trajectory 1: response_length 5 must be in \[0, L_i - 1\]"),
        (dict(loss_mask=torch.ones(3, 10, dtype=torch.bool)), r"loss_mask has shape \(3, 10\), expected \(B=3, A\).*S=9"),
        (dict(loss_mask=torch.ones(3, 9, dtype=torch.bool)), r"trajectory 0: loss_mask is set at token column 0, which no logit"),
        # Trajectory 1 (L = 5) is real in token columns 4..8; the [B, A=6] mask covers columns 3..8.
        (dict(loss_mask=_loss_at(1, 0)),
         r"trajectory 1: loss_mask is set at token column 3, which no logit predicts \(padding; loss_mask column 0"),
        (dict(loss_mask=_loss_at(1, 1)),
         r"trajectory 1: loss_mask is set at token column 4, which no logit predicts \(the trajectory's first real token"),
        (dict(old_logprobs=torch.zeros(3, 5)), r"old_logprobs has shape \(3, 5\), expected \(3, 6\): the columns of loss_mask"),
        (dict(advantages=torch.zeros(2)), r"advantages has shape \(2,\), expected \(3,\) or \(3, 6\)"),
        (dict(loss_mask=torch.ones(2, 6, dtype=torch.bool)), r"loss_mask has shape \(2, 6\)"),
        (dict(loss_mask=torch.ones(3, 0, dtype=torch.bool)), r"loss_mask has shape \(3, 0\)"),
        (dict(support=_ragged_batch().support[[0, 1]]), r"support holds 2 trajectories, the batch 3"),
        (dict(support=_ragged_batch().support[[0, 0, 2]]), r"trajectory 1 has 4 support rows for 2 response tokens"),
        (dict(routes=PackedTensor(torch.zeros(21, 2, 1), [0, 9, 14, 21])[[0, 1]]), r"routes hold 2 trajectories, the batch 3"),
        (dict(routes=PackedTensor(torch.zeros(21, 2, 1), [0, 9, 15, 21])),
         r"trajectory 1 has 6 route rows for 5 real tokens; routes are token-aligned"),
    ],
)
def test_validation_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        ReplayBatch(**_fields(**changes))


def test_routes_aligned_with_real_tokens_pass():
    routes = PackedTensor(torch.zeros(21, 2, 1, dtype=torch.int32), [0, 9, 14, 21])
    assert ReplayBatch(**_fields(routes=routes)).routes is routes


# ------------------------------------------------------------------ padding layouts


def _relaid(batch: ReplayBatch, layout: str) -> ReplayBatch:
    """The same trajectories in another padding, with a token-aligned [B, S] loss mask and fields.

    ``right``: real tokens at columns [0, L); ``split``: prompts left-padded to end at one
    column, completions right-padded from it (the generation buffer of many engines).
    """
    B, S = batch.sequences.shape
    starts, ends = real_runs(batch.attention_mask)
    R = batch.response_lengths
    P = ends - starts - R
    width = S + 2 if layout == "split" else S
    seq = torch.full((B, width), PAD, dtype=torch.int64)
    am = torch.zeros(B, width, dtype=torch.bool)
    lm = torch.zeros(B, width, dtype=torch.bool)
    old = torch.zeros(B, width, dtype=torch.float64)
    A = batch.loss_mask.shape[1]
    for i in range(B):
        s = 0 if layout == "right" else int(P.max() - P[i])
        L = int(ends[i] - starts[i])
        seq[i, s : s + L] = batch.sequences[i, starts[i] : ends[i]]
        am[i, s : s + L] = True
        # Token column t of the old layout -> t - ends_i + (s + L) here; the old mask covers [S - A, S).
        for a in range(A):
            t = S - A + a
            if batch.loss_mask[i, a]:
                lm[i, t - int(ends[i]) + s + L] = True
            old[i, t - int(ends[i]) + s + L] = batch.old_logprobs[i, a]
    return ReplayBatch(seq, am, R.clone(), lm, support=batch.support, old_logprobs=old)


@pytest.mark.parametrize("layout", ["right", "split"])
def test_other_paddings_give_the_same_channels_moved(layout):
    base = _ragged_batch()
    base.old_logprobs = torch.randn(base.loss_mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    other = _relaid(base, layout)
    ch0, ch = canonical_channels(base), canonical_channels(other)
    s0, e0 = real_runs(base.attention_mask)
    s1, e1 = real_runs(other.attention_mask)
    for i in range(base.batch_size):
        n = int(e0[i] - s0[i]) - 1  # logit positions that predict a real token
        a = slice(int(s0[i]), int(s0[i]) + n)
        b = slice(int(s1[i]), int(s1[i]) + n)
        for name in ("sampled_ids", "row_ids", "loss_mask"):
            assert torch.equal(getattr(ch, name)[i, b], getattr(ch0, name)[i, a]), (layout, name, i)
        assert (ch.trajectory_ids[i, b] == i).all()
        # Everything outside the run predicts nothing: no row, no loss, no trajectory.
        outside = torch.ones(ch.row_ids.shape[1], dtype=torch.bool)
        outside[b] = False
        assert (ch.row_ids[i, outside] == -1).all() and not ch.loss_mask[i, outside].any()
        assert (ch.trajectory_ids[i, outside] == -1).all()
    # The token-aligned field round-trips through logit columns into the caller's [B, S].
    lp = from_caller_columns(other.old_logprobs, other.batch_size, other.seq_len - 1, "old_logprobs")
    back = to_caller_columns(lp.double(), other.seq_len)
    assert torch.equal(back[:, 1:], other.old_logprobs[:, 1:].float().double()) and (back[:, 0] == 0).all()


def test_token_aligned_docstring_example():
    # Right-padded p0 p1 r0 r1 _ (ids 11 12 21 22, pad 0); rows 7, 8 at tokens r0, r1.
    seq = torch.tensor([[11, 12, 21, 22, 0]])
    am = torch.tensor([[1, 1, 1, 1, 0]])
    rows = torch.tensor([[-1, -1, 7, 8, -1]])
    token_mask = torch.tensor([[0, 0, 1, 1, 0]])
    ch = token_aligned_channels(seq, am, token_mask, rows)
    assert ch.sampled_ids.tolist() == [[12, 21, 22, 0]]
    assert ch.row_ids.tolist() == [[-1, 7, 8, -1]]
    assert ch.loss_mask.tolist() == [[False, True, True, False]]
    assert ch.trajectory_ids.tolist() == [[0, 0, 0, -1]]
    with pytest.raises(ValueError, match=r"token_row_ids \(1, 5\) and token_loss_mask \(1, A <= 5\), got \(1, 4\)"):
        token_aligned_channels(seq, am, token_mask, rows[:, :4])


def test_caller_columns_examples_and_role_output_views():
    x = torch.tensor([[1.0, 2.0, 3.0]])  # logit columns of S = 4
    assert to_caller_columns(x, 2).tolist() == [[2.0, 3.0]]
    assert to_caller_columns(x, 4, fill=-1).tolist() == [[-1.0, 1.0, 2.0, 3.0]]
    with pytest.raises(ValueError, match="caller columns must number 1..S=4, got 5"):
        to_caller_columns(x, 5)
    assert from_caller_columns(torch.tensor([[9.0, 2.0, 3.0, 4.0]]), 1, 3, "f").tolist() == [[2.0, 3.0, 4.0]]
    assert from_caller_columns(torch.tensor([[3.0, 4.0]]), 1, 3, "f").tolist() == [[0.0, 3.0, 4.0]]
    assert from_caller_columns(torch.tensor([5.0]), 1, 3, "f").tolist() == [[5.0, 5.0, 5.0]]
    out = RoleOutput(x, x > 1, x < 0)
    full = out.response(4)
    assert full.logprobs.tolist() == [[0.0, 1.0, 2.0, 3.0]] and full.valid_mask.tolist() == [[False, False, True, True]]
    assert out.response(1).logprobs.tolist() == [[3.0]]


def test_position_ids_any_padding():
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0]])
    assert position_ids(am).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 0, 0], [0, 0, 1, 2, 0]]
    assert [t.tolist() for t in real_runs(am)] == [[2, 0, 1], [5, 3, 4]]


def test_canonical_channels_cost_one_host_read():
    """The batch checked its mask when built; placing its rows reads back only their count
    (the runs were checked again and repeat_interleave sized itself: four reads)."""
    from benchmarks.syncs import HostReads

    batch = _ragged_batch()
    with HostReads() as reads:
        canonical_channels(batch)
    assert reads.total == 1, dict(reads.where)
