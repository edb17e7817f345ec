"""Every malformed scorer input raises ValueError naming the problem (and where it is)."""

from __future__ import annotations

import pytest
import torch

from nemo_replay import PackedTensor, RaggedSupport, VocabShard, score_aligned_support, score_full_vocabulary
from tests.scoring.batches import make_case


@pytest.fixture(scope="module")
def case():
    return make_case(B=3, T=19, V=61, k=5, H=8, eos=(1,), seed=21)


def _score(case, **overrides):
    args = dict(
        source=case.logits, sampled_ids=case.sampled_ids, row_ids=case.row_ids,
        loss_mask=case.loss_mask, support=case.support,
    )
    kwargs = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return score_aligned_support(
        args["source"], args["sampled_ids"], args["row_ids"], args["loss_mask"], args["support"], **kwargs
    )


def _valid_positions(case, traj):
    """Columns of trajectory ``traj`` that are loss-active and carry a non-empty row."""
    return [t for t in range(case.row_ids.shape[1])
            if case.loss_mask[traj, t] and case.row_ids[traj, t] >= 0 and case.sets[int(case.row_ids[traj, t])]]


def test_the_fixture_scores_cleanly(case):
    out = _score(case, compute_entropy=True)
    assert out.valid_mask.any() and int(out.fallback_mask.sum()) == 1


# ------------------------------------------------------------------ shapes and dtypes


@pytest.mark.parametrize(
    "name, make, match",
    [
        ("source", lambda c: c.logits.long(), r"source must be a floating-point tensor"),
        ("source", lambda c: c.logits.tolist(), r"source must be a floating-point tensor.*list"),
        ("source", lambda c: c.logits[0, 0], r"source must have a position dimension"),
        ("sampled_ids", lambda c: c.sampled_ids[:, :-1], r"sampled_ids has shape \(3, 18\) but source positions are \(3, 19\)"),
        ("row_ids", lambda c: c.row_ids.T, r"row_ids has shape \(19, 3\)"),
        ("loss_mask", lambda c: c.loss_mask[None], r"loss_mask has shape \(1, 3, 19\)"),
        ("sampled_ids", lambda c: c.sampled_ids.double(), r"sampled_ids must be an integer tensor, got torch.float64"),
        ("row_ids", lambda c: c.row_ids.float(), r"row_ids must be an integer tensor, got torch.float32"),
        ("row_ids", lambda c: c.row_ids >= 0, r"row_ids must be an integer tensor, got torch.bool"),
        ("sampled_ids", lambda c: c.sampled_ids.tolist(), r"sampled_ids must be a tensor, got list"),
    ],
)
def test_bad_channels(case, name, make, match):
    with pytest.raises(ValueError, match=match):
        _score(case, **{name: make(case)})


def test_non_float_source_and_weight_name_their_dtype(case):
    with pytest.raises(ValueError, match=r"source must be a floating-point tensor .* got torch.int64"):
        _score(case, source=case.logits.long())
    with pytest.raises(ValueError, match=r"lm_head_weight must be a floating-point tensor \(V_local, H\), got torch.int64"):
        _score(case, source=case.hidden, lm_head_weight=case.weight.long())


def test_bad_trajectory_ids(case):
    with pytest.raises(ValueError, match=r"trajectory_ids has shape \(57,\)"):
        _score(case, trajectory_ids=case.trajectory_ids.reshape(-1))
    with pytest.raises(ValueError, match=r"trajectory_ids must be an integer tensor, got torch.float32"):
        _score(case, trajectory_ids=case.trajectory_ids.float())


def test_bad_lm_head_weight(case):
    with pytest.raises(ValueError, match=r"lm_head_weight must be \(V_local, H=8\).*got \(61, 7\)"):
        _score(case, source=case.hidden, lm_head_weight=case.weight[:, :7])
    with pytest.raises(ValueError, match=r"lm_head_weight must be \(V_local, H=8\).*got \(61, 8, 1\)"):
        _score(case, source=case.hidden, lm_head_weight=case.weight[..., None])


