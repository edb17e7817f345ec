"""Canonical coordinates of a micro-batch and its token-aligned channels (docs/design.md §3).

Coordinates. ``sequences (B, S)`` holds one trajectory per row whose ``L_i`` real tokens
form one contiguous run of columns ``[s_i, e_i)``; its last ``R_i`` real tokens are the
response. The logit at column c predicts the token at column c + 1, so logit-coordinate
channels are ``(B, S - 1)``. Every layout trainers use is such a run, read as it is (no
copy into another padding):

    left-padded (the reference trainer)         _  _  p0 p1 r0 r1 r2      e_i = S
    right-padded (NeMo-RL, Hugging Face)        p0 p1 r0 r1 r2 _  _       s_i = 0
    left-padded prompt, right-padded completion _  p0 p1 r0 r1 r2 _       prompt ends at a fixed column

Per-token fields (``loss_mask``, ``old_logprobs``, ...) are ``(B, A)`` and cover the last A
token columns ``[S - A, S)``: ``A = S`` is the whole row (token-aligned, NeMo-RL's
``token_mask``), ``A < S`` a right-aligned response window of a left-padded batch.

Worked example, S = 6, one left-padded trajectory with prompt ``p0 p1`` and response
``r0 r1 r2`` (R = 3, L = 5, one left pad ``_``), support rows ``s0 s1 s2``:

    token column     0    1    2    3    4    5
    sequences        _    p0   p1   r0   r1   r2
    logit column     0    1    2    3    4          (logit c predicts token c + 1)
    sampled_ids      p0   p1   r0   r1   r2         sequences[:, 1:]
    row_ids          -1   -1   s0   s1   s2         row j at logit column e - 1 - R + j
    loss_mask(tok)   0    0    0    1    1    1     [B, A=3]: token columns 3..5
    loss_mask(logit) 0    0    1    1    1          token mask shifted with the targets
    trajectory_ids   -1   0    0    0    0          -1 unless tokens c and c + 1 are real

The same trajectory right-padded (``p0 p1 r0 r1 r2 _``, e = 5): rows s0 s1 s2 sit at logit
columns 1 2 3, logit column 4 (token r2 predicting the pad) has trajectory id -1.

Support rows are placed at logit positions and never rolled; the loss mask is a token
quantity and moves with the targets. Rows may also come token-aligned (the row of token t
at column t, NeMo-RL's ``generation_support``): :func:`token_aligned_channels` shifts them
with the targets, like the sampled ids. Every channel the strategies carry starts here.
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_replay.layout.channels import ScorerChannels

__all__ = [
    "canonical_channels",
    "token_aligned_channels",
    "real_runs",
    "response_columns",
    "position_ids",
    "to_caller_columns",
    "from_caller_columns",
]

def real_runs(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First real column ``s_i`` and one past the last ``e_i`` of each row's single run of real tokens.

    Args:
        attention_mask: (B, S), bool or 0/1 integer.
    Returns:
        (starts, ends), each (B,) int64. Example: ``[0 1 1 1 0]`` -> (1, 4).
    Raises:
        ValueError naming the row when it has no real token or several separate runs.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (B, S), got shape {tuple(attention_mask.shape)}")
    real = attention_mask.bool()
    B, S = real.shape
    lengths = real.sum(1).to(torch.int64)
    empty = torch.nonzero(lengths == 0).flatten()
    if empty.numel():
        raise ValueError(f"trajectory {int(empty[0])}: attention_mask has no real token; drop empty rows")
    runs = real[:, :1].to(torch.int64).squeeze(1) + (real[:, 1:] & ~real[:, :-1]).sum(1)
    multi = torch.nonzero(runs > 1).flatten()
    if multi.numel():
        i = int(multi[0])
        raise ValueError(
            f"trajectory {i}: attention_mask holds {int(runs[i])} separate runs of real tokens; a row holds one "
            f"trajectory whose real tokens are contiguous (padding on the left, the right or both sides)"
        )
    return _run_bounds(real)


def _run_bounds(real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`real_runs` without its checks (no host read), for a mask already checked: (B, S) bool."""
    starts = torch.argmax(real.to(torch.int8), dim=1).to(torch.int64)
    return starts, starts + real.sum(1).to(torch.int64)


