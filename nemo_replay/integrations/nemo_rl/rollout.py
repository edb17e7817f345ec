"""The vLLM-worker side: what NeMo-RL's generation worker must request, and its supports as rows.

NeMo-RL's vLLM worker (``nemo_rl/models/generation/vllm/vllm_worker.py``) asks every
request for ``logprobs=0`` (``_build_sampling_params``) and keeps only the sampled token's
log-prob, in a ``[B, total_length]`` tensor: row i holds the prompt's ``input_lengths[i]``
tokens, then the generated ones from column ``input_lengths[i]``, right-padded to
``padded_input_length + max generated length`` (its output loop, ``full_logprobs``).
The rollout manager then slices ``[input_len:total_len]`` into the assistant message's
``generation_logprobs`` (``nemo_rl/experience/rollout_manager.py``).

For replay the worker must see each token's whole support:

- processed log-probs: engine ``vllm_cfg.logprobs_mode: processed_logprobs`` (NeMo-RL's
  default) and ``max_logprobs >= top_k + 1``; each request asks ``logprobs = width + 1``
  with ``width = min(top_k + 16, max_logprobs - 1)`` (:func:`vllm_support_request`), so every
  position's list ends with a filtered entry even where vLLM 0.24 / 0.25 keep every token
  tied with the k-th (their PyTorch path, any step of fewer than 8 rows);
- or vLLM's sampling masks (``return_sampling_mask`` on a Model Runner V2 engine), exact
  sets of any width.

:func:`completion_supports` reads the worker's outputs through the engine adapters of
:mod:`nemo_replay.rollout.engines.vllm`: each completion's rows, CSR, placed after its prompt in
the columns of the worker's ``logprobs`` tensor. Replay's vLLM worker (:mod:`.workers`) encodes
them once, one :class:`~nemo_replay.support.rows.SampleRows` a sample; the patched rollout code
slices each into its generated message like ``logprobs`` (:mod:`.patch`), and :mod:`.datapath`
joins each sample's messages in the columns of its flattened message log, before NeMo-RL builds
its policy batches. The rows are decoded once, where they are scored (:mod:`.scoring`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from nemo_replay.rollout.engines.vllm import support_from_vllm_output, vllm_row_width

__all__ = ["vllm_support_request", "completion_supports"]


def vllm_support_request(top_k: int, *, path: str = "logprobs", max_logprobs: Optional[int] = None) -> dict:
    """The ``SamplingParams`` fields the worker must set on top of its own for ``path``.

    ``"logprobs"``: ``{"logprobs": width + 1, "flat_logprobs": True}`` with ``width =``
    :func:`~nemo_replay.rollout.engines.vllm.vllm_row_width` ``(top_k, max_logprobs)``: a list
    that long shows a support tied at the k-th value up to ``width`` ids whole (NeMo-RL asks 0; a
    vLLM without ``flat_logprobs`` keeps its dicts: the worker sets only fields it has).
    ``"mask"``: ``{}`` -- the engine returns masks itself when started with
    ``return_sampling_mask``; ``logprobs=0`` still gives the sampled token's log-prob.

    Raises:
        ValueError when ``top_k`` is not an int > 1 (an unbounded or single-token support
        cannot be replayed), ``max_logprobs`` leaves no room, or ``path`` is unknown.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 2:
        raise ValueError(
            f"replay needs policy.generation.top_k set to an int > 1 (vLLM returns a whole support only for a bounded "
            f"top-k), got {top_k!r}"
        )
    if path == "logprobs":
        # flat_logprobs (vLLM >= 0.24, sampling_params.py): one flat list a response instead of a
        # dict and a Logprob per entry -- half the memory held until generate returns, a sixth of
        # the engine's output processing; position i still reads as a dict (FlatLogprobs.__getitem__).
        return {"logprobs": vllm_row_width(top_k, max_logprobs) + 1, "flat_logprobs": True}
    if path == "mask":
        return {}
    raise ValueError(f"path must be 'logprobs' or 'mask', got {path!r}")


def completion_supports(completions: Sequence[Any], input_lengths, total_length: int, *, width: int,
                        vocab_size: Optional[int] = None, sampling_params: Any = None):
    """``(i, start, EngineSupport)`` of each completion, its rows CSR, checked to fit ``total_length``
    after its prompt.

    Args:
        completions: ``[o.outputs[0] for o in llm.generate(...)]``, one vLLM
            ``CompletionOutput`` per request, in batch order.
        input_lengths: (B,), int. The prompt lengths NeMo-RL's worker used.
        total_length: the width of its ``output_ids`` / ``logprobs`` (padded input length
            plus the longest generation).
        width: the row width (``vllm_row_width(top_k, max_logprobs)``: wider supports are flagged).
        vocab_size: ids must be below it when given.
        sampling_params: the requests' ``SamplingParams``, checked for the support path.

    Raises:
        ValueError naming the request when its tokens do not fit ``total_length``, and the
        adapters' errors (misaligned log-probs, a raw log-prob mode, missing log-probs).
    """
    lengths = torch.as_tensor(input_lengths, dtype=torch.int64).cpu()
    B = len(completions)
    if lengths.shape != (B,):
        raise ValueError(f"input_lengths has shape {tuple(lengths.shape)} for {B} completions; pass one prompt length per request")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be the row width k (an int >= 1, the requests' top_k), got {width!r}")
    for i, completion in enumerate(completions):
        got = support_from_vllm_output(completion, width=width, vocab_size=vocab_size, sampling_params=sampling_params)
        n = got.support.num_rows
        start = int(lengths[i])
        if start < 0 or start + n > total_length:
            raise ValueError(
                f"request {i}: {start} prompt tokens + {n} generated tokens do not fit total_length={total_length}; pass "
                f"the width of the worker's output_ids"
            )
        yield i, start, got
