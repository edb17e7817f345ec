"""Engine outputs -> support rows for one response (docs/design.md §2, §7).

Three sources, each turned into the package's support forms and checked at the boundary
(:func:`~nemo_replay.rollout.boundary.validate_support`):

1. **vLLM processed top-k log-probs** -> fixed-width rows (:func:`support_from_vllm_logprobs`).
   Needs the vLLM V1 engine started with ``--logprobs-mode processed_logprobs`` (the
   ``logprobs_mode`` engine argument, 0.10 series onward) and ``--max-logprobs >= top_k``,
   and requests with ``SamplingParams(top_k=k, logprobs=k, temperature=T > 0)`` and no
   penalties. Processed log-probs are taken after temperature, min-p, top-k and top-p, so a
   filtered candidate shows as ``-inf`` -- and as ``-9999.0`` in the OpenAI-compatible
   server's JSON, which clamps ``-inf`` there; both count as "not a member". The engine adds
   the sampled token's entry when it is not among the ``k``, so a position holds ``k`` or
   ``k + 1`` entries.
   Accepted per-position forms: the offline ``CompletionOutput.logprobs`` entries (a mapping
   ``token_id -> Logprob`` with ``.logprob`` and ``.rank``), the same with plain floats or
   ``{"logprob", "rank"}`` dicts, the completions JSON ``top_logprobs`` mapping and the chat
   JSON ``logprobs.content`` entries (both need ``"return_tokens_as_token_ids": true`` so
   tokens read ``"token_id:<id>"``).
   Repair: vLLM's approximate top-k/top-p pivot can drop the sampled token from the kept
   set. Such a row gets the sampled token in place of its weakest member (width and
   padding unchanged); repairs are counted in the result and logged.
2. **vLLM sampling mask** -> CSR rows (:func:`support_from_vllm_sampling_mask`). Needs a vLLM
   with ``--return-sampling-mask`` (Model Runner V2; vllm-project/vllm#49577). Offline the
   mask is ``SamplingMask(token_ids, offsets)`` (CSR over the generated tokens); the HTTP
   form is one id list per generated token. The engine compacts ids in ascending id order,
   not by rank, and the rows keep that order (the scorer does not depend on it).
3. **SGLang sampling mask** -> CSR rows (:func:`support_from_sglang_meta_info`). Needs an
   SGLang ``/generate`` request with ``"return_sampling_mask": true`` (sgl-project/sglang#27408;
   top-p-only masks from #33593). ``meta_info["output_token_sampling_mask"]`` holds one id list
   per output token and ``meta_info["output_token_sampling_logprobs"]`` the log-probs
   renormalised over those sets.

Masks are the exact support the engine sampled from: a sampled token outside its mask is
an error, not repaired.
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from nemo_replay.rollout.boundary import validate_support
from nemo_replay.rollout.capture import check_capture_settings
from nemo_replay.support.packed import PackedTensor, lengths_to_cu_seqlens
from nemo_replay.support.ragged import RaggedSupport

__all__ = [
    "EngineSupport",
    "capture_settings_from_engine",
    "support_from_vllm_logprobs",
    "support_from_vllm_sampling_mask",
    "support_from_sglang_meta_info",
    "VLLM_FILTERED_LOGPROB",
]

logger = logging.getLogger(__name__)

#: The OpenAI-compatible vLLM server writes ``-inf`` log-probs as this value.
VLLM_FILTERED_LOGPROB = -9999.0

_ENGINES = ("vllm", "sglang")


@dataclass
class EngineSupport:
    """The support of one response, as an adapter returns it.

    Attributes:
        support: ``PackedTensor`` (values (n, k) int32, cu_seqlens [0, n]) or a
            ``RaggedSupport`` of one segment with n rows.
        logprobs: (n,), float32 processed log-probs of the sampled tokens, or None when the
            engine output does not carry them.
        repaired: (n,), bool: rows whose sampled token the engine had dropped and that got it
            back in place of their weakest member. The engine's log-prob of such a token
            is unreliable (it may be ``-inf``); leave these positions out of diagnostics.
    """

    support: Union[PackedTensor, RaggedSupport]
    logprobs: Optional[torch.Tensor]
    repaired: torch.Tensor

    @property
    def num_repairs(self) -> int:
        return int(self.repaired.sum())


def capture_settings_from_engine(params: Mapping[str, Any], *, engine: str) -> dict:
    """Translate an engine's sampling parameters and refuse those capture cannot replay.

    Args:
        params: the request's sampling parameters as sent to the engine (vLLM
            ``SamplingParams`` fields or SGLang ``sampling_params`` keys). ``temperature``
            must be present: engines fill a missing one from the model's generation config,
            which the trainer cannot see.
        engine: ``"vllm"`` or ``"sglang"``; both spell "no top-k bound" as ``0``/``-1`` (SGLang
            also as ``1 << 30``).

    Returns:
        keyword arguments for :func:`~nemo_replay.rollout.capture.check_capture_settings`
        (``top_k=None`` when unbounded).
    """
    if engine not in _ENGINES:
        raise ValueError(f"engine={engine!r}: expected one of {', '.join(_ENGINES)}")
    params = _as_mapping(params)
    top_k = params.get("top_k")
    if top_k is not None and not isinstance(top_k, bool) and isinstance(top_k, int):
        if top_k in (0, -1) or (engine == "sglang" and top_k >= 1 << 30):
            top_k = None
    settings = dict(
        temperature=params.get("temperature"),
        top_k=top_k,
        top_p=1.0 if params.get("top_p") is None else params["top_p"],
        min_p=0.0 if params.get("min_p") is None else params["min_p"],
        repetition_penalty=params.get("repetition_penalty"),
        presence_penalty=params.get("presence_penalty"),
        frequency_penalty=params.get("frequency_penalty"),
    )
    check_capture_settings(**settings, where=f"{engine} sampling params")
    return settings


def _as_mapping(params: Any) -> Mapping[str, Any]:
    """A ``SamplingParams``-like object's public attributes, or the mapping itself."""
    if isinstance(params, Mapping):
        return params
    return {k: getattr(params, k) for k in dir(params) if not k.startswith("_")}


