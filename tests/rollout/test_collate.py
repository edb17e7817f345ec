"""Collation into the trainer's batch order, with repeats, row-count and alignment checks."""

import pytest
import torch

import nemo_replay
from nemo_replay import capture
from nemo_replay.batch import ReplayBatch
from nemo_replay.layout.canonical import canonical_channels
from nemo_replay.rollout.collate import collate_routes, collate_support
from nemo_replay.rollout.capture.trace import SupportTrace
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport

V, K, T = 40, 5, 0.8


def trajectories(top_k, lengths=(2, 3, 1), seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for R in lengths:
        logits = torch.randn(R, V, generator=gen) * 2
        out.append((logits, capture.sample(logits, temperature=T, top_k=top_k, top_p=0.9, generator=gen)))
    return out


def rows(support, r):
    return [int(t) for t in support.values[r] if t >= 0] if isinstance(support, PackedTensor) else support.row(r).tolist()


@pytest.mark.parametrize("top_k", [K, None], ids=["fixed", "ragged"])
def test_batch_order_with_group_repeats_scores_like_the_sampler(top_k):
    trajs = trajectories(top_k)
    index = [2, 0, 0, 1]
    lengths = torch.tensor([2, 3, 1])[index]
    # fixed: the sampler's rows padded to top_k, as an engine adapter hands them over.
    given = [r.support.to_padded() if top_k else r.support for _, r in trajs]
    batch_support = collate_support(given, response_lengths=lengths, sampled_ids=[r.ids for _, r in trajs], index=index, vocab_size=V)
    assert isinstance(batch_support, PackedTensor if top_k else RaggedSupport)
    assert batch_support.cu_seqlens.tolist() == [0, 1, 3, 5, 8]
    src_rows = [rows(r.support, j) for _, r in trajs for j in range(r.ids.numel())]
    starts = [0, 2, 5]
    want = [src_rows[starts[i] + j] for i in index for j in range(int(torch.tensor([2, 3, 1])[i]))]
    assert [rows(batch_support, r) for r in range(8)] == want

    # The trainer's left-padded batch in that order: scores reproduce the sampler.
    prompt_len, S = 3, 6
    seqs, am, src = torch.zeros(4, S, dtype=torch.int64), torch.zeros(4, S, dtype=torch.bool), torch.randn(4, S - 1, V)
    loss_mask = torch.zeros(4, 3, dtype=torch.bool)  # right-aligned token positions: the responses
    for b, i in enumerate(index):
        logits, res = trajs[i]
        R = res.ids.numel()
        L = prompt_len + R
        seqs[b, S - L :] = torch.cat([torch.tensor([30 + b, 31, 32]), res.ids])
        am[b, S - L :] = True
        loss_mask[b, 3 - R :] = True
        src[b, S - 1 - R :] = logits  # logit column S-1-R+j predicts response token j
    batch = ReplayBatch(seqs, am, lengths, loss_mask=loss_mask, support=batch_support)
    ch = canonical_channels(batch)
    sc = nemo_replay.score_aligned_support(
        src, ch.sampled_ids, ch.row_ids, ch.loss_mask, batch.support, temperature=T, trajectory_ids=ch.trajectory_ids
    )
    assert int(sc.valid_mask.sum()) == 8 and not sc.fallback_mask.any()
    for b, i in enumerate(index):
        R = trajs[i][1].ids.numel()
        torch.testing.assert_close(sc.logprobs[b, S - 1 - R :], trajs[i][1].logprobs, rtol=0, atol=1e-6)


def test_repeat_interleave_index_equals_packed_repeat():
    trajs = trajectories(K)
    sup = [r.support for _, r in trajs]
    once = collate_support(sup, response_lengths=[2, 3, 1])
    grouped = collate_support(sup, response_lengths=[2, 2, 3, 3, 1, 1], index=torch.arange(3).repeat_interleave(2))
    assert grouped == once.repeat_interleave(2)


def test_traces_collate_with_their_own_tokens():
    trajs = trajectories(K)
    traces = []
    for _, r in trajs:
        tr = SupportTrace(top_k=K, eos_id=2)
        tr.add_turn(r.ids, r.support)
        tr.add_observation([7, 8])
        traces.append(tr)
    out = collate_support(traces, response_lengths=[4, 5, 3])
    assert out.cu_seqlens.tolist() == [0, 4, 9, 12]
    assert isinstance(out, RaggedSupport) and (out.row_lengths[[2, 3, 7, 8, 10, 11]] == 0).all()  # CSR from the traces
    assert (out.to_padded().values[[2, 3, 7, 8, 10, 11]] == -1).all() and out.width_bound == K


def test_collation_errors_name_where():
    trajs = trajectories(K)
    sup = [r.support.to_padded() for _, r in trajs]  # fixed-width, as an engine adapter hands them over
    ids = [r.ids for _, r in trajs]
    with pytest.raises(ValueError, match=r"batch position 1 \(trajectory 0\) has 2 support rows but its response length is 3"):
        collate_support(sup, response_lengths=[1, 3], index=[2, 0])
    misaligned = [ids[0], ids[1].roll(1), ids[2]]
    with pytest.raises(ValueError, match="collation: trajectory 1, row 0: sampled token"):
        collate_support(sup, response_lengths=[2, 3, 1], sampled_ids=misaligned)
    with pytest.raises(ValueError, match="trajectory 2 has 1 support rows but 2 response tokens"):
        collate_support(sup, response_lengths=[2, 3, 1], sampled_ids=[ids[0], ids[1], torch.tensor([1, 2])])
    with pytest.raises(ValueError, match="mix fixed-width and ragged"):
        collate_support([sup[0], RaggedSupport.from_padded(sup[1])], response_lengths=[2, 3])
    with pytest.raises(ValueError, match="different row widths"):
        collate_support([sup[0], sup[1].values[:, :3]], response_lengths=[2, 3])
    with pytest.raises(ValueError, match="refers outside"):
        collate_support(sup, response_lengths=[2], index=[3])
    with pytest.raises(ValueError, match=r"expected \(3,\) in batch order"):
        collate_support(sup, response_lengths=[2, 3])
    with pytest.raises(ValueError, match="trajectory 1 rows have dtype torch.float32, expected integer token ids"):
        collate_support([sup[0], sup[1].values.float() + 0.5], response_lengths=[2, 3])


def test_routes_collate_and_check_sequence_lengths():
    r = [torch.randint(0, 8, (n, 2, 2), dtype=torch.int16) for n in (5, 7)]
    out = collate_routes(r, sequence_lengths=[7, 5, 7], index=[1, 0, 1])
    assert out.cu_seqlens.tolist() == [0, 7, 12, 19]
    assert torch.equal(out.values, torch.cat([r[1], r[0], r[1]]))
    with pytest.raises(ValueError, match=r"batch position 0 \(trajectory 0\) has 5 route rows but its sequence length is 6"):
        collate_routes(r, sequence_lengths=[6, 7])
    with pytest.raises(ValueError, match="different route shapes"):
        collate_routes([r[0], torch.zeros(3, 2, 3, dtype=torch.int16)], sequence_lengths=[5, 3])
    with pytest.raises(ValueError, match=r"int \(L_i, layers, topk\)"):
        collate_routes([r[0].float()], sequence_lengths=[5])


def test_integer_checks_widen_and_never_narrow_silently():
    # uint8 routes (engines narrow expert ids to a byte): compared with -1 only after widening.
    r8 = [torch.randint(0, 8, (n, 2, 2), dtype=torch.uint8) for n in (3, 4)]
    out = collate_routes(r8, sequence_lengths=[3, 4])
    assert out.values.dtype == torch.uint8 and torch.equal(out.values, torch.cat(r8))
    with pytest.raises(ValueError, match="expert id -2 < -1"):
        collate_routes([torch.full((2, 1, 1), -2, dtype=torch.int8)], sequence_lengths=[2])
    # int64 rows are range-checked before the cast to int32, which would wrap 2**32 + 5 to 5.
    rows = torch.tensor([[5, 2**32 + 5]], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"trajectory 0 rows hold 4294967301, outside \[-1, 2\*\*31\)"):
        collate_support([rows], response_lengths=[1], sampled_ids=[torch.tensor([5])])
    with pytest.raises(ValueError, match="trajectory 0 sampled ids have dtype torch.float32"):
        collate_support([torch.tensor([[5, 1]], dtype=torch.int32)], response_lengths=[1], sampled_ids=[torch.tensor([5.4])])
