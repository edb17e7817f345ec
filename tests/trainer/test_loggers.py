"""Experiment loggers (``trainer.loggers``): what each wrote, read back with its own reader.

One run folder, three processes' worth of runs in one test process, every logger on:

1. steps 0-2, checkpoints after steps 1 and 2; then the step-2 checkpoint is deleted, as if the
   process had been killed while writing it: step 2 is a row past the last checkpoint;
2. the same recipe with ``trainer.steps=4``: resumes after step 1, logs steps 2 and 3;
3. ``trainer.steps=5``: resumes after step 3 (a clean stop), logs step 4.

Each logger's files are then read with that logger's reader (the csv module, TensorBoard's
``EventAccumulator``, W&B's protobuf records from the offline ``.wandb`` files, MLflow's
``MlflowClient`` on the file store) and compared with ``metrics.jsonl``: same steps, same
values, one run.
"""

from __future__ import annotations

import csv
import json
import re
import math
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest

from nemo_replay.trainer.config import ConfigError, load_config
from nemo_replay.trainer.grpo import GRPOTrainer
from nemo_replay.trainer.loggers import IDS_FILE, RunLoggers
from nemo_replay.trainer.loggers.metrics import read_jsonl
from tests.trainer.tiny import tiny

ALL = "trainer.loggers=[jsonl,csv,tensorboard,wandb,mlflow]"


