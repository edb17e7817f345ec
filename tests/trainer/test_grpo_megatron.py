"""GRPO trainer steps with the megatron strategy: a real megatron-core GPTModel on CPU ranks.

The test-only shims of tests/strategies/megatron/cpu_shims.py are installed in each spawned worker
(CPU device for megatron's CUDA calls; the missing ``te_general_gemm`` name for MoE
without Transformer Engine); process groups, layers and schedules are megatron-core's own.
"""

from __future__ import annotations

import pytest

from tests.spawn import run_workers
from tests.trainer.tiny import tiny

MOE = ["model.num_experts=4", "model.moe_top_k=2", "replay.route_replay=true"]


def _megatron_runs(rank, world, out_dir, runs):
    from tests.strategies.megatron.cpu_shims import install_cpu_shims, install_moe_without_te_shim

    install_cpu_shims()
    install_moe_without_te_shim()
    from nemo_replay.trainer.config import load_config
    from nemo_replay.trainer.grpo import GRPOTrainer

    results = []
    for i, extra in enumerate(runs):
        overrides = tiny(f"{out_dir}/{i}", "replay.strategy=megatron", *extra, steps=2)
        trainer = GRPOTrainer(load_config(overrides=overrides, world_size=world))
        probe = None
        if "replay.route_replay=true" in extra:
            batch, _ = trainer.rollout()  # one extra rollout to look at the recorded routes
            probe = {
                "route_rows": batch.routes.lengths.tolist(),
                "tokens": batch.attention_mask.sum(1).tolist(),
                "route_range": (int(batch.routes.values.min()), int(batch.routes.values.max())),
            }
        results.append({"history": trainer.fit().history, "probe": probe})
    return results


def test_megatron_steps_tp1_tp2_and_moe_route_replay(tmp_path):
    tp1, moe = run_workers(_megatron_runs, 1, str(tmp_path / "w1"), [[], MOE])[0]
    tp2 = run_workers(_megatron_runs, 2, str(tmp_path / "w2"), [["parallel.tensor=2"]])
    assert tp2[0][0]["history"] == tp2[1][0]["history"]
    tp2 = tp2[0][0]
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
