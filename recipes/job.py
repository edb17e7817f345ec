"""The job both launchers submit: ``nemo-replay train`` under torchrun on every node.

:class:`Job` holds the cluster shape and the workload; :func:`torchrun_command` renders the
command each node runs. Rendezvous is torchrun's c10d store on the first node of the
allocation (``--rdzv-endpoint $MASTER_ADDR:$MASTER_PORT``), so every node runs the same
line and torchrun assigns ranks.

The recipe is validated here, before anything is queued, for the world size the job will
have (nodes x processes per node): a recipe that cannot run fails on the login node, with
every problem listed, not after an hour in the queue. The launcher's own arguments are
checked as they are parsed (:mod:`recipes.arguments`).

Resumable by construction. Unless the workload names ``trainer.output_dir``, the job pins
one (``runs/<job name>-<time>-<token>``, relative to ``workdir``): a requeued or resubmitted
job runs the same command into the same folder and continues from its latest checkpoint
(``trainer.resume=auto``).
"""

from __future__ import annotations

import argparse
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from recipes import arguments

DEFAULT_IMAGE = "nvcr.io/nvidia/pytorch:25.01-py3"
# NGC images pin torch through PIP_CONSTRAINT, so this keeps the container's torch (and apex).
DEFAULT_SETUP = 'pip install --quiet -e ".[all]"'
DEFAULT_WORKDIR = "/workspace/nemo_replay"

__all__ = [
    "Job", "DEFAULT_IMAGE", "DEFAULT_SETUP", "DEFAULT_WORKDIR", "add_job_arguments", "add_signal_lead_argument", "check_job_arguments", "job_from_args",
    "checked_job", "torchrun_command",
    "validate_recipe", "pinned_output_dir",
]


@dataclass
class Job:
    """One training job.

    Attributes:
        config: recipe path as seen inside the container (relative to ``workdir``), or None
            for the embedded default.
        overrides: ``key=value`` recipe overrides.
        nodes: nodes of the allocation.
        gpus_per_node: GPUs per node; 0 for a CPU job (no GRES request, ``trainer.accelerator=cpu``).
        procs_per_node: trainer processes per node: one per GPU, or ``procs_per_node`` CPU
            ranks in a CPU job (None: one per GPU, or 1).
        container: run the task in ``container_image`` through pyxis; False runs it on the
            node's own software (the environment ``sbatch`` was called from).
        container_image: NGC image (pyxis/enroot ``--container-image``).
        container_mounts: ``src:dst`` mounts (``--container-mounts``).
        workdir: working directory of the task: the repository checkout inside the container;
            without one, a folder on the node (None: where ``sbatch`` was called).
        job_name, partition, account, time: Slurm fields.
        master_port: rendezvous port on the first node.
        mode: ``train`` or ``compare``.
        setup: shell command each node runs inside the container before torchrun (installs
            the package into the NGC image); empty for an image that already has it.
    """

    config: Optional[str] = None
    overrides: list = field(default_factory=list)
    nodes: int = 1
    gpus_per_node: int = 8
    procs_per_node: Optional[int] = None
    container: bool = True
    container_image: str = DEFAULT_IMAGE
    container_mounts: list = field(default_factory=list)
    workdir: Optional[str] = DEFAULT_WORKDIR
    job_name: str = "nemo-replay"
    partition: Optional[str] = None
    account: Optional[str] = None
    time: str = "01:00:00"
    master_port: int = 29500
    mode: str = "train"
    setup: str = DEFAULT_SETUP

    @property
    def procs(self) -> int:
        """Trainer processes per node."""
        if self.procs_per_node is not None:
            return self.procs_per_node
        return self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs

    def recipe_overrides(self) -> list[str]:
        """The process counts the recipe must agree with, then the user's overrides (which win)."""
        accelerator = "gpu" if self.gpus_per_node else "cpu"
        counts = [f"trainer.devices={self.procs}", f"trainer.num_nodes={self.nodes}", f"trainer.accelerator={accelerator}"]
        return counts + list(self.overrides)

    def workload_args(self) -> list[str]:
        """``train [CONFIG] overrides``: the arguments of ``python -m nemo_replay``."""
        return [self.mode] + ([self.config] if self.config else []) + self.recipe_overrides()


