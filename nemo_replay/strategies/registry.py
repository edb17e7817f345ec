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
from typing import Callable, Optional

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


def _no_sizes(cfg) -> dict[str, int]:
    return {}


def _no_problems(cfg, world_size: int) -> list[str]:
    return []


@dataclass(frozen=True)
class StrategySpec:
    """One replay strategy: how to build it, and what it asks of a recipe.

    The spec carries the strategy's behaviour so callers never branch on its name: recipe
    validation asks it for its checks and sizes, the reference trainer for its process-group
    need and its model backend. A third-party strategy says all of this about itself.

    Attributes:
        name: registry key, lower-case (``megatron``, ``fsdp``, ``my_backend``).
        factory: ``factory(**options) -> ReplayStrategy``; options come from the recipe.
        description: one line shown by ``nemo-replay strategies``.
        parallel_sizes: ``parallel_sizes(cfg) -> {flag: size}``, the ``parallel.*`` flags whose
            product is the number of ranks that hold one copy of the data (megatron:
            ``tensor``, ``pipeline``, ``context``; fsdp: ``sequence``). The world size must be a
            multiple of that product; the rest is data parallel.
        check_config: ``check_config(cfg, world_size) -> list[str]``, the strategy's own rules
            for a recipe, one line per problem naming the flag and the fix (collected with
            every other problem into one error).
        needs_process_group: the strategy needs ``torch.distributed`` even on one rank
            (megatron-core's model-parallel state does).
        supports_route_replay: the strategy replays recorded MoE routes (``replay.route_replay``).
        trainer_backend: ``"module:attribute"`` of the class that builds models for the reference
            trainer (``nemo-replay train``), imported only when a run starts; None when the strategy
            is meant for users' own loops only.
    """

    name: str
    factory: Callable[..., object]
    description: str = ""
    parallel_sizes: Callable[[object], dict] = _no_sizes
    check_config: Callable[[object, int], list] = _no_problems
    needs_process_group: bool = False
    supports_route_replay: bool = False
    trainer_backend: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"strategy name must be lower-case letters, digits, '_' or '-', starting with a letter; got {self.name!r}"
            )
        for field_name in ("factory", "parallel_sizes", "check_config"):
            if not callable(getattr(self, field_name)):
                raise ValueError(
                    f"strategy {self.name!r}: {field_name} must be callable, got {type(getattr(self, field_name)).__name__}"
                )
        if self.trainer_backend is not None and (
            not isinstance(self.trainer_backend, str) or ":" not in self.trainer_backend
        ):
            raise ValueError(
                f"strategy {self.name!r}: trainer_backend must be 'module:attribute' or None, got {self.trainer_backend!r}"
            )

    def model_parallel_size(self, cfg) -> int:
        """Ranks that hold one copy of the data: the product of :attr:`parallel_sizes` (each at least 1)."""
        size = 1
        for value in self.parallel_sizes(cfg).values():
            size *= max(1, int(value))
        return size

    def load_trainer_backend(self):
        """The reference trainer's backend class; ValueError when the strategy has none."""
        if self.trainer_backend is None:
            raise ValueError(
                f"strategy {self.name!r} provides no model backend for the reference trainer (StrategySpec."
                f"trainer_backend is None); pass one as GRPOTrainer(cfg, backend=...) or use it in your own loop"
            )
        return _load(self.trainer_backend)


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