@pytest.mark.parametrize(
    "make_shard, match",
    [
        (lambda: VocabShard(0, 60), r"VocabShard\(start=0, end=60\) holds 60 vocabulary rows but the local vocabulary size is 61"),
        (lambda: VocabShard(0, 62), r"holds 62 vocabulary rows but the local vocabulary size is 61"),
        (lambda: VocabShard(10, 71), r"VocabShard\(start=10, end=71\) has no group, so it must hold the whole vocabulary"),
        (lambda: VocabShard(0, 61, None, 60), r"the global vocabulary size must be >= end"),
        (lambda: VocabShard(-1, 60), r"must satisfy 0 <= start < end"),
        (lambda: VocabShard(10, 10), r"must satisfy 0 <= start < end"),
        (lambda: VocabShard(0, 61.0), r"VocabShard.end must be an int, got 61.0"),
        (lambda: VocabShard(True, 61), r"VocabShard.start must be an int, got True"),
        (lambda: (0, 61), r"shard must be a nemo_replay.VocabShard.*got tuple"),
    ],
)
def test_bad_shard(case, make_shard, match):
    with pytest.raises(ValueError, match=match):
        _score(case, shard=make_shard())


@pytest.mark.parametrize("local_size", [None, 0, 2.0, True])
def test_from_group_needs_a_local_size(local_size):
    with pytest.raises(ValueError, match=r"local_size must be this rank's number of vocabulary rows"):
        VocabShard.from_group(None, local_size)


def test_even_shard_needs_a_divisible_vocabulary():
    assert VocabShard.even(61, None) == VocabShard(0, 61)
    assert VocabShard.whole(61).world_size == 1


@pytest.mark.parametrize("temperature", [0, 0.0, -1.0, float("nan"), float("inf"), "1.0", None])
def test_bad_temperature(case, temperature):
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0.*got"):
        _score(case, temperature=temperature)
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0"):
        score_full_vocabulary(case.logits, case.sampled_ids, temperature=temperature)


def test_bad_chunk_size(case):
    for bad in (0, -3, 2.5, True, "8", 2**31, 10**20):
        with pytest.raises(ValueError, match=rf"chunk_size must be an int in \[1, 2147483647\] \(pairs per chunk\), got {bad!r}"):
            _score(case, source=case.hidden, lm_head_weight=case.weight, chunk_size=bad)


def test_support_mass_needs_logits(case):
    with pytest.raises(ValueError, match=r"compute_support_mass needs full logits.*compute_support_mass=False"):
        _score(case, source=case.hidden, lm_head_weight=case.weight, compute_support_mass=True)


# ------------------------------------------------------------------ support argument


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda c: c.support.values.tolist(), r"support must be a PackedTensor.*RaggedSupport.*got list"),
        (lambda c: None, r"support must be a PackedTensor.*got NoneType"),
        (lambda c: c.support.values.reshape(-1), r"support rows must be \(rows, k\), got shape \(\d+,\)"),
        (lambda c: PackedTensor(c.support.values[..., None], c.support.cu_seqlens),
         r"fixed-width support values must be \(rows, k\), got \(\d+, 5, 1\)"),
        (lambda c: c.support.values.float(), r"support rows must be integer"),
        (lambda c: PackedTensor(c.support.values.float(), c.support.cu_seqlens), r"support rows must be integer"),
    ],
)
def test_bad_support_types(case, make, match):
    with pytest.raises(ValueError, match=match):
        _score(case, support=make(case))


def _edit_row(case, traj, fn):
    """Support values with the row at trajectory ``traj``'s first valid position edited by ``fn``."""
    t = _valid_positions(case, traj)[0]
    row = int(case.row_ids[traj, t])
    vals = case.support.values.clone()
    vals[row] = fn(vals[row].clone())
    return PackedTensor(vals, case.support.cu_seqlens), row


