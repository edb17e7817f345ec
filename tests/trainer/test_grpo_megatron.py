"""GRPO trainer steps with the megatron strategy: a real megatron-core GPTModel on CPU ranks.

The two test-only CPU shims (tests/megatron/cpu_shims.py) are installed in each spawned
worker; process groups, layers and schedules are megatron-core's own.
"""

from __future__ import annotations

import pytest

from tests.spawn import run_workers
from tests.trainer.tiny import tiny


def _megatron_run(rank, world, out_dir, extra):
    from tests.megatron.cpu_shims import install_cpu_shims

    install_cpu_shims()
    from nemo_replay.config import load_config
    from nemo_replay.trainer.grpo import GRPOTrainer

    overrides = tiny(out_dir, "replay.strategy=megatron", "model.hidden_size=32", *extra, steps=2)
    return GRPOTrainer(load_config(overrides=overrides, world_size=world)).fit().history


def test_megatron_tp1_and_tp2_first_step_ratio_is_one(tmp_path):
    tp1 = run_workers(_megatron_run, 1, str(tmp_path / "tp1"), [])[0]
    tp2 = run_workers(_megatron_run, 2, str(tmp_path / "tp2"), ["parallel.tensor=2"])
    assert tp2[0] == tp2[1]
    for history in (tp1, tp2[0]):
        first = history[0]
        assert abs(first["ratio_mean"] - 1) < 1e-5 and first["ratio_max_dev"] < 1e-5
        assert first["mismatch_max"] < 1e-5
        assert history[1]["ratio_max_dev"] < 1e-5
    # TP = 2 splits the same weights: same rollouts, same update.
    for a, b in zip(tp1, tp2[0]):
        assert a["reward"] == b["reward"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-6)
