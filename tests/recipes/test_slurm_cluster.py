"""The Slurm launcher on a real Slurm: submitted, signalled, requeued, killed, resumed.

Needs a running Slurm (``scripts/slurm_cluster.sh start`` as root starts a one-node one;
``.ci/run`` does). Each test submits the batch script ``recipes/slurm.py`` renders and
writes, unchanged, for the reference trainer with 2 CPU ranks under torchrun
(``--gpus-per-node 0 --procs-per-node 2 --no-container``), then interrupts one job's life
three times and checks that it ends exactly where a job that was never interrupted ends:

1. ``scancel --signal=USR1 --batch`` (what ``--signal=B:USR1@N`` delivers before the time
   limit): the batch shell's trap passes USR1 to the ranks, they checkpoint the step they
   were in, the step exits 75, the trap requeues; the requeued job (``SLURM_RESTART_COUNT=1``
   in its log) resumes right after that step.
2. ``scontrol requeue`` from outside (no USR1 to the batch shell; Slurm sends SIGTERM to the
   job): the requeued job resumes no earlier than the last periodic checkpoint.
3. SIGKILL to every process of the job (a node lost, the OOM killer; Slurm's own ``scancel
   --signal=KILL`` is a cancel that sends SIGTERM first): no checkpoint, the job fails; submitting the
   same script again resumes from the last complete checkpoint.

Then its metrics rows (all but the step time) and its final weights equal the uninterrupted
job's, bit for bit. megatron-core runs on CPU through the test shims, installed in the job's
workers by ``tests/recipes/cpu_shims_site`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.recipes.cluster import (
    JOB_RECIPE, STRATEGIES, job_env, resubmit_resumes,
    after_start, ended, final_weights, job_fields, latest_checkpoint, resumed_after, rows, skip_without_slurm, wait_for,
)

REPO = Path(__file__).resolve().parents[2]


pytestmark = [pytest.mark.slurm, skip_without_slurm()]

STEPS = 14
RECIPE = [*JOB_RECIPE, f"trainer.steps={STEPS}"]


def _submit(cwd: Path, strategy: str, name: str, out: str) -> tuple[str, Path]:
    """``recipes/slurm.py`` as a user runs it; (job id, the batch script it wrote)."""
    cmd = [sys.executable, str(REPO / "recipes" / "slurm.py"), "--nodes", "1", "--gpus-per-node", "0",
           "--procs-per-node", "2", "--no-container", "--time", "00:20:00", "--signal-lead", "60",
           "--job-name", name, "--", f"trainer.output_dir={out}", *RECIPE, *STRATEGIES[strategy]]
    done = subprocess.run(cmd, cwd=cwd, env=job_env(strategy), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    job = re.search(r"Submitted batch job (\d+)", done.stdout)
    assert job, done.stdout
    (script,) = (cwd / "logs").glob(f"{name}-*.sbatch")
    return job.group(1), script


def _kill_outright(job: str) -> None:
    """SIGKILL to the job's processes (``scontrol listpids``) and all their descendants, at once."""
    listed = subprocess.run(["scontrol", "listpids", job], capture_output=True, text=True, check=True).stdout
    pids = {int(line.split()[0]) for line in listed.splitlines()[1:] if line.split()}
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict = {}
    for line in table.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    todo, every = list(pids), set()
    while todo:
        pid = todo.pop()
        if pid not in every:
            every.add(pid)
            todo += children.get(pid, [])
    assert len(every) >= 4, (listed, every)  # the batch shell, srun, the launcher and its 2 ranks at least
    for pid in every:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_signal_requeue_kill_and_resume_end_where_an_uninterrupted_job_ends(strategy, tmp_path):
    ref_job, _ = _submit(tmp_path, strategy, f"ref-{strategy}", "runs/ref")
    ref_log = tmp_path / "logs" / f"ref-{strategy}-{ref_job}.out"
    state = wait_for("the uninterrupted job to end", lambda: ended(ref_job), ref_log)
    assert state == "COMPLETED" and job_fields(ref_job)["ExitCode"] == "0:0", ref_log.read_text()[-4000:]

    out = tmp_path / "runs" / "run"
    job, script = _submit(tmp_path, strategy, f"run-{strategy}", "runs/run")
    log = tmp_path / "logs" / f"run-{strategy}-{job}.out"

    # 1. USR1 to the batch shell: checkpoint the step in flight, exit 75, requeue, resume after it.
    wait_for("step 1", lambda: len(rows(out)) >= 2, log)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    wait_for("the requeued job to start", lambda: job_fields(job).get("Restarts") == "1" and after_start(log, 1), log)
    first = after_start(log, 0)
    assert "nemo-replay: the job step exited 75 (75: it checkpointed and stopped)" in first, first[-4000:]
    stopped = re.search(r"stopped by SIGUSR1 after (\d+) of", first)
    assert stopped, first[-4000:]
    wait_for("the resumed run", lambda: "resuming" in after_start(log, 1), log)
    assert resumed_after(after_start(log, 1)) == int(stopped.group(1)) - 1  # the step in flight, not a periodic one

    # 2. An external requeue: nothing older than the last periodic checkpoint is lost.
    resumed = resumed_after(after_start(log, 1))
    wait_for("a periodic checkpoint after the resume", lambda: latest_checkpoint(out) > resumed, log)
    periodic = latest_checkpoint(out)
    subprocess.run(["scontrol", "requeue", job], check=True)
    wait_for("the second start", lambda: job_fields(job).get("Restarts") == "2" and "resuming" in after_start(log, 2), log)
    assert resumed_after(after_start(log, 2)) >= periodic

    # 3. Killed outright: the same script, submitted again, resumes from the last complete checkpoint.
    resumed = resumed_after(after_start(log, 2))
    wait_for("a checkpoint after the second resume", lambda: latest_checkpoint(out) > resumed, log)
    _kill_outright(job)
    wait_for("the killed job to end", lambda: ended(job), log)
    assert "stopped by" not in after_start(log, 2) and job_fields(job)["JobState"] == "FAILED", after_start(log, 2)[-4000:]
    resubmit_resumes(script, tmp_path, strategy, out)

    # Where an uninterrupted job ends, bit for bit.
    assert rows(out) == rows(tmp_path / "runs" / "ref")
    ref, got = final_weights(tmp_path / "runs" / "ref", tmp_path, STEPS), final_weights(out, tmp_path, STEPS)
    assert ref.keys() == got.keys() and len(ref) > 10
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
