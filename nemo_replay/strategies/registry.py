"""The strategy registry: plain data, looked up by name (docs/design.md §5).

A strategy is a frozen :class:`StrategySpec` holding a factory. Built-ins (``megatron``,
``fsdp``) are named here and imported only when looked up, so ``import nemo_replay`` never
imports megatron-core or transformers. Third-party packages register through the
``nemo_replay.strategies`` entry-point group; each entry point loads to a StrategySpec::

    # pyproject.toml of a plugin
    [project.entry-points."nemo_replay.strategies"]
    my_backend = "my_pkg.replay:SPEC"

Nothing here runs at import time beyond building the empty default registry.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import threading
from dataclasses import dataclass
from typing import Callable

__all__ = [
    "StrategySpec",
    "StrategyRegistry",
    "ENTRY_POINT_GROUP",
    "register_strategy",
    "get_strategy",
    "available_strategies",
    "default_registry",
]

ENTRY_POINT_GROUP = "nemo_replay.strategies"
_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")

# name -> "module:attribute" of a StrategySpec, imported on first lookup.
_BUILTINS = {
    "megatron": "nemo_replay.strategies.megatron:SPEC",
    "fsdp": "nemo_replay.strategies.fsdp:SPEC",
}


@dataclass(frozen=True)
class StrategySpec:
    """One replay strategy.

    Attributes:
        name: registry key, lower-case (``megatron``, ``fsdp``, ``my_backend``).
        factory: ``factory(**options) -> ReplayStrategy``; options come from the recipe.
        description: one line shown by ``nemo-replay strategies``.
    """

    name: str
    factory: Callable[..., object]
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"strategy name must be lower-case letters, digits, '_' or '-', starting with a letter; got {self.name!r}"
            )
        if not callable(self.factory):
            raise ValueError(f"strategy {self.name!r}: factory must be callable, got {type(self.factory).__name__}")


def _load(target: str) -> StrategySpec:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


class StrategyRegistry:
    """Name -> StrategySpec, with lazy built-ins and entry points.

    Args:
        builtins: name -> "module:attribute" loaded on first lookup.
        entry_point_group: entry-point group scanned on lookup misses and listings;
            None to disable.
    """

    def __init__(self, builtins: dict[str, str] | None = None, entry_point_group: str | None = ENTRY_POINT_GROUP):
        self._specs: dict[str, StrategySpec] = {}
        self._lazy = dict(builtins or {})
        self._group = entry_point_group
        self._lock = threading.Lock()

    def _entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        if self._group is None:
            return {}
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=self._group)}

    def register(self, spec: StrategySpec) -> StrategySpec:
        """Add ``spec``; a name already registered (or reserved by a built-in) is rejected."""
        if not isinstance(spec, StrategySpec):
            raise ValueError(f"register() takes a StrategySpec, got {type(spec).__name__}")
        with self._lock:
            if spec.name in self._specs or spec.name in self._lazy:
                raise ValueError(
                    f"strategy {spec.name!r} is already registered; pick another name "
                    f"(registered: {', '.join(self.names())})"
                )
            self._specs[spec.name] = spec
        return spec

    def names(self) -> list[str]:
        return sorted(set(self._specs) | set(self._lazy) | set(self._entry_points()))

    def get(self, name: str) -> StrategySpec:
        with self._lock:
            if name in self._specs:
                return self._specs[name]
            if name in self._lazy:
                spec = _load(self._lazy[name])
                self._check_loaded(name, spec, self._lazy[name])
                self._specs[name] = spec
                del self._lazy[name]
                return spec
        eps = self._entry_points()
        if name in eps:
            spec = eps[name].load()
            self._check_loaded(name, spec, f"entry point {eps[name].value}")
            with self._lock:
                self._specs.setdefault(name, spec)
            return spec
        raise ValueError(
            f"unknown replay strategy {name!r}; registered strategies: {', '.join(self.names()) or '(none)'}. "
            f"Set replay.strategy to one of them, or register a plugin under the "
            f"'{ENTRY_POINT_GROUP}' entry-point group"
        )

    @staticmethod
    def _check_loaded(name: str, spec: object, origin: str) -> None:
        if not isinstance(spec, StrategySpec) or spec.name != name:
            raise ValueError(f"{origin} must provide a StrategySpec named {name!r}, got {spec!r}")


default_registry = StrategyRegistry(_BUILTINS)


def register_strategy(spec: StrategySpec) -> StrategySpec:
    """Register ``spec`` in the default registry (rejects duplicates)."""
    return default_registry.register(spec)


def get_strategy(name: str) -> StrategySpec:
    """Look ``name`` up; unknown names raise ValueError listing the registered ones."""
    return default_registry.get(name)


def available_strategies() -> list[str]:
    """Names of built-in, registered and entry-point strategies, without importing them."""
    return default_registry.names()
