"""The run's metric files: what a resume keeps of metrics.jsonl; summary.json as strict JSON."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_replay.trainer.loggers.metrics import read_jsonl, restore_rows, write_summary


def test_restore_rows_moves_later_and_torn_rows_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    checkpointed = [{"step": 0, "reward": 0.25}, {"step": 1, "reward": 0.5}]
    # Steps 0..2 were logged, then the process died while appending step 3: its line is torn.
    logged = [{"step": 0, "reward": 0.0}, {"step": 1, "reward": 0.125}, {"step": 2, "reward": 0.75}]
    path.write_text("".join(json.dumps(r) + "\n" for r in logged) + '{"step": 3, "rew')
    side = restore_rows(path, checkpointed)
    assert read_jsonl(path) == checkpointed  # exactly the checkpoint's rows, ready to append to
    assert side is not None and side.name.startswith("metrics.after-step-1-")
    assert side.read_text() == json.dumps({"step": 2, "reward": 0.75}) + "\n" + '{"step": 3, "rew\n'
    # Nothing past the checkpoint: no side file.
    assert restore_rows(path, checkpointed) is None and read_jsonl(path) == checkpointed


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_write_summary_is_strict_json_at_every_depth(tmp_path):
    # compare's summary nests each run's summary and the effects; a run without support mass has a NaN gap.
    summary = {
        "replay_on": {"steps": 2, "mismatch_max": torch.tensor(1e-7), "kl": float("nan")},
        "effects": {"normalisation_gap_mean": float("nan"), "numeric_gap_max": float("inf"), "engine": "hf"},
        "rows": [1.0, float("-inf")],
        "reward": 0.5,
    }
    path = write_summary(tmp_path / "summary.json", summary)
    assert _strict(path.read_text()) == {
        "replay_on": {"steps": 2, "mismatch_max": pytest.approx(1e-7), "kl": None},
        "effects": {"normalisation_gap_mean": None, "numeric_gap_max": None, "engine": "hf"},
        "rows": [1.0, None],
        "reward": 0.5,
    }
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left behind
