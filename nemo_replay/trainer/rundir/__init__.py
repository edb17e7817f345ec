"""The run folder: unique when unnamed, resumed when named, never shared by two runs.

Rank 0 decides, every rank learns the decision (one broadcast), before any model is built:

- ``trainer.output_dir: null``: a new folder ``runs/<YYYYmmdd-HHMMSS>-<strategy>-replay-<on|off>``
  (``-j<job>`` or ``-j<array job>_<task>`` under Slurm), created with an exclusive ``mkdir``;
  when the name is taken (two runs started in the same second, on any node of a shared file
  system) the next free ``-2``, ``-3``, ... is used. Two runs never share a folder.
- a named folder: empty or new, a fresh run starts there. Holding a run
  (``config.yaml``, ``metrics.jsonl``, ``summary.json`` or ``checkpoints/``), ``trainer.resume``
  decides: ``auto`` continues from its latest complete checkpoint, and starts a folder that
  has none again at step 0 when its ``config.yaml`` holds the same recipe (the trainer moves
  the rows aside); ``never`` refuses it; ``must`` refuses to start without a checkpoint. A
  resumed recipe may differ from the one that wrote the checkpoint only in :data:`RESUMABLE`
  flags, and in :data:`OVERRIDABLE` ones named on purpose; anything else is refused, listing
  the flags.

While a run works in a folder, rank 0 holds an exclusive ``flock`` on ``<folder>/.lock``
(released by the kernel when the process ends, however it ends): a second run started in
the same folder stops with an error naming the process that holds it.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from nemo_replay.trainer.config.loading import to_yaml
from nemo_replay.trainer.config.paths import output_dir_problem
from nemo_replay.trainer.config.schema import RecipeConfig
from nemo_replay.trainer.rundir.checkpoint import CHECKPOINTS, CheckpointInfo, latest_checkpoint

__all__ = [
    "RunDir", "prepare_run_dir", "new_run_dir", "default_run_name", "holds_run", "RESUMABLE", "OVERRIDABLE", "RUN_FILES",
    "check_overrides",
]

# Flags a resumed run may change: how long it runs, how it checkpoints and reports.
RESUMABLE = frozenset({
    "trainer.steps", "trainer.checkpoint_every", "trainer.keep_checkpoints", "trainer.resume",
    "trainer.progress_bar", "trainer.plot", "trainer.num_threads", "trainer.collective_timeout_s",
    "trainer.output_dir", "trainer.loggers",
})
# Optimizer and objective settings a resume may change, each only when named on purpose
# (``nemo-replay train --resume-override trainer.lr``): the way a diverged run goes on.
OVERRIDABLE = frozenset({"trainer.lr", "trainer.weight_decay", "trainer.grad_clip", "trainer.clip_eps", "trainer.kl_coef",
                         "trainer.objective", "trainer.tis_cap"})
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", CHECKPOINTS)
LOCK = ".lock"


def _slurm_tag() -> str:
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"-j{array_job}_{task}"
    job = os.environ.get("SLURM_JOB_ID")
    return f"-j{job}" if job else ""


def default_run_name(cfg: RecipeConfig, suffix: str = "", *, kind: Optional[str] = None) -> str:
    """``<YYYYmmdd-HHMMSS>-<strategy>-<kind><suffix>[-j<slurm job>]``; kind defaults to ``replay-<on|off>``."""
    kind = kind or f"replay-{'on' if cfg.replay.enabled else 'off'}"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.replay.strategy}-{kind}{suffix}{_slurm_tag()}"


def new_run_dir(parent: Path, name: str) -> Path:
    """Create and return ``parent/name``, or ``parent/name-2``, ``-3``, ...: the first that did not exist.

    ``mkdir`` without ``exist_ok`` is atomic, so concurrent callers (ranks of other jobs,
    array tasks on a shared file system) never get the same folder.
    """
    parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = parent / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise ValueError(f"{parent} holds runs {name} to {name}-9999; clean up old runs or set trainer.output_dir")


def holds_run(path: Path) -> list[str]:
    """The run files found in ``path`` (empty: no run there)."""
    return [name for name in RUN_FILES if (path / name).exists()]


@dataclass
class RunDir:
    """Where a run writes, and what it resumes from.

    Attributes:
        path: the run folder.
        resume: the checkpoint to continue from; None for a fresh run.
        restart: the folder holds a run killed before its first checkpoint, under the same
            recipe: it starts again at step 0 (its rows are moved aside).
        overridden: ``flag: old -> new`` for each :data:`OVERRIDABLE` flag a resume changes.
    """

    path: Path
    resume: Optional[CheckpointInfo] = None
    restart: bool = False
    overridden: list = field(default_factory=list)
    _lock: Optional[int] = field(default=None, repr=False)

    def release(self) -> None:
        """Give up the folder's lock (rank 0; the kernel also drops it when the process ends)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _lock(path: Path) -> Optional[int]:
    """An exclusive non-blocking flock on ``path/.lock``; None where the file system has no locks."""
    import fcntl

    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ValueError(
                f"trainer.output_dir={str(path)!r} is in use by a running run ({holder}); wait for it to end, "
                f"or choose another trainer.output_dir"
            ) from None
        import warnings

        warnings.warn(f"{path} is on a file system without flock ({exc.strerror}); runs sharing it are not kept apart")
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def _flat(node, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def recipe_differences(saved_yaml: str, cfg: RecipeConfig) -> list[str]:
    """``flag: saved -> now`` for every flag outside :data:`RESUMABLE` that changed."""
    saved = _flat(OmegaConf.to_container(OmegaConf.create(saved_yaml)))
    now = _flat(OmegaConf.to_container(OmegaConf.create(to_yaml(cfg))))
    keys = sorted((set(saved) | set(now)) - RESUMABLE)
    return [f"{k}: {saved.get(k, '(absent)')!r} -> {now.get(k, '(absent)')!r}" for k in keys if saved.get(k) != now.get(k)]


def check_overrides(flags) -> frozenset:
    """The flags a resume may change on purpose; ValueError naming the ones that cannot be."""
    flags = frozenset(flags or ())
    bad = sorted(flags - OVERRIDABLE)
    if bad:
        raise ValueError(
            f"--resume-override {', '.join(bad)}: only the optimizer and objective settings "
            f"{', '.join(sorted(OVERRIDABLE))} may change on resume; other changes need a new trainer.output_dir"
        )
    return flags


def _same_recipe(saved_yaml: str, cfg: RecipeConfig, allowed: frozenset) -> tuple[list, list]:
    """(refused differences, overridden ones) between a saved recipe and ``cfg``."""
    changed = recipe_differences(saved_yaml, cfg)
    overridden = [c for c in changed if c.split(":", 1)[0] in allowed]
    return [c for c in changed if c not in overridden], overridden


def _named(cfg: RecipeConfig, world_size: int, allowed: frozenset = frozenset()) -> RunDir:
    """Rank 0's decision for a named ``trainer.output_dir`` (see the module doc)."""
    problem = output_dir_problem(cfg.trainer.output_dir)
    if problem:
        raise ValueError(problem)
    path = Path(os.path.expanduser(cfg.trainer.output_dir))
    if cfg.trainer.resume == "must" and not path.exists():
        raise ValueError(
            f"trainer.resume=must but trainer.output_dir={str(path)!r} does not exist; name the folder of the run "
            f"to continue, or set trainer.resume=auto to start a run there"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"trainer.output_dir={str(path)!r} cannot be created ({exc.strerror or exc}); choose a writable folder"
        ) from None
    run = RunDir(path, _lock=_lock(path))
    found = holds_run(path)
    ckpt = latest_checkpoint(path / CHECKPOINTS)
    mode = cfg.trainer.resume
    again = "the same command continues it (trainer.resume=auto)"
    try:
        if mode == "never" and found:
            raise ValueError(
                f"trainer.output_dir={str(path)!r} already holds a run ({', '.join(found)}) and trainer.resume=never; "
                f"choose a new trainer.output_dir, or set trainer.resume=auto to continue it"
            )
        if mode == "must" and ckpt is None:
            raise ValueError(
                f"trainer.resume=must but {path / CHECKPOINTS} has no complete checkpoint to continue from"
                f"{' (the folder holds ' + ', '.join(found) + ')' if found else ''}; check trainer.output_dir, or set "
                f"trainer.resume=auto to start a run there"
            )
        if ckpt is None and found:
            # Killed before its first checkpoint (a node failure, an OOM kill, a requeue): under the
            # same recipe it starts again at step 0, its rows kept aside (as rows past a checkpoint are).
            saved = path / "config.yaml"
            refused, overridden = _same_recipe(saved.read_text(encoding="utf-8"), cfg, allowed) if saved.is_file() else (None, [])
            if refused is None or refused:
                why = (f"a recipe that differs in {'; '.join(refused)}" if refused else "no config.yaml naming its recipe")
                raise ValueError(
                    f"trainer.output_dir={str(path)!r} holds a run ({', '.join(found)}) without a complete checkpoint and "
                    f"with {why}; the same command restarts such a run from step 0 only under its own recipe. Restore "
                    f"those flags, or choose a new trainer.output_dir (or move that folder away)"
                )
            run.restart, run.overridden = True, overridden
        if ckpt is not None:
            if ckpt.world_size != world_size:
                raise ValueError(
                    f"the checkpoint {ckpt.path} was written by {ckpt.world_size} process(es) and this run has "
                    f"{world_size}; resume with the process count that wrote it (trainer.devices * trainer.num_nodes, "
                    f"or torchrun's), or start a new trainer.output_dir"
                )
            changed, overridden = _same_recipe(ckpt.config, cfg, allowed)
            if changed:
                optimizer = [c.split(":", 1)[0] for c in changed if c.split(":", 1)[0] in OVERRIDABLE]
                deliberate = (f", or continue with the change on purpose: nemo-replay train ... --resume-override "
                              f"{','.join(optimizer)} (recorded in the run's resume.log)") if optimizer else ""
                raise ValueError(
                    f"trainer.output_dir={str(path)!r} holds a run whose recipe differs in {'; '.join(changed)}; {again} "
                    f"only with the same recipe (only {', '.join(sorted(RESUMABLE))} may change). Restore those flags, "
                    f"or choose a new trainer.output_dir{deliberate}"
                )
            run.resume, run.overridden = ckpt, overridden
    except ValueError:
        run.release()
        raise
    return run


def prepare_run_dir(cfg: RecipeConfig, fabric, suffix: str = "", *, overrides=()) -> RunDir:
    """The run folder of ``cfg`` on every rank (see the module doc); raises ValueError on every rank.

    ``overrides``: :data:`OVERRIDABLE` flags a resume may change (:func:`check_overrides`).
    """
    decision, run = None, None
    if fabric.is_global_zero:
        try:
            if cfg.trainer.output_dir:
                run = _named(cfg, fabric.world_size, check_overrides(overrides))
            else:
                path = new_run_dir(Path("runs"), default_run_name(cfg, suffix))
                run = RunDir(path, _lock=_lock(path))
            decision = (str(run.path), (run.resume, run.restart, run.overridden), None)
        except (ValueError, OSError) as exc:
            decision = (None, None, str(exc) if isinstance(exc, ValueError) else f"run folder: {exc}")
    if fabric.world_size > 1:
        decision = fabric.broadcast(decision, src=0)
    path, state, error = decision
    if error:
        raise ValueError(error)
    if run is None or not fabric.is_global_zero:
        run = RunDir(Path(path), *state)
    return run
