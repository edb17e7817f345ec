"""Replay in verl 0.9.1's FSDP engine (``workers/engine/fsdp/transformer_impl.py``; docs/design.md §9.3).

:class:`ReplayFSDPEngineWithLMHead` subclasses verl's ``FSDPEngineWithLMHead`` and is
registered with verl's ``EngineRegistry`` for the ``fsdp`` and ``fsdp2`` backends under the
vendor key ``nemo_replay`` (importing this module registers it; ``VERL_ENGINE_VENDOR=nemo_replay``
selects it). verl's ``forward_backward_batch``, micro-batching, ``forward_step``, model forward,
autocast, Ulysses gather and loss all stay verl's. It overrides:

- ``forward_backward_batch``: the whole batch is checked first (every rank raises together)
  and each sample is tagged with its index, for errors;
- ``prepare_model_inputs``: verl's own, plus ONE channel carried exactly as verl carries
  ``input_ids_rmpad_rolled`` -- the packed index of the token each logit predicts
  (:func:`~nemo_replay.integrations.verl.response_layout.next_token_index`), through verl's static
  pad (``pad_packed_inputs``) and Ulysses pad-and-slice (``ulysses_pad_and_slice_inputs``),
  or laid over the padded rows without remove-padding;
- ``prepare_model_outputs``: the method that turns the model's logits into ``log_probs``
  and ``entropy``. Replay replaces exactly that step: verl's version computes both over the
  full vocabulary in one 200-line method (``logprobs_from_logits``, ``entropy_from_logits``)
  with no smaller seam to hook, so this override scores the support with the shared scorer
  and then assembles the outputs with verl's own helpers (``_gather_and_unpad_packed``,
  nested tensors over ``input_ids.offsets()``), as verl assembles its own;
- ``forward_step``: verl's, with its loss function wrapped to add the replay metrics.

Outputs, each nested ``[b, L_i]`` like verl's ``log_probs`` (value at packed token q scores
token q + 1): ``log_probs`` over the recorded support (0 where not loss-active),
``full_vocab_log_probs`` (verl's own scoring of the same tokens, detached), ``entropy`` of the
support distribution when verl asks for entropy, and verl's full-vocabulary ``sum_pi_squared``.

Refused, each with its fix: ``use_fused_kernels`` (the fused forward scores inside the
model), top-k distillation and a dense ``pad_mode``.
"""

from __future__ import annotations

import torch

import verl.utils.torch_functional as verl_F
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.ulysses import get_ulysses_sequence_parallel_group, ulysses_pad_and_slice_inputs
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import pad_packed_inputs

from nemo_replay.distributed.compat import dtensor_names
from nemo_replay.distributed.groups import group_size_rank
from nemo_replay.integrations.verl.engine import (
    FULL_VOCAB_KEY,
    FUSED_KERNELS_FIX,
    VENDOR,
    ReplayEngineMixin,
    micro_batch_layout,
    scalar_temperature,
    score_slots,
    with_replay_metrics,
)
from nemo_replay.integrations.verl.response_layout import next_token_index, padded_next_token_index
from nemo_replay.scoring.shard import VocabShard

DTensor, Replicate, Shard = dtensor_names()

__all__ = ["ReplayFSDPEngineWithLMHead", "local_vocab_shard"]

_PREDICTED = "replay_predicted"  # output_args: the predicted-token channel, laid out like the logits
_FLAT = "replay_flat"  # output_args (no remove-padding): each padded slot's packed token, -1 on padding


