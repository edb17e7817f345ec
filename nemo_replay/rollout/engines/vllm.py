"""vLLM outputs -> support rows (docs/design.md §2, §7; worked examples: docs/engines.md).

Checked against vLLM 0.33.0 (paths below are inside its wheel). Two sources of support:

**The sampling mask** -- the exact set each token was drawn from. Engine: started with
``--return-sampling-mask`` (``LLM(return_sampling_mask=True)``), which needs Model Runner V2
(``VLLM_USE_V2_MODEL_RUNNER=1``) and ``--logprobs-mode processed_logprobs``
(``vllm/config/vllm.py``, ``_verify_sampling_replay_config``). Request: ``temperature > 0``
and ``top_k > 0`` (``vllm/v1/engine/input_processor.py`` refuses others; capture also needs
``top_k > 1``). Output paths:

- offline: ``CompletionOutput.sampling_mask``, a ``SamplingMask`` whose one field is
  ``token_ids: list[list[int]]`` (``vllm/outputs.py``); ids ascending in each row (the
  compaction kernel in ``vllm/v1/worker/gpu/sample/output.py`` walks the vocabulary in
  order; rows wider than its buffer come from the exact bitmask).
  :func:`support_from_vllm_sampling_mask`, or :func:`support_from_vllm_output` for the
  whole ``CompletionOutput``;
- ``POST /inference/v1/generate``: ``choices[i].sampling_mask``, the same lists
  (``vllm/entrypoints/scale_out/token_in_token_out/``). :func:`support_from_vllm_generate`.

**Processed log-probs** -- the top entries of the distribution after temperature, min-p,
top-k and top-p, where a filtered token reads ``-inf`` (``-9999.0`` in JSON, which clamps).
Engine: ``--logprobs-mode processed_logprobs`` and ``--max-logprobs >= top_k + 1``.
Request: ``temperature > 0``, ``top_k > 1``, no penalties, and ``logprobs = top_k + 1`` (chat:
``"logprobs": true, "top_logprobs": top_k + 1``; HTTP: ``"return_tokens_as_token_ids": true``
so tokens read ``"token_id:<id>"``). Each position holds the sampled token first, then the
top entries by rank, de-duplicated by id (``vllm/logprobs.py``,
``append_logprobs_for_next_position``). Output paths, all read by
:func:`support_from_vllm_logprobs`:

- offline ``CompletionOutput.logprobs``: ``list[dict[int, Logprob]]`` or ``FlatLogprobs``
  (``SamplingParams(flat_logprobs=True)``; ``vllm/logprobs.py``);
- ``/v1/completions``: ``choices[i].logprobs`` = ``{"tokens", "token_logprobs",
  "top_logprobs": [{"token_id:<id>": lp}], "text_offset"}``, all ``logprobs + 1`` entries
  (``entrypoints/openai/completion/serving.py``);
- ``/v1/chat/completions``: ``choices[i].logprobs.content`` = ``[{"token", "logprob", "bytes",
  "top_logprobs": [...]}]``, each cut to its first ``top_logprobs`` entries in engine order
  (``entrypoints/openai/chat_completion/serving.py``, ``entrypoints/generate/base/serving.py``);
- ``/inference/v1/generate`` (``output_mode`` "tokens"): ``choices[i].logprobs.content`` =
  ``[{"token_id", "logprob", "rank", "top_logprobs": [{"token_id", "logprob", "rank"}]}]``,
  every entry, not cut (``token_in_token_out/protocol.py``, ``serving.py``).

How a row is read from log-probs. The top entries come from ``torch.topk`` over the processed
log-probs, members (finite) first. So a position whose list shows at least one filtered
entry shows every member: its row is those members. A position whose entries are all
members may have more members past the end of its list -- with ``logprobs = top_k`` under
vLLM's PyTorch path, which keeps every token tied with the k-th (see
:mod:`nemo_replay.rollout.capture.sampler`), or under the chat cut -- so it is flagged
``not_fully_visible`` and its row left empty (:mod:`nemo_replay.rollout.engines.base`). Rows are
never cut: a support wider than a fixed ``width`` is flagged ``wider_than_row``.

A sampled token whose own log-prob is filtered, or a first entry that is not the sampled
token, is an error: the log-probs are not the ones the token was drawn from (raw log-prob
mode) or the outputs are misaligned.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from nemo_replay.rollout.engines.base import (
    FLAG_REASONS,
    EngineSupport,
    as_mapping,
    assemble,
    assemble_flat,
    capture_settings_from_engine,
    id_rows,
    sampled_tensor,
    strict_int,
    strict_logprob,
)
from nemo_replay.rollout.engines.vllm_arrays import VLLM_FILTERED_LOGPROB, flat_entries, read_flat

__all__ = [
    "VLLM_FILTERED_LOGPROB",
    "VLLM_TIE_MARGIN",
    "VLLM_DEFAULT_MAX_LOGPROBS",
    "vllm_row_width",
    "max_logprobs_problem",
    "check_vllm_engine",
    "check_vllm_request",
    "support_from_vllm_logprobs",
    "support_from_vllm_sampling_mask",
    "support_from_vllm_output",
    "support_from_vllm_generate",
]

_RAW_HINT = (" (every position's list holds members only: request logprobs=top_k + 1, and check that vLLM runs with "
             "--logprobs-mode processed_logprobs -- raw log-probs are never -inf)")

#: Members past ``top_k`` a row may hold and still be read whole: vLLM 0.24 / 0.25 run their
#: PyTorch top-k/top-p path for any step of fewer than 8 rows (``topk_topp_sampler.py:345-360``),
#: which keeps every token tied with the k-th value (``:384-392``): rows of 64..77 ids at
#: ``top_k = 64`` were seen. Requests ask ``logprobs = row width + 1`` (:func:`vllm_row_width`).
VLLM_TIE_MARGIN = 16


def vllm_row_width(top_k: int, max_logprobs: Optional[int] = None) -> int:
    """The widest support a request shows whole: ``top_k + VLLM_TIE_MARGIN``, within the engine's
    ``max_logprobs - 1`` (None or -1: no cap). A request asks one log-prob more, so that each
    position's list ends with a filtered entry; a tied support wider than this is flagged.

    Raises:
        ValueError when ``max_logprobs`` leaves no room for ``top_k + 1`` log-probs.
    """
    width = top_k + VLLM_TIE_MARGIN
    if max_logprobs is not None and max_logprobs != -1:
        if max_logprobs < top_k + 1:
            raise ValueError(f"max_logprobs={max_logprobs} < top_k + 1 = {top_k + 1}: a log-prob list cannot show a "
                             f"whole support; start vLLM with --max-logprobs {top_k + 1 + VLLM_TIE_MARGIN}")
        width = min(width, max_logprobs - 1)
    return width


def max_logprobs_problem(top_k: int, max_logprobs: Any, path: str, *, absent: bool = False) -> Optional[str]:
    """A recipe's problem line when the engine's ``max_logprobs`` (at ``path``; ``absent``: not set,
    vLLM's default) cannot take requests of ``top_k + 1`` log-probs, else None. -1 is vLLM's whole
    vocabulary. One rule for every recipe that starts vLLM (NeMo-RL's, verl's)."""
    came = f"{path} absent (vLLM's default {VLLM_DEFAULT_MAX_LOGPROBS})" if absent else f"{path}={max_logprobs!r}"
    value = VLLM_DEFAULT_MAX_LOGPROBS if absent else max_logprobs
    if isinstance(value, int) and not isinstance(value, bool) and (value == -1 or value >= top_k + 1):
        return None
    return (f"{came}: set an int >= {top_k + 1} = top_k + 1, best {top_k + 1 + VLLM_TIE_MARGIN} (each request asks "
            f"logprobs = min(top_k + {1 + VLLM_TIE_MARGIN}, max_logprobs) so every list ends with a filtered candidate, "
            f"even where vLLM 0.24 / 0.25 keep every token tied with the k-th; vLLM refuses a request above max_logprobs)")


_PATHS = ("mask", "logprobs")
#: vLLM's ``ModelConfig.max_logprobs`` default, the same from 0.24 to 0.33 (vllm/config/model.py).
VLLM_DEFAULT_MAX_LOGPROBS = 20
#: vLLM 0.33's defaults for the engine arguments checked (vllm/config/model.py).
_VLLM_DEFAULTS = {"logprobs_mode": "raw_logprobs", "return_sampling_mask": False, "max_logprobs": VLLM_DEFAULT_MAX_LOGPROBS}


def _filtered(lp: float) -> bool:
    return lp <= VLLM_FILTERED_LOGPROB  # -inf offline, -9999.0 in JSON


# ---------------------------------------------------------------------------------- prerequisites


def check_vllm_engine(config: Any, *, path: str, top_k: Optional[int] = None) -> None:
    """Refuse an engine configuration under which ``path`` cannot give exact supports.

    Args:
        config: ``llm.llm_engine.vllm_config`` (a ``VllmConfig``: ``.model_config`` and
            ``.use_v2_model_runner``), or a mapping of engine arguments (``logprobs_mode``,
            ``return_sampling_mask``, ``max_logprobs``, ``use_v2_model_runner``). A key left
            out of the mapping takes vLLM's default (``vllm/config/model.py``: raw log-probs,
            no sampling mask, 20 log-probs); ``use_v2_model_runner`` has none (it depends on
            ``VLLM_USE_V2_MODEL_RUNNER`` and the platform), so the mask path needs it stated.
        path: ``"mask"`` (sampling masks) or ``"logprobs"`` (processed log-probs).
        top_k: the requests' top_k; with ``path="logprobs"`` checks ``--max-logprobs``.

    Raises:
        ValueError naming each flag to set, all problems at once.
    """
    if path not in _PATHS:
        raise ValueError(f"check_vllm_engine: path={path!r}, expected one of {_PATHS}")
    if isinstance(config, Mapping):
        values, v2 = {**_VLLM_DEFAULTS, **config}, config.get("use_v2_model_runner")
    elif hasattr(config, "model_config") or all(hasattr(config, k) for k in _VLLM_DEFAULTS):
        model = getattr(config, "model_config", config)
        # A vLLM before sampling masks (0.30) has no return_sampling_mask: masks off, the log-prob path stands.
        missing = [k for k in _VLLM_DEFAULTS if k != "return_sampling_mask" and not hasattr(model, k)]
        if missing:
            raise ValueError(f"check_vllm_engine: the model config has no {missing}; pass llm.llm_engine.vllm_config")
        values = {k: getattr(model, k, _VLLM_DEFAULTS[k]) for k in _VLLM_DEFAULTS}
        mode = values["logprobs_mode"]
        values["logprobs_mode"] = getattr(mode, "value", mode)  # a Literal str in 0.33, an Enum in older releases
        v2 = getattr(config, "use_v2_model_runner", None)
    else:
        raise ValueError(
            f"check_vllm_engine: expected llm.llm_engine.vllm_config or a mapping of engine arguments, got "
            f"{type(config).__name__}"
        )
    errors = []
    if values["logprobs_mode"] != "processed_logprobs":
        errors.append(
            f"logprobs_mode={values['logprobs_mode']!r}: supports come from the processed distribution; start vLLM "
            f"with --logprobs-mode processed_logprobs (LLM(logprobs_mode='processed_logprobs'))"
        )
    if path == "mask":
        if not hasattr(getattr(config, "model_config", config), "return_sampling_mask") and not isinstance(config, Mapping):
            errors.append("this vLLM has no sampling masks (0.24 / 0.25 lack them; 0.30 and later have them): upgrade to "
                          "vLLM >= 0.30, or use the log-prob path")
        elif values["return_sampling_mask"] is not True:
            errors.append("return_sampling_mask is off: start vLLM with --return-sampling-mask (LLM(return_sampling_mask=True))")
        if v2 is None:
            errors.append(
                "Model Runner V2 cannot be confirmed: pass llm.llm_engine.vllm_config, or use_v2_model_runner in the "
                "mapping; sampling masks need VLLM_USE_V2_MODEL_RUNNER=1"
            )
        elif v2 is not True:
            errors.append("the V1 model runner is active: sampling masks need Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1")
    max_lp = values["max_logprobs"]
    if path == "logprobs" and top_k is not None and max_lp != -1 and max_lp < top_k + 1:
        errors.append(
            f"max_logprobs={max_lp}: requests need logprobs={top_k + 1} (top_k + 1, so a filtered entry closes "
            f"each list); start vLLM with --max-logprobs {top_k + 1}"
        )
    if errors:
        raise ValueError(f"vLLM engine cannot give exact supports ({path} path):\n  - " + "\n  - ".join(errors))


#: Every request field :func:`check_vllm_request` reads: two requests equal in these pass or fail it alike.
CHECKED_REQUEST_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                          "frequency_penalty", "logprobs", "top_logprobs")


def _requested_logprobs(params: Mapping[str, Any]) -> Any:
    """The request's log-prob count: ``logprobs`` (SamplingParams, completions, generate) or
    chat's ``top_logprobs`` (where ``logprobs`` is a bool)."""
    lp = params.get("logprobs")
    return params.get("top_logprobs") if isinstance(lp, bool) else lp


