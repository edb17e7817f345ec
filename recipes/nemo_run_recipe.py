"""NeMo-Run recipe: the main job on NeMo-Run's local executor or its Slurm executor.

    python recipes/nemo_run_recipe.py --executor local --gpus-per-node 0 --procs-per-node 2 -- trainer.steps=20
    python recipes/nemo_run_recipe.py --executor slurm --nodes 2 --gpus-per-node 8 \\
        --partition batch --account myacct --container-mounts /lustre/repo:/workspace/nemo_replay \\
        -- configs/fsdp_gpu.yaml trainer.steps=200

The task is a ``run.Script`` whose inline script runs, on every node, the same line as
``recipes/slurm.py``: torchrun through ``python -m nemo_replay.trainer.torchrun`` (exit 75
when the run checkpointed and stopped), one process per GPU or ``--procs-per-node`` CPU
ranks, c10d rendezvous on the first node of the allocation. NeMo-Run's own ``torchrun``
launcher is not used: Slurm's ``--signal`` reaches every process of the step, and torchrun
dies of SIGUSR1 (its default action) with its workers mid-checkpoint; the script and the
package's launcher ignore USR1 and leave it to the trainer ranks.

Executors. ``local`` runs on this machine. ``slurm`` submits through ``run.LocalTunnel``
(from a login node) or ``run.SSHTunnel`` (``--ssh-host``), with ``run.Packager()``: the
task runs the checkout in ``--workdir`` (the container's mount of the repository, or with
``--no-container`` a folder on the nodes, default the one the recipe is run from), so
nothing is archived (NeMo-Run's default ``GitArchivePackager`` needs the submitting folder
to be a git checkout). NeMo-Run writes the experiment under ``--base-dir`` (default
``~/.nemo_run``, expanded): ``experiments/<name>/<name>_<id>/<task>/``, with the Slurm
logs there, one per start (``log--.<task>_<job>_<SLURM_RESTART_COUNT>.out``); the local
tunnel's ``job_dir`` is that same folder, where ``sbatch`` finds the script.

Preemption on Slurm: the executor asks for ``--signal=USR1@<--signal-lead>`` (to the job
step, NeMo-Run's batch script has no trap), ``--requeue``, and ``retries=<--retries>``:
NeMo-Run's script requeues the job when the step exits non-zero and fewer restarts have
happened. The ranks checkpoint on USR1 and exit 75; the requeued job runs the same line
into the same pinned ``trainer.output_dir`` and resumes. ``srun_args=["--kill-on-bad-exit=0"]``
overrides NeMo-Run's ``--kill-on-bad-exit=1``, under which the first node to exit 75 would
terminate the other nodes' tasks before they finish. A job stopped at its time limit
without USR1 gets SIGTERM: the ranks checkpoint if the step and the checkpoint fit in
Slurm's ``KillWait``.

The recipe waits for the experiment (unless ``--detach``) and exits 0 when every task
succeeded: NeMo-Run's status, or, where it reports UNKNOWN (Slurm without accounting,
where ``sacct`` has nothing), the job's state from ``scontrol show job``. NeMo-Run waits
through ``sacct`` alone and, after 30 failed asks 2 s apart, cancels the job; so on a Slurm
whose ``sacct`` does not answer (accounting off) the recipe submits detached and waits on
the job itself (``scontrol show job`` every 2 s, through requeues, to its final state).

``nemo_run`` is imported only to submit (``pip install -e ".[nemo-run]"``, in an environment
of its own: README). ``--dry-run`` needs neither NeMo-Run nor a cluster: it prints the
executor, the task script and what every node runs. Every argument is checked before
anything is submitted (one-line errors, exit 2): the shared ones in
:mod:`recipes.arguments` and :mod:`recipes.job`, the local executor's single node and
missing container, and NeMo-Run being installed when submitting.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recipes import arguments
from recipes.job import Job, add_job_arguments, add_signal_lead_argument, check_job_arguments, checked_job, torchrun_command

__all__ = ["plan", "build", "task_script", "outcome", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASE_DIR = "~/.nemo_run"


def task_script(job: Job, executor: str, shutdown_timeout: int = 600) -> str:
    """The inline script every node runs: into the checkout, USR1 left to the ranks, then torchrun."""
    lines = ['trap "" USR1  # Slurm signals every process of the step: the trainer ranks act on it']
    if job.workdir:
        lines.append(f"cd {shlex.quote(job.workdir)}")
    if executor == "local":
        master, node_rank = f"localhost:{job.master_port}", "0"
    else:
        lines += ['export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                  f"export MASTER_PORT={job.master_port}"]
        master, node_rank = "$MASTER_ADDR:$MASTER_PORT", "$SLURM_NODEID"
    lines.append(torchrun_command(job, node_rank=node_rank, master=master, shutdown_timeout=shutdown_timeout))
    return "\n".join(lines) + "\n"


def plan(job: Job, executor: str, *, ssh_host: Optional[str] = None, ssh_user: Optional[str] = None,
         base_dir: str = DEFAULT_BASE_DIR, job_dir: Optional[str] = None, signal_lead: int = 300, retries: int = 3) -> dict:
    """Everything the submission consists of, as plain data (what ``--dry-run`` prints)."""
    base_dir = os.path.abspath(os.path.expanduser(base_dir))
    env = {"OMP_NUM_THREADS": "1"}
    if executor == "local":
        if job.nodes != 1:
            raise ValueError(f"the local executor runs on this machine: --nodes must be 1, got {job.nodes}")
        executor_args = {"ntasks_per_node": 1, "env_vars": env}
    elif executor == "slurm":
        executor_args = {
            "account": job.account or "",
            "partition": job.partition,
            "nodes": job.nodes,
            "ntasks_per_node": 1,
            "gpus_per_node": job.gpus_per_node or None,
            "container_image": job.container_image if job.container else None,
            "container_mounts": list(job.container_mounts) if job.container else [],
            "time": job.time,
            "exclusive": True,
            "signal": f"USR1@{signal_lead}",
            "retries": retries,
            "additional_parameters": {"requeue": True},
            # NeMo-Run's srun has --kill-on-bad-exit=1, and a stop's 75 is a bad exit to srun: the first node
            # to exit would terminate the others' tasks while their torchrun still closes the rendezvous (seen on
            # two nodes: 143 instead of 75). Its --wait=60 still ends the others 60 s after the first task.
            "srun_args": ["--kill-on-bad-exit=0"],
            "env_vars": env,
            "packager": "plain",
            "tunnel": ({"kind": "ssh", "host": ssh_host, "user": ssh_user, "job_dir": job_dir or "~/.nemo_run/experiments"}
                       if ssh_host else {"kind": "local", "job_dir": os.path.join(base_dir, "experiments")}),
        }
    else:
        raise ValueError(f"--executor must be 'local' or 'slurm', got {executor!r}")
    return {
        "name": job.job_name,
        "base_dir": base_dir,
        "executor": executor,
        "executor_args": executor_args,
        "task": {"inline": task_script(job, executor, 600 if executor == "local" else max(signal_lead, 30))},
        "world_size": job.world_size,
    }


def build(p: dict):
    """``(task, executor)`` NeMo-Run objects for a :func:`plan` (imports ``nemo_run``)."""
    try:
        import nemo_run as run
    except ImportError as exc:
        raise ValueError('submitting needs NeMo-Run: `pip install -e ".[nemo-run]"` (or use --dry-run)') from exc
    task = run.Script(inline=p["task"]["inline"])
    args = dict(p["executor_args"])
    if p["executor"] == "local":
        return task, run.LocalExecutor(**args)
    tunnel = args.pop("tunnel")
    if tunnel["kind"] == "ssh":
        args["tunnel"] = run.SSHTunnel(host=tunnel["host"], user=tunnel["user"], job_dir=tunnel["job_dir"])
    else:
        args["tunnel"] = run.LocalTunnel(job_dir=tunnel["job_dir"])
    args["packager"] = run.Packager()
    return task, run.SlurmExecutor(**{k: v for k, v in args.items() if v is not None})


def _rewritten_paths(p: dict) -> list[str]:
    """Paths of the plan that NeMo-Run would rewrite: without a container, its Slurm executor replaces
    every ``/nemo_run`` in the batch script and the task script with the job's folder (0.11.1)."""
    if p["executor"] != "slurm" or p["executor_args"]["container_image"]:
        return []
    # The SSH tunnel's job folder holds the scripts NeMo-Run writes: rewritten like --base-dir.
    words = [p["base_dir"], p["executor_args"]["tunnel"]["job_dir"], *shlex.split(p["task"]["inline"], comments=True)]
    return [w for w in words if "/nemo_run" in w]


