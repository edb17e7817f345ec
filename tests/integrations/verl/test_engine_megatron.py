"""Replay in verl 0.9.1's Megatron engine: its packing, CP split and TP vocab shards, on CPU.

What runs: verl's own Megatron packing and unpacking (``models/mcore/util.py``
``preprocess_thd_engine`` -- sequences padded to ``tp * cp * 2`` (FP8 and bucket variants),
zigzag CP split, ``label`` rolled -- ``preprocess_bshd_engine``, ``postprocess_thd_engine``
with its CP all-gather), megatron-core's ``parallel_state`` with real TP and CP gloo groups in
four spawned ranks (TP x CP = 1x1, 2x1, 1x2, 2x2), verl's ``left_right_2_no_padding`` /
``no_padding_2_padding``, and the replay processor (:func:`replay_logits`, what the engine's
``_lm_head_logits_processor`` runs) with the shared scorer's TP all-reduces.

What cannot run on CPU, and so is not exercised here: verl's ``MegatronEngine`` itself -- its
constructor requires ``use_mbridge`` and builds the model through mbridge / Megatron-Bridge
with Transformer Engine layers, and its THD forward needs Transformer Engine's packed
(and context-parallel) attention, which has no CPU kernel. The logits therefore come from a
float64 Hugging Face model per sequence, packed with verl's own packer exactly as the Megatron
forward hands them to the processor.

Checked:
- the channel against verl's rolled labels, exhaustively over ragged length sets and every
  packing variant, and coverage: over the CP ranks every token that has a predecessor in its
  sample is predicted exactly once;
- the sampler's log q reproduced through pack -> score -> verl's CP gather -> unpack, TP=2
  equal to TP=1, forward and backward against a naive float64 reference;
- a swapped support row raises the same SupportAlignmentError on every CP rank.
"""

from __future__ import annotations

import re
import tempfile

import pytest
import torch

pytest.importorskip("verl", reason="verl 0.9.1 is not installed (pip install -e .[verl] in its own environment)")
pytest.importorskip("megatron.core", reason="megatron-core is not installed beside verl")

