"""Replay's NeMo-RL workers: the vLLM generation worker and the policy worker extensions.

Each is NeMo-RL's own worker implementation with a mixin in front, made a Ray actor with
the options NeMo-RL gives its own class. The classes are built on first lookup (module
``__getattr__``), so this module imports without NeMo-RL, and each worker process imports
only its own NeMo-RL worker module (the vLLM environment has no Megatron):

- ``ReplayVllmGenerationWorker`` (:class:`ReplayVllmMixin` + ``VllmGenerationWorkerImpl``):
  each sampled request asks ``logprobs = top_k + 1`` processed log-probs
  (``_build_sampling_params``; NeMo-RL asks 0, vllm_worker.py:662), and ``generate``
  returns ``generation_support`` rows next to ``logprobs``, laid out like it
  (:func:`~.rollout.completion_supports`). Greedy calls (validation) record
  nothing.
- ``ReplayMegatronPolicyWorker`` and ``ReplayDTensorPolicyWorkerV2``
  (:class:`ReplayPolicyMixin` + NeMo-RL's worker implementation): before NeMo-RL's
  ``__init__`` they rebind the post-processor names the worker module builds by name
  (``LossPostProcessor``, ``LogprobsPostProcessor``) to replay's (:mod:`.hooks`), in that
  worker's process.

:data:`WORKERS` maps each to the NeMo-RL class it stands in for; the launcher
(:mod:`.run_grpo`) passes the policy one as ``worker_extension_cls_fqn`` and swaps the vLLM
one in for NeMo-RL's.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch

from nemo_replay.integrations.nemo_rl import hooks
from nemo_replay.integrations.nemo_rl.rollout import completion_supports, vllm_support_request
from nemo_replay.integrations.nemo_rl.scoring import SUPPORT_KEY
from nemo_replay.rollout.engines.vllm import VLLM_DEFAULT_MAX_LOGPROBS, vllm_row_width
from nemo_replay.support.rows import SampleRows

__all__ = ["ReplayVllmMixin", "ReplayPolicyMixin", "rebind_post_processors", "WORKERS", "worker_fqn"]

_VLLM = "nemo_rl.models.generation.vllm.vllm_worker"
_MEGATRON = "nemo_rl.models.policy.workers.megatron_policy_worker"
_DTENSOR_V2 = "nemo_rl.models.policy.workers.dtensor_policy_worker_v2"

#: replay class name -> (NeMo-RL worker module, its implementation class, its Ray actor class).
WORKERS = {
    "ReplayVllmGenerationWorker": (_VLLM, "VllmGenerationWorkerImpl", "VllmGenerationWorker"),
    "ReplayMegatronPolicyWorker": (_MEGATRON, "MegatronPolicyWorkerImpl", "MegatronPolicyWorker"),
    "ReplayDTensorPolicyWorkerV2": (_DTENSOR_V2, "DTensorPolicyWorkerV2Impl", "DTensorPolicyWorkerV2"),
}

#: worker module -> (loss post-processor, log-prob post-processor) replay installs there.
_POST_PROCESSORS = {
    _MEGATRON: (hooks.ReplayLossPostProcessor, hooks.ReplayLogprobsPostProcessor),
    _DTENSOR_V2: (hooks.ReplayAutomodelLossPostProcessor, hooks.ReplayAutomodelLogprobsPostProcessor),
}


def worker_fqn(name: str) -> str:
    """The fully qualified name NeMo-RL's worker builders import, e.g. for ``worker_extension_cls_fqn``."""
    if name not in WORKERS:
        raise ValueError(f"no replay worker {name!r}; the workers are {sorted(WORKERS)}")
    return f"{__name__}.{name}"


def nemo_rl_fqn(name: str) -> str:
    """The NeMo-RL actor class replay's worker ``name`` stands in for."""
    module, _, actor = WORKERS[name]
    return f"{module}.{actor}"


def rebind_post_processors(worker_module) -> None:
    """Point ``worker_module``'s post-processor names at replay's (idempotent)."""
    loss, logprobs = _POST_PROCESSORS[worker_module.__name__]
    worker_module.LossPostProcessor = loss
    worker_module.LogprobsPostProcessor = logprobs


class ReplayPolicyMixin:
    """In front of a NeMo-RL policy worker implementation: replay's post-processors in its process."""

    #: The NeMo-RL worker module whose names are rebound (set where the class is built).
    nemo_rl_worker_module: str = ""

    def __init__(self, *args, **kwargs):
        if self.nemo_rl_worker_module not in _POST_PROCESSORS:
            raise ValueError(
                f"{type(self).__name__}.nemo_rl_worker_module={self.nemo_rl_worker_module!r}: expected one of "
                f"{sorted(_POST_PROCESSORS)}"
            )
        rebind_post_processors(importlib.import_module(self.nemo_rl_worker_module))
        super().__init__(*args, **kwargs)


