"""Engine outputs built field for field as vLLM 0.33.0 and SGLang 0.5.23 build them.

Read from the wheels (``pip download vllm==0.33.0 --no-deps``, ``pip download sglang==0.5.23
--no-deps``, unzipped); every builder cites the file and lines it follows. The engines
themselves are not dependencies: the classes below carry the same fields, and JSON forms go
through ``json.dumps(..., allow_nan=False)`` / ``json.loads`` as the servers' responses do.

The sampler side is simulated from known logits: the processed logits are ``x = z / T`` with
``-inf`` outside the support a vLLM path keeps (:func:`nemo_replay.capture.sample` with the
matching ``ties=`` rule), so every engine-shaped value below has an exact reference.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

# ---------------------------------------------------------------------------------- vLLM classes


@dataclass
class Logprob:
    """vllm/logprobs.py:13-26 -- ``logprob``, ``rank``, ``decoded_token``."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class FlatLogprobs:
    """vllm/logprobs.py:32-60 -- flat lists plus per-position start/end indices.

    ``append_fast`` (vllm/logprobs.py:74-91) appends the sampled entry and the top-k entries
    without de-duplicating them: a sampled token inside the top-k appears twice.
    """

    start_indices: list = field(default_factory=list)
    end_indices: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    ranks: list = field(default_factory=list)
    decoded_tokens: list = field(default_factory=list)

    def append_fast(self, token_ids, logprobs, ranks, decoded_tokens):
        self.start_indices.append(len(self.logprobs))
        for t, lp, r, d in zip(token_ids, logprobs, ranks, decoded_tokens):
            self.token_ids.append(t), self.logprobs.append(lp), self.ranks.append(r), self.decoded_tokens.append(d)
        self.end_indices.append(len(self.logprobs))

    # A MutableSequence of positions (vllm/logprobs.py:30-31, 100-135 in 0.25.1): what code that iterates
    # ``output.logprobs`` position by position (TRL's extract_logprobs) sees.
    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, index: int) -> dict:
        """Position ``index`` as a dict: the entries in order, a repeated token keeping its last entry."""
        return {
            self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
            for i in range(self.start_indices[index], self.end_indices[index])
        }

    def __iter__(self):
        return (self[i] for i in range(len(self)))


@dataclass
class SamplingMask:
    """vllm/outputs.py:38-46 -- one field, ``token_ids: list[list[int]]``."""

    token_ids: list


@dataclass
class CompletionOutput:
    """vllm/outputs.py:58-97 (fields in declaration order)."""

    index: int
    text: str
    token_ids: list
    cumulative_logprob: Optional[float]
    logprobs: object
    routed_experts: object = None
    finish_reason: Optional[str] = None
    stop_reason: object = None
    lora_request: object = None
    sampling_mask: Optional[SamplingMask] = None
    spec_decode_metrics: object = None
    weight_versions: object = None


@dataclass
class RequestOutput:
    """vllm/outputs.py:169-190 (``RequestOutput.__init__``'s parameters in order); ``LLM.generate``
    returns one per prompt, its ``outputs`` holding the ``CompletionOutput`` of each sample."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: Optional[list]
    prompt_logprobs: object
    outputs: list
    finished: bool
    metrics: object = None
    lora_request: object = None
    encoder_prompt: Optional[str] = None
    encoder_prompt_token_ids: Optional[list] = None
    num_cached_tokens: Optional[int] = None
    num_cache_creation_tokens: Optional[int] = None
    prompt_token_id_logprobs: object = None
    kv_transfer_params: Optional[dict] = None
    ec_transfer_params: Optional[dict] = None


# ---------------------------------------------------------------------------------- vLLM sampler


@dataclass
class VllmStep:
    """What vLLM's sampler hands the output processor for one generated token."""

    token: int
    token_ids: list  # sampled first, then the top-N by processed log-prob
    logprobs: list
    rank: int  # of the sampled token
    mask: list  # the support, ids ascending


