"""Rank-local slots and the canonical columns they hold: the one slot <-> channel mapping (docs/design.md §3).

A rank-local tensor (unpadded rows, one packed THD row, the context-parallel chunks of
either) is a list of *slots*. Each names the trajectory ``b`` it belongs to and its
position ``q`` counted from ``b``'s first real token, or padding (``b = -1``). With ``s_b``
the canonical column of ``b``'s first real token and ``L_b`` its real tokens:

- a token channel ``(B, S, ...)`` is read at column ``s_b + q``, for ``q < L_b``;
- a logit channel ``(B, S - 1, ...)`` is read at logit column ``s_b + q``, for
  ``q < L_b - 1``: the logit of slot ``(b, q)`` predicts token ``q + 1`` of the same
  trajectory, never the first token of the sequence packed after it.

Megatron's :class:`~nemo_replay.strategies.megatron.token_layout.TokenMetadataLayout` and the
NeMo-RL hooks build their slots (the context-parallel split comes from
:mod:`nemo_replay.layout.context_parallel`) and read every scorer channel through
:meth:`Slots.channels`; outputs go back through :meth:`Slots.canonical_index`. Example,
one left-padded trajectory ``_ p0 p1 r0`` (``s = 1``, ``L = 3``) in slots ``q = 0 1 2 -``::

    slot                 0    1    2    3 (padding)
    token column         1    2    3    -
    logit column         1    2    -    -       slot 2 holds the last token: it predicts nothing
    sampled_ids          p1   r0   0    0       canonical sampled_ids[0, 1], [0, 2]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_replay.layout.channels import ScorerChannels

__all__ = ["Slots"]


@dataclass(frozen=True)
class Slots:
    """Which canonical column each rank-local slot holds. Build with :meth:`of`.

    Attributes:
        valid: (n,), bool. The slot holds a column of the channel kind it was built for.
        trajectory: (n,), int64. ``b`` (clamped to 0 where not valid).
        column: (n,), int64. Canonical column (clamped into range where not valid).
        width: the canonical width of the channel kind (``S`` for tokens, ``S - 1`` for logits).
        shape: the local position shape the slots fill, row-major.
    """

    valid: torch.Tensor
    trajectory: torch.Tensor
    column: torch.Tensor
    width: int
    shape: tuple

    @classmethod
    def of(cls, trajectory, position, starts, lengths, *, seq_len: int, shape, logit: bool) -> "Slots":
        """Slots of ``(trajectory, position)`` pairs, for logit or token channels.

        Args:
            trajectory, position: (n,), int. ``b`` and ``q`` of each slot, ``b < 0`` on padding.
            starts, lengths: (B,), int. ``s_b`` and ``L_b`` of each trajectory.
            seq_len: canonical ``S``.
            shape: the local position shape (its product is n).
        """
        trajectory = torch.as_tensor(trajectory, dtype=torch.int64)
        position = torch.as_tensor(position, dtype=torch.int64)
        b = trajectory.clamp(min=0)
        lengths = torch.as_tensor(lengths, dtype=torch.int64).to(b.device)
        last = lengths[b] - 1 if logit else lengths[b]
        valid = (trajectory >= 0) & (position >= 0) & (position < last)
        width = seq_len - 1 if logit else seq_len
        column = (torch.as_tensor(starts, dtype=torch.int64).to(b.device)[b] + position.clamp(min=0)).clamp(0, max(width - 1, 0))
        return cls(valid, b, column, width, tuple(int(d) for d in shape))

    def take(self, x: torch.Tensor, fill) -> torch.Tensor:
        """Canonical channel ``(B, width, *extra)`` -> ``(*shape, *extra)``, ``fill`` where a slot holds none."""
        if x.dim() < 2 or x.shape[1] != self.width:
            raise ValueError(f"a canonical channel must be (B, {self.width}, ...), got shape {tuple(x.shape)}")
        device = x.device
        values = x[self.trajectory.to(device), self.column.to(device)]
        keep = self.valid.to(device).view(-1, *([1] * (values.dim() - 1)))
        values = torch.where(keep, values, torch.full_like(values, fill))
        return values.view(*self.shape, *values.shape[1:])

    def channels(self, canonical: ScorerChannels, device=None) -> ScorerChannels:
        """Every scorer channel at the slots (logit slots), on ``device`` (default the channels')."""
        out = ScorerChannels(
            sampled_ids=self.take(canonical.sampled_ids, 0),
            row_ids=self.take(canonical.row_ids, -1),
            loss_mask=self.take(canonical.loss_mask, False),
            trajectory_ids=self.take(canonical.trajectory_ids, -1),
            token_positions=self.take(canonical.token_positions, -1),
        )
        return out if device is None else out.to(device)

    def canonical_index(self) -> torch.Tensor:
        """(n,), int64: each slot's flat index into ``(B, width)``, -1 where it holds none (the way back)."""
        return torch.where(self.valid, self.trajectory * self.width + self.column, -1)
