"""What every engine adapter returns, and the checks they share (docs/design.md §2, §7).

Adapters live one module per engine -- :mod:`nemo_replay.rollout.engines.vllm` and
:mod:`nemo_replay.rollout.engines.sglang`; ``docs/engines.md`` shows one worked example per engine
output path. Each turns what the engine returns for one response (``n`` generated tokens)
into an :class:`EngineSupport`: one support row per token, checked at the boundary by
:func:`~nemo_replay.rollout.boundary.validate_support` (every non-empty row holds its
sampled token, no duplicate ids, ids below ``vocab_size`` when given).

Flagged positions. A row holds the engine's whole support or nothing: an adapter never cuts
a support to a width, never guesses a missing member and never swaps a token in. Where the
support cannot be recorded exactly, the row is left empty, the position is *flagged* and
counted by reason (:data:`FLAG_REASONS`), and a warning names the positions. An empty row
means "no support recorded" (docs/design.md §2): leave flagged positions out of the loss
(``loss_mask &= result.loss_mask``; ``SupportTrace.add_turn(ids, result)`` does it for a
multi-turn trace). Left in, one would be scored over the full vocabulary like a synthetic
EOS, and the scorer refuses a trajectory with more than one loss-active position that
lacks a row.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from nemo_replay.rollout.boundary import validate_support
from nemo_replay.rollout.capture.sampler import check_capture_settings
from nemo_replay.support.dtypes import first_outside, is_integer
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.packed import lengths_to_cu_seqlens
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["EngineSupport", "FLAG_REASONS", "capture_settings_from_engine"]

logger = logging.getLogger(__name__)

#: Why a position can be flagged (its row left empty).
FLAG_REASONS = {
    "not_fully_visible": (
        "every log-prob entry the engine showed is a member, so members past the end of its list are "
        "unknown; request at least top_k + 1 log-probs so a filtered entry closes each list"
    ),
    "wider_than_row": (
        "the support holds more tokens than the fixed row width (ties at the top-k cutoff); take ragged rows "
        "(ragged=True) to carry it whole"
    ),
}

_ENGINES = ("vllm", "sglang")
_INT32_MAX = torch.iinfo(torch.int32).max


@dataclass
class EngineSupport:
    """The support of one response, as an adapter returns it.

    Attributes:
        support: ``RaggedSupport`` with n rows (one segment), each row its members; with a
            row width its ``width_bound`` is that width (``to_padded()`` gives the
            ``(n, width)`` int32 rows, ``-1`` padded). Flagged positions have empty rows.
        logprobs: (n,), float32: the engine's processed log-prob of each sampled token
            (over the support it sampled from), or None when the output carries none.
        flagged: (n,), bool: positions whose support could not be recorded exactly.
        reasons: how many positions were flagged for each reason of :data:`FLAG_REASONS`.
    """

    support: RaggedSupport
    logprobs: Optional[torch.Tensor]
    flagged: torch.Tensor
    reasons: dict = field(default_factory=dict)

    @property
    def num_flagged(self) -> int:
        return int(self.flagged.sum())

    @property
    def loss_mask(self) -> torch.Tensor:
        """(n,), bool: True where the row is the engine's whole support (not flagged)."""
        return ~self.flagged


def as_mapping(params: Any) -> Mapping[str, Any]:
    """A ``SamplingParams``-like object's public attributes, or the mapping itself."""
    if isinstance(params, Mapping):
        return params
    return {k: getattr(params, k) for k in dir(params) if not k.startswith("_")}


def strict_int(value: Any, what: str, where: str) -> int:
    """``value`` as an int; a bool, a float (even 3.0) or a string is an error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{where}: {what} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def strict_logprob(value: Any, what: str, where: str) -> float:
    """``value`` as a float log-prob: a real number <= 0 (up to rounding), not NaN; ``-inf`` allowed."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or value > 1e-5:
        raise ValueError(f"{where}: {what} must be a log-prob (a number <= 0, not NaN), got {value!r}")
    return float(value)


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
    params = as_mapping(params)
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


def id_rows(rows: Sequence[Any], where: str) -> list[list[int]]:
    """An engine's sampling mask, one id list per generated token, as lists of strict ints."""
    if set(map(type, rows)) <= {list} and all(rows) and set(map(type, itertools.chain.from_iterable(rows))) <= {int}:
        return rows  # every row a non-empty list of ints: nothing to name (checked at C speed)
    out = []
    for j, r in enumerate(rows):
        if not isinstance(r, (list, tuple)):
            raise ValueError(f"{where}, position {j}: a mask row must be a list of token ids, got {type(r).__name__}")
        if not r:
            # Taken as it came, an empty row would read as the synthetic EOS at a response's last
            # token (scored over the whole vocabulary) or fail far from the engine.
            raise SupportAlignmentError(
                f"{where}, generated token {j} of {len(rows)}: an empty sampling-mask row; a mask row always holds "
                f"the token sampled from it, so this output is corrupted -- resample the request, and report the "
                f"engine's version and request if it repeats"
            )
        out.append([strict_int(t, "mask token id", f"{where}, position {j}") for t in r])
    return out


