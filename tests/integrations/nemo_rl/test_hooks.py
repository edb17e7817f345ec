"""Replay inside NeMo-RL: its hooks on batches built with its conventions, on real gloo groups.

One spawn of four gloo ranks (tensor-parallel rank fastest: ``rank = 2 * cp_rank + tp_rank``,
Megatron's order) runs every multi-process check, each layout as NeMo-RL builds it
(tests/integrations/nemo_rl/batches.py cites the NeMo-RL file and line of each convention):

- TP=2, unpacked rows (the Megatron worker without packing: CP needs packing there);
- CP=2 and TP=2 x CP=2, packed sequences, ``replay_prepare_fn`` called once per sequence
  with its CP-local logits the way ``SequencePackingLossWrapper`` calls it;
- the sampler's log-probs reproduced within 1e-5 (float32 logits), and the policy
  gradient of a ClippedPG-style loss through ``replay_prepare_fn`` (float64) against a
  single-process float64 autograd reference, including NeMo-RL's CP loss normalisation;
- the reference pass (``ReplayLogprobsPostProcessor``) on another model's logits: the same
  support, or the full vocabulary inside ``reference_pass(full_vocab=True)``;
- the DTensor (automodel v2) post-processors on TP=2 DTensor logits, unpacked and packed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nemo_replay.support.rows import SampleRows
from tests.integrations.nemo_rl.batches import (
    TEMPERATURE,
    VOCAB,
    WIDTH,
    ClippedPGStyleLoss,
    LossInputType,
    cp_chunks,
    encode_rows,
    make_batch,
    make_logits,
    packed_layout,
    packed_local_logits,
    per_sequence_data,
    reference_next_token_logprobs,
    vocab_shard,
    with_loss_inputs,
)
from tests.spawn import run_workers

# ---------------------------------------------------------------------------- the workers


def _groups(rank):
    """Every rank creates every group in one order (new_group is collective)."""
    import torch.distributed as dist

    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    alone = [dist.new_group([r]) for r in range(4)]
    return dict(tp=tp[rank // 2], cp=cp[rank % 2], alone=alone[rank], tp_rank=rank % 2, cp_rank=rank // 2)


def _configs(g):
    """name -> (tp group, tp size, tp rank, cp group, cp size, cp rank, packed, pad factor)."""
    return {
        "tp2": (g["tp"], 2, g["tp_rank"], g["alone"], 1, 0, False, 1),
        "cp2": (g["alone"], 1, 0, g["cp"], 2, g["cp_rank"], True, 4),  # pad factor 2 cp (data.py:1286-1287)
        "tp2cp2": (g["tp"], 2, g["tp_rank"], g["cp"], 2, g["cp_rank"], True, 8),  # 2 cp x tp under SP (1288-1289)
    }


def _local(scaled, lengths, cfg):
    """This rank's logits of the micro-batch: unpacked ``[B, W, V/tp]`` or packed ``[1, T/cp, V/tp]``, and cu."""
    _, tp, tr, _, cp, cr, packed, pad = cfg
    shard = vocab_shard(scaled, tp, tr)
    if not packed:
        return shard, None
    cu = packed_layout(lengths, pad)
    return packed_local_logits(shard, lengths, cu, cp, cr), cu


