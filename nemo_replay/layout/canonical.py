"""The canonical micro-batch and its token-aligned channels (docs/design.md §3).

Coordinates. ``sequences [B, S]`` is left-padded: trajectory i's ``L_i`` real tokens sit in
columns ``[S - L_i, S)``; its last ``R_i`` tokens are the response. The logit at column c
predicts the token at column c + 1, so logit-coordinate channels are ``[B, S - 1]``.

Worked example, S = 6, one trajectory with prompt ``p0 p1`` and response ``r0 r1 r2``
(R = 3, L = 5, one left pad ``_``), support rows ``s0 s1 s2``:

    token column     0    1    2    3    4    5
    sequences        _    p0   p1   r0   r1   r2
    logit column     0    1    2    3    4          (logit c predicts token c + 1)
    sampled_ids      p0   p1   r0   r1   r2         sequences[:, 1:]
    row_ids          -1   -1   s0   s1   s2         row j at logit column S - 1 - R + j
    loss_mask(tok)   0    0    0    1    1    1     right-aligned [B, A], A <= S
    loss_mask(logit) 0    0    1    1    1          token mask shifted with the targets
    trajectory_ids   -1   0    0    0    0          -1 where the logit position is padding

Support rows are placed at logit positions and never rolled; the loss mask is a token
quantity and moves with the targets. Every channel the strategies carry starts here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Union

import torch

from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["ReplayBatch", "CanonicalChannels", "canonical_channels", "response_columns", "position_ids", "Support"]

Support = Union[PackedTensor, RaggedSupport]


@dataclass
class ReplayBatch:
    """One trainer micro-batch in canonical coordinates.

    Attributes:
        sequences: (B, S), int64. Left-padded prompt + response tokens.
        attention_mask: (B, S), bool. True on real tokens (a suffix of each row).
        response_lengths: (B,), int64. ``R_i``: response tokens of trajectory i, including
            observation tokens and any synthetic EOS the trainer appended.
        loss_mask: (B, A), bool or float. Token-position mask right-aligned to the last A
            columns of ``sequences`` (A <= S).
        support: ``R_i`` rows per trajectory (all -1 / empty rows where nothing was
            sampled), or None when replay is off.
        routes: optional MoE routes, ``L_i`` rows ``[layers, topk]`` per trajectory (R3).
        rollout_logprobs: optional (B, A) float, the engine's log-probs (diagnostics).
        advantages: optional (B,) or (B, A) float.
        old_logprobs: optional (B, A) float, the old policy's log-probs (``recompute`` role).
        ref_logprobs: optional (B, A) float, the reference model's log-probs (``reference`` role).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_lengths: torch.Tensor
    loss_mask: torch.Tensor
    support: Optional[Support] = None
    routes: Optional[PackedTensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    @property
    def seq_len(self) -> int:
        return self.sequences.shape[1]

    @property
    def response_width(self) -> int:
        return self.loss_mask.shape[1]

    def validate(self) -> None:
        seq, am = self.sequences, self.attention_mask
        if seq.dim() != 2 or seq.dtype.is_floating_point:
            raise ValueError(f"sequences must be an integer [B, S] tensor, got {seq.dtype} {tuple(seq.shape)}")
        B, S = seq.shape
        if am.shape != (B, S):
            raise ValueError(f"attention_mask has shape {tuple(am.shape)}, expected {(B, S)} like sequences")
        am = am.bool()
        # Left padding: once a row turns real it stays real.
        if S > 1 and (am[:, :-1] & ~am[:, 1:]).any():
            i = int(torch.nonzero((am[:, :-1] & ~am[:, 1:]).any(1))[0])
            raise ValueError(
                f"trajectory {i}: attention_mask is not left-padded (real tokens must be a suffix of the "
                f"row); right-padded batches must be flipped to left padding before replay"
            )
        lengths = am.sum(1)
        R = torch.as_tensor(self.response_lengths)
        if R.shape != (B,):
            raise ValueError(f"response_lengths has shape {tuple(R.shape)}, expected ({B},)")
        bad = torch.nonzero((R < 1) | (R >= lengths.to(R.device)))
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"trajectory {i}: response_length {int(R[i])} must be in [1, L_i - 1] with L_i={int(lengths[i])} "
                f"real tokens (a response needs at least one prompt token before it)"
            )
        lm = self.loss_mask
        if lm.dim() != 2 or lm.shape[0] != B or not 1 <= lm.shape[1] <= S - 1:
            raise ValueError(
                f"loss_mask has shape {tuple(lm.shape)}, expected [B={B}, A] right-aligned token positions "
                f"with 1 <= A <= S-1={S - 1}"
            )
        if self.support is not None:
            if len(self.support) != B:
                raise ValueError(f"support holds {len(self.support)} trajectories, the batch {B}")
            rows = self.support.lengths.cpu()
            mismatch = torch.nonzero(rows != R.cpu())
            if mismatch.numel():
                i = int(mismatch[0])
                raise ValueError(
                    f"trajectory {i} has {int(rows[i])} support rows for {int(R[i])} response tokens; every "
                    f"response token needs exactly one row (an all -1 padding row where the engine sampled "
                    f"nothing: observation tokens, a synthetic EOS)"
                )
        if self.routes is not None:
            if len(self.routes) != B:
                raise ValueError(f"routes hold {len(self.routes)} trajectories, the batch {B}")
            mismatch = torch.nonzero(self.routes.lengths.cpu() != lengths.cpu())
            if mismatch.numel():
                i = int(mismatch[0])
                raise ValueError(
                    f"trajectory {i} has {int(self.routes.lengths[i])} route rows for {int(lengths[i])} real "
                    f"tokens; routes are token-aligned over the whole sequence (prompt and response)"
                )

    def select(self, index: torch.Tensor) -> "ReplayBatch":
        """Trajectories ``index`` (1-D int) as a new batch; support and routes follow."""
        index = torch.as_tensor(index, dtype=torch.int64)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                out[f.name] = None
            elif isinstance(v, (PackedTensor, RaggedSupport)):
                out[f.name] = v.gather(index)
            else:
                out[f.name] = v[index.to(v.device)]
        return ReplayBatch(**out)

    def to(self, device) -> "ReplayBatch":
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if getattr(self, f.name) is not None
            },
        )


