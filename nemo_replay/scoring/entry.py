"""The scorer's one entry point: every strategy and integration scores through :func:`score_positions`
(docs/design.md §4).

A caller brings only what its framework decides -- where the tokens, the logits and the
support rows are:

- ``source``: logits ``(*, V_local)``, or hidden states ``(*, H)`` with the LM-head weight;
- :class:`~nemo_replay.layout.channels.ScorerChannels`: five channels shaped like the positions ``[*]``;
- ``support``: the batch's rows (either form, :mod:`nemo_replay.support`).

:func:`score_positions` owns the rest: over the recorded support or the whole vocabulary, this rank's
vocabulary shard, and the ranks of a group that split one micro-batch (context or sequence
parallel) failing together with one error (:func:`~nemo_replay.distributed.groups.agree`).
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_replay.distributed.groups import agree, flag_device
from nemo_replay.layout.channels import ScorerChannels
from nemo_replay.layout.checks import Where, check_canonical
from nemo_replay.scoring.scorer import SupportArg, SupportScores, score_aligned_support, score_full_vocabulary
from nemo_replay.scoring.shard import VocabShard
from nemo_replay.support.ragged import as_support

__all__ = ["ScorerChannels", "score_positions"]


def score_positions(
    source: torch.Tensor,
    channels: ScorerChannels,
    support: Optional[SupportArg] = None,
    *,
    replay: bool = True,
    shard: Optional[VocabShard] = None,
    lm_head_weight: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    compute_support_mass: bool = False,
    chunk_size: Optional[int] = None,
    validate: bool = True,
    group=None,
    group_name: str = "SP",
    context: str = "",
    canonical: Optional[ScorerChannels] = None,
    where: Optional[Where] = None,
    hint: str = "",
) -> SupportScores:
    """Score one micro-batch's positions on this rank.

    Args:
        source: logits ``(*, V_local)`` or hidden states ``(*, H)`` with ``lm_head_weight``.
        channels: :class:`ScorerChannels`, each shaped like ``source``'s positions.
        support: the rows ``channels.row_ids`` index (unused with ``replay=False``).
        replay: True: each loss-active position over its recorded row (one synthetic EOS
            per trajectory over the vocabulary). False: every position that predicts a real
            token (``trajectory_ids >= 0``) over the whole vocabulary.
        shard: this rank's vocabulary slice and its tensor-parallel group (None: the whole
            vocabulary on this rank).
        temperature, compute_entropy, compute_support_mass, chunk_size, validate: as in
            :func:`~nemo_replay.scoring.scorer.score_aligned_support` (the full-vocabulary
            path reads only the temperature and the entropy flag).
        group: the group the positions of one micro-batch are split over (context or
            sequence parallel), or None. A rank that rejects its slice would leave the others
            waiting in the next collective: every rank raises the same error, prefixed with
            ``"<group_name> rank r of n: "``.
        context: what the positions are, prefixed to a ``ValueError`` (for example how a
            framework's trajectory and token position read).
        canonical: the whole sequences' channels, ``(B, S - 1)`` in the caller's coordinates, for a
            caller whose positions are a slice of them (context parallel): membership and the
            synthetic-EOS rule are checked on them first
            (:func:`~nemo_replay.layout.checks.check_canonical`, naming positions with ``where``
            and adding ``hint`` to a membership error), over the same decoded rows.

    Returns:
        :class:`~nemo_replay.scoring.scorer.SupportScores` shaped like the positions.
    """

    def run() -> SupportScores:
        try:
            if not replay:
                return score_full_vocabulary(
                    source, channels.sampled_ids, loss_mask=channels.trajectory_ids >= 0, shard=shard,
                    lm_head_weight=lm_head_weight, temperature=temperature, compute_entropy=compute_entropy,
                    trajectory_ids=channels.trajectory_ids, token_positions=channels.token_positions,
                )
            if support is None:
                raise ValueError(
                    "replay scores over the recorded support but none was given (support=None); pass the batch's "
                    "rows, or score with replay=False"
                )
            rows = as_support(support, source.device)  # compact rows decode here, once (docs/design.md §2)
            if canonical is not None:
                if getattr(rows, "decode_flag", None) is not None:
                    rows.check()  # the decode's own checks before any row is read
                check_canonical(canonical, rows, hint=hint, where=where)
            return score_aligned_support(
                source, channels.sampled_ids, channels.row_ids, channels.loss_mask, rows, shard=shard,
                lm_head_weight=lm_head_weight, temperature=temperature, trajectory_ids=channels.trajectory_ids,
                compute_entropy=compute_entropy, compute_support_mass=compute_support_mass, chunk_size=chunk_size,
                validate=validate, token_positions=channels.token_positions,
            )
        except ValueError as exc:
            if not context:
                raise
            raise type(exc)(f"{context}: {exc}") from exc

    return agree(run, group, device=flag_device(group, source.device), name=group_name)