def check_vllm_request(sampling_params: Any, *, path: str) -> dict:
    """Refuse a request whose outputs cannot give exact supports; return capture settings.

    Args:
        sampling_params: ``SamplingParams`` or the request's JSON sampling fields
            (completions / chat bodies, or the generate endpoint's ``sampling_params``).
        path: ``"mask"`` or ``"logprobs"``.

    Raises:
        ValueError naming the field to set.
    """
    if path not in _PATHS:
        raise ValueError(f"check_vllm_request: path={path!r}, expected one of {_PATHS}")
    params = as_mapping(sampling_params)
    settings = capture_settings_from_engine(params, engine="vllm")
    top_k = settings["top_k"]
    where = f"vLLM request ({path} path)"
    if top_k is None:
        raise ValueError(
            f"{where}: top_k={params.get('top_k')!r} is unbounded; vLLM returns sampling masks only for top_k > 0 "
            f"(v1/engine/input_processor.py) and a log-prob list cannot show an unbounded support: set top_k > 1"
        )
    if path == "logprobs":
        n = _requested_logprobs(params)
        want = vllm_row_width(top_k) + 1
        if n == -1:
            raise ValueError(
                f"{where}: logprobs=-1 asks for the whole vocabulary at every position (V entries per token), and "
                f"the generate endpoint of vLLM 0.24 / 0.25 / 0.30 keeps one entry for it; request logprobs={want} "
                f"(vllm_row_width(top_k) + 1; chat: top_logprobs={want})"
            )
        if n is None or isinstance(n, bool) or not isinstance(n, int) or n < top_k + 1:
            raise ValueError(
                f"{where}: logprobs={n!r}; request logprobs={want} (vllm_row_width(top_k) + 1: top_k, a margin for "
                f"ties at the k-th value, and one filtered entry; chat: top_logprobs={want}) so each position's list "
                f"shows the whole support"
            )
    return settings


