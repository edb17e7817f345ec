"""The fsdp strategy's token layout: canonical channels through unpad, roll and Ulysses.

Channels start in canonical coordinates (:func:`~nemo_replay.layout.canonical.canonical_channels`)
and are laid out ``(B, S)`` like the tokens, one value per token position p:

- ``row_ids``: the support row of the *logit* at p (it predicts token p + 1). Canonical
  logit column c is token column c, so the canonical ``(B, S-1)`` row ids are the first
  S-1 columns and the last token gets -1. They are never rolled.
- ``trajectory_ids``: batch index of token p, -1 on padding. Never rolled.
- ``loss_mask``: a *token* quantity: the canonical logit mask moved back one column
  (``token_mask[:, c + 1] = loss_mask[:, c]``), then rolled with the targets.

Then, in order, the same transforms for every channel and the tokens:

1. padding removal (optional): the same non-pad indices, one packed row ``[1, nnz]``;
   position ids restart per trajectory;
2. the roll: targets = tokens shifted left by one, loss mask shifted alike;
3. Ulysses (SP > 1): pad to a multiple of sp and slice, fill 0 for ids, positions and
   the loss mask, -1 for row ids and trajectory ids.

Worked example, S = 5, B = 1, prompt ``p0 p1``, response ``r0 r1`` (one left pad ``_``),
support rows 0, 1 for r0, r1, no padding removal, no SP:

    token column      0    1    2    3    4
    tokens            _    p0   p1   r0   r1
    canonical (logit columns 0..3)
      sampled_ids     p0   p1   r0   r1
      row_ids         -1   -1   0    1
      loss_mask       0    0    1    1
    token layout
      row_ids         -1   -1   0    1    -1      canonical + a -1 column, not rolled
      loss_mask(tok)  0    0    0    1    1       canonical moved back one column
      trajectory_ids  -1   0    0    0    0
    after the roll
      targets         p0   p1   r0   r1   0       tokens shifted left, fill 0
      loss_mask       0    0    1    1    0       moved with the targets
    scored            position 2 predicts r0 over row 0, position 3 r1 over row 1

Outputs come back through :meth:`FSDPLayout.to_canonical`: gathered over SP, unpadded
back to ``(B, S)`` and cut to the canonical ``(B, S-1)`` logit columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nemo_replay.batch import ReplayBatch
from nemo_replay.layout.canonical import canonical_channels, position_ids
from nemo_replay.layout.channels import ScorerChannels
from nemo_replay.distributed.groups import group_size_rank
from nemo_replay.layout.ulysses import gather_sequence, pad_and_slice, padded_length
from nemo_replay.layout.unpad import Unpadding, pad, shift_left, unpad, unpad_indices
from nemo_replay.strategies.fsdp.attention import UlyssesPlan

__all__ = ["FSDPLayout", "token_channels", "build_layout"]


@dataclass
class FSDPLayout:
    """One micro-batch as this rank feeds it to the model and the scorer.

    ``R`` is B (padded) or 1 (padding removed); ``T`` the positions this rank holds
    (S or nnz, then ``padded_length(., sp) / sp`` under SP). All channel tensors are
    (R, T) on this rank.

    Attributes:
        input_ids: (R, T), torch.int64. Tokens.
        position_ids: (R, T), torch.int64. Global positions, restarting per trajectory.
        attention_mask: (B, S), torch.int64 for the model (padded mode without SP), else None.
        channels: the scorer's channels, each (R, T): ``sampled_ids`` int64, the targets
            (tokens rolled left by one); ``row_ids`` int64, the support row per logit
            position, -1 none; ``loss_mask`` bool, rolled with the targets;
            ``trajectory_ids`` int64, -1 on padding; ``token_positions`` int64, the column
            of ``batch.sequences`` holding the token each position predicts (rolled with the
            targets), for error messages.
        ulysses_plan: the SP group and full-sequence segment ids, None without SP.
        canonical: the canonical channels the layout was built from.
        unpadding: the non-pad indices, None in padded mode.
        model_len: positions per row before the SP padding (S or nnz).
        group: the SP group, or None.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    channels: ScorerChannels
    ulysses_plan: Optional[UlyssesPlan]
    canonical: ScorerChannels
    unpadding: Optional[Unpadding]
    model_len: int
    group: object = None

    def model_inputs(self) -> dict:
        """Keyword arguments of the Hugging Face forward."""
        kwargs = dict(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False)
        if self.attention_mask is not None:
            kwargs["attention_mask"] = self.attention_mask
        if self.ulysses_plan is not None:
            kwargs["ulysses_plan"] = self.ulysses_plan
        return kwargs

    def to_canonical(self, x: torch.Tensor, *, fill=0, grad_scale: float = 1.0) -> torch.Tensor:
        """(R, T) per-position output of this rank -> (B, S-1) canonical logit columns.

        Gathers over SP (``grad_scale`` as in :func:`~nemo_replay.layout.ulysses.gather_sequence`),
        scatters packed positions back to ``(B, S)`` with ``fill`` at padding, and drops the
        last token column (its logit predicts nothing). Differentiable in ``x``.
        """
        x = gather_sequence(x, self.group, dim=1, seq_len=self.model_len, grad_scale=grad_scale)
        if self.unpadding is not None:
            x = pad(x[0], self.unpadding, fill)
        return x[:, :-1]


