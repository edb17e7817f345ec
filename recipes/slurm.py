"""Slurm launcher: sbatch + srun + torchrun across nodes, inside an NGC container (pyxis/enroot).

    python recipes/slurm.py --nodes 2 --gpus-per-node 8 --partition batch --account myacct \\
        --container-mounts /lustre/$USER/nemo_replay:/workspace/nemo_replay \\
        --dry-run -- configs/megatron_moe_gpu.yaml trainer.steps=200

The batch script asks for ``--nodes`` nodes with one Slurm task per node; ``srun`` starts
that task inside the container (``--container-image``, ``--container-mounts``,
``--container-workdir``: the pyxis flags) and each task runs torchrun, which starts one
process per GPU and meets the other nodes at a c10d rendezvous on the first node of the
allocation (``MASTER_ADDR`` from ``scontrol show hostnames``, ``MASTER_PORT``).

``--dry-run`` prints the batch script and the ``sbatch`` command without writing or
submitting anything. Without it the script goes to ``--script-dir`` and is submitted.
The recipe is validated for ``nodes * gpus_per_node`` ranks first (``--no-validate`` skips).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recipes.job import Job, add_job_arguments, checked_job, torchrun_command

__all__ = ["render_sbatch", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def render_sbatch(job: Job) -> str:
    """The batch script of ``job``."""
    directives = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        f"--gpus-per-node={job.gpus_per_node}",
        f"--time={job.time}",
        "--exclusive",
        "--output=logs/%x-%j.out",
    ]
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.account:
        directives.append(f"--account={job.account}")
    container = [f"--container-image={job.container_image}", f"--container-workdir={job.workdir}", "--no-container-mount-home"]
    if job.container_mounts:
        container.insert(1, f"--container-mounts={','.join(job.container_mounts)}")
    srun = ["srun", f"--nodes={job.nodes}", "--ntasks-per-node=1", *container, "bash -c " + shlex.quote(torchrun_command(job))]
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {d}" for d in directives]
    lines += [
        "set -euo pipefail",
        "",
        "# Rendezvous on the first node of the allocation.",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export MASTER_PORT={job.master_port}",
        "export OMP_NUM_THREADS=1",
        "",
        "# One task per node inside the container; torchrun starts one process per GPU.",
        " \\\n    ".join(srun),
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(parser)
    parser.add_argument("--script-dir", default="logs", help="where the batch script is written before sbatch")
    ns = parser.parse_args(argv)
    job = checked_job(ns, REPO_ROOT)
    if job is None:
        return 2
    script = render_sbatch(job)
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