def local_vocab_shard(logits) -> tuple[torch.Tensor, VocabShard]:
    """(local logits, this rank's :class:`VocabShard`) for a plain tensor or a vocab-sharded DTensor.

    verl's FSDP engine family hands ``prepare_model_outputs`` DTensor logits sharded on the
    vocabulary under tensor parallelism (and gathers them with ``full_tensor()``); replay
    scores the local shard instead. DTensor's ``Shard(-1)`` split is ``torch.chunk``'s:
    ``ceil(V / tp)`` rows per rank.
    """
    if not isinstance(logits, DTensor):
        return logits, VocabShard.whole(logits.shape[-1])
    local = logits.to_local()
    vocab_dims = []
    for dim, placement in enumerate(logits.placements):
        if isinstance(placement, Shard) and placement.dim in (-1, logits.dim() - 1):
            vocab_dims.append(dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"DTensor logits placed {logits.placements}; replay scores logits that are replicated or sharded on "
                f"the vocabulary (Shard(-1)) over one mesh dimension"
            )
    if not vocab_dims:
        return local, VocabShard.whole(local.shape[-1])
    if len(vocab_dims) > 1:
        raise ValueError(f"DTensor logits are sharded on the vocabulary over {len(vocab_dims)} mesh dimensions; expected one")
    group = logits.device_mesh.get_group(vocab_dims[0])
    size, rank = group_size_rank(group)
    vocab = logits.shape[-1]
    per = -(-vocab // size)
    return local, VocabShard(rank * per, rank * per + local.shape[-1], group if size > 1 else None, vocab)


def _refuse_unsupported(micro_batch) -> None:
    if tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
        raise ValueError(FUSED_KERNELS_FIX)
    if tu.get_non_tensor_data(data=micro_batch, key="distillation_use_topk", default=False):
        raise ValueError(
            "top-k distillation scores the student over the full vocabulary; it cannot run with replay "
            f"(VERL_ENGINE_VENDOR={VENDOR}). Turn distillation off or unset VERL_ENGINE_VENDOR"
        )
    pad_mode = tu.get_non_tensor_data(data=micro_batch, key="pad_mode", default=DatasetPadMode.NO_PADDING)
    if pad_mode != DatasetPadMode.NO_PADDING:
        raise ValueError(f"replay reads verl's no-padding batches (pad_mode no_padding), got pad_mode {pad_mode}")


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=["cuda", "npu", "cpu"], vendor=VENDOR)
class ReplayFSDPEngineWithLMHead(ReplayEngineMixin, FSDPEngineWithLMHead):
    """verl's FSDP actor/reference engine, scoring every pass over the recorded supports."""

    def forward_step(self, micro_batch, loss_function, forward_only):
        return super().forward_step(micro_batch, with_replay_metrics(loss_function), forward_only)

    # ------------------------------------------------------------------ inputs
    def prepare_model_inputs(self, micro_batch):
        _refuse_unsupported(micro_batch)
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        input_ids = micro_batch["input_ids"]
        cu = input_ids.offsets()
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            # The rolled token channel, then verl's own pads and slice, in verl's order.
            predicted = next_token_index(cu).unsqueeze(0)  # (1, total_nnz), like input_ids_rmpad_rolled
            static_pad = self._get_packed_pad_size(predicted.size(-1))
            if static_pad:
                predicted, _ = pad_packed_inputs(predicted, None, static_pad, pad_value=-1)
            if self.use_ulysses_sp:
                predicted, _, _ = ulysses_pad_and_slice_inputs(
                    predicted, position_ids_rmpad=None, sp_size=self.ulysses_sequence_parallel_size, pad_value=-1
                )
            output_args[_PREDICTED] = predicted.squeeze(0)
        else:
            width = int(model_inputs["input_ids"].shape[1])  # verl pads each row to the longest sequence
            output_args[_PREDICTED], output_args[_FLAT] = padded_next_token_index(cu, width)
        return model_inputs, output_args

    # ------------------------------------------------------------------ outputs
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        _refuse_unsupported(micro_batch)
        rmpad = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
        calculate_entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        calculate_sum_pi_squared = tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared", default=False)
        layout, support = micro_batch_layout(micro_batch)
        input_ids = micro_batch["input_ids"]
        cu = input_ids.offsets()

        predicted = output_args[_PREDICTED]
        if rmpad:
            logits = output.logits.squeeze(0)  # (total_nnz / sp + pad, V)
            sampled = output_args["input_ids_rmpad_rolled"]
            per_slot_t = output_args["temperature_rmpad"]
        else:
            logits = output.logits  # (b, S, V)
            flat = output_args[_FLAT]
            rolled = output_args["input_ids_rmpad_rolled"]  # (total_nnz,)
            sampled = torch.where(flat >= 0, rolled[flat.clamp(min=0)], torch.zeros_like(flat))
            per_slot_t = output_args["temperature"][:, None].expand(flat.shape)
        local, shard = local_vocab_shard(logits)
        temperature = scalar_temperature(micro_batch["temperature"])
        if temperature is None:  # per-sample temperatures: divide as verl does, out of place
            local = local / per_slot_t.clamp(min=1e-8).to(local.dtype)[..., None]
            temperature = 1.0
        sp_group = get_ulysses_sequence_parallel_group() if self.use_ulysses_sp else None
        scores = score_slots(
            local, shard, sampled, predicted, layout, support, temperature=temperature,
            compute_entropy=calculate_entropy, group=sp_group, group_name="SP",
        )

        def to_nested(x: torch.Tensor) -> torch.Tensor:
            if rmpad:
                x = self._gather_and_unpad_packed(x, output_args["pad_size"])
            else:
                x = x[flat >= 0]  # row-major over (sample, column): packed order
            return torch.nested.nested_tensor_from_jagged(x, cu)

        model_output = {"log_probs": to_nested(scores.log_probs)}
        with torch.no_grad():
            model_output[FULL_VOCAB_KEY] = to_nested(scores.full_vocab_log_probs)
        if calculate_entropy:
            model_output["entropy"] = to_nested(scores.entropy)
        if calculate_sum_pi_squared:
            model_output["sum_pi_squared"] = to_nested(self._sum_pi_squared(logits, per_slot_t))
        return model_output

    @staticmethod
    def _sum_pi_squared(logits, per_slot_t) -> torch.Tensor:
        """verl's full-vocabulary sum of squared probabilities (its optimal-baseline input), no gradient."""
        with torch.no_grad():
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            scaled = logits / per_slot_t.clamp(min=1e-8).to(logits.dtype)[..., None]
            return verl_F.calculate_sum_pi_squared_from_logits(scaled)