def response_columns(
    response_lengths: torch.Tensor, num_columns: int, ends: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where response element j of trajectory i sits: column ``ends_i - R_i + j``.

    Args:
        response_lengths: (B,), int. ``R_i``.
        num_columns: width of the coordinates; ``ends`` defaults to it (right-aligned).
        ends: (B,), int64. One past each trajectory's last column, or None.
    Returns:
        ``(batch_index, column)``, each (sum(R_i),) int64, trajectory-major with j increasing.
        Example: R = [2, 0, 3], 8 columns -> batch [0 0 2 2 2], columns [6 7 5 6 7].
    """
    R = torch.as_tensor(response_lengths, dtype=torch.int64)
    total = int(R.sum())  # the one host read: the output size
    b = torch.repeat_interleave(torch.arange(R.numel(), device=R.device), R, output_size=total)
    starts = torch.cumsum(R, 0) - R
    j = torch.arange(total, device=R.device) - starts[b]
    end = torch.full_like(R, num_columns) if ends is None else torch.as_tensor(ends, dtype=torch.int64).to(R.device)
    return b, end[b] - R[b] + j


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each real token within its trajectory, 0 on padding (any side).

    Args:
        attention_mask: (B, S), bool or int, one contiguous run per row.
    Returns:
        (B, S), int64. Examples: ``[0 0 1 1 1]`` -> ``[0 0 0 1 2]``; ``[1 1 1 0 0]`` ->
        ``[0 1 2 0 0]``.
    """
    real = attention_mask.bool()
    return torch.where(real, real.to(torch.int64).cumsum(-1) - 1, 0)


def to_caller_columns(x: torch.Tensor, width: int, fill=0) -> torch.Tensor:
    """Logit channel ``(B, S - 1, ...)`` -> the caller's ``(B, A=width, ...)`` token columns ``[S - A, S)``.

    Token column t holds the value of logit column t - 1 (the logit that predicts it);
    for ``width == S`` token column 0 gets ``fill`` (no logit predicts it). Differentiable.
    Example, S = 4: logit values ``[a b c]`` -> width 2: ``[b c]``; width 4: ``[fill a b c]``.
    """
    W = x.shape[1]
    if not 1 <= width <= W + 1:
        raise ValueError(f"caller columns must number 1..S={W + 1}, got {width}")
    if width <= W:
        return x[:, W - width :]
    return torch.cat([torch.full_like(x[:, :1], fill), x], 1)


def from_caller_columns(x: torch.Tensor, batch_size: int, num_logits: int, name: str) -> torch.Tensor:
    """(B,) or (B, A) per-token values in the caller's columns -> (B, S - 1) float32 logit columns.

    The inverse of :func:`to_caller_columns` (token column t -> logit column t - 1; token
    column 0 of a token-aligned field is dropped), zeros where the field has no column.
    (B,) values (per-trajectory advantages) are broadcast to every column.
    """
    x = torch.as_tensor(x)
    B, W = batch_size, num_logits
    if x.dim() == 1:
        if x.shape[0] != B:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected ({B},) or ({B}, A)")
        return x[:, None].expand(B, W).to(torch.float32)
    if x.dim() != 2 or x.shape[0] != B or not 1 <= x.shape[1] <= W + 1:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected ({B}, A) with 1 <= A <= S = {W + 1}")
    A = x.shape[1]
    out = torch.zeros(B, W, dtype=torch.float32, device=x.device)
    if A <= W:
        out[:, W - A :] = x.to(torch.float32)
    else:
        out[:] = x[:, 1:].to(torch.float32)
    return out


def token_aligned_channels(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    token_loss_mask: torch.Tensor,
    token_row_ids: torch.Tensor,
) -> ScorerChannels:
    """Logit channels from token-aligned ones: the row and the mask of token t serve the logit at t - 1.

    Args:
        sequences: (B, S), int. Tokens.
        attention_mask: (B, S), bool or int; one contiguous run per row (any padding).
        token_loss_mask: (B, A), bool or float, over token columns ``[S - A, S)`` (A <= S).
        token_row_ids: (B, S), int64. Global support row of token t (-1 none), e.g. the row
            of NeMo-RL's ``generation_support[b, t]``.
    Returns:
        :class:`ScorerChannels`, each (B, S - 1).

    Worked example, right-padded ``p0 p1 r0 r1 _`` (S = 5), rows 7 8 at tokens r0 r1:

        token column         0    1    2    3    4
        token_row_ids        -1   -1   7    8    -1
        logit column         0    1    2    3
        sampled_ids          p1   r0   r1   _          tokens shifted left
        row_ids              -1   7    8    -1         token rows shifted left
        trajectory_ids       0    0    0    -1         logit 3 predicts padding
    """
    B, S = sequences.shape
    device = sequences.device
    real = attention_mask.to(device).bool()
    pair = real[:, :-1] & real[:, 1:]
    A = token_loss_mask.shape[1]
    if token_row_ids.shape != (B, S) or not 1 <= A <= S or token_loss_mask.shape[0] != B:
        raise ValueError(
            f"token channels must be token_row_ids ({B}, {S}) and token_loss_mask ({B}, A <= {S}), got "
            f"{tuple(token_row_ids.shape)} and {tuple(token_loss_mask.shape)}"
        )
    loss_mask = from_caller_columns(token_loss_mask.to(device) != 0, B, S - 1, "token_loss_mask") != 0
    rows = token_row_ids.to(device=device, dtype=torch.int64)[:, 1:]
    return ScorerChannels(
        sampled_ids=sequences[:, 1:].to(torch.int64),
        row_ids=torch.where(pair, rows, -1),
        loss_mask=loss_mask & pair,
        trajectory_ids=torch.where(pair, torch.arange(B, device=device)[:, None], -1),
        token_positions=torch.arange(1, S, device=device).expand(B, S - 1),  # the column of the predicted token
    )


def canonical_channels(batch) -> ScorerChannels:
    """Build the logit-coordinate channels of a :class:`~nemo_replay.batch.ReplayBatch` (see the module example;
    this module sits below the batch type and reads its fields only).

    The ``R_i`` packed support rows of trajectory i belong to its last ``R_i`` real tokens;
    they are placed at those token columns and shifted with the targets
    (:func:`token_aligned_channels`).
    """
    seq = batch.sequences
    B, S = seq.shape
    device = seq.device
    token_rows = torch.full((B, S), -1, dtype=torch.int64, device=device)
    if batch.support is not None:
        # The batch checked its mask when it was built: read the runs without checking again.
        _, ends = _run_bounds(batch.attention_mask.to(device).bool())
        b, col = response_columns(batch.response_lengths.to(device), S, ends)
        # Rows are packed trajectory-major with R_i rows each (checked by the batch), so
        # the global row of (i, j) is cu_seqlens[i] + j = its index in this enumeration.
        token_rows[b, col] = torch.arange(b.numel(), device=device)
    return token_aligned_channels(seq, batch.attention_mask, batch.loss_mask, token_rows)