def torchrun_command(
    job: Job, *, node_rank: str = "$SLURM_NODEID", master: str = "$MASTER_ADDR:$MASTER_PORT", shutdown_timeout: int = 600,
) -> str:
    """The command every node runs (shell variables left for the node's shell to expand).

    It is torchrun through :mod:`nemo_replay.trainer.torchrun` (same arguments), whose exit
    status is 75 when the run checkpointed and stopped.

    ``shutdown_timeout``: seconds torchrun gives its workers to finish the step and write the
    stop checkpoint after passing a SIGTERM on, before SIGKILL (torchrun's default, 30 s, is
    shorter than one step of a large model).
    """
    parts = [
        "python",
        "-m",
        "nemo_replay.trainer.torchrun",  # torchrun, exiting 75 when every worker checkpointed and stopped
        f"--nnodes={job.nodes}",
        f"--nproc-per-node={job.procs}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={master}",
        "--rdzv-id=${SLURM_JOB_ID:-nemo-replay}",
        f"--shutdown-timeout={shutdown_timeout}",
        "-m",
        "nemo_replay",
    ]
    command = " ".join(parts + [shlex.quote(a) for a in job.workload_args()])
    return f"{job.setup} && {command}" if job.setup else command


def validate_recipe(job: Job, repo_root: Optional[Path] = None) -> None:
    """Load and validate the recipe for ``job.world_size`` ranks (raises ConfigError listing every problem).

    ``job.config`` is resolved against ``repo_root`` (the local checkout mirrored at ``workdir``).
    """
    from nemo_replay.trainer.config.loading import load_config

    config = job.config
    if not job.container:  # the task runs here, in --workdir or where sbatch is called
        repo_root = Path(job.workdir or ".")
    if config and not config.startswith("pkg://") and repo_root is not None and not Path(config).is_absolute():
        config = str(repo_root / config)
    load_config(config, job.recipe_overrides(), world_size=job.world_size)


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments both launchers share, each checked as it is parsed (:mod:`recipes.arguments`)."""
    parser.add_argument("--nodes", type=arguments.positive_int, default=1, help="nodes of the allocation")
    parser.add_argument(
        "--gpus-per-node", type=arguments.count, default=8,
        help="GPUs per node, one process each; 0 for a CPU job (no GRES, trainer.accelerator=cpu)",
    )
    parser.add_argument(
        "--procs-per-node", type=arguments.positive_int, default=None,
        help="processes per node of a CPU job (--gpus-per-node 0; default 1); with GPUs it is --gpus-per-node",
    )
    parser.add_argument(
        "--no-container", action="store_true",
        help="run on the nodes' own software (the environment sbatch is called from), without pyxis",
    )
    parser.add_argument(
        "--container-image", type=arguments.image, default=None, help=f"NGC container image (default {DEFAULT_IMAGE})"
    )
    parser.add_argument(
        "--container-mounts", type=arguments.mounts, default=None,
        help="comma-separated SRC:DST[:FLAGS] mounts, e.g. /lustre/data:/data,$PWD:/workspace/nemo_replay",
    )
    parser.add_argument(
        "--workdir", type=arguments.abs_path, default=None,
        help=f"the repository checkout inside the container (default {DEFAULT_WORKDIR}); with --no-container, "
        f"the folder the task runs in (default: where sbatch is called)",
    )
    parser.add_argument("--job-name", type=arguments.name, default="nemo-replay")
    parser.add_argument("--partition", type=arguments.partition, default=None)
    parser.add_argument("--account", type=arguments.partition, default=None)
    parser.add_argument(
        "--time", type=arguments.slurm_time, default="01:00:00", help="wall-clock limit (Slurm formats: HH:MM:SS, D-HH:MM:SS, MINUTES)"
    )
    parser.add_argument("--master-port", type=arguments.port, default=29500, help="rendezvous port on the first node")
    parser.add_argument("--mode", choices=("train", "compare"), default="train")
    parser.add_argument(
        "--setup", default=None,
        help=f"command each node runs before torchrun ('' for none; default in the container: {DEFAULT_SETUP}, "
        f"without one: none)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would be submitted and exit")
    parser.add_argument("--no-validate", action="store_true", help="skip validating the recipe before submitting")
    parser.add_argument("workload", nargs=argparse.REMAINDER, help="[CONFIG] [key=value ...] as for nemo-replay train")


def pinned_output_dir(job_name: str) -> str:
    """``trainer.output_dir=runs/<job name>-<YYYYmmdd-HHMMSS>-<token>``: fixed in the script, unique per submission."""
    return f"trainer.output_dir=runs/{job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def add_signal_lead_argument(parser: argparse.ArgumentParser) -> None:
    """``--signal-lead``: when Slurm asks the run to checkpoint and stop before ``--time`` (checked by
    :func:`check_job_arguments`)."""
    parser.add_argument(
        "--signal-lead", type=arguments.signal_lead, default=300,
        help="seconds before the time limit at which the run checkpoints and stops (default 300)",
    )


def _late_flags(parser: argparse.ArgumentParser, workload: Sequence[str]) -> list[str]:
    """The launcher's own flags among the workload's words. Everything after the workload's first
    word is the workload's (``argparse.REMAINDER``): a ``--dry-run`` written there went to
    ``nemo-replay train`` inside the job, and with ``--no-validate`` the job was submitted."""
    known = parser._option_string_actions  # every flag of this launcher, shared ones and its own
    return [word for word in workload if word.split("=", 1)[0] in known]


def check_job_arguments(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Rules between the shared arguments (``parser.error``: one line, exit 2)."""
    late = _late_flags(parser, ns.workload)
    if late:
        parser.error(
            f"argument {late[0].split('=', 1)[0]}: written after the workload ({' '.join(ns.workload[:2])} ...), where it "
            f"would reach nemo-replay train inside the job instead of this launcher; write the launcher's flags "
            f"({', '.join(late)}) before CONFIG and the key=value overrides"
        )
    lead = getattr(ns, "signal_lead", None)
    if lead is not None:
        limit = arguments.parse_slurm_time(ns.time)
        if lead >= limit:
            parser.error(
                f"argument --signal-lead: {lead} s is not before the end of --time={ns.time} ({limit} s); "
                f"lower --signal-lead or raise --time"
            )
    if ns.procs_per_node is not None and ns.gpus_per_node and ns.procs_per_node != ns.gpus_per_node:
        parser.error(
            f"argument --procs-per-node: torchrun starts one process per GPU, so it must be --gpus-per-node "
            f"({ns.gpus_per_node}), got {ns.procs_per_node}; leave it out, or pass --gpus-per-node 0 for a CPU job"
        )
    if ns.no_container and (ns.container_image is not None or ns.container_mounts is not None):
        flag = "--container-image" if ns.container_image is not None else "--container-mounts"
        parser.error(f"argument {flag}: --no-container runs without a container; drop {flag} or --no-container")