def token_channels(channels: ScorerChannels, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Canonical ``(B, S-1)`` logit channels -> ``(B, S)`` token layout (module docstring).

    Returns ``row_ids`` (int64, -1 in the last column), ``loss_mask`` (bool, token
    positions) and ``trajectory_ids`` (int64, -1 on padding), each (B, S).
    """
    B = channels.row_ids.shape[0]
    device = channels.row_ids.device
    minus_one = torch.full((B, 1), -1, dtype=torch.int64, device=device)
    no = torch.zeros((B, 1), dtype=torch.bool, device=device)
    real = attention_mask.to(device) != 0
    return {
        "row_ids": torch.cat([channels.row_ids, minus_one], 1),
        "loss_mask": torch.cat([no, channels.loss_mask], 1),
        "trajectory_ids": torch.where(real, torch.arange(B, device=device)[:, None], -1),
    }


def build_layout(batch: ReplayBatch, *, remove_padding: bool = True, sp_group=None) -> FSDPLayout:
    """Lay a canonical micro-batch out for the model and the scorer on this rank.

    Args:
        batch: the canonical micro-batch (same on every rank of ``sp_group``).
        remove_padding: pack the real tokens into one row (varlen) instead of keeping
            the left-padded ``(B, S)`` rows.
        sp_group: the Ulysses SP group, or None.
    """
    channels = canonical_channels(batch)
    tokens = batch.sequences.to(torch.int64)
    device = tokens.device
    real = batch.attention_mask.to(device) != 0
    chan = token_channels(channels, real)
    # Left padding: the first real token of every row is position 0 (mask [0 1 1 1] ->
    # positions [0 0 1 2]); unpadded, the same values restart at every trajectory.
    positions = position_ids(real)
    columns = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    unpadding = None
    if remove_padding:
        unpadding = unpad_indices(real)
        tokens = unpad(tokens, unpadding)[None]
        positions = unpad(positions, unpadding)[None]
        columns = unpad(columns, unpadding)[None]
        chan = {name: unpad(t, unpadding)[None] for name, t in chan.items()}

    # The roll: targets and the loss mask move; row ids and trajectory ids stay.
    sampled = shift_left(tokens, 0, dim=1)
    loss_mask = shift_left(chan["loss_mask"], False, dim=1)
    model_len = tokens.shape[1]

    sp, _ = group_size_rank(sp_group)
    plan = None
    if sp > 1:
        seg = chan["trajectory_ids"]
        tail = padded_length(model_len, sp) - model_len
        seg = torch.cat([seg, seg.new_full((seg.shape[0], tail), -1)], 1)
        plan = UlyssesPlan(sp_group, seg)

    def local(t, fill):
        return pad_and_slice(t, sp_group, fill=fill, dim=1)

    return FSDPLayout(
        input_ids=local(tokens, 0),
        position_ids=local(positions, 0),
        attention_mask=real.to(torch.int64) if (not remove_padding and sp == 1) else None,
        channels=ScorerChannels(
            sampled_ids=local(sampled, 0),
            row_ids=local(chan["row_ids"], -1),
            loss_mask=local(loss_mask, False),
            trajectory_ids=local(chan["trajectory_ids"], -1),
            token_positions=local(shift_left(columns, -1, dim=1), -1),
        ),
        ulysses_plan=plan,
        canonical=channels,
        unpadding=unpadding,
        model_len=model_len,
        group=sp_group,
    )
