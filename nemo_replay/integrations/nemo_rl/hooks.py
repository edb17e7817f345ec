"""Replay inside NeMo-RL's policy workers: the ``prepare_fn`` and the post-processors.

Where each hook attaches (NeMo-RL commit in :data:`~.layout.NEMO_RL_COMMIT`):

- policy loss, Megatron worker: ``LossPostProcessor(prepare_fn=...)``
  (``nemo_rl/models/megatron/train.py``) calls ``prepare_fn(logits=, data=, loss_fn=,
  vocab_parallel_rank=, vocab_parallel_group=, context_parallel_group=)`` once per
  micro-batch (unpacked) or once per packed sequence with its CP-local logits
  (``nemo_rl/algorithms/loss/wrapper.py``, ``SequencePackingLossWrapper``).
  :func:`replay_prepare_fn` is that function; :class:`ReplayLossPostProcessor` is
  NeMo-RL's post-processor with it installed.
- old-policy and reference log-probs, Megatron worker: :class:`ReplayLogprobsPostProcessor`
  replaces ``LogprobsPostProcessor`` (which has no hook).
- DTensor / automodel v2 worker (``nemo_rl/models/automodel/train.py``): its
  ``LossPostProcessor`` and ``LogprobsPostProcessor`` take no ``prepare_fn``;
  :class:`ReplayAutomodelLossPostProcessor` and :class:`ReplayAutomodelLogprobsPostProcessor`
  replace them (tensor parallel; DTensor context parallelism is refused).

NeMo-RL dispatches post-processors with ``isinstance`` against its own classes, so each
replacement subclasses NeMo-RL's class when NeMo-RL is importable (and ``object``
otherwise: this module imports without NeMo-RL, which needs Python >= 3.13).
Logits arrive divided by the temperature (``forward_with_post_processing_fn``); NeMo-RL's
own top-k/top-p re-filtering (``TrainingSamplingParams``) is bypassed, since every
log-prob is scored over the recorded support instead.

Reference pass: by default it scores the same support. Inside ``with reference_pass(full_vocab=True):``
post-processors built there score the full vocabulary instead (a worker enters it in its
``use_reference_model``).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from functools import partial
from typing import Any, Callable, Optional

import torch

from nemo_replay.integrations.nemo_rl.metrics import merge_parts, metric_parts, to_floats
from nemo_replay.integrations.nemo_rl.scoring import SUPPORT_KEY, next_token_logprobs

__all__ = [
    "replay_prepare_fn",
    "make_replay_prepare_fn",
    "reference_pass",
    "ReplayLossPostProcessor",
    "ReplayLogprobsPostProcessor",
    "ReplayAutomodelLossPostProcessor",
    "ReplayAutomodelLogprobsPostProcessor",
]

_REFERENCE_FULL_VOCAB = contextvars.ContextVar("nemo_replay_reference_full_vocab", default=False)


def _nemo_rl_class(module: str, name: str):
    """NeMo-RL's class when NeMo-RL is importable, else ``object``."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return object


@contextlib.contextmanager
def reference_pass(*, full_vocab: bool):
    """Log-prob post-processors built inside score the full vocabulary (``full_vocab=True``) or the support."""
    token = _REFERENCE_FULL_VOCAB.set(bool(full_vocab))
    try:
        yield
    finally:
        _REFERENCE_FULL_VOCAB.reset(token)


def _check_logprob_loss(loss_fn) -> None:
    kind = getattr(getattr(loss_fn, "input_type", None), "value", None)
    if kind != "logprob":
        raise ValueError(
            f"replay_prepare_fn serves LossInputType.LOGPROB losses (next_token_logprobs), got {type(loss_fn).__name__} "
            f"with input_type {getattr(loss_fn, 'input_type', None)!r}; keep NeMo-RL's prepare_loss_input for it"
        )


