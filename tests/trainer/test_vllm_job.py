"""The main job on a running vLLM (``configs/vllm.yaml``): ``nemo-replay compare`` as a user runs
it, in a process of its own (vLLM starts its engine in child processes, which import the
command's module again: ``python -m nemo_replay`` must not run twice).

With replay on, every step's rollout-trainer gap stays at float noise while the weights change
step by step (each rollout comes after a weight sync); with replay off, the full-vocabulary gap
shows at every step. Marked ``vllm``; skipped where vLLM does not import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.vllm_marks import vllm_marks

pytestmark = vllm_marks()

REPO = Path(__file__).resolve().parents[2]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_compare_on_a_live_vllm_every_step(tmp_path):
    steps = 4
    cmd = [sys.executable, "-m", "nemo_replay", "compare", "configs/vllm.yaml", f"trainer.steps={steps}",
           f"trainer.output_dir={tmp_path}", "trainer.progress_bar=false", "trainer.prompts_per_step=8",
           "trainer.group_size=4"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    on, off = _rows(tmp_path / "replay-on" / "metrics.jsonl"), _rows(tmp_path / "replay-off" / "metrics.jsonl")
    assert [r["step"] for r in on] == list(range(steps)) == [r["step"] for r in off]
    assert all(r["mismatch_max"] <= 1e-3 for r in on), [r["mismatch_max"] for r in on]
    assert all(r["mismatch_max"] > 0.1 for r in off), [r["mismatch_max"] for r in off]
    assert all(r["grad_norm"] > 0 for r in on)  # the weights the engine reloads do change
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["effects"]["engine"] == "vllm"
    assert summary["replay_on"]["reward_first"] == summary["replay_off"]["reward_first"]  # same first rollouts
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    assert "the vllm engine (float32, KV cache)" in run.stdout


def test_train_on_a_vllm_server_every_step(tmp_path):
    """generation.engine=vllm-server: the job starts a vLLM server on 127.0.0.1, samples over HTTP,
    reloads the weights through the server before every rollout, and stops it at the end."""
    steps = 3
    cmd = [sys.executable, "-m", "nemo_replay", "train", "configs/vllm.yaml", "generation.engine=vllm-server",
           f"trainer.steps={steps}", f"trainer.output_dir={tmp_path}", "trainer.progress_bar=false",
           "trainer.prompts_per_step=8", "trainer.group_size=4"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["mismatch_max"] <= 1e-3 for r in rows), [r["mismatch_max"] for r in rows]
    assert all(r["full_vocab_mismatch_max"] > 0.1 for r in rows)
