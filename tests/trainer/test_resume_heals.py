"""Resume that heals: unloadable checkpoints set aside, runs killed before their first checkpoint
restarted, deliberate optimizer changes on resume, a diverged run reported as failed.

In-process runs of the reference trainer on the tiny recipe (one process, Fabric's format);
the diverged run goes through the real command line for its exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from nemo_replay.cli import main
from nemo_replay.trainer.config import load_config
from nemo_replay.trainer.grpo import GRPOTrainer
from nemo_replay.trainer.rundir import check_overrides
from tests.trainer.tiny import tiny

REPO = Path(__file__).resolve().parents[2]


def _trainer(out, *extra, steps, **kwargs) -> GRPOTrainer:
    return GRPOTrainer(load_config(overrides=tiny(out, *extra, steps=steps)), **kwargs)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_newest_checkpoint_that_does_not_load_is_set_aside_and_the_one_before_resumes(tmp_path):
    out = tmp_path / "run"
    keep = ("trainer.checkpoint_every=1", "trainer.keep_checkpoints=3")
    _trainer(out, *keep, steps=3).fit()
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-0000000", "step-0000001", "step-0000002"]
    # complete.json intact; the state truncated in the newest, missing in the next.
    state = ckpts / "step-0000002" / "state"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    (ckpts / "step-0000001" / "state").unlink()
    trainer = _trainer(out, *keep, steps=4)
    assert trainer.start_step == 1 and trainer.run_dir.resume.step == 0
    aside = sorted(p.name for p in ckpts.glob(".unloadable-*"))
    assert [a.rsplit("-", 1)[0] for a in aside] == [".unloadable-step-0000001", ".unloadable-step-0000002"]
    log = (out / "resume.log").read_text()
    assert "checkpoint" in log and "step-0000002 does not load" in log and "resuming from step-0000000" in log
    assert [r["step"] for r in trainer.fit().history] == [0, 1, 2, 3]
    # None left that loads: the error names what to delete.
    (ckpts / "step-0000003" / "state").write_bytes(b"")
    for folder in ckpts.glob("step-*"):
        if folder.name != "step-0000003":
            (folder / "state").unlink()
    with pytest.raises(ValueError, match=rf"no checkpoint of {out} loads .*delete {ckpts} and run the same command"):
        _trainer(out, *keep, steps=5)


def test_a_run_killed_before_its_first_checkpoint_starts_again_under_the_same_recipe(tmp_path):
    out = tmp_path / "run"
    _trainer(out, "trainer.checkpoint_every=50", steps=2).fit()  # as if killed before step 49: rows, no checkpoint
    for p in (out / "checkpoints").iterdir():
        import shutil

        shutil.rmtree(p)
    rows = (out / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="with a recipe that differs in trainer.seed") as info:
        _trainer(out, "trainer.checkpoint_every=50", "trainer.seed=7", steps=2)
    assert "checkpoint_every > 0" not in str(info.value)
    trainer = _trainer(out, "trainer.checkpoint_every=50", steps=3)
    assert trainer.start_step == 0
    (aside,) = out.glob("metrics.after-step--1-*.jsonl")
    assert aside.read_text() == rows  # moved aside, not lost
    assert _steps(out / "metrics.jsonl") == [] if (out / "metrics.jsonl").exists() else True
    assert [r["step"] for r in trainer.fit().history] == [0, 1, 2]
    assert "starting again at step 0" in (out / "resume.log").read_text()


def test_a_deliberate_optimizer_change_on_resume_is_allowed_by_name_and_recorded(tmp_path):
    out = tmp_path / "run"
    _trainer(out, "trainer.checkpoint_every=1", steps=2).fit()
    with pytest.raises(ValueError, match=r"differs in trainer.lr: 0.001 -> 0.0001.*--resume-override trainer.lr"):
        _trainer(out, "trainer.checkpoint_every=1", "trainer.lr=1e-4", steps=3)
    with pytest.raises(ValueError, match="--resume-override model.hidden_size: only the optimizer and objective"):
        check_overrides(["model.hidden_size"])
    trainer = _trainer(out, "trainer.checkpoint_every=1", "trainer.lr=1e-4", steps=3, resume_overrides=["trainer.lr"])
    assert trainer.start_step == 2
    assert {g["lr"] for g in trainer.optimizer.param_groups} == {1e-4}  # not the checkpoint's 1e-3
    assert "trainer.lr: 0.001 -> 0.0001" in (out / "resume.log").read_text()
    trainer.fit()
    # The change is the run's recipe from now on: the next resume needs no flag.
    again = _trainer(out, "trainer.checkpoint_every=1", "trainer.lr=1e-4", steps=4)
    assert again.start_step == 3
    again.run_dir.release()


def test_a_diverged_run_exits_1_with_its_summary_and_goes_on_with_a_smaller_lr(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))

    def args(lr, *extra, steps):
        return ["train", *tiny(out, "trainer.checkpoint_every=2", steps=steps), f"trainer.lr={lr}", *extra]

    def train(lr, *extra, steps):
        cmd = [sys.executable, "-m", "nemo_replay", *args(lr, *extra, steps=steps)]
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    # The runs around the diverged one go through the same command line in this process.
    assert main(args("1e-3", steps=2)) == 0  # checkpoint after step 1
    # Raised on purpose, it diverges: step 2's first update throws the weights far, the next gradient is NaN.
    bad = train("1e6", "--resume-override", "trainer.lr", steps=4)
    assert bad.returncode == 1, bad.stderr[-2000:]  # README: 1 a failed run (it was 2, a usage error)
    assert "step 2, minibatch 1: the gradient norm is nan" in bad.stderr and "--resume-override" in bad.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"].startswith("step 2, minibatch 1: ") and summary["steps"] == 2
    # The fix the message names goes on from the last checkpoint (step 1), recorded in the run's log.
    assert main(args("1e-3", "--resume-override", "trainer.lr", steps=4)) == 0
    assert _steps(out / "metrics.jsonl") == [0, 1, 2, 3]
    # The diverged attempt wrote no checkpoint: the step-1 one (lr 0.001) is the recipe resumed.
    assert "trainer.lr: 0.001 -> 1000000.0" in (out / "resume.log").read_text()
    assert "lr: 0.001" in (out / "config.yaml").read_text()


def test_a_full_disk_leaves_no_temp_file_and_the_next_start_removes_partial_folders(tmp_path, monkeypatch):
    import errno

    from nemo_replay.trainer.loggers import metrics

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        metrics.write_summary(tmp_path / "summary.json", {"steps": 1})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no .summary.json.<pid>.tmp left
    out = tmp_path / "run"
    _trainer(out, "trainer.checkpoint_every=1", steps=1).fit()
    (out / "checkpoints" / ".partial-step-0000001-abcdef" / "state").mkdir(parents=True)  # a save the disk stopped
    trainer = _trainer(out, "trainer.checkpoint_every=1", steps=2)
    assert not list((out / "checkpoints").glob(".partial-*"))  # its space is free before the first step
    assert "removed .partial-step-0000001-abcdef" in (out / "resume.log").read_text()
    trainer.run_dir.release()


def test_a_single_process_checkpoint_is_staged_next_to_the_output_not_in_tmpdir(tmp_path, monkeypatch):
    """Fabric's single-file save staged the whole checkpoint in $TMPDIR (fsspec's transaction): a
    small $TMPDIR failed the save with the output disk free. Every temporary file of the save now
    lies in the checkpoint's own folder, and the state loads back."""
    import tempfile

    import torch
    from lightning.fabric import Fabric

    from nemo_replay.trainer.rundir.checkpoint import _FabricFormat

    staged = []
    real = tempfile.mkstemp

    def recording(*args, **kwargs):
        fd, name = real(*args, **kwargs)
        staged.append(name)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", recording)
    fabric = Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    folder = tmp_path / "out" / ".partial-step-0000001"
    folder.mkdir(parents=True)
    _FabricFormat().save(fabric, folder, model, optimizer, {"step": 1})
    assert staged and all(Path(name).parent == folder for name in staged), staged
    assert tempfile.tempdir != str(folder)  # restored after the save
    fresh = torch.nn.Linear(4, 3)
    again = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert _FabricFormat().load(fabric, folder, fresh, again) == {"step": 1}
    assert torch.equal(fresh.weight, model.weight)