# ---------------------------------------------------------------------------------- log-probs


def _token(value: Any, where: str) -> int:
    if isinstance(value, str):
        if value.startswith("token_id:"):
            try:
                return strict_int(int(value[len("token_id:") :]), "token", where)
            except ValueError:
                pass
        raise ValueError(
            f"{where}: token {value!r} is not a token id; send the request with \"return_tokens_as_token_ids\": true "
            f"(or start the server with --return-tokens-as-token-ids) so tokens read 'token_id:<id>'"
        )
    return strict_int(value, "token id", where)


def _value(value: Any, where: str) -> float:
    """The log-prob of one offline entry: a ``Logprob``, a float, or ``{"logprob": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("logprob")
    elif hasattr(value, "logprob"):
        value = value.logprob
    return strict_logprob(value, "log-prob", where)


def _content_positions(content: Sequence[Any], where: str) -> tuple[list, list]:
    """Chat / generate ``logprobs.content`` -> (entries per position, sampled id per position)."""
    positions, sampled = [], []
    for j, c in enumerate(content):
        at = f"{where}, position {j}"
        if not isinstance(c, Mapping) or "logprob" not in c or ("token_id" not in c and "token" not in c):
            raise ValueError(f"{at}: expected a logprobs.content entry with 'token_id' (or 'token') and 'logprob', got {c!r:.120}")
        key = "token_id" if "token_id" in c else "token"
        tops = c.get("top_logprobs") or []
        positions.append([(_token(e.get(key), at), strict_logprob(e.get("logprob"), "log-prob", at)) for e in tops])
        sampled.append((_token(c[key], at), strict_logprob(c["logprob"], "sampled log-prob", at)))
    return positions, sampled


def _positions(logprobs: Any, where: str) -> tuple[list, Optional[list]]:
    """Any accepted form -> ([(token, logprob), ...] per position in engine order, and for the
    JSON forms the (token, logprob) each position reports as sampled)."""
    if hasattr(logprobs, "start_indices") and hasattr(logprobs, "end_indices"):  # FlatLogprobs
        ids, lps = logprobs.token_ids, logprobs.logprobs
        return [
            [(_token(ids[i], f"{where}, position {j}"), strict_logprob(lps[i], "log-prob", f"{where}, position {j}")) for i in range(s, e)]
            for j, (s, e) in enumerate(zip(logprobs.start_indices, logprobs.end_indices))
        ], None
    if isinstance(logprobs, Mapping) and "content" in logprobs:  # chat, generate
        return _content_positions(logprobs["content"] or [], where)
    if isinstance(logprobs, Mapping) and "top_logprobs" in logprobs and "tokens" in logprobs:  # completions
        tops, tokens, own = logprobs["top_logprobs"] or [], logprobs["tokens"] or [], logprobs.get("token_logprobs") or []
        if len(tops) != len(tokens) or len(own) != len(tokens):
            raise ValueError(f"{where}: completions logprobs hold {len(tokens)} tokens, {len(own)} token_logprobs, {len(tops)} top_logprobs")
        positions = [[(_token(t, f"{where}, position {j}"), _value(v, f"{where}, position {j}")) for t, v in (d or {}).items()] for j, d in enumerate(tops)]
        sampled = [(_token(t, f"{where}, position {j}"), _value(v, f"{where}, position {j}")) for j, (t, v) in enumerate(zip(tokens, own))]
        return positions, sampled
    if isinstance(logprobs, Sequence) and not isinstance(logprobs, (str, bytes)):
        if logprobs and isinstance(logprobs[0], Mapping) and "top_logprobs" in logprobs[0]:
            return _content_positions(logprobs, where)
        out = []
        for j, d in enumerate(logprobs):
            if not isinstance(d, Mapping):
                raise ValueError(f"{where}, position {j}: expected a mapping token id -> Logprob, got {type(d).__name__}")
            out.append([(_token(t, f"{where}, position {j}"), _value(v, f"{where}, position {j}")) for t, v in d.items()])
        return out, None
    raise ValueError(
        f"{where}: expected CompletionOutput.logprobs (list[dict[int, Logprob]] or FlatLogprobs), or a choice's "
        f"'logprobs' object from /v1/completions, /v1/chat/completions or /inference/v1/generate; got "
        f"{type(logprobs).__name__}"
    )


def _read_position(entries: list, token: int, own: Optional[float], vocab_size: Optional[int], at: str):
    """(row or None when not fully visible, sampled log-prob) of one position."""
    if not entries:
        raise ValueError(f"{at}: no log-prob entries; request logprobs=top_k + 1 (chat: top_logprobs=top_k + 1)")
    if entries[0][0] != token:
        raise ValueError(
            f"{at}: the first entry is token {entries[0][0]} but the response sampled {token}; vLLM lists the sampled "
            f"token first, so the log-probs and tokens are misaligned"
        )
    values: dict[int, float] = {}
    for t, lp in entries:
        if t in values and not (math.isclose(values[t], lp, abs_tol=1e-4) or (_filtered(values[t]) and _filtered(lp))):
            raise ValueError(f"{at}: token {t} is listed twice with log-probs {values[t]} and {lp}")
        values.setdefault(t, lp)
    lp = values[token] if own is None else own
    if _filtered(lp) or not math.isclose(lp, values[token], abs_tol=1e-4):
        raise ValueError(
            f"{at}: the sampled token {token} has log-prob {lp} (listed {values[token]}): it was not drawn from these "
            f"log-probs; start vLLM with --logprobs-mode processed_logprobs"
        )
    members = sorted(t for t, v in values.items() if not _filtered(v))
    whole = len(members) < len(values) or (vocab_size is not None and len(values) >= vocab_size)
    return (members if whole else None), lp


def support_from_vllm_logprobs(
    logprobs: Any,
    sampled_ids: Optional[Sequence[int] | torch.Tensor] = None,
    *,
    width: Optional[int] = None,
    vocab_size: Optional[int] = None,
    sampling_params: Any = None,
) -> EngineSupport:
    """Support rows from vLLM processed log-probs, any output path (module doc).

    Args:
        logprobs: ``CompletionOutput.logprobs`` (``list[dict[int, Logprob]]`` or
            ``FlatLogprobs``), or a choice's ``logprobs`` object from ``/v1/completions``,
            ``/v1/chat/completions`` or ``/inference/v1/generate``.
        sampled_ids: (n,) int, the generated tokens (``CompletionOutput.token_ids``,
            ``choices[i].token_ids``). Optional for the JSON forms, which name each token;
            checked against them when given.
        width: fixed row width (e.g. the request's top_k) or None for ragged rows.
        vocab_size: ids must be below it when given.
        sampling_params: the request's sampling parameters; checked with
            :func:`check_vllm_request` when given (recommended).

    Returns:
        :class:`~nemo_replay.rollout.engines.base.EngineSupport`: one row per token, ids
        ascending (as the sampling mask gives them), the sampled tokens' processed log-probs, and the
        positions flagged ``not_fully_visible`` / ``wider_than_row`` with empty rows.
    """
    where = "vLLM processed-logprobs adapter"
    if sampling_params is not None:
        check_vllm_request(sampling_params, path="logprobs")
    flat = flat_entries(logprobs)
    fast = None
    if flat is not None and (sampled_ids is not None or flat[3] is not None):
        tokens, values, counts, reported, own = flat
        sampled = torch.from_numpy(reported) if sampled_ids is None else sampled_tensor(sampled_ids, counts.size, where)
        if reported is None or np.array_equal(reported, sampled.numpy()):
            fast = read_flat(tokens, values, counts, sampled.numpy(), own, vocab_size)
        if fast is not None:
            members, lengths, flagged, lps = fast
            reasons = {"not_fully_visible": int(flagged.sum())} if flagged.any() else {}
            if flagged.size and flagged.all():
                where += _RAW_HINT
            return assemble_flat(torch.from_numpy(members), torch.from_numpy(lengths), torch.from_numpy(flagged), sampled,
                                 width=width, logprobs=torch.from_numpy(lps).to(torch.float32), reasons=reasons,
                                 vocab_size=vocab_size, where=where)
    positions, reported = _positions(logprobs, where)  # any form, entry by entry: names what breaks a rule
    n = len(positions)
    if sampled_ids is None:
        if reported is None:
            raise ValueError(f"{where}: pass sampled_ids (CompletionOutput.token_ids); offline log-probs do not name the sampled tokens")
        sampled = torch.tensor([t for t, _ in reported], dtype=torch.int64)
    else:
        sampled = sampled_tensor(sampled_ids, n, where)
        if reported is not None and [t for t, _ in reported] != sampled.tolist():
            j = next(j for j, (t, _) in enumerate(reported) if t != int(sampled[j]))
            raise ValueError(f"{where}, position {j}: the log-probs name token {reported[j][0]}, the response {int(sampled[j])}")
    rows, lps, reasons = [], torch.empty(n, dtype=torch.float32), {}
    for j in range(n):
        own = reported[j][1] if reported is not None else None
        row, lps[j] = _read_position(positions[j], int(sampled[j]), own, vocab_size, f"{where}, position {j}")
        rows.append(row)
        if row is None:
            reasons["not_fully_visible"] = reasons.get("not_fully_visible", 0) + 1
    if n and reasons.get("not_fully_visible") == n:
        where += _RAW_HINT
    return assemble(rows, sampled, width=width, logprobs=lps, reasons=reasons, vocab_size=vocab_size, where=where)


# ---------------------------------------------------------------------------------- masks


def _mask_rows(mask: Any, where: str) -> list[list[int]]:
    """``SamplingMask.token_ids`` or the HTTP lists, as lists of strict ints."""
    rows = getattr(mask, "token_ids", mask)
    if hasattr(mask, "offsets") or (isinstance(rows, list) and rows and not isinstance(rows[0], (list, tuple))):
        raise ValueError(
            f"{where}: got a flat id array; SamplingMaskLists (token_ids + offsets) is internal to vLLM -- pass "
            f"CompletionOutput.sampling_mask (SamplingMask, token_ids: list[list[int]]) or the HTTP "
            f"choices[i].sampling_mask lists"
        )
    if not isinstance(rows, (list, tuple)):
        raise ValueError(
            f"{where}: expected CompletionOutput.sampling_mask (SamplingMask) or a list of id lists, got "
            f"{type(mask).__name__}; is vLLM started with --return-sampling-mask?"
        )
    return id_rows(rows, where)


def support_from_vllm_sampling_mask(
    mask: Any,
    sampled_ids: Sequence[int] | torch.Tensor,
    *,
    logprobs: Optional[torch.Tensor] = None,
    width: Optional[int] = None,
    vocab_size: Optional[int] = None,
    sampling_params: Any = None,
) -> EngineSupport:
    """Support rows from vLLM's sampling mask (module doc).

    Args:
        mask: ``CompletionOutput.sampling_mask`` (``SamplingMask(token_ids=[[...], ...])``)
            or ``choices[i].sampling_mask`` of ``/inference/v1/generate`` (``[[...], ...]``).
        sampled_ids: (n,) int, the generated tokens; each must be in its row.
        logprobs: (n,) float32 sampled log-probs to carry along, or None.
        width: fixed row width or None for ragged rows (ids ascending, as vLLM gives them).
        vocab_size: ids must be below it when given.
        sampling_params: the request's sampling parameters, checked when given.
    """
    where = "vLLM sampling-mask adapter"
    if sampling_params is not None:
        check_vllm_request(sampling_params, path="mask")
    rows = _mask_rows(mask, where)
    sampled = sampled_tensor(sampled_ids, len(rows), where)
    return assemble(rows, sampled, width=width, logprobs=logprobs, reasons={}, vocab_size=vocab_size, where=where)


def _own_logprobs(positions: list, sampled: torch.Tensor, reported: Optional[list], where: str) -> torch.Tensor:
    """(n,) float32: each sampled token's log-prob from a log-prob output (first entry)."""
    out = torch.empty(len(positions), dtype=torch.float32)
    for j, entries in enumerate(positions):
        at = f"{where}, position {j}"
        if reported is not None:
            token, lp = reported[j]
        elif entries:
            token, lp = entries[0]
        else:
            raise ValueError(f"{at}: no log-prob entry for the sampled token")
        if token != int(sampled[j]) or _filtered(lp):
            raise ValueError(f"{at}: the log-probs give token {token} log-prob {lp}; the response sampled {int(sampled[j])}")
        out[j] = lp
    return out


def support_from_vllm_output(
    output: Any,
    *,
    width: Optional[int] = None,
    vocab_size: Optional[int] = None,
    sampling_params: Any = None,
) -> EngineSupport:
    """Support rows from one offline ``CompletionOutput`` (``LLM.generate(...)[i].outputs[j]``).

    Uses its ``sampling_mask`` when present (exact rows; the sampled log-probs from its
    ``logprobs`` when requested), else its processed ``logprobs``
    (:func:`support_from_vllm_logprobs`).
    """
    where = "vLLM CompletionOutput adapter"
    token_ids = getattr(output, "token_ids", None)
    if token_ids is None:
        raise ValueError(f"{where}: expected a vllm CompletionOutput (token_ids, logprobs, sampling_mask), got {type(output).__name__}")
    return _mask_or_logprobs(
        list(token_ids), getattr(output, "sampling_mask", None), getattr(output, "logprobs", None), where,
        missing="the output has neither sampling_mask nor logprobs; start vLLM with --return-sampling-mask, or request "
        "SamplingParams(logprobs=top_k + 1) with --logprobs-mode processed_logprobs",
        width=width, vocab_size=vocab_size, sampling_params=sampling_params,
    )


def support_from_vllm_generate(
    choice: Mapping[str, Any],
    *,
    width: Optional[int] = None,
    vocab_size: Optional[int] = None,
    sampling_params: Any = None,
) -> EngineSupport:
    """Support rows from one choice of a ``POST /inference/v1/generate`` response (output_mode "tokens").

    Uses ``choice["sampling_mask"]`` when present, with the sampled log-probs of
    ``choice["logprobs"]["content"]`` when the request asked for log-probs; else the
    processed log-probs of ``choice["logprobs"]``.
    """
    where = "vLLM /inference/v1/generate adapter"
    if not isinstance(choice, Mapping) or not isinstance(choice.get("token_ids"), list):
        raise ValueError(
            f"{where}: expected one element of the response's 'choices' with 'token_ids' (output_mode \"tokens\"), "
            f"got {type(choice).__name__}"
        )
    return _mask_or_logprobs(
        choice["token_ids"], choice.get("sampling_mask"), choice.get("logprobs"), where,
        missing="the choice has neither 'sampling_mask' nor 'logprobs'; start vLLM with --return-sampling-mask, or send "
        "\"sampling_params\": {\"logprobs\": top_k + 1} to a server with --logprobs-mode processed_logprobs",
        width=width, vocab_size=vocab_size, sampling_params=sampling_params,
    )


def _mask_or_logprobs(token_ids: list, mask, lp, where: str, *, missing: str, **options) -> EngineSupport:
    """The exact rows of a sampling mask (with the sampled log-probs when ``lp`` came too), else
    the processed log-probs; ``missing`` says what to turn on when neither came."""
    if mask is not None:
        logprobs = None
        if lp is not None:
            positions, reported = _positions(lp, where)
            logprobs = _own_logprobs(positions, sampled_tensor(token_ids, len(positions), where), reported, where)
        return support_from_vllm_sampling_mask(mask, token_ids, logprobs=logprobs, **options)
    if lp is None:
        raise ValueError(f"{where}: {missing}")
    return support_from_vllm_logprobs(lp, token_ids, **options)


assert set(FLAG_REASONS) >= {"not_fully_visible", "wider_than_row"}
