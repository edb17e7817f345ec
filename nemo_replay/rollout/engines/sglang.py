"""SGLang ``/generate`` outputs -> support rows (docs/design.md §2, §7; worked example: docs/engines.md).

Checked against SGLang 0.5.23 (paths below are inside its wheel, under ``sglang/srt/``).

Request (``managers/io_struct.py``, ``GenerateReqInput``)::

    {"input_ids": [...], "return_sampling_mask": true,
     "sampling_logprobs_mode": "selected" | "support",        # default "selected"
     "sampling_params": {"temperature": T > 0, "top_k": k, "top_p": ..., "min_p": ...}}

The scheduler refuses a mask request unless ``1 < top_k <= --sampling-mask-max-tokens``
(``managers/scheduler.py``; the server flag defaults to 4096,
``arg_groups/fields/exec_.py``). A token whose realised support is wider than that limit
(ties at the top-k cutoff) aborts the request (``SamplingMaskStatus.OVERFLOW``,
``managers/scheduler_components/batch_result_processor.py``): a non-streaming HTTP call
answers 400 ``{"error": {"message": "Sampling support exceeds --sampling-mask-max-tokens=..."}}``
(``entrypoints/http_server.py``); a stream, or the Python engine, ends with
``meta_info["finish_reason"] == {"type": "abort", "message": ..., "status_code": 400,
"err_type": "BadRequestError"}`` (``managers/schedule_batch.py``, ``FINISH_ABORT.to_json``).
Both are refused here with :class:`SGLangAbortError`, naming the fix: the response's rows
are incomplete.

Response ``meta_info`` keys (``managers/tokenizer_manager.py``):

- ``output_token_sampling_mask``: one id list per output token, members ordered by
  probability, largest first (``layers/sampler.py``, ``_build_sampling_mask_output``: a
  sorted ``torch.topk`` of the filtered weights); kept in that order;
- ``output_token_sampling_logprobs``: in ``"selected"`` mode one float per token,
  ``log(w_sel / support_mass)``; in ``"support"`` mode one list per token aligned with its
  mask row, ``log(w / support_mass)`` for each member (``sampling/sampling_mask.py``,
  ``SamplingMaskChunk.to_lists``). The sampled token's log-prob is the entry at its own
  position in the row -- not the row's first (most probable) entry;
- ``output_token_sampling_mask_length``: the number of rows.

The mask is the exact support: a sampled token outside its row is an error, never repaired.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import torch

from nemo_replay.rollout.engines.base import (
    EngineSupport,
    assemble,
    capture_settings_from_engine,
    id_rows,
    sampled_tensor,
    strict_logprob,
)
from nemo_replay.support.errors import SupportAlignmentError

__all__ = [
    "SGLangAbortError",
    "SGLANG_DEFAULT_MASK_MAX_TOKENS",
    "check_sglang_request",
    "support_from_sglang_meta_info",
    "support_from_sglang_response",
]

#: SGLang 0.5.23's default ``--sampling-mask-max-tokens``.
SGLANG_DEFAULT_MASK_MAX_TOKENS = 4096

_MODES = ("selected", "support")
_OVERFLOW = "Sampling support exceeds --sampling-mask-max-tokens"


class SGLangAbortError(ValueError):
    """SGLang aborted the request; its rows are incomplete and must not be replayed."""


def _abort(message: str, where: str) -> SGLangAbortError:
    if message.startswith(_OVERFLOW):
        return SGLangAbortError(
            f"{where}: SGLang aborted the request: {message!r}. One token's support (ties at the top-k cutoff) was "
            f"wider than the server's --sampling-mask-max-tokens; lower sampling_params.top_k or restart SGLang with a "
            f"larger --sampling-mask-max-tokens, then send the request again"
        )
    return SGLangAbortError(f"{where}: SGLang aborted the request: {message!r}; its output is incomplete")


def check_sglang_request(body: Mapping[str, Any], *, mask_max_tokens: int = SGLANG_DEFAULT_MASK_MAX_TOKENS) -> dict:
    """Refuse a ``/generate`` body whose masks cannot be replayed; return capture settings.

    Args:
        body: the request JSON (``return_sampling_mask``, ``sampling_logprobs_mode``,
            ``sampling_params``).
        mask_max_tokens: the server's ``--sampling-mask-max-tokens``.

    Raises:
        ValueError naming the field to set.
    """
    where = "SGLang /generate request"
    if not isinstance(body, Mapping):
        raise ValueError(f"{where}: expected the request body (a JSON object), got {type(body).__name__}")
    if body.get("return_sampling_mask") is not True:
        raise ValueError(f"{where}: return_sampling_mask={body.get('return_sampling_mask')!r}; send \"return_sampling_mask\": true")
    mode = body.get("sampling_logprobs_mode")
    if mode is not None and mode not in _MODES:
        raise ValueError(f"{where}: sampling_logprobs_mode={mode!r}, expected one of {_MODES}")
    params = body.get("sampling_params")
    if not isinstance(params, Mapping):
        raise ValueError(f"{where}: sampling_params={params!r}; send a sampling_params object with temperature and top_k")
    settings = capture_settings_from_engine(params, engine="sglang")
    k = settings["top_k"]
    if k is None or not 1 < k <= mask_max_tokens:
        raise ValueError(
            f"{where}: sampling_params.top_k={params.get('top_k')!r}; SGLang returns masks only for "
            f"1 < top_k <= --sampling-mask-max-tokens={mask_max_tokens} -- leave headroom below the limit for ties"
        )
    return settings


def _rows(meta_info: Mapping[str, Any], where: str) -> list[list[int]]:
    rows = meta_info.get("output_token_sampling_mask")
    if rows is None:
        raise ValueError(
            f"{where}: meta_info has no 'output_token_sampling_mask'; send the request with \"return_sampling_mask\": "
            f"true, to SGLang >= 0.5.23 (0.5.12 returns no sampling masks and its log-probs are over the vocabulary, "
            f"before truncation: no support can be read from them)"
        )
    if not isinstance(rows, list):
        raise ValueError(f"{where}: 'output_token_sampling_mask' must be a list of id lists, got {type(rows).__name__}")
    out = id_rows(rows, where)
    count = meta_info.get("output_token_sampling_mask_length")
    if count is not None and count != len(out):
        raise ValueError(f"{where}: output_token_sampling_mask_length={count!r} but {len(out)} rows arrived; truncated output")
    return out


def _sampled_logprob(value: Any, row: list[int], token: int, at: str) -> float:
    """The sampled token's log-prob: the float itself ("selected") or its row entry ("support")."""
    if isinstance(value, list):
        if len(value) != len(row):
            raise ValueError(f"{at}: {len(value)} support log-probs for a row of {len(row)} tokens; expected one per member")
        if token not in row:
            # The same failure validate_support names in "selected" mode: the same error class.
            raise SupportAlignmentError(f"{at}: sampled token {token} is not a member of its row {row[:16]}; outputs are misaligned")
        value = value[row.index(token)]
    lp = strict_logprob(value, "sampling log-prob", at)
    if not math.isfinite(lp):
        raise ValueError(f"{at}: the sampled token's log-prob is {lp}; SGLang reports a finite one for every sampled token")
    return lp


