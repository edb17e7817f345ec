"""The canonical pre-check: support rows against the tokens they score, on whole sequences
(docs/design.md §3).

Two rules tie support rows to token coordinates:

- membership: a loss-active position with a row predicts a token that is a member of it;
- the synthetic-EOS rule: at most one loss-active position per trajectory lacks a row,
  and it is that trajectory's last loss-active position.

The scorer checks both on the positions it is given. Under context or sequence
parallelism no rank holds a whole trajectory, so a strategy or integration that slices
sequences first calls :func:`check_canonical` on the canonical ``(B, S - 1)`` channels every
rank holds alike: every rank reaches the same verdict, and errors name the caller's
trajectory and token position (:class:`Where`), never a rank-local slot.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.membership import row_membership
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["Where", "has_support_row", "synthetic_eos_flag", "check_synthetic_eos", "check_canonical"]


def position(flat: int, shape: torch.Size) -> str:
    """Position of a flattened index along the last position axis (the sequence axis)."""
    if len(shape) == 0:
        return "0"
    return str(flat % shape[-1]) if len(shape) > 1 else str(flat)


class Where:
    """Names a flattened position in an error: the caller's trajectory and token position.

    ``token_positions`` (N,) int64: the caller's column of the token each position predicts
    (strategies pass it: the same token is then named the same whatever the packing, context
    or sequence parallel slicing); without it, the position along the input's last axis. The
    rank that saw it is added by :func:`~nemo_replay.distributed.groups.agree`.

    An integration names its own coordinates with ``trajectory`` (the name of trajectory b,
    e.g. ``"sample 3 (uid u-3)"``) and ``position`` (the word for a token position, e.g.
    ``"response position"``).
    """

    def __init__(self, traj: torch.Tensor, pos_shape, token_positions: Optional[torch.Tensor] = None, *,
                 trajectory: Optional[Callable[[int], str]] = None, position: str = "token position"):
        self.traj, self.pos_shape, self.token_positions = traj, pos_shape, token_positions
        self.trajectory = trajectory or (lambda b: f"trajectory {b}")
        self.position = position

    def __call__(self, p: int) -> str:
        name = self.trajectory(int(self.traj[p]))
        if self.token_positions is not None:
            return f"{name}, {self.position} {int(self.token_positions[p])}"
        return f"{name}, logit position {position(p, self.pos_shape)}"


def has_support_row(support: Union[PackedTensor, RaggedSupport], row_ids: torch.Tensor) -> torch.Tensor:
    """True where ``row_ids`` names a non-empty row (not -1, not all -1 / empty).

    Args:
        support: fixed-width (rows, k) PackedTensor or RaggedSupport.
        row_ids: any shape, int; values outside ``[0, rows)`` count as no row.
    Returns:
        bool, shaped like ``row_ids``.
    """
    nonempty = support.nonempty_rows().to(row_ids.device)
    if nonempty.numel() == 0:
        return torch.zeros(row_ids.shape, dtype=torch.bool, device=row_ids.device)
    ok = (row_ids >= 0) & (row_ids < nonempty.numel())
    return ok & nonempty[row_ids.clamp(0, nonempty.numel() - 1)]


def synthetic_eos_flag(fallback: torch.Tensor, loss_mask: torch.Tensor, traj: torch.Tensor) -> torch.Tensor:
    """0-d bool, True when :func:`check_synthetic_eos` would raise; no host sync.

    Args:
        fallback: (N,), bool. Loss-active positions without a row.
        loss_mask: (N,), bool.
        traj: (N,), int64 trajectory ids (< 0: padding).

    A row-less position is wrong when it belongs to no trajectory, or when a later
    loss-active position of its trajectory exists (which also covers two row-less
    positions in one trajectory: the first is not the last). A stable sort by trajectory
    (loss-inactive positions under one key below every id) keeps each trajectory's
    positions in order, so "a later one exists" is "the next sorted entry has the same key".
    Example: traj [0, 0, 1, 1], loss [1, 1, 1, 1], fallback [1, 0, 0, 1] -> sorted keys
    [0, 0, 1, 1]; entry 0 is row-less and entry 1 has its key -> flagged.
    """
    if fallback.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=fallback.device)
    key = torch.where(loss_mask, traj, torch.full_like(traj, -2))
    order = torch.sort(key, stable=True).indices
    key_s, fb_s = key[order], fallback[order]
    later = torch.zeros_like(fb_s)
    later[:-1] = key_s[1:] == key_s[:-1]
    return (fb_s & ((key_s < 0) | later)).any()


def check_synthetic_eos(fallback, loss_mask, traj, pos_shape, where: Optional[Where] = None) -> None:
    """The synthetic-EOS rule (docs/design.md §3): at most one loss-active position without a support
    row per trajectory, and it is that trajectory's last loss-active position.

    Args:
        fallback: (N,), bool. Loss-active positions without a row.
        loss_mask: (N,), bool.
        traj: (N,), int64 trajectory ids, -1 on padding. Positions of one trajectory must
            appear in increasing order (true after unpadding, packing, CP and SP slicing).
        pos_shape: the unflattened position shape, for error messages.
        where: names a position (default: trajectory and position along ``pos_shape``'s last axis).

    Raises:
        ValueError for a loss-active padding position; SupportAlignmentError otherwise.

    Strategies that shard a sequence call it on the whole sequence first, since a slice
    cannot see another slice's positions. A batch that keeps the rule costs one host read
    (:func:`synthetic_eos_flag`); only a failing one pays for naming the position.
    """
    loss_mask = loss_mask.bool()
    if not bool(synthetic_eos_flag(fallback, loss_mask, traj)):
        return
    where = where or Where(traj, pos_shape)
    idx = torch.nonzero(fallback).flatten()
    t = traj[idx]
    if (t < 0).any():
        p = int(idx[torch.nonzero(t < 0)[0]])
        raise ValueError(
            f"{where(p)} is loss-active but belongs to no trajectory (trajectory id -1, padding); padding must be "
            f"loss-masked"
        )
    counts = torch.bincount(t)
    many = torch.nonzero(counts > 1).flatten().tolist()
    if many:
        raise SupportAlignmentError(
            f"trajectories {many} have {[int(counts[i]) for i in many]} loss-active positions without a support row; "
            f"at most one per trajectory (a synthetic EOS) may be scored over the full vocabulary. Check that "
            f"support row ids are placed at logit positions and that every sampled token has a row"
        )
    active = torch.nonzero(loss_mask).flatten()
    a_traj = traj[active]
    keep = a_traj >= 0
    # One slot per trajectory id seen at a loss-active position (not only those with a
    # row-less position): a clamp here would fold later trajectories into earlier slots.
    last = torch.full((int(a_traj[keep].max()) + 1,), -1, dtype=torch.int64, device=idx.device)
    last.scatter_reduce_(0, a_traj[keep], active[keep], reduce="amax", include_self=True)
    not_last = idx != last[t]
    if not_last.any():
        p = int(idx[torch.nonzero(not_last)[0]])
        raise SupportAlignmentError(
            f"{where(p)}: loss-active with no support row but "
            f"not the trajectory's last loss-active token; only a synthetic EOS (the last token) may lack a row. "
            f"Support rows are misaligned (an off-by-one between token and logit positions?)"
        )
    raise AssertionError("the synthetic-EOS flag was set but no position breaks the rule")  # pragma: no cover


def check_canonical(channels, support, *, hint: str = "", where: Optional[Where] = None) -> None:
    """Membership and the synthetic-EOS rule on whole canonical sequences, before any slicing.

    Args:
        channels: canonical channels (``sampled_ids``, ``row_ids``, ``loss_mask``,
            ``trajectory_ids``, ``token_positions``), each (B, S - 1)
            (:class:`~nemo_replay.layout.channels.ScorerChannels`).
        support: the batch's rows, either form.
        hint: what the caller's user checks when rows and tokens disagree (appended to a
            membership error).
        where: names a position in errors (default: trajectory and token position, from the
            channels).

    Raises:
        SupportAlignmentError naming the trajectory and the token's column; ValueError for a
        loss-active padding position.
    """
    loss_mask = channels.loss_mask.reshape(-1).bool()
    rows = channels.row_ids.reshape(-1)
    traj = channels.trajectory_ids.reshape(-1)
    shape = channels.loss_mask.shape
    where = where or Where(traj, shape, channels.token_positions.reshape(-1))
    has_row = has_support_row(support, rows)
    active = torch.nonzero(loss_mask & has_row).flatten()
    if active.numel():
        ids = support.gather_padded(rows[active].to(support.device), support.width_bound)
        sampled = channels.sampled_ids.reshape(-1)[active]
        member, _ = row_membership(ids, sampled)
        if not bool(member.all()):
            j = int(torch.nonzero(~member)[0])
            raise SupportAlignmentError(
                f"{where(int(active[j]))}: token {int(sampled[j])} is not a member of its support row "
                f"{ids[j][ids[j] >= 0][:16].tolist()} (row {int(rows[active[j]])}); rows and tokens are misaligned "
                f"(the row of a token is the support it was sampled from, docs/design.md §3)" + (f"; {hint}" if hint else "")
            )
    check_synthetic_eos(loss_mask & ~has_row, loss_mask, traj, shape, where)