@dataclass
class VllmDraw:
    """One sampler step before its log-prob list is cut: the drawn token, the support (ids
    ascending) and the processed log-probs over the vocabulary, (V,) float32."""

    token: int
    mask: list
    processed: torch.Tensor

    def step(self, num_logprobs: int) -> VllmStep:
        """The step as the sampler hands it over when the request asks ``num_logprobs``."""
        top = torch.topk(self.processed, num_logprobs)
        own = self.processed[self.token]
        rank = int((self.processed >= own).sum())
        return VllmStep(self.token, [self.token] + top.indices.tolist(), [float(own)] + top.values.tolist(), rank, self.mask)


def vllm_draws(logits: torch.Tensor, temperature: float, *, top_k: int, top_p: float = 1.0, min_p: float = 0.0,
               ties: str = "index_order", seed: int = 0) -> list[VllmDraw]:
    """One draw per row of ``logits`` (N, V); :func:`vllm_steps` cuts each to a log-prob list.

    - Min-p, top-k and top-p as the vLLM path named by ``ties`` applies them
      (:func:`nemo_replay.capture.sample`; min-p vllm/v1/sample/logits_processor/builtin.py:102-116).
    - Processed log-probs: ``log_softmax`` in float32 of the processed logits
      (vllm/v1/sample/sampler.py:369-370; MRV2 vllm/v1/worker/gpu/sample/logprob.py:15-56).
    - Mask: ids whose processed logit is finite, ascending (vllm/v1/worker/gpu/sample/output.py:26-80).
    """
    from nemo_replay import capture

    res = capture.sample(logits.double(), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, ties=ties,
                         generator=torch.Generator().manual_seed(seed))
    draws = []
    for j in range(logits.shape[0]):
        members = res.support.row(j).tolist() if hasattr(res.support, "row") else [int(t) for t in res.support.values[j] if t >= 0]
        x = (logits[j].double() / temperature).float()
        processed = torch.full_like(x, -math.inf)
        processed[members] = x[members]
        draws.append(VllmDraw(int(res.ids[j]), sorted(members), torch.log_softmax(processed, dim=-1, dtype=torch.float32)))
    return draws


def vllm_steps(logits: torch.Tensor, temperature: float, *, top_k: int, top_p: float = 1.0, min_p: float = 0.0,
               num_logprobs: int, ties: str = "index_order", seed: int = 0) -> list[VllmStep]:
    """One step per row of ``logits`` (N, V) (the draws: :func:`vllm_draws`).

    - Entries: the sampled token, then ``torch.topk(processed, num_logprobs)`` ids, sorted
      (vllm/v1/sample/sampler.py:373-415; MRV2 logprob.py:125-133).
    - Rank of the sampled token: the count of log-probs ``>=`` its own
      (MRV2 logprob.py:62-81, ``logits >= x``).
    """
    return [d.step(num_logprobs) for d in vllm_draws(logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                                      ties=ties, seed=seed)]


def vllm_position(step: VllmStep, num_logprobs: int) -> dict:
    """``dict[int, Logprob]`` as append_logprobs_for_next_position builds it
    (vllm/logprobs.py:178-207): ranks ``chain((rank,), range(1, num_logprobs + 1))``, a dict
    comprehension over zip -- the sampled token keeps the first slot, a repeat overwrites its value."""
    ranks = itertools.chain((step.rank,), range(1, num_logprobs + 1))
    return {t: Logprob(lp, r, None) for t, lp, r in zip(step.token_ids, step.logprobs, ranks)}


def vllm_offline_output(steps: list[VllmStep], num_logprobs: int, *, flat: bool = False, mask: bool = False) -> CompletionOutput:
    """``CompletionOutput`` of one finished request (vllm/v1/engine/output_processor.py:490-525):
    ``logprobs`` a list of dicts or a FlatLogprobs (vllm/logprobs.py:173-176), ``sampling_mask`` a
    ``SamplingMask`` joined from the engine's chunks (output_processor.py:500-510)."""
    if flat:
        logprobs = FlatLogprobs()
        for s in steps:
            ranks = itertools.chain((s.rank,), range(1, num_logprobs + 1))
            logprobs.append_fast(s.token_ids, s.logprobs, ranks, itertools.repeat(None))
    else:
        logprobs = [vllm_position(s, num_logprobs) for s in steps]
    return CompletionOutput(
        index=0,
        text="",
        token_ids=[s.token for s in steps],
        cumulative_logprob=sum(s.logprobs[0] for s in steps),
        logprobs=logprobs,
        finish_reason="length",
        sampling_mask=SamplingMask([s.mask for s in steps]) if mask else None,
    )