def replay_prepare_fn(
    logits,
    data,
    loss_fn,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group=None,
    context_parallel_group=None,
    *,
    support_key: str = SUPPORT_KEY,
    validate: bool = True,
    metrics_sink: Optional[Callable[[dict], None]] = None,
) -> tuple[dict[str, torch.Tensor], Any]:
    """NeMo-RL ``prepare_fn``: ``next_token_logprobs (B, S - 1)`` over the recorded supports.

    Args (NeMo-RL's, by keyword):
        logits: ``(B, S / cp, V / tp)`` temperature-divided logits of an unpacked micro-batch,
            or ``[1, P / cp, V / tp]`` of one packed sequence (``SequencePackingLossWrapper``).
        data: the (per-sequence) data dict: ``input_ids``, ``input_lengths``, ``token_mask``,
            ``sample_mask``, ``generation_support`` (a list of one
            :class:`~nemo_replay.support.rows.SampleRows` a sample).
        loss_fn: a LOGPROB loss (``ClippedPGLossFn``...).
        vocab_parallel_rank, vocab_parallel_group, context_parallel_group: Megatron's groups.
        metrics_sink: receives this call's replay metric parts (:func:`~.metrics.metric_parts`);
            :class:`ReplayLossPostProcessor` hands them to NeMo-RL's metrics.

    Returns:
        ``({"next_token_logprobs": (B, S - 1) float32, differentiable}, data)``; data unchanged.
    """
    _check_logprob_loss(loss_fn)
    scores = next_token_logprobs(
        logits, data, vocab_parallel_rank=vocab_parallel_rank, vocab_parallel_group=vocab_parallel_group,
        context_parallel_group=context_parallel_group, support_key=support_key, validate=validate,
    )
    if metrics_sink is not None:
        metrics_sink(metric_parts(scores.logprobs, data))
    return {"next_token_logprobs": scores.logprobs}, data


def make_replay_prepare_fn(*, support_key: str = SUPPORT_KEY, validate: bool = True, metrics_sink=None):
    """:func:`replay_prepare_fn` reading the rows from ``data[support_key]``."""
    return partial(replay_prepare_fn, support_key=support_key, validate=validate, metrics_sink=metrics_sink)


def _policy_cfg(cfg, name: str) -> dict:
    if not hasattr(cfg, "get"):
        raise ValueError(f"{name}: cfg must be NeMo-RL's policy config (a mapping), got {type(cfg).__name__}")
    return cfg


def _refuse_fused(cfg, name: str) -> None:
    """The fused paths skip the hooks replay lives in: refuse them, naming the flag."""
    problems = []
    if bool((cfg.get("sequence_packing") or {}).get("fuse_loss", False)):
        problems.append("policy.sequence_packing.fuse_loss=false (the fused packed loss ignores prepare_fn)")
    if bool((cfg.get("megatron_cfg") or {}).get("use_fused_linear_logprobs", False)):
        problems.append("policy.megatron_cfg.use_fused_linear_logprobs=false (it gathers log-probs over the full vocabulary)")
    if problems:
        raise ValueError(f"{name}: replay needs " + "; ".join(problems))


# ------------------------------------------------------------------------------ Megatron worker

_MegatronLoss = _nemo_rl_class("nemo_rl.models.megatron.train", "LossPostProcessor")
_MegatronLogprobs = _nemo_rl_class("nemo_rl.models.megatron.train", "LogprobsPostProcessor")
_AutomodelLoss = _nemo_rl_class("nemo_rl.models.automodel.train", "LossPostProcessor")
_AutomodelLogprobs = _nemo_rl_class("nemo_rl.models.automodel.train", "LogprobsPostProcessor")


class ReplayLossPostProcessor(_MegatronLoss):
    """NeMo-RL's Megatron ``LossPostProcessor`` with :func:`replay_prepare_fn` as its ``prepare_fn``.

    Same constructor as NeMo-RL's (``loss_fn, cfg, num_microbatches, cp_normalize,
    sampling_params, draft_model, prepare_fn``); needs NeMo-RL installed.
    """

    def __init__(self, loss_fn, cfg, *args, prepare_fn=None, **kwargs):
        if _MegatronLoss is object:
            raise ValueError(
                "ReplayLossPostProcessor extends NeMo-RL's Megatron LossPostProcessor, and nemo_rl is not importable "
                "here; outside NeMo-RL call replay_prepare_fn directly"
            )
        _refuse_fused(_policy_cfg(cfg, "ReplayLossPostProcessor"), "ReplayLossPostProcessor")
        self._replay_parts: list[dict] = []  # one entry a prepare_fn call (a packed micro-batch: one a sequence)
        prepare_fn = prepare_fn or make_replay_prepare_fn(metrics_sink=self._replay_parts.append)
        super().__init__(loss_fn, cfg, *args, prepare_fn=prepare_fn, **kwargs)

    def __call__(self, *args, **kwargs):
        """NeMo-RL's closure, whose metrics also carry this micro-batch's replay parts (:mod:`.metrics`)."""
        inner = super().__call__(*args, **kwargs)

        def with_replay_metrics(*a, **k):
            loss, metrics = inner(*a, **k)
            parts, self._replay_parts[:] = merge_parts(self._replay_parts), []  # drained: a rerun counts once
            return loss, {**metrics, **to_floats(parts)}  # one host read a micro-batch, packed or not

        return with_replay_metrics


