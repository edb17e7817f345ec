"""The scorer's channels: what it reads at each position (docs/design.md §3, §4).

One type serves every coordinate system: the canonical ``(B, S - 1)`` logit columns
(:func:`~nemo_replay.layout.canonical.canonical_channels`), a rank's slots
(:meth:`~nemo_replay.layout.slots.Slots.channels`), the fsdp strategy's rolled rows, and
each integration's own positions. :func:`~nemo_replay.scoring.entry.score_positions` takes it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["ScorerChannels"]


class ScorerChannels(NamedTuple):
    """Five channels, each shaped like the positions ``[*]`` they describe.

    Attributes:
        sampled_ids: int. The token the position's logit predicts (global vocabulary id; any
            value, 0 by convention, where the position predicts nothing).
        row_ids: int. Global row of the support scored there, -1 for none.
        loss_mask: bool or 0/1. The position counts in the loss.
        trajectory_ids: int. The caller's trajectory, -1 where the logit predicts nothing.
        token_positions: int or None. The caller's column of the predicted token, which
            errors name (-1 where none); None: the position along the last axis.
    """

    sampled_ids: torch.Tensor
    row_ids: torch.Tensor
    loss_mask: torch.Tensor
    trajectory_ids: torch.Tensor
    token_positions: Optional[torch.Tensor] = None

    def to(self, device) -> "ScorerChannels":
        """Every channel on ``device``."""
        return ScorerChannels(*(None if t is None else t.to(device) for t in self))

    def flat(self) -> "ScorerChannels":
        """Every channel as one row of positions ``(N,)``."""
        return ScorerChannels(*(None if t is None else t.reshape(-1) for t in self))
