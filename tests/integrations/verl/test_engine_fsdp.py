"""Replay in verl 0.9.1's FSDP engine, running verl's own engine code on the CPU.

What runs, all verl's own code unless named: ``EngineRegistry`` lookup of the replay engine
under ``VERL_ENGINE_VENDOR``; ``FSDPEngine.__init__`` / ``initialize`` (device mesh, FSDP2
``fully_shard`` of a tiny Llama built from a config, optimizer); ``infer_batch`` /
``train_batch`` -> ``forward_backward_batch`` (micro-batching, dynamic batch size) ->
``forward_step`` (its remove-padding inputs, the roll, the static pad and Ulysses
pad-and-slice, the model forward) -> the loss (``workers/utils/losses.py`` ``ppo_loss``);
``left_right_2_no_padding`` / ``no_padding_2_padding``; ``DataProto``; the Ulysses gather
(``gather_outputs_and_unpad``) and all-to-all over two spawned gloo ranks. Two CPU stand-ins
from ``cpu_platform.py``: verl's platform registry gets a CPU entry, and the Ulysses attention
exchange that verl keeps inside its flash-attention wrapper runs around an exact attention.

Batches are sampled with top-k from the same tiny model (``engine_batches.py``, each field
cited to verl's source), their rows one compact buffer a sample as replay's agent loop writes
them, with a tool turn (observation tokens without rows, out of the loss) and a position whose
support could not be recorded. Checked:

- the replayed old-policy log-probs equal the sampler's log q within 1e-5, where verl's own
  engine (same weights, same batch) is off by the normalisation gap, which the replay engine
  reports as ``full_vocab_log_probs`` (equal to verl's own log-probs);
- forward and backward of the policy pass (log-probs and support entropy through a loss on
  verl's nested outputs) against a naive float64 reference, with and without remove-padding,
  with dynamic micro-batches;
- verl's ``ppo_loss`` on top, unchanged: first-step ratio 1 against the sampler;
- Ulysses SP = 2 equals SP = 1 and the sampler, values and gradients; vocab-sharded DTensor
  logits (an uneven split over two ranks) score in place as the whole vocabulary does;
- bad input: a batch without ``generation_support``, a buffer short of its response's rows, a
  row swapped between samples or shifted by one position, the retired tensor forms (dense
  ``[B, R, K]``, nested ``(B, R_i, K)``), fused kernels -- each a ValueError naming what, where
  and the fix, and the same error on every rank when only one rank's batch is bad;
- the coordinate channel against verl's own roll / pad / Ulysses slice, exhaustively.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytest.importorskip("verl", reason="verl 0.9.1 is not installed (pip install -e .[verl] in its own environment)")

from tests.integrations.verl import engine_batches as eb  # noqa: E402
from tests.integrations.verl.cpu_platform import ULYSSES_ATTENTION  # noqa: E402
from tests.spawn import run_workers  # noqa: E402


def _weights(batch, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = batch.batch["responses"].shape
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def _weighted_loss(model_output, data, dp_group=None):
    """A loss on verl's nested outputs, read back with verl's own ``no_padding_2_padding``."""
    lp = eb.response_view(model_output["log_probs"], data)
    ent = eb.response_view(model_output["entropy"], data)
    loss = (data["test_w"].to(lp.dtype) * lp).sum() + (data["test_u"].to(ent.dtype) * ent).sum()
    return loss, {}


def _grads(engine) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in engine.module.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def _policy_pass(engine, batch, *, rmpad: bool, dynamic: bool, seed: int):
    """verl's ``forward_backward_batch`` with gradients; returns the response view and the gradients."""
    from verl.utils import tensordict_utils as tu

    w, u = _weights(batch, seed)
    batch = batch.union(type(batch).from_dict(tensors={"test_w": w.float(), "test_u": u.float()}))
    td = eb.engine_batch(batch, calculate_entropy=True, dynamic_bsz=dynamic, use_remove_padding=rmpad)
    tu.assign_non_tensor(td, compute_loss=True)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(td, _weighted_loss, forward_only=False)
        grads = _grads(engine)
    return {"grads": grads, "w": w, "u": u, "loss": out["loss"]}


