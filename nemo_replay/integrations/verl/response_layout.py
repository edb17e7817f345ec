"""verl 0.9.1's token coordinates on the trainer side (docs/design.md §3, §9.3). Imports no verl.

Legend: b samples in a micro-batch, T = sum L_i packed tokens, R the response width
(columns of ``responses`` and of ``generation_support``), K the support width, n slots of
a model output (packed, padded, sliced: whatever shape verl gives the logits).

What verl's engines see (``workers/utils/padding.py`` ``left_right_2_no_padding``): each
sample's real tokens, prompt then response, as one row of a nested ``input_ids``; its offsets
``cu_seqlens`` (b + 1,) place sample i at packed tokens ``[cu_i, cu_{i+1})``, ``L_i`` tokens of
which the last ``R_i`` are its response. The response tensors stay ``[b, R]``, right-padded:
``responses``, ``response_mask`` and the rows ``generation_support [b, R, K]``, row j being
the support response token j was sampled from. verl reads the response back from the packed
log-probs at ``cu_{i+1} - R_i - 1 + j`` (``no_padding_2_padding``): the logit at packed
position q predicts packed token q + 1.

Every slot of a model output is named here by ONE integer: the packed index of the token
its logit predicts (``-1``: none -- a sequence's last token, padding). Everything the scorer
needs follows from it (:func:`slot_channels`), so the engines only have to carry that one
channel through verl's own transforms -- the FSDP roll, static pad and Ulysses slice, the
Megatron packing and CP split -- exactly as verl carries the tokens.

Worked example: two samples, prompts of 2 and 1 tokens, responses of 2 and 3 (R = 3)::

    sample            0   0   0   0   1   1   1   1
    packed token t    0   1   2   3   4   5   6   7        cu = [0, 4, 8]
    token             p0  p1  a0  a1  q0  b0  b1  b2       L = [4, 4], R_i = [2, 3]
    predicts (q + 1)  1   2   3   -1  5   6   7   -1       (-1: the roll would cross samples)
    response pos j    -   0   1   -   -   0   1   2        j = predicted - cu_i - (L_i - R_i)
    row id, dense     -1  0   1   -1  -1  3   4   5        row_ids[i, j] = i * R + j: generation_support[i, j]
    row id, compact   -1  0   1   -1  -1  2   3   4        row_ids[i, j]: sample i's rows after those before it

verl's own roll (``torch.roll(input_ids_rmpad, -1)``) gives slot 3 the token q0 and slot 7
the token p0; those slots score nothing here and verl never reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nemo_replay.scoring.entry import ScorerChannels

__all__ = [
    "ResponseLayout",
    "response_layout",
    "next_token_index",
    "padded_next_token_index",
    "next_from_own",
    "slot_channels",
]


@dataclass(frozen=True)
class ResponseLayout:
    """Where the response tokens of one micro-batch sit in its packed token stream.

    Attributes:
        cu_seqlens: (b + 1,), int64. Offsets of ``input_ids``' nested rows.
        response_lengths: (b,), int64. ``R_i``, real response tokens of sample i.
        response_width: R, the columns of ``responses`` and ``generation_support``.
        response_mask: (b, R), bool. verl's ``response_mask`` (its loss mask).
        sample_ids: (b,), int64. How errors name sample i (its index in the batch the
            engine was handed, carried through verl's micro-batching).
        row_ids: (b, R), int64, the support row of response position j of sample i (-1: none).
    """

    cu_seqlens: torch.Tensor
    response_lengths: torch.Tensor
    response_width: int
    response_mask: torch.Tensor
    sample_ids: torch.Tensor
    row_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def to(self, device) -> "ResponseLayout":
        return ResponseLayout(
            self.cu_seqlens.to(device), self.response_lengths.to(device), self.response_width,
            self.response_mask.to(device), self.sample_ids.to(device),
            self.row_ids.to(device),
        )


def response_layout(
    cu_seqlens: torch.Tensor,
    response_lengths: torch.Tensor,
    response_mask: torch.Tensor,
    sample_ids: Optional[torch.Tensor] = None,
    row_ids: Optional[torch.Tensor] = None,
) -> ResponseLayout:
    """Check and hold a micro-batch's coordinates.

    Args:
        cu_seqlens: (b + 1,), int. ``input_ids.offsets()``.
        response_lengths: (b,), int. ``R_i``, as ``no_padding_2_padding`` computes it.
        response_mask: (b, R), bool/int/float.
        sample_ids: (b,), int; default ``arange(b)``.
        row_ids: (b, R), int64, the row of each response position; default ``i * R + j`` (the
            dense ``generation_support [b, R, K]`` flattened).

    Raises:
        ValueError when a response does not fit its sample: verl needs at least one prompt
        token before it (``no_padding_2_padding`` asserts ``prompt_len > 0``) and at most R.
    """
    cu = cu_seqlens.to(torch.int64)
    lengths = response_lengths.to(device=cu.device, dtype=torch.int64)
    b = lengths.numel()
    if cu.shape != (b + 1,) or response_mask.dim() != 2 or response_mask.shape[0] != b:
        raise ValueError(
            f"micro-batch shapes disagree: input_ids offsets {tuple(cu.shape)}, response lengths {tuple(lengths.shape)}, "
            f"response_mask {tuple(response_mask.shape)}; expected ({b + 1},), ({b},), ({b}, R)"
        )
    width = int(response_mask.shape[1])
    total = cu[1:] - cu[:-1]
    bad = torch.nonzero((lengths < 0) | (lengths > width) | (lengths >= total)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"sample {i} of the micro-batch has {int(lengths[i])} response tokens in a sequence of {int(total[i])} "
            f"tokens with responses {width} wide; a response needs at least one prompt token before it and at most "
            f"response_length tokens (attention_mask and input_ids come from different batches?)"
        )
    ids = torch.arange(b, dtype=torch.int64, device=cu.device) if sample_ids is None else sample_ids.to(torch.int64)
    if row_ids is None:
        row_ids = torch.arange(b * width, dtype=torch.int64, device=cu.device).view(b, width)
    elif tuple(row_ids.shape) != (b, width):
        raise ValueError(f"row_ids has shape {tuple(row_ids.shape)}, expected ({b}, {width}) like response_mask: the "
                         f"row of each response position (read_responses builds it)")
    return ResponseLayout(cu, lengths, width, response_mask.to(cu.device) != 0, ids.to(cu.device),
                          row_ids.to(device=cu.device, dtype=torch.int64))


def next_token_index(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(T,) int64: the packed token each packed logit predicts, -1 at each sequence's last token.

    The same roll verl applies to ``input_ids_rmpad`` (FSDP ``prepare_model_inputs``), applied
    to the token indices, then the slots where the roll crosses into the next sample are
    marked -1. Example: cu = [0, 4, 8] -> [1, 2, 3, -1, 5, 6, 7, -1].
    """
    cu = cu_seqlens.to(torch.int64)
    total = int(cu[-1])
    index = torch.roll(torch.arange(total, dtype=torch.int64, device=cu.device), shifts=-1, dims=0)
    if total:
        index[cu[1:] - 1] = -1  # zero-length samples are refused by response_layout
    return index


def padded_next_token_index(cu_seqlens: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits ``[b, width]`` over right-padded rows (verl FSDP without remove-padding).

    Returns:
        predicted: (b, width), int64. Packed token each logit predicts, -1 where none.
        flat: (b, width), int64. Packed index of each slot's own token, -1 on padding (where
            the slot's result lands in verl's packed ``log_probs``).

    Example: cu = [0, 4, 7], width 4 -> predicted [[1, 2, 3, -1], [5, 6, -1, -1]],
    flat [[0, 1, 2, 3], [4, 5, 6, -1]].
    """
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    col = torch.arange(width, dtype=torch.int64, device=cu.device)[None, :]
    flat = cu[:-1, None] + col
    real = col < lengths[:, None]
    predicted = torch.where(col + 1 < lengths[:, None], flat + 1, -1)
    return predicted, torch.where(real, flat, -1)


def next_from_own(own_plus_one: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Predicted tokens from a channel holding each slot's OWN packed token index + 1 (0: padding).

    verl's Megatron forward packs and CP-splits every nested tensor it hands the logits
    processor with zero padding, rolling only the labels; the channel is carried unrolled and
    shifted by one so that its padding reads as "no token". Slot with own token t predicts
    t + 1 when t + 1 is in the same sample. Example: cu = [0, 4, 8], own + 1 =
    [1, 2, 3, 4, 0, 0, 5, 6, 7, 8] -> [1, 2, 3, -1, -1, -1, 5, 6, 7, -1].
    """
    cu = cu_seqlens.to(device=own_plus_one.device, dtype=torch.int64)
    own = own_plus_one.to(torch.int64) - 1
    seq = torch.searchsorted(cu[1:], own.clamp(min=0), right=True)
    seq = seq.clamp(max=cu.numel() - 2)
    same = (own >= 0) & (own + 1 < cu[seq + 1])
    return torch.where(same, own + 1, -1)


def slot_channels(layout: ResponseLayout, predicted: torch.Tensor, sampled_ids: torch.Tensor) -> ScorerChannels:
    """Scorer channels (docs/design.md §3) of slots that predict the packed tokens ``predicted`` (any
    shape, -1 = none), each shaped like ``predicted``.

    ``sampled_ids`` are verl's labels (the token each slot's logit predicts). Row ids sit at the
    slot of the logit that predicts the token (never rolled, §3): ``layout.row_ids[i, j]`` for
    response position j of sample i, -1 where the slot
    predicts no response token. The loss mask is the predicted token's ``response_mask``;
    trajectories are ``sample_ids[i]``; token positions the response position j (errors name
    it).
    """
    lay = layout.to(predicted.device)
    p = predicted.to(torch.int64)
    has = (p >= 0) & (p < lay.num_tokens)
    q = torch.where(has, p, 0)
    seq = torch.searchsorted(lay.cu_seqlens[1:], q, right=True).clamp(max=lay.sample_ids.numel() - 1)
    start = lay.cu_seqlens[1:][seq] - lay.response_lengths[seq]  # first response token of the sample
    j = q - start
    is_response = has & (j >= 0)
    jj = j.clamp(0, max(lay.response_width - 1, 0))
    mask = lay.response_mask[seq, jj] if lay.response_width else torch.zeros_like(is_response)
    none = torch.full_like(p, -1)
    return ScorerChannels(
        sampled_ids=sampled_ids.to(device=p.device, dtype=torch.int64).reshape(p.shape),
        row_ids=torch.where(is_response, lay.row_ids[seq, jj], none),
        loss_mask=is_response & mask,
        trajectory_ids=torch.where(has, lay.sample_ids[seq], none),
        token_positions=torch.where(is_response, j, none),
    )
