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


def test_torchrun_two_processes(tmp_path):
    """The main job under a real `torchrun --nproc-per-node 2` (gloo on CPU): progress bar, JSONL, PNG."""
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
    assert "GRPO fsdp replay-on" in proc.stderr  # tqdm, rank 0 only
    assert proc.stdout.count("reward ") == 1  # the summary line, rank 0 only