def _megatron_groups(tp_group, tp_rank, cp_group):
    """Explicit groups, or megatron-core's parallel state read once here (the worker's boundary)."""
    if tp_group is not None or cp_group is not None:
        return tp_group, tp_rank, cp_group
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(), cp


class ReplayLogprobsPostProcessor(_MegatronLogprobs):
    """Replaces NeMo-RL's Megatron ``LogprobsPostProcessor``: old-policy and reference log-probs over the support.

    ``post(data_dict, input_ids, cu_seqlens_padded)`` returns ``fn(output_tensor) -> (0,
    {"logprobs": (B, S) float32})``, token-aligned with a 0 in column 0, as NeMo-RL's does.
    Output tensors are ``(B, S, V / tp)`` (unpacked) or ``[1, T / cp, V / tp]`` (packed,
    ``cfg["sequence_packing"]["enabled"]``).

    Args:
        cfg: NeMo-RL's policy config.
        sampling_params, use_fused_linear_logprobs: NeMo-RL's arguments; the fused path is refused.
        full_vocab: score the full vocabulary (None: the enclosing :func:`reference_pass`, else False).
        tp_group, tp_rank, cp_group: explicit groups; None reads megatron-core's parallel state per call.
    """

    def __init__(
        self, cfg, sampling_params=None, use_fused_linear_logprobs: bool = False, *, full_vocab: Optional[bool] = None,
        support_key: str = SUPPORT_KEY, tp_group=None, tp_rank: Optional[int] = None, cp_group=None,
    ):
        self.cfg = _policy_cfg(cfg, "ReplayLogprobsPostProcessor")
        if use_fused_linear_logprobs:
            raise ValueError(
                "ReplayLogprobsPostProcessor: replay needs policy.megatron_cfg.use_fused_linear_logprobs=false (the fused "
                "path gathers log-probs over the full vocabulary from hidden states)"
            )
        self.sampling_params = sampling_params
        self.use_fused_linear_logprobs = False
        self.full_vocab = _REFERENCE_FULL_VOCAB.get() if full_vocab is None else bool(full_vocab)
        self.support_key = support_key
        self.groups = (tp_group, tp_rank, cp_group)

    def __call__(self, data_dict, input_ids=None, cu_seqlens_padded=None):
        packed = bool((self.cfg.get("sequence_packing") or {}).get("enabled", False))

        if packed and cu_seqlens_padded is None:
            raise ValueError(
                "ReplayLogprobsPostProcessor: policy.sequence_packing.enabled is true but no cu_seqlens_padded came; "
                "call it as NeMo-RL's forward step does, post(data_dict, input_ids, cu_seqlens_padded)"
            )

        def processor_fn_inner(output_tensor):
            tp_group, tp_rank, cp_group = _megatron_groups(*self.groups)
            scores = next_token_logprobs(
                output_tensor, data_dict, vocab_parallel_rank=tp_rank, vocab_parallel_group=tp_group,
                context_parallel_group=cp_group, cu_seqlens_padded=cu_seqlens_padded if packed else None,
                full_vocab=self.full_vocab, support_key=self.support_key,
            )
            lp = scores.logprobs
            token_logprobs = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
            return torch.tensor(0.0, device=lp.device), {"logprobs": token_logprobs}

        return processor_fn_inner


# ------------------------------------------------------------------------------ DTensor / automodel v2 worker


def _automodel_logits(logits, processed_inputs, packed: bool):
    """(logits, cu_seqlens or None): packed rows are cut to their sequences (pack_sequences pads the tail)."""
    if not packed:
        return logits, None
    cu = torch.as_tensor(processed_inputs.flash_attn_kwargs.cu_seqlens_q, dtype=torch.int64).cpu()
    return logits[:, : int(cu[-1])], cu