def _json(obj):
    """Through JSON as the server sends it; ``allow_nan=False`` proves no ``-inf`` escaped the clamp."""
    return json.loads(json.dumps(obj, allow_nan=False))


def vllm_completions_logprobs(steps: list[VllmStep], num_logprobs: int) -> dict:
    """``choices[i].logprobs`` of /v1/completions with ``return_tokens_as_token_ids``
    (vllm/entrypoints/openai/completion/serving.py:714-803; protocol.py:668-672): tokens as
    ``token_id:<id>`` (entrypoints/generate/base/serving.py:322-323), each log-prob clamped with
    ``max(lp, -9999.0)``, ``top_logprobs`` the first ``logprobs + 1`` entries
    (base/serving.py:368-378)."""
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    last = 0
    for s in steps:
        pos = vllm_position(s, num_logprobs)
        token = f"token_id:{s.token}"
        out["tokens"].append(token)
        out["token_logprobs"].append(max(pos[s.token].logprob, -9999.0))
        out["top_logprobs"].append({f"token_id:{t}": max(e.logprob, -9999.0) for t, e in itertools.islice(pos.items(), num_logprobs + 1)})
        out["text_offset"].append(0 if not out["text_offset"] else out["text_offset"][-1] + last)
        last = len(token)
    return _json(out)


def vllm_chat_logprobs(steps: list[VllmStep], num_logprobs: int, top_logprobs: int) -> dict:
    """``choices[i].logprobs`` of /v1/chat/completions with ``return_tokens_as_token_ids``
    (vllm/entrypoints/openai/chat_completion/serving.py:1190-1277; protocol.py:96-110): each
    position's ``top_logprobs`` cut to its first ``top_logprobs`` entries in engine order, the
    sampled token first (base/serving.py:355-365); ``bytes`` of the content entry is None
    without a decoded token (serving.py:1266-1269)."""
    content = []
    for s in steps:
        pos = vllm_position(s, num_logprobs)
        top = [
            {"token": f"token_id:{t}", "logprob": max(e.logprob, -9999.0), "bytes": list(f"token_id:{t}".encode())}
            for t, e in itertools.islice(pos.items(), top_logprobs)
        ]
        content.append({"token": f"token_id:{s.token}", "logprob": max(pos[s.token].logprob, -9999.0), "bytes": None, "top_logprobs": top})
    return _json({"content": content})


def vllm_generate_choice(steps: list[VllmStep], num_logprobs: Optional[int], *, mask: bool) -> dict:
    """One element of ``choices`` of POST /inference/v1/generate, output_mode "tokens"
    (vllm/entrypoints/scale_out/token_in_token_out/serving.py:455-502 and 876-922;
    protocol.py:453-520): every entry of the position, not cut, with integer ``token_id``,
    ``logprob`` clamped to -9999.0 (serving.py:85-91) and ``rank or None``."""
    logprobs = None
    if num_logprobs is not None:
        content = []
        for s in steps:
            pos = vllm_position(s, num_logprobs)
            clamp = lambda v: -9999.0 if math.isnan(v) else max(v, -9999.0)  # noqa: E731
            content.append({
                "token_id": s.token,
                "logprob": clamp(pos[s.token].logprob),
                "rank": pos[s.token].rank or None,
                "top_logprobs": [{"token_id": t, "logprob": clamp(e.logprob), "rank": e.rank or None} for t, e in pos.items()],
            })
        logprobs = {"content": content}
    return _json({
        "index": 0,
        "logprobs": logprobs,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": [s.token for s in steps],
        "routed_experts": None,
        "sampling_mask": [s.mask for s in steps] if mask else None,
        "weight_versions": None,
    })


# ---------------------------------------------------------------------------------- SGLang


@dataclass
class SglangStep:
    token: int
    row: list  # the packed ids, most probable first
    selected_logprob: float
    support_logprobs: list