def _policy_logprobs(local, data, cfg, cu, loss_fn):
    """next_token_logprobs [B, W-1] through replay_prepare_fn, as NeMo-RL calls it; and the wrapped loss."""
    from nemo_replay.integrations.nemo_rl import replay_prepare_fn

    tg, _, tr, cg, cp, _, packed, _ = cfg
    B, W = data["input_ids"].shape
    hooks = dict(loss_fn=loss_fn, vocab_parallel_rank=tr, vocab_parallel_group=tg, context_parallel_group=cg)
    gvt = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    if not packed:
        loss_input, _ = replay_prepare_fn(logits=local, data=data, **hooks)
        lp = loss_input["next_token_logprobs"]
        loss, _ = loss_fn(data=data, global_valid_seqs=None, global_valid_toks=gvt, **loss_input)
        return lp, loss / cp
    out = torch.zeros(B, W - 1, dtype=local.dtype)
    total = 0.0
    for i in range(B):  # SequencePackingLossWrapper (wrapper.py:86-144)
        P = cu[i + 1] - cu[i]
        logits_i = local.narrow(1, cu[i] // cp, P // cp)
        data_i = per_sequence_data(data, i, P)
        loss_input, _ = replay_prepare_fn(logits=logits_i, data=data_i, **hooks)
        lp_i = loss_input["next_token_logprobs"]
        assert lp_i.shape == (1, data_i["input_ids"].shape[1] - 1)
        out = out.index_put((torch.tensor([i]), torch.arange(lp_i.shape[1])), lp_i[0])
        loss_i, _ = loss_fn(data=data_i, global_valid_seqs=None, global_valid_toks=gvt, **loss_input)
        total = total + loss_i
    return out, total / cp  # LossPostProcessor's cp_normalize (train.py:574-582)


def _phase_policy(out, g, data, raw32, rows):
    from nemo_replay.integrations.nemo_rl import next_token_logprobs

    lengths = data["input_lengths"].tolist()
    data64 = with_loss_inputs(data, raw32 / TEMPERATURE, rows)
    # The same rows captured at a fixed width (SampleRows.encode(width=k)): decoded as wide.
    wide64 = {**data64, "generation_support": encode_rows(rows, data["input_ids"], data["input_lengths"], width=WIDTH)}
    scaled64 = (raw32.double() / TEMPERATURE).requires_grad_()
    ref = reference_next_token_logprobs(scaled64, data64, rows)
    gvt = (data64["token_mask"][:, 1:] * data64["sample_mask"][:, None]).sum()
    ref_loss, _ = ClippedPGStyleLoss()(data=data64, global_valid_seqs=None, global_valid_toks=gvt, next_token_logprobs=ref)
    ref_loss.backward()
    out["reference_logprobs"] = ref.detach()
    for name, cfg in _configs(g).items():
        # Values in float32, as the worker holds them after the in-place temperature division.
        local32, cu = _local(raw32 / TEMPERATURE, lengths, cfg)
        with torch.no_grad():
            lp32, _ = _policy_logprobs(local32, data64, cfg, cu, ClippedPGStyleLoss())
            # The whole micro-batch in one call (the log-prob post-processor's form): its masks.
            tg, _, tr, cg, _, _, _, _ = cfg
            whole = next_token_logprobs(
                local32, data64, vocab_parallel_rank=tr, vocab_parallel_group=tg, context_parallel_group=cg,
                cu_seqlens_padded=None if cu is None else torch.tensor(cu),
            )
            # The ragged rows the vLLM worker ships, against the same rows captured at a fixed width (decoded
            # as wide), through the same hooks.
            ragged, wide = (next_token_logprobs(
                local32, d, vocab_parallel_rank=tr, vocab_parallel_group=tg, context_parallel_group=cg,
                cu_seqlens_padded=None if cu is None else torch.tensor(cu),
            ) for d in (data64, wide64))
            lp_wide, _ = _policy_logprobs(local32, wide64, cfg, cu, ClippedPGStyleLoss())
        # Gradients in float64 through the same hooks.
        local64, _ = _local(scaled64.detach(), lengths, cfg)
        local64.requires_grad_()
        lp64, loss = _policy_logprobs(local64, data64, cfg, cu, ClippedPGStyleLoss())
        loss.backward()
        want_grad, _ = _local(scaled64.grad, lengths, cfg)
        out[name] = dict(
            logprobs32=lp32.detach(), logprobs64=lp64.detach(), loss=float(loss.detach()) * cfg[4],
            grad=local64.grad, want_grad=want_grad, ref_loss=float(ref_loss.detach()),
            whole=(whole.logprobs, whole.valid_mask, whole.fallback_mask),
            ragged=(ragged.logprobs, ragged.valid_mask, ragged.fallback_mask),
            wide=(wide.logprobs, wide.valid_mask, wide.fallback_mask), logprobs_wide=lp_wide,
        )


def _phase_reference(out, g, data, rows):
    from nemo_replay.integrations.nemo_rl import ReplayLogprobsPostProcessor, reference_pass

    lengths = data["input_lengths"].tolist()
    ref_scaled = make_logits(*data["input_ids"].shape, seed=11, dtype=torch.float32) / TEMPERATURE  # other weights
    for name in ("tp2", "tp2cp2"):
        cfg = _configs(g)[name]
        tg, _, tr, cg, _, _, packed, _ = cfg
        local, cu = _local(ref_scaled, lengths, cfg)
        policy_cfg = {"sequence_packing": {"enabled": packed}, "megatron_cfg": {"use_fused_linear_logprobs": False}}
        results = {}
        for full in (False, True):
            with reference_pass(full_vocab=full):
                post = ReplayLogprobsPostProcessor(policy_cfg, None, False, tp_group=tg, tp_rank=tr, cp_group=cg)
            fn = post(data, data["input_ids"], None if cu is None else torch.tensor(cu, dtype=torch.int32))
            with torch.no_grad():
                zero, lp = fn(local)
            results[full] = lp["logprobs"]
            assert float(zero) == 0.0
        out[f"reference_{name}"] = results
    out["reference_want"] = {
        full: reference_next_token_logprobs(ref_scaled.double(), data, rows, full_vocab=full) for full in (False, True)
    }


def _phase_dtensor(out, rank, data, raw32, rows):
    """automodel v2: TP=2 DTensor logits (Shard(-1) over a 'tp' mesh dimension), unpacked and packed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from nemo_replay.integrations.nemo_rl import ReplayAutomodelLogprobsPostProcessor, ReplayAutomodelLossPostProcessor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    tr = rank % 2
    scaled = raw32 / TEMPERATURE
    B, W = data["input_ids"].shape
    unpacked = DTensor.from_local(vocab_shard(scaled, 2, tr).contiguous(), mesh, [Shard(-1)], run_check=False)
    post = ReplayAutomodelLogprobsPostProcessor({}, cp_size=1, enable_seq_packing=False)
    with torch.no_grad():
        out["dtensor_unpacked"] = post(unpacked, data, SimpleNamespace(), B, W)
    # Packed: sequences back to back, the row padded at the end to min_seq_len
    # (huggingface/common.py:199-215, 118-127); cu_seqlens from the real lengths (286).
    lengths = data["input_lengths"].tolist()
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lengths), 0).tolist(), dtype=torch.int32)
    data64 = with_loss_inputs(data, scaled, rows)
    scaled64 = (raw32.double() / TEMPERATURE).requires_grad_()
    row = torch.cat([scaled64[i, :L] for i, L in enumerate(lengths)] + [torch.zeros(5, scaled.shape[-1], dtype=torch.float64)])
    leaf = vocab_shard(row[None].detach(), 2, tr).contiguous().requires_grad_()
    packed = DTensor.from_local(leaf, mesh, [Shard(-1)], run_check=False)
    inputs = SimpleNamespace(flash_attn_kwargs=SimpleNamespace(cu_seqlens_q=cu))
    gvt = (data64["token_mask"][:, 1:] * data64["sample_mask"][:, None]).sum()
    loss_post = ReplayAutomodelLossPostProcessor(ClippedPGStyleLoss(), {}, cp_size=1, enable_seq_packing=True)
    loss, _ = loss_post(packed, data64, inputs, torch.tensor(float(B)), gvt)
    loss.backward()
    ref = reference_next_token_logprobs(scaled64, data64, rows)
    ref_loss, _ = ClippedPGStyleLoss()(data=data64, global_valid_seqs=None, global_valid_toks=gvt, next_token_logprobs=ref)
    ref_loss.backward()
    want = torch.cat([scaled64.grad[i, :L] for i, L in enumerate(lengths)] + [torch.zeros(5, scaled.shape[-1], dtype=torch.float64)])
    out["dtensor_packed"] = dict(loss=float(loss.detach()), ref_loss=float(ref_loss.detach()), grad=leaf.grad,
                                 want=vocab_shard(want[None], 2, tr))
    logprob_post = ReplayAutomodelLogprobsPostProcessor({}, cp_size=1, enable_seq_packing=True)
    with torch.no_grad():
        out["dtensor_packed_logprobs"] = logprob_post(packed.detach(), data, inputs, B, W)


def _phase_shards(out, g, raw32):
    """The vocabulary shards the hooks build for Megatron and DTensor logits, global size included."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from nemo_replay.integrations.nemo_rl.scoring import vocab_shard_of

    tr = g["tp_rank"]
    local = vocab_shard(raw32, 2, tr).contiguous()
    _, megatron = vocab_shard_of(local, tr, g["tp"])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    _, dtensor = vocab_shard_of(DTensor.from_local(local, mesh, [Shard(-1)], run_check=False), None, None)
    out["shards"] = [(s.start, s.end, s.vocab_size) for s in (megatron, dtensor)]


def _phase_one_cp_rank_fails(out, g, data, raw32, rows):
    """validate=False and an id >= V in a row only one CP rank scores: the memory-safety guard fires on
    that rank alone, and every rank of the CP group raises its error (else the other waits in the gather)."""
    from nemo_replay.integrations.nemo_rl import next_token_logprobs

    rows = rows.clone()
    active = _active_with_row(data, rows)
    i, c = (int(v) for v in torch.nonzero(active)[0])  # next-token column c scores input_ids column c + 1
    token = int(data["input_ids"][i, c + 1])
    slot = next(j for j, t in enumerate(rows[i, c + 1].tolist()) if t != token)
    rows[i, c + 1, slot] = VOCAB + 36
    bad = {**data, "generation_support": encode_rows(rows, data["input_ids"], data["input_lengths"])}
    cfg = _configs(g)["cp2"]
    local, cu = _local(raw32 / TEMPERATURE, data["input_lengths"].tolist(), cfg)
    try:
        next_token_logprobs(local, bad, context_parallel_group=cfg[3], cu_seqlens_padded=torch.tensor(cu), validate=False)
        out["one_cp_rank_fails"] = dict(error=None, row=i, column=c + 1)
    except ValueError as exc:
        out["one_cp_rank_fails"] = dict(error=str(exc), row=i, column=c + 1)


def _worker(rank, world_size):
    g = _groups(rank)
    data, raw32, sampler, rows = make_batch(seed=0)
    out = {"data": data, "sampler": sampler, "rows": rows}
    _phase_one_cp_rank_fails(out, g, data, raw32, rows)
    _phase_policy(out, g, data, raw32, rows)
    _phase_reference(out, g, data, rows)
    _phase_dtensor(out, rank, data, raw32, rows)
    _phase_shards(out, g, raw32)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_workers(_worker, 4)


# ---------------------------------------------------------------------------- assertions


def _active_with_row(data, rows):
    """(B, W - 1) bool: next tokens that are loss-active and carry a recorded row (``rows``: the dense
    (B, W, k) rows of :func:`~tests.integrations.nemo_rl.batches.make_batch`)."""
    nxt = (data["token_mask"][:, 1:] != 0) & (data["sample_mask"][:, None] != 0)
    return nxt & (rows[:, 1:, 0] >= 0)


def test_a_check_one_cp_rank_fails_raises_the_same_error_on_every_rank(ranks):
    for group in ([0, 2], [1, 3]):  # the CP groups (rank = 2 * cp_rank + tp_rank)
        got = [ranks[r]["one_cp_rank_fails"] for r in group]
        assert got[0]["error"] is not None and got[0]["error"] == got[1]["error"]
        assert re.match(rf"CP rank [01] of 2: trajectory {got[0]['row']}, token position {got[0]['column']}: its support "
                        rf"row \d+ holds id 100, outside \[-1, 64\)", got[0]["error"]), got[0]["error"]


@pytest.mark.parametrize("config", ["tp2", "cp2", "tp2cp2"])
def test_prepare_fn_reproduces_the_sampler_within_1e5(ranks, config):
    for r in ranks:
        data, got = r["data"], r[config]["logprobs32"]
        rows = _active_with_row(data, r["rows"])
        sampler = r["sampler"][:, 1:]
        assert rows.sum() > 10
        err = (got[rows].double() - sampler[rows].double()).abs().max()
        assert err < 1e-5, f"{config}: max |replay - sampler| = {float(err):.2e}"
        # Everything else is 0, and the synthetic EOS of trajectory 0 (no row) is scored.
        eos = (data["token_mask"][:, 1:] != 0) & (data["sample_mask"][:, None] != 0) & ~rows
        assert eos.sum() == 1 and bool(eos[0].any())
        torch.testing.assert_close(got[eos].double(), r["reference_logprobs"][eos], atol=1e-5, rtol=0)
        scored = rows | eos
        assert (got[~scored] == 0).all()
        # One call over the whole micro-batch: the same log-probs, rows valid, the EOS the one fallback.
        lp, valid, fallback = r[config]["whole"]
        torch.testing.assert_close(lp, got, atol=1e-6, rtol=0)
        assert torch.equal(valid, rows) and torch.equal(fallback, eos)
        # Ragged rows (the vLLM worker's SampleRows) score bit for bit as the same rows captured at a fixed
        # width and decoded as wide, whole and per sequence.
        for a, b in zip(r[config]["ragged"], r[config]["wide"]):
            assert torch.equal(a, b)
        torch.testing.assert_close(r[config]["ragged"][0], lp, atol=0, rtol=0)
        assert torch.equal(r[config]["logprobs_wide"], got)


@pytest.mark.parametrize("config", ["tp2", "cp2", "tp2cp2"])
def test_prepare_fn_gradient_matches_the_float64_reference(ranks, config):
    for r in ranks:
        c = r[config]
        torch.testing.assert_close(c["logprobs64"], r["reference_logprobs"], atol=1e-12, rtol=0)
        assert c["loss"] == pytest.approx(c["ref_loss"], abs=1e-12)
        assert c["want_grad"].abs().max() > 1e-3
        torch.testing.assert_close(c["grad"], c["want_grad"], atol=1e-12, rtol=0)


@pytest.mark.parametrize("config", ["tp2", "tp2cp2"])
def test_the_reference_pass_scores_the_same_support_or_the_full_vocabulary(ranks, config):
    for r in ranks:
        got, want = r[f"reference_{config}"], r["reference_want"]
        data = r["data"]
        scored = (data["token_mask"][:, 1:] != 0) & (data["sample_mask"][:, None] != 0)
        for full in (False, True):
            lp = got[full]
            assert lp.shape == data["input_ids"].shape and (lp[:, 0] == 0).all()  # token-aligned, 0 first
            torch.testing.assert_close(lp[:, 1:].double(), want[full], atol=1e-5, rtol=0)
        # Over the support, the reference scores only the positions the policy scores (a one-member
        # row scores exactly 0, so nonzero is a subset).
        assert not (got[False][:, 1:] != 0)[~scored].any() and (got[False][:, 1:] != 0).sum() > 10
        assert (got[True][:, 1:] - got[False][:, 1:]).abs().max() > 1e-2  # the support normalisation matters


def test_the_hooks_shards_know_the_global_vocabulary(ranks):
    """Megatron's even split and DTensor's Shard(-1) both give V: the scorer checks ids before its
    collectives rather than learning V from them (a deferred check and one more host read per call)."""
    half = VOCAB // 2
    for rank, r in enumerate(ranks):
        tr = rank % 2
        assert r["shards"] == [(tr * half, (tr + 1) * half, VOCAB)] * 2


def test_dtensor_post_processors(ranks):
    for r in ranks:
        data = r["data"]
        want = r["reference_logprobs"]
        for key in ("dtensor_unpacked", "dtensor_packed_logprobs"):
            lp = r[key]
            assert (lp[:, 0] == 0).all()
            torch.testing.assert_close(lp[:, 1:].double(), want, atol=1e-5, rtol=0)
        p = r["dtensor_packed"]
        assert p["loss"] == pytest.approx(p["ref_loss"], abs=1e-12)
        torch.testing.assert_close(p["grad"], p["want"], atol=1e-12, rtol=0)
        assert p["want"].abs().max() > 1e-3
        assert data["input_ids"].shape[0] == 4


# ---------------------------------------------------------------------------- single process


def _prepare(data, logits=None, **kw):
    from nemo_replay.integrations.nemo_rl import replay_prepare_fn

    if logits is None:
        logits = make_logits(*data["input_ids"].shape, seed=0, dtype=torch.float32) / TEMPERATURE
    return replay_prepare_fn(logits=logits, data=data, loss_fn=ClippedPGStyleLoss(), **kw)


def test_misaligned_and_malformed_batches_are_refused_naming_the_fix():
    from nemo_replay.support.errors import SupportAlignmentError

    data, raw, _, rows = make_batch(seed=0)
    ids, lengths = data["input_ids"], data["input_lengths"]
    logits = raw / TEMPERATURE
    lp, same = _prepare(data, logits)
    assert same is data and lp["next_token_logprobs"].shape == (4, data["input_ids"].shape[1] - 1)
    # Rows one column late (aligned like next_token_logprobs instead of like the tokens).
    late = dict(data, generation_support=encode_rows(rows, ids, lengths, shift=1))
    with pytest.raises(SupportAlignmentError, match=r"trajectory 0, token position \d+: token \d+ is not a member of "
                                                    r"its support row .*generation_support must be sliced like "
                                                    r"generation_logprobs"):
        _prepare(late, logits)
    # A sampled id of -1 is not a member of a row padded with -1 (rows captured at a fixed width decode
    # -1 padded to it): a row shorter than k, its token replaced by -1.
    col = int(torch.nonzero((rows[0, :, 0] >= 0) & (rows[0, :, -1] < 0) & (data["token_mask"][0] > 0))[0])
    pad = dict(data, input_ids=ids.clone(), generation_support=encode_rows(rows, ids, lengths, width=WIDTH))
    pad["input_ids"][0, col] = -1
    with pytest.raises(SupportAlignmentError, match=rf"trajectory 0, token position {col}: token -1 "):
        _prepare(pad, logits)
    # A second loss-active token without a row in trajectory 1 breaks the synthetic-EOS rule.
    two = rows.clone()
    cols = torch.nonzero(rows[1, :, 0] >= 0).flatten()
    two[1, cols[:2]] = -1
    with pytest.raises(ValueError, match=r"trajectories \[1\] have \[2\] loss-active positions without a support row"):
        _prepare(dict(data, generation_support=encode_rows(two, ids, lengths)), logits)
    cases = [
        (dict(generation_support=None), r"no 'generation_support' \(support rows: one SampleRows a sample\); replay "
                                        r"needs it .*launch with python -m nemo_replay.integrations.nemo_rl.run_grpo"),
        (dict(input_lengths=None), r"no 'input_lengths' \(tokens per row \[B\]\)"),
        # The dense token-aligned (B, S, k) rows are retired: a tensor where SampleRows are expected.
        (dict(generation_support=rows), r"data\['generation_support'\] must be a list of 4 SampleRows, one a data row "
                                        r".*got Tensor"),
        (dict(input_lengths=data["input_lengths"] + 40), r"data row 0 has input_lengths \d+, outside \[1, \d+\]"),
        (dict(token_mask=data["token_mask"][:2]), r"data dict shapes disagree"),
    ]
    for change, match in cases:
        bad = {k: v for k, v in {**data, **change}.items() if v is not None}
        with pytest.raises(ValueError, match=match):
            _prepare(bad, logits)
    # A list of one SampleRows a data row, each with its own sample's rows.
    entries = data["generation_support"]
    flipped = SampleRows((entries[1].buffers[0].copy(),), entries[1].runs, entries[1].length)
    flipped.buffers[0][-1] ^= 1
    past = SampleRows(entries[0].buffers, np.concatenate([entries[0].runs, [[40, 0, 1]]]).astype(np.int32),
                      entries[0].length)
    compact_cases = [
        (entries[:3], r"data\['generation_support'\] must be a list of 4 SampleRows, one a data row .* got a list of 3"),
        ([entries[0], None, *entries[2:]], r"data\['generation_support'\]\[1\] \(data row 1\) is a NoneType, "
                                           r"expected SampleRows"),
        ([past, *entries[1:]], r"\[0\] \(data row 0\): row columns .* must increase and lie below the sample's \d+ "
                               r"token columns"),
        ([SampleRows(entries[0].buffers, entries[0].runs[:, :1], entries[0].length), *entries[1:]],
         r"\[0\] \(data row 0\): runs of dtype int32, shape \(\d+, 1\); expected \(n, 3\) integer"),
        ([entries[0], flipped, *entries[2:]], r"\[1\] \(data row 1\): compact support: the buffer's CRC-32 does not match"),
        ([entries[1], entries[0], *entries[2:]], r"\[0\] \(data row 0\): row columns .* the rows belong to another sample"),
    ]
    for given, match in compact_cases:
        with pytest.raises(ValueError, match=match):
            _prepare({**data, "generation_support": given}, logits)
    with pytest.raises(ValueError, match=r"logits hold 3 rows for 4 data rows"):
        _prepare(data, logits[:3])
    loss = ClippedPGStyleLoss()
    loss.input_type = LossInputType.LOGIT
    from nemo_replay.integrations.nemo_rl import replay_prepare_fn

    with pytest.raises(ValueError, match=r"serves LossInputType.LOGPROB losses .* keep NeMo-RL's prepare_loss_input"):
        replay_prepare_fn(logits=logits, data=data, loss_fn=loss)


def test_packed_and_parallel_arguments_are_checked():
    from nemo_replay.integrations.nemo_rl import next_token_logprobs

    data, raw, _, _ = make_batch(seed=0)
    lengths = data["input_lengths"].tolist()
    cu = packed_layout(lengths, 1)
    local = packed_local_logits(raw / TEMPERATURE, lengths, cu, 1, 0)
    got = next_token_logprobs(local, data, cu_seqlens_padded=cu)
    want = next_token_logprobs(raw / TEMPERATURE, data)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=0, rtol=0)
    assert torch.equal(got.valid_mask, want.valid_mask) and got.fallback_mask.sum() == 1
    with pytest.raises(ValueError, match=r"packed logits must be \[1, cu_seqlens_padded\[-1\] / cp"):
        next_token_logprobs(local[:, :-1], data, cu_seqlens_padded=cu)
    with pytest.raises(ValueError, match=r"cu_seqlens_padded must be \(5,\) non-decreasing offsets from 0"):
        next_token_logprobs(local, data, cu_seqlens_padded=cu[:-1])
    short = packed_layout([L - 2 for L in lengths], 1)
    with pytest.raises(ValueError, match=r"data row 0 has \d+ tokens but its logits cover \d+ positions"):
        next_token_logprobs(packed_local_logits(raw / TEMPERATURE, [L - 2 for L in lengths], short, 1, 0), data,
                            cu_seqlens_padded=short)
    from nemo_replay.integrations.nemo_rl.token_aligned import local_slots

    assert local_slots([8], 2, 0, packed=True).position.tolist() == [0, 1, 6, 7]
    assert torch.equal(cp_chunks(torch.arange(8), 2, 1, 0), local_slots([8], 2, 1, packed=True).position)
    with pytest.raises(ValueError, match=r"a padded sequence of 6 tokens \(sequence 1\) cannot be cut into 2 \* cp = 4 "
                                         r"chunks; NeMo-RL pads each sequence to a multiple of 2 \* cp"):
        local_slots([8, 6], 2, 0, packed=True)


