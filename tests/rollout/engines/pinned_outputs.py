"""Engine outputs as each pinned vLLM and SGLang release builds them.

Users run the releases their trainer pins: NeMo-RL vLLM 0.25.1 and SGLang 0.5.12.post1, verl
0.9.1 vLLM 0.24.0 and SGLang 0.5.12, SkyRL 0.4.0 vLLM 0.30.0. The adapters are written against
vLLM 0.33.0 and SGLang 0.5.23, whose outputs :mod:`tests.rollout.engines.engine_outputs` builds.
Every pin below was read from its wheel (``pip download vllm==X --no-deps``, unzipped); the
file:line citations are inside that wheel. SGLang 0.5.12.post1 holds the same
``io_struct.py``, ``sampler.py`` and ``tokenizer_manager.py`` as 0.5.12.

What the vLLM releases share, 0.24.0 to 0.33.0: ``Logprob`` and ``FlatLogprobs``
(``vllm/logprobs.py``: same fields; a position appended as the sampled entry, then the top
``logprobs`` by rank), ``SamplingParams.flat_logprobs``, ``max_logprobs = 20`` by default,
``logprobs_mode`` a ``Literal`` defaulting to ``"raw_logprobs"``, min-p on probabilities before
top-k / top-p (``v1/sample/logits_processor/builtin.py:102-116``), the ``/v1/completions`` form
(the first ``logprobs + 1`` entries of a position) and the ``/v1/chat/completions`` form (its
first ``top_logprobs``), both clamping ``-inf`` to ``-9999.0``. So one builder serves each of
those (``engine_outputs``). What differs is keyed by version in :data:`VLLM_PINS`:

- the ``CompletionOutput`` and ``RequestOutput`` fields (sampling masks exist from 0.30 on);
- which top-k/top-p path a step takes: 0.24 / 0.25 run the Triton kernel only for a step of
  at least 8 rows and the PyTorch path, which keeps every token tied with the k-th value, for
  fewer; 0.30 / 0.33 run Triton whenever it is importable;
- the ``/inference/v1/generate`` log-prob form: 0.24 / 0.25 / 0.30 write chat-shaped entries
  (``"token": "token_id:<id>"``) cut to the first ``logprobs`` entries; 0.33 integer ids, every
  entry.

SGLang 0.5.12 has no sampling mask: its log-probs (``return_logprob``) are of the tempered
distribution before top-k / top-p / min-p, so no support can be read from them
(:data:`SGLANG_PINS`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from tests.rollout.engines.engine_outputs import (
    VllmDraw,
    VllmStep,
    _json,
    vllm_draws,
    vllm_generate_choice,
    vllm_offline_output,
    vllm_position,
)

# ---------------------------------------------------------------------------------- vLLM pins

_COMPLETION_FIELDS = ("index", "text", "token_ids", "cumulative_logprob", "logprobs", "routed_experts", "finish_reason",
                      "stop_reason", "lora_request")
_REQUEST_POSITIONAL = ("request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics",
                       "lora_request", "encoder_prompt", "encoder_prompt_token_ids", "num_cached_tokens")


@dataclass(frozen=True)
class VllmPin:
    """What one vLLM release returns, where it differs between the pinned releases.

    Attributes:
        version: the release.
        pinned_by: the trainers that pin it.
        completion_fields: ``CompletionOutput``'s fields in declaration order (the first five
            required, the rest default to None).
        request_positional: ``RequestOutput.__init__``'s positional parameters in order.
        request_keyword: its keyword-only parameters.
        masks: ``SamplingMask``, ``--return-sampling-mask`` and Model Runner V2's mask exist.
        generate_ids: ``/inference/v1/generate`` writes integer ``token_id`` entries, not cut
            (0.33); else chat-shaped ``"token_id:<id>"`` entries cut to ``logprobs``.
        triton_min_rows: a step of at least this many rows takes the Triton top-k/top-p kernel
            (exactly k, ties in index order) on a GPU with Triton; fewer take the PyTorch path
            (every token tied with the k-th kept).
        sources: file:line of each fact, inside the wheel.
    """

    version: str
    pinned_by: str
    completion_fields: tuple
    request_positional: tuple
    request_keyword: tuple
    masks: bool
    generate_ids: bool
    triton_min_rows: int
    sources: Mapping[str, str]

    def tie_rule(self, num_rows: int) -> str:
        """The ``capture.sample`` ``ties=`` rule of a step with ``num_rows`` rows."""
        return "index_order" if num_rows >= self.triton_min_rows else "keep_tied"


VLLM_PINS = {
    "0.24.0": VllmPin(
        "0.24.0", "verl 0.9.1", _COMPLETION_FIELDS, _REQUEST_POSITIONAL, ("kv_transfer_params",),
        masks=False, generate_ids=False, triton_min_rows=8,
        sources={
            "CompletionOutput": "vllm/outputs.py:21-48",
            "RequestOutput": "vllm/outputs.py:109-127",
            "built": "vllm/v1/engine/output_processor.py:376-411",
            "flat_logprobs": "vllm/sampling_params.py:284",
            "max_logprobs": "vllm/config/model.py:216",
            "top-k/top-p dispatch": "vllm/v1/sample/ops/topk_topp_sampler.py:345-360",
            "PyTorch top-k/top-p": "vllm/v1/sample/ops/topk_topp_sampler.py:363-404 (ties kept: 386-392)",
            "completions": "vllm/entrypoints/openai/completion/serving.py:606-690",
            "chat": "vllm/entrypoints/openai/chat_completion/serving.py:1111-1197",
            "generate": "vllm/entrypoints/serve/disagg/serving.py:289-295, 464-503; protocol.py:161-176",
        },
    ),
    "0.25.1": VllmPin(
        "0.25.1", "NeMo-RL", _COMPLETION_FIELDS, _REQUEST_POSITIONAL, ("kv_transfer_params",),
        masks=False, generate_ids=False, triton_min_rows=8,
        sources={
            "CompletionOutput": "vllm/outputs.py:21-48",
            "RequestOutput": "vllm/outputs.py:109-127",
            "built": "vllm/v1/engine/output_processor.py:376-411",
            "flat_logprobs": "vllm/sampling_params.py:284",
            "max_logprobs": "vllm/config/model.py:222",
            "top-k/top-p dispatch": "vllm/v1/sample/ops/topk_topp_sampler.py:345-360",
            "PyTorch top-k/top-p": "vllm/v1/sample/ops/topk_topp_sampler.py:363-404 (ties kept: 386-392)",
            "completions": "vllm/entrypoints/openai/completion/serving.py:646-730",
            "chat": "vllm/entrypoints/openai/chat_completion/serving.py:1093-1179",
            "generate": "vllm/entrypoints/scale_out/token_in_token_out/serving.py:293-299, 468-507; protocol.py:176-191",
        },
    ),
    "0.30.0": VllmPin(
        "0.30.0", "SkyRL 0.4.0", _COMPLETION_FIELDS + ("sampling_mask", "spec_decode_metrics"),
        _REQUEST_POSITIONAL + ("num_cache_creation_tokens",), ("kv_transfer_params", "ec_transfer_params"),
        masks=True, generate_ids=False, triton_min_rows=1,
        sources={
            "SamplingMask": "vllm/outputs.py:21-29",
            "CompletionOutput": "vllm/outputs.py:32-68",
            "RequestOutput": "vllm/outputs.py:133-153",
            "built": "vllm/v1/engine/output_processor.py:398-442 (mask on finish only: 423-427)",
            "return_sampling_mask": "vllm/config/model.py:252; MRV2 and processed_logprobs: vllm/config/vllm.py:1111-1135",
            "mask request check": "vllm/v1/engine/input_processor.py:104-114",
            "mask rows": "vllm/v1/worker/gpu/sample/output.py:26-70, 134-156 (ids ascending)",
            "flat_logprobs": "vllm/sampling_params.py:302",
            "max_logprobs": "vllm/config/model.py:254",
            "top-k/top-p dispatch": "vllm/v1/sample/ops/topk_topp_sampler.py:368-378",
            "completions": "vllm/entrypoints/openai/completion/serving.py:652-737",
            "chat": "vllm/entrypoints/openai/chat_completion/serving.py:1214-1305",
            "generate": "vllm/entrypoints/scale_out/token_in_token_out/serving.py:329-340, 529-568; protocol.py:323-339",
        },
    ),
    "0.33.0": VllmPin(
        "0.33.0", "the adapters' reference", _COMPLETION_FIELDS + ("sampling_mask", "spec_decode_metrics", "weight_versions"),
        _REQUEST_POSITIONAL + ("num_cache_creation_tokens",),
        ("prompt_token_id_logprobs", "kv_transfer_params", "ec_transfer_params"),
        masks=True, generate_ids=True, triton_min_rows=1,
        sources={
            "SamplingMask": "vllm/outputs.py:38-46",
            "CompletionOutput": "vllm/outputs.py:58-98",
            "RequestOutput": "vllm/outputs.py:169-190",
            "built": "vllm/v1/engine/output_processor.py:475-525 (mask on delta or finish: 500-510)",
            "return_sampling_mask": "vllm/config/model.py:284; MRV2 and processed_logprobs: vllm/config/vllm.py:1304-1333",
            "flat_logprobs": "vllm/sampling_params.py:369",
            "max_logprobs": "vllm/config/model.py:286",
            "top-k/top-p dispatch": "vllm/v1/sample/ops/topk_topp_sampler.py:501-521",
            "completions": "vllm/entrypoints/openai/completion/serving.py:714-803",
            "chat": "vllm/entrypoints/openai/chat_completion/serving.py:1190-1280",
            "generate": "vllm/entrypoints/scale_out/token_in_token_out/serving.py:455-502, 876-922; protocol.py:453-520",
        },
    ),
}


@functools.cache
def completion_output_class(version: str) -> type:
    """``CompletionOutput`` of ``version``: its fields, in its order (:attr:`VllmPin.completion_fields`)."""
    names = VLLM_PINS[version].completion_fields
    fields = [(n, object) if i < 5 else (n, object, field(default=None)) for i, n in enumerate(names)]
    return dataclasses.make_dataclass("CompletionOutput", fields, namespace={"__module__": __name__})


@functools.cache
def request_output_class(version: str) -> type:
    """``RequestOutput`` of ``version``: its ``__init__`` parameters as fields, the six before
    ``metrics`` required, the keyword-only ones keyword-only."""
    pin = VLLM_PINS[version]
    fields = [(n, object) if i < 6 else (n, object, field(default=None)) for i, n in enumerate(pin.request_positional)]
    fields += [(n, object, field(default=None, kw_only=True)) for n in pin.request_keyword]
    return dataclasses.make_dataclass("RequestOutput", fields, namespace={"__module__": __name__})


def pinned_draws(version: str, logits: torch.Tensor, temperature: float, *, top_k: int, top_p: float = 1.0,
                 min_p: float = 0.0, rows, seed: int = 0) -> list[VllmDraw]:
    """One draw per row of ``logits`` (N, V), each by the top-k/top-p path its step takes on
    ``version``: ``rows`` (N,) is the number of rows (sequences) in the engine step that
    generated each position -- a rollout's tail, a small replica or a thin data-parallel
    shard runs steps of few rows."""
    pin = VLLM_PINS[version]
    rules = [pin.tie_rule(int(r)) for r in rows]
    by_rule = {rule: vllm_draws(logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p, ties=rule, seed=seed)
               for rule in sorted(set(rules))}
    return [by_rule[rule][j] for j, rule in enumerate(rules)]


def pinned_request_output(version: str, steps: list[VllmStep], num_logprobs: int, *, flat: bool = False,
                          mask: bool = False):
    """``LLM.generate(...)[0]`` of ``version``: a ``RequestOutput`` of that release holding one
    finished ``CompletionOutput`` of that release. The values are those every release computes
    alike (:func:`~tests.rollout.engines.engine_outputs.vllm_offline_output`); the classes differ."""
    pin = VLLM_PINS[version]
    if mask and not pin.masks:
        raise ValueError(f"vLLM {version} has no sampling masks")
    values = vllm_offline_output(steps, num_logprobs, flat=flat, mask=mask)
    output = completion_output_class(version)(**{n: getattr(values, n) for n in pin.completion_fields})
    return request_output_class(version)("0", None, [1, 2, 3], None, [output], True)


def pinned_generate_choice(version: str, steps: list[VllmStep], num_logprobs: Optional[int], *, mask: bool = False) -> dict:
    """One element of ``choices`` of ``POST /inference/v1/generate`` on ``version``.

    0.33: :func:`~tests.rollout.engines.engine_outputs.vllm_generate_choice`. 0.24 / 0.25 /
    0.30 (``_create_tokens_logprobs``, :attr:`VllmPin.sources` "generate"): chat-shaped
    entries, ``"token": "token_id:<id>"`` whatever the server's flags, ``logprob`` clamped with
    ``max(lp, -9999.0)``, ``bytes`` left None, ``top_logprobs`` the position's first
    ``max(logprobs, 1)`` entries in engine order; the choice's fields in declaration order,
    ``sampling_mask`` only from 0.30 on.
    """
    pin = VLLM_PINS[version]
    if mask and not pin.masks:
        raise ValueError(f"vLLM {version} has no sampling masks")
    if pin.generate_ids:
        return vllm_generate_choice(steps, num_logprobs, mask=mask)
    logprobs = None
    if num_logprobs is not None:
        content = []
        for s in steps:
            pos = vllm_position(s, num_logprobs)
            top = [{"token": f"token_id:{t}", "logprob": max(e.logprob, -9999.0), "bytes": None}
                   for t, e in itertools.islice(pos.items(), max(num_logprobs, 1))]
            content.append({"token": f"token_id:{s.token}", "logprob": max(pos[s.token].logprob, -9999.0), "bytes": None,
                            "top_logprobs": top})
        logprobs = {"content": content}
    choice = {"index": 0, "logprobs": logprobs, "finish_reason": "length", "token_ids": [s.token for s in steps],
              "routed_experts": None}
    if pin.masks:
        choice["sampling_mask"] = [s.mask for s in steps] if mask else None
    return _json(choice)


def pinned_vllm_config(version: str, *, logprobs_mode: str = "processed_logprobs", max_logprobs: int = 20,
                       return_sampling_mask: bool = False, use_v2_model_runner: bool = False):
    """``llm.llm_engine.vllm_config`` of ``version``, the fields replay checks: its
    ``model_config`` has ``return_sampling_mask`` only where the release has masks."""
    model = dict(logprobs_mode=logprobs_mode, max_logprobs=max_logprobs)
    if VLLM_PINS[version].masks:
        model["return_sampling_mask"] = return_sampling_mask
    model_config = type("ModelConfig", (), model)()
    return type("VllmConfig", (), {"model_config": model_config, "use_v2_model_runner": use_v2_model_runner})()


# ---------------------------------------------------------------------------------- SGLang pins

_SGLANG_0512_REQUEST = ("text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "use_audio_in_video",
                        "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                        "return_text_in_logprobs", "stream")
_SGLANG_0523_REQUEST = ("text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
                        "mm_content_hashes", "use_audio_in_video", "video_config", "sampling_params", "watermark",
                        "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                        "return_sampling_mask", "sampling_logprobs_mode", "return_text_in_logprobs",
                        "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs", "stream")


@dataclass(frozen=True)
class SglangPin:
    """What one SGLang release returns from ``/generate``.

    Attributes:
        request_fields: ``GenerateReqInput``'s fields from the prompt to ``stream``, in order
            (``rid`` is keyword-only in both).
        masks: ``return_sampling_mask`` exists (the sampling mask and its log-probs).
        sources: file:line of each fact, inside the wheel.
    """

    version: str
    pinned_by: str
    request_fields: tuple
    masks: bool
    sources: Mapping[str, str]


SGLANG_PINS = {
    "0.5.12": SglangPin(
        "0.5.12", "verl 0.9.1; NeMo-RL pins 0.5.12.post1, the same files", _SGLANG_0512_REQUEST, masks=False,
        sources={
            "GenerateReqInput": "sglang/srt/managers/io_struct.py:134-169 (rid: BaseReq, 51-53)",
            "log-probs": "sglang/srt/layers/sampler.py:169-186 (log of the tempered softmax, before top-k/top-p/min-p), "
                         "339 (clamped to the dtype's min)",
            "meta_info": "sglang/srt/managers/tokenizer_manager.py:1682-1714, 1925-1960; "
                         "(logprob, token_id, None) tuples: 2063-2075",
        },
    ),
    "0.5.23": SglangPin(
        "0.5.23", "the adapters' reference", _SGLANG_0523_REQUEST, masks=True,
        sources={
            "GenerateReqInput": "sglang/srt/managers/io_struct.py:176-256",
            "mask": "sglang/srt/layers/sampler.py:539-629; meta_info: tokenizer_manager.py:2506-2558",
        },
    ),
}


@functools.cache
def generate_req_input_class(version: str) -> type:
    """``GenerateReqInput`` of ``version``, a dataclass with its fields up to ``stream``."""
    fields = [(n, object, field(default=None)) for n in SGLANG_PINS[version].request_fields]
    fields.append(("rid", object, field(default=None, kw_only=True)))
    return dataclasses.make_dataclass("GenerateReqInput", fields, namespace={"__module__": __name__})


def sglang_0512_meta_info(logits: torch.Tensor, temperature: float, sampled: list[int], *, top_logprobs_num: int) -> dict:
    """``meta_info`` of a finished SGLang 0.5.12 ``/generate`` response with ``return_logprob``
    (SGLANG_PINS["0.5.12"].sources; the prompt-side log-prob fields left out):
    ``output_token_logprobs`` ``[logprob, token_id, null]`` per
    token and ``output_top_logprobs`` the top ``top_logprobs_num`` of the same distribution -- the
    tempered softmax over the whole vocabulary, which top-k / top-p never touched: nothing in it
    is ``-inf``, so it shows no support."""
    lp = torch.log(torch.softmax(logits.float() / temperature, dim=-1))
    lp = lp.clamp(min=torch.finfo(lp.dtype).min)
    top = torch.topk(lp, top_logprobs_num, dim=-1)
    own = [[float(lp[j, t]), t, None] for j, t in enumerate(sampled)]
    tops = [[[v, i, None] for v, i in zip(top.values[j].tolist(), top.indices[j].tolist())] for j in range(len(sampled))]
    return _json({
        "id": "b1946ac92492d2347c6235b4d2611184",
        "finish_reason": {"type": "length", "length": len(sampled)},
        "prompt_tokens": 5,
        "weight_version": "default",
        "num_retractions": 0,
        "output_token_logprobs": own,
        "output_token_logprobs_length": len(own),
        "output_top_logprobs": tops,
        "reasoning_tokens": 0,
        "completion_tokens": len(sampled),
        "cached_tokens": 0,
    })


__all__ = [
    "SGLANG_PINS",
    "VLLM_PINS",
    "completion_output_class",
    "generate_req_input_class",
    "pinned_draws",
    "pinned_generate_choice",
    "pinned_request_output",
    "pinned_vllm_config",
    "request_output_class",
    "sglang_0512_meta_info",
]
