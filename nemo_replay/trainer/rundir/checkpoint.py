"""Checkpoints of a run: written atomically, resumed bit for bit (docs/design.md §10).

Layout under the run folder::

    checkpoints/
      step-0000049/            a complete checkpoint: steps 0..49 are done
        state/                 model and optimizer (format below), the trainer state
        complete.json          written last; without it the folder is never resumed from. It
                               lists every other file with its size and digest
                               (trainer/rundir/digests.py), checked before a resume reads it
      .partial-step-0000099-3fa2c1/   a save in progress (or one a crash left behind)

What a checkpoint holds: the policy's weights and the optimizer state; the step; the
metrics so far; and, per rank, every RNG state (Python, NumPy, torch CPU and CUDA, and the
trainer's own prompt and sampling generators, which are the data position). The reference
model is not saved: it is the initial policy, rebuilt from the seed (or
``model.pretrained``) the same way on resume.

Two formats, chosen by what the model offers, never by a strategy's name:

- ``megatron-dist``: a model with ``sharded_state_dict()`` (megatron-core's
  ``MegatronModule``) goes through megatron-core's ``dist_checkpointing``: every rank writes
  its own shards (torch distributed checkpoint underneath); the optimizer's per-parameter
  tensors are sharded like their parameters (``dist_checkpointing.optimizer``), its scalars
  (Adam's step count) and groups travel in the rank's trainer state;
- ``fabric``: any other model through Lightning Fabric's ``save`` / ``load``: one file on a
  single device; under FSDP2 (DTensor parameters, Fabric's ``ModelParallelStrategy``) a
  sharded folder written through torch distributed checkpoint.

Integrity. A checkpoint whose files are missing, resized or altered, or that its loader fails
on (any exception, ``BaseException`` subclasses such as torch DCP's ``CheckpointException``
included), is set aside on every rank alike and the one before it is used
(:meth:`Checkpointer.load`, ``grpo.GRPOTrainer._resume``). So is one whose ``complete.json``
cannot be trusted (:class:`ManifestUntrusted`): its step must be an int equal to the folder's
number and to the state's own step, its listing must name every file of the folder and only
files inside it.

Atomicity. Every rank writes into ``.partial-step-<n>-<token>``; after a barrier, rank 0
writes ``complete.json`` (fsynced) and renames the folder to ``step-<n>`` (one ``rename``,
atomic on POSIX file systems), then prunes. A crash at any point leaves either the old
latest checkpoint or the new one, never half of one. Old checkpoints are renamed away
before they are deleted, for the same reason.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import secrets
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

import nemo_replay.trainer.rundir.digests as digests  # the module, not the package: no import circle
from nemo_replay.distributed.groups import agree
from nemo_replay.trainer.loggers.metrics import current_names, write_atomic
from nemo_replay.trainer.preemption import start_writer_helpers

__all__ = [
    "CHECKPOINTS",
    "MANIFEST",
    "CheckpointInfo",
    "CheckpointMismatch",
    "CheckpointUnreadable",
    "Checkpointer",
    "ManifestUntrusted",
    "unreadable_manifests",
    "latest_checkpoint",
    "capture_rank_rng",
    "restore_rank_rng",
    "state_format",
]

CHECKPOINTS = "checkpoints"
MANIFEST = "complete.json"
_COMPLETE = re.compile(r"^step-(\d{7,})$")
_FORMAT_VERSION = 1
#: ``complete.json``'s own version. 1: the manifest written before it had a ``version`` key (the
#: same fields, read under the same checks); 2: with the key.
_MANIFEST_VERSION = 2
_FORMATS = ("fabric", "megatron-dist")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint, as its ``complete.json`` describes it.

    Attributes:
        path: the ``step-<n>`` folder.
        step: the last step it holds (steps ``0..step`` are done; the run resumes at ``step + 1``).
        world_size: processes that wrote it (a resume needs as many).
        format: ``fabric`` or ``megatron-dist``.
        config: the recipe of the run that wrote it, as YAML.
        files: ``{relative path: [size, sha256 hex]}`` of every file of the folder but
            ``complete.json`` (:mod:`~nemo_replay.trainer.rundir.digests`), each checked before a
            resume reads it; a file of the folder it does not list is refused.
    """

    path: Path
    step: int
    world_size: int
    format: str
    config: str
    files: dict


class CheckpointUnreadable(RuntimeError):
    """A complete checkpoint (its ``complete.json`` intact) whose state does not load on some rank."""

    def __init__(self, path: Path, cause: str):
        super().__init__(f"checkpoint {path} does not load: {cause}")
        self.path, self.cause = path, cause


