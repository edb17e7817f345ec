"""Flags that name a place on disk, checked before any model is built (docs/design.md §8).

Each check returns None when the path is usable, else one line naming the flag, what is at
that path and the fix. Nothing is downloaded: ``model.pretrained`` must be a local folder,
and a Hugging Face hub id (``org/name``) is reported like any other missing path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

__all__ = ["pretrained_problem", "output_dir_problem", "WEIGHT_FILES"]

# What ``transformers.AutoModelForCausalLM.from_pretrained`` reads from a local folder
# (transformers/utils/__init__.py: WEIGHTS_NAME, WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
# SAFE_WEIGHTS_INDEX_NAME).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")

_FIX_PRETRAINED = (
    "point model.pretrained at a local folder holding a Hugging Face checkpoint (config.json and "
    "model.safetensors or pytorch_model.bin; hub ids are not downloaded, fetch it first), or set "
    "model.pretrained=null to build the model from the model.* sizes"
)


def _listing(folder: Path, limit: int = 6) -> str:
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return "it is empty"
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return "it holds " + ", ".join(names[:limit]) + more


def pretrained_problem(value: Optional[str]) -> Optional[str]:
    """Why ``model.pretrained=value`` cannot be loaded, or None (also None for null)."""
    if value is None:
        return None
    head = f"model.pretrained={value!r}"
    if not str(value).strip():
        return f"{head} is empty; {_FIX_PRETRAINED}"
    path = Path(os.path.expanduser(str(value)))
    try:
        if not path.exists():
            where = f" (relative to the working directory {os.getcwd()})" if not path.is_absolute() else ""
            return f"{head}: nothing exists at that path{where}; {_FIX_PRETRAINED}"
        if not path.is_dir():
            return f"{head} is a file, not a checkpoint folder; {_FIX_PRETRAINED}"
        config = path / "config.json"
        if not config.is_file():
            return f"{head} is a folder without config.json ({_listing(path)}); {_FIX_PRETRAINED}"
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except ValueError as exc:
            return f"{head}: {config} is not valid JSON ({exc}); re-export the checkpoint or {_FIX_PRETRAINED}"
        if not any((path / name).is_file() for name in WEIGHT_FILES):
            return (
                f"{head} has config.json but no weights (none of {', '.join(WEIGHT_FILES)}; {_listing(path)}); "
                f"{_FIX_PRETRAINED}"
            )
    except OSError as exc:  # permission denied and the like
        return f"{head} cannot be read ({exc.strerror or exc}); {_FIX_PRETRAINED}"
    return None


def output_dir_problem(value: Optional[str]) -> Optional[str]:
    """Why ``trainer.output_dir=value`` cannot hold a run folder, or None (also None for null).

    A folder that does not exist yet is fine (it is created); a file at the path or at one
    of its parents is not.
    """
    if value is None:
        return None
    head = f"trainer.output_dir={value!r}"
    if not str(value).strip():
        return f"{head} is empty; name a folder, or set trainer.output_dir=null for a new folder under runs/"
    path = Path(os.path.expanduser(str(value)))
    fix = "name a folder (new or holding a run to resume), or set trainer.output_dir=null for a new folder under runs/"
    for candidate in (path, *path.parents):
        try:
            if candidate.exists() and not candidate.is_dir():
                what = "is a file" if candidate == path else f"is under {str(candidate)!r}, which is a file"
                return f"{head} {what}, not a folder; {fix}"
        except OSError as exc:
            return f"{head} cannot be inspected ({exc.strerror or exc}); {fix}"
    return None
