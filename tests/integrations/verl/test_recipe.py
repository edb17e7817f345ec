"""What a verl 0.9.1 user switches on and reads: the overlays, the config check, the plugin, the metrics.

verl's own code that runs: Hydra composition of ``configs/verl/replay_{fsdp,megatron}.yaml``
over verl's ``ppo_trainer`` / ``ppo_megatron_trainer`` (``pkg://verl.trainer.config``), its
``RolloutConfig`` dataclass on the result, ``import verl`` with ``VERL_USE_EXTERNAL_MODULES``
(``verl/__init__.py``) in a fresh interpreter, its ``RolloutReplicaRegistry`` and agent loop
registry, ``calculate_debug_metrics`` (``utils/debug/metrics.py``, the
``training/rollout_probs_diff_*`` replay's metrics sit beside), ``left_right_2_no_padding`` /
``no_padding_2_padding`` and ``Metric`` aggregation (``utils/metric/utils.py``) for the
engine-side metrics. Not here: building the vLLM / SGLang replica classes (their modules
import vLLM / SGLang, which do not install on a CPU machine).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl 0.9.1 is not installed here; .ci/run builds its own environment for these tests")

from hydra import compose, initialize_config_dir  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.debug.metrics import calculate_debug_metrics  # noqa: E402
from verl.utils.metric import AggregationType, Metric  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from nemo_replay.integrations.verl.keys import LOG_SUPPORT_MASS_KEY  # noqa: E402
from nemo_replay.integrations.verl.metrics import engine_metrics, replay_metrics, replay_metrics_from_batch  # noqa: E402
from nemo_replay.integrations.verl.recipe import check_verl_config  # noqa: E402
from nemo_replay.integrations.verl.rollout import RolloutReplay  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
CONFIG_DIR = str(ROOT / "configs" / "verl")
R = "actor_rollout_ref.rollout"


def composed(name: str = "replay_fsdp", *overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=name, overrides=list(overrides))


# ---------------------------------------------------------------------------------- overlays + check


@pytest.mark.parametrize("name, strategy", [("replay_fsdp", "fsdp"), ("replay_megatron", "megatron")])
def test_overlays_compose_over_verl_and_pass_the_check(name, strategy):
    cfg = composed(name)
    assert cfg.actor_rollout_ref.actor.strategy == strategy
    check_verl_config(cfg)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)  # verl's RolloutConfig accepts the overlay
    assert rollout.custom == {"replay": {"enabled": True, "support_width": None, "source": "logits"}}
    replay = RolloutReplay.from_rollout_config(rollout)
    # Rows 16 wider than top_k: supports tied at the k-th value are read whole (81 log-probs a request).
    assert (replay.enabled, replay.width, replay.top_k) == (True, 80, 64)
    assert rollout.engine_kwargs["vllm"]["max_logprobs"] == 81 and rollout.logprobs_mode == "processed_logprobs"
    # verl's defaults outside the overlay stay: V1 trainer, sync mode, verl's own manager
    assert cfg.trainer.use_v1 is True and cfg.trainer.v1.trainer_mode == "sync"


def test_check_reports_every_problem_at_once():
    cfg = composed(
        "replay_fsdp",
        f"{R}.top_k=-1", f"{R}.temperature=0", f"{R}.do_sample=false", f"+{R}.repetition_penalty=1.1",
        f"{R}.calculate_log_probs=false", f"{R}.logprobs_mode=raw_logprobs", f"{R}.disaggregation.enabled=true",
        "actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_rollout=true", f"{R}.agent.default_agent_loop=tool_agent",
        f"{R}.custom.replay.support_width=1", f"{R}.custom.replay.source=dense",
        "trainer.v1.trainer_mode=colocate_async", "actor_rollout_ref.actor.strategy=veomni",
        "actor_rollout_ref.model.use_fused_kernels=true", "ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR=null",
        "ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=other.module",
    )
    with pytest.raises(ValueError) as err:
        check_verl_config(cfg)
    lines = str(err.value).splitlines()[1:]
    expected = [
        f"{R}.custom.replay.support_width=1", f"{R}.custom.replay.source='dense'", f"{R}.temperature=0",
        f"{R}.top_k=-1", f"{R}.do_sample=False", f"{R}.repetition_penalty=1.1", f"{R}.calculate_log_probs=False",
        f"{R}.logprobs_mode='raw_logprobs'", f"{R}.disaggregation.enabled=True", f"{R}.mtp.enable_rollout=True",
        f"{R}.agent.default_agent_loop='tool_agent'", "trainer.v1.trainer_mode='colocate_async'",
        "actor_rollout_ref.actor.strategy='veomni'", "actor_rollout_ref.model.use_fused_kernels=True",
        "VERL_USE_EXTERNAL_MODULES='other.module'", "VERL_ENGINE_VENDOR=None",
    ]
    assert len(lines) == len(expected), str(err.value)
    for flag in expected:
        assert sum(flag in line for line in lines) == 1, f"{flag} missing or repeated in:\n{err.value}"
    assert all(": set " in line for line in lines), "every line names its fix"


def test_check_sizes_the_engine_limits_from_top_k():
    cfg = composed("replay_fsdp", f"{R}.top_k=32", f"{R}.engine_kwargs.vllm.max_logprobs=32")
    with pytest.raises(ValueError, match=r"max_logprobs=32: set an int >= 33"):
        check_verl_config(cfg)
    check_verl_config(composed("replay_fsdp", f"{R}.top_k=32", f"{R}.engine_kwargs.vllm.max_logprobs=33"))
    check_verl_config(composed("replay_fsdp", f"{R}.top_k=32", f"{R}.engine_kwargs.vllm.max_logprobs=4",
                               f"+{R}.engine_kwargs.vllm.return_sampling_mask=true"))  # masks need no log-prob room
    cfg = composed("replay_fsdp", f"{R}.name=sglang", f"{R}.top_k=64", f"+{R}.engine_kwargs.sglang.sampling_mask_max_tokens=32")
    with pytest.raises(ValueError, match=r"sampling_mask_max_tokens=32: set >= top_k=64"):
        check_verl_config(cfg)
    # verl 0.9.1's own SGLang server fails on every SGLang that returns masks (ServerArgs a msgspec struct from
    # 0.5.20, async_sglang_server.py:375 dataclasses.fields; EngineBase's weight-update session from 0.5.21)
    with pytest.raises(ValueError, match=r"name='sglang': set vllm\. verl 0\.9\.1's SGLang server cannot run"):
        check_verl_config(cfg)
    with pytest.raises(ValueError, match=r"name='trtllm': set vllm or sglang"):
        check_verl_config(composed("replay_fsdp", f"{R}.name=trtllm"))


def test_check_matches_the_manager_to_the_trainer():
    with pytest.raises(ValueError, match=r"agent_loop_manager_class=None: set nemo_replay.*ReplayAgentLoopManager with trainer.use_v1=false"):
        check_verl_config(composed("replay_fsdp", "trainer.use_v1=false"))
    check_verl_config(composed("replay_fsdp", "trainer.use_v1=false",
                               f"+{R}.agent.agent_loop_manager_class=nemo_replay.integrations.verl.agent_loop.ReplayAgentLoopManager"))
    with pytest.raises(ValueError, match=r"agent_loop_manager_class='my.Manager': set null with trainer.use_v1=true"):
        check_verl_config(composed("replay_fsdp", f"+{R}.agent.agent_loop_manager_class=my.Manager"))
    with pytest.raises(ValueError, match=r"custom.replay.enabled=False: set true"):
        check_verl_config(composed("replay_fsdp", f"{R}.custom.replay.enabled=false"))
    check_verl_config(composed("replay_fsdp", "actor_rollout_ref.model.use_fused_kernels=true", f"{R}.custom.replay.source=hidden"))


def test_plugin_registers_replay_in_verl_registries_at_import():
    code = (
        "import verl\n"
        "from verl.workers.rollout.replica import RolloutReplicaRegistry as r\n"
        "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as a\n"
        "print(r._registry['vllm'].__module__, r._registry['sglang'].__module__, r._registry['trtllm'].__module__)\n"
        "print(a['replay_single_turn_agent']['_target_'], a['replay_tool_agent']['_target_'], a['single_turn_agent']['_target_'])\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "nemo_replay.integrations.verl.plugin", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    replicas, loops = out.stdout.strip().splitlines()[-2:]
    assert replicas.split() == ["nemo_replay.integrations.verl.plugin"] * 2 + ["verl.workers.rollout.replica"]
    assert loops.split() == [
        "nemo_replay.integrations.verl.agent_loop.ReplaySingleTurnAgentLoop",
        "nemo_replay.integrations.verl.agent_loop.ReplayToolAgentLoop",
        "verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop",
    ]


# ---------------------------------------------------------------------------------- metrics


def ragged_batch(seed: int = 0, B: int = 5, Rl: int = 9):
    """Rollout, replayed and full-vocabulary log-probs of a ragged batch: replayed = rollout plus a
    small numeric error, full = replayed + log(support mass)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [9, 3, 7, 1, 5][:B]
    mask = torch.zeros(B, Rl, dtype=torch.int64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    mask[0, 4] = 0  # a tool token inside a response
    rollout = -torch.rand(B, Rl, generator=g, dtype=torch.float64) * 3
    replayed = rollout + torch.randn(B, Rl, generator=g, dtype=torch.float64) * 1e-3
    log_mass = torch.log(torch.rand(B, Rl, generator=g, dtype=torch.float64) * 0.5 + 0.4)
    return mask, rollout.float(), replayed.float(), (replayed + log_mass).float(), log_mass.float()


def naive(mask, rollout, replayed, full):
    """float64 loops over the masked tokens."""
    a, b, f = [], [], []
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            if mask[i, j]:
                a.append(float(rollout[i, j])), b.append(float(replayed[i, j])), f.append(float(full[i, j]))
    pd = [abs(math.exp(y) - math.exp(x)) for x, y in zip(a, b)]
    fd = [abs(math.exp(y) - math.exp(x)) for x, y in zip(a, f)]
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    std = lambda v: math.sqrt(sum((x - mean(v)) ** 2 for x in v) / (len(v) - 1))  # noqa: E731
    return {
        "replay/rollout_probs_diff_max": max(pd), "replay/rollout_probs_diff_mean": mean(pd), "replay/rollout_probs_diff_std": std(pd),
        "replay/mismatch_mean": mean([abs(y - x) for x, y in zip(a, b)]), "replay/mismatch_max": max(abs(y - x) for x, y in zip(a, b)),
        "replay/support_mass_mean": mean([math.exp(y - x) for x, y in zip(b, f)]),
        "replay/normalisation_gap_mean": mean([x - y for x, y in zip(b, f)]),
        "replay/full_vocab_probs_diff_max": max(fd), "replay/full_vocab_probs_diff_mean": mean(fd), "replay/full_vocab_probs_diff_std": std(fd),
        "replay/full_vocab_mismatch_mean": mean([abs(y - x) for x, y in zip(a, f)]),
        "replay/full_vocab_mismatch_max": max(abs(y - x) for x, y in zip(a, f)),
    }


def test_metrics_against_float64_loops_and_verls_own_formula():
    mask, rollout, replayed, full, log_mass = ragged_batch()
    got = replay_metrics(replayed, mask, rollout_log_probs=rollout, full_vocab_log_probs=full, flagged_tokens=np.array([1, None, 2], dtype=object))
    ref = naive(mask, rollout, replayed, full)
    for k, v in ref.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert got["replay/rollout_probs_diff_valid"] == 1 and got["replay/flagged_tokens"] == 3.0
    # the same numbers from the log support mass instead of the full-vocabulary log-probs
    by_mass = replay_metrics(replayed, mask, rollout_log_probs=rollout, log_support_mass=log_mass)
    for k in ref:
        assert by_mass[k] == pytest.approx(got[k], rel=1e-5, abs=1e-6), k

    def verl(old):  # verl's training/rollout_probs_diff_* on the same batch (utils/debug/metrics.py:63-123)
        batch = DataProto.from_dict(tensors={"rollout_log_probs": rollout, "old_log_probs": old, "response_mask": mask,
                                             "responses": torch.zeros_like(mask)})
        return calculate_debug_metrics(batch)

    replayed_verl, full_verl = verl(replayed), verl(full)
    for stat in ("max", "mean", "std"):
        assert got[f"replay/rollout_probs_diff_{stat}"] == pytest.approx(replayed_verl[f"training/rollout_probs_diff_{stat}"], rel=1e-4)
        assert got[f"replay/full_vocab_probs_diff_{stat}"] == pytest.approx(full_verl[f"training/rollout_probs_diff_{stat}"], rel=1e-4)
    # the replayed gap is numerics (1e-3 here), the full-vocabulary one the normalisation gap
    assert got["replay/mismatch_mean"] < 2e-3 < got["replay/normalisation_gap_mean"]


def test_metrics_from_a_verl_batch_and_in_the_engine():
    mask, rollout, replayed, full, log_mass = ragged_batch(seed=1)
    B, Rl = mask.shape
    flags = np.empty(B, dtype=object)
    flags[:] = [0, 1, 0, 0, 2]
    batch = DataProto.from_dict(tensors={"rollout_log_probs": rollout, "old_log_probs": replayed, "response_mask": mask,
                                         LOG_SUPPORT_MASS_KEY: log_mass}, non_tensors={"replay_flagged_tokens": flags})
    got = replay_metrics_from_batch(batch)
    ref = naive(mask, rollout, replayed, full)
    assert got["replay/normalisation_gap_mean"] == pytest.approx(ref["replay/normalisation_gap_mean"], rel=1e-5)
    assert got["replay/flagged_tokens"] == 3.0
    with pytest.raises(ValueError, match=r"no \['rollout_log_probs'\].*calculate_log_probs=true"):
        replay_metrics_from_batch(DataProto.from_dict(tensors={"old_log_probs": replayed, "response_mask": mask}))

    # the engine side: verl's unpadded micro-batch (left_right_2_no_padding) and nested outputs
    P = 3
    prompt_mask = torch.ones(B, P, dtype=torch.int64)
    prompt_mask[1, 0] = 0  # left padding
    response_attn = mask.clone()
    response_attn[0, 4] = 1  # the tool token is attended, only out of the loss
    attention = torch.cat([prompt_mask, response_attn], dim=1)
    td = DataProto.from_dict(tensors={
        "prompts": torch.ones(B, P, dtype=torch.int64), "responses": torch.ones(B, Rl, dtype=torch.int64),
        "input_ids": torch.ones(B, P + Rl, dtype=torch.int64), "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "response_mask": mask, "rollout_log_probs": rollout,
    }).to_tensordict()
    td = left_right_2_no_padding(td)

    def nested(values_BR):  # the engine's per-token output: response token j at sequence position P_i + j - 1
        rows = []
        for i in range(B):
            p, r = int(prompt_mask[i].sum()), int(response_attn[i].sum())
            row = torch.zeros(p + r)
            row[p - 1 : p - 1 + r] = values_BR[i, :r]
            rows.append(row)
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)

    metrics = engine_metrics({"log_probs": nested(replayed), "full_vocab_log_probs": nested(full)}, td)
    assert isinstance(metrics["replay/mismatch_max"], Metric) and metrics["replay/mismatch_max"].aggregation == AggregationType.MAX
    assert metrics["replay/mismatch_mean"].aggregation == AggregationType.MEAN
    for k, v in ref.items():
        assert metrics[k].aggregate() == pytest.approx(v, rel=1e-4, abs=1e-6), k


def test_metrics_refuse_bad_input_and_never_give_nan():
    mask, rollout, replayed, full, _ = ragged_batch()
    empty = replay_metrics(replayed, torch.zeros_like(mask), rollout_log_probs=rollout, full_vocab_log_probs=full)
    assert empty["replay/rollout_probs_diff_valid"] == 0 and not any(math.isnan(v) for v in empty.values())
    assert set(empty) == set(replay_metrics(replayed, mask, rollout_log_probs=rollout, full_vocab_log_probs=full)), \
        "the same keys every micro-batch: verl's data-parallel reduction needs as many values from each rank"
    bad = replayed.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"log_probs is nan at trajectory 2, response position 1"):
        replay_metrics(bad, mask, rollout_log_probs=rollout)
    with pytest.raises(ValueError, match=r"has shape \(5, 8\), the response mask \(5, 9\)"):
        replay_metrics(replayed, mask, rollout_log_probs=rollout[:, :8])
    swapped = full.clone()
    swapped[0, 0] = replayed[0, 0] + 0.5
    with pytest.raises(ValueError, match=r"log mass is 0.5.*trajectory 0, response position 0"):
        replay_metrics(replayed, mask, full_vocab_log_probs=swapped)
