"""Slurm launcher: sbatch + srun + torchrun across nodes, inside an NGC container (pyxis/enroot).

    python recipes/slurm.py --nodes 2 --gpus-per-node 8 --partition batch --account myacct \\
        --container-mounts /lustre/$USER/nemo_replay:/workspace/nemo_replay \\
        --dry-run -- configs/megatron_moe_gpu.yaml trainer.steps=200

The batch script asks for ``--nodes`` nodes with one Slurm task per node; ``srun`` starts
that task inside the container (``--container-image``, ``--container-mounts``,
``--container-workdir``: the pyxis flags) and each task runs torchrun, which starts one
process per GPU and meets the other nodes at a c10d rendezvous on the first node of the
allocation (``MASTER_ADDR`` from ``scontrol show hostnames``, ``MASTER_PORT``).

Time limit and preemption. The script asks Slurm for SIGUSR1 ``--signal-lead`` seconds
before the time limit, delivered to the batch shell only (``#SBATCH --signal=B:USR1@<lead>``).
The shell's trap passes it to every process of the job step (``scancel --signal=USR1``;
inside the step, bash and torchrun ignore it, so only the trainer ranks act on it): the
ranks finish their step, write a checkpoint and exit. The trap then waits for the step and
requeues the job (``scontrol requeue``; ``#SBATCH --requeue``, logs appended); the requeued
job runs the same command into the same pinned ``trainer.output_dir`` and resumes.
``--no-requeue`` leaves the job ended after its checkpoint.

Without GPUs or pyxis (a CPU cluster, or the one- or two-node Slurm of ``scripts/slurm_cluster.sh``):
``--gpus-per-node 0 --procs-per-node N`` asks for no GRES and runs N CPU ranks per node
(``trainer.accelerator=cpu``); ``--no-container`` drops the pyxis flags, so the task runs on
the node's own software in the environment ``sbatch`` was called from (``--setup`` defaults
to none then; ``--workdir`` is the folder it runs in, default where ``sbatch`` was called)::

    python recipes/slurm.py --nodes 1 --gpus-per-node 0 --procs-per-node 2 --no-container \\
        --time 00:10:00 --signal-lead 60 -- trainer.steps=20 trainer.checkpoint_every=2

``--dry-run`` prints the batch script and the ``sbatch`` command without writing or
submitting anything. Without it the script goes to ``--script-dir`` and is submitted.
Every argument is checked first (one-line errors, exit 2), then the recipe is validated
for ``nodes * processes per node`` ranks (``--no-validate`` skips that); nothing is written
before both pass.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recipes import arguments
from recipes.job import Job, add_job_arguments, add_signal_lead_argument, check_job_arguments, checked_job, torchrun_command

__all__ = ["render_sbatch", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def _on_usr1(lead: int, requeue: bool) -> list[str]:
    """The batch shell's USR1 trap (see the module doc)."""
    then = 'scontrol requeue "${SLURM_JOB_ID}"' if requeue else 'echo "nemo-replay: not requeued (--no-requeue)"'
    return [
        f"# Slurm sends USR1 to this shell {lead} s before the time limit (--signal=B:USR1@{lead}).",
        "# Every process of the job step gets it: the trainer ranks finish their step, write a",
        "# checkpoint and exit (bash and torchrun in the step ignore it). Then requeue: the same",
        "# command resumes from that checkpoint in the same trainer.output_dir.",
        "on_usr1() {",
        '    echo "nemo-replay: USR1: asking the run to checkpoint and stop (job ${SLURM_JOB_ID})"',
        '    scancel --signal=USR1 "${SLURM_JOB_ID}"',
        '    status=0; wait "${STEP_PID}" || status=$?',
        '    echo "nemo-replay: the job step exited ${status} (75: it checkpointed and stopped)"',
        f"    {then}",
        "    exit 0",
        "}",
        "trap on_usr1 USR1",
    ]


def render_sbatch(job: Job, *, signal_lead: int = 300, requeue: bool = True) -> str:
    """The batch script of ``job``; USR1 ``signal_lead`` seconds before the time limit, then requeue."""
    directives = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []),
        f"--time={job.time}",
        f"--signal=B:USR1@{signal_lead}",
        "--exclusive",
        "--output=logs/%x-%j.out",
        "--open-mode=append",
    ]
    if requeue:
        directives.append("--requeue")
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.account:
        directives.append(f"--account={job.account}")
    if job.container:
        place = [f"--container-image={job.container_image}", f"--container-workdir={job.workdir}", "--no-container-mount-home"]
        if job.container_mounts:
            place.insert(1, f"--container-mounts={','.join(job.container_mounts)}")
    else:
        place = [f"--chdir={job.workdir}"] if job.workdir else []
    # USR1 is for the trainer ranks: the task's bash and torchrun ignore it (and pass the
    # ignore on; the trainer installs its own handler).
    # SIGTERM (preemption): torchrun waits up to --signal-lead seconds for the stop checkpoint.
    task = 'trap "" USR1; ' + torchrun_command(job, shutdown_timeout=max(signal_lead, 30))
    srun = ["srun", f"--nodes={job.nodes}", "--ntasks-per-node=1", *place, "bash -c " + shlex.quote(task)]
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {d}" for d in directives]
    lines += [
        "set -euo pipefail",
        "",
        "# Rendezvous on the first node of the allocation.",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export MASTER_PORT={job.master_port}",
        "export OMP_NUM_THREADS=1",
        'echo "nemo-replay: job ${SLURM_JOB_ID} started on $(hostname) (SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0})"',
        "",
        *_on_usr1(signal_lead, requeue),
        "",
        "# One task per node" + (" inside the container" if job.container else "")
        + "; torchrun starts " + ("one process per GPU." if job.gpus_per_node else f"{job.procs} CPU processes."),
        " \\\n    ".join(srun) + " &",
        "STEP_PID=$!",
        'wait "${STEP_PID}"',
        "",
    ]
    return "\n".join(lines)


def _check_cross(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Rules between arguments and about this machine, before anything is written."""
    script_dir = Path(ns.script_dir)
    if any(p.exists() and not p.is_dir() for p in (script_dir, *script_dir.parents)):
        parser.error(f"argument --script-dir: {ns.script_dir!r} is (or is under) a file; name a folder")
    if not ns.dry_run and shutil.which("sbatch") is None:
        parser.error("sbatch is not on PATH: submit from a Slurm login node, or pass --dry-run to print the script")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = arguments.LauncherParser(
        prog="slurm.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_job_arguments(parser)
    parser.add_argument("--script-dir", default="logs", help="where the batch script is written before sbatch")
    add_signal_lead_argument(parser)
    parser.add_argument("--no-requeue", action="store_true", help="do not requeue the job after a time-limit checkpoint")
    try:
        ns = parser.parse_args(argv)
        check_job_arguments(parser, ns)
        _check_cross(parser, ns)
    except SystemExit as exc:
        return int(exc.code or 0)
    job = checked_job(ns, REPO_ROOT)
    if job is None:
        return 2
    script = render_sbatch(job, signal_lead=ns.signal_lead, requeue=not ns.no_requeue)
    path = Path(ns.script_dir) / f"{job.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    if ns.dry_run:
        print(f"# dry run: would write {path} and run: sbatch {path}")
        print(script)
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    Path("logs").mkdir(exist_ok=True)
    return subprocess.call(["sbatch", str(path)])


if __name__ == "__main__":
    sys.exit(main())
