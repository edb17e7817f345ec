"""Long runs on several ranks: a stopped rank.

Under a real ``torchrun --nproc-per-node 2``, rank 1 is frozen with SIGSTOP mid-run; rank 0
must fail within ``trainer.collective_timeout_s`` with an error naming the collective it
waited in. (Sharded checkpoints resumed bit for bit on two ranks: tests/trainer/test_spawned_runs.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.spawn import free_port
from tests.trainer.tiny import tiny

REPO = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in env if v.startswith(b"RANK=")).split(b"=", 1)[1])


def test_a_stopped_rank_fails_the_others_within_the_collective_timeout(tmp_path):
    timeout_s = 5
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    overrides = [o for o in tiny(tmp_path, steps=200) if not o.startswith("trainer.progress_bar")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "nemo_replay", "train", *overrides, "trainer.progress_bar=false", f"trainer.collective_timeout_s={timeout_s}",
           "trainer.checkpoint_every=1"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        deadline = time.monotonic() + 240
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        workers = _children(proc.pid)
        stopped = next(pid for pid in workers if _rank_of(pid) == 1)
        os.kill(stopped, signal.SIGSTOP)  # rank 1 hangs: alive, silent
        frozen_at = time.monotonic()
        rank0 = next(pid for pid in workers if pid != stopped)
        while Path(f"/proc/{rank0}").exists() and Path(f"/proc/{rank0}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() - frozen_at < timeout_s + 60, "rank 0 still waits long after the collective timeout"
            time.sleep(0.05)
        waited = time.monotonic() - frozen_at
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)  # torchrun's own SIGTERM stays pending on a stopped process
        out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert waited >= timeout_s - 1, waited  # it did wait for the peer ...
    assert "waited trainer.collective_timeout_s=5 s without every rank joining" in err, err[-3000:]
    assert "step " in err and "on rank 0: the collective " in err  # ... and names the collective it waited in
    assert "Then run the same command to resume from" in err
