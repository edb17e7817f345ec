"""Load a recipe: YAML with ``defaults:`` inheritance, dotlist overrides, typed and validated.

    cfg = load_config("configs/fsdp_gpu.yaml", ["trainer.steps=50", "replay.enabled=false"])

Inheritance. A YAML may open with a ``defaults:`` list of other recipes, merged in order,
then the file itself on top (later wins)::

    defaults:
      - pkg://default          # a recipe shipped inside the package (nemo_replay/configs/)
      - ../shared/cluster.yaml # a path relative to this file
    trainer: {steps: 500}

Each recipe, the CONFIG and every defaults entry, is a ``*.yaml`` / ``*.yml`` file holding a
mapping of flags; anything else is refused naming the file, never read back as flags.

Overrides. ``key=value`` strings in OmegaConf dotlist syntax, applied after every file
(``generation.top_k=null``, ``trainer.lr=3e-4``).

Errors. Every problem — unknown flags (with the closest known name), values of the wrong
type, and the cross-flag rules of :mod:`nemo_replay.trainer.config.validation` — is collected and
raised once as :class:`ConfigError`, before any model is built.
"""

from __future__ import annotations

import difflib
import os
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_replay.trainer.config.errors import ConfigError
from nemo_replay.trainer.config.schema import RecipeConfig, flag_docs
from nemo_replay.trainer.config.validation import collect_problems

__all__ = ["ConfigError", "PACKAGE_PREFIX", "packaged_config", "read_recipe", "load_config", "to_yaml"]

PACKAGE_PREFIX = "pkg://"


def packaged_config(name: str) -> Path:
    """Path of ``nemo_replay/configs/<name>.yaml`` (the recipes shipped as package data)."""
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    path = Path(str(resources.files("nemo_replay") / "configs" / f"{stem}.yaml"))
    if not path.is_file():
        shipped = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        raise ConfigError(
            [f"no packaged recipe {PACKAGE_PREFIX}{stem}; shipped recipes: {', '.join(shipped) or '(none)'}"]
        )
    return path


def _resolve(entry: str, base_dir: Optional[Path]) -> Path:
    if entry.startswith(PACKAGE_PREFIX):
        return packaged_config(entry[len(PACKAGE_PREFIX):])
    path = Path(os.path.expanduser(entry))
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if path.suffix not in (".yaml", ".yml") and not path.exists():
        path = path.with_suffix(".yaml")
    if not path.is_file():
        raise ConfigError([f"recipe file {str(path)!r} does not exist (from {entry!r})"])
    return path.resolve()


def _not_a_recipe(file: Path, named: str) -> Optional[str]:
    """Why ``file`` is not a recipe (a ``*.yaml`` / ``*.yml`` file holding a mapping of flags), naming
    it and never echoing its content (``defaults: [/etc/hostname]`` once read back as a flag); None
    when it is one, or when only OmegaConf's reading can say what is wrong with it."""
    fix = "name a recipe file (e.g. configs/fsdp_gpu.yaml) or a shipped one (pkg://default)"
    if file.suffix not in (".yaml", ".yml"):
        return f"{named} is not a recipe: {file} is not a YAML file named *.yaml or *.yml; {fix}"
    try:
        top = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        return None
    if top is not None and not isinstance(top, dict):
        return f"{named} is not a recipe: {file} holds a YAML {type(top).__name__}, not a mapping of flags; {fix}"
    return None


