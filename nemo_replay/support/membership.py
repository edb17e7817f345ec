"""Is the sampled token in its row: the one test, for fixed-width rows and for CSR members.

Both forms compare ids in int64 (a sampled id cast down to a narrow row dtype could wrap
onto a member) and never count the padding: a sampled id of -1 is not a member of a row
padded with -1. No host sync.
"""

from __future__ import annotations

import torch

__all__ = ["row_membership", "csr_membership"]


def row_membership(rows: torch.Tensor, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(member (N,) bool, col (N,) int64): whether ``sampled[i]`` is in ``rows[i]``, and its column.

    Args:
        rows: (N, w), int, -1 padded.
        sampled: (N,), int.

    Compared in the rows' dtype first (max over 0/1 bytes: column 0 when absent), then the
    found entry is confirmed in int64. Example: rows ``[[5, 9, -1], [-1, -1, -1]]``, sampled
    ``[9, -1]`` -> member ``[True, False]``, col ``[1, 0]``.
    """
    N, w = rows.shape
    sampled = sampled.to(device=rows.device, dtype=torch.int64)
    if w == 0:
        return torch.zeros(N, dtype=torch.bool, device=rows.device), torch.zeros(N, dtype=torch.int64, device=rows.device)
    found, col = (rows == sampled.to(rows.dtype)[:, None]).view(torch.uint8).max(1)
    exact = rows.gather(1, col[:, None]).squeeze(1).to(torch.int64) == sampled
    return found.bool() & exact & (sampled >= 0), col


def csr_membership(member_ids: torch.Tensor, row_of: torch.Tensor, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(found (R,) bool, hit (M,) bool): whether row r holds ``sampled[r]``, and which members are it.

    Args:
        member_ids: (M,), int, every row's members back to back.
        row_of: (M,), int64, the row of each member (``repeat_interleave(arange(R), lengths)``).
        sampled: (R,), int, one token per row.

    Example: members ``[4, 9, 2, 3, 7]`` of rows ``[0, 0, 2, 2, 2]``, sampled ``[9, 1, 5]`` ->
    found ``[True, False, False]``, hit ``[F, T, F, F, F]``.
    """
    sampled = sampled.to(device=member_ids.device, dtype=torch.int64)
    hit = (member_ids.to(torch.int64) == sampled[row_of]) & (member_ids >= 0)
    found = torch.zeros(sampled.shape[0], dtype=torch.bool, device=member_ids.device)
    found[row_of[hit]] = True
    return found, hit
