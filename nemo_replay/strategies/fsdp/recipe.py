"""What the fsdp strategy asks of a recipe: its parallel sizes and its own rules.

Read by :mod:`nemo_replay.trainer.config.validation` through the strategy's spec; ``cfg`` is a
:class:`~nemo_replay.trainer.config.schema.RecipeConfig` (read by attribute, never imported here).
"""

from __future__ import annotations

__all__ = ["parallel_sizes", "check_config"]


def parallel_sizes(cfg) -> dict[str, int]:
    """Ulysses sequence-parallel ranks hold one copy of the data; FSDP shards over the rest."""
    return {"sequence": cfg.parallel.sequence}


def check_config(cfg, world_size: int) -> list[str]:
    """The fsdp strategy's rules (FSDP2 + Ulysses SP), one line per problem."""
    p = cfg.parallel
    out = [
        f"parallel.{name}={getattr(p, name)} is not available with the fsdp strategy (FSDP2 + Ulysses SP); set "
        f"parallel.{name}=1 or replay.strategy=megatron"
        for name in ("tensor", "pipeline", "context", "expert")
        if getattr(p, name) > 1
    ]
    if p.packing:
        out.append("parallel.packing=true is a megatron option; set parallel.packing=false with the fsdp strategy")
    return out
