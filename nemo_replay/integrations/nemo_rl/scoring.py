"""Replay scores from NeMo-RL's logits and data dict: the one function every hook calls.

:func:`next_token_logprobs` takes what a NeMo-RL worker holds after its forward --
temperature-divided logits (vocab-parallel over TP, CP-local, unpacked rows or one packed
row) and the micro-batch's data dict -- and returns ``(N, W - 1)`` log-probs of the
sampled tokens over their recorded supports (docs/design.md §9), through the shared
scorer. It runs as phases: read the shards, read the data dict, build this rank's
channels (:mod:`.layout`), check the whole sequences, score, gather over CP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from nemo_replay.distributed.compat import dtensor_names
from nemo_replay.distributed.groups import group_size_rank
from nemo_replay.integrations.nemo_rl.token_aligned import canonical_of, check_width, gather_slots, local_slots
from nemo_replay.scoring.entry import score_positions
from nemo_replay.scoring.shard import VocabShard
from nemo_replay.support.dtypes import is_integer
from nemo_replay.support.rows import batch_rows

__all__ = ["ReplayScores", "next_token_logprobs", "vocab_shard_of", "SUPPORT_KEY"]

#: The data-dict key of the token-aligned support rows.
SUPPORT_KEY = "generation_support"


@dataclass
class ReplayScores:
    """Scores in NeMo-RL's next-token columns, each (N, W - 1): column c scores token c + 1.

    Attributes:
        logprobs: float32 (float64 for float64 logits), differentiable; 0 where not scored.
        valid_mask: bool, scored over a recorded support row.
        fallback_mask: bool, scored over the full vocabulary (a synthetic EOS, or all with ``full_vocab``).
    """

    logprobs: torch.Tensor
    valid_mask: torch.Tensor
    fallback_mask: torch.Tensor


def vocab_shard_of(logits, vocab_parallel_rank: Optional[int], vocab_parallel_group) -> tuple[torch.Tensor, VocabShard]:
    """(local logits, this rank's :class:`VocabShard`) for Megatron vocab-parallel or DTensor logits.

    Megatron (``vocab_parallel_group`` given): rank r holds ``[r * V_local, (r + 1) * V_local)``
    (NeMo-RL's ``vocab_start_index``). DTensor (automodel v2): the ``tp`` mesh dimension,
    ``Shard(-1)`` placement (torch.chunk split: ``ceil(V / tp)`` per rank) or ``Replicate``.
    """
    DTensor, Replicate, Shard = dtensor_names()
    if isinstance(logits, DTensor):
        return _dtensor_shard(logits, Replicate, Shard)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 3:
        got = f"{logits.dtype} {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a floating [rows, positions, V_local] tensor, got {got}")
    v_local = logits.shape[-1]
    if vocab_parallel_group is None:
        return logits, VocabShard.whole(v_local)
    tp, rank = group_size_rank(vocab_parallel_group)
    if vocab_parallel_rank is None or int(vocab_parallel_rank) != rank:
        raise ValueError(
            f"vocab_parallel_rank={vocab_parallel_rank!r} is not this rank's rank {rank} in vocab_parallel_group; "
            f"pass NeMo-RL's get_tensor_model_parallel_rank() with its group"
        )
    # The global size is known (an even split), so the scorer checks ids before its collectives
    # instead of learning V from them and reading it back (one host read per call).
    return logits, VocabShard(rank * v_local, (rank + 1) * v_local, vocab_parallel_group, v_local * tp)


def _dtensor_shard(logits, Replicate, Shard):
    mesh = logits.device_mesh
    names = tuple(mesh.mesh_dim_names or ())
    for dim, (name, placement) in enumerate(zip(names, logits.placements)):
        if name != "tp" and not isinstance(placement, Replicate):
            raise ValueError(
                f"DTensor logits are sharded over mesh dimension {name!r} ({placement}); replay scores vocab-parallel "
                f"logits sharded over 'tp' only. Context parallelism of the DTensor worker is not supported: set "
                f"policy.dtensor_cfg.context_parallel_size=1 or use the Megatron backend"
            )
    local = logits.to_local()
    if "tp" not in names or isinstance(logits.placements[names.index("tp")], Replicate):
        return local, VocabShard.whole(local.shape[-1])
    placement = logits.placements[names.index("tp")]
    if not (isinstance(placement, Shard) and placement.dim in (-1, logits.dim() - 1)):
        raise ValueError(f"DTensor logits must be Shard(-1) (vocabulary) over 'tp', got {placement}")
    group = mesh.get_group("tp")
    tp, rank = group_size_rank(group)
    per = -(-logits.shape[-1] // tp)  # torch.chunk: ceil(V / tp) rows per rank, the last ones fewer
    return local, VocabShard(rank * per, rank * per + local.shape[-1], group, logits.shape[-1])


def _tensor(data: Mapping[str, Any], key: str, what: str) -> torch.Tensor:
    if key not in data:
        raise ValueError(
            f"the NeMo-RL data dict has no {key!r} ({what}); replay needs it in every micro-batch it scores"
        )
    value = data[key]
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"data[{key!r}] must be a tensor ({what}), got {type(value).__name__}")
    return value


def _read_data(data: Mapping[str, Any], support_key: str, replay: bool):
    """(input_ids (N, W), input_lengths [N], token_mask (N, W), sample_mask [N], support or None, token_rows or None).

    The rows are a list of one :class:`~nemo_replay.support.rows.SampleRows` a data row (what the replay
    data path puts in NeMo-RL's batches), in the columns of ``input_ids``; ``token_rows`` (N, W) places them.
    """
    ids = _tensor(data, "input_ids", "right-padded tokens (B, S)")
    if ids.dim() != 2 or not is_integer(ids):
        raise ValueError(f"data['input_ids'] must be an integer (B, S) tensor, got {ids.dtype} {tuple(ids.shape)}")
    N, W = ids.shape
    lengths = _tensor(data, "input_lengths", "tokens per row [B]")
    mask = _tensor(data, "token_mask", "loss-active tokens (B, S)")
    sample = _tensor(data, "sample_mask", "trajectories in the loss [B]")
    if lengths.shape != (N,) or mask.shape != (N, W) or sample.shape != (N,):
        raise ValueError(
            f"data dict shapes disagree: input_ids {tuple(ids.shape)}, input_lengths {tuple(lengths.shape)}, token_mask "
            f"{tuple(mask.shape)}, sample_mask {tuple(sample.shape)}; expected ({N}, {W}), ({N},), ({N}, {W}), ({N},)"
        )
    check_width(f"data[{'input_lengths'!r}]", lengths, W)  # before batch_rows places rows by these lengths
    support = token_rows = None
    if replay:
        if support_key not in data:
            raise ValueError(
                f"the NeMo-RL data dict has no {support_key!r} (support rows: one SampleRows a sample); replay needs it "
                f"in every micro-batch it scores" + (": launch with python -m nemo_replay.integrations.nemo_rl.run_grpo, "
                                                      "whose vLLM worker records them" if support_key == SUPPORT_KEY else "")
            )
        support, token_rows = batch_rows(data[support_key], ids, lengths, name=f"data[{support_key!r}]", unit="data row")
    return ids, lengths, mask, sample, support, token_rows


def next_token_logprobs(
    logits,
    data: Mapping[str, Any],
    *,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group=None,
    context_parallel_group=None,
    cu_seqlens_padded: Optional[Sequence[int] | torch.Tensor] = None,
    full_vocab: bool = False,
    support_key: str = SUPPORT_KEY,
    validate: bool = True,
) -> ReplayScores:
    """Log-probs of NeMo-RL's next tokens over their recorded supports.

    Args:
        logits: ``(N, P / cp, V_local)`` (unpacked rows) or ``[1, sum(P_i) / cp, V_local]``
            (packed, with ``cu_seqlens_padded``), already divided by the temperature, any
            float dtype; a torch tensor (Megatron) or a DTensor (automodel). Not modified.
        data: the micro-batch's data dict: ``input_ids (N, W)`` (int, right-padded),
            ``input_lengths [N]``, ``token_mask (N, W)``, ``sample_mask [N]`` and, unless
            ``full_vocab``, ``generation_support``: a list of N
            :class:`~nemo_replay.support.rows.SampleRows`, their columns those of ``input_ids``.
        vocab_parallel_rank, vocab_parallel_group: Megatron's TP rank and group (None: whole
            vocabulary, or the DTensor's own mesh).
        context_parallel_group: the CP group (None: no CP).
        cu_seqlens_padded: (N + 1,) offsets of the padded sequences in the packed row (whole
            sequence, before CP); None for unpacked rows.
        full_vocab: score every real next token over the full vocabulary (a reference pass
            that does not replay).
        validate: check the support invariants (docs/design.md §2) in the scorer.

    Returns:
        :class:`ReplayScores`, (N, W - 1). Loss-active tokens (``token_mask * sample_mask``)
        are scored; with ``full_vocab`` every real next token is.

    Raises:
        ValueError (``SupportAlignmentError`` for a misaligned batch) naming the data row,
        the next-token column, the key or the flag to fix.
    """
    local, shard = vocab_shard_of(logits, vocab_parallel_rank, vocab_parallel_group)
    cp, cp_rank = group_size_rank(context_parallel_group)
    ids, lengths, mask, sample, support, token_rows = _read_data(data, support_key, replay=not full_vocab)
    N, W = ids.shape
    if W < 2:
        raise ValueError(f"data['input_ids'] has width {W}; a next token needs at least 2 columns")
    packed = cu_seqlens_padded is not None
    padded = _padded_lengths(local, N, cp, cu_seqlens_padded)
    check_width("logits", lengths, W, padded)
    canonical = canonical_of(ids, lengths, mask, sample, token_rows)
    host_lengths = lengths.to(torch.int64).cpu()  # slots are host index arithmetic: one copy serves every rank's
    slots = local_slots(padded, cp, cp_rank, packed=packed).logit_slots(host_lengths, W)
    ch = slots.channels(canonical, local.device).flat()
    scores = score_positions(
        local.reshape(-1, local.shape[-1]), ch, support, replay=not full_vocab, shard=shard, validate=validate,
        group=context_parallel_group, group_name="CP", canonical=canonical,  # whole sequences, before the CP split
        hint=f"{support_key} must be sliced like generation_logprobs: the row of token t at column t",
    )
    indices = [  # where every CP rank's slots land in (N, W - 1)
        (slots if r == cp_rank else local_slots(padded, cp, r, packed=packed).logit_slots(host_lengths, W)).canonical_index().to(local.device)
        for r in range(cp)
    ]
    out_shape = (N, W - 1)
    gather = lambda t: gather_slots(t, indices, out_shape, context_parallel_group, cp_rank)  # noqa: E731
    with torch.no_grad():  # both masks in one gather: bit 0 valid, bit 1 fallback
        flags = gather(scores.valid_mask.to(torch.uint8) | (scores.fallback_mask.to(torch.uint8) << 1))
    return ReplayScores(gather(scores.logprobs), (flags & 1) != 0, (flags & 2) != 0)


def _padded_lengths(local: torch.Tensor, N: int, cp: int, cu_seqlens_padded) -> list[int]:
    """P_i of every data row, from the logits (unpacked) or ``cu_seqlens_padded`` (packed)."""
    if cu_seqlens_padded is None:
        if local.shape[0] != N:
            raise ValueError(
                f"logits hold {local.shape[0]} rows for {N} data rows; unpacked logits are (B, S / cp, V_local) "
                f"(packed ones need cu_seqlens_padded)"
            )
        return [local.shape[1] * cp] * N
    cu = torch.as_tensor(cu_seqlens_padded, dtype=torch.int64).cpu()
    if cu.shape != (N + 1,) or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seqlens_padded must be ({N + 1},) non-decreasing offsets from 0 for {N} packed sequences, got "
            f"{cu.tolist()[:8]}"
        )
    if local.shape[0] != 1 or local.shape[1] * cp != int(cu[-1]):
        raise ValueError(
            f"packed logits must be [1, cu_seqlens_padded[-1] / cp = {int(cu[-1])} / {cp}, V_local], got "
            f"{tuple(local.shape)}"
        )
    return (cu[1:] - cu[:-1]).tolist()