def test_post_processors_refuse_the_paths_that_skip_replay():
    from nemo_replay.integrations.nemo_rl import (
        ReplayAutomodelLogprobsPostProcessor,
        ReplayLogprobsPostProcessor,
        ReplayLossPostProcessor,
    )

    with pytest.raises(ValueError, match=r"use_fused_linear_logprobs=false"):
        ReplayLogprobsPostProcessor({"sequence_packing": {"enabled": False}}, None, True)
    with pytest.raises(ValueError, match=r"context_parallel_size=1 or use the Megatron backend"):
        ReplayAutomodelLogprobsPostProcessor({}, cp_size=2)
    with pytest.raises(ValueError, match=r"nemo_rl is not importable here; outside NeMo-RL call replay_prepare_fn"):
        ReplayLossPostProcessor(ClippedPGStyleLoss(), {})
    post = ReplayLogprobsPostProcessor({"sequence_packing": {"enabled": True}})
    with pytest.raises(ValueError, match=r"sequence_packing.enabled is true but no cu_seqlens_padded came"):
        post({"input_ids": torch.zeros(1, 4, dtype=torch.int64)}, None, None)
    # CP-local logits without their CP group: the logits cover fewer positions than the tokens.
    data, raw, _, _ = make_batch(seed=0)
    half = cp_chunks(raw / TEMPERATURE, 2, 0, 1)[:, : raw.shape[1] // 2]
    with pytest.raises(ValueError, match=r"logits are CP-local and context_parallel_group is missing"):
        _prepare(data, half)


def test_post_processors_subclass_nemo_rls_classes_when_it_is_importable(tmp_path):
    """NeMo-RL dispatches post-processors with isinstance (megatron/train.py:329-360,
    automodel/train.py:373-426): with nemo_rl importable, each replacement is a subclass."""
    for mod in ("megatron", "automodel"):
        pkg = tmp_path / "nemo_rl" / "models" / mod
        pkg.mkdir(parents=True)
        (pkg / "train.py").write_text(textwrap.dedent("""
            class LossPostProcessor:
                def __init__(self, loss_fn, cfg, num_microbatches=1, cp_normalize=True, sampling_params=None,
                             draft_model=None, prepare_fn=None):
                    self.loss_fn, self.cfg, self.prepare_fn = loss_fn, cfg, prepare_fn

                def __call__(self, data_dict, packed_seq_params=None, global_valid_seqs=None, global_valid_toks=None):
                    # megatron/train.py:567-596: a closure over one micro-batch; prepare_fn, then the loss
                    def processor_fn_inner(output_tensor):
                        loss_input, data = self.prepare_fn(logits=output_tensor, data=data_dict, loss_fn=self.loss_fn)
                        return self.loss_fn(data=data, global_valid_seqs=global_valid_seqs,
                                            global_valid_toks=global_valid_toks, **loss_input)
                    return processor_fn_inner

            class LogprobsPostProcessor:
                pass
        """))
        for d in (tmp_path / "nemo_rl", tmp_path / "nemo_rl" / "models", pkg):
            (d / "__init__.py").touch()
    code = textwrap.dedent("""
        import nemo_rl.models.megatron.train as mt, nemo_rl.models.automodel.train as at
        from nemo_replay.integrations import nemo_rl as replay
        assert issubclass(replay.ReplayLogprobsPostProcessor, mt.LogprobsPostProcessor)
        assert issubclass(replay.ReplayLossPostProcessor, mt.LossPostProcessor)
        assert issubclass(replay.ReplayAutomodelLossPostProcessor, at.LossPostProcessor)
        assert issubclass(replay.ReplayAutomodelLogprobsPostProcessor, at.LogprobsPostProcessor)
        post = replay.ReplayLossPostProcessor(None, {"sequence_packing": {"enabled": True}})
        assert post.prepare_fn.func is replay.replay_prepare_fn
        # Called as NeMo-RL calls it: the loss's metrics carry this micro-batch's replay parts, drained once.
        from tests.integrations.nemo_rl.batches import TEMPERATURE, ClippedPGStyleLoss, make_batch, with_loss_inputs
        data, raw, _, rows = make_batch()
        scaled = raw / TEMPERATURE
        data = with_loss_inputs(data, scaled, rows)
        post = replay.ReplayLossPostProcessor(ClippedPGStyleLoss(), {"sequence_packing": {"enabled": False}})
        fn = post(data, global_valid_toks=(data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum())
        loss, metrics = fn(scaled)
        assert set(metrics) == {"loss", "replay/mismatch_mean:sum", "replay/mismatch_mean:count", "replay/mismatch_max"}
        lp = replay.next_token_logprobs(scaled, data).logprobs.double()
        mask = (data["token_mask"][:, 1:] != 0) & (data["sample_mask"] != 0)[:, None]
        diff = (data["generation_logprobs"][:, 1:].double() - lp).abs()[mask]
        assert metrics["replay/mismatch_mean:count"] == float(mask.sum()) > 0, metrics
        assert abs(metrics["replay/mismatch_mean:sum"] - float(diff.sum())) < 1e-9 * max(1.0, float(diff.sum()))
        assert metrics["replay/mismatch_max"] == float(diff.max())
        assert post._replay_parts == []
        try:
            replay.ReplayLossPostProcessor(None, {"sequence_packing": {"enabled": True, "fuse_loss": True}})
        except ValueError as exc:
            assert "policy.sequence_packing.fuse_loss=false" in str(exc)
        else:
            raise AssertionError("fuse_loss was accepted")
        print("ok")
    """)
    env = {"PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parents[3]}"}
    import os

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_vllm_outputs_become_generation_support_that_reproduces_the_engine():
    """The vLLM worker's layout (vllm_worker.py:951-991: prompt at [0, input_len), generated
    tokens from input_len, right-padded to padded_input_length + max generated length): each
    completion's rows encoded once, as replay's worker encodes them, in the columns of its
    ``logprobs``."""
    from nemo_replay.integrations.nemo_rl import completion_supports, next_token_logprobs, vllm_support_request
    from tests.rollout.engines.engine_outputs import vllm_offline_output, vllm_steps

    top_k = 6
    assert vllm_support_request(top_k, max_logprobs=65) == {"logprobs": top_k + 17, "flat_logprobs": True}  # top_k + 16 tied ids whole
    assert vllm_support_request(top_k, max_logprobs=10)["logprobs"] == 10 and vllm_support_request(top_k, path="mask") == {}
    with pytest.raises(ValueError, match=r"policy.generation.top_k set to an int > 1"):
        vllm_support_request(None)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 64, (n,), generator=g) for n in (3, 5)]
    gen = [4, 2]
    total = 5 + max(gen)
    logits = make_logits(2, total, seed=9, dtype=torch.float32)
    completions, ids = [], torch.zeros(2, total, dtype=torch.int64)
    for i, (p, n) in enumerate(zip(prompts, gen)):
        # The engine's logits at column t - 1 drew token t; here they are fixed per position.
        steps = vllm_steps(logits[i, len(p) - 1 : len(p) - 1 + n], TEMPERATURE, top_k=top_k, top_p=0.9, num_logprobs=top_k + 1, seed=i)
        completions.append(vllm_offline_output(steps, top_k + 1, mask=(i == 1)))
        ids[i, : len(p)] = p
        ids[i, len(p) : len(p) + n] = torch.tensor([s.token for s in steps])
    rows, engine_lp = [], torch.zeros(2, total)
    for i, start, got in completion_supports(completions, [3, 5], total, width=top_k, vocab_size=64):
        assert not got.flagged.any()
        rows.append(SampleRows.encode(got.support, torch.as_tensor(list(completions[i].token_ids)), start=start,
                                      where=f"request {i}")[0:total])  # sliced as logprobs is
        engine_lp[i, start : start + got.support.num_rows] = got.logprobs
    # A row at every generated column, none on the prompt or the padding.
    for r, p, n in zip(rows, prompts, gen):
        assert r.length == total
        assert r.recorded().tolist() == [False] * len(p) + [True] * n + [False] * (total - len(p) - n)
    token_mask = torch.stack([r.recorded() for r in rows]).float()
    data = {"input_ids": ids, "input_lengths": torch.tensor([7, 7]), "token_mask": token_mask,
            "sample_mask": torch.ones(2), "generation_support": rows}
    scores = next_token_logprobs(logits / TEMPERATURE, data)
    active = token_mask[:, 1:] != 0
    torch.testing.assert_close(scores.logprobs[active], engine_lp[:, 1:][active], atol=1e-5, rtol=0)
    assert scores.valid_mask[active].all() and active.sum() == sum(gen)
    with pytest.raises(ValueError, match=r"request 0: 3 prompt tokens \+ 4 generated tokens do not fit total_length=6"):
        list(completion_supports(completions, [3, 5], 6, width=top_k))