@contextlib.contextmanager
def _recorded(llm, outputs: list):
    """``llm.generate`` appends its results to ``outputs`` while inside (an instance attribute, removed after)."""
    generate = llm.generate

    def recording(*args, **kwargs):
        result = generate(*args, **kwargs)
        outputs.append(result)
        return result

    llm.generate = recording
    try:
        yield
    finally:
        del llm.generate


class ReplayVllmMixin:
    """In front of NeMo-RL's ``VllmGenerationWorkerImpl``: supports requested, recorded and returned.

    Asks the engine for the sampling mask where it returns one, else for processed log-probs.
    ``generation_support``: a list of B :class:`~nemo_replay.support.rows.SampleRows`, each the
    generated tokens' rows encoded once, in the columns of the worker's ``logprobs`` (the row of
    token t at column t; none where a generated token's support could not be recorded: it leaves
    the loss, :mod:`.datapath`), sliced by column as ``logprobs`` is into each message.
    """

    def _build_sampling_params(self, *, greedy: bool, stop_strings, max_new_tokens=None):
        params = super()._build_sampling_params(greedy=greedy, stop_strings=stop_strings, max_new_tokens=max_new_tokens)
        if not greedy:
            request = vllm_support_request(self.cfg["top_k"], path=_support_path(self), max_logprobs=_max_logprobs(self))
            for name, value in request.items():
                if name == "logprobs" or hasattr(params, name):  # flat_logprobs exists from vLLM 0.24 on
                    setattr(params, name, value)
        return params

    def generate(self, data, greedy: bool = False):
        outputs: list = []
        with _recorded(self.llm, outputs):
            result = super().generate(data, greedy=greedy)
        if greedy:
            return result
        # Rows tied past top_k fit whole; the log-prob path can show at most max_logprobs - 1 of them.
        width = vllm_row_width(self.cfg["top_k"], None if _support_path(self) == "mask" else _max_logprobs(self))
        if not outputs:  # an empty shard: NeMo-RL returns before generating
            result[SUPPORT_KEY] = []
            return result
        if len(outputs) != 1:
            raise ValueError(f"{type(self).__name__}.generate: expected one llm.generate call per batch, saw {len(outputs)}")
        completions = [out.outputs[0] for out in outputs[0]]
        # One compact entry a sample crosses Ray, encoded once from each completion's CSR rows (the sampled ids
        # kept: the rows travel apart from the tokens); the patched rollout code slices it as it slices logprobs.
        result[SUPPORT_KEY] = [
            SampleRows.encode(got.support, torch.as_tensor(list(completions[i].token_ids)), start=start,
                              where=f"{type(self).__name__}.generate, request {i}")
            for i, start, got in completion_supports(completions, data["input_lengths"], result["output_ids"].shape[1],
                                                     width=width, vocab_size=_vocab_size(self.llm))
        ]
        return result


def _support_path(worker) -> str:
    """``"mask"`` when the engine returns sampling masks (vLLM >= 0.33 started with
    ``return_sampling_mask``: exact rows, and the request keeps NeMo-RL's ``logprobs=0``), else
    ``"logprobs"`` (the pinned vLLM 0.25.1 has no masks)."""
    config = getattr(getattr(worker.llm, "llm_engine", None), "model_config", None)
    return "mask" if getattr(config, "return_sampling_mask", False) is True else "logprobs"


def _max_logprobs(worker) -> int:
    """The engine's ``max_logprobs``: as its model config says, else as the recipe sets it
    (``vllm_kwargs.max_logprobs``), else vLLM's default (20): a request above it is refused."""
    value = getattr(getattr(getattr(worker.llm, "llm_engine", None), "model_config", None), "max_logprobs", None)
    if not isinstance(value, int) or isinstance(value, bool):
        value = (worker.cfg.get("vllm_kwargs") or {}).get("max_logprobs", VLLM_DEFAULT_MAX_LOGPROBS)
    return value


def _vocab_size(llm) -> Any:
    """The engine's vocabulary size where the engine says it (ids are checked against it), else None."""
    try:
        return int(llm.llm_engine.model_config.get_vocab_size())
    except (AttributeError, TypeError, ValueError):
        return None


_MIXINS = {_VLLM: ReplayVllmMixin, _MEGATRON: ReplayPolicyMixin, _DTENSOR_V2: ReplayPolicyMixin}


def _build(name: str):
    """Replay's worker ``name``: mixin + NeMo-RL's implementation, a Ray actor with NeMo-RL's options."""
    module_name, impl_name, actor_name = WORKERS[name]
    module = importlib.import_module(module_name)
    impl, actor = getattr(module, impl_name), getattr(module, actor_name)
    namespace = {"__module__": __name__, "__qualname__": name, "nemo_rl_worker_module": module_name}
    cls = type(name, (_MIXINS[module_name], impl), namespace)
    import ray

    options = dict(getattr(actor, "_default_options", None) or {})
    return ray.remote(**options)(cls) if options else ray.remote(cls)


def __getattr__(name: str):
    if name not in WORKERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = cls = _build(name)
    return cls