# ---------------------------------------------------------------------------------- vLLM top-k


def _parse_token(key: Any, where: str) -> int:
    if isinstance(key, bool):
        raise ValueError(f"{where}: token key {key!r} is not a token id")
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key.startswith("token_id:"):
        try:
            return int(key[len("token_id:") :])
        except ValueError:
            pass
    raise ValueError(
        f"{where}: token {key!r} is not a token id; request log-probs with "
        f"\"return_tokens_as_token_ids\": true so tokens read 'token_id:<id>'"
    )


def _parse_value(value: Any, where: str) -> tuple[float, float]:
    """(logprob, rank) of one entry; rank is +inf when the engine gave none."""
    if isinstance(value, Mapping):
        lp, rank = value.get("logprob"), value.get("rank")
    elif hasattr(value, "logprob"):
        lp, rank = value.logprob, getattr(value, "rank", None)
    else:
        lp, rank = value, None
    if isinstance(lp, bool) or not isinstance(lp, numbers.Real) or math.isnan(lp):
        raise ValueError(f"{where}: log-prob {lp!r} is not a number")
    return float(lp), float(rank) if rank is not None else math.inf


def _position_entries(entry: Any, where: str) -> list[tuple[int, float, float]]:
    """[(token_id, logprob, rank)] of one position, any accepted form (module doc)."""
    if isinstance(entry, Mapping) and "top_logprobs" in entry:
        # Chat completions: {"token", "logprob", "top_logprobs": [{"token", "logprob"}, ...]}.
        items = [(e["token"], e["logprob"]) for e in entry["top_logprobs"] or ()]
        if "token" in entry and "logprob" in entry:
            items.append((entry["token"], entry["logprob"]))
    elif isinstance(entry, Mapping):
        items = list(entry.items())
    else:
        raise ValueError(
            f"{where}: expected a mapping token -> log-prob (or a chat 'logprobs.content' entry), got "
            f"{type(entry).__name__}"
        )
    out: dict[int, tuple[int, float, float]] = {}
    for key, value in items:
        tok = _parse_token(key, where)
        lp, rank = _parse_value(value, where)
        out[tok] = (tok, lp, rank)  # the sampled token may repeat a top-k entry: same values
    return list(out.values())