class CheckpointMismatch(ValueError):
    """A checkpoint that loads but does not fit this run's model or optimizer (a recipe error, not damage)."""


class ManifestUntrusted(ValueError):
    """A ``complete.json`` that parses but cannot steer a resume: another step than its folder's, a
    file outside the folder, no listing to check the files against, an unknown version."""


# What reading a manifest raises when it cannot be used (deep nesting: RecursionError).
_UNUSABLE = (OSError, ValueError, RecursionError)


def _read_manifest(folder: Path) -> Optional[CheckpointInfo]:
    try:
        return _parse_manifest(folder)
    except _UNUSABLE:
        return None


def _exact_int(value) -> bool:
    return type(value) is int  # not a bool, not 2.9, not Infinity


def _name_problem(name) -> Optional[str]:
    """Why ``name`` is not a file inside the checkpoint's folder, as the writer records one; None when it is."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return f"{name!r} is not a relative file name"
    if name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
        return f"{name!r} is not a relative path inside the checkpoint's folder (no '/' first, no '.' or '..' parts)"
    return None


def _files_problem(files) -> Optional[str]:
    """Why the manifest's ``files`` entry is not a listing to check every file against; None when it is."""
    if not isinstance(files, dict) or not files:
        return (f"its files entry is {json.dumps(files)[:40]} where {{name: [size, sha256]}} of every file is expected "
                f"(a checkpoint written before digests, or its listing removed: nothing can be checked)")
    for name, entry in files.items():
        problem = _name_problem(name)
        if problem:
            return f"its files entry lists {problem}"
        if not (isinstance(entry, list) and len(entry) == 2 and _exact_int(entry[0]) and entry[0] >= 0
                and isinstance(entry[1], str) and _SHA256.match(entry[1])):
            return f"its files entry for {name!r} is {json.dumps(entry)[:60]} where [size, 64 hex digits of SHA-256] is expected"
    return None


def _manifest_problem(folder: Path, data) -> Optional[str]:
    """Why the parsed ``complete.json`` of ``folder`` cannot be trusted; None when it can."""
    if not isinstance(data, dict):
        return "it is not a JSON object"
    version = data.get("version", 1)  # version 1: the same fields, written before the manifest had a version
    if not (_exact_int(version) and 1 <= version <= _MANIFEST_VERSION):
        return f"its version is {json.dumps(version)[:20]}, this nemo_replay reads versions 1 to {_MANIFEST_VERSION}"
    m = _COMPLETE.match(folder.name)
    if m is None:
        return f"its folder's name {folder.name!r} is not step-<n> (7 digits or more)"
    named = int(m.group(1))
    if not (_exact_int(data.get("step")) and data["step"] == named):
        return f"its step is {json.dumps(data.get('step'))[:20]} where the folder's number {named} is expected"
    if not (_exact_int(data.get("world_size")) and data["world_size"] >= 1):
        return f"its world_size is {json.dumps(data.get('world_size'))[:20]} where a process count >= 1 is expected"
    if data.get("format") not in _FORMATS:
        return f"its format is {json.dumps(data.get('format'))[:20]} where one of {', '.join(_FORMATS)} is expected"
    if not isinstance(data.get("config"), str):
        return "its config is not the recipe's YAML text"
    return _files_problem(data.get("files"))


def _parse_manifest(folder: Path) -> CheckpointInfo:
    data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    problem = _manifest_problem(folder, data)
    if problem:
        raise ManifestUntrusted(problem)
    return CheckpointInfo(folder, data["step"], data["world_size"], data["format"], data["config"], data["files"])


def unreadable_manifests(root: Path) -> list[tuple[Path, str]]:
    """``step-<n>`` folders under ``root`` whose ``complete.json`` is missing or does not parse, with why."""
    if not root.is_dir():
        return []
    bad = []
    for child in sorted(root.iterdir()):
        if _COMPLETE.match(child.name) and child.is_dir():
            try:
                _parse_manifest(child)
            except _UNUSABLE as exc:
                bad.append((child, f"{type(exc).__name__}: {exc}"))
    return bad


def latest_checkpoint(root: Path) -> Optional[CheckpointInfo]:
    """The newest complete checkpoint under ``root`` (a ``checkpoints/`` folder), or None."""
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        m = _COMPLETE.match(child.name)
        if m and child.is_dir():
            info = _read_manifest(child)
            if info is not None:
                found.append(info)
    return max(found, key=lambda i: i.step, default=None)