from tests.integrations.verl import engine_batches as eb  # noqa: E402
from tests.spawn import run_workers  # noqa: E402

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, cp); rank = tp_rank + tp * cp_rank (megatron's order)


def _channel_cases(cu_list, ps) -> dict:
    """Every packing variant of every length set: channel vs verl's labels, and CP coverage."""
    import torch.distributed as dist
    from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine

    from nemo_replay.integrations.verl.megatron import PackArgs, packed_predicted

    cp_group = ps.get_context_parallel_group()
    cp = ps.get_context_parallel_world_size()
    failures, checked = [], 0
    for case, cu in enumerate(cu_list):
        total = int(cu[-1])
        values = (torch.arange(total) * 7919 + 13) % 100003 + 1  # distinct token ids
        ids = torch.nested.nested_tensor_from_jagged(values, cu)
        variants = [PackArgs("thd", fp8, None, bucket, "zigzag") for fp8 in (False, True) for bucket in (None, 16)]
        variants.append(PackArgs("thd", False, None, None, "contiguous"))
        variants.append(PackArgs("bshd", False))
        for pack in variants:
            try:
                if pack.data_format == "thd":
                    label = preprocess_thd_engine(ids, pre_process=True, need_roll=True, use_fp8_padding=pack.use_fp8_padding,
                                                  pad_to_length_bucket=pack.pad_to_length_bucket, cp_layout=pack.cp_layout)[0]
                else:
                    label = preprocess_bshd_engine(ids, pre_process=True, need_roll=True)[0]
            except ValueError as exc:  # a layout this megatron-core cannot pack (contiguous CP without cp_partition_mode)
                failures.append(("unsupported", pack.cp_layout, str(exc)[:60])) if pack.cp_layout != "contiguous" else None
                continue
            p = packed_predicted(ids, pack)
            if p.shape != label.shape:
                failures.append((case, pack, "shape", tuple(p.shape), tuple(label.shape)))
                continue
            has = p >= 0
            if not torch.equal(values[p[has]], label[has]):
                failures.append((case, pack, "label"))
            mine = p[has].tolist()
            gathered = [None] * cp
            dist.all_gather_object(gathered, mine, group=cp_group)
            every = sorted(x for part in gathered for x in part)
            firsts = set(cu[:-1].tolist())
            if every != [t for t in range(total) if t not in firsts]:
                failures.append((case, pack, "coverage"))
            checked += 1
    return {"failures": failures, "checked": checked}


def _score_case(ps, model64, swap: bool = False) -> dict:
    """The sampled batch through pack -> replay_logits -> verl's CP gather -> unpack, with gradients."""
    import verl.utils.torch_functional as verl_F
    from verl.models.mcore.util import postprocess_thd_engine, preprocess_thd_engine

    from nemo_replay.integrations.verl.megatron import PackArgs, replay_logits
    from nemo_replay.integrations.verl.engine import FULL_VOCAB_KEY

    batch = eb.sampled_batch(model64)
    if swap:
        eb.edit_rows(batch, eb.swap_rows)
    td = eb.engine_batch(batch, calculate_entropy=True)
    input_ids = td["input_ids"]
    b = input_ids.size(0)
    with torch.no_grad():
        per_seq = [model64(input_ids[i][None]).logits[0] for i in range(b)]  # [L_i, V] float64
    nested_logits = torch.nested.nested_tensor_from_jagged(torch.cat(per_seq), input_ids.offsets())
    packed, params, _ = preprocess_thd_engine(nested_logits, pre_process=True)  # verl's own packer
    label = preprocess_thd_engine(input_ids, pre_process=True, need_roll=True)[0]
    temperature = verl_F.expand_as_nested(torch.full((b,), float(td["temperature"])), input_ids)
    temperature = preprocess_thd_engine(temperature, pre_process=True)[0]
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    v_local = eb.VOCAB // tp
    local = packed[..., tp_rank * v_local:(tp_rank + 1) * v_local].clone().requires_grad_()
    try:
        out = replay_logits(local, label, temperature, td, PackArgs(), tp_group=ps.get_tensor_model_parallel_group(),
                            cp_group=ps.get_context_parallel_group(), calculate_entropy=True)
    except ValueError as exc:
        return {"error": (type(exc).__name__, str(exc))}
    nested = {k: postprocess_thd_engine(v, params, input_ids, b) for k, v in out.items()}  # CP all-gather, unpack
    view = {k: eb.response_view(v, td) for k, v in nested.items()}
    w, u = (torch.randn(view["log_probs"].shape, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
            for s in (5, 6))
    (w * view["log_probs"]).sum().add((u * view["entropy"]).sum()).backward()

    # the naive float64 reference, and its gradient packed by the same packer onto this rank's shard
    leaves = [z.clone().requires_grad_() for z in per_seq]
    ref = eb.reference_from_logits(leaves, {**batch.batch, "generation_support": eb.support_rows(batch)})
    ((w * ref["log_probs"]).sum() + (u * ref["entropy"]).sum()).backward()
    ref_grad = torch.nested.nested_tensor_from_jagged(torch.cat([z.grad for z in leaves]), input_ids.offsets())
    ref_grad = preprocess_thd_engine(ref_grad, pre_process=True)[0][..., tp_rank * v_local:(tp_rank + 1) * v_local]
    return {
        "log_probs": view["log_probs"].detach(), "entropy": view["entropy"].detach(),
        "full": view[FULL_VOCAB_KEY].detach(), "rollout": batch.batch["rollout_log_probs"],
        "mask": batch.batch["response_mask"].bool(), "ref": {k: v.detach() for k, v in ref.items()},
        "grad_err": float((local.grad - ref_grad).abs().max()), "grad_max": float(ref_grad.abs().max()),
    }


def _megatron_ranks(rank, world_size, model_dir):
    eb.worker_environment()
    from megatron.core import parallel_state as ps

    model64 = eb.load_float64(model_dir)
    g = torch.Generator().manual_seed(7)
    cu_list = []
    for _ in range(25):
        lengths = torch.randint(2, 13, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
        cu_list.append(torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
    results = {}
    for tp, cp in LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        results[(tp, cp)] = {
            "channel": _channel_cases(cu_list, ps),
            "score": _score_case(ps, model64),
            "swap": _score_case(ps, model64, swap=True),
        }
    ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory() as d:
        eb.save_tiny_model(d)
        yield run_workers(_megatron_ranks, 4, d)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_channel_follows_verls_packing_cp_split_and_roll(ranks, layout):
    for r in ranks:
        ch = r[layout]["channel"]
        assert ch["failures"] == [], ch["failures"][:3]
        assert ch["checked"] >= 25 * 5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replayed_log_probs_equal_the_sampler_forward_and_backward(ranks, layout):
    for r in ranks:
        s = r[layout]["score"]
        mask = s["mask"]
        assert mask.sum() >= 15
        assert (s["log_probs"] - s["rollout"].double())[mask].abs().max() < 1e-5
        assert (s["log_probs"] - s["ref"]["log_probs"]).abs().max() < 1e-10
        assert (s["entropy"] - s["ref"]["entropy"]).abs().max() < 1e-10
        assert (s["full"] - s["ref"]["full_vocab"])[mask].abs().max() < 1e-10
        assert (s["rollout"].double() - s["full"])[mask].min() > 0.3  # verl's own scoring: off by the gap
        assert s["grad_err"] < 1e-10 and s["grad_max"] > 1e-3
        # TP=2 and CP=2 equal TP=1, CP=1
        assert torch.allclose(s["log_probs"], ranks[0][(1, 1)]["score"]["log_probs"], atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_swapped_row_raises_the_same_error_on_every_rank(ranks, layout):
    tp, cp = layout
    errors = [r[layout]["swap"]["error"] for r in ranks]
    assert {e[0] for e in errors} == {"SupportAlignmentError"}
    for group_start in range(0, 4, tp * cp):  # one model-parallel replica
        messages = {errors[k][1] for k in range(group_start, group_start + tp * cp)}
        assert len(messages) == 1, messages
    msg = errors[0][1]
    # the swap breaks response position 1 of samples 0 and 3; a CP rank names the first it holds
    assert re.search(r"trajectory [03], token position 1: sampled token \d+ is not a member", msg), msg
    if cp > 1:
        assert msg.startswith("CP rank ")
