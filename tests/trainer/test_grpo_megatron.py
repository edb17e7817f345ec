"""GRPO trainer steps with the megatron strategy: a real megatron-core GPTModel on CPU ranks.

The test-only shims of tests/strategies/megatron/cpu_shims.py are installed in each spawned worker
(CPU device for megatron's CUDA calls; the missing ``te_general_gemm`` name for MoE
without Transformer Engine); process groups, layers and schedules are megatron-core's own.
"""

from __future__ import annotations

import pytest

from tests.trainer.distributed_runs import phase


def test_megatron_steps_tp1_tp2_and_moe_route_replay(spawned_runs):
    # TP = 1 and MoE on one rank; TP = 2 a phase of the shared two-rank spawn (tests/trainer/distributed_runs.py).
    tp1, moe = spawned_runs["one"]
    tp2 = [phase(rank, "megatron_tp2") for rank in spawned_runs["two"]]
    assert tp2[0]["history"] == tp2[1]["history"]
    tp2 = tp2[0]
    for run in (tp1, tp2, moe):
        first, second = run["history"]
        assert abs(first["ratio_mean"] - 1) < 1e-5 and first["ratio_max_dev"] < 1e-5
        assert first["mismatch_max"] < 1e-5 and second["ratio_max_dev"] < 1e-5
    # TP = 2 splits the same weights: same rollouts, same update.
    for a, b in zip(tp1["history"], tp2["history"]):
        assert a["reward"] == b["reward"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-6)
    # R3: one recorded route row per real token, expert ids in range.
    probe = moe["probe"]
    assert probe["route_rows"] == probe["tokens"]
    assert 0 <= probe["route_range"][0] and probe["route_range"][1] < 4