def _nest_responses(td) -> None:
    """The TransferQueue trainer's layout: prompts, responses and their masks nested per sample
    (``trainer/ppo/v1/trainer_base.py`` reads them back with ``response_from_nested``); the rows, one
    compact buffer a sample, are per sample already."""
    P = td["prompts"].shape[1]
    lengths = td["attention_mask"][:, P:].sum(1).tolist()
    real_prompt = td["attention_mask"][:, :P].bool()

    def nest(parts):
        return torch.nested.as_nested_tensor(parts, layout=torch.jagged)

    td["prompts"] = nest([td["prompts"][i][real_prompt[i]] for i in range(len(lengths))])
    td["responses"] = nest([td["responses"][i, :n] for i, n in enumerate(lengths)])
    td["response_mask"] = nest([td["response_mask"][i, :n] for i, n in enumerate(lengths)])


def _infer(engine, batch, nested: bool = False, edit=None, **kw):
    """``infer_batch`` on ``batch``'s engine batch (nested as the TransferQueue trainer's with ``nested``,
    then ``edit(td)``), read back as ``[B, response_length]``."""
    td = eb.engine_batch(batch, calculate_entropy=True, **kw)
    if nested:
        _nest_responses(td)
    if edit is not None:
        edit(td)
    with engine.eval_mode():
        out = engine.infer_batch(td)["model_output"]
    view = {k: eb.response_view(v, td) for k, v in out.items()}
    return view


def _metric_values(v) -> list[float]:
    """verl's per-micro-batch metrics (floats, tensors or ``Metric`` objects) as floats."""
    items = v if isinstance(v, list) else [v]
    out = []
    for m in items:
        if hasattr(m, "values"):
            out.extend(float(x) for x in m.values)
        else:
            out.append(float(m))
    return out


def _error(fn) -> tuple[str, str]:
    try:
        fn()
    except ValueError as exc:
        return type(exc).__name__, str(exc)
    return "", ""


# ---------------------------------------------------------------------------- one rank


