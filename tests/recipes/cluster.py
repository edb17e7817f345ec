"""What the tests that submit to a real Slurm share: the skips, a job's fields and log, a run's rows,
checkpoints and final weights."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = [
    "skip_without_slurm", "skip_without_two_nodes", "job_fields", "ended", "rows", "wait_for", "latest_checkpoint",
    "final_weights", "after_start", "resumed_after", "node_processes", "node_ranks", "JOB_RECIPE", "STRATEGIES",
    "job_env", "REPO_ROOT", "resubmit_resumes",
]


def _cluster_problem() -> str | None:
    if shutil.which("sbatch") is None:
        return "Slurm is not installed"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        return f"no Slurm controller answers ({(ping.stdout + ping.stderr).strip()[:200]})"
    return None


def _skip_unless(problem: str | None, what: str, start: str, select: str):
    return pytest.mark.skipif(
        problem is not None,
        reason=f"needs {what}: {problem}; as root: scripts/slurm_cluster.sh install && "
        f'eval "$(scripts/slurm_cluster.sh start{start})", then python -m pytest -m slurm{select}',
    )


def skip_without_slurm():
    return _skip_unless(_cluster_problem(), "a running Slurm", "", "")


def _two_nodes_problem() -> str | None:
    problem = _cluster_problem()
    if problem:
        return problem
    shown = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout.split()
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    missing = [n for n in ("nr-node1", "nr-node2") if n not in shown or f"nemo-replay-node{n[-1]}" not in spaces]
    return f"the cluster has no {' and no '.join(missing)} in its own network namespace (nodes: {shown})" if missing else None


def skip_without_two_nodes():
    """Skips unless the cluster is ``scripts/slurm_cluster.sh start --nodes 2``'s (its node names and namespaces)."""
    return _skip_unless(_two_nodes_problem(), "the two-node Slurm of this machine", " --nodes 2", " -k two_nodes")


#: The Slurm jobs' recipe (the tiny model, checkpoints every 3 steps) without its step count, and
#: each strategy's flags: megatron's TP=2 spans the job's two ranks.
JOB_RECIPE = [
    "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.micro_batch_size=8", "trainer.minibatches_per_step=2",
    "trainer.progress_bar=false", "trainer.plot=false", "generation.max_new_tokens=4", "model.hidden_size=32",
    "model.intermediate_size=64", "trainer.checkpoint_every=3", "trainer.num_threads=1",
]
STRATEGIES = {
    "fsdp": [],
    "megatron": ["replay.strategy=megatron", "parallel.tensor=2"],
}


def job_env(strategy: str) -> dict:
    """The job's environment: this checkout first on PYTHONPATH; megatron's CPU shims for megatron
    (megatron-core asks CUDA for its device: tests/recipes/cpu_shims_site)."""
    shims = [str(REPO_ROOT / "tests" / "recipes" / "cpu_shims_site")] if strategy == "megatron" else []
    return dict(os.environ, PYTHONPATH=os.pathsep.join([*shims, str(REPO_ROOT)]), OMP_NUM_THREADS="1")


def job_fields(job: str) -> dict:
    """``scontrol show job`` as a dict (kept MinJobAge, 300 s, after the job ends; no accounting needed)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", str(job)], capture_output=True, text=True)
    return dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)


def ended(job: str):
    """The job's final state once it ran out (COMPLETED, FAILED, ...), else None."""
    state = job_fields(job).get("JobState")
    return None if state in (None, "PENDING", "RUNNING", "COMPLETING", "REQUEUED", "CONFIGURING") else state


def rows(out: Path) -> list[dict]:
    """The run's metrics rows without the step time (the one field a resume cannot repeat)."""
    path = out / "metrics.jsonl"
    found = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    for r in found:
        r.pop("step_time_s")
    return found


def wait_for(what: str, ok, log: Path, timeout: float = 300):
    """``ok()``'s first true value, polled every 0.2 s; fails with the job log's tail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = ok()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:] if log.exists() else "(no log)"
            pytest.fail(f"timed out waiting for {what}; job log:\n{tail}")
        time.sleep(0.2)


def latest_checkpoint(out: Path) -> int:
    """The step of the run's latest complete checkpoint, -1 without one."""
    steps = [int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*") if (p / "complete.json").exists()]
    return max(steps, default=-1)


def final_weights(out: Path, tmp: Path, steps: int) -> dict:
    """Every tensor of the final checkpoint, that of step ``steps - 1`` (torch distributed checkpoint, read
    without a process group), by its path in the state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = latest_checkpoint(out)
    assert step == steps - 1, f"the last complete checkpoint of {out} is step {step}, expected the final step {steps - 1}"
    folder = out / "checkpoints" / f"step-{step:07d}"
    state = next(p for p in (folder, *folder.iterdir()) if p.is_dir() and (p / ".metadata").exists())
    target = tmp / f"{out.name}.pt"
    dcp_to_torch_save(state, target)
    flat = {}

    def walk(value, key):
        if torch.is_tensor(value):
            flat[key] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}/{k}")

    walk(torch.load(target, weights_only=False), "")
    return flat


def after_start(log: Path, restart: int) -> str:
    """The log of the job's ``restart``-th start (``SLURM_RESTART_COUNT``) to its next start."""
    text = log.read_text()
    parts = re.split(r"nemo-replay: job \d+ started on \S+ \(SLURM_RESTART_COUNT=(\d+)\)", text)
    found = {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}
    return found.get(restart, "")


def resumed_after(segment: str) -> int:
    """The step a log segment says the run resumed after."""
    m = re.search(r"resuming \S+ after step (\d+)", segment)
    assert m, segment[-3000:]
    return int(m.group(1))


def node_processes(node: int) -> dict:
    """{pid: command line} of every process in nr-node<node>'s network namespace."""
    listed = subprocess.run(["ip", "netns", "pids", f"nemo-replay-node{node}"], capture_output=True, text=True, check=True)
    found = {}
    for pid in map(int, listed.stdout.split()):
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except FileNotFoundError:
            pass  # ended meanwhile
    return found


def node_ranks(node: int) -> list:
    """The trainer ranks running on nr-node<node>."""
    return [pid for pid, cmd in node_processes(node).items() if "-m nemo_replay train" in cmd]


def resubmit_resumes(script: Path, cwd: Path, strategy: str, out: Path) -> None:
    """After a job failed: the same batch script, submitted again, completes and resumes after the
    last complete checkpoint in ``out`` (its log ``<cwd>/logs/run-<strategy>-<job>.out``)."""
    kept = latest_checkpoint(out)
    again = subprocess.run(["sbatch", str(script)], cwd=cwd, env=job_env(strategy), capture_output=True, text=True,
                           check=True)
    job = re.search(r"Submitted batch job (\d+)", again.stdout).group(1)
    log = cwd / "logs" / f"run-{strategy}-{job}.out"
    wait_for("the resubmitted job to end", lambda: ended(job), log)
    assert job_fields(job)["JobState"] == "COMPLETED", log.read_text()[-4000:]
    assert resumed_after(log.read_text()) == kept
