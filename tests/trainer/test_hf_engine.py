"""The main job's rollout engine: generation.engine / generation.dtype, the hf engine, compare's two effects."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_replay.cli import main
from nemo_replay.trainer.backends.hf import build_hf_model
from nemo_replay.trainer.backends.hf_engine import HFEngine
from nemo_replay.trainer.config import load_config
from nemo_replay.trainer.config.errors import ConfigError
from nemo_replay.trainer.config.validation import resolve_engine
from nemo_replay.trainer.generation import SamplingSettings
from nemo_replay.trainer.grpo import GRPOTrainer
from tests.trainer.tiny import tiny


def test_engine_flags_resolve_per_strategy_and_refuse_what_cannot_run():
    assert resolve_engine(load_config()) == "hf"  # fsdp: Hugging Face models
    assert resolve_engine(load_config(overrides=["replay.strategy=megatron"])) == "trainer"
    assert resolve_engine(load_config(overrides=["generation.engine=trainer"])) == "trainer"
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["replay.strategy=megatron", "generation.engine=hf"])
    assert "generation.engine=hf needs a Hugging Face model, but replay.strategy=megatron" in str(err.value)
    assert "set generation.engine=trainer or auto" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["generation.engine=trainer", "generation.dtype=bfloat16", "generation.engine=sglang"])
    assert "generation.engine='sglang' must be one of auto, hf, trainer, vllm" in str(err.value)
    assert resolve_engine(load_config(overrides=["generation.engine=vllm", "generation.dtype=bfloat16"])) == "vllm"
    # megatron too: its GPTModel's weights reach vLLM in the Llama layout (backends/megatron_export.py)
    assert resolve_engine(load_config(overrides=["replay.strategy=megatron", "generation.engine=vllm-server"])) == "vllm-server"
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["generation.engine=trainer", "generation.dtype=bfloat16"])
    assert "generation.dtype=bfloat16 applies to the hf engine's own weights" in str(err.value)
    assert "the trainer engine samples with the trainer's float32 weights" in str(err.value)
    with pytest.raises(ConfigError, match="generation.dtype='fp8' must be one of"):
        load_config(overrides=["generation.dtype=fp8"])
    load_config(overrides=["generation.engine=trainer", "generation.dtype=float32"])  # = model.dtype: allowed


def test_engine_weights_follow_the_policy_and_draws_repeat(tmp_path):
    cfg = load_config(overrides=tiny(tmp_path))
    torch.manual_seed(0)
    policy = build_hf_model(cfg).eval()
    settings = SamplingSettings(temperature=1.0, top_k=6, top_p=0.9, max_new_tokens=4, stop_token_id=5)
    state = torch.random.get_rng_state()
    engine = HFEngine(policy, settings, dtype="bfloat16", device=torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), state)  # building the copy draws nothing from the run's RNG
    prompts = [torch.tensor([3, 4, 5]), torch.tensor([9]), torch.tensor([20, 21])]
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    state = torch.random.get_rng_state()
    first = engine.rollout(policy, prompts, seed=11)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, e), (_, p) in zip(engine.model.named_parameters(), policy.named_parameters()):
        assert e.dtype == torch.bfloat16 and torch.equal(e, p.to(torch.bfloat16)), name
    again = engine.rollout(policy, prompts, seed=11)
    assert torch.equal(first.batch.sequences, again.batch.sequences)
    batch = first.batch
    for i, response in enumerate(first.responses):
        stops = (response == 5).nonzero().flatten().tolist()
        assert stops in ([], [response.numel() - 1])  # a sampled stop token ends the response, kept
        assert int(batch.response_lengths[i]) == response.numel() == int(batch.loss_mask[i].sum())
    assert batch.support.batch_size == 3 and batch.support.num_rows == int(batch.response_lengths.sum())


def test_fp32_engine_matches_the_trainer_bf16_engine_leaves_a_numeric_gap(tmp_path):
    """KV cache in float32: float noise. A bf16 engine: a numeric gap, with the normalisation gap logged apart."""
    fp32 = GRPOTrainer(load_config(overrides=tiny(tmp_path / "fp32", steps=1))).fit().history[0]
    assert fp32["mismatch_max"] < 1e-5 and fp32["ratio_max_dev"] < 1e-5
    assert fp32["normalisation_gap_mean"] > 0.1
    bf16 = GRPOTrainer(load_config(overrides=tiny(tmp_path / "bf16", "generation.dtype=bfloat16", steps=1))).fit().history[0]
    assert 1e-4 < bf16["mismatch_max"] < 0.1
    assert bf16["normalisation_gap_mean"] == pytest.approx(fp32["normalisation_gap_mean"], rel=0.2)
    assert bf16["mismatch_mean"] < 0.1 * bf16["normalisation_gap_mean"]


def test_compare_shows_the_two_effects_apart(tmp_path, capsys):
    rc = main(["compare", *tiny(tmp_path, "generation.dtype=bfloat16", steps=1)])
    out = capsys.readouterr().out
    assert rc == 0
    fx = json.loads((tmp_path / "summary.json").read_text())["effects"]
    assert fx["engine"] == "hf" and fx["engine_dtype"] == "bfloat16" and fx["trainer_dtype"] == "float32"
    assert fx["normalisation_gap_mean"] > 0.1 > fx["numeric_gap_max"] > fx["numeric_gap_mean"] > 1e-5
    assert fx["replay_off_mismatch_mean"] > fx["normalisation_gap_mean"] / 2
    assert "replay removes the normalisation gap" in out and "hf engine (bfloat16, KV cache) leaves a numeric gap" in out
    assert (tmp_path / "compare.png").stat().st_size > 10_000