def _single_rank(rank, world_size, model_dir):
    eb.worker_environment()
    from functools import partial

    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    import nemo_replay.integrations.verl.fsdp  # noqa: F401 - registers, as VERL_USE_EXTERNAL_MODULES does
    from nemo_replay.integrations.verl.engine import VENDOR

    model64 = eb.load_float64(model_dir)
    batch = eb.sampled_batch(model64)
    res = {"batch": {**{k: v.clone() for k, v in batch.batch.items()}, "generation_support": eb.support_rows(batch)}}

    # The lookup verl's TrainingWorker does (engine_workers.py:136), with and without the vendor key.
    os.environ["VERL_ENGINE_VENDOR"] = VENDOR
    replay_cls = EngineRegistry.get_engine_cls("language_model", "fsdp2")
    del os.environ["VERL_ENGINE_VENDOR"]
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # verl registers its own FSDP engine for cuda and npu only
    own_cls = EngineRegistry.get_engine_cls("language_model", "fsdp2")
    del os.environ["VERL_ENGINE_DEVICE"]
    res["classes"] = (replay_cls.__name__, own_cls.__name__)

    replay = eb.build_engine(replay_cls, model_dir)
    own = eb.build_engine(own_cls, model_dir)
    res["replay"] = _infer(replay, batch)
    res["replay_dynamic"] = _infer(replay, batch, dynamic_bsz=True, max_token_len=12)
    res["own"] = _infer(own, batch)
    res["replay_nested"] = _infer(replay, batch, nested=True)

    # The policy pass: forward and backward, remove-padding on and off, fixed and dynamic micro-batches.
    res["policy_rmpad"] = _policy_pass(replay, batch, rmpad=True, dynamic=True, seed=5)
    replay_padded = eb.build_engine(replay_cls, model_dir, use_remove_padding=False)
    res["replay_padded"] = _infer(replay_padded, batch, use_remove_padding=False)
    res["policy_padded"] = _policy_pass(replay_padded, batch, rmpad=False, dynamic=False, seed=5)

    # verl's ppo_loss on top (ray_trainer.py:1327-1366 flags, engine_workers.py:348-358 defaults);
    # old log-probs = the sampler's (bypass mode), negative advantages so a ratio below 1 - clip clips.
    config = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                             use_dynamic_bsz=False)
    loss_fn = partial(ppo_loss, config=config)
    tensors = {"old_log_probs": batch.batch["rollout_log_probs"].clone(),
               "advantages": -torch.ones_like(batch.batch["rollout_log_probs"])}
    ppo_batch = batch.union(type(batch).from_dict(tensors=tensors))
    for name, engine in (("ppo_replay", eb.build_engine(replay_cls, model_dir)), ("ppo_own", own)):
        td = eb.engine_batch(ppo_batch, calculate_entropy=False)
        tu.assign_non_tensor(td, compute_loss=True, global_batch_size=4)
        with engine.train_mode():
            out = engine.train_batch(td, loss_function=loss_fn)
        res[name] = {k: _metric_values(v) for k, v in out["metrics"].items() if k.startswith(("actor/", "replay/"))}

    # Bad input.
    def bad(change, **kw):
        b = eb.sampled_batch(model64)
        change(b)
        return _error(lambda: _infer(replay, b, **kw))

    def drop(b):
        b.non_tensor_batch.pop("generation_support")

    def short(b):  # the rows of response positions 0..6 only: sample 3 (8 tokens) is a row short
        cut = [min(n, eb.RESPONSE_LENGTH - 1) for n in eb.response_lengths(b)]
        eb.edit_rows(b, lambda rows, sampled: None, lengths=cut)

    def shift(rows, sampled):  # every row of sample 3 one position late, with the token sampled from it
        rows[3, 1:] = rows[3, :-1].clone()
        sampled[3, 1:] = sampled[3, :-1].clone()

    def dense(b):  # the retired [B, response_length, K] int32 field
        b.batch["generation_support"] = eb.support_rows(b)
        b.non_tensor_batch.pop("generation_support")

    def nested_rows(rows, lengths):  # the retired nested (B, R_i, K) int32 field, beside nested responses
        def edit(td):
            td["generation_support"] = torch.nested.as_nested_tensor([rows[i, :n] for i, n in enumerate(lengths)],
                                                                     layout=torch.jagged)
        return edit

    res["errors"] = {name: bad(fn) for name, fn in
                     (("missing", drop), ("rows", short), ("swap", lambda b: eb.edit_rows(b, eb.swap_rows)),
                      ("shift", lambda b: eb.edit_rows(b, shift)), ("dense", dense))}
    res["errors"]["nested"] = bad(lambda b: None, nested=True,
                                  edit=nested_rows(eb.support_rows(batch), eb.response_lengths(batch)))
    res["errors"]["fused"] = _error(lambda: eb.build_engine(replay_cls, model_dir, use_fused_kernels=True,
                                                             initialize=False))
    res["channel_failures"] = _channel_failures(1)
    return res


@pytest.fixture(scope="module")
def single():
    with tempfile.TemporaryDirectory() as d:
        eb.save_tiny_model(d)
        model64 = eb.load_float64(d)
        (res,) = run_workers(_single_rank, 1, d)
        yield res, model64


def _reference(model64, res):
    return eb.reference_scores(model64, res["batch"])


def test_registry_selects_replay_engine_only_under_the_vendor_key(single):
    res, _ = single
    assert res["classes"] == ("ReplayFSDPEngineWithLMHead", "FSDPEngineWithLMHead")