def _slurm_state(job_id: str) -> str:
    """``JobState`` from ``scontrol show job`` (kept for MinJobAge after the end), or UNKNOWN."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True)
    fields = dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)
    return fields.get("JobState", "UNKNOWN")


def _sacct_answers() -> bool:
    """Whether this machine's Slurm keeps accounting (``sacct`` answers), which NeMo-Run's wait needs."""
    try:
        return subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True).returncode == 0
    except FileNotFoundError:
        return False


# States a job leaves on its own: it runs, is requeued (by NeMo-Run's script after exit 75) and runs again.
_LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SIGNALING", "STAGE_OUT", "SUSPENDED"}


def _wait_for_jobs(statuses: dict, poll_s: float = 2.0) -> None:
    """Until every task's Slurm job is in a final state (``scontrol show job``)."""
    for info in statuses.values():
        if info.get("job_id"):
            while _slurm_state(info["job_id"]) in _LIVE:
                time.sleep(poll_s)


def outcome(statuses: dict, executor: str) -> int:
    """0 when every task succeeded; prints one line per task (state, job id, folder)."""
    failed = 0
    for name, info in statuses.items():
        state = str(info.get("status", "UNKNOWN")).split(" ")[0]
        if state == "UNKNOWN" and executor == "slurm" and info.get("job_id"):
            slurm = _slurm_state(info["job_id"])  # one scontrol call
            state = "SUCCEEDED" if slurm == "COMPLETED" else slurm
        print(f"nemo-run: task {name} (job {info.get('job_id')}): {state}; logs under {info.get('local_dir')}")
        failed += state != "SUCCEEDED"
    return 0 if failed == 0 else 1


