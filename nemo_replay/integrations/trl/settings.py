"""The one extra argument of :class:`~nemo_replay.integrations.trl.ReplayGRPOTrainer` (no TRL import)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Mapping, Optional, Union

__all__ = ["ReplaySettings", "as_settings"]

_SOURCES = ("logits", "hidden")


@dataclass(frozen=True)
class ReplaySettings:
    """How the trainer records and replays supports (docs/design.md §9).

    Attributes:
        enabled: score the old policy, the reference and the policy over the recorded
            supports. False leaves every TRL code path unchanged (the baseline).
        source: ``"logits"``: score the model's logits of the completion positions
            (``(B, C, V)``, like TRL without its fused head; logs the support mass).
            ``"hidden"``: score the backbone's last hidden states against the LM-head
            weight and never build ``(B, C, V)`` logits, keeping the memory property of
            TRL's fused head.
        chunk_size: (position, member) pairs projected per chunk in hidden mode.
        row_width: columns of fixed-width support rows; None: the sampler's ``top_k``.
            Rows wider than this (ties at the top-k cutoff) or without a top-k are carried
            ragged, never cut.
        vllm_logprobs: log-probs per position requested from vLLM (``use_vllm=True``);
            None: ``top_k + 1``, so each list ends with a filtered entry and shows the
            whole support.
    """

    enabled: bool = True
    source: str = "logits"
    chunk_size: int = 8192
    row_width: Optional[int] = None
    vllm_logprobs: Optional[int] = None

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.enabled, bool):
            problems.append(f"enabled={self.enabled!r} must be True or False")
        if self.source not in _SOURCES:
            problems.append(f"source={self.source!r} must be one of {', '.join(_SOURCES)}")
        for name, low in (("chunk_size", 1), ("row_width", 2), ("vllm_logprobs", 2)):
            value = getattr(self, name)
            if value is None and name != "chunk_size":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                problems.append(f"{name}={value!r} must be an int >= {low}")
        if problems:
            raise ValueError("ReplaySettings: " + "; ".join(problems))


def as_settings(replay: Union[ReplaySettings, Mapping, None]) -> ReplaySettings:
    """``ReplaySettings`` from itself, a mapping of its fields, or None (the defaults)."""
    if replay is None:
        return ReplaySettings()
    if isinstance(replay, ReplaySettings):
        return replay
    if isinstance(replay, Mapping):
        unknown = set(replay) - set(ReplaySettings.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"replay: unknown setting(s) {sorted(unknown)}; ReplaySettings has {sorted(ReplaySettings.__dataclass_fields__)}"
            )
        return ReplaySettings(**replay)
    raise ValueError(f"replay must be a ReplaySettings, a dict of its fields or None, got {type(replay).__name__}")