def test_verl_imports_the_engine_module_named_in_its_environment():
    """verl/__init__.py imports VERL_USE_EXTERNAL_MODULES in every process, Ray workers included."""
    import subprocess
    import sys

    code = (
        "import verl\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "print(sorted(str(k) for k in EngineRegistry._engines['language_model']['fsdp2']))\n"
    )
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="nemo_replay.integrations.verl.fsdp")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "('cuda', 'nemo_replay')" in out.stdout and "'cuda'" in out.stdout, out.stdout


def test_old_policy_recompute_equals_the_sampler_where_verl_is_off_by_the_gap(single):
    res, _ = single
    b = res["batch"]
    mask = b["response_mask"].bool()
    rollout = b["rollout_log_probs"]
    replay, own = res["replay"], res["own"]
    assert mask.sum() >= 15 and not mask[1, 2] and not mask[2, 1:3].any()  # flagged and tool tokens out of the loss
    assert (replay["log_probs"] - rollout)[mask].abs().max() < 1e-5
    gap = (rollout - own["log_probs"])[mask]
    assert gap.min() > 0.3  # verl's full-vocabulary scoring misses the truncated mass on every token
    # the replay engine reports verl's own scoring beside its own, from the same forward
    assert (replay["full_vocab_log_probs"] - own["log_probs"])[mask].abs().max() < 1e-5
    assert (replay["log_probs"][~mask] == 0).all()
    # dynamic micro-batches (verl's rearrangement and restore) give the same values, and so
    # do the TransferQueue trainer's nested responses and rows
    assert torch.allclose(res["replay_dynamic"]["log_probs"], replay["log_probs"], atol=1e-6)
    assert torch.equal(res["replay_nested"]["log_probs"], replay["log_probs"])


def test_a_tensor_support_field_is_refused_with_the_fix(single):
    """The dense ``[B, R, K]`` and nested ``(B, R_i, K)`` int32 fields are retired (replay's agent loops write one
    compact buffer a sample): through verl's own FSDP engine each is a ValueError naming what it got and the fix."""
    res, _ = single
    for name, shape in (("dense", "(4, 8, 5)"), ("nested", "(4, j")):
        kind, msg = res["errors"][name]
        assert kind == "ValueError", (name, msg)
        assert f"batch['generation_support'] is a {shape}" in msg and "tensor" in msg, msg
        assert "one uint8 buffer a sample (SampleRows.to_bytes)" in msg and "agent loops (configs/verl/)" in msg, msg


def test_forward_matches_naive_float64_reference(single):
    res, model64 = single
    ref = _reference(model64, res)
    mask = ref["loss"]
    for view in (res["replay"], res["replay_padded"]):
        assert (view["log_probs"].double() - ref["log_probs"])[mask].abs().max() < 1e-5
        assert (view["entropy"].double() - ref["entropy"])[mask].abs().max() < 1e-5
        assert (view["full_vocab_log_probs"].double() - ref["full_vocab"])[mask].abs().max() < 1e-5


@pytest.mark.parametrize("which", ["policy_rmpad", "policy_padded"])
def test_backward_matches_naive_float64_reference(single, which):
    res, model64 = single
    pol = res[which]
    model64.zero_grad()
    ref = _reference(model64, res)
    loss = (pol["w"] * ref["log_probs"]).sum() + (pol["u"] * ref["entropy"]).sum()
    loss.backward()
    assert abs(sum(pol["loss"]) - loss.item()) < 1e-4
    ref_grads = dict(model64.named_parameters())
    assert set(pol["grads"]) == set(ref_grads)
    for name, g in pol["grads"].items():
        r = ref_grads[name].grad
        assert torch.allclose(g.double(), r, rtol=1e-4, atol=1e-6), (name, (g.double() - r).abs().max())
    assert max(float(g.abs().max()) for g in pol["grads"].values()) > 1e-3


