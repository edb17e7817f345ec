"""NeMo-Run recipe: the main job on a local executor or a Slurm executor.

    python recipes/nemo_run_recipe.py --executor local --gpus-per-node 2 --dry-run
    python recipes/nemo_run_recipe.py --executor slurm --nodes 2 --gpus-per-node 8 \\
        --partition batch --account myacct --container-mounts /lustre/repo:/workspace/nemo_replay \\
        -- configs/fsdp_gpu.yaml trainer.steps=200

The task is ``python -m nemo_replay train [CONFIG] [overrides]`` (a ``run.Script`` with
``m=True``) under NeMo-Run's ``torchrun`` launcher, which renders the per-node torchrun
line (one process per GPU, c10d rendezvous on the first node). The Slurm executor runs it
in the NGC container through pyxis (``container_image``, ``container_mounts``); submit
from a login node (``run.LocalTunnel``) or from your machine (``--ssh-host``:
``run.SSHTunnel``).

``nemo_run`` is imported only to submit (``pip install nemo-run``). ``--dry-run`` needs
neither NeMo-Run nor a cluster: it prints the executor, the task and the torchrun line
every node would run. Every argument is checked before anything is submitted (one-line
errors, exit 2): the shared ones in :mod:`recipes.arguments`, the local executor's single
node, and NeMo-Run being installed when submitting.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recipes import arguments
from recipes.job import Job, add_job_arguments, check_job_arguments, checked_job, torchrun_command

__all__ = ["plan", "build", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def plan(job: Job, executor: str, *, ssh_host: Optional[str] = None, ssh_user: Optional[str] = None, job_dir: str = "~/.nemo_run/jobs") -> dict:
    """Everything the submission consists of, as plain data (what ``--dry-run`` prints)."""
    if executor == "local":
        if job.nodes != 1:
            raise ValueError(f"the local executor runs on this machine: --nodes must be 1, got {job.nodes}")
        executor_args = {"ntasks_per_node": job.procs, "launcher": "torchrun", "env_vars": {"OMP_NUM_THREADS": "1"}}
        command = torchrun_command(job, node_rank="0", master="localhost:" + str(job.master_port))
    elif executor == "slurm":
        executor_args = {
            "account": job.account,
            "partition": job.partition,
            "nodes": job.nodes,
            "ntasks_per_node": job.procs,
            "gpus_per_node": job.gpus_per_node,
            "container_image": job.container_image,
            "container_mounts": list(job.container_mounts),
            "time": job.time,
            "launcher": "torchrun",
            "env_vars": {"OMP_NUM_THREADS": "1"},
            "tunnel": {"kind": "ssh", "host": ssh_host, "user": ssh_user, "job_dir": job_dir} if ssh_host else {"kind": "local", "job_dir": job_dir},
        }
        command = torchrun_command(job)
    else:
        raise ValueError(f"--executor must be 'local' or 'slurm', got {executor!r}")
    return {
        "name": job.job_name,
        "executor": executor,
        "executor_args": executor_args,
        "task": {"path": "nemo_replay", "entrypoint": "python", "m": True, "args": job.workload_args()},
        "world_size": job.world_size,
        "per_node_command": command,
    }


def build(p: dict):
    """``(task, executor)`` NeMo-Run objects for a :func:`plan` (imports ``nemo_run``)."""
    try:
        import nemo_run as run
    except ImportError as exc:
        raise ValueError("submitting needs NeMo-Run: `pip install nemo-run` (or use --dry-run)") from exc
    task = run.Script(path=p["task"]["path"], entrypoint=p["task"]["entrypoint"], m=p["task"]["m"], args=p["task"]["args"])
    args = dict(p["executor_args"])
    if p["executor"] == "local":
        return task, run.LocalExecutor(**args)
    tunnel = args.pop("tunnel")
    if tunnel["kind"] == "ssh":
        args["tunnel"] = run.SSHTunnel(host=tunnel["host"], user=tunnel["user"], job_dir=tunnel["job_dir"])
    else:
        args["tunnel"] = run.LocalTunnel(job_dir=tunnel["job_dir"])
    return task, run.SlurmExecutor(**{k: v for k, v in args.items() if v is not None})


def _check_cross(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Rules between arguments and about this machine, before anything is submitted."""
    if ns.executor == "local" and ns.nodes != 1:
        parser.error(
            f"argument --nodes: the local executor runs on this machine, so --nodes must be 1 (got {ns.nodes}); "
            f"use --executor slurm for {ns.nodes} nodes"
        )
    if ns.executor == "local" and (ns.ssh_host or ns.ssh_user):
        parser.error("argument --ssh-host/--ssh-user: only the slurm executor submits over SSH; drop them or use --executor slurm")
    if not ns.dry_run and importlib.util.find_spec("nemo_run") is None:
        parser.error("NeMo-Run is not installed: `pip install nemo-run` to submit, or pass --dry-run to print the plan")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = arguments.LauncherParser(
        prog="nemo_run_recipe.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--executor", choices=("local", "slurm"), default="local")
    parser.add_argument("--ssh-host", type=arguments.partition, default=None, help="submit over SSH to this login node (Slurm)")
    parser.add_argument("--ssh-user", type=arguments.name, default=None)
    parser.add_argument("--job-dir", default="~/.nemo_run/jobs", help="where NeMo-Run keeps job metadata")
    parser.add_argument("--detach", action="store_true", help="return after submitting")
    add_job_arguments(parser)
    try:
        ns = parser.parse_args(argv)
        check_job_arguments(parser, ns)
        _check_cross(parser, ns)
    except SystemExit as exc:
        return int(exc.code or 0)
    job = checked_job(ns, REPO_ROOT)
    if job is None:
        return 2
    p = plan(job, ns.executor, ssh_host=ns.ssh_host, ssh_user=ns.ssh_user, job_dir=ns.job_dir)
    if ns.dry_run:
        print("# dry run: NeMo-Run would submit")
        print(json.dumps(p, indent=2))
        return 0
    task, executor = build(p)  # reports a missing NeMo-Run install
    import nemo_run as run

    with run.Experiment(p["name"]) as exp:
        exp.add(task, executor=executor, name=p["name"])
        exp.run(detach=ns.detach)
    return 0


if __name__ == "__main__":
    sys.exit(main())
