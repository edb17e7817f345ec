"""One micro-batch turned into Megatron inputs and aligned channels.

Every channel starts from :func:`~nemo_replay.layout.canonical.canonical_channels` (logit
coordinates ``(B, S - 1)`` of the batch, whatever its padding) and moves through the
micro-batch's :class:`~nemo_replay.strategies.megatron.token_layout.TokenMetadataLayout`; the
support row ids are taken from the canonical channels too, so the layout never re-derives
where a row sits. The policy objective reads its inputs (advantages, old and reference
log-probs) from the batch in the caller's columns, so none of them is laid out here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nemo_replay.batch import ReplayBatch
from nemo_replay.layout.canonical import canonical_channels
from nemo_replay.layout.channels import ScorerChannels
from nemo_replay.layout.checks import check_canonical
from nemo_replay.strategies.base import RoleSettings, role_replays
from nemo_replay.strategies.megatron.token_layout import TokenMetadataLayout

__all__ = [
    "PreparedMicroBatch",
    "prepare_micro_batch",
]


@dataclass
class PreparedMicroBatch:
    """A micro-batch ready for one forward step; tensors are on the model's device.

    Attributes:
        index: position of the micro-batch in the role's list.
        batch: the canonical batch.
        canonical: its canonical channels, ``(B, S - 1)``.
        layout: the token layout on this rank.
        replay: score over the support (True) or the full vocabulary.
        input_ids, position_ids: ``layout.local_shape``, int64 model inputs.
        packed_seq_params: megatron-core ``PackedSeqParams`` in packed mode, else None.
        channels: the scorer's channels at this rank's logit slots, each ``local_shape``
            (:meth:`~nemo_replay.layout.slots.Slots.channels`).
        support: the batch's support on the model's device, or None.
        routes: ``(*local_shape, layers, topk)`` int64 recorded MoE routes (-1 on padding), or None.
    """

    index: int
    batch: ReplayBatch
    canonical: ScorerChannels
    layout: TokenMetadataLayout
    replay: bool
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: Optional[object]
    channels: ScorerChannels
    support: Optional[object] = None
    routes: Optional[torch.Tensor] = None


def prepare_micro_batch(
    index: int,
    batch: ReplayBatch,
    *,
    role: str,
    settings: RoleSettings,
    tp_size: int,
    cp_size: int,
    cp_rank: int,
    fp8: bool,
    packed: bool,
    device,
    min_length: Optional[int] = None,
    pad_id: int = 0,
    with_routes: bool = False,
) -> PreparedMicroBatch:
    """Lay out ``batch`` for this rank and align every channel the role needs.

    Raises:
        ValueError: replay on without support; route replay without routes; the
            synthetic-EOS rule broken; and the layout's own errors (CP without packing, a
            row holding several trajectories). The objective's own inputs are checked by
            the strategy (:func:`~nemo_replay.strategies.base.check_policy_batches`).
    """
    replay = role_replays(batch, role, settings, where=f"micro-batch {index}")
    if with_routes and batch.routes is None:
        raise ValueError(
            f"micro-batch {index}: MoE route replay is on but the batch carries no routes; record routes at "
            f"rollout or build the strategy with route_replay=False"
        )
    channels = canonical_channels(batch)
    if replay and cp_size > 1:  # a rank's chunks cannot see the rest of their trajectory
        check_canonical(channels, batch.support)
    layout = TokenMetadataLayout.build(
        batch.attention_mask, tp_size=tp_size, cp_size=cp_size, cp_rank=cp_rank, fp8=fp8, packed=packed,
        min_length=min_length,
    )
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    prepared = PreparedMicroBatch(
        index=index,
        batch=batch,
        canonical=channels,
        layout=layout,
        replay=replay,
        input_ids=to(layout.input_ids(batch.sequences, pad_id)),
        position_ids=to(layout.position_ids()),
        packed_seq_params=layout.packed_seq_params(device) if packed else None,
        channels=layout.slots(logit=True).channels(channels, device),
        support=batch.support.to(device) if replay else None,
    )
    if with_routes:
        # Routes are token-aligned over the whole trajectory: offset 0, no next-token shift.
        starts = torch.zeros(batch.batch_size, dtype=torch.int64)
        prepared.routes = to(layout.align_packed(batch.routes, starts, shift=False, fill=-1)).to(torch.int64)
    return prepared