def job_from_args(ns: argparse.Namespace) -> Job:
    """The :class:`Job` of parsed arguments; pins ``trainer.output_dir`` unless the workload names one."""
    workload = [a for a in ns.workload if a != "--"]
    config = workload[0] if workload and "=" not in workload[0] else None
    overrides = workload[1:] if config else workload
    if not any(o.startswith("trainer.output_dir=") for o in overrides):
        overrides = [pinned_output_dir(ns.job_name), *overrides]
    container = not ns.no_container
    setup = ns.setup if ns.setup is not None else (DEFAULT_SETUP if container else "")
    return Job(
        config=config, overrides=overrides, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node,
        procs_per_node=ns.procs_per_node, container=container, container_image=ns.container_image or DEFAULT_IMAGE,
        container_mounts=list(ns.container_mounts or []), workdir=ns.workdir or (DEFAULT_WORKDIR if container else None),
        job_name=ns.job_name, partition=ns.partition, account=ns.account, time=ns.time,
        master_port=ns.master_port, mode=ns.mode, setup=setup,
    )


def checked_job(ns: argparse.Namespace, repo_root: Optional[Path] = None) -> Optional[Job]:
    """The job the arguments describe, with its recipe validated for the target world size
    (unless ``--no-validate``); None after printing why it would not be submitted."""
    job = job_from_args(ns)
    if not ns.no_validate:
        try:
            validate_recipe(job, repo_root)
        except ValueError as exc:
            print(f"not submitted: {exc}", file=sys.stderr)
            return None
    return job