# ---------------------------------------------------------------------------- RNG states
def capture_rank_rng(generators: dict[str, torch.Generator]) -> dict:
    """Every RNG state of this process, as tensors and plain values (loadable with ``weights_only``).

    Args:
        generators: the trainer's own generators by name (prompt order, sampling).
    """
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "generators": {k: g.get_state() for k, g in generators.items()},
    }


def restore_rank_rng(state: dict, generators: dict[str, torch.Generator]) -> None:
    """Put back what :func:`capture_rank_rng` captured (the inverse, field by field)."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    missing = set(generators) - set(state["generators"])
    if missing:
        raise ValueError(f"the checkpoint has no state for the generators {sorted(missing)}; it was written by another trainer")
    for k, g in generators.items():
        g.set_state(state["generators"][k])


# ---------------------------------------------------------------------------- formats
@contextlib.contextmanager
def _temp_folder(folder: Path):
    """``tempfile``'s default folder is ``folder`` while inside (then what it was)."""
    before = tempfile.tempdir
    tempfile.tempdir = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = before


class _FabricFormat:
    """Lightning Fabric's ``save`` / ``load`` (sharded through torch DCP when the model holds DTensors)."""

    name = "fabric"

    def rank_extra(self, model, optimizer) -> dict:
        return {}

    def save(self, fabric, folder: Path, model, optimizer, common: dict) -> None:
        # Fabric's single-file save stages the whole file through fsspec's transaction in the temp
        # folder ($TMPDIR): a small one failed the save with the output disk free. Staged inside the
        # checkpoint's own (partial) folder, the file is renamed on the output's file system instead.
        with _temp_folder(folder):
            fabric.save(folder / "state", {"model": model, "optimizer": optimizer, "trainer": common})

    def load(self, fabric, folder: Path, model, optimizer) -> dict:
        state = {"model": model, "optimizer": optimizer, "trainer": {}}
        fabric.load(folder / "state", state)
        return state["trainer"]


def _optimizer_params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


class _MegatronFormat:
    """megatron-core ``dist_checkpointing``: model and optimizer tensors sharded like the model."""

    name = "megatron-dist"

    def rank_extra(self, model, optimizer) -> dict:
        """This rank's optimizer layout: which state entries are parameter-shaped tensors
        (saved sharded) and the rest (scalars such as Adam's ``step``, the param groups)."""
        params = _optimizer_params(optimizer)
        osd = optimizer.state_dict()
        tensor_keys, other = {}, {}
        for pid, entry in osd["state"].items():
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape == params[pid].shape:
                    tensor_keys.setdefault(pid, []).append(key)
                else:
                    other.setdefault(pid, {})[key] = value
        return {"param_groups": osd["param_groups"], "tensor_keys": tensor_keys, "other": other}

    def _sharded(self, model, optimizer, tensor_keys: dict, values) -> dict:
        from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, make_sharded_optimizer_tensor

        model_sd = model.sharded_state_dict()
        params = _optimizer_params(optimizer)
        by_id = get_param_id_to_sharded_param_map(model_sd, params)
        missing = [pid for pid in tensor_keys if pid not in by_id]
        if missing:
            raise CheckpointMismatch(
                f"optimizer parameters {missing[:5]} have no entry in the model's sharded_state_dict(); "
                f"build the optimizer over the model's own parameters"
            )
        optim = {
            str(pid): {key: make_sharded_optimizer_tensor(by_id[pid], values(pid, key), prefix=f"optimizer.state.{key}") for key in keys}
            for pid, keys in tensor_keys.items()
        }
        return {"model": model_sd, "optimizer": optim}

    def save(self, fabric, folder: Path, model, optimizer, common: dict) -> None:
        from megatron.core import dist_checkpointing

        layout = common["ranks"][dist.get_rank()]["format"]
        state = optimizer.state_dict()["state"]
        sharded = self._sharded(model, optimizer, layout["tensor_keys"], lambda pid, key: state[pid][key])
        sharded["trainer"] = common
        target = folder / "state"
        if dist.get_rank() == 0:
            target.mkdir()
        dist.barrier()
        start_writer_helpers()
        dist_checkpointing.save(sharded, str(target))

    def load(self, fabric, folder: Path, model, optimizer) -> dict:
        from megatron.core import dist_checkpointing

        target = str(folder / "state")
        common = dist_checkpointing.load_common_state_dict(target)["trainer"]
        layout = common["ranks"][dist.get_rank()]["format"]
        params = _optimizer_params(optimizer)
        template = self._sharded(model, optimizer, layout["tensor_keys"], lambda pid, key: torch.empty_like(params[pid]))
        loaded = dist_checkpointing.load(template, target)
        model.load_state_dict(loaded["model"])
        restored = {"state": {}, "param_groups": layout["param_groups"]}
        for pid in set(layout["tensor_keys"]) | set(layout["other"]):
            entry = dict(layout["other"].get(pid, {}))
            for key in layout["tensor_keys"].get(pid, []):
                entry[key] = loaded["optimizer"][str(pid)][key]
            restored["state"][pid] = entry
        optimizer.load_state_dict(restored)
        return common