def test_support_invariants_are_validated(case):
    def too_big(r):
        r[-1] = 61 if r[-1] < 0 else r[-1]
        r[0] = 99
        return r

    sup, row = _edit_row(case, 2, lambda r: torch.cat([r[:1], r[:-1]]))  # duplicate of the first id
    with pytest.raises(ValueError, match=r"scorer support: trajectory 2, row \d+ holds a duplicate id"):
        _score(case, support=sup)
    sup, _ = _edit_row(case, 0, lambda r: torch.tensor([-1, 3, -1, -1, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"trajectory 0, row \d+ has a member after -1 padding"):
        _score(case, support=sup)
    sup, _ = _edit_row(case, 0, lambda r: torch.tensor([4, -2, -1, -1, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"holds an id below -1"):
        _score(case, support=sup)
    sup, _ = _edit_row(case, 1, too_big)
    with pytest.raises(ValueError, match=r"trajectory 1, row \d+ holds an id >= vocab_size=61"):
        _score(case, support=sup)
    ragged = RaggedSupport(torch.tensor([1, 2, 2]), torch.tensor([0, 3]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"trajectory 0, row 0 holds a duplicate id"):
        score_aligned_support(case.logits[0, :1], case.sampled_ids[0, :1].fill_(1), torch.zeros(1, dtype=torch.long),
                              torch.ones(1, dtype=torch.bool), ragged)


def test_validate_false_skips_the_invariant_pass(case):
    """An id >= vocab in a row that no loss-active position uses only fails when validating."""
    vals = case.support.values.clone()
    unused = [r for r, members in enumerate(case.sets) if not members and r not in case.row_ids[case.loss_mask]]
    vals[unused[0], 0] = 1000
    sup = PackedTensor(vals, case.support.cu_seqlens)
    with pytest.raises(ValueError, match=r"holds an id >= vocab_size=61"):
        _score(case, support=sup)
    torch.testing.assert_close(_score(case, support=sup, validate=False).logprobs, _score(case).logprobs)


# ------------------------------------------------------------------ alignment and EOS


def test_row_id_out_of_range_names_trajectory_and_position(case):
    t = _valid_positions(case, 2)[1]
    rows = case.row_ids.clone()
    rows[2, t] = case.support.num_rows
    with pytest.raises(ValueError, match=rf"trajectory 2, logit position {t}: row id {case.support.num_rows} outside \[-1, "):
        _score(case, row_ids=rows)
    rows[2, t] = -2
    with pytest.raises(ValueError, match=rf"trajectory 2, logit position {t}: row id -2 outside"):
        _score(case, row_ids=rows)


@pytest.mark.parametrize("form", ["packed", "ragged"])
def test_sampled_not_in_row_names_trajectory_and_position(case, form):
    t = _valid_positions(case, 1)[2]
    members = case.sets[int(case.row_ids[1, t])]
    outsider = next(v for v in range(61) if v not in members)
    sampled = case.sampled_ids.clone()
    sampled[1, t] = outsider
    support = case.support if form == "packed" else RaggedSupport.from_padded(case.support)
    with pytest.raises(ValueError, match=rf"trajectory 1, logit position {t}: sampled token {outsider} is not a member of its "
                                         rf"support row .*misaligned"):
        _score(case, sampled_ids=sampled, support=support)
    # The same token at a loss-inactive position is not scored, so it is not an error.
    lmask = case.loss_mask.clone()
    lmask[1, t] = False
    out = _score(case, sampled_ids=sampled, loss_mask=lmask, support=support)
    assert out.logprobs[1, t] == 0 and not out.scored_mask[1, t]


@pytest.mark.parametrize("form", ["packed", "ragged"])
def test_sampled_minus_one_does_not_match_row_padding(case, form):
    """A sampled id of -1 in a row padded with -1 is not a member (it scored the padding's fill, -3.4e38)."""
    t = next(t for t in _valid_positions(case, 1) if len(case.sets[int(case.row_ids[1, t])]) < 5)
    sampled = case.sampled_ids.clone()
    sampled[1, t] = -1
    support = case.support if form == "packed" else RaggedSupport.from_padded(case.support)
    with pytest.raises(ValueError, match=rf"trajectory 1, logit position {t}: sampled token -1 is not a member"):
        _score(case, sampled_ids=sampled, support=support)
    with pytest.raises(ValueError, match=rf"trajectory 1, logit position {t}: sampled token -1 is not a member"):
        _score(case, sampled_ids=sampled, support=support, source=case.hidden, lm_head_weight=case.weight)


def test_off_by_one_rows_are_caught(case):
    """Row ids shifted one position right (placed at token instead of logit positions)."""
    rows = torch.full_like(case.row_ids, -1)
    rows[:, 1:] = case.row_ids[:, :-1]
    with pytest.raises(ValueError, match=r"(trajectory \d+, logit position \d+: sampled token|trajectories \[[\d, ]+\] have)"):
        _score(case, row_ids=rows)


def test_two_rowless_positions_in_one_trajectory(case):
    rows = case.row_ids.clone()
    t = _valid_positions(case, 1)[-1]
    rows[1, t] = -1  # trajectory 1 already ends with a synthetic EOS
    with pytest.raises(ValueError, match=r"trajectories \[1\] have \[2\] loss-active positions without a support row"):
        _score(case, row_ids=rows)
    t0 = _valid_positions(case, 0)[-1]
    rows[0, t0] = -1
    rows[0, _valid_positions(case, 0)[0]] = -1
    with pytest.raises(ValueError, match=r"trajectories \[0, 1\] have \[2, 2\]"):
        _score(case, row_ids=rows)


def test_rowless_position_that_is_not_the_last(case):
    t = _valid_positions(case, 2)[0]
    rows = case.row_ids.clone()
    rows[2, t] = -1
    with pytest.raises(ValueError, match=rf"trajectory 2, logit position {t}: loss-active with no support row but not the "
                                         rf"trajectory's last loss-active token"):
        _score(case, row_ids=rows)


def test_loss_active_padding(case):
    lmask = case.loss_mask.clone()
    pad = int(torch.nonzero(case.trajectory_ids[1] < 0)[0])
    lmask[1, pad] = True
    with pytest.raises(ValueError, match=rf"position {pad} is loss-active but belongs to no trajectory \(trajectory id "
                                         rf"-1, padding\)"):
        _score(case, loss_mask=lmask, trajectory_ids=case.trajectory_ids)


def test_eos_sampled_id_outside_vocab(case):
    t = int(torch.nonzero(case.loss_mask[1])[-1])
    sampled = case.sampled_ids.clone()
    sampled[1, t] = 61
    with pytest.raises(ValueError, match=rf"trajectory 1, logit position {t}: sampled id 61 outside the vocabulary \[0, 61\)"):
        _score(case, sampled_ids=sampled)


def test_full_vocabulary_shape_errors(case):
    with pytest.raises(ValueError, match=r"sampled_ids has shape \(3, 18\)"):
        score_full_vocabulary(case.logits, case.sampled_ids[:, 1:])
    with pytest.raises(ValueError, match=r"loss_mask has shape \(3,\)"):
        score_full_vocabulary(case.logits, case.sampled_ids, loss_mask=case.loss_mask[:, 0])


# ------------------------------------------------------------------ required arguments and error classes


@pytest.mark.parametrize("name", ["source", "sampled_ids", "row_ids", "loss_mask", "support"])
def test_every_required_argument_refuses_none(case, name):
    """None for a required argument is a ValueError naming it (loss_mask=None was an AttributeError)."""
    with pytest.raises(ValueError, match=rf"{name if name != 'support' else 'support must be'}.*(None|NoneType)"):
        _score(case, **{name: None})


def test_full_vocabulary_required_arguments(case):
    with pytest.raises(ValueError, match=r"sampled_ids is required.*got None"):
        score_full_vocabulary(case.logits, None)
    with pytest.raises(ValueError, match=r"lm_head_weight must be a floating-point tensor"):
        score_full_vocabulary(case.hidden, case.sampled_ids, lm_head_weight=case.weight.long())


@pytest.mark.parametrize("sampled", [-1, 61])
def test_full_vocabulary_sampled_id_outside_vocab(case, sampled):
    ids = case.sampled_ids.clone()
    ids[2, 4] = sampled
    with pytest.raises(ValueError, match=rf"trajectory 2, logit position 4: sampled id {sampled} outside the vocabulary \[0, 61\)"):
        score_full_vocabulary(case.logits, ids)


def test_alignment_failures_are_support_alignment_errors(case):
    """A misaligned batch raises SupportAlignmentError (a ValueError); a bad argument does not."""
    from nemo_replay import SupportAlignmentError

    t = _valid_positions(case, 1)[2]
    sampled = case.sampled_ids.clone()
    sampled[1, t] = next(v for v in range(61) if v not in case.sets[int(case.row_ids[1, t])])
    with pytest.raises(SupportAlignmentError, match=rf"trajectory 1, logit position {t}: sampled token"):
        _score(case, sampled_ids=sampled)
    rows = case.row_ids.clone()
    rows[2, _valid_positions(case, 2)[0]] = -1
    with pytest.raises(SupportAlignmentError, match=r"trajectory 2, logit position \d+: loss-active with no support row"):
        _score(case, row_ids=rows)
    rows = case.row_ids.clone()
    rows[1, _valid_positions(case, 1)[-1]] = -1
    with pytest.raises(SupportAlignmentError, match=r"trajectories \[1\] have \[2\] loss-active positions"):
        _score(case, row_ids=rows)
    assert issubclass(SupportAlignmentError, ValueError)
    for bad in (dict(temperature=0), dict(row_ids=case.row_ids.float())):
        with pytest.raises(ValueError) as info:
            _score(case, **bad)
        assert not isinstance(info.value, SupportAlignmentError)


def test_whole_sequence_synthetic_eos_check_costs_one_host_read(case):
    """Strategies run the synthetic-EOS rule on every micro-batch before slicing it (SP, CP, NeMo-RL):
    a batch that keeps the rule costs one host read, a batch that breaks it is still named."""
    from benchmarks.syncs import HostReads
    from nemo_replay.layout.checks import check_synthetic_eos, has_support_row

    lmask, traj = case.loss_mask.reshape(-1), case.trajectory_ids.reshape(-1)

    def check(rows):
        fallback = lmask & ~has_support_row(case.support, rows.reshape(-1))
        check_synthetic_eos(fallback, lmask, traj, case.loss_mask.shape)

    with HostReads() as reads:
        check(case.row_ids)  # trajectory 1 ends with a synthetic EOS
    assert reads.total == 1, dict(reads.where)
    rows = case.row_ids.clone()
    t = _valid_positions(case, 2)[0]
    rows[2, t] = -1
    with pytest.raises(ValueError, match=rf"trajectory 2, logit position {t}: loss-active with no support row but not"):
        check(rows)
    rows = case.row_ids.clone()
    rows[1, _valid_positions(case, 1)[-1]] = -1
    with pytest.raises(ValueError, match=r"trajectories \[1\] have \[2\] loss-active positions without a support row"):
        check(rows)


# ------------------------------------------------------------------ ids past the vocabulary in hidden mode


def _with_id(case, traj: int, new_id: int) -> tuple[PackedTensor, int]:
    """The support with ``new_id`` written into a free slot of trajectory ``traj``'s first scored row
    (its first padding, or its first member other than the sampled token), and that row."""
    t = _valid_positions(case, traj)[0]
    row = int(case.row_ids[traj, t])
    vals = case.support.values.clone()
    free = [j for j, v in enumerate(vals[row].tolist()) if v < 0 or v != int(case.sampled_ids[traj, t])]
    vals[row, free[0]] = new_id
    return PackedTensor(vals, case.support.cu_seqlens), row


def _forged_vocab(rows: RaggedSupport, coded: int, claimed: int):
    """Rows coded for ``coded`` ids, their header saying ``claimed`` with the CRC recomputed (a writer's
    bug, not a transit error): a decode whose flag is set, its ids past ``claimed`` as they come."""
    import struct

    import numpy as np

    from nemo_replay.support import codec
    from nemo_replay.support.codec import header

    buf = codec.encode_support(rows, vocab_size=coded).copy()
    buf[8:12] = np.frombuffer(struct.pack("<I", claimed), np.uint8)  # V u32, after the magic and four u8 fields
    buf[header.CRC_AT:header.CRC_AT + 4] = 0
    buf[header.CRC_AT:header.CRC_AT + 4] = np.frombuffer(struct.pack("<I", header.crc(buf)), np.uint8)
    return codec.CompactRows([buf])


def _error(fn):
    with pytest.raises(ValueError) as info:
        fn()
    return type(info.value), str(info.value)


def _bad_supports(case):
    """(name, support, validate, the case's channels) with an id at or past V = 61 in a scored row."""
    from nemo_replay.support.codec import CompactRows, encode_support

    fixed, _ = _with_id(case, 1, 70)
    at_v, _ = _with_id(case, 2, 61)
    larger_v = CompactRows([encode_support(RaggedSupport.from_padded(fixed), vocab_size=80)])
    yield "fixed rows, validate=True", fixed, True
    yield "fixed rows, validate=False", fixed, False
    yield "fixed rows holding V, validate=False", at_v, False
    yield "ragged rows", RaggedSupport.from_padded(fixed), True
    yield "compact rows coded for V = 80", larger_v, True


def test_ids_past_the_vocabulary_in_hidden_mode_with_gradients_are_logits_mode_s_named_error(case):
    """Hidden mode with a trainable LM head counts the weight gradient's runs before the guards' read:
    an id >= V there once indexed past its histogram (a raw RuntimeError on CPU, a device write past
    the tensor on CUDA). Every such input now ends in the very error logits mode names."""
    for name, support, validate in _bad_supports(case):
        want = _error(lambda: _score(case, support=support, validate=validate))
        h, w = case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_()
        got = _error(lambda: _score(case, source=h, lm_head_weight=w, support=support, validate=validate))
        assert got == want, name
        assert "61" in want[1] and ("trajectory" in want[1] or "row" in want[1]), (name, want)


def test_a_flagged_decode_past_the_vocabulary_in_hidden_mode_is_the_decode_s_named_error():
    """Rows {0, 17} coded for V = 18 under a header saying V = 15 (CRC recomputed): the decode flags id 17
    and hands it on; the weight gradient's sizes are counted before that flag is read."""
    from nemo_replay.support.codec import CodecError

    rows = RaggedSupport.from_rows([[[0, 17], [3]]])
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(1, 2, 4, generator=g), torch.randn(15, 4, generator=g)
    args = (torch.tensor([[0, 3]]), torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.bool))
    want = _error(lambda: score_aligned_support(hidden @ weight.T, *args, _forged_vocab(rows, 18, 15)))
    assert want[0] is CodecError and "row 0 decodes id 17, past the 15 ids" in want[1], want
    got = _error(lambda: score_aligned_support(hidden.requires_grad_(), *args, _forged_vocab(rows, 18, 15),
                                               lm_head_weight=weight.requires_grad_()))
    assert got == want
