"""Replay in verl 0.9.1's Megatron engine (``workers/engine/megatron/transformer_impl.py``; docs/design.md §9.3).

verl's Megatron forward (``models/mcore/model_forward.py`` ``gptmodel_forward_model_engine``)
packs every nested tensor it hands the LM-head logits processor with
``preprocess_thd_engine`` (``models/mcore/util.py``): sequences padded to a multiple of
``tp * cp * 2`` (FP8, bucket and dynamic-CP variants included), CP-split zigzag or
contiguous, rolled only for ``label``; the BSHD format pads rows with ``preprocess_bshd_engine``.
The processor gets this rank's vocab-parallel, CP-local logits ``[1, n, V / tp]`` (or
``[b, s / cp, V / tp]``) and returns per-slot tensors that verl all-gathers over CP and
unpacks into nested ``[b, L_i]`` outputs.

:class:`ReplayMegatronEngineWithLMHead` subclasses verl's ``MegatronEngineWithLMHead`` and
overrides ``_lm_head_logits_processor`` -- the smallest seam: the one method that turns
logits into ``log_probs`` / ``entropy``. It packs ONE channel with verl's own packer, with
the arguments ``forward_step`` gives it: each slot's own packed token index + 1 (0 on verl's
zero padding, :func:`~nemo_replay.integrations.verl.response_layout.next_from_own`), and scores the
slots over the recorded supports with this rank's vocabulary shard as a ``VocabShard``
(Megatron's even split). Every slot's predicted token is checked against verl's rolled
``label`` there (one more host read per micro-batch), so a change in verl's packing is an
error, not a silent misalignment. The
rest of ``forward_step`` (router replay, MTP, the pipeline schedule, the CP all-gather and
unpacking, the loss) stays verl's. ``forward_backward_batch`` checks the whole batch first
(every rank raises together); ``postprocess_micro_batch_func`` wraps verl's loss function
to add the replay metrics.

The pieces that need no engine -- :func:`packed_predicted` and :func:`replay_logits` -- take
their process groups as arguments; only the engine methods read ``parallel_state``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from nemo_replay.distributed.groups import group_size_rank
from nemo_replay.integrations.verl.engine import (
    FULL_VOCAB_KEY,
    VENDOR,
    ReplayEngineMixin,
    micro_batch_layout,
    scalar_temperature,
    score_slots,
    with_replay_metrics,
)
from nemo_replay.integrations.verl.response_layout import next_from_own
from nemo_replay.scoring.shard import VocabShard

__all__ = ["PackArgs", "packed_predicted", "replay_logits", "ReplayMegatronEngineWithLMHead"]


@dataclass(frozen=True)
class PackArgs:
    """The arguments ``gptmodel_forward_model_engine`` packs the processor's tensors with.

    Attributes:
        data_format: ``"thd"`` (remove-padding) or ``"bshd"``.
        use_fp8_padding: the model's ``config.fp8`` is ``e4m3`` or ``hybrid``.
        local_cp_size: dynamic CP's group size, or None (static CP).
        pad_to_length_bucket: THD bucket padding, or None.
        cp_layout: ``"zigzag"`` or ``"contiguous"``.
        forced_max_seqlen: BSHD row width override, or None.
    """

    data_format: str = "thd"
    use_fp8_padding: bool = False
    local_cp_size: Optional[int] = None
    pad_to_length_bucket: Optional[int] = None
    cp_layout: str = "zigzag"
    forced_max_seqlen: Optional[int] = None


def packed_predicted(input_ids: torch.Tensor, pack: PackArgs) -> torch.Tensor:
    """The packed token each local slot's logit predicts (-1: none), laid out as verl lays out ``label``.

    Args:
        input_ids: nested ``[b, L_i]``, the micro-batch's tokens.
    Returns:
        int64, the shape of verl's packed ``label``: ``[1, n]`` (THD) or ``[b, s / cp]`` (BSHD).
    """
    from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine

    cu = input_ids.offsets()
    own = torch.arange(1, int(cu[-1]) + 1, dtype=torch.int64, device=input_ids.values().device)
    channel = torch.nested.nested_tensor_from_jagged(own, cu)
    if pack.data_format == "thd":
        packed = preprocess_thd_engine(
            channel, pre_process=True, need_roll=False, use_fp8_padding=pack.use_fp8_padding,
            local_cp_size=pack.local_cp_size, pad_to_length_bucket=pack.pad_to_length_bucket, cp_layout=pack.cp_layout,
        )[0]
    elif pack.data_format == "bshd":
        packed = preprocess_bshd_engine(
            channel, pre_process=True, need_roll=False, use_fp8_padding=pack.use_fp8_padding,
            forced_max_seqlen=pack.forced_max_seqlen,
        )[0]
    else:
        raise ValueError(f"verl's Megatron data_format must be 'thd' or 'bshd', got {pack.data_format!r}")
    return next_from_own(packed, cu)


def _check_labels(label: torch.Tensor, predicted: torch.Tensor, values: torch.Tensor, cp_group) -> None:
    """verl's rolled label at every slot that predicts a token must be that token (one host read)."""
    has = predicted >= 0
    wrong = has & (label.to(torch.int64) != values[predicted.clamp(min=0)].to(torch.int64))
    flag = wrong.any()
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        flag = flag.to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=cp_group)
    if bool(flag):
        raise RuntimeError(
            "replay's packing of the token channel disagrees with verl's packed labels: verl's Megatron forward "
            "(models/mcore/model_forward.py, models/mcore/util.py preprocess_thd_engine / preprocess_bshd_engine) "
            "packs differently from the verl 0.9.1 this integration follows; pin verl==0.9.1"
        )


