"""Forward-step functions and loss closures in megatron-core's convention (docs/design.md §6).

``get_forward_backward_func()`` calls ``forward_step_func(data_iterator, model)``, which
returns the model output and a closure ``loss_func(output) -> (loss, reduced)``; on the
last pipeline stage the schedule calls the closure, multiplies the loss by the CP size,
divides it by the number of micro-batches and (unless ``forward_only``) back-propagates.

:class:`RoleForwardStep` is that ``forward_step_func`` for one role:

- ``policy``: scores with gradients, brings the log-probs to the caller's ``(B, A)``
  columns (a differentiable gather over CP) and returns the loss of the step's
  ``loss_fn`` (a :class:`~nemo_replay.objectives.PolicyLoss`; default
  ``TokenRatioObjective()``, the clipped token-ratio objective);
- ``recompute`` / ``reference``: score under ``torch.no_grad`` (the caller runs the schedule
  with ``forward_only=True``) and return a zero loss.

CP normalisation. Every CP rank computes the objective of the whole micro-batch from the
gathered log-probs; the gather's backward keeps this rank's slots of the gradient (no
collective), so each rank's parameters receive the gradient through its own tokens only.
The schedule's ``x cp_size`` and the DDP average over ``dp x cp`` then cancel: the summed
gradient is that of the micro-batch's objective, as without CP.

Each closure also stores the micro-batch's results, scattered back to canonical
``(B, S - 1)`` coordinates, in :attr:`RoleForwardStep.results`. A trainer with its own
training loop can hand a ``RoleForwardStep`` to its own ``forward_backward_func`` call.

Sources. Logits mode scores the GPTModel output ``[b, s, V/tp]`` (vocab-parallel; a
gathered ``[b, s, V]`` output is scored without the TP group). Hidden mode runs the model
with ``post_process`` switched off for the call, so GPTModel returns the decoder output
``[s, b, H]`` (after the final norm) and never builds logits; the scorer projects it
against this rank's output-layer shard ``(V/tp, H)``.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Optional

import torch

from nemo_replay.layout.canonical import to_caller_columns
from nemo_replay.objectives import PolicyLoss
from nemo_replay.scoring.entry import score_positions
from nemo_replay.strategies.base import RoleSettings, policy_objective
from nemo_replay.strategies.megatron.batch import PreparedMicroBatch
from nemo_replay.strategies.megatron.token_layout import TokenMetadataLayout
from nemo_replay.strategies.megatron.parallel import MegatronParallel
from nemo_replay.strategies.megatron.routing import install_routes

__all__ = ["RoleForwardStep", "unwrap_gpt_model", "gather_logits_to_canonical"]


def unwrap_gpt_model(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (the module holding ``decoder``)."""
    inner = model
    while not hasattr(inner, "decoder") and hasattr(inner, "module"):
        inner = inner.module
    if not hasattr(inner, "decoder"):
        raise ValueError(f"expected a megatron-core GPTModel (possibly wrapped), got {type(model).__name__}")
    return inner


def output_weight(inner: torch.nn.Module) -> torch.Tensor:
    """This rank's LM-head shard ``(V/tp, H)`` (the shared embedding when tied)."""
    if getattr(inner, "share_embeddings_and_output_weights", False):
        return inner.shared_embedding_or_output_weight()
    return inner.output_layer.weight