def sampled_tensor(sampled_ids: Any, n: int, where: str) -> torch.Tensor:
    """(n,) int64 sampled ids from a list of ints or an integer tensor; no coercion."""
    if isinstance(sampled_ids, torch.Tensor):
        if not is_integer(sampled_ids) or sampled_ids.dim() != 1:
            raise ValueError(f"{where}: sampled ids must be a 1-D integer tensor, got {sampled_ids.dtype} {tuple(sampled_ids.shape)}")
        ids = sampled_ids.to(torch.int64).cpu()
    else:
        if not isinstance(sampled_ids, Sequence) or isinstance(sampled_ids, (str, bytes)):
            raise ValueError(f"{where}: sampled ids must be a list of ints, got {type(sampled_ids).__name__}")
        if set(map(type, sampled_ids)) <= {int} and (not sampled_ids or max(map(abs, (min(sampled_ids), max(sampled_ids)))) < 2**62):
            ids = torch.tensor(list(sampled_ids), dtype=torch.int64)  # plain ints: nothing to name (checked at C speed)
        else:
            ids = torch.tensor([strict_int(t, f"generated token {j}", where) for j, t in enumerate(sampled_ids)],
                               dtype=torch.int64)
    if ids.numel() != n:
        raise ValueError(
            f"{where}: {n} support entries for {ids.numel()} generated tokens; the engine returns one per "
            f"generated token -- pass this response's own token ids"
        )
    return ids


def _id_out_of_range(where: str, bad: int) -> ValueError:
    return ValueError(f"{where}: support holds token id {bad}, outside [0, 2**31); an engine's token ids are int32 -- "
                      f"pass the engine's own output for this response")


def assemble(rows: Sequence[Optional[Sequence[int]]], sampled: torch.Tensor, **options) -> EngineSupport:
    """Rows -> a checked :class:`EngineSupport`: ``rows`` are n member lists, ``None`` for a position
    flagged upstream; they are flattened and handed to :func:`assemble_flat` with its keywords ``options``."""
    flagged = torch.tensor([r is None for r in rows], dtype=torch.bool)
    kept = [list(r) if r is not None else [] for r in rows]
    flat = [t for r in kept for t in r]
    if any(t < 0 or t > _INT32_MAX for t in flat):  # as Python ints: 2**64 never reaches torch's conversion
        bad = next(t for t in flat if t < 0 or t > _INT32_MAX)
        raise _id_out_of_range(options["where"], bad)
    flat = torch.tensor(flat, dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in kept], dtype=torch.int64)
    return assemble_flat(flat, lengths, flagged, sampled, **options)


def assemble_flat(
    members: torch.Tensor,
    lengths: torch.Tensor,
    flagged: torch.Tensor,
    sampled: torch.Tensor,
    *,
    width: Optional[int],
    logprobs: Optional[torch.Tensor],
    reasons: dict,
    vocab_size: Optional[int],
    where: str,
) -> EngineSupport:
    """Rows as arrays -> a checked :class:`EngineSupport`; no Python loop over rows.

    Args:
        members: (M,) int64, the rows' ids back to back.
        lengths: (n,) their sizes (0 where ``flagged``).
        flagged: (n,) bool, positions flagged upstream.
        sampled: (n,) int64 generated tokens.
        width: the row width a consumer pads to (``to_padded()``: the rows stay CSR,
            with this ``width_bound``), or None. A row wider than ``width`` is flagged
            ``"wider_than_row"`` and left empty -- never cut.
        logprobs: (n,) float32 or None.
        reasons: counts of upstream flags by reason; updated here.
    """
    n = int(sampled.numel())
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        # 0 would flag every position, a float would fail deep in indexing: neither is a row width.
        raise ValueError(
            f"{where}: width={width!r}; expected an int >= 1 (fixed rows, e.g. the request's top_k) or None "
            f"(ragged rows, every support whole)"
        )
    if lengths.numel() != n:
        raise ValueError(f"{where}: {lengths.numel()} support rows for {n} generated tokens; expected one per token")
    if logprobs is not None and (
        not isinstance(logprobs, torch.Tensor) or not logprobs.dtype.is_floating_point or logprobs.shape != (n,)
    ):
        got = f"{logprobs.dtype} {tuple(logprobs.shape)}" if isinstance(logprobs, torch.Tensor) else type(logprobs).__name__
        raise ValueError(
            f"{where}: logprobs must be a float ({n},) tensor, one sampled log-prob per generated token, got {got}; "
            f"pass this response's own log-probs (torch.tensor(..., dtype=torch.float32)) or None"
        )
    flagged = flagged.clone()
    if width is not None:
        wide = lengths > width
        if bool(wide.any()):
            # Never cut: the position leaves the loss and its row is emptied.
            keep = torch.repeat_interleave(~wide, lengths, output_size=members.numel())
            members, lengths = members[keep], torch.where(wide, torch.zeros_like(lengths), lengths)
            flagged |= wide
            reasons["wider_than_row"] = reasons.get("wider_than_row", 0) + int(wide.sum())
    bad = first_outside(members, _INT32_MAX + 1)
    if bad is not None:
        raise _id_out_of_range(where, int(members[bad]))
    ragged = RaggedSupport(
        members.to(torch.int32), lengths_to_cu_seqlens(lengths).to(torch.int64), torch.tensor([0, n], dtype=torch.int32),
    )
    # CSR either way: a row costs its members; with a width, padded copies are that wide.
    support = ragged if width is None else ragged.bounded(width)
    validate_support(support, sampled_ids=sampled, vocab_size=vocab_size, where=where)
    if flagged.any():
        at = torch.nonzero(flagged).flatten().tolist()
        logger.warning(
            "%s: %d of %d positions flagged, their rows left empty (%s): positions %s%s. Leave them out of the "
            "loss (loss_mask &= result.loss_mask).",
            where,
            len(at),
            n,
            ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items())),
            at[:8],
            " ..." if len(at) > 8 else "",
        )
    return EngineSupport(support, logprobs, flagged, dict(reasons))