def support_from_vllm_logprobs(
    position_logprobs: Sequence[Any],
    sampled_ids: Sequence[int] | torch.Tensor,
    *,
    top_k: int,
    vocab_size: Optional[int] = None,
    sampling_params: Optional[Mapping[str, Any]] = None,
) -> EngineSupport:
    """Fixed-width rows from vLLM processed top-k log-probs (engine flags: module doc).

    Args:
        position_logprobs: one entry per generated token (``CompletionOutput.logprobs``,
            completions ``logprobs.top_logprobs`` or chat ``logprobs.content``).
        sampled_ids: (n,) the generated token ids (``CompletionOutput.token_ids``).
        top_k: the request's ``top_k`` (= its ``logprobs``); the row width.
        vocab_size: ids must be below it when given.
        sampling_params: the request's sampling parameters; checked with
            :func:`capture_settings_from_engine` when given (recommended).

    Returns:
        :class:`EngineSupport` with a one-segment ``PackedTensor`` of ``int32 [n, top_k]``
        rows (members by rank: log-prob descending, then engine rank, then id), the sampled
        tokens' processed log-probs and the repaired rows.
    """
    where = "vLLM processed-logprobs adapter"
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 1:
        raise ValueError(f"{where}: top_k={top_k!r}; fixed-width rows need the request's top_k, an int > 1")
    if sampling_params is not None:
        sampling_params = _as_mapping(sampling_params)
        settings = capture_settings_from_engine(sampling_params, engine="vllm")
        if settings["top_k"] != top_k:
            raise ValueError(
                f"{where}: top_k={top_k} but the request sampled with top_k={settings['top_k']}; the rows "
                f"must be the sampler's top-k set, so pass the request's top_k"
            )
        n_lp = sampling_params.get("logprobs")
        if n_lp is not None and n_lp < top_k:
            raise ValueError(f"{where}: logprobs={n_lp} < top_k={top_k}; request logprobs=top_k")
    sampled = [int(t) for t in torch.as_tensor(sampled_ids).tolist()]
    if len(position_logprobs) != len(sampled):
        raise ValueError(
            f"{where}: {len(position_logprobs)} log-prob entries for {len(sampled)} generated tokens; the "
            f"engine must return one entry per generated token (SamplingParams.logprobs set)"
        )
    n = len(sampled)
    values = torch.full((n, top_k), -1, dtype=torch.int32)
    sampled_lp = torch.empty(n, dtype=torch.float32)
    repaired: list[int] = []
    for j, (entry, tok) in enumerate(zip(position_logprobs, sampled)):
        at = f"{where}, position {j}"
        entries = _position_entries(entry, at)
        own = [lp for t, lp, _ in entries if t == tok]
        if not own:
            raise ValueError(f"{at}: no log-prob entry for the sampled token {tok}; the engine always adds it")
        # A sampled token the pivot dropped may show as filtered (-inf): the row is repaired
        # below and the engine's value is passed on; `repaired` marks such positions.
        sampled_lp[j] = own[0] if own[0] > VLLM_FILTERED_LOGPROB else -math.inf
        members = [e for e in entries if math.isfinite(e[1]) and e[1] > VLLM_FILTERED_LOGPROB]
        members.sort(key=lambda e: (-e[1], e[2], e[0]))
        row = [t for t, _, _ in members[:top_k]]
        if tok not in row:
            # Put the sampled token in place of the weakest member: width and padding stay.
            row[-1:] = [tok]
            repaired.append(j)
        values[j, : len(row)] = torch.tensor(row, dtype=torch.int32)
    if repaired:
        logger.warning(
            "%s: repaired %d of %d rows whose sampled token the engine's top-k/top-p pivot had dropped "
            "(positions %s%s)",
            where,
            len(repaired),
            n,
            repaired[:8],
            " ..." if len(repaired) > 8 else "",
        )
    support = PackedTensor(values, [0, n])
    validate_support(support, sampled_ids=torch.tensor(sampled, dtype=torch.int64), vocab_size=vocab_size, where=where)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[repaired] = True
    return EngineSupport(support, sampled_lp, mask)


# ---------------------------------------------------------------------------------- masks


def _ragged_from_lists(rows: Iterable[Sequence[int]], where: str) -> RaggedSupport:
    rows = [list(r) for r in rows]
    for j, r in enumerate(rows):
        if any(isinstance(t, bool) or not isinstance(t, int) for t in r):
            raise ValueError(f"{where}: row {j} holds a non-integer id: {r[:16]}")
    members = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
    offsets = lengths_to_cu_seqlens([len(r) for r in rows]).to(torch.int64)
    return _ragged(members, offsets, where)


def _ragged(members: torch.Tensor, offsets: torch.Tensor, where: str) -> RaggedSupport:
    if members.numel() and (members.min() < 0 or members.max() > torch.iinfo(torch.int32).max):
        bad = int(members[(members < 0) | (members > torch.iinfo(torch.int32).max)][0])
        raise ValueError(f"{where}: mask holds token id {bad}, outside [0, 2**31)")
    return RaggedSupport(members.to(torch.int32), offsets, torch.tensor([0, offsets.numel() - 1], dtype=torch.int32))


def _finish_mask(
    support: RaggedSupport,
    sampled_ids: Optional[Sequence[int] | torch.Tensor],
    vocab_size: Optional[int],
    where: str,
) -> None:
    if sampled_ids is None:
        validate_support(support, vocab_size=vocab_size, where=where)
        return
    sampled = torch.as_tensor(sampled_ids, dtype=torch.int64)
    if sampled.shape != (support.num_rows,):
        raise ValueError(
            f"{where}: the mask has {support.num_rows} rows for {sampled.numel()} generated tokens; the "
            f"engine returns one row per generated token"
        )
    validate_support(support, sampled_ids=sampled, vocab_size=vocab_size, where=where)