def support_from_sglang_meta_info(
    meta_info: Mapping[str, Any],
    sampled_ids: Sequence[int] | torch.Tensor,
    *,
    width: Optional[int] = None,
    vocab_size: Optional[int] = None,
    sampling_params: Optional[Mapping[str, Any]] = None,
) -> EngineSupport:
    """Support rows from a ``/generate`` response's ``meta_info`` (module doc).

    Args:
        meta_info: the response's ``meta_info``, either ``sampling_logprobs_mode``.
        sampled_ids: (n,) the response's ``output_ids``; each must be in its row.
        width: fixed row width or None for ragged rows (SGLang's order, most probable first).
        vocab_size: ids must be below it when given.
        sampling_params: the request's ``sampling_params``, checked when given.

    Returns:
        :class:`~nemo_replay.rollout.engines.base.EngineSupport` with the sampled tokens'
        log-probs over their supports when the response carries them.

    Raises:
        SGLangAbortError: the request was aborted (overflow or another reason).
    """
    where = "SGLang sampling-mask adapter"
    if sampling_params is not None:
        capture_settings_from_engine(sampling_params, engine="sglang")
    if not isinstance(meta_info, Mapping):
        raise ValueError(f"{where}: expected the response's meta_info object, got {type(meta_info).__name__}")
    finish = meta_info.get("finish_reason")
    if isinstance(finish, Mapping) and finish.get("type") == "abort":
        raise _abort(str(finish.get("message", "")), where)
    rows = _rows(meta_info, where)
    sampled = sampled_tensor(sampled_ids, len(rows), where)
    raw = meta_info.get("output_token_sampling_logprobs")
    logprobs = None
    if raw is not None:
        if not isinstance(raw, list) or len(raw) != len(rows):
            got = len(raw) if isinstance(raw, list) else type(raw).__name__
            raise ValueError(f"{where}: {got} sampling log-probs for {len(rows)} mask rows; expected one per row")
        logprobs = torch.tensor(
            [_sampled_logprob(v, r, int(t), f"{where}, position {j}") for j, (v, r, t) in enumerate(zip(raw, rows, sampled))],
            dtype=torch.float32,
        )
    return assemble(rows, sampled, width=width, logprobs=logprobs, reasons={}, vocab_size=vocab_size, where=where)


def support_from_sglang_response(
    response: Mapping[str, Any],
    *,
    width: Optional[int] = None,
    vocab_size: Optional[int] = None,
    sampling_params: Optional[Mapping[str, Any]] = None,
) -> EngineSupport:
    """Support rows from a whole ``/generate`` response body (``output_ids`` + ``meta_info``).

    An error body (``{"error": {"message": ...}}``, SGLang's 400 for an aborted request) raises
    :class:`SGLangAbortError` naming the fix.
    """
    where = "SGLang /generate response"
    if not isinstance(response, Mapping):
        raise ValueError(f"{where}: expected the response object, got {type(response).__name__} (one response per call)")
    error = response.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, Mapping) else error
        raise _abort(str(message), where)
    if "output_ids" not in response or "meta_info" not in response:
        raise ValueError(f"{where}: expected 'output_ids' and 'meta_info', got keys {sorted(response)}")
    return support_from_sglang_meta_info(
        response["meta_info"], response["output_ids"], width=width, vocab_size=vocab_size, sampling_params=sampling_params
    )