@dataclass
class CanonicalChannels:
    """Token-aligned channels in logit coordinates, all ``(B, S - 1)``.

    Attributes:
        sampled_ids: int64, the token each logit position predicts (``sequences[:, 1:]``).
        row_ids: int64, global support row scored at that logit position, -1 for none.
        loss_mask: bool, the token loss mask shifted with the targets.
        trajectory_ids: int64, batch index, -1 on padding.
    """

    sampled_ids: torch.Tensor
    row_ids: torch.Tensor
    loss_mask: torch.Tensor
    trajectory_ids: torch.Tensor


def response_columns(response_lengths: torch.Tensor, num_columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where response token j of trajectory i sits in right-aligned ``[B, num_columns]`` logit coordinates.

    Returns ``(batch_index, column)``, each (sum(R_i),) int64, trajectory-major with j
    increasing; column = num_columns - R_i + j.
    """
    R = torch.as_tensor(response_lengths, dtype=torch.int64)
    b = torch.repeat_interleave(torch.arange(R.numel(), device=R.device), R)
    starts = torch.cumsum(R, 0) - R
    j = torch.arange(int(R.sum()), device=R.device) - starts[b]
    return b, num_columns - R[b] + j


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: ``cumsum(mask) - 1``, 0 on padding.

    Args:
        attention_mask: (B, S), bool or int.
    Returns:
        (B, S), int64. Example: mask ``[0 0 1 1 1]`` -> ``[0 0 0 1 2]``.
    """
    return (attention_mask.to(torch.int64).cumsum(-1) - 1).clamp(min=0)


def canonical_channels(batch: ReplayBatch) -> CanonicalChannels:
    """Build the logit-coordinate channels of a canonical batch (see the module example)."""
    seq = batch.sequences
    B, S = seq.shape
    device = seq.device
    sampled_ids = seq[:, 1:].to(torch.int64)
    # Token loss mask [B, A] lives in token columns [S - A, S); shifting with the targets
    # puts token column t at logit column t - 1, i.e. the last A columns of [B, S - 1].
    A = batch.loss_mask.shape[1]
    loss_mask = torch.zeros(B, S - 1, dtype=torch.bool, device=device)
    loss_mask[:, S - 1 - A :] = batch.loss_mask.to(device) != 0
    am = batch.attention_mask.to(device).bool()[:, :-1]
    trajectory_ids = torch.where(am, torch.arange(B, device=device)[:, None], torch.full_like(sampled_ids, -1))
    loss_mask &= am
    row_ids = torch.full((B, S - 1), -1, dtype=torch.int64, device=device)
    if batch.support is not None:
        b, col = response_columns(batch.response_lengths.to(device), S - 1)
        # Rows are packed trajectory-major with R_i rows each (checked by the batch), so
        # the global row of (i, j) is cu_seqlens[i] + j = its index in this enumeration.
        row_ids[b, col] = torch.arange(b.numel(), device=device)
    return CanonicalChannels(sampled_ids, row_ids, loss_mask, trajectory_ids)
