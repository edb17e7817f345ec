"""The guards of one scorer call (docs/design.md §2, §3, §4).

Each guard is first computed as a device flag, with no host sync; the scorer reads all of
them (and the sizes it needs) in ONE host read. Only when a flag is set does the matching
``raise_*`` function run, which may read the device freely to name the trajectory, the
position and the fix: the failure path is the only one that pays for the message.

    guard           what it catches                                       error
    row_range       a row id outside [-1, rows)                           ValueError
    id_range        an id of a scored row outside [-1, V): always on,     ValueError
                    whatever ``validate`` or a row's check record skips,
                    since the kernels index the logits / LM-head rows
                    with these ids
    support         rows breaking the §2 invariants (when validating)     ValueError
    synthetic_eos   row-less loss-active positions breaking the §3 rule   SupportAlignmentError
    membership      a scored sampled token that is not in its row         SupportAlignmentError
    sampled_vocab   a sampled id outside [0, V) where the vocabulary
                    scores it (synthetic EOS, the full-vocabulary path)   ValueError
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport

__all__ = [
    "GUARDS",
    "Where",
    "has_support_row",
    "check_synthetic_eos",
    "check_rowless_positions",
    "synthetic_eos_flag",
    "raise_row_range",
    "raise_id_range",
    "raise_membership",
    "raise_sampled_vocab",
]

GUARDS = ("row_range", "support", "id_range", "synthetic_eos", "membership", "sampled_vocab")


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
    rank that saw it is added by :func:`~nemo_replay.scoring.collectives.agree`.
    """

    def __init__(self, traj: torch.Tensor, pos_shape, token_positions: Optional[torch.Tensor] = None):
        self.traj, self.pos_shape, self.token_positions = traj, pos_shape, token_positions

    def __call__(self, p: int) -> str:
        if self.token_positions is not None:
            return f"trajectory {int(self.traj[p])}, token position {int(self.token_positions[p])}"
        return f"trajectory {int(self.traj[p])}, logit position {position(p, self.pos_shape)}"


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


def check_rowless_positions(channels, support) -> None:
    """The synthetic-EOS rule (docs/design.md §3) on whole canonical sequences, before any slicing.

    Under context or sequence parallelism no rank sees a whole trajectory, so a strategy
    checks the rule here, on the canonical channels every rank holds alike (same verdict on
    every rank); errors name the trajectory and the token's column.

    Args:
        channels: canonical channels (``row_ids``, ``loss_mask``, ``trajectory_ids``,
            ``token_positions``), each (B, S - 1).
        support: the batch's rows.
    """
    rowless = channels.loss_mask & ~has_support_row(support, channels.row_ids)
    traj = channels.trajectory_ids.reshape(-1)
    shape = channels.loss_mask.shape
    check_synthetic_eos(rowless.reshape(-1), channels.loss_mask.reshape(-1), traj, shape,
                        Where(traj, shape, channels.token_positions.reshape(-1)))


def raise_row_range(rows: torch.Tensor, num_rows: int, where: Where) -> None:
    """Name the first position whose row id is outside ``[-1, num_rows)``."""
    p = int(torch.nonzero((rows < -1) | (rows >= num_rows))[0])
    raise ValueError(
        f"{where(p)}: row id {int(rows[p])} outside "
        f"[-1, {num_rows}) for a support of {num_rows} rows; row ids index the support's rows (-1 for none)"
    )


def raise_id_range(bad: torch.Tensor, ids: torch.Tensor, rows, vocab_size, where: Where) -> None:
    """Name the first scored position whose row holds an id outside ``[-1, vocab_size)``.

    ``bad``: (N, w) bool; ``ids``: (N, w) the row of every position.
    """
    p, c = (int(i) for i in torch.nonzero(bad)[0])
    vocab = "V" if vocab_size is None else vocab_size
    raise ValueError(
        f"{where(p)}: its support row {int(rows[p])} holds id "
        f"{int(ids[p, c])}, outside [-1, {vocab}) (-1 pads a row; every other id must be a token of the model's "
        f"vocabulary). The rows were changed after their check, or built without one: rebuild them, or score with "
        f"validate=True on rows that carry no check"
    )


def raise_membership(missing: torch.Tensor, ids: torch.Tensor, sampled, rows, where: Where) -> None:
    """Name the first scored position whose sampled token is not in its row.

    ``missing``: (N,) bool; ``ids``: (N, w) the row of every position.
    """
    p = int(torch.nonzero(missing)[0])
    members = ids[p][ids[p] >= 0][:16].tolist()
    raise SupportAlignmentError(
        f"{where(p)}: sampled token {int(sampled[p])} is not a "
        f"member of its support row {members} (row {int(rows[p])}); token and support coordinates are misaligned "
        f"(support rows sit at logit positions: row j of a response predicts token P + j)"
    )


def raise_sampled_vocab(bad: torch.Tensor, sampled, vocab_size, where: Where) -> None:
    """Name the first position scored over the vocabulary whose sampled id lies outside it.

    ``vocab_size``: int, or None when only a negative id can be known wrong yet (a TP shard
    that does not know the global size, before the MAX all-reduce).
    """
    p = int(torch.nonzero(bad)[0])
    vocab = "V" if vocab_size is None else vocab_size
    raise ValueError(
        f"{where(p)}: sampled id {int(sampled[p])} outside "
        f"the vocabulary [0, {vocab}); sampled ids are the tokens shifted by one, in the model's vocabulary"
    )