class _Damaged(Exception):
    """A checkpoint's file that is not what was written (missing, another size, other bytes)."""


def _raise_if(problem: Optional[str]) -> None:
    if problem is not None:
        raise _Damaged(problem)


def state_format(model):
    """How a :class:`Checkpointer` writes ``model`` and its optimizer into a checkpoint's ``state/``:
    ``megatron-dist`` for a model with ``sharded_state_dict()``, ``fabric`` for any other (module doc).

    The format has ``name`` (recorded in ``complete.json``), ``rank_extra(model, optimizer)`` (this
    rank's layout, kept in the trainer state), ``save(fabric, folder, model, optimizer, common)``
    (writes ``folder / "state"``; ``common``: the trainer state, a dict) and ``load(fabric, folder,
    model, optimizer)`` (restores both in place, returns ``common``). Neither writes the manifest or
    the digests: the :class:`Checkpointer` does, around them.
    """
    return _MegatronFormat() if callable(getattr(model, "sharded_state_dict", None)) else _FabricFormat()


# ---------------------------------------------------------------------------- save / load
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Checkpointer:
    """Writes and reads the checkpoints of one run (see the module doc).

    Args:
        root: the run's ``checkpoints/`` folder.
        fabric: the run's launched Fabric (rank, barrier, broadcast; the ``fabric`` format).
        every: ``trainer.checkpoint_every``: a checkpoint after every ``every``-th step and
            after the last; 0 writes one only when the run is stopped by a signal.
        keep: ``trainer.keep_checkpoints``: complete checkpoints kept (0: all).
        config: the run's recipe as YAML (stored in ``complete.json``).
    """

    def __init__(self, root: Path, fabric, *, every: int, keep: int, config: str):
        self.root = Path(root)
        self.fabric = fabric
        self.every = every
        self.keep = keep
        self.config = config
        self.last: Optional[Path] = None

    def due(self, step: int, *, last: bool, stopping: bool) -> bool:
        """Whether to write a checkpoint after ``step`` (0-based)."""
        if stopping:
            return True
        return self.every > 0 and (last or (step + 1) % self.every == 0)

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def save(self, step: int, model, optimizer, *, history: list, rank_state: dict) -> Path:
        """Write the checkpoint of steps ``0..step``; collective (every rank calls it). Returns its folder."""
        fmt = state_format(model)
        mine = dict(rank_state, format=fmt.rank_extra(model, optimizer))
        world = self.fabric.world_size
        if self._distributed():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        common = {
            "version": _FORMAT_VERSION, "step": step, "world_size": world, "config": self.config,
            # JSON text: NaN metrics compare equal across ranks and load under weights_only.
            "history": json.dumps(history), "ranks": ranks,
        }
        # Rank 0 checks the space and every rank gets its verdict, so all refuse together.
        short = self._space_short() if self.fabric.is_global_zero else None
        short = self.fabric.broadcast(short, src=0) if world > 1 else short
        if short is not None:
            raise OSError(errno.ENOSPC, short)
        token = secrets.token_hex(3) if self.fabric.is_global_zero else None
        token = self.fabric.broadcast(token, src=0) if world > 1 else token
        partial = self.root / f".partial-step-{step:07d}-{token}"
        if self.fabric.is_global_zero:
            partial.mkdir(parents=True)
        self.fabric.barrier()
        fmt.save(self.fabric, partial, model, optimizer, common)
        self.fabric.barrier()
        files = self._digests(partial)
        final = self.root / f"step-{step:07d}"
        if self.fabric.is_global_zero:
            manifest = {"version": _MANIFEST_VERSION, "step": step, "world_size": world, "format": fmt.name, "config": self.config, "written": time.time(),
                        "files": files}
            write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1))
            if final.exists():
                # Not ours to delete (a folder left by hand or by an interrupted prune): moved aside.
                aside = final.with_name(f".replaced-{final.name}-{token}")
                warnings.warn(f"{final} existed before this checkpoint; moved to {aside.name}")
                os.rename(final, aside)
            os.rename(partial, final)
            _fsync_dir(self.root)
            self._prune()
        self.fabric.barrier()
        self.last = final
        return final

    def _rank_world(self) -> tuple[int, int]:
        return (dist.get_rank(), dist.get_world_size()) if self._distributed() else (0, 1)

    def _digests(self, folder: Path) -> Optional[dict]:
        """``{name: [size, digest]}`` of every file of the written ``folder`` (collective: rank 0
        lists it, each rank hashes its share of the blocks, rank 0 combines; the others get None)."""
        rank, world = self._rank_world()
        listing = digests.list_files(folder, skip=MANIFEST) if rank == 0 else None
        if world > 1:
            box = [listing]
            dist.broadcast_object_list(box, src=0)
            listing = box[0]
        mine = digests.block_digests(folder, digests.share(digests.blocks(listing), rank, world))
        if world == 1:
            return digests.combine(listing, mine)
        gathered = [None] * world
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
        return digests.combine(listing, {k: v for part in gathered for k, v in part.items()}) if rank == 0 else None

    def _verify(self, info: CheckpointInfo) -> None:
        """Raise :class:`CheckpointUnreadable` on every rank alike when a recorded file is missing,
        resized or altered (collective: each rank hashes its share of the blocks; all gather)."""
        group = dist.group.WORLD if self._distributed() else None
        rank, world = self._rank_world()
        files = sorted((name, size) for name, (size, _) in info.files.items())

        def mine() -> dict:
            _raise_if(digests.unlisted(info.path, info.files, skip=MANIFEST))
            _raise_if(digests.resized(info.path, info.files))
            return digests.block_digests(info.path, digests.share(digests.blocks(files), rank, world))

        try:
            got = agree(mine, group, device=self.fabric.device, name="checkpoint")
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as exc:  # _Damaged, or a file that cannot be read
            raise CheckpointUnreadable(info.path, str(exc) if isinstance(exc, _Damaged) else f"{type(exc).__name__}: {exc}") from None
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, got)
            got = {k: v for part in parts for k, v in part.items()}
        problem = digests.differs(info.files, digests.combine(files, got))
        if problem is not None:
            raise CheckpointUnreadable(info.path, problem)

    def _space_short(self) -> Optional[str]:
        """A one-line reason when the output's free space is below the last checkpoint's size (plus 10%).

        None when it fits or no checkpoint of this run was written yet (nothing to size it by).
        """
        if self.last is None or not self.last.is_dir():
            return None
        need = sum(f.stat().st_size for f in self.last.rglob("*") if f.is_file())
        need += need // 10
        free = shutil.disk_usage(self.root).free
        if free >= need:
            return None
        head = (f"{self.root}: {free / 2**20:.1f} MiB free, a checkpoint needs about {need / 2**20:.1f} MiB (the last, "
                f"{self.last.name}, plus 10%)")
        kept = [info for info in map(_read_manifest, self.root.glob("step-*")) if info is not None]
        # Each older checkpoint frees about what the last one holds; a resume prunes before its first step.
        drop = -(-(need - free) * 11 // 10 // max(need, 1))
        if len(kept) - drop >= 1:
            return (f"{head}; free space there, or run the same command with trainer.keep_checkpoints="
                    f"{len(kept) - drop} (it holds {len(kept)} now): the resume keeps the newest {len(kept) - drop} "
                    f"before its first step")
        return f"{head}; the run keeps {len(kept)} checkpoint(s) already: free space on that file system, then run the same command"

    def set_aside(self, bad: CheckpointUnreadable) -> Optional[CheckpointInfo]:
        """Rename an unloadable checkpoint to ``.unloadable-step-<n>-<token>`` (rank 0); collective.

        Returns the newest complete checkpoint left (None when there is none). The folder is
        kept, not deleted: it may be mended or examined.
        """
        aside = None
        if self.fabric.is_global_zero:
            aside = bad.path.with_name(f".unloadable-{bad.path.name}-{secrets.token_hex(3)}")
            os.rename(bad.path, aside)
            _fsync_dir(self.root)
        if self.fabric.world_size > 1:
            aside = self.fabric.broadcast(aside, src=0)
        self.fabric.barrier()
        self.set_aside_as = aside
        return latest_checkpoint(self.root)

    def clean(self) -> list[Path]:
        """Rank 0, before the first step: delete the ``.partial-*`` folders interrupted saves left (a
        full disk stays full until they go) and ``.deleting-*`` ones; returns them."""
        if not self.root.is_dir():
            return []
        gone = [p for p in self.root.iterdir() if p.name.startswith((".partial-", ".deleting-"))]
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)
        return gone

    def set_aside_unreadable_manifests(self) -> list[str]:
        """Rank 0, before the first step: rename ``step-<n>`` folders whose ``complete.json`` does not
        parse to ``.unloadable-step-<n>-<token>`` (never resumed from, never pruned as a checkpoint);
        returns a line for each."""
        lines = []
        for path, why in unreadable_manifests(self.root):
            aside = path.with_name(f".unloadable-{path.name}-{secrets.token_hex(3)}")
            os.rename(path, aside)
            lines.append(f"checkpoint {path} has no readable {MANIFEST} ({why}); moved it to {aside}")
        if lines:
            _fsync_dir(self.root)
        return lines

    def prune(self) -> None:
        """Rank 0, on resume before the first step: keep the newest ``keep`` complete checkpoints, so
        that a lower ``trainer.keep_checkpoints`` frees the space the next save needs."""
        if self.fabric.is_global_zero:
            self._prune()
        self.fabric.barrier()

    def _prune(self) -> None:
        """Rank 0: drop checkpoints beyond ``keep``, partial folders left by interrupted saves, and
        the rest of deletions an earlier crash interrupted (``.deleting-*``)."""
        complete = sorted(
            (info for info in (_read_manifest(p) for p in self.root.iterdir() if _COMPLETE.match(p.name)) if info),
            key=lambda i: i.step,
        )
        doomed = [info.path for info in complete[: -self.keep]] if self.keep > 0 else []
        doomed += [p for p in self.root.iterdir() if p.name.startswith(".partial-")]
        # Folders moved aside when a checkpoint replaced them: all but the newest.
        replaced = sorted(self.root.glob(".replaced-*"), key=lambda p: p.stat().st_mtime)
        doomed += replaced[:-1]
        for leftover in self.root.glob(".deleting-*"):  # already renamed away: never a checkpoint
            shutil.rmtree(leftover, ignore_errors=True)
        for path in doomed:
            # Renamed first: a folder half deleted must never look complete.
            trash = path.with_name(f".deleting-{path.name.lstrip('.')}-{secrets.token_hex(2)}")
            try:
                os.rename(path, trash)
            except OSError:
                continue
            shutil.rmtree(trash, ignore_errors=True)

    def load(self, info: CheckpointInfo, model, optimizer) -> tuple[list, dict]:
        """Restore ``model`` and ``optimizer`` from ``info``; returns (history, this rank's state)."""
        fmt = state_format(model)
        if fmt.name != info.format:
            raise ValueError(
                f"checkpoint {info.path} is in the {info.format!r} format but this model saves as {fmt.name!r} "
                f"(another strategy wrote it); resume with the recipe that wrote it, or use a new trainer.output_dir"
            )
        # Every rank decides alike: a file or shard may fail on one rank only.
        group = dist.group.WORLD if self._distributed() else None
        self._verify(info)
        try:
            common = agree(lambda: fmt.load(self.fabric, info.path, model, optimizer), group,
                           device=self.fabric.device, name="checkpoint")
        except CheckpointMismatch:
            raise
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as exc:  # whatever the reader raises (torch DCP's CheckpointException is a BaseException)
            text = str(exc).strip()
            raise CheckpointUnreadable(info.path, f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}") from None
        rank = dist.get_rank() if self._distributed() else 0
        if not (_exact_int(common.get("step")) and common["step"] == info.step):
            # The same common state on every rank: all set it aside alike.
            raise CheckpointUnreadable(info.path, f"its state holds step {common.get('step')!r} where its folder and "
                                                  f"{MANIFEST} say {info.step}")
        if common.get("version") != _FORMAT_VERSION or len(common["ranks"]) != self.fabric.world_size:
            raise ValueError(
                f"checkpoint {info.path} holds {len(common['ranks'])} rank(s) (format version {common.get('version')}); "
                f"this run has {self.fabric.world_size}: resume with as many processes as wrote it"
            )
        self.last = info.path
        return [current_names(r) for r in json.loads(common["history"])], common["ranks"][rank]

