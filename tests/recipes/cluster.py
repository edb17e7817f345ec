"""What the tests that submit to a real Slurm share: the skip, a job's fields, a run's rows."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["skip_without_slurm", "job_fields", "ended", "rows"]


def _cluster_problem() -> str | None:
    if shutil.which("sbatch") is None:
        return "Slurm is not installed"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        return f"no Slurm controller answers ({(ping.stdout + ping.stderr).strip()[:200]})"
    return None


def skip_without_slurm():
    problem = _cluster_problem()
    return pytest.mark.skipif(
        problem is not None,
        reason=f"needs a running Slurm: {problem}; as root: scripts/slurm_cluster.sh install && "
        f'eval "$(scripts/slurm_cluster.sh start)", then python -m pytest -m slurm',
    )


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
