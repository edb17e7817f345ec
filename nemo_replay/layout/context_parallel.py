"""Context parallelism's load-balanced split: the one definition of which positions a rank holds.

Each padded sequence of ``P_i`` tokens (a multiple of ``2 cp``) is cut into ``2 cp`` equal
chunks and rank ``r`` keeps chunks ``r`` and ``2 cp - 1 - r``, in that order (causal
attention costs the same on every rank). Sequences follow one another. Megatron's
``TokenMetadataLayout`` and the NeMo-RL hooks both read it from here. Example, P = [8, 4],
cp = 2 (chunks of 2 and 1)::

    rank 0: sequence 0 positions 0 1 6 7, sequence 1 positions 0 3
    rank 1: sequence 0 positions 2 3 4 5, sequence 1 positions 1 2
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

__all__ = ["cp_local_positions"]


def cp_local_positions(
    padded_lengths: Union[Sequence[int], torch.Tensor], cp_size: int, cp_rank: int, *, fix: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position) of each of rank ``cp_rank``'s slots, in its local order.

    Args:
        padded_lengths: (N,), int, ``P_i`` of each sequence.
        fix: what the caller's user sets to pad the sequences, appended to the error.

    Returns:
        two (sum P_i / cp,), int64 tensors: the sequence of each slot and its position within
        that padded sequence.

    Raises:
        ValueError naming the first sequence whose length is not a multiple of ``2 cp`` (cp > 1).
    """
    padded = torch.as_tensor(padded_lengths, dtype=torch.int64).cpu().reshape(-1)
    cp, r = int(cp_size), int(cp_rank)
    if cp > 1:
        bad = torch.nonzero(padded % (2 * cp)).flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"a padded sequence of {int(padded[i])} tokens (sequence {i}) cannot be cut into 2 * cp = {2 * cp} "
                f"chunks" + (f"; {fix}" if fix else "")
            )
    local_cu = torch.cat([padded.new_zeros(1), torch.cumsum(padded // cp, 0)])
    k = torch.arange(int(local_cu[-1]), dtype=torch.int64)
    seq = torch.searchsorted(local_cu[1:], k, right=True)
    within = k - local_cu[seq]
    if cp == 1:
        return seq, within
    chunk = padded[seq] // (2 * cp)
    first = within < chunk  # the first half of a sequence's local share is chunk r, the second chunk 2cp-1-r
    chunk_id = torch.where(first, torch.full_like(within, r), torch.full_like(within, 2 * cp - 1 - r))
    return seq, chunk_id * chunk + torch.where(first, within, within - chunk)
