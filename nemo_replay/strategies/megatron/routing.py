"""MoE router replay (R3) through megatron-core's own ``RouterReplay`` (docs/design.md §7).

A model built with ``TransformerConfig(moe_enable_routing_replay=True)`` gives every
``TopKRouter`` a ``router_replay`` object. In the ``REPLAY_FORWARD`` action the router
skips its top-k and takes the installed indices instead (the gate probabilities are
gathered at those indices, so gradients still reach the gate). This module installs the
rollout's recorded routes on the routers of the model being run, one micro-batch at a
time, and clears them afterwards. It works on the routers of the given model only: the
class-level list ``RouterReplay.global_router_replay_instances`` also holds the routers of
every other model in the process (a reference model, say), so it is not used.

Token order. Routes arrive token-aligned through the micro-batch layout, shape
``(*local_shape, layers, topk)`` with ``local_shape = (B, S_out)`` (unpadded) or
``(1, T_local)`` (packed), no next-token shift (a route belongs to the token that was
routed, not to the token it predicts). The router sees hidden states ``[s, b, h]``
flattened to ``s * B + b``; under sequence parallelism each TP rank holds a contiguous
``1/tp`` slice of ``s``. Worked example, B = 2, S_out = 4, tp = 2 with sequence parallel:
rank 1 holds s = 2, 3 and its router tokens are (s=2,b=0) (2,1) (3,0) (3,1).

Layers. ``routes[..., i, :]`` is the i-th MoE layer of the whole model, counted over the
global layer numbers marked MoE by ``config.moe_layer_freq``; each router finds its
column from its own global ``layer_number``, so pipeline stages pick their own layers.
Padding tokens (``-1`` rows) get experts ``0..topk-1``: causal attention keeps them from
influencing real tokens. A real token's recorded route must name experts in
``[0, num_experts)``: :func:`check_recorded_routes` checks that in canonical coordinates,
where it can name the trajectory and token, before anything is laid out.
"""

from __future__ import annotations

from typing import Sequence

import torch

from nemo_replay.support.packed import PackedTensor

__all__ = [
    "moe_routers",
    "moe_layer_columns",
    "check_route_replay",
    "check_recorded_routes",
    "install_routes",
    "clear_routes",
]


def moe_routers(model_chunks: Sequence[torch.nn.Module]) -> list:
    """The ``TopKRouter`` modules with a ``router_replay`` object, in module order."""
    routers = []
    for chunk in model_chunks:
        for module in chunk.modules():
            if getattr(module, "router_replay", None) is not None and hasattr(module, "layer_number"):
                routers.append(module)
    return routers


def moe_layer_columns(config) -> dict[int, int]:
    """Global 1-based layer number -> column of the routes' ``layers`` axis."""
    freq = getattr(config, "moe_layer_freq", 1)
    n = config.num_layers
    if isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(n)]
    else:
        pattern = list(freq)
    columns, k = {}, 0
    for i, is_moe in enumerate(pattern):
        if is_moe:
            columns[i + 1] = k
            k += 1
    return columns


def check_route_replay(model_chunks: Sequence[torch.nn.Module], config, *, vpp_size, role: str) -> list:
    """Validate that routes can be replayed on this model; return its routers.

    Raises:
        ValueError: virtual pipeline parallelism; activation recomputation in the policy
            role; a model without routing replay enabled.
    """
    if len(model_chunks) > 1 or (vpp_size or 1) > 1 or getattr(config, "virtual_pipeline_model_parallel_size", None):
        raise ValueError(
            f"MoE route replay with virtual pipeline parallelism (model chunks: {len(model_chunks)}, vpp_size="
            f"{vpp_size}) is not supported: interleaved chunks run micro-batches out of order, so the installed "
            f"routes could reach the wrong forward. Run without virtual_pipeline_model_parallel_size, or without "
            f"route replay"
        )
    if role == "policy" and getattr(config, "recompute_granularity", None) is not None:
        raise ValueError(
            f"MoE route replay in the policy role with activation recomputation (recompute_granularity="
            f"{config.recompute_granularity!r}) is not supported: the recomputed router inside backward would need "
            f"megatron's REPLAY_BACKWARD action in schedule order. Set recompute_granularity=None for route replay"
        )
    routers = moe_routers(model_chunks)
    if not routers:
        raise ValueError(
            "MoE route replay is on but the model has no router with routing replay; build the model with "
            "TransformerConfig(moe_enable_routing_replay=True, num_moe_experts=...)"
        )
    return routers


