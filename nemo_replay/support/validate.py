"""Invariant checks for support rows (docs/design.md §2); segment offsets are checked in packed.py.

Every boundary where support data enters the package (capture, wire decode, collation,
the scorer) calls these. They are vectorised: one pass over the buffer, no Python loop
over rows, and they only index into the data to build the error message.

:func:`support_row_flags` is the same check as a device flag, with no host sync, for
callers that combine it with other guards and read them all at once (the scorer);
:func:`validate_support_rows` then names the failure.
"""

from __future__ import annotations

import torch

from nemo_replay.support.dtypes import is_integer
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.membership import row_membership

__all__ = ["validate_support_rows", "support_row_flags", "describe_row", "SORT_BLOCK"]

# Duplicate members are found by sorting each row and comparing neighbours. Blocks of
# 2**17 entries bound the sort's temporaries (values and int64 indices) at 1 MiB while
# leaving each sort enough rows to run on every thread.
SORT_BLOCK = 1 << 17


def _wide(values: torch.Tensor) -> torch.Tensor:
    """int32 / int64 rows as they are, any other integer dtype widened to int64.

    A comparison with a Python int happens in the tensor's dtype: for uint8 rows ``-1``
    wraps to 255 and a vocabulary of 300 to 44, for int16 40000 wraps too.
    """
    return values if values.dtype in (torch.int32, torch.int64) else values.to(torch.int64)


def support_row_flags(values: torch.Tensor, *, vocab_size: int | torch.Tensor | None = None) -> torch.Tensor:
    """True when some fixed-width row breaks docs/design.md §2; no host sync.

    Args:
        values: (num_rows, k), integer (validated as such by the caller).
        vocab_size: ids must be below it when given (an int, or a 0-d integer tensor on
            ``values``' device, e.g. the result of a collective).

    Returns:
        0-d bool on ``values``' device: an id below -1, an id >= vocab_size, a member after
        padding, or a duplicate id in a row. :func:`validate_support_rows` names which.
    """
    values = _wide(values)
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=values.device)
    lowest, highest = torch.aminmax(values)
    bad = lowest < -1
    if vocab_size is not None:
        bad = bad | (highest >= vocab_size)
    if values.shape[1] > 1:
        pad = values < 0
        bad = bad | (pad[:, :-1] > pad[:, 1:]).any()
        block = max(1, SORT_BLOCK // values.shape[1])
        for start in range(0, values.shape[0], block):
            ordered, _ = torch.sort(values[start : start + block], dim=1)
            bad = bad | ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()
    return bad


def describe_row(cu_seqlens: torch.Tensor | None, row: int) -> str:
    """'trajectory i, row j' for a global row index, or 'row r' without offsets."""
    if cu_seqlens is None or cu_seqlens.numel() < 2:
        return f"row {row}"
    seg = int(torch.searchsorted(cu_seqlens.to(torch.int64), torch.tensor([row], device=cu_seqlens.device), right=True)[0]) - 1
    return f"trajectory {seg}, row {row - int(cu_seqlens[seg])}"


def validate_support_rows(
    values: torch.Tensor,
    *,
    vocab_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    sampled_ids: torch.Tensor | None = None,
    where: str = "support",
) -> None:
    """Check fixed-width support rows against docs/design.md §2.

    Args:
        values: (num_rows, k), integer. Members first, then trailing -1 padding.
        vocab_size: ids must be < vocab_size when given.
        cu_seqlens: (batch_size + 1,), used only to name trajectories in errors.
        sampled_ids: (num_rows,), integer. When given, each non-empty row must contain its
            sampled token (a row that does not is a misalignment).
        where: names the boundary in error messages ("wire decode", "collation", ...).

    Raises:
        ValueError naming the first offending trajectory and row;
        SupportAlignmentError (a ValueError) when a sampled token is not in its row.
    """
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{where}: support rows must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() != 2:
        raise ValueError(f"{where}: support rows must be 2-D (rows, k), got shape {tuple(values.shape)}")
    if not is_integer(values):
        raise ValueError(f"{where}: support rows must be an integer tensor (int32), got {values.dtype}")
    if values.numel() == 0:
        return

    if bool(support_row_flags(values, vocab_size=vocab_size)):  # the one host read of valid rows
        _name_row_failure(values, vocab_size, cu_seqlens, where)
    if sampled_ids is not None:
        if not isinstance(sampled_ids, torch.Tensor) or not is_integer(sampled_ids):
            # A float id would be truncated to a member (3.7 -> 3) and pass.
            raise ValueError(
                f"{where}: sampled_ids must be an integer tensor of token ids, got "
                f"{sampled_ids.dtype if isinstance(sampled_ids, torch.Tensor) else type(sampled_ids).__name__}"
            )
        if sampled_ids.shape != values.shape[:1]:
            raise ValueError(
                f"{where}: sampled_ids has shape {tuple(sampled_ids.shape)}, expected ({values.shape[0]},)"
            )
        has_row = values[:, 0] >= 0
        member, _ = row_membership(_wide(values), sampled_ids)
        missing = has_row & ~member
        if missing.any():
            row = int(torch.nonzero(missing)[0])
            raise SupportAlignmentError(
                f"{where}: {describe_row(cu_seqlens, row)}: sampled token {int(sampled_ids[row])} is not a "
                f"member of its support row {values[row].tolist()[:16]}; rows and tokens are misaligned: row i "
                f"must be the support token i was sampled from (docs/design.md §3). A sampled token missing "
                f"from the engine's own output is an engine error, not something to patch into the row"
            )


def _name_row_failure(values: torch.Tensor, vocab_size, cu_seqlens, where: str) -> None:
    """Raise for the first row :func:`support_row_flags` flagged, naming its trajectory and what it breaks."""
    values = _wide(values)

    def fail(mask_rows: torch.Tensor, what: str) -> None:
        row = int(torch.nonzero(mask_rows)[0])
        raise ValueError(
            f"{where}: {describe_row(cu_seqlens, row)} {what}: {values[row].tolist()[:16]}"
        )

    # Whole-buffer checks first (no per-row temporaries); per-row masks only to name a failure.
    lowest, highest = torch.aminmax(values)
    if int(lowest) < -1:
        fail((values < -1).any(1), "holds an id below -1 (only -1 may pad)")
    if vocab_size is not None and int(highest) >= vocab_size:
        fail((values >= vocab_size).any(1), f"holds an id >= vocab_size={vocab_size}")
    pad = values < 0
    # Padding must be trailing: once a row pads, it pads to the end (no pad followed by a member).
    if values.shape[1] > 1:
        late_member = pad[:, :-1] > pad[:, 1:]
        if late_member.any():
            fail(late_member.any(1), "has a member after -1 padding (padding must be trailing)")
        # Duplicate members: sort each row, compare neighbours, ignore padding.
        block = max(1, SORT_BLOCK // values.shape[1])
        for start in range(0, values.shape[0], block):
            ordered, _ = torch.sort(values[start : start + block], dim=1)
            dup = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
            if dup.any():
                rows = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
                rows[start : start + block] = dup.any(1)
                fail(rows, "holds a duplicate id")
    raise AssertionError("the support flag was set but no row breaks the checks")  # pragma: no cover