class ReplayAutomodelLossPostProcessor(_AutomodelLoss):
    """Replaces the automodel ``LossPostProcessor``: the loss reads ``next_token_logprobs`` over the support.

    Same constructor as NeMo-RL's (``loss_fn, cfg, device_mesh, cp_mesh, tp_mesh, cp_size,
    dp_size, enable_seq_packing, sampling_params``). Called as NeMo-RL calls it, it scores
    the whole micro-batch (packed or not) once and calls ``loss_fn`` once on the unpacked
    data -- the fused form NeMo-RL uses for packed LOGPROB losses
    (``SequencePackingFusionLossWrapper``).
    """

    def __init__(self, loss_fn, cfg, device_mesh=None, cp_mesh=None, tp_mesh=None, cp_size: int = 1, dp_size: int = 1,
                 enable_seq_packing: bool = False, sampling_params=None, *, support_key: str = SUPPORT_KEY):
        self.loss_fn = loss_fn
        self.cfg = _policy_cfg(cfg, "ReplayAutomodelLossPostProcessor")
        self.device_mesh, self.cp_mesh, self.tp_mesh = device_mesh, cp_mesh, tp_mesh
        self.cp_size, self.dp_size = int(cp_size), int(dp_size)
        self.enable_seq_packing = bool(enable_seq_packing)
        self.sampling_params = sampling_params
        self.support_key = support_key
        _refuse_dtensor_cp(self.cp_size, "ReplayAutomodelLossPostProcessor")

    def __call__(self, logits, data_dict, processed_inputs, global_valid_seqs, global_valid_toks, sequence_dim: int = 1):
        _check_logprob_loss(self.loss_fn)
        logits, cu = _automodel_logits(logits, processed_inputs, self.enable_seq_packing)
        scores = next_token_logprobs(logits, data_dict, cu_seqlens_padded=cu, support_key=self.support_key)
        loss, metrics = self.loss_fn(
            data=data_dict, global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks,
            next_token_logprobs=scores.logprobs,
        )
        return loss, {**metrics, **to_floats(metric_parts(scores.logprobs, data_dict))}  # replay's parts (.metrics)


class ReplayAutomodelLogprobsPostProcessor(_AutomodelLogprobs):
    """Replaces the automodel ``LogprobsPostProcessor``: ``(B, S)`` token-aligned log-probs over the support.

    Same constructor as NeMo-RL's (``cfg, device_mesh, cp_mesh, tp_mesh, cp_size,
    enable_seq_packing, sampling_params``) plus ``full_vocab`` (None: the enclosing
    :func:`reference_pass`).
    """

    def __init__(self, cfg, device_mesh=None, cp_mesh=None, tp_mesh=None, cp_size: int = 1, enable_seq_packing: bool = False,
                 sampling_params=None, *, full_vocab: Optional[bool] = None, support_key: str = SUPPORT_KEY):
        self.cfg = _policy_cfg(cfg, "ReplayAutomodelLogprobsPostProcessor")
        self.device_mesh, self.cp_mesh, self.tp_mesh = device_mesh, cp_mesh, tp_mesh
        self.cp_size = int(cp_size)
        self.enable_seq_packing = bool(enable_seq_packing)
        self.sampling_params = sampling_params
        self.full_vocab = _REFERENCE_FULL_VOCAB.get() if full_vocab is None else bool(full_vocab)
        self.support_key = support_key
        _refuse_dtensor_cp(self.cp_size, "ReplayAutomodelLogprobsPostProcessor")

    def __call__(self, logits, data_dict, processed_inputs, original_batch_size: int, original_seq_len: int, sequence_dim: int = 1):
        logits, cu = _automodel_logits(logits, processed_inputs, self.enable_seq_packing)
        scores = next_token_logprobs(logits, data_dict, cu_seqlens_padded=cu, full_vocab=self.full_vocab, support_key=self.support_key)
        lp = scores.logprobs
        if tuple(lp.shape) != (original_batch_size, original_seq_len - 1):
            raise ValueError(
                f"scores of shape {tuple(lp.shape)} for a micro-batch of {original_batch_size} x {original_seq_len}; the "
                f"data dict is not the micro-batch the logits were computed for"
            )
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def _refuse_dtensor_cp(cp_size: int, name: str) -> None:
    if cp_size > 1:
        raise ValueError(
            f"{name}: context parallelism of the DTensor worker (cp_size={cp_size}) shards the sequence through "
            f"torch's context_parallel, which replay does not lay out; set policy.dtensor_cfg.context_parallel_size=1 "
            f"or use the Megatron backend (policy.megatron_cfg.enabled=true), whose CP replay supports"
        )
