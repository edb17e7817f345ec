"""Padding removal and the way back, flash-attention varlen style (docs/design.md §3, §5 fsdp).

A left-padded ``(B, S)`` batch becomes one packed row of its ``nnz`` real tokens, the
trajectories back to back; ``cu_seqlens`` marks where each starts. Every token-aligned
channel goes through the *same* non-pad indices, so a value never changes position
relative to its token.

Worked example, B = 2, S = 4 (``_`` is padding):

    attention_mask   [[0, 1, 1, 1],        flat column  0  1  2  3 | 4  5  6  7
                      [1, 1, 1, 1]]
    sequences        [[_, a, b, c],
                      [d, e, f, g]]
    indices          [1, 2, 3, 4, 5, 6, 7]      flat positions of real tokens (nnz = 7)
    cu_seqlens       [0, 3, 7]                  int32, trajectory i = packed [cu[i], cu[i+1])
    unpad            [a, b, c, d, e, f, g]
    position_ids     [0, 1, 2, 0, 1, 2, 3]      restart at every trajectory
    shift_left(., 0) [b, c, d, e, f, g, 0]      next-token targets; position 2 (c) gets d,
                                                a token of the next trajectory: the logit of
                                                a trajectory's last token predicts nothing,
                                                so its loss mask (shifted alike) is 0 there
    pad(., fill=0)   [[0, a, b, c],             back to (B, S), fill at the pad positions
                      [d, e, f, g]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Unpadding", "unpad_indices", "unpad", "pad", "packed_position_ids", "shift_left"]


@dataclass(frozen=True)
class Unpadding:
    """Where the real tokens of a ``(B, S)`` batch sit.

    Attributes:
        indices: (nnz,), torch.int64. Flat positions ``b * S + s`` of the real tokens,
            ascending (trajectory-major, left to right).
        cu_seqlens: (batch_size + 1,), torch.int32. Packed offsets of each trajectory.
        batch_size: B.
        seq_len: S.
    """

    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    batch_size: int
    seq_len: int

    @property
    def nnz(self) -> int:
        return self.indices.numel()

    @property
    def max_seqlen(self) -> int:
        """Longest trajectory, in tokens (what a varlen attention kernel asks for).

        Derived from ``cu_seqlens`` when asked: one host sync for callers that need it,
        none for those that do not.
        """
        if self.batch_size == 0:
            return 0
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())


def unpad_indices(attention_mask: torch.Tensor) -> Unpadding:
    """Non-pad indices and ``cu_seqlens`` of a batch.

    Args:
        attention_mask: (B, S), bool or int; nonzero on real tokens. Any padding side
            works; the packed order is row-major.
    """
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be (B, S) (one row per trajectory), got shape {tuple(attention_mask.shape)}; "
            f"pass the batch's 2-D mask, not a per-layer or (B, 1, S, S) attention mask"
        )
    real = attention_mask != 0
    B, S = real.shape
    lengths = real.sum(1)
    indices = torch.nonzero(real.reshape(-1), as_tuple=False).flatten()
    cu = torch.zeros(B + 1, dtype=torch.int32, device=real.device)
    cu[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    return Unpadding(indices, cu, B, S)


def unpad(x: torch.Tensor, plan: Unpadding) -> torch.Tensor:
    """(B, S, ...) -> (nnz, ...): the real tokens of ``x``, packed. Differentiable in ``x``."""
    if tuple(x.shape[:2]) != (plan.batch_size, plan.seq_len):
        raise ValueError(
            f"cannot unpad a tensor of shape {tuple(x.shape)} with indices built for "
            f"(B={plan.batch_size}, S={plan.seq_len}); every channel must share the token layout"
        )
    return x.reshape(plan.batch_size * plan.seq_len, *x.shape[2:]).index_select(0, plan.indices)


def pad(x: torch.Tensor, plan: Unpadding, fill=0) -> torch.Tensor:
    """(nnz, ...) -> (B, S, ...): scatter packed values back, ``fill`` at pad positions.

    The inverse of :func:`unpad` on the real positions; differentiable in ``x`` (the
    gradient of a pad position is dropped). ``x`` is not modified.
    """
    if x.shape[0] != plan.nnz:
        raise ValueError(
            f"pad expects {plan.nnz} packed positions (nnz) along dimension 0, got a tensor of shape "
            f"{tuple(x.shape)}; pass a packed [nnz, ...] tensor produced with the same Unpadding "
            f"(drop the leading [1, nnz] row dimension first)"
        )
    out = x.new_full((plan.batch_size * plan.seq_len, *x.shape[1:]), fill)
    out = out.index_copy(0, plan.indices, x)
    return out.view(plan.batch_size, plan.seq_len, *x.shape[1:])


def packed_position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 for every trajectory.

    Args:
        cu_seqlens: (batch_size + 1,), torch.int32.
    Returns:
        (nnz,), torch.int64. For cu_seqlens [0, 3, 7]: [0, 1, 2, 0, 1, 2, 3].
    """
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    total = int(cu[-1])
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return torch.arange(total, device=cu.device) - starts


def shift_left(x: torch.Tensor, fill=0, dim: int = -1) -> torch.Tensor:
    """The next-token roll: ``out[..., p] = x[..., p + 1]``, ``fill`` at the last position.

    Applied to token ids it gives the targets each logit predicts; applied to the token
    loss mask it moves the mask with them. Unlike ``torch.roll`` nothing wraps around, so
    the first token never reappears as a target. Returns a new tensor.

    Example: shift_left([a, b, c, d], fill=0) -> [b, c, d, 0].
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    if n == 0:
        return x.clone()
    tail = x.new_full((*x.shape[:dim], 1, *x.shape[dim + 1 :]), fill)
    return torch.cat([x.narrow(dim, 1, n - 1), tail], dim)
