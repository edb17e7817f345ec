"""The run's metric files: what a resume keeps of metrics.jsonl."""

from __future__ import annotations

import json

from nemo_replay.trainer.metrics import read_jsonl, restore_rows


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
