"""NeMo-RL's token coordinates, as its Megatron and DTensor workers lay them out (docs/design.md §9).

Read from NeMo-RL at commit ``7ea279abfbeb698b092856d0dab61e7cf39bc909`` (github NVIDIA-NeMo/RL):

- batches are right-padded: row i's ``input_lengths[i]`` tokens sit at columns ``[0, L_i)``
  of ``input_ids (B, W)``; per-token fields are token-aligned ``(B, W)`` (``token_mask``,
  ``generation_logprobs``), and ``generation_support (B, W, k)`` holds the support row of
  token t at column t (``-1`` padded; all ``-1`` where nothing was sampled);
- ``next_token_logprobs (B, W - 1)``: column c scores token c + 1
  (``distributed/model_utils.py`` ``from_parallel_logits_to_logprobs``: targets rolled by
  -1, last column dropped);
- context parallel: a padded sequence of P tokens (a multiple of 2 cp) is cut into 2 cp
  chunks and rank r holds chunks r and 2 cp - 1 - r, in that order
  (``_get_tokens_on_this_cp_rank``); logits are ``[.., P / cp, V / tp]``;
- packed: one row ``[1, T / cp]`` of sequences, each padded to its
  ``cu_seqlens_padded`` length and CP-chunked on its own (``models/megatron/data.py``
  ``_pack_sequences_for_megatron``).

Worked example, cp = 2, one sequence of L = 6 tokens ``a0 .. a5`` padded to P = 8
(chunks of 2):

    position        0   1   2   3   4   5   6   7
    token           a0  a1  a2  a3  a4  a5  _   _
    chunk           0   0   1   1   2   2   3   3
    rank 0 holds positions 0 1 6 7, rank 1 holds 2 3 4 5 (local order)
    the logit at position q predicts a_{q+1} when q + 1 < L: rank 0's slots predict
    a1 a2 - -, rank 1's a3 a4 a5 -; next_token_logprobs column q <- slot of position q.

Every local logit slot is (data row i, padded position q): the package's slot mapping
(:mod:`nemo_replay.layout.slots`) reads the canonical channels of :func:`canonical_of` there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from nemo_replay.layout.canonical import token_aligned_channels
from nemo_replay.layout.channels import ScorerChannels
from nemo_replay.layout.context_parallel import cp_local_positions
from nemo_replay.layout.slots import Slots

__all__ = [
    "NEMO_RL_COMMIT",
    "LocalSlots",
    "local_slots",
    "canonical_of",
    "gather_slots",
    "check_width",
]

#: The NeMo-RL commit whose conventions this module and its tests follow.
NEMO_RL_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"


@dataclass(frozen=True)
class LocalSlots:
    """This rank's logit slots, flattened in the logits' order.

    Attributes:
        row: (n,), int64. Data row (trajectory) of each slot.
        position: (n,), int64. Position within its padded sequence.
        shape: the position shape of the local logits (``logits.shape[:-1]``).
    """

    row: torch.Tensor
    position: torch.Tensor
    shape: tuple

    def logit_slots(self, input_lengths: torch.Tensor, width: int) -> Slots:
        """The slots as next-token columns of ``(N, W - 1)``: rows are right-padded, so position q
        of data row i is its column q, and its logit predicts token q + 1 while ``q + 1 < L_i``."""
        lengths = input_lengths.to(torch.int64).cpu()
        return Slots.of(self.row, self.position, torch.zeros_like(lengths), lengths, seq_len=width, shape=self.shape, logit=True)


def local_slots(padded_lengths: Sequence[int], cp_size: int, cp_rank: int, *, packed: bool) -> LocalSlots:
    """The slots of rank ``cp_rank``: unpacked ``(N, P / cp)`` rows, or one packed ``[1, sum(P_i) / cp]`` row.

    Args:
        padded_lengths: P_i per data row (unpacked: all equal to the padded row width).
        packed: sequences follow one another in one row (NeMo-RL's THD packing).
    """
    lengths = [int(p) for p in padded_lengths]
    row, position = cp_local_positions(
        lengths, cp_size, cp_rank, fix="NeMo-RL pads each sequence to a multiple of 2 * cp "
        "(policy.make_sequence_length_divisible_by)",
    )
    n = int(row.numel())
    shape = (1, n) if packed else (len(lengths), n // len(lengths) if lengths else 0)
    return LocalSlots(row, position, shape)


def canonical_of(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, token_mask: torch.Tensor, sample_mask: torch.Tensor,
    token_rows: Optional[torch.Tensor] = None,
) -> ScorerChannels:
    """The scorer channels of a right-padded NeMo-RL micro-batch, in next-token columns ``(N, W - 1)``.

    Column c predicts token c + 1 of its data row when ``c + 1 < L_i``; its row is
    ``generation_support`` flattened, ``i * W + c + 1`` (an all -1 row means none); it is
    loss-active where ``token_mask * sample_mask`` of the predicted token is.

    Args:
        input_ids: (N, W), int. Right-padded tokens.
        input_lengths: (N,), int. ``L_i <= W``.
        token_mask: (N, W), bool/int/float, token-aligned.
        sample_mask: (N,), bool/int/float.
        token_rows: (N, W), int64, the global row of token t at column t (-1 none), for rows
            that are not the dense ``(N, W, k)`` tensor; default ``i * W + t``.
    """
    device = input_ids.device
    N, W = input_ids.shape
    columns = torch.arange(W, device=device)
    real = columns[None, :] < input_lengths.to(device=device, dtype=torch.int64)[:, None]
    active = (token_mask.to(device) != 0) & (sample_mask.to(device) != 0)[:, None]
    if token_rows is None:
        token_rows = torch.arange(N, device=device)[:, None] * W + columns[None, :]
    return token_aligned_channels(input_ids, real, active, token_rows)


class _GatherSlots(torch.autograd.Function):
    """Every CP rank's slot values scattered into ``(N, W - 1)``; NeMo-RL's CP gather semantics.

    Forward: one all-gather over ``cp_group`` of this rank's ``(n,)`` values (none when
    cp = 1), then a scatter of every rank's slots (0 where no slot predicts). Backward: the
    gradient is summed over the CP ranks (one all-reduce) and this rank's slots take theirs --
    the backward of NeMo-RL's ``allgather_cp_sharded_tensor``, which its ``LossPostProcessor``
    balances by dividing the loss by the CP size.
    """

    @staticmethod
    def forward(ctx, local, indices, numel: int, cp_group, cp_rank: int):
        ctx.own = indices[cp_rank]
        ctx.cp_group = cp_group
        if len(indices) == 1:
            parts = [local]
        else:
            wire = local.detach().contiguous()
            parts = [torch.empty_like(wire) for _ in indices]
            dist.all_gather(parts, wire, group=cp_group)
        # One spare element at the end takes every slot that fills nothing (index -1), so the
        # scatter needs no count of the kept slots (a nonzero would read the device per rank).
        out = torch.zeros(numel + 1, dtype=local.dtype, device=local.device)
        for part, index in zip(parts, indices):
            out[torch.where(index >= 0, index, numel)] = part
        return out[:numel]

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.cp_group is not None and dist.get_world_size(ctx.cp_group) > 1:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.cp_group)
        own = ctx.own
        keep = own >= 0
        local = torch.where(keep, grad[own.clamp(min=0)], torch.zeros((), dtype=grad.dtype, device=grad.device))
        return local, None, None, None, None


def gather_slots(
    local: torch.Tensor, indices: list[torch.Tensor], out_shape: tuple, cp_group=None, cp_rank: int = 0
) -> torch.Tensor:
    """Differentiable gather of slot values into ``out_shape`` (see :class:`_GatherSlots`).

    Args:
        local: (n,), float. This rank's slot values.
        indices: one (n_r,) int64 flat output index per CP rank, -1 for a slot that fills nothing.
        cp_group: the CP group (None when ``len(indices) == 1``).
    """
    numel = 1
    for d in out_shape:
        numel *= int(d)
    return _GatherSlots.apply(local, indices, numel, cp_group, cp_rank).view(out_shape)


def check_width(name: str, input_lengths: torch.Tensor, width: int, padded: Optional[Sequence[int]] = None) -> None:
    """Each ``L_i`` fits the data width W and its padded length P_i."""
    L = input_lengths.to(torch.int64).cpu()
    bad = torch.nonzero((L < 1) | (L > width)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"{name}: data row {i} has input_lengths {int(L[i])}, outside [1, {width}] (the width of input_ids); "
            f"pass the unpadded lengths of the right-padded rows"
        )
    if padded is not None:
        P = torch.as_tensor(list(padded), dtype=torch.int64)
        bad = torch.nonzero(L > P).flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"{name}: data row {i} has {int(L[i])} tokens but its logits cover {int(P[i])} positions; the logits "
                f"and the data dict belong to different micro-batches, cu_seqlens_padded is not this one's, or the "
                f"logits are CP-local and context_parallel_group is missing"
            )