def support_from_vllm_sampling_mask(
    mask: Any,
    sampled_ids: Optional[Sequence[int] | torch.Tensor] = None,
    *,
    vocab_size: Optional[int] = None,
    sampling_params: Optional[Mapping[str, Any]] = None,
) -> EngineSupport:
    """CSR rows from vLLM's sampling mask (engine flags: module doc).

    Args:
        mask: ``SamplingMask`` (``.token_ids``, ``.offsets``), a ``{"token_ids", "offsets"}``
            mapping, or the HTTP form ``[[ids of token 0], [ids of token 1], ...]``.
            ``offsets``: (n + 1,) starting at 0 and ending at ``len(token_ids)``.
        sampled_ids: (n,) generated token ids; each must be in its row when given.
        vocab_size: ids must be below it when given.
        sampling_params: the request's sampling parameters, checked when given.

    Returns:
        :class:`EngineSupport` with a one-segment ``RaggedSupport`` of n rows (no log-probs).
    """
    where = "vLLM sampling-mask adapter"
    if sampling_params is not None:
        capture_settings_from_engine(sampling_params, engine="vllm")
    if isinstance(mask, Mapping) or hasattr(mask, "token_ids"):
        get = mask.get if isinstance(mask, Mapping) else lambda k: getattr(mask, k, None)
        token_ids, offsets = get("token_ids"), get("offsets")
        if token_ids is None or offsets is None:
            raise ValueError(f"{where}: a CSR mask needs both 'token_ids' and 'offsets'")
        members = torch.as_tensor(token_ids, dtype=torch.int64).flatten()
        offsets = torch.as_tensor(offsets, dtype=torch.int64).flatten()
        if offsets.numel() == 0:
            raise ValueError(f"{where}: offsets must hold n + 1 entries (at least [0]), got none")
        support = _ragged(members, offsets, where)
    elif isinstance(mask, Sequence) and not isinstance(mask, (str, bytes)):
        support = _ragged_from_lists(mask, where)
    else:
        raise ValueError(
            f"{where}: expected a SamplingMask, a {{'token_ids', 'offsets'}} mapping or a list of id lists, "
            f"got {type(mask).__name__}; is the engine started with --return-sampling-mask?"
        )
    _finish_mask(support, sampled_ids, vocab_size, where)
    return EngineSupport(support, None, torch.zeros(support.num_rows, dtype=torch.bool))


def support_from_sglang_meta_info(
    meta_info: Mapping[str, Any],
    sampled_ids: Optional[Sequence[int] | torch.Tensor] = None,
    *,
    vocab_size: Optional[int] = None,
    sampling_params: Optional[Mapping[str, Any]] = None,
) -> EngineSupport:
    """CSR rows from SGLang's sampling mask in a ``/generate`` response's ``meta_info``.

    Args:
        meta_info: the response's ``meta_info`` with ``output_token_sampling_mask`` (one id
            list per output token) and optionally ``output_token_sampling_logprobs`` (one
            float per output token, or ``[logprob, token_id, ...]`` tuples).
        sampled_ids: (n,) the response's ``output_ids``; each must be in its row when given.
        vocab_size: ids must be below it when given.
        sampling_params: the request's ``sampling_params``, checked when given.

    Returns:
        :class:`EngineSupport` with a one-segment ``RaggedSupport`` of n rows and the
        renormalised log-probs when present.
    """
    where = "SGLang sampling-mask adapter"
    if sampling_params is not None:
        capture_settings_from_engine(sampling_params, engine="sglang")
    if not isinstance(meta_info, Mapping) or meta_info.get("output_token_sampling_mask") is None:
        raise ValueError(
            f"{where}: meta_info has no 'output_token_sampling_mask'; send the request with "
            f"\"return_sampling_mask\": true"
        )
    rows = meta_info["output_token_sampling_mask"]
    support = _ragged_from_lists(rows, where)
    logprobs = None
    raw_lp = meta_info.get("output_token_sampling_logprobs")
    if raw_lp is not None:
        if len(raw_lp) != support.num_rows:
            raise ValueError(
                f"{where}: {len(raw_lp)} sampling log-probs for {support.num_rows} mask rows; expected one each"
            )
        vals = [v[0] if isinstance(v, (list, tuple)) else v for v in raw_lp]
        logprobs = torch.tensor([float(v) for v in vals], dtype=torch.float32)
    _finish_mask(support, sampled_ids, vocab_size, where)
    return EngineSupport(support, logprobs, torch.zeros(support.num_rows, dtype=torch.bool))
