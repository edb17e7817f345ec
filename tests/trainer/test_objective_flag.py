"""``trainer.objective``: the reference trainer's policy loss chosen from the recipe (it was
always the token-ratio objective), checked like every other flag."""

from __future__ import annotations

import pytest

from nemo_replay.objectives import SequenceRatioObjective, TokenRatioObjective, TruncatedISObjective
from nemo_replay.trainer.config import load_config
from nemo_replay.trainer.grpo import GRPOTrainer, make_objective
from tests.trainer.tiny import tiny


def test_each_objective_is_built_from_the_recipe_and_bad_values_are_named(tmp_path):
    cfg = lambda *o: load_config(overrides=tiny(tmp_path / "x", *o, steps=1))  # noqa: E731
    assert make_objective(cfg()) == TokenRatioObjective(clip_eps=0.2, kl_coef=0.01)
    assert make_objective(cfg("trainer.objective=sequence_ratio", "trainer.clip_eps=3e-4")) == SequenceRatioObjective(
        clip_eps=3e-4, clip_eps_high=None, kl_coef=0.01)
    assert make_objective(cfg("trainer.objective=tis", "trainer.tis_cap=1.5")) == TruncatedISObjective(
        cap=1.5, clip_eps=0.2, kl_coef=0.01)
    with pytest.raises(ValueError, match=r"trainer.objective='gspo' must be one of token_ratio, sequence_ratio, tis"):
        cfg("trainer.objective=gspo")
    with pytest.raises(ValueError, match=r"trainer.tis_cap=0.0 must be > 0"):
        cfg("trainer.objective=tis", "trainer.tis_cap=0")
    with pytest.raises(ValueError, match=r"objective=tis with trainer.old_logprobs='rollout': the weight exp\(old - rollout\) "
                                         r"is then 1 everywhere; set trainer.old_logprobs=recompute"):
        cfg("trainer.objective=tis", "trainer.old_logprobs=rollout")


def test_a_run_trains_with_truncated_is_and_logs_its_weights(tmp_path):
    """With replay the old-policy pass reproduces the engine's log-probs, so the first step's
    importance weights are 1 to float tolerance, and none reaches the cap."""
    trainer = GRPOTrainer(load_config(overrides=tiny(tmp_path / "run", "trainer.objective=tis", steps=2)))
    assert isinstance(trainer.objective, TruncatedISObjective)
    first = trainer.fit().history[0]
    assert abs(first["tis_weight_mean"] - 1) < 1e-5 and first["tis_truncated_fraction"] == 0.0
    assert first["ratio_max_dev"] < 1e-5