def test_a_checkpoint_that_would_not_fit_is_refused_before_writing_naming_path_and_space(tmp_path, monkeypatch):
    """A full disk gave a raw OSError mid-save and a .partial folder that kept the space; the save
    now checks the free space against the last checkpoint's size first and writes nothing."""
    import errno
    import shutil
    from types import SimpleNamespace

    import torch
    from lightning.fabric import Fabric

    from nemo_replay.trainer.rundir import checkpoint as ck

    fabric = Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    root = tmp_path / "checkpoints"
    store = ck.Checkpointer(root, fabric, every=1, keep=0, config="x: 1\n")
    rank_state = {}
    store.save(0, model, optimizer, history=[], rank_state=rank_state)
    size = sum(f.stat().st_size for f in (root / "step-0000000").rglob("*") if f.is_file())
    real = shutil.disk_usage
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: SimpleNamespace(free=size // 2, total=real(p).total))
    with pytest.raises(OSError) as err:
        store.save(1, model, optimizer, history=[], rank_state=rank_state)
    assert err.value.errno == errno.ENOSPC
    assert str(root) in str(err.value) and "a checkpoint needs about" in str(err.value) and "step-0000000" in str(err.value)
    assert sorted(p.name for p in root.iterdir()) == ["step-0000000"]  # no .partial folder left
    monkeypatch.setattr(ck.shutil, "disk_usage", real)
    assert store.save(1, model, optimizer, history=[], rank_state=rank_state).name == "step-0000001"


def test_a_bit_flipped_checkpoint_is_set_aside_by_its_digest_and_a_torn_manifest_is_named(tmp_path):
    """A flipped bit loads without an error: only the digest recorded in complete.json tells.
    A complete.json that does not parse was skipped silently; now it is moved aside and named."""
    out = tmp_path / "run"
    keep = ("trainer.checkpoint_every=1", "trainer.keep_checkpoints=3")
    straight = _trainer(tmp_path / "straight", *keep, steps=3).fit().history
    _trainer(out, *keep, steps=3).fit()
    ckpts = out / "checkpoints"
    manifest = json.loads((ckpts / "step-0000002" / "complete.json").read_text())
    assert sorted(manifest["files"]) == ["state"] and manifest["files"]["state"][0] == (ckpts / "step-0000002" / "state").stat().st_size
    state = ckpts / "step-0000002" / "state"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit; the size unchanged
    state.write_bytes(bytes(data))
    (ckpts / "step-0000001" / "complete.json").write_text('{"step": 1, "world_')  # torn
    trainer = _trainer(out, *keep, steps=3)
    assert trainer.start_step == 1
    log = (out / "resume.log").read_text()
    assert "step-0000001 has no readable complete.json (JSONDecodeError" in log, log
    assert "step-0000002 does not load: state does not hold the bytes written (SHA-256" in log, log
    assert "resuming from step-0000000" in log
    assert sorted(p.name.rsplit("-", 1)[0] for p in ckpts.glob(".unloadable-*")) == [
        ".unloadable-step-0000001", ".unloadable-step-0000002"]
    from tests.trainer.distributed_runs import rows

    assert rows(trainer.fit().history) == rows(straight)  # the corrupted weights never trained


def test_a_loader_error_of_any_kind_sets_the_checkpoint_aside(tmp_path, monkeypatch):
    """torch DCP raises CheckpointException, a BaseException: it was not caught, and every
    resume died on it. Any exception of the loader's now sets the checkpoint aside; a stop
    (KeyboardInterrupt) still stops."""
    from torch.distributed.checkpoint.api import CheckpointException

    from nemo_replay.trainer.rundir import checkpoint as ck

    out = tmp_path / "run"
    keep = ("trainer.checkpoint_every=1", "trainer.keep_checkpoints=3")
    _trainer(out, *keep, steps=2).fit()
    real = ck._FabricFormat.load
    calls = []

    def failing_once(self, fabric, folder, model, optimizer):
        calls.append(folder.name)
        if len(calls) == 1:
            try:  # as torch DCP wraps a rank's failure (checkpoint/utils.py, _wrap_exception)
                raise RuntimeError("shard read failed")
            except RuntimeError as exc:
                failure = (exc, traceback.extract_tb(exc.__traceback__))
            raise CheckpointException("load", {0: failure})
        return real(self, fabric, folder, model, optimizer)

    monkeypatch.setattr(ck._FabricFormat, "load", failing_once)
    assert not issubclass(CheckpointException, Exception)
    trainer = _trainer(out, *keep, steps=2)
    assert calls == ["step-0000001", "step-0000000"] and trainer.start_step == 1
    assert "step-0000001 does not load: CheckpointException" in (out / "resume.log").read_text()
    trainer.run_dir.release()

    def interrupted(self, fabric, folder, model, optimizer):
        raise KeyboardInterrupt

    monkeypatch.setattr(ck._FabricFormat, "load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _trainer(out, *keep, steps=2)
    assert (out / "checkpoints" / "step-0000000").is_dir()  # a stop is not damage: nothing set aside


def test_a_full_disk_heals_with_the_command_the_message_names(tmp_path, monkeypatch):
    """Pruning ran only after a new checkpoint was written, so lowering trainer.keep_checkpoints
    as the message advised failed the same way. The message now names the value; the resume
    prunes to it before its first step, and the save then fits."""
    import errno
    import re
    import shutil
    from types import SimpleNamespace

    from nemo_replay.trainer.rundir import checkpoint as ck

    out = tmp_path / "run"
    _trainer(out, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=4", steps=4).fit()
    ckpts = out / "checkpoints"
    size = sum(f.stat().st_size for f in (ckpts / "step-0000003").rglob("*") if f.is_file())
    real = shutil.disk_usage

    def usage(path):  # a disk of 5.5 checkpoints: the four written leave 1.5 free
        held = sum(f.stat().st_size for f in ckpts.rglob("*") if f.is_file())
        return SimpleNamespace(free=int(5.5 * size) - held, total=real(path).total)

    monkeypatch.setattr(ck.shutil, "disk_usage", usage)
    assert usage(ckpts).free >= 1.1 * size  # one more checkpoint fits (each needs its size plus 10%)
    _trainer(out, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0", steps=5).fit()  # keep all: now 5 held
    with pytest.raises(OSError) as err:
        _trainer(out, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0", steps=6).fit()
    assert err.value.errno == errno.ENOSPC
    message = str(err.value)
    fix = re.search(r"run the same command with trainer.keep_checkpoints=(\d+) \(it holds 5 now\)", message)
    assert fix, message
    trainer = _trainer(out, "trainer.checkpoint_every=1", f"trainer.keep_checkpoints={fix.group(1)}", steps=6)
    assert len(list(ckpts.glob("step-*"))) == int(fix.group(1))  # pruned before the first step
    assert [r["step"] for r in trainer.fit().history] == [0, 1, 2, 3, 4, 5]


def test_a_resume_with_fewer_steps_than_done_says_so(tmp_path):
    out = tmp_path / "run"
    _trainer(out, "trainer.checkpoint_every=1", steps=3).fit()
    trainer = _trainer(out, "trainer.checkpoint_every=1", steps=2)
    result = trainer.fit()
    assert [r["step"] for r in result.history] == [0, 1, 2]  # nothing trained, nothing lost
    assert ("the checkpoint step-0000002 holds steps 0..2, trainer.steps=2 asks for no more: nothing to train; "
            "set trainer.steps above 3") in (out / "resume.log").read_text()