def read_recipe(path: str | os.PathLike, _stack: tuple[Path, ...] = ()) -> DictConfig:
    """The merged, untyped YAML of ``path`` after following its ``defaults:`` list.

    ``path`` is a file path or ``pkg://<name>``.
    """
    file = _resolve(str(path), None)
    problem = _not_a_recipe(file, f"the defaults entry {str(path)!r} of {_stack[-1]}" if _stack else f"{str(path)!r}")
    if problem:
        raise ConfigError([problem])
    if file in _stack:
        chain = " -> ".join(str(p) for p in (*_stack, file))
        raise ConfigError([f"recipe defaults form a cycle: {chain}; remove one of the includes"])
    try:
        node = OmegaConf.load(file)
    except Exception as exc:  # YAML syntax errors come in several types
        raise ConfigError([f"cannot parse {file}: {exc}"]) from exc
    if not isinstance(node, DictConfig):
        raise ConfigError([f"{file} must hold a mapping of flags at the top level, got {type(node).__name__}"])
    if len(node) == 0:
        # An empty file (or one of comments only) is almost always a wrong path or a lost edit.
        raise ConfigError([
            f"recipe file {file} is empty (no flags, no defaults); write flags into it, start it with "
            f"'defaults: [pkg://default]' to inherit the embedded recipe, or leave CONFIG out to run that recipe"
        ])
    defaults = node.pop("defaults", None) if "defaults" in node else None
    if defaults is None:
        return node
    if isinstance(defaults, str) or not OmegaConf.is_list(defaults):
        raise ConfigError([f"{file}: 'defaults' must be a list of recipes to inherit, got {defaults!r}"])
    layers = []
    for entry in defaults:
        if not isinstance(entry, str):
            raise ConfigError([f"{file}: each defaults entry must be a path or pkg://name string, got {entry!r}"])
        layers.append(read_recipe(_resolve(entry, file.parent), (*_stack, file)))
    return OmegaConf.merge(*layers, node)


def _leaves(node: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(node, dict):
        if not node and prefix:
            yield prefix.rstrip("."), node
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), node


def _parse_overrides(overrides: Sequence[str]) -> tuple[DictConfig, list[str]]:
    problems, good = [], []
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"override {item!r} is not key=value; write e.g. trainer.steps=20")
        else:
            good.append(item)
    try:
        return OmegaConf.from_dotlist(good), problems
    except OmegaConfBaseException as exc:
        return OmegaConf.create(), problems + [f"cannot parse overrides {good}: {exc}"]


def _apply(raw: dict, problems: list[str]) -> DictConfig:
    """Apply the raw leaves one at a time onto the schema, collecting unknown flags and type errors."""
    cfg = OmegaConf.structured(RecipeConfig)
    known = [path for path, _, _ in flag_docs()]
    sections = {p.rsplit(".", 1)[0] for p in known if "." in p}
    for path, value in _leaves(raw):
        if path not in known:
            if path in sections:
                problems.append(f"{path} is a section of flags, not a value; set its fields, e.g. {path}.<flag>=...")
                continue
            close = difflib.get_close_matches(path, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else "; run `nemo-replay flags` for the list"
            problems.append(f"unknown flag {path}{hint}")
            continue
        if isinstance(value, dict):
            problems.append(f"{path} takes a single value, got a mapping {value!r}")
            continue
        try:
            OmegaConf.update(cfg, path, value, merge=False)
        except OmegaConfBaseException as exc:
            reason = str(exc).splitlines()[0]
            if isinstance(OmegaConf.select(cfg, path), ListConfig) and not isinstance(value, (list, tuple)):
                reason = f"{path} takes a list; write it in brackets, e.g. {path}=[{value}]"
            problems.append(f"{path}={value!r}: {reason}")
    return cfg


def load_config(
    path: Optional[str | os.PathLike] = None,
    overrides: Sequence[str] = (),
    *,
    world_size: Optional[int] = None,
    validate: bool = True,
) -> RecipeConfig:
    """Read, merge, type and validate a recipe.

    Args:
        path: a YAML file or ``pkg://<name>``; None loads the embedded CPU default.
        overrides: ``key=value`` dotlist strings applied last.
        world_size: processes the run will have; None reads ``WORLD_SIZE`` or uses
            ``trainer.devices * trainer.num_nodes``.
        validate: run the cross-flag rules (:func:`~nemo_replay.trainer.config.validation.collect_problems`).

    Returns:
        a :class:`RecipeConfig` instance.

    Raises:
        ConfigError (a ValueError) listing every problem found.
    """

    source = str(path) if path is not None else f"{PACKAGE_PREFIX}default"
    raw_node = read_recipe(source)
    dotlist, problems = _parse_overrides(list(overrides))
    merged = OmegaConf.merge(raw_node, dotlist)
    try:
        raw = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError([f"cannot resolve an interpolation: {str(exc).splitlines()[0]}"], source) from exc
    typed = _apply(raw, problems)
    cfg: RecipeConfig = OmegaConf.to_object(typed)
    if validate:
        problems += collect_problems(cfg, world_size=world_size)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def to_yaml(cfg: RecipeConfig) -> str:
    """The resolved recipe as YAML (written next to the metrics of every run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
