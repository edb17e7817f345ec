"""GRPO trainer steps with the fsdp strategy in one process (FSDP2 / Ulysses ranks: tests/trainer/test_spawned_runs.py)."""

from __future__ import annotations

import json

import torch

from nemo_replay.trainer.config import load_config
from nemo_replay.trainer.grpo import GRPOTrainer
from nemo_replay.trainer.tasks import SuccessorTask
from tests.trainer.tiny import tiny

DIAGNOSTICS = {"reward", "mismatch_mean", "mismatch_max", "ratio_mean", "ratio_max_dev", "kl", "clip_fraction", "loss", "grad_norm"}


def test_successor_reward_worked_example():
    task = SuccessorTask(32, 2, 2, 4)
    r = task.rewards([torch.tensor([30, 31]), torch.tensor([3, 4])], [torch.tensor([0, 1, 5, 6]), torch.tensor([5, 6, 7, 8])])
    assert r.tolist() == [0.75, 1.0]
    for p in task.prompts(5, torch.Generator().manual_seed(0)):
        assert ((p[1:] - p[:-1]) % 32 == 1).all() and len(p) == 2


def test_replay_on_first_step_ratio_is_one(tmp_path):
    cfg = load_config(overrides=tiny(tmp_path, "trainer.kl_coef=0.05", steps=2))
    result = GRPOTrainer(cfg).fit()
    first = result.history[0]
    assert DIAGNOSTICS | {"support_mass_mean"} <= set(first)
    assert abs(first["ratio_mean"] - 1) < 1e-5 and first["ratio_max_dev"] < 1e-5
    assert first["mismatch_max"] < 1e-5
    assert 0 < first["support_mass_mean"] < 1
    assert 0 <= first["kl"] < 1e-2  # policy == reference until the first of two updates
    assert result.history[1]["kl"] > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and rows[0]["ratio_max_dev"] == first["ratio_max_dev"]
    assert (tmp_path / "config.yaml").is_file()


def test_replay_off_shows_the_mismatch(tmp_path):
    cfg = load_config(overrides=tiny(tmp_path, "replay.enabled=false", "trainer.old_logprobs=rollout", steps=1))
    first = GRPOTrainer(cfg).fit().history[0]
    assert first["mismatch_mean"] > 1e-2 and first["ratio_max_dev"] > 1e-2
    assert "support_mass_mean" not in first
    # old log-probs from the rollout: the PPO ratio itself is off from the first step.
    assert first["ratio_old_max_dev"] > 1e-2