def sglang_steps(logits: torch.Tensor, temperature: float, *, top_k: int, top_p: float = 1.0, min_p: float = 0.0,
                 seed: int = 0) -> list[SglangStep]:
    """SGLang's PyTorch sampling backend with ``return_sampling_mask``.

    - Filtered weights: probabilities sorted descending, ranks ``>= top_k`` zeroed, then tokens
      whose preceding mass exceeds ``top_p`` zeroed, without renormalising after top-k
      (sglang/srt/layers/sampler.py:785-835); min-p last, against the largest weight left
      (sampler.py:829-835: ``w < w[0] * min_p`` zeroed).
    - Packed row: the weights' sorted ``torch.topk`` ids, ``lengths`` the count of positive
      weights; ``selected_logprobs = log(w_sel / support_mass)`` and
      ``support_logprobs = log(w / support_mass)`` per packed member
      (sglang/srt/layers/sampler.py:539-629).
    """
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    steps = []
    for j in range(logits.shape[0]):
        p_sort, p_idx = probs[j].sort(descending=True)
        cum = torch.cumsum(p_sort, 0)
        w_sort = p_sort.clone()
        w_sort[top_k:] = 0.0
        w_sort[(cum - p_sort) > top_p] = 0.0
        if min_p > 0.0:
            w_sort[w_sort < w_sort[0] * min_p] = 0.0
        weights = torch.zeros_like(probs[j]).scatter(0, p_idx, w_sort)
        token = int(torch.multinomial(weights, 1, generator=g))
        length = int((weights > 0).sum())
        packed_w, packed_ids = torch.topk(weights, k=length, sorted=True)
        mass = weights[weights > 0].sum(dtype=torch.float32)
        steps.append(SglangStep(token, packed_ids.tolist(), float(torch.log(weights[token] / mass)),
                                torch.log(packed_w / mass).tolist()))
    return steps


def sglang_meta_info(steps: list[SglangStep], mode: str, *, prompt_tokens: int = 5) -> dict:
    """``meta_info`` of a finished /generate response (sglang/srt/managers/tokenizer_manager.py:2506-2558):
    ``SamplingMaskChunk.to_lists`` gives one id list per token and, per
    ``sampling_logprobs_mode``, one float (selected) or one list aligned with the row (support)
    (sglang/srt/sampling/sampling_mask.py:12-51); the finish reason is FINISH_LENGTH.to_json
    (sglang/srt/managers/schedule_batch.py:320-329)."""
    masks = [s.row for s in steps]
    values = [s.selected_logprob for s in steps] if mode == "selected" else [s.support_logprobs for s in steps]
    return _json({
        "id": "b1946ac92492d2347c6235b4d2611184",
        "finish_reason": {"type": "length", "length": len(steps)},
        "prompt_tokens": prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "output_token_sampling_mask": masks,
        "output_token_sampling_logprobs": values,
        "output_token_sampling_mask_length": len(masks),
        "reasoning_tokens": 0,
        "completion_tokens": len(steps),
        "cached_tokens": 0,
    })


def sglang_overflow_message(limit: int = 4096) -> str:
    """FINISH_ABORT message for SamplingMaskStatus.OVERFLOW
    (sglang/srt/managers/scheduler_components/batch_result_processor.py:1333-1341)."""
    return (
        f"Sampling support exceeds --sampling-mask-max-tokens={limit}, commonly because "
        "of cutoff ties. Lower top_k to leave more headroom or increase "
        "the server limit."
    )


def sglang_abort_finish_reason(message: str) -> dict:
    """FINISH_ABORT.to_json (sglang/srt/managers/schedule_batch.py:332-345), status 400."""
    return {"type": "abort", "message": message, "status_code": 400, "err_type": "BadRequestError"}


def sglang_error_body(message: str) -> dict:
    """The non-streaming HTTP answer to a 400 abort: ``_create_error_response``
    (sglang/srt/entrypoints/http_server.py:2246-2250) after tokenizer_manager.py:1916-1918
    raises ValueError(message)."""
    return _json({"error": {"message": message}})