def test_ppo_loss_runs_unchanged_with_first_step_ratio_one(single):
    res, _ = single
    rep, own = res["ppo_replay"], res["ppo_own"]
    assert max(abs(v) for v in rep["actor/ppo_kl"]) < 1e-5
    assert max(rep["actor/pg_clipfrac"]) == 0.0
    assert min(own["actor/ppo_kl"]) > 0.3  # verl's own: old (sampler) vs full vocabulary differ by the gap
    assert min(own["actor/pg_clipfrac"]) > 0.0
    # the replay metrics ride along in the actor's metrics (one value per micro-batch); verl's own engine adds none
    assert len(rep["replay/mismatch_max"]) == 2 and max(rep["replay/mismatch_max"]) < 1e-5
    gaps = rep["replay/normalisation_gap_mean"]
    assert min(gaps) > 0.3 and abs(sum(gaps) / 2 - sum(own["actor/ppo_kl"]) / 2) < 0.2
    assert not any(k.startswith("replay/") for k in own)


def test_bad_input_is_named(single):
    res, _ = single
    errors = res["errors"]
    kind, msg = errors["missing"]
    assert kind == "ValueError" and "'generation_support'" in msg and "VERL_ENGINE_VENDOR" in msg
    kind, msg = errors["rows"]
    assert kind == "ValueError" and "batch['generation_support'] holds 7 rows for sample 3, whose response has 8 " \
        "tokens: one row per response token" in msg, msg
    b = res["batch"]
    tokens, rows = b["responses"], b["generation_support"]
    # the swap: sample 0's token at position 1 is not in sample 3's row 1 (distinct ids there)
    assert tokens[0, 1] not in rows[3, 1]
    # the shift: the first position whose token is not in the previous position's row
    shifted = next(j for j in range(1, 8) if rows[3, j - 1, 0] >= 0 and tokens[3, j] not in rows[3, j - 1])
    for name, sample, position in (("swap", 0, 1), ("shift", 3, shifted)):
        kind, msg = errors[name]
        assert kind == "SupportAlignmentError", msg
        assert msg.startswith(f"sample {sample} (uid uid-{sample}), response position {position}: token "
                              f"{int(tokens[sample, position])} is not a member of its support row"), msg
        assert "shifted by one position" in msg
    kind, msg = errors["fused"]
    assert kind == "ValueError" and "use_fused_kernels=False" in msg


# ---------------------------------------------------------------------------- Ulysses SP = 2


def _sp_ranks(rank, world_size, model_dir, bad_rank):
    eb.worker_environment()
    import torch.distributed as dist

    from nemo_replay.integrations.verl.fsdp import ReplayFSDPEngineWithLMHead

    model64 = eb.load_float64(model_dir)
    batch = eb.sampled_batch(model64)
    engine = eb.build_engine(ReplayFSDPEngineWithLMHead, model_dir, sp=2, attn=ULYSSES_ATTENTION)
    res = {"sp_group_size": dist.get_world_size(engine.ulysses_parallel_group)}
    res["infer"] = _infer(engine, batch)
    res["policy"] = _policy_pass(engine, batch, rmpad=True, dynamic=False, seed=5)
    # Only one rank's batch is bad: every rank raises the same error.
    bad = eb.sampled_batch(model64)
    if rank == bad_rank:
        eb.edit_rows(bad, eb.swap_rows)
    res["error"] = _error(lambda: _infer(engine, bad))
    with engine.eval_mode():  # sets verl's Ulysses group, as every pass does
        res["channel_failures"] = _channel_failures(2)
    res["dtensor"] = _dtensor_logits()
    return res