def _check_cross(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Rules between arguments and about this machine, before anything is submitted."""
    if ns.executor == "local" and ns.nodes != 1:
        parser.error(
            f"argument --nodes: the local executor runs on this machine, so --nodes must be 1 (got {ns.nodes}); "
            f"use --executor slurm for {ns.nodes} nodes"
        )
    if ns.executor == "local" and (ns.ssh_host or ns.ssh_user):
        parser.error("argument --ssh-host/--ssh-user: only the slurm executor submits over SSH; drop them or use --executor slurm")
    if ns.executor == "local" and (ns.container_image is not None or ns.container_mounts is not None):
        flag = "--container-image" if ns.container_image is not None else "--container-mounts"
        parser.error(f"argument {flag}: the local executor runs on this machine without a container; drop {flag}")
    if ns.job_dir is not None and not ns.ssh_host:
        parser.error("argument --job-dir: it names the folder on the login node of --ssh-host; with the local tunnel, "
                     "NeMo-Run's folder is --base-dir")
    if not ns.dry_run and importlib.util.find_spec("nemo_run") is None:
        parser.error('NeMo-Run is not installed: `pip install -e ".[nemo-run]"` to submit, or pass --dry-run to print the plan')


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = arguments.LauncherParser(
        prog="nemo_run_recipe.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--executor", choices=("local", "slurm"), default="local")
    parser.add_argument("--ssh-host", type=arguments.partition, default=None, help="submit over SSH to this login node (Slurm)")
    parser.add_argument("--ssh-user", type=arguments.name, default=None)
    parser.add_argument("--job-dir", type=arguments.abs_path, default=None,
                        help="with --ssh-host: NeMo-Run's job folder on the login node (default ~/.nemo_run/experiments)")
    parser.add_argument("--base-dir", type=arguments.abs_path, default=None,
                        help=f"where NeMo-Run writes the experiment (default {DEFAULT_BASE_DIR}, expanded)")
    parser.add_argument("--retries", type=arguments.count, default=3,
                        help="Slurm: times NeMo-Run requeues the job after a non-zero exit, a stop checkpoint included (default 3)")
    add_signal_lead_argument(parser)
    parser.add_argument("--detach", action="store_true", help="return after submitting")
    add_job_arguments(parser)
    try:
        ns = parser.parse_args(argv)
        check_job_arguments(parser, ns)
        _check_cross(parser, ns)
    except SystemExit as exc:
        return int(exc.code or 0)
    if ns.executor == "local":
        ns.no_container = True  # this machine's own software, in --workdir or here
    if ns.no_container and ns.workdir is None:
        ns.workdir = os.getcwd()  # NeMo-Run starts the task in its own job folder: come back here
    job = checked_job(ns, REPO_ROOT)
    if job is None:
        return 2
    p = plan(job, ns.executor, ssh_host=ns.ssh_host, ssh_user=ns.ssh_user, base_dir=ns.base_dir or DEFAULT_BASE_DIR,
             job_dir=ns.job_dir, signal_lead=ns.signal_lead, retries=ns.retries)
    mangled = _rewritten_paths(p)
    if mangled:
        print(
            f"nemo_run_recipe.py: {mangled[0]!r} holds '/nemo_run', which NeMo-Run's Slurm executor without a container "
            f"rewrites to the job's folder everywhere in its batch and task scripts; use a folder whose path has no "
            f"'/nemo_run' (see --help)", file=sys.stderr,
        )
        return 2
    if ns.dry_run:
        print("# dry run: NeMo-Run would submit")
        print(json.dumps(p, indent=2))
        return 0
    task, executor = build(p)  # reports a missing NeMo-Run install
    import nemo_run as run

    own_wait = not ns.detach and p["executor"] == "slurm" and not ns.ssh_host and not _sacct_answers()
    if own_wait:
        print("nemo-run: this Slurm keeps no accounting (sacct does not answer), so NeMo-Run's wait would cancel the "
              "job after about a minute: submitting detached and waiting on the job through scontrol", file=sys.stderr)
    with run.Experiment(p["name"], base_dir=p["base_dir"]) as exp:
        exp.add(task, executor=executor, name=p["name"])
        exp.run(detach=ns.detach or own_wait)
    if ns.detach:
        return 0
    if own_wait:
        _wait_for_jobs(exp.status(return_dict=True) or {})
    return outcome(exp.status(return_dict=True) or {}, p["executor"])


if __name__ == "__main__":
    sys.exit(main())
