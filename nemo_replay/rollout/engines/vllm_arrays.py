"""vLLM log-prob outputs as flat arrays, and their supports read with array operations.

Every form :func:`~nemo_replay.rollout.engines.vllm.support_from_vllm_logprobs` takes -- the
offline ``list[dict[int, Logprob]]`` and ``FlatLogprobs``, the completions, chat and generate
JSON -- is flattened here without a check per entry in Python (:func:`flat_entries`), and
read for the whole response at once (:func:`read_flat`): one stable sort by (position, id)
finds the duplicates and leaves each row's ids ascending. Anything that breaks a rule makes
these return None, and the adapter reads the response entry by entry, which names it
(docs/design.md §7).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Mapping, Optional

import numpy as np

__all__ = ["VLLM_FILTERED_LOGPROB", "flat_entries", "read_flat"]

#: vLLM's JSON writes a ``-inf`` (filtered) log-prob as this value.
VLLM_FILTERED_LOGPROB = -9999.0


def _token_ids(raw: list) -> list:
    """``"token_id:<id>"`` strings (the HTTP forms) as ints; raises on anything else."""
    if set(map(type, raw)) <= {int}:
        return raw
    if not all(isinstance(t, str) and t.startswith("token_id:") for t in raw):
        raise ValueError("not token ids")
    return [int(t[9:]) for t in raw]


def _flat_json(logprobs: Mapping) -> tuple:
    """The HTTP forms as flat lists: (tokens, values, counts, reported tokens, reported log-probs)."""
    if "content" in logprobs:  # chat, generate
        content = logprobs["content"] or []
        key = "token_id" if content and "token_id" in content[0] else "token"
        tops = [c["top_logprobs"] or [] for c in content]
        tokens = _token_ids([e[key] for top in tops for e in top])
        values = [e["logprob"] for top in tops for e in top]
        return (tokens, values, list(map(len, tops)), _token_ids([c[key] for c in content]),
                [c["logprob"] for c in content])
    tops, own = logprobs["top_logprobs"] or [], logprobs.get("token_logprobs") or []  # completions
    reported = _token_ids(list(logprobs["tokens"] or []))
    if len(tops) != len(reported) or len(own) != len(reported):
        raise ValueError("lengths differ")
    tops = [d or {} for d in tops]
    return (_token_ids(list(itertools.chain.from_iterable(tops))), list(itertools.chain.from_iterable(map(dict.values, tops))),
            list(map(len, tops)), reported, list(own))


def flat_entries(logprobs: Any) -> Optional[tuple]:
    """Any form as flat arrays, built without a check per entry in Python: (token ids int64,
    log-probs float64, entries per position int64, reported tokens and log-probs or None);
    None for an unknown form or any entry of an unexpected type (the per-entry reader then
    names it)."""
    reported = own = None
    if isinstance(logprobs, Mapping) and ("content" in logprobs or ("top_logprobs" in logprobs and "tokens" in logprobs)):
        try:
            tokens, values, counts, reported, own = _flat_json(logprobs)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            return None
        if not set(map(type, own)) <= {float, int}:
            return None
        starts = np.cumsum([0, *counts])[:-1]
        ends = starts + np.asarray(counts, dtype=np.int64)
    elif hasattr(logprobs, "start_indices") and hasattr(logprobs, "end_indices"):  # FlatLogprobs
        starts, ends = np.asarray(logprobs.start_indices), np.asarray(logprobs.end_indices)
        tokens, values = logprobs.token_ids, logprobs.logprobs
        if starts.size and (starts[0] != 0 or ends[-1] != len(tokens) or np.any(starts[1:] != ends[:-1])):
            return None  # not back to back: the per-entry reader follows the indices
    elif isinstance(logprobs, list) and set(map(type, logprobs)) <= {dict}:
        counts = list(map(len, logprobs))
        tokens = list(itertools.chain.from_iterable(logprobs))
        entries = list(itertools.chain.from_iterable(map(dict.values, logprobs)))
        kinds = set(map(type, entries))
        if len(kinds) == 1 and entries and hasattr(entries[0], "logprob"):  # vLLM's Logprob (a dataclass)
            values = list(map(operator.attrgetter("logprob"), entries))
        elif kinds <= {float}:
            values = entries
        else:
            return None
        starts = np.cumsum([0, *counts])[:-1]
        ends = starts + np.asarray(counts, dtype=np.int64)
    else:
        return None
    if not set(map(type, tokens)) <= {int} or not set(map(type, values)) <= {float, int}:
        return None  # a bool, a float id, a string: named by the per-entry reader
    if reported is not None and not set(map(type, reported)) <= {int}:
        return None
    try:  # an id past int64 is refused by the conversion itself
        return (np.asarray(tokens, dtype=np.int64).reshape(-1), np.asarray(values, dtype=np.float64).reshape(-1),
                (np.asarray(ends) - np.asarray(starts)).astype(np.int64).reshape(-1),
                None if reported is None else np.asarray(reported, dtype=np.int64).reshape(-1),
                None if own is None else np.asarray(own, dtype=np.float64).reshape(-1))
    except OverflowError:
        return None


def read_flat(tokens, values, counts, sampled: np.ndarray, own: Optional[np.ndarray], vocab_size: Optional[int]):
    """The per-position rule of ``vllm._read_position`` over every position at once, from
    :func:`flat_entries`' arrays.

    Returns (members int64 back to back, lengths, flagged, sampled log-probs), or None when a
    position breaks a rule: the per-position reader then raises naming it.
    """
    n = counts.size
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0)
    if np.any(counts == 0) or np.any(np.isnan(values)) or np.any(values > 1e-5):
        return None
    starts = np.cumsum(counts) - counts
    if np.any(tokens[starts] != sampled):
        return None
    if tokens.min() < 0 or tokens.max() >= 2**31:
        return None
    pos = np.repeat(np.arange(n), counts)
    order = np.argsort((pos << 31) | tokens, kind="stable")  # by position, then id, then engine order
    t, v, p = tokens[order], values[order], pos[order]
    again = (t[1:] == t[:-1]) & (p[1:] == p[:-1])
    if np.any(again):
        a, b = v[:-1][again], v[1:][again]
        if not np.all(_close(a, b) | ((a <= VLLM_FILTERED_LOGPROB) & (b <= VLLM_FILTERED_LOGPROB))):
            return None
    first = np.ones(t.size, bool)
    first[1:] = ~again  # the first listing of each id, as the per-position reader keeps it
    t, v, p = t[first], v[first], p[first]
    listed = values[starts]  # the sampled token is each list's first entry
    lp = listed if own is None else own
    if np.any(lp <= VLLM_FILTERED_LOGPROB) or not np.all(_close(lp, listed)):
        return None
    member = v > VLLM_FILTERED_LOGPROB
    unique, members = np.bincount(p, minlength=n), np.bincount(p[member], minlength=n)
    whole = members < unique
    if vocab_size is not None:
        whole |= unique >= vocab_size
    keep = member & whole[p]  # ids ascending within each position, as the sort left them
    return t[keep], np.where(whole, members, 0), ~whole, lp


def _close(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``math.isclose(a, b, abs_tol=1e-4)`` elementwise (equal infinities included)."""
    with np.errstate(invalid="ignore"):
        return (a == b) | (np.abs(a - b) <= np.maximum(1e-9 * np.maximum(np.abs(a), np.abs(b)), 1e-4))
