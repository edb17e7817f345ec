"""Every stop path writes its checkpoint: Megatron's writer helpers, torchrun's exit status and resume command.

megatron-core's ``dist_checkpointing.save`` talks to a helper process (a spawned
``multiprocessing.Manager``) started at the first save. torchrun stops a worker by sending
SIGTERM to the worker's process group, and Slurm's ``scancel --signal=USR1`` reaches every
process of the job: both used to kill the helper too, so the stop checkpoint failed with a
``BrokenPipeError`` (rc 1, a ``.partial-*`` folder). The runs here are the real command line
(megatron-core on CPU through the test shims, ``tests/trainer/megatron_cli.py``), stopped with
real signals after a periodic checkpoint has started the helper.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from nemo_replay.trainer.rundir.checkpoint import latest_checkpoint
from nemo_replay.trainer.preemption import PREEMPTED_EXIT
from nemo_replay.trainer.torchrun import SHUTDOWN_TIMEOUT_S, with_shutdown_timeout
from tests.spawn import free_port
from tests.trainer.tiny import tiny

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
MEGATRON = ["replay.strategy=megatron", "trainer.checkpoint_every=1"]


def _start(cmd: list, cwd: Path) -> subprocess.Popen:
    # Its own session: the test signals the run's process group as torchrun and Slurm do.
    return subprocess.Popen(cmd, cwd=cwd, env=ENV, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_checkpoint(folder: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until a periodic checkpoint is complete (so megatron-core's helper process is running)."""
    deadline = time.monotonic() + timeout
    while latest_checkpoint(folder / "checkpoints") is None:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)


def _session(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--sid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _stopped_cleanly(folder: Path, err: str, signal_name: str) -> int:
    ckpts = folder / "checkpoints"
    done = len((folder / "metrics.jsonl").read_text().splitlines())
    assert latest_checkpoint(ckpts).step == done - 1, (sorted(os.listdir(ckpts)), err[-3000:])
    assert not [p for p in os.listdir(ckpts) if p.startswith(".partial-")], os.listdir(ckpts)
    assert "BrokenPipeError" not in err and "Traceback" not in err, err[-3000:]
    assert json.loads((folder / "summary.json").read_text())["stopped_by"] == signal_name
    return done


def test_megatron_usr1_to_every_process_writes_the_stop_checkpoint(tmp_path):
    """Slurm's ``scancel --signal=USR1``: every process of the run, the writer's helpers included."""
    out = tmp_path / "run"
    proc = _start([sys.executable, "-m", "tests.trainer.megatron_cli", "train", *tiny(out, *MEGATRON, steps=200)], tmp_path)
    _wait_for_checkpoint(out, proc)
    pids = _session(proc.pid)
    assert len(pids) >= 2, "megatron-core's helper process should be running"
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    _stopped_cleanly(out, err, "SIGUSR1")


def test_torchrun_sigterm_megatron_tp2_exits_75_and_prints_the_command_that_resumes(tmp_path):
    """SIGTERM to the launcher's group (a scheduler, ``kill``): torchrun passes it to each worker's group."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "nemo_replay.trainer.torchrun", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "tests.trainer.megatron_cli", "train",
           *tiny(out, *MEGATRON, "parallel.tensor=2", steps=200)]
    proc = _start(cmd, tmp_path)
    _wait_for_checkpoint(out, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    done = _stopped_cleanly(out, err, "SIGTERM")
    hint = err.split("resume with: ", 1)[1].splitlines()[0]
    again = shlex.split(hint)
    assert again[:3] == ["python", "-m", "nemo_replay.trainer.torchrun"], hint  # the launcher, as it was typed
    assert "--nproc-per-node" in again and again[again.index("--nproc-per-node") + 1] == "2", hint
    # The printed command resumes (one step more, so the test stays short).
    again[0] = sys.executable
    resumed = subprocess.run([*again, f"trainer.steps={done + 1}"], cwd=tmp_path, env=ENV, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"after step {done - 1}" in resumed.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == done + 1


def test_the_shutdown_timeout_is_raised_unless_chosen(monkeypatch):
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert with_shutdown_timeout(["--nproc-per-node", "2"])[0] == f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}"
    assert with_shutdown_timeout(["--shutdown-timeout", "5", "x"]) == ["--shutdown-timeout", "5", "x"]
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert with_shutdown_timeout(["x"]) == ["x"]
