"""Support checks where rollout data enters the package (docs/design.md §2).

Capture adapters, wire decode and collation all call :func:`validate_support`, which
applies the §2 invariants to either support form:

- a plain ``(rows, k)`` tensor: :func:`~nemo_replay.support.validate.validate_support_rows`;
- a ``PackedTensor`` or a ``RaggedSupport``: its own ``validate``, which both forms answer
  the same way, membership included (one pass, no loop over rows).

An empty row (all ``-1``, or no CSR members) means "no support recorded" and is exempt
from the membership check. A support that passes records it on itself, with the vocabulary
size it was checked against (:mod:`nemo_replay.support.checked`), so the scorer does not
check the same rows again.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from nemo_replay.support.checked import record_checked
from nemo_replay.support.dtypes import is_integer
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport, is_support
from nemo_replay.support.validate import validate_support_rows

__all__ = ["validate_support"]


def validate_support(
    support: Union[PackedTensor, RaggedSupport, torch.Tensor],
    *,
    sampled_ids: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    where: str,
) -> None:
    """Check a support batch against docs/design.md §2.

    Args:
        support: fixed-width rows ``(rows, k)`` (bare or packed) or CSR rows.
        sampled_ids: (rows,), integer, the token sampled from each row (all rows of all
            segments, in buffer order); checks membership when given.
        vocab_size: ids must be below it when given.
        where: names the boundary in error messages.

    Raises:
        ValueError naming the trajectory and row; SupportAlignmentError (a ValueError) when a
        sampled token is not a member of its row.
    """
    if not (is_support(support) or isinstance(support, torch.Tensor)):
        raise ValueError(
            f"{where}: support must be fixed-width rows (a PackedTensor or an int (rows, k) tensor) or a "
            f"RaggedSupport, got {type(support).__name__}"
        )
    if sampled_ids is not None:
        sampled_ids = torch.as_tensor(sampled_ids)
        if not is_integer(sampled_ids):
            # A float id would be truncated on the way to int64 and could pass as a member.
            raise ValueError(f"{where}: sampled_ids have dtype {sampled_ids.dtype}, expected integer token ids")
    if isinstance(support, torch.Tensor):
        if sampled_ids is not None:
            sampled_ids = sampled_ids.to(support.device)
        validate_support_rows(support, vocab_size=vocab_size, sampled_ids=sampled_ids, where=where)
    else:
        support.validate(vocab_size=vocab_size, sampled_ids=sampled_ids, where=where)
    record_checked(support, vocab_size)