def _dtensor_logits() -> dict:
    """Vocab-sharded DTensor logits (what verl's FSDP engine family gathers with ``full_tensor()``)
    scored in place: an uneven 97-row vocabulary over two ranks (torch.chunk: 49 + 48)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from nemo_replay.integrations.verl.fsdp import local_vocab_shard
    from nemo_replay.scoring.scorer import score_aligned_support

    g = torch.Generator().manual_seed(9)
    full = torch.randn(6, 97, generator=g, dtype=torch.float64)
    rows = torch.stack([torch.randperm(97, generator=g)[:4] for _ in range(6)]).to(torch.int32)
    sampled = rows[:, 2].to(torch.int64)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    local, shard = local_vocab_shard(distribute_tensor(full, mesh, [Shard(-1)]))
    got = score_aligned_support(local, sampled, torch.arange(6), torch.ones(6, dtype=torch.bool), rows, shard=shard)
    return {"shard": (shard.start, shard.end, shard.vocab_size), "log_probs": got.logprobs, "full": full, "rows": rows}


@pytest.fixture(scope="module")
def sp_ranks():
    with tempfile.TemporaryDirectory() as d:
        eb.save_tiny_model(d)
        yield run_workers(_sp_ranks, 2, d, 1)


def test_ulysses_sp2_equals_sp1_and_the_sampler(single, sp_ranks):
    res, model64 = single
    ranks = sp_ranks
    mask = res["batch"]["response_mask"].bool()
    for r in ranks:
        assert r["sp_group_size"] == 2
        assert (r["infer"]["log_probs"] - res["batch"]["rollout_log_probs"])[mask].abs().max() < 1e-5
        assert (r["infer"]["log_probs"] - res["replay"]["log_probs"]).abs().max() < 1e-5
        assert (r["infer"]["entropy"] - res["replay"]["entropy"]).abs().max() < 1e-5
        for name, g in r["policy"]["grads"].items():
            ref = res["policy_rmpad"]["grads"][name]
            assert torch.allclose(g, ref, rtol=1e-4, atol=1e-6), (name, (g - ref).abs().max())
    shards = [r["dtensor"]["shard"] for r in ranks]
    assert shards == [(0, 49, 97), (49, 97, 97)]
    d = ranks[0]["dtensor"]
    z, rows = d["full"], d["rows"].to(torch.int64)
    expect = z.gather(1, rows[:, 2:3]).squeeze(1) - torch.logsumexp(z.gather(1, rows), 1)
    for r in ranks:
        assert torch.allclose(r["dtensor"]["log_probs"], expect, atol=1e-12)
    kinds = {r["error"][0] for r in ranks}
    messages = {r["error"][1] for r in ranks}
    assert kinds == {"SupportAlignmentError"} and len(messages) == 1
    assert next(iter(messages)).startswith("worker rank 1 of 2: sample 0 (uid uid-0), response position 1")


# ---------------------------------------------------------------------------- coordinates


def _channel_failures(sp: int) -> list:
    """Every slot's predicted token, read through the channel, against verl's rolled label there.

    The channel and verl's labels go through the same calls in the same order as in
    ``prepare_model_inputs`` (transformer_impl.py:1193-1238): the roll, ``pad_packed_inputs``
    (static pad), ``ulysses_pad_and_slice_inputs`` on this rank's real SP group. Many ragged
    length sets, distinct token ids; returns the failures (empty when all agree).
    """
    from verl.utils.ulysses import ulysses_pad_and_slice_inputs
    from verl.workers.engine.utils import pad_packed_inputs

    from nemo_replay.integrations.verl.response_layout import next_token_index

    g = torch.Generator().manual_seed(11)
    failures, seen, expected = [], [], []
    for case in range(40):
        lengths = torch.randint(2, 9, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        total = int(cu[-1])
        values = torch.randperm(1000, generator=g)[:total] + 1  # distinct token ids
        rolled = torch.roll(values.unsqueeze(0), shifts=-1, dims=1)
        predicted = next_token_index(cu).unsqueeze(0)
        static_pad = case % 3
        if static_pad:
            rolled, _ = pad_packed_inputs(rolled, None, static_pad)
            predicted, _ = pad_packed_inputs(predicted, None, static_pad, pad_value=-1)
        if sp > 1:
            rolled, _, _ = ulysses_pad_and_slice_inputs(rolled, None, sp_size=sp)
            predicted, _, _ = ulysses_pad_and_slice_inputs(predicted, None, sp_size=sp, pad_value=-1)
        p, lab = predicted.squeeze(0), rolled.squeeze(0)
        has = p >= 0
        if p.shape != lab.shape or not torch.equal(values[p[has]], lab[has]):
            failures.append((case, lengths.tolist(), "label"))
        # -1 exactly where verl's label crosses into the next sample (or is padding): over all
        # SP ranks, L_i - 1 predicting slots per sample, never a sample's first token
        seen.append(int(has.sum()))
        expected.append(total - lengths.numel())
        if bool(torch.isin(p[has], cu[:-1]).any()):
            failures.append((case, lengths.tolist(), "predicts a first token"))
    return {"failures": failures, "seen": seen, "expected": expected}


def test_predicted_token_channel_follows_verls_roll_pad_and_slice(single, sp_ranks):
    res, _ = single
    one = res["channel_failures"]
    assert one["failures"] == [] and one["seen"] == one["expected"]
    for r in sp_ranks:
        assert r["channel_failures"]["failures"] == []
    seen = [a + b for a, b in zip(*(r["channel_failures"]["seen"] for r in sp_ranks))]
    assert seen == one["expected"]


def test_a_batch_missing_keys_or_responses_or_with_a_misshapen_mask_is_named():
    """verl's batch check once raised KeyError for a batch without response_mask / attention_mask,
    ``RuntimeError: step must be nonzero`` when every response was empty, and a broadcasting
    error for a (B, R + 1) mask. Batches built as verl builds them (``engine_batches.make_batch``,
    then ``engine_batch``: ``left_right_2_no_padding``), dense (the legacy trainer's) and nested; a tensor
    support field (the retired dense and nested int32 forms) is refused with the fix."""
    from nemo_replay.integrations.verl.engine import check_replay_batch

    rollouts = [eb.Rollout([11, 23], [30, 31, 32], [[30, 33], [31, 34], [32, 35]], [-0.1, -0.2, -0.3]),
                eb.Rollout([42], [36, 37], [[36, 38], [37, 39]], [-0.4, -0.5])]
    batch = eb.make_batch(rollouts, k=2)
    dense = batch.to_tensordict()
    nested = eb.engine_batch(batch, calculate_entropy=False)
    check_replay_batch(dense, vocab_size=100)
    check_replay_batch(nested, vocab_size=100)
    for td, keys in ((dense, ("response_mask", "attention_mask")), (nested, ("response_mask",))):
        for key in keys:
            with pytest.raises(ValueError, match=rf"the batch has no '{key}'; replay reads .* as verl's agent loop writes them"):
                check_replay_batch(td.exclude(key), vocab_size=100)
    B, R = dense["responses"].shape
    wide = dense.clone()
    wide["response_mask"] = torch.ones(B, R + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"batch\['response_mask'\] has shape \({B}, {R + 1}\), expected \[{B}, {R}\]"):
        check_replay_batch(wide, vocab_size=100)
    empty = eb.make_batch([eb.Rollout([11, 23]), eb.Rollout([42])], k=2)
    check_replay_batch(empty.to_tensordict(), vocab_size=100)  # no response token: nothing to check, no error
    # The retired tensor forms, dense [B, R, K] beside dense responses and nested (B, R_i, K) beside nested ones:
    # each refused with what it is and the fix (the compact rows of the same batch check clean).
    rows, lengths = eb.support_rows(batch, k=2), eb.response_lengths(batch)
    nested_responses = nested.clone()
    _nest_responses(nested_responses)
    check_replay_batch(nested_responses, vocab_size=100)
    nested_rows = torch.nested.as_nested_tensor([rows[i, :n] for i, n in enumerate(lengths)], layout=torch.jagged)
    fix = r"tensor; replay's agent loops write one uint8 buffer a sample \(SampleRows.to_bytes\).*\(configs/verl/\)"
    for td, field, shape in ((dense, rows, rf"\({B}, {R}, 2\)"), (nested_responses, nested_rows, rf"\({B}, j\d+, 2\)")):
        retired = td.clone()
        retired["generation_support"] = field
        with pytest.raises(ValueError, match=rf"batch\['generation_support'\] is a {shape} {fix}"):
            check_replay_batch(retired, vocab_size=100)