def _run(out: Path, steps: int) -> None:
    cfg = load_config(overrides=tiny(out, ALL, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2", steps=steps))
    GRPOTrainer(cfg).fit()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run folder after the three runs, and the rows of step 2 the first process logged."""
    for extra in ("tensorboard", "wandb", "mlflow"):  # installed by the extras of the same names (in "all")
        pytest.importorskip(extra)
    out = tmp_path_factory.mktemp("loggers") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        mp.delenv("WANDB_PROJECT", raising=False)
        mp.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the logger sets it; restored after
        _run(out, steps=3)
        stale = read_jsonl(out / "metrics.jsonl")[2]
        shutil.rmtree(out / "checkpoints" / "step-0000002")  # killed while writing it
        _run(out, steps=4)
        _run(out, steps=5)
        yield out, stale


def _same(logged, expected) -> bool:
    """A logged value equals the JSONL's (null there is a non-finite number here)."""
    if expected is None:
        return logged is None or not math.isfinite(logged)
    return logged == expected


def _jsonl(out: Path) -> list[dict]:
    return read_jsonl(out / "metrics.jsonl")


def test_jsonl_holds_each_step_once_and_keeps_the_stale_row_aside(run):
    out, stale = run
    rows = _jsonl(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    (aside,) = out.glob("metrics.after-step-1-*.jsonl")
    assert read_jsonl(aside) == [stale]
    assert rows[2]["step_time_s"] != stale["step_time_s"]  # the wall-clock field tells the two step-2 rows apart


def test_csv_is_one_file_with_each_step_once_and_the_stale_row_aside(run):
    out, stale = run
    assert sorted(p.name for p in (out / "csv").iterdir() if not p.name.startswith("metrics.after-step")) == ["metrics.csv"]
    with open(out / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    expected = _jsonl(out)
    assert [int(r["step"]) for r in rows] == [r["step"] for r in expected]
    for got, want in zip(rows, expected):
        assert set(got) == set(want)
        for key, value in want.items():
            assert _same(float(got[key]), value), (want["step"], key, got[key], value)
    (aside,) = (out / "csv").glob("metrics.after-step-1-*.csv")
    with open(aside, newline="") as f:
        (old,) = list(csv.DictReader(f))
    assert int(old["step"]) == 2 and float(old["step_time_s"]) == stale["step_time_s"]


def test_tensorboard_shows_each_step_once_with_the_resumed_values(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, stale = run
    folder = out / "tensorboard"
    assert [p for p in folder.iterdir() if p.is_dir()] == []  # one log folder: no version_1
    assert len(list(folder.glob("events.out.tfevents.*"))) == 3  # one event file per process
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    expected = _jsonl(out)
    keys = set(expected[0]) - {"step"}
    assert set(acc.Tags()["scalars"]) == keys
    import numpy as np

    for key in keys:
        events = acc.Scalars(key)
        assert [e.step for e in events] == [r["step"] for r in expected], key
        for e, want in zip(events, expected):
            # TensorBoard keeps scalars as float32.
            assert _same(e.value, None if want[key] is None else float(np.float32(want[key]))), (key, e.step)
    # The stopped process's step 2 (before the restart marker) is not what the reader shows.
    (shown,) = [e.value for e in acc.Scalars("step_time_s") if e.step == 2]
    assert shown != pytest.approx(stale["step_time_s"], rel=1e-6)


def _wandb_records(path: Path):
    """The records of a W&B transaction log (``run-<id>.wandb``): W&B's protobuf ``Record`` messages.

    The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version), then
    32 KiB blocks of chunks, each ``crc32c (4) | length (2) | type (1)`` and its bytes; type
    1 is a whole record, 2 / 3 / 4 its first / middle / last piece.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    block, pos, pieces = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        pieces += data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record
            pieces = b""


def _wandb_folder_order(folder: Path) -> tuple[str, str, int]:
    """(start second, run id, suffix) of ``offline-run-<YYYYmmdd_HHMMSS>-<id>[-<n>]``: W&B adds
    ``-<n>`` when a process of the same run already made a folder in the same second."""
    found = re.fullmatch(r"offline-run-(\d{8}_\d{6})-([^-]+)(?:-(\d+))?", folder.name)
    assert found, folder.name
    return found[1], found[2], int(found[3] or 0)


def _written(file: Path, timeout_s: float = 30.0) -> Path:
    """``file`` once W&B's writer (its own service process) has written the run's exit record:
    ``finish()`` returns before the last records of an offline run are always on disk."""
    deadline = time.monotonic() + timeout_s
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(file)):
        assert time.monotonic() < deadline, f"{file} has no exit record after {timeout_s} s"
        time.sleep(0.1)
    return file


def test_wandb_keeps_one_offline_run_whose_steps_go_on(run):
    out, stale = run
    run_id = json.loads((out / IDS_FILE).read_text())["wandb"]
    folders = sorted((out / "wandb").glob("offline-run-*"), key=_wandb_folder_order)
    assert [_wandb_folder_order(f)[1] for f in folders] == [run_id] * 3  # one per process, one run id
    logged, config = [], {}  # (folder, step, row) in logging order; the run's config
    for n, folder in enumerate(folders):
        (file,) = folder.glob(f"run-{run_id}.wandb")
        for record in _wandb_records(_written(file)):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id and record.run.project == "nemo_replay"
            elif kind == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                # A key is ``key`` or, as W&B writes flat rows, a one-element ``nested_key``.
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                assert row["_step"] == row["trainer/global_step"]
                logged.append((n, row["_step"], row))
    # Each process logs the steps it ran; only the step past the first checkpoint comes twice.
    assert [(n, step) for n, step, _ in logged] == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 3), (2, 4)]
    assert logged[2][2]["step_time_s"] == stale["step_time_s"]
    latest = {step: row for _, step, row in logged}  # the later folder's value of each step
    expected = _jsonl(out)
    assert sorted(latest) == [r["step"] for r in expected]
    for want in expected:
        got = latest[want["step"]]
        for key, value in want.items():
            if key != "step":
                assert _same(got[key], value), (want["step"], key)
    assert config["trainer"]["loggers"] == ["jsonl", "csv", "tensorboard", "wandb", "mlflow"]  # the recipe
    assert "wandb: the offline files of run" in (out / "resume.log").read_text()


def test_mlflow_keeps_one_run_in_the_run_folders_file_store(run):
    from mlflow.tracking import MlflowClient

    out, stale = run
    run_id = json.loads((out / IDS_FILE).read_text())["mlflow"]
    client = MlflowClient((out / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "nemo_replay"]
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_id == run_id and found.info.status == "FINISHED"
    assert found.data.params["trainer/steps"] == "3"  # the recipe, as params, when the run was made
    expected = _jsonl(out)
    for key in set(expected[0]) - {"step"}:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        steps = [m.step for m in history]
        # Step 2 twice: the stopped process's value, then the resumed one's (MLflow cannot delete).
        assert steps == [0, 1, 2, 2, 3, 4], key
        latest = {m.step: m.value for m in history}
        for want in expected:
            assert _same(latest[want["step"]], want[key]), (key, want["step"])
        if key == "step_time_s":
            assert history[2].value == stale["step_time_s"]
    assert "mlflow: run " + run_id in (out / "resume.log").read_text()


def test_the_resumes_are_in_the_runs_log(run):
    out, _ = run
    log = (out / "resume.log").read_text()
    assert "rows of steps after 1 (written after that checkpoint) moved to metrics.after-step-1-" in log
    assert "csv: rows of steps after 1 moved to" in log
    assert "tensorboard: step 2 the stopped process logged past step 1 hidden by" in log
    assert log.count("wandb:") == 1 and log.count("mlflow:") == 1  # the clean resume has nothing to say


def test_a_logger_new_to_a_resumed_folder_writes_the_checkpoints_rows_first(tmp_path, monkeypatch):
    """Rows with a tensor, a non-finite value and text: numbers go everywhere, text to the JSONL only."""
    import torch

    MlflowClient = pytest.importorskip("mlflow.tracking").MlflowClient
    EventAccumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator").EventAccumulator

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    rows = [{"step": 0, "reward": torch.tensor(0.25), "kl": float("nan"), "peak": float("inf"), "note": "text"},
            {"step": 1, "reward": 0.5, "kl": 0.125, "peak": 2.0, "note": "more"}]
    loggers = RunLoggers(["jsonl", "csv", "tensorboard", "mlflow"], tmp_path, active=True)
    assert loggers.start("resume", rows, hparams={"trainer": {"steps": 3}}) == []
    loggers.log({"reward": 0.75, "kl": 0.0, "peak": 1.0, "note": "last"}, step=2)
    loggers.close("stopped")
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 0, "reward": 0.25, "kl": None, "peak": None, "note": "text"},
        {"step": 1, "reward": 0.5, "kl": 0.125, "peak": 2.0, "note": "more"},
        {"step": 2, "reward": 0.75, "kl": 0.0, "peak": 1.0, "note": "last"},
    ]
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert table == [
        {"kl": "nan", "peak": "inf", "reward": "0.25", "step": "0"},
        {"kl": "0.125", "peak": "2.0", "reward": "0.5", "step": "1"},
        {"kl": "0.0", "peak": "1.0", "reward": "0.75", "step": "2"},
    ]
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["kl", "peak", "reward"]
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(0, 0.25), (1, 0.5), (2, 0.75)]
    assert math.isnan(acc.Scalars("kl")[0].value) and acc.Scalars("peak")[0].value == math.inf
    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    run_id = json.loads((tmp_path / IDS_FILE).read_text())["mlflow"]
    assert sorted(client.get_run(run_id).data.metrics) == ["kl", "peak", "reward"]
    kl = sorted(client.get_metric_history(run_id, "kl"), key=lambda m: m.step)
    assert math.isnan(kl[0].value) and [m.value for m in kl[1:]] == [0.125, 0.0]
    # A stop signal ends the MLflow run as KILLED; the resume reopens that run, which then finishes.
    assert client.get_run(run_id).info.status == "KILLED"
    again = RunLoggers(["jsonl", "mlflow"], tmp_path, active=True)
    again.start("resume", [*rows, {"step": 2, "reward": 0.75}])
    assert client.get_run(run_id).info.status == "RUNNING"
    again.close("success")
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED" and finished.data.params == {"trainer/steps": "3"}
    assert [r.info.run_id for r in client.search_runs([finished.info.experiment_id])] == [run_id]


def test_unknown_logger_names_are_refused_listing_the_known_ones():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["trainer.loggers=[jsonl,tensorbord,neptune]"])
    assert info.value.problems == [
        "trainer.loggers: unknown logger 'tensorbord' (did you mean tensorboard?); known loggers: jsonl, csv, "
        "tensorboard, wandb, mlflow. Fix the name or remove it",
        "trainer.loggers: unknown logger 'neptune'; known loggers: jsonl, csv, tensorboard, wandb, mlflow. "
        "Fix the name or remove it",
    ]
    with pytest.raises(ConfigError, match=r"leaves out jsonl.*list it: trainer.loggers=\[jsonl,csv\]"):
        load_config(overrides=["trainer.loggers=[csv]"])


@pytest.mark.parametrize("name, modules", [("tensorboard", ("tensorboard", "tensorboardX")), ("wandb", ("wandb",)),
                                           ("mlflow", ("mlflow",))])
def test_a_logger_whose_package_is_missing_is_a_config_error_naming_the_extra(name, modules, monkeypatch, tmp_path):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed, in this process only
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"trainer.loggers=[jsonl,{name}]"])
    (problem,) = info.value.problems
    assert problem.startswith(f"trainer.loggers: {name} needs the {' or '.join(modules)} package, which is not installed")
    assert f'pip install "nemo_replay[{name}]"' in problem
    # A recipe that skipped validation fails the same way when its loggers open, before any row.
    with pytest.raises(ValueError, match=rf'pip install "nemo_replay\[{name}\]"'):
        RunLoggers(["jsonl", name], tmp_path, active=True).start("new")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_csv_taken_back_from_a_start_killed_between_its_hold_and_its_rewrite(tmp_path):
    """A start killed after holding metrics.csv aside (and after the writer began an empty file):
    the next start takes the held rows back, moving the step past the checkpoint aside."""
    pytest.importorskip("lightning")
    from nemo_replay.trainer.loggers import _Csv

    folder = tmp_path / "csv"
    folder.mkdir()
    (folder / ".metrics.csv.held").write_text("reward,step\n0.5,0\n0.25,1\n0.75,2\n")
    (folder / "metrics.csv").write_text("")  # the writer's empty file
    rows = [{"step": 0, "reward": 0.5}, {"step": 1, "reward": 0.25}]
    note = _Csv(tmp_path).start("resume", rows, {}, {}, [])
    with open(folder / "metrics.csv", newline="") as f:
        assert [(r["step"], r["reward"]) for r in csv.DictReader(f)] == [("0", "0.5"), ("1", "0.25")]
    (aside,) = folder.glob("metrics.after-step-1-*.csv")
    assert aside.read_text().splitlines() == ["reward,step", "0.75,2"]
    assert not (folder / ".metrics.csv.held").exists() and "moved to" in note


def test_rows_written_under_the_old_metric_names_read_under_todays(tmp_path):
    """A run folder from before diagnostics gave one spelling (support_mass, normalisation_gap) resumes and
    compares whole: its rows read back under support_mass_mean / normalisation_gap_mean."""
    from nemo_replay.trainer.loggers.metrics import read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "support_mass": 0.8, "normalisation_gap": 0.3, "mismatch_mean": 1e-7}\n'
                    '{"step": 1, "support_mass_mean": 0.7, "normalisation_gap_mean": 0.4, "mismatch_mean": 2e-7}\n')
    rows = read_jsonl(path)
    assert [r["support_mass_mean"] for r in rows] == [0.8, 0.7]
    assert [r["normalisation_gap_mean"] for r in rows] == [0.3, 0.4]
    assert not any("support_mass" in r or "normalisation_gap" in r for r in rows)
