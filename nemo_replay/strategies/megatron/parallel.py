"""The megatron strategy's boundary with ``megatron.core.parallel_state``.

:meth:`MegatronParallel.from_parallel_state` is the only place the strategy reads Megatron's
global process groups. Everything downstream (layout, scorer, route replay, result
broadcast) receives the groups held here as explicit arguments. (verl's Megatron engine
hands its loss functions no groups, so ``integrations/verl/megatron.py`` reads them from
``parallel_state`` where verl's own code does.) A trainer that manages
its own groups builds a :class:`MegatronParallel` directly and passes it to the strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from nemo_replay.scoring.shard import VocabShard

__all__ = ["MegatronParallel"]


@dataclass(frozen=True)
class MegatronParallel:
    """Process groups and ranks of one Megatron rank.

    Attributes:
        tp_group: tensor-parallel group (vocabulary shards), or None for tp_size 1.
        cp_group: context-parallel group, or None for cp_size 1.
        pp_group: pipeline-parallel group, or None for pp_size 1.
        tp_size, tp_rank, cp_size, cp_rank, pp_size, pp_rank: sizes and this rank's index.
        pp_last_rank: global rank of the last pipeline stage in this rank's pipeline (the
            source of the result broadcast; read only when pp_size > 1).
        vpp_size: virtual pipeline size, or None.
    """

    tp_group: Optional[object] = None
    cp_group: Optional[object] = None
    pp_group: Optional[object] = None
    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    pp_last_rank: int = 0
    vpp_size: Optional[int] = None

    def __post_init__(self) -> None:
        for name, size, rank, group in (
            ("tp", self.tp_size, self.tp_rank, self.tp_group),
            ("cp", self.cp_size, self.cp_rank, self.cp_group),
            ("pp", self.pp_size, self.pp_rank, self.pp_group),
        ):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name}_rank={rank} must lie in [0, {name}_size={size})")
            if size > 1 and group is None:
                raise ValueError(f"{name}_size={size} needs its process group ({name}_group)")
            if group is not None and dist.get_world_size(group) != size:
                raise ValueError(f"{name}_group has {dist.get_world_size(group)} ranks, {name}_size says {size}")

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def vocab_shard(self, local_size: int) -> VocabShard:
        """This rank's slice of Megatron's vocab-parallel output layer (an even split of ``local_size`` rows each)."""
        return VocabShard(self.tp_rank * local_size, (self.tp_rank + 1) * local_size, self.tp_group, local_size * self.tp_size)

    @classmethod
    def from_parallel_state(cls) -> "MegatronParallel":
        """Read the groups megatron-core's ``initialize_model_parallel`` set up."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise ValueError(
                "megatron.core.parallel_state is not initialised: call initialize_model_parallel(...) before "
                "running a role, or pass parallel=MegatronParallel(...) to the megatron strategy"
            )
        tp, cp, pp = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
        )
        return cls(
            tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
            cp_group=ps.get_context_parallel_group() if cp > 1 else None,
            pp_group=ps.get_pipeline_model_parallel_group() if pp > 1 else None,
            tp_size=tp,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            cp_size=cp,
            cp_rank=ps.get_context_parallel_rank(),
            pp_size=pp,
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_last_rank=ps.get_pipeline_model_parallel_last_rank() if pp > 1 else 0,
            vpp_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        )