def replay_logits(
    logits: torch.Tensor,
    label: torch.Tensor,
    temperature: torch.Tensor,
    batch,
    pack: PackArgs,
    *,
    tp_group,
    cp_group,
    calculate_entropy: bool,
    calculate_sum_pi_squared: bool = False,
) -> dict:
    """What verl's ``_lm_head_logits_processor`` returns, scored over the recorded supports.

    Args:
        logits: ``[1, n, V / tp]`` or ``[b, s / cp, V / tp]``, not divided by the temperature;
            rank r of ``tp_group`` holds ids ``[r V / tp, (r + 1) V / tp)``. Not modified.
        label: verl's packed, rolled labels, the logits' position shape.
        temperature: verl's packed per-slot temperatures (0 on padding), same shape.
        batch: the micro-batch TensorDict (nested ``input_ids``, ``responses``,
            ``response_mask``, ``generation_support``, ...).
        tp_group, cp_group: the vocabulary's tensor-parallel group and the CP group the
            slots are split over (None: not split).

    Returns:
        ``{"log_probs", FULL_VOCAB_KEY[, "entropy"][, "sum_pi_squared"]}``, each shaped like ``label``.
    """
    input_ids = batch["input_ids"]
    layout, support = micro_batch_layout(batch)
    predicted = packed_predicted(input_ids, pack).to(logits.device)
    if predicted.shape != label.shape:
        raise RuntimeError(
            f"replay's packed token channel has shape {tuple(predicted.shape)}, verl's labels {tuple(label.shape)}; "
            f"verl's Megatron forward packs differently from the verl 0.9.1 this integration follows"
        )
    _check_labels(label, predicted, input_ids.values().to(logits.device), cp_group)

    tp, rank = group_size_rank(tp_group)
    v_local = logits.shape[-1]
    shard = VocabShard(rank * v_local, (rank + 1) * v_local, tp_group if tp > 1 else None, v_local * tp)
    t = scalar_temperature(batch["temperature"])
    source = logits
    if t is None:  # per-sample temperatures: divide by verl's packed ones, out of place
        source = logits / temperature.clamp(min=1e-8).to(logits.dtype)[..., None]
        t = 1.0
    cp = None if cp_group is None or dist.get_world_size(cp_group) == 1 else cp_group
    scores = score_slots(source, shard, label, predicted, layout, support, temperature=t,
                         compute_entropy=calculate_entropy, group=cp, group_name="CP")
    out = {"log_probs": scores.log_probs, FULL_VOCAB_KEY: scores.full_vocab_log_probs}
    if calculate_entropy:
        out["entropy"] = scores.entropy
    if calculate_sum_pi_squared:
        from verl.utils.megatron.tensor_parallel import vocab_parallel_sum_pi_squared

        with torch.no_grad():
            scaled = logits.detach() / temperature.clamp(min=1e-8).to(logits.dtype)[..., None]
            out["sum_pi_squared"] = vocab_parallel_sum_pi_squared(scaled)
    return out


try:
    from megatron.core import parallel_state as mpu
    from verl.utils import tensordict_utils as tu
    from verl.utils.megatron_utils import unwrap_model
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
except ImportError:  # verl's Megatron engine needs megatron-core (and mbridge to build models)
    ReplayMegatronEngineWithLMHead = None
else:

    @EngineRegistry.register(model_type="language_model", backend="megatron", device=["cuda", "cpu"], vendor=VENDOR)
    class ReplayMegatronEngineWithLMHead(ReplayEngineMixin, MegatronEngineWithLMHead):
        """verl's Megatron actor/reference engine, scoring every pass over the recorded supports."""

        def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
            unwrapped = unwrap_model(model)
            # What gptmodel_forward_model_engine packs with, read where forward_step reads it.
            self._replay_model_pack = (
                self._get_context_parallel_layout(unwrapped),
                unwrapped.config.fp8 in ["e4m3", "hybrid"],
            )
            return super().forward_step(batch_iter, model, logits_processor_func, postprocess_micro_batch_func)

        def postprocess_micro_batch_func(self, output, data, forward_only, loss_function, local_cp_size=None):
            return super().postprocess_micro_batch_func(
                output, data, forward_only, with_replay_metrics(loss_function), local_cp_size=local_cp_size
            )

        def _lm_head_logits_processor(self, logits, label, temperature, *, calculate_sum_pi_squared,
                                      calculate_entropy, distillation_use_topk, distillation_only,
                                      logits_processor_func, batch, data_format):
            if distillation_use_topk:
                raise ValueError(
                    "top-k distillation scores the student over the full vocabulary; it cannot run with replay "
                    f"(VERL_ENGINE_VENDOR={VENDOR}). Turn distillation off or unset VERL_ENGINE_VENDOR"
                )
            cp_layout, use_fp8_padding = self._replay_model_pack
            local_cp_size = tu.get_non_tensor_data(data=batch, key="local_cp_size", default=None)
            remove_padding = self.engine_config.use_remove_padding
            pack = PackArgs(
                data_format=data_format,
                use_fp8_padding=use_fp8_padding,
                local_cp_size=local_cp_size,
                pad_to_length_bucket=(self.engine_config.pad_to_length_bucket
                                      if self.engine_config.pad_to_length and remove_padding else None),
                cp_layout=cp_layout,
                forced_max_seqlen=tu.get_non_tensor_data(data=batch, key="forced_max_seqlen", default=None),
            )
            if local_cp_size is not None:
                cp_group = mpu.get_dynamic_data_context_parallel_groups(group_size=local_cp_size)
            else:
                cp_group = mpu.get_context_parallel_group()
            return replay_logits(
                logits, label, temperature, batch, pack, tp_group=mpu.get_tensor_model_parallel_group(),
                cp_group=cp_group, calculate_entropy=calculate_entropy,
                calculate_sum_pi_squared=calculate_sum_pi_squared,
            )
