"""The ``megatron`` replay strategy: roles driven through megatron-core's schedules.

:meth:`MegatronReplayStrategy.run_role` lays out each canonical micro-batch
(:mod:`~nemo_replay.strategies.megatron.batch`), runs ``get_forward_backward_func()``
with the role's :class:`~nemo_replay.strategies.megatron.steps.RoleForwardStep`, and
returns one :class:`~nemo_replay.strategies.base.RoleOutput` per micro-batch in canonical
``(B, S - 1)`` coordinates on every rank (the last pipeline stage broadcasts them over
the pipeline group).

Process groups are read from ``megatron.core.parallel_state`` once per call, at entry,
unless the strategy was built with an explicit :class:`MegatronParallel`.

The model's train/eval mode is the caller's: run forward-only roles in eval mode when the
model has dropout.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from nemo_replay.batch import ReplayBatch
from nemo_replay.strategies.megatron.token_layout import TokenMetadataLayout
from nemo_replay.objectives import PolicyLoss
from nemo_replay.strategies.base import (
    ReplayStrategy,
    RoleOutput,
    RoleSettings,
    start_role,
)
from nemo_replay.strategies.megatron.batch import prepare_micro_batch
from nemo_replay.strategies.megatron.parallel import MegatronParallel
from nemo_replay.strategies.megatron.routing import check_recorded_routes, check_route_replay, clear_routes
from nemo_replay.strategies.megatron.steps import RoleForwardStep

__all__ = ["MegatronReplayStrategy"]


class MegatronReplayStrategy(ReplayStrategy):
    """Support-conditioned replay for megatron-core GPTModels.

    Args:
        packed: THD packing (required for context parallelism; attention then needs
            Transformer Engine). Default: unpadded rows.
        fp8: FP8 token alignment; None reads ``config.fp8`` of the model.
        pad_id: token id written on padding slots.
        route_replay: install the batches' recorded MoE routes (R3) on every forward.
        parallel: explicit process groups; None reads ``parallel_state`` at each call.
    """

    name = "megatron"

    def __init__(
        self,
        *,
        packed: bool = False,
        fp8: Optional[bool] = None,
        pad_id: int = 0,
        route_replay: bool = False,
        parallel: Optional[MegatronParallel] = None,
    ):
        if parallel is not None and not isinstance(parallel, MegatronParallel):
            raise ValueError(f"parallel must be a MegatronParallel or None, got {type(parallel).__name__}")
        self.packed = bool(packed)
        self.fp8 = fp8
        self.pad_id = int(pad_id)
        self.route_replay = bool(route_replay)
        self.parallel = parallel

    def run_role(
        self, role, model, batches: Sequence[ReplayBatch], settings: RoleSettings, *, loss_fn: Optional[PolicyLoss] = None
    ) -> list[RoleOutput]:
        batches = list(batches)
        loss_fn = start_role(role, batches, settings, loss_fn)
        if not batches:
            return []
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.utils import get_model_config

        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        parallel = self.parallel or MegatronParallel.from_parallel_state()
        config = get_model_config(chunks[0])
        fp8 = bool(getattr(config, "fp8", None)) if self.fp8 is None else bool(self.fp8)
        if parallel.cp_size > 1 and not self.packed:
            raise ValueError(
                f"context parallelism (cp_size={parallel.cp_size}) needs packed THD sequences: build the megatron "
                f"strategy with packed=True (attention then runs Transformer Engine's THD kernels)"
            )
        routers = check_route_replay(chunks, config, vpp_size=parallel.vpp_size, role=role) if self.route_replay else None
        if routers is not None:
            for i, b in enumerate(batches):
                if b.routes is not None:  # a batch without routes is refused when it is prepared
                    check_recorded_routes(b.routes, config, micro_batch=i)
        device = next(chunks[0].parameters()).device
        seq_length, micro_batch_size, min_length = self._shapes(batches, parallel, fp8)
        prepared = [
            prepare_micro_batch(
                i, b, role=role, settings=settings, tp_size=parallel.tp_size, cp_size=parallel.cp_size,
                cp_rank=parallel.cp_rank, fp8=fp8, packed=self.packed, device=device, min_length=min_length,
                pad_id=self.pad_id, with_routes=routers is not None,
            )
            for i, b in enumerate(batches)
        ]
        step = RoleForwardStep(role, settings, parallel, config, routers=routers, loss_fn=loss_fn)
        forward_backward = get_forward_backward_func(pp_size=parallel.pp_size, vp_size=parallel.vpp_size)
        iterators = [iter(prepared) for _ in chunks] if len(chunks) > 1 else iter(prepared)
        forward_only = role != "policy"
        grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
        try:
            with grad_mode:
                forward_backward(
                    forward_step_func=step, data_iterator=iterators, model=chunks if len(chunks) > 1 else chunks[0],
                    num_microbatches=len(prepared), seq_length=seq_length, micro_batch_size=micro_batch_size,
                    forward_only=forward_only,
                )
        finally:
            if routers is not None:
                clear_routes(routers)
        results = [step.results.get(i) for i in range(len(prepared))]
        if parallel.pp_size > 1:
            # CPU copies: a pickled CUDA tensor would land on the sender's device index.
            holder = [[{k: _to(v, "cpu") for k, v in r.items()} for r in results] if parallel.is_last_stage else None]
            dist.broadcast_object_list(holder, src=parallel.pp_last_rank, group=parallel.pp_group)
            results = [{k: _to(v, device) for k, v in r.items()} for r in holder[0]]
        assert all(r is not None for r in results), "the loss closure did not run for every micro-batch"
        return [RoleOutput(**r) for r in results]

    def _shapes(self, batches: list[ReplayBatch], parallel: MegatronParallel, fp8: bool):
        """(seq_length, micro_batch_size, min_length) for the schedule; one shape under PP."""
        layouts = [
            TokenMetadataLayout.build(
                b.attention_mask, tp_size=parallel.tp_size, cp_size=parallel.cp_size, cp_rank=parallel.cp_rank,
                fp8=fp8, packed=self.packed,
            )
            for b in batches
        ]
        # seq_length is the whole (pre-CP, pre-SP) length; the schedule divides it itself.
        lengths = [lay.total_padded if self.packed else lay.local_shape[1] for lay in layouts]
        sizes = [1 if self.packed else lay.batch_size for lay in layouts]
        if parallel.pp_size > 1 and len(set(sizes)) > 1:
            raise ValueError(
                f"pipeline parallel schedules need one micro-batch size for every micro-batch, got batch sizes "
                f"{sizes}; split the batches evenly (or use packed=True, where every micro-batch is one row)"
            )
        longest = max(lengths)
        return longest, sizes[0], (longest if parallel.pp_size > 1 else None)


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return value
