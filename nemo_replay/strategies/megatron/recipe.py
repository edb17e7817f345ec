"""What the megatron strategy asks of a recipe: its parallel sizes and its own rules.

Read by :mod:`nemo_replay.trainer.config.validation` through the strategy's spec; ``cfg`` is a
:class:`~nemo_replay.trainer.config.schema.RecipeConfig` (read by attribute, never imported here).
"""

from __future__ import annotations

__all__ = ["parallel_sizes", "check_config"]


def parallel_sizes(cfg) -> dict[str, int]:
    """Tensor, pipeline and context parallel ranks hold one copy of the data."""
    p = cfg.parallel
    return {"tensor": p.tensor, "pipeline": p.pipeline, "context": p.context}


def check_config(cfg, world_size: int) -> list[str]:
    """The megatron strategy's rules for a recipe of ``world_size`` ranks, one line per problem."""
    p, m = cfg.parallel, cfg.model
    out = []
    if p.context > 1 and not p.packing:
        out.append(
            f"parallel.context={p.context} needs packed sequences: context parallel splits each packed "
            f"sequence into 2*cp chunks; set parallel.packing=true or parallel.context=1"
        )
    if p.sequence > 1:
        out.append(
            f"parallel.sequence={p.sequence} is Ulysses sequence parallel of the fsdp strategy; the megatron "
            f"strategy shards sequences with context parallel: set parallel.context={p.sequence} "
            f"(with parallel.packing=true) and parallel.sequence=1, or replay.strategy=fsdp"
        )
    if p.pipeline > 1:
        out.append(
            f"parallel.pipeline={p.pipeline}: the reference trainer samples with whole-model forwards, which "
            f"pipeline stages cannot run alone (the megatron strategy's roles do support pipeline parallel in "
            f"your own loop); set parallel.pipeline=1"
        )
    if p.expert > 1:
        ep_block = p.tensor * p.pipeline * p.expert
        if world_size % ep_block:
            out.append(
                f"parallel.expert={p.expert}: tensor*pipeline*expert = {ep_block} does not divide world size "
                f"{world_size}; change parallel.expert or the process count"
            )
        if m.num_experts and m.num_experts % p.expert:
            out.append(f"model.num_experts={m.num_experts} is not divisible by parallel.expert={p.expert}")
    if cfg.replay.route_replay and m.num_experts < 1:
        out.append(
            f"replay.route_replay=true needs an MoE model (model.num_experts={m.num_experts}); set "
            f"model.num_experts or replay.route_replay=false"
        )
    if m.pretrained is not None:
        out.append(
            "model.pretrained loads Hugging Face checkpoints for the fsdp strategy; the megatron strategy builds "
            "its GPTModel from the model.* sizes. Set model.pretrained=null or replay.strategy=fsdp"
        )
    return out