class _GatherToCanonical(torch.autograd.Function):
    """Local per-logit values ``(*local_shape)`` -> canonical ``(B, S - 1)``, differentiable.

    Forward: :meth:`TokenMetadataLayout.to_canonical` (one all-gather over CP; 0 where no
    rank predicts). Backward: :meth:`TokenMetadataLayout.align_logits` of the incoming
    gradient, its exact adjoint -- each local slot takes the gradient of the canonical
    position it fills, padding slots 0 -- and no collective (module doc, CP normalisation).
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: TokenMetadataLayout, cp_group) -> torch.Tensor:
        ctx.layout = layout
        return layout.to_canonical(local.detach(), 0.0, cp_group=cp_group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.layout.align_logits(grad, 0.0).to(grad.dtype), None, None


def gather_logits_to_canonical(local: torch.Tensor, layout: TokenMetadataLayout, cp_group=None) -> torch.Tensor:
    """Differentiable :meth:`TokenMetadataLayout.to_canonical` (see :class:`_GatherToCanonical`).

    Args:
        local: ``layout.local_shape``, float: one value per local logit slot.
        cp_group: the CP group (required when ``layout.cp_size > 1``).
    Returns:
        (B, S - 1), same dtype, every CP rank the whole micro-batch.
    """
    return _GatherToCanonical.apply(local, layout, cp_group)


def _canonical_outputs(scores, logprobs: Optional[torch.Tensor], layout: TokenMetadataLayout, cp_group) -> dict:
    """The scorer's per-slot outputs in canonical ``(B, S - 1)`` columns, with one all-gather over CP.

    The fields present (``logprobs`` when given, the two masks, entropy and support mass when
    computed) are stacked on a last dimension in one float dtype and gathered together;
    the masks come back bool. Positions no rank predicts are 0 / False. Detached.
    """
    fields = {"logprobs": logprobs, "valid_mask": scores.valid_mask, "fallback_mask": scores.fallback_mask,
              "entropy": scores.entropy, "support_logmass": scores.support_logmass}
    present = {k: v for k, v in fields.items() if v is not None}
    dtype = torch.float32
    for v in present.values():
        if v.is_floating_point():
            dtype = torch.promote_types(dtype, v.dtype)
    stacked = torch.stack([v.detach().to(dtype) for v in present.values()], -1)
    canon = layout.to_canonical(stacked, 0.0, cp_group=cp_group)
    out = dict.fromkeys(fields)
    for i, (name, v) in enumerate(present.items()):
        out[name] = canon[..., i] != 0 if v.dtype == torch.bool else canon[..., i].to(v.dtype)
    return out


@contextlib.contextmanager
def _decoder_output(inner: torch.nn.Module, enabled: bool):
    """Make GPTModel return its decoder output instead of logits for one call."""
    if not enabled:
        yield
        return
    saved = inner.post_process
    inner.post_process = False
    try:
        yield
    finally:
        inner.post_process = saved


class RoleForwardStep:
    """``forward_step_func`` for one role (see the module doc).

    Args:
        role: ``policy``, ``recompute`` or ``reference``.
        settings: the role's RoleSettings.
        parallel: explicit process groups (never read from ``parallel_state`` here).
        config: the model's TransformerConfig.
        routers: routers for MoE route replay, or None.
        loss_fn: the ``policy`` role's objective (default :func:`~nemo_replay.strategies.base.policy_objective`,
            ``TokenRatioObjective()``); forward-only roles ignore it.

    Attributes:
        results: micro-batch index -> dict of RoleOutput fields in canonical coordinates
            (filled on the last pipeline stage).
    """

    def __init__(
        self, role: str, settings: RoleSettings, parallel: MegatronParallel, config, routers=None,
        loss_fn: Optional[PolicyLoss] = None,
    ):
        self.role = role
        self.settings = settings
        self.loss_fn = policy_objective(loss_fn) if role == "policy" else None
        self.parallel = parallel
        self.config = config
        self.routers = routers
        self.results: dict[int, dict] = {}
        if settings.source == "hidden" and getattr(config, "mtp_num_layers", None):
            raise ValueError(
                "hidden-state scoring with multi-token prediction (mtp_num_layers set) is not supported: the decoder "
                "output then carries the MTP streams. Use RoleSettings(source='logits')"
            )

    # ------------------------------------------------------------------ forward step
    def __call__(self, data_iterator, model):
        mb: PreparedMicroBatch = next(data_iterator)
        inner = unwrap_gpt_model(model)
        if self.routers is not None:
            p = self.parallel
            install_routes(self.routers, mb.routes, self.config, tp_size=p.tp_size, tp_rank=p.tp_rank)
        hidden = self.settings.source == "hidden" and bool(inner.post_process)
        with _decoder_output(inner, hidden):
            output = model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
        return output, partial(self._loss, mb, inner, hidden)

    # ------------------------------------------------------------------ loss closure
    def _source(self, output: torch.Tensor, inner, hidden: bool):
        """(source ``[*local_shape, V_local or H]``, lm_head_weight or None, this rank's VocabShard)."""
        p = self.parallel
        weight = output_weight(inner)
        v_local = weight.shape[0]
        if hidden:
            if self.config.sequence_parallel and p.tp_size > 1:
                from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

                # Backward only splits: the scorer already all-reduces the hidden grad over TP.
                output = gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False, group=p.tp_group)
            return output.transpose(0, 1), weight, p.vocab_shard(v_local)
        if output.shape[-1] == v_local:
            return output, None, p.vocab_shard(v_local)
        if output.shape[-1] == v_local * p.tp_size:
            return output, None, None  # parallel_output=False: every rank holds all V
        raise ValueError(
            f"model output has last dimension {output.shape[-1]}; expected the vocab shard {v_local} "
            f"(or the gathered vocabulary {v_local * p.tp_size})"
        )

    def _loss(self, mb: PreparedMicroBatch, inner, hidden: bool, output: torch.Tensor):
        source, weight, shard = self._source(output, inner, hidden)
        p, lay = self.parallel, mb.layout
        # A CP rank that rejects its slice would leave the others in the gather below: all raise together.
        scores = score_positions(source, mb.channels, mb.support, replay=mb.replay, shard=shard, lm_head_weight=weight,
                       group=p.cp_group, group_name="CP", **self.settings.scorer_options())
        # The policy role gathers the log-probs differentiably, for its objective; every other
        # output (and the log-probs of the forward-only roles) travels in one detached gather.
        # They keep the scorer's dtype: float64 models get float64 log-probs (1e-15, not 5e-7).
        policy = self.role == "policy"
        logprobs = scores.logprobs
        result = _canonical_outputs(scores, None if policy else logprobs, lay, p.cp_group)
        if policy:
            logprobs = gather_logits_to_canonical(logprobs, lay, p.cp_group)
            result["logprobs"] = logprobs.detach()
        result.update(loss=None, metrics={})
        if not policy:
            self.results[mb.index] = result
            return torch.zeros((), device=source.device), {}
        batch = mb.batch
        view = to_caller_columns(logprobs, batch.response_width)
        mask = batch.loss_mask.to(view.device) != 0
        loss, metrics = self.loss_fn(view, batch, mask)
        result["loss"], result["metrics"] = loss.detach(), dict(metrics)
        self.results[mb.index] = result
        return loss.clone(), {}