def check_recorded_routes(routes: PackedTensor, config, *, micro_batch: int) -> None:
    """Check one micro-batch's recorded routes against the model, in canonical coordinates.

    Args:
        routes: values ``(sum(L_b), layers, topk)`` int, one row per real token of each
            trajectory (prompt and response), ``cu_seqlens (B + 1,)`` int32.
        config: the model's TransformerConfig (``moe_layer_freq``, ``moe_router_topk``,
            ``num_moe_experts``).
        micro_batch: index of the micro-batch in the role's list (for messages).

    Raises:
        ValueError: a layer / top-k shape that does not match the model; an expert id outside
            ``[0, num_experts)`` (``-1`` included: every real token was routed), naming the
            trajectory, token position and MoE layer.
    """
    layers, topk, experts = len(moe_layer_columns(config)), config.moe_router_topk, config.num_moe_experts
    values = routes.values
    if values.dim() != 3 or tuple(values.shape[1:]) != (layers, topk):
        raise ValueError(
            f"micro-batch {micro_batch}: routes must be (tokens, layers={layers}, topk={topk}) for this model's MoE "
            f"layers, got {tuple(values.shape)}; record them with the same num_layers, moe_layer_freq and "
            f"moe_router_topk"
        )
    # Compare in int64: a narrow dtype wraps the bound (uint8 routes of a 256-expert model
    # compared with 256 compare with 0). One host read of the extremes; widen only to locate.
    low, high = (int(v) for v in torch.aminmax(values)) if values.numel() else (0, 0)
    if low < 0 or high >= experts:
        wide = values.to(torch.int64)
        bad = torch.nonzero((wide < 0) | (wide >= experts))
        row, layer, _ = (int(v) for v in bad[0])
        # Row -> (trajectory, token): with cu_seqlens [0, 5, 8], row 6 is token 1 of trajectory 1.
        b = int(torch.searchsorted(routes.cu_seqlens.to(torch.int64).cpu(), row, right=True)) - 1
        q = row - int(routes.cu_seqlens[b])
        raise ValueError(
            f"micro-batch {micro_batch}, trajectory {b}, token position {q}, MoE layer {layer}: recorded experts "
            f"{values[row, layer].tolist()} lie outside [0, num_moe_experts={experts}); every real token needs the "
            f"experts it was routed to at rollout. Record routes for every prompt and response token with the same "
            f"num_moe_experts, or build the strategy with route_replay=False"
        )


def _router_tokens(routes: torch.Tensor, *, sequence_parallel: bool, tp_size: int, tp_rank: int) -> torch.Tensor:
    """``(b, s, layers, topk)`` -> ``(tokens, layers, topk)`` in the router's ``s * B + b`` order."""
    sbf = routes.transpose(0, 1)  # (s, b, layers, topk)
    if sequence_parallel and tp_size > 1:
        s = sbf.shape[0]
        if s % tp_size:
            raise ValueError(f"sequence length {s} is not a multiple of tp_size={tp_size} under sequence parallelism")
        part = s // tp_size
        sbf = sbf[tp_rank * part : (tp_rank + 1) * part]
    return sbf.reshape(-1, *routes.shape[2:])


def install_routes(routers: list, routes: torch.Tensor, config, *, tp_size: int = 1, tp_rank: int = 0) -> None:
    """Install one micro-batch's routes on ``routers`` and switch them to ``REPLAY_FORWARD``.

    Args:
        routers: from :func:`check_route_replay`.
        routes: ``(*local_shape, layers, topk)`` int64, ``-1`` rows on padding; real tokens
            already checked by :func:`check_recorded_routes`.
        config: the model's TransformerConfig (``moe_layer_freq``, ``moe_router_topk``,
            ``num_moe_experts``, ``sequence_parallel``).
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    columns = moe_layer_columns(config)
    topk = config.moe_router_topk
    if routes.dim() != 4 or routes.shape[2] != len(columns) or routes.shape[3] != topk:
        raise ValueError(
            f"routes must be (*local_shape, layers={len(columns)}, topk={topk}) for this model's MoE layers, got "
            f"{tuple(routes.shape)}"
        )
    real = routes[..., 0, 0] >= 0
    fill = torch.arange(topk, dtype=torch.int64, device=routes.device)
    routes = torch.where(real[..., None, None], routes, fill)
    tokens = _router_tokens(routes, sequence_parallel=bool(config.sequence_parallel), tp_size=tp_size, tp_rank=tp_rank)
    for router in routers:
        if router.layer_number not in columns:
            raise ValueError(
                f"router of layer {router.layer_number} is not an MoE layer under moe_layer_freq="
                f"{config.moe_layer_freq!r}; the routes' layer axis cannot be matched to the model"
            )
        router.router_replay.set_target_indices(tokens[:, columns[router.layer_number]].contiguous())
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_routes(routers: list) -> None:
    """Drop installed routes and return the routers to ordinary top-k routing."""
    for router in routers:
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()
