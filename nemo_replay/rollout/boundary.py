"""Support checks where rollout data enters the package (docs/design.md §2).

Capture adapters, wire decode and collation all call :func:`validate_support`, which
applies the §2 invariants to either support form:

- fixed-width rows (``PackedTensor`` or a plain ``[rows, k]`` tensor): the core
  :func:`~nemo_replay.support.validate.validate_support_rows`;
- CSR rows (``RaggedSupport``): ``RaggedSupport.validate`` plus the membership check
  below, vectorised the same way (one pass, no loop over rows).

An empty row (all ``-1``, or no CSR members) means "no support recorded" and is exempt
from the membership check. A support that passes records it on itself, with the vocabulary
size it was checked against (:mod:`nemo_replay.support.checked`), so the scorer does not
check the same rows again.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from nemo_replay.support.checked import record_checked
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.membership import csr_membership
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport
from nemo_replay.support.validate import describe_row, validate_support_rows

__all__ = ["validate_support", "check_ragged_members"]


def check_ragged_members(support: RaggedSupport, sampled_ids: torch.Tensor, *, where: str) -> None:
    """Each non-empty CSR row must contain its sampled token.

    Args:
        support: ``num_rows`` rows.
        sampled_ids: (num_rows,), integer; the token sampled from each row.

    Worked example: member_ids [4, 9, 2, 3, 7], row_offsets [0, 2, 2, 5], sampled [9, 5, 1]
    -> row_of_member [0, 0, 2, 2, 2]; hits at member 1 (row 0); row 1 is empty (exempt);
    row 2 has no hit -> error naming row 2.
    """
    sampled_ids = torch.as_tensor(sampled_ids)
    if sampled_ids.shape != (support.num_rows,):
        raise ValueError(
            f"{where}: sampled_ids has shape {tuple(sampled_ids.shape)}, expected ({support.num_rows},) "
            f"-- one sampled token per support row"
        )
    lengths = support.row_lengths
    row_of = torch.repeat_interleave(torch.arange(support.num_rows, device=support.device), lengths)
    sampled = sampled_ids.to(device=support.device, dtype=torch.int64)
    found, _ = csr_membership(support.member_ids, row_of, sampled)
    missing = (lengths > 0) & ~found
    if missing.any():
        r = int(torch.nonzero(missing)[0])
        raise SupportAlignmentError(
            f"{where}: {describe_row(support.cu_seqlens, r)}: sampled token {int(sampled[r])} is not a member "
            f"of its support row {support.row(r).tolist()[:16]}; rows and tokens are misaligned"
        )


def validate_support(
    support: Union[PackedTensor, RaggedSupport, torch.Tensor],
    *,
    sampled_ids: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    where: str,
) -> None:
    """Check a support batch against docs/design.md §2.

    Args:
        support: fixed-width rows ``[rows, k]`` (bare or packed) or CSR rows.
        sampled_ids: (rows,), integer, the token sampled from each row (all rows of all
            segments, in buffer order); checks membership when given.
        vocab_size: ids must be below it when given.
        where: names the boundary in error messages.

    Raises:
        ValueError naming the trajectory and row; SupportAlignmentError (a ValueError) when a
        sampled token is not a member of its row.
    """
    if not isinstance(support, (PackedTensor, RaggedSupport, torch.Tensor)):
        raise ValueError(
            f"{where}: support must be fixed-width rows (a PackedTensor or an int [rows, k] tensor) or a "
            f"RaggedSupport, got {type(support).__name__}"
        )
    if sampled_ids is not None:
        sampled_ids = torch.as_tensor(sampled_ids)
        if sampled_ids.dtype.is_floating_point or sampled_ids.dtype.is_complex or sampled_ids.dtype == torch.bool:
            # A float id would be truncated on the way to int64 and could pass as a member.
            raise ValueError(f"{where}: sampled_ids have dtype {sampled_ids.dtype}, expected integer token ids")
    if isinstance(support, RaggedSupport):
        support.validate(vocab_size=vocab_size, where=where)
        if sampled_ids is not None:
            check_ragged_members(support, sampled_ids, where=where)
    else:
        values, cu = (support.values, support.cu_seqlens) if isinstance(support, PackedTensor) else (support, None)
        if sampled_ids is not None:
            sampled_ids = torch.as_tensor(sampled_ids).to(values.device)
        validate_support_rows(values, vocab_size=vocab_size, cu_seqlens=cu, sampled_ids=sampled_ids, where=where)
    record_checked(support, vocab_size)
