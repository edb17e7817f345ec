"""The command line: compare mode, config errors, listings, and the main job under a real torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from nemo_replay.cli import main
from tests.spawn import free_port
from tests.trainer.tiny import tiny

REPO = Path(__file__).resolve().parents[2]


def test_compare_replay_on_vs_off(tmp_path, capsys):
    rc = main(["compare", *tiny(tmp_path, steps=2)])
    out = capsys.readouterr().out
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "NaN" not in (tmp_path / "summary.json").read_text() and summary["effects"]["engine"] == "hf"  # strict JSON
    on, off = summary["replay_on"], summary["replay_off"]
    assert on["mismatch_max"] < 1e-5 and on["first_step_ratio_max_dev"] < 1e-5
    assert off["mismatch_mean"] > 1e-2 and off["first_step_ratio_max_dev"] > 1e-2
    assert on["reward_first"] == off["reward_first"]  # same seed, same weights: same first rollouts
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    assert (tmp_path / "replay-on" / "metrics.jsonl").is_file() and (tmp_path / "replay-off" / "metrics.jsonl").is_file()
    assert "max |rollout - trainer| log-prob" in out and "replay off" in out


def test_config_errors_exit_2_listing_every_problem(capsys):
    rc = main(["train", "generation.temperature=0", "replay.strategy=nope"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "2 problem(s)" in err and "generation.temperature" in err and "registered strategies: fsdp, megatron" in err


def test_listings(capsys):
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fsdp") and "\nmegatron" in out
    assert main(["flags"]) == 0
    assert "replay.sample_support.top_k = None" in capsys.readouterr().out
    assert main(["check", "trainer.steps=4"]) == 0
    assert "steps: 4" in capsys.readouterr().out


def test_usage_help_and_unknown_arguments(capsys):
    assert main([]) == 2  # no command: the usage, exit 2
    err = capsys.readouterr().err
    assert err.startswith("usage: nemo-replay") and "a command is required" in err
    assert main(["train", "--help"]) == 0  # each command its own help
    out = capsys.readouterr().out
    assert out.startswith("usage: nemo-replay train") and "Long runs." in out and "trainer.resume" in out
    assert main(["check", "-h"]) == 0 and capsys.readouterr().out.startswith("usage: nemo-replay check")
    for argv, extra in ((["flags", "extra"], "extra"), (["strategies", "--all"], "--all"), (["train", "--steps", "3"], "--steps")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"nemo-replay {argv[0]}: error: unrecognized arguments: {extra}" in err
    assert main(["bogus"]) == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_empty_recipe_and_missing_pretrained_are_one_error(tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text("")
    assert main(["train", str(tmp_path / "empty.yaml")]) == 2
    assert "is empty (no flags, no defaults)" in capsys.readouterr().err
    for command in ("check", "train"):
        assert main([command, "model.pretrained=/nonexistent/llama"]) == 2
        err = capsys.readouterr().err
        assert "1 problem(s)" in err and "Traceback" not in err and "OSError" not in err
        assert "model.pretrained='/nonexistent/llama': nothing exists at that path" in err
        assert "set model.pretrained=null" in err


def test_a_local_pretrained_folder_trains(tmp_path, capsys):
    """What users pass: a folder saved by transformers (config.json + weights), no hub access."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    overrides = [*tiny(tmp_path / "run", steps=1), f"model.pretrained={tmp_path / 'llama'}"]
    assert main(["check", *overrides]) == 0
    assert f"pretrained: {tmp_path / 'llama'}" in capsys.readouterr().out
    assert main(["train", *overrides]) == 0
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["mismatch_max"] < 1e-5


def test_torchrun_two_processes(tmp_path):
    """The main job under a real `torchrun --nproc-per-node 2` (gloo on CPU): progress lines, JSONL, PNG."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    overrides = [o for o in tiny(tmp_path, steps=2) if not o.startswith(("trainer.progress_bar", "trainer.plot"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "nemo_replay", "train", *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["ratio_max_dev"] < 1e-5 and rows[0]["mismatch_max"] < 1e-5
    assert (tmp_path / "metrics.png").is_file()
    # A pipe, not a terminal: plain progress lines, rank 0 only.
    assert proc.stderr.count("GRPO fsdp replay-on: step 2/2") == 1 and "\r" not in proc.stderr
    assert proc.stdout.count("reward ") == 1  # the summary line, rank 0 only
