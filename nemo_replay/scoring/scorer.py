"""The one shared scorer (docs/design.md §4).

Every trainer pass (policy, old-policy recompute, reference) of every strategy calls
:func:`score_aligned_support` on channels that a strategy already aligned:

    log p(x | S) = z[x]/T - logsumexp_{s in S} z[s]/T

Legend: N flattened positions, V local vocabulary rows, H hidden size, n positions scored
over a support row, e positions scored over the full vocabulary (synthetic EOS), w support
width.

Tensor parallel (vocabulary sharded over ``shard.group``): each rank scores the members in
its shard. Forward: one MAX all-reduce (stabilisers, plus this rank's vocab end so every
rank learns the global vocabulary size) and one SUM all-reduce carrying denominators,
sampled scores, entropy terms and the support-mass denominators together. Backward: none
in logits mode; one SUM all-reduce of the hidden-state gradient in hidden mode.

Math runs in float32 (float64 when the source is float64) whatever the input dtype.
Inputs are never modified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from nemo_replay.scoring.collectives import all_reduce_max, copy_to_shards, group_size, reduce_sum_from_shards
from nemo_replay.scoring.projection import project_support
from nemo_replay.scoring.selection import select_scores
from nemo_replay.scoring.shard import VocabShard
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport
from nemo_replay.support.validate import validate_support_rows

__all__ = ["SupportScores", "score_aligned_support", "score_full_vocabulary", "check_synthetic_eos", "has_support_row"]

SupportArg = Union[PackedTensor, RaggedSupport, torch.Tensor]
DEFAULT_CHUNK_SIZE = 8192


@dataclass
class SupportScores:
    """Scorer output, shaped like the positions ``[*]`` of the input.

    Attributes:
        logprobs: float32 (float64 for float64 input); 0 where not scored.
        valid_mask: bool, scored over a recorded support row.
        fallback_mask: bool, scored over the full vocabulary (synthetic EOS / replay off).
        entropy: entropy of the scoring distribution, or None; 0 where not scored.
        support_logmass: ``logsumexp_S z/T - logsumexp_V z/T`` (<= 0) on support positions,
            or None; the log of the probability the truncation kept.
    """

    logprobs: torch.Tensor
    valid_mask: torch.Tensor
    fallback_mask: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    support_logmass: Optional[torch.Tensor] = None

    @property
    def scored_mask(self) -> torch.Tensor:
        return self.valid_mask | self.fallback_mask


# ---------------------------------------------------------------------------- checks


def _position(flat: int, shape: torch.Size) -> str:
    """Position of a flattened index along the last position axis (the sequence axis)."""
    if len(shape) == 0:
        return "0"
    return str(flat % shape[-1]) if len(shape) > 1 else str(flat)


def _check_inputs(source, sampled_ids, row_ids, loss_mask, trajectory_ids, lm_head_weight, temperature):
    if not isinstance(source, torch.Tensor) or not source.is_floating_point():
        raise ValueError(f"source must be a floating-point tensor [*, V_local] or [*, H], got {type(source).__name__}")
    if source.dim() < 2:
        raise ValueError(f"source must have a position dimension and a last vocab/hidden dimension, got {tuple(source.shape)}")
    pos_shape = source.shape[:-1]
    for name, t in (("sampled_ids", sampled_ids), ("row_ids", row_ids), ("loss_mask", loss_mask), ("trajectory_ids", trajectory_ids)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.shape != pos_shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but source positions are {tuple(pos_shape)}; every channel must be "
                f"aligned to the source positions (source.shape[:-1])"
            )
        if name != "loss_mask" and (t.is_floating_point() or t.dtype == torch.bool):
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if lm_head_weight is not None:
        if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != source.shape[-1]:
            raise ValueError(
                f"lm_head_weight must be [V_local, H={source.shape[-1]}] to match the hidden states, "
                f"got {tuple(lm_head_weight.shape)}"
            )
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0 (the policy's sampling temperature), got {temperature!r}")


def _shard(shard: Optional[VocabShard], v_local: int) -> VocabShard:
    if shard is None:
        return VocabShard.whole(v_local)
    if not isinstance(shard, VocabShard):
        raise ValueError(
            f"shard must be a nemo_replay.VocabShard(start, end, group) describing this rank's vocabulary slice, "
            f"got {type(shard).__name__}"
        )
    if shard.size != v_local:
        raise ValueError(
            f"shard=VocabShard(start={shard.start}, end={shard.end}) holds {shard.size} vocabulary rows but the local "
            f"vocabulary size is {v_local} (source.shape[-1], or lm_head_weight.shape[0] in hidden mode); build the "
            f"shard from this rank's real slice (VocabShard.from_group(group, {v_local}))"
        )
    return shard


def _normalise_support(support: SupportArg) -> Union[PackedTensor, RaggedSupport]:
    if isinstance(support, (PackedTensor, RaggedSupport)):
        if isinstance(support, PackedTensor) and support.values.dim() != 2:
            raise ValueError(f"fixed-width support values must be [rows, k], got {tuple(support.values.shape)}")
        return support
    if isinstance(support, torch.Tensor):
        if support.dim() != 2:
            raise ValueError(f"support rows must be [rows, k], got shape {tuple(support.shape)}")
        return PackedTensor(support, [0, support.shape[0]])
    raise ValueError(
        f"support must be a PackedTensor of [rows, k] int rows, a RaggedSupport or a [rows, k] tensor, got "
        f"{type(support).__name__}"
    )


def has_support_row(support: Union[PackedTensor, RaggedSupport], row_ids: torch.Tensor) -> torch.Tensor:
    """True where ``row_ids`` names a non-empty row (not -1, not all -1 / empty).

    Args:
        support: fixed-width (rows, k) PackedTensor or RaggedSupport.
        row_ids: any shape, int; values outside ``[0, rows)`` count as no row.
    Returns:
        bool, shaped like ``row_ids``.
    """
    if isinstance(support, PackedTensor):
        values = support.values
        nonempty = values[:, 0] >= 0 if values.shape[1] else torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
    else:
        nonempty = support.row_lengths > 0
    nonempty = nonempty.to(row_ids.device)
    if nonempty.numel() == 0:
        return torch.zeros(row_ids.shape, dtype=torch.bool, device=row_ids.device)
    ok = (row_ids >= 0) & (row_ids < nonempty.numel())
    return ok & nonempty[row_ids.clamp(0, nonempty.numel() - 1)]


def check_synthetic_eos(fallback, loss_mask, traj, pos_shape) -> None:
    """The synthetic-EOS rule (docs/design.md §3): at most one loss-active position without a support
    row per trajectory, and it is that trajectory's last loss-active position.

    Args:
        fallback: (N,), bool. Loss-active positions without a row.
        loss_mask: (N,), bool.
        traj: (N,), int64 trajectory ids, -1 on padding. Positions of one trajectory must
            appear in increasing order (true after unpadding, packing, CP and SP slicing).
        pos_shape: the unflattened position shape, for error messages.

    Strategies that shard a sequence call it on the whole sequence first, since a slice
    cannot see another slice's positions.
    """
    idx = torch.nonzero(fallback).flatten()
    if idx.numel() == 0:
        return
    t = traj[idx]
    if (t < 0).any():
        p = int(idx[torch.nonzero(t < 0)[0]])
        raise ValueError(
            f"position {_position(p, pos_shape)} is loss-active but belongs to no trajectory (trajectory id -1, "
            f"padding); padding must be loss-masked"
        )
    counts = torch.bincount(t)
    many = torch.nonzero(counts > 1).flatten().tolist()
    if many:
        raise ValueError(
            f"trajectories {many} have {[int(counts[i]) for i in many]} loss-active positions without a support row; "
            f"at most one per trajectory (a synthetic EOS) may be scored over the full vocabulary. Check that "
            f"support row ids are placed at logit positions and that every sampled token has a row"
        )
    active = torch.nonzero(loss_mask).flatten()
    a_traj = traj[active]
    keep = a_traj >= 0
    # One slot per trajectory id seen at a loss-active position (not only those with a
    # row-less position): a clamp here would fold later trajectories into earlier slots.
    last = torch.full((int(a_traj[keep].max()) + 1,), -1, dtype=torch.int64, device=idx.device)
    last.scatter_reduce_(0, a_traj[keep], active[keep], reduce="amax", include_self=True)
    not_last = idx != last[t]
    if not_last.any():
        p = int(idx[torch.nonzero(not_last)[0]])
        raise ValueError(
            f"trajectory {int(traj[p])}, logit position {_position(p, pos_shape)}: loss-active with no support row but not "
            f"the trajectory's last loss-active token; only a synthetic EOS (the last token) may lack a row. Support "
            f"rows are misaligned (an off-by-one between token and logit positions?)"
        )


# ---------------------------------------------------------------------------- math


def _row_max(z: torch.Tensor) -> torch.Tensor:
    """Detached row maxima of (m, w) scores; ``lowest`` rows stay finite."""
    if z.shape[1] == 0:
        return z.new_full((z.shape[0],), torch.finfo(z.dtype).min)
    return z.detach().amax(1)


def _scaled_rows(src: torch.Tensor, pos: torch.Tensor, cd: torch.dtype, temperature: float) -> torch.Tensor:
    """Detached full-vocabulary rows ``src[pos] / T`` in the compute dtype (support-mass pass)."""
    return src[pos].detach().to(cd) / temperature


def _sums(z, m, zs, compute_entropy):
    """Partial sums over this rank's entries of each row: [exp sum, sampled score, (entropy term)].

    ``z`` (m, w) holds ``lowest`` where an entry is absent, so ``exp`` gives exactly 0 there.
    """
    shifted = z - m[:, None]
    if not compute_entropy:
        return [shifted.exp_().sum(1), zs]  # in place: the shifted scores are not needed again
    e = torch.exp(shifted)
    return [e.sum(1), zs, (e * shifted).sum(1)]


def _finish(m, s, zs, t):
    log_s = torch.log(s)
    logp = zs - m - log_s
    ent = None if t is None else (log_s - t / s).clamp_min(0)
    return logp, ent


# ---------------------------------------------------------------------------- entry points


def score_aligned_support(
    source: torch.Tensor,
    sampled_ids: torch.Tensor,
    row_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    support: SupportArg,
    *,
    shard: Optional[VocabShard] = None,
    lm_head_weight: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    trajectory_ids: Optional[torch.Tensor] = None,
    compute_entropy: bool = False,
    compute_support_mass: bool = False,
    chunk_size: Optional[int] = None,
    validate: bool = True,
) -> SupportScores:
    """Score each sampled token over its recorded support.

    Args:
        source: (*, V_local) logits, or (*, H) hidden states with ``lm_head_weight``. Any float dtype.
        sampled_ids: (*,), int. The token each position predicts (global vocab id).
        row_ids: (*,), int. Global row of ``support`` for the position, -1 for none. A row
            that is all -1 (fixed width) or empty (CSR) also means none.
        loss_mask: (*,), bool or float (nonzero = loss-active).
        support: PackedTensor with int values (rows, k), a (rows, k) int tensor, or RaggedSupport.
        shard: this rank's vocabulary slice and the group it is sharded over
            (:class:`~nemo_replay.scoring.shard.VocabShard`); default the whole vocabulary
            ``[0, V_local)`` with no group.
        lm_head_weight: (V_local, H), this rank's LM-head rows (hidden mode).
        temperature: divides every score (pass 1.0 for logits already scaled).
        trajectory_ids: (*,), int, -1 on padding. Default: index along dim 0 when the
            positions have >= 2 dims ([B, T]), else a single trajectory 0.
        compute_entropy: also return the entropy over the support (differentiable).
        compute_support_mass: also return log of the kept mass (logits mode only).
        chunk_size: (position, id) pairs per chunk in hidden mode (default 8192); in logits
            mode, positions per chunk of the support-mass pass.
        validate: check the support invariants (docs/design.md §2). The alignment guard and the
            synthetic-EOS rule always run.

    Scored positions: loss-active with a row (``valid_mask``), plus at most one loss-active
    position per trajectory without a row, which must be its last loss-active position
    (``fallback_mask``, scored over the full vocabulary).

    Raises:
        ValueError on malformed input, a sampled id outside its row at a loss-active position
        (naming trajectory and position), or more than one row-less position per trajectory.
    """
    _check_inputs(source, sampled_ids, row_ids, loss_mask, trajectory_ids, lm_head_weight, temperature)
    hidden_mode = lm_head_weight is not None
    if hidden_mode and compute_support_mass:
        raise ValueError(
            "compute_support_mass needs full logits; in hidden mode (lm_head_weight given) the scorer never builds "
            "them. Pass logits as source, or set compute_support_mass=False"
        )
    pos_shape = source.shape[:-1]
    v_local = lm_head_weight.shape[0] if hidden_mode else source.shape[-1]
    shard = _shard(shard, v_local)
    v_start, v_end, tp_group = shard.start, shard.end, shard.group
    tp = group_size(tp_group)
    support = _normalise_support(support)
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else int(chunk_size)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    device = source.device
    cd = torch.float64 if (source.dtype == torch.float64 or (hidden_mode and lm_head_weight.dtype == torch.float64)) else torch.float32

    src = source.reshape(-1, source.shape[-1])
    N = src.shape[0]
    sampled = sampled_ids.reshape(-1).to(device=device, dtype=torch.int64)
    rows = row_ids.reshape(-1).to(device=device, dtype=torch.int64)
    lmask = (loss_mask.reshape(-1) != 0).to(device)
    if trajectory_ids is None:
        traj = (
            torch.arange(pos_shape[0], device=device).repeat_interleave(N // max(pos_shape[0], 1))
            if len(pos_shape) >= 2
            else torch.zeros(N, dtype=torch.int64, device=device)
        )
    else:
        traj = trajectory_ids.reshape(-1).to(device=device, dtype=torch.int64)

    num_rows = support.num_rows
    bad_row = (rows < -1) | (rows >= num_rows)
    if bad_row.any():
        p = int(torch.nonzero(bad_row)[0])
        raise ValueError(
            f"trajectory {int(traj[p])}, logit position {_position(p, pos_shape)}: row id {int(rows[p])} outside "
            f"[-1, {num_rows}) for a support of {num_rows} rows"
        )
    if isinstance(support, PackedTensor):
        values = support.values.to(device)
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ValueError(f"support rows must be integer (int32), got {values.dtype}")
        if validate:
            validate_support_rows(values, vocab_size=v_end if tp == 1 else None, cu_seqlens=support.cu_seqlens, where="scorer support")
    elif validate:
        support.validate(vocab_size=v_end if tp == 1 else None, where="scorer support")
    has_row = has_support_row(support, rows)
    scored = lmask & has_row
    fallback = lmask & ~has_row
    check_synthetic_eos(fallback, lmask, traj, pos_shape)
    sel = torch.nonzero(scored).flatten()
    eos = torch.nonzero(fallback).flatten()

    # Member ids of each scored position: [n, w], -1 where absent.
    rows_sel = rows[sel]
    if isinstance(support, PackedTensor):
        # Every row once, in order (positions that follow their rows): read the rows in place.
        in_order = rows_sel.numel() == values.shape[0] and bool((rows_sel == torch.arange(rows_sel.numel(), device=device)).all())
        ids = values if in_order else values[rows_sel]
    else:
        ids = support.padded_rows(rows_sel).to(device)
    sampled_sel = sampled[sel]
    is_sampled = ids == sampled_sel[:, None].to(ids.dtype)
    # The sampled member's column, and whether there is one (max over 0/1 bytes; col 0 if absent).
    found, col = is_sampled.view(torch.uint8).max(1) if is_sampled.shape[1] else (
        torch.zeros(is_sampled.shape[0], dtype=torch.uint8, device=device),
        torch.zeros(is_sampled.shape[0], dtype=torch.int64, device=device),
    )
    guard = found == 0
    if guard.any():
        i = int(torch.nonzero(guard)[0])
        p = int(sel[i])
        raise ValueError(
            f"trajectory {int(traj[p])}, logit position {_position(p, pos_shape)}: sampled token {int(sampled[p])} is not a "
            f"member of its support row {ids[i][:16].tolist()} (row {int(rows[p])}); token and support coordinates "
            f"are misaligned (support rows sit at logit positions: row j of a response predicts token P + j)"
        )
    local = ids >= 0 if tp == 1 else (ids >= v_start) & (ids < v_end)
    # Absent members score ``lowest`` (not -inf): exp gives 0 and no 0 * inf reaches a gradient.
    lowest = torch.tensor(torch.finfo(cd).min, dtype=cd, device=device)

    # ---- local scores z/T for both groups ---------------------------------------------
    if hidden_mode:
        h = copy_to_shards(src, tp_group)
        lid = (ids.clamp(min=0) if tp == 1 else torch.where(local, ids - v_start, torch.zeros_like(ids))).to(torch.int64)
        # Support pairs and the few full-vocabulary rows in one function: one weight-sized gradient.
        z_sup, z_eos = project_support(h, lm_head_weight, sel, lid, local, eos, chunk_size=chunk_size, compute_dtype=cd)
        if temperature != 1.0:
            z_sup = z_sup / temperature
            z_eos = z_eos / temperature
        z_sup = torch.where(local, z_sup, lowest)
    else:
        # One gather, temperature and fill in place, one [N, V] gradient for pairs and EOS rows.
        z_sup, z_eos = select_scores(
            src, sel, ids, None if bool(local.all()) else local, eos,
            vocab_start=v_start, temperature=temperature, fill=float(lowest), compute_dtype=cd,
        )
    if compute_entropy:
        z_sup = z_sup.clamp_min(lowest)  # -inf source logits on members
    z_eos = z_eos.clamp_min(lowest)  # -inf logits on masked vocab entries
    zs_sup = z_sup.gather(1, col[:, None]).squeeze(1)
    if tp > 1:
        zs_sup = torch.where(local.gather(1, col[:, None]).squeeze(1), zs_sup, torch.zeros_like(zs_sup))
    s_local = sampled[eos] - v_start
    in_shard = (s_local >= 0) & (s_local < v_local)
    zs_eos = z_eos.gather(1, s_local.clamp(0, max(v_local - 1, 0))[:, None]).squeeze(1) if eos.numel() else z_eos.new_zeros(0)
    zs_eos = torch.where(in_shard, zs_eos, torch.zeros_like(zs_eos))

    # ---- one MAX all-reduce --------------------------------------------------------------
    max_parts = [_row_max(z_sup), _row_max(z_eos)]
    if compute_support_mass:
        max_parts.append(
            torch.cat([_row_max(_scaled_rows(src, sel[i : i + chunk_size], cd, temperature)) for i in range(0, sel.numel(), chunk_size)])
            if sel.numel()
            else z_sup.new_zeros(0)
        )
    max_parts.append(torch.tensor([float(v_end)], dtype=cd, device=device))
    sizes = [p.numel() for p in max_parts]
    maxima = all_reduce_max(torch.cat(max_parts), tp_group).split(sizes)
    m_sup, m_eos = maxima[0], maxima[1]
    vocab_size = int(maxima[-1][0])
    if tp > 1 and validate:
        if isinstance(support, PackedTensor):
            validate_support_rows(values, vocab_size=vocab_size, cu_seqlens=support.cu_seqlens, where="scorer support")
        else:
            support.validate(vocab_size=vocab_size, where="scorer support")
    bad_eos = (sampled[eos] < 0) | (sampled[eos] >= vocab_size)
    if bad_eos.any():
        p = int(eos[torch.nonzero(bad_eos)[0]])
        raise ValueError(
            f"trajectory {int(traj[p])}, logit position {_position(p, pos_shape)}: sampled id {int(sampled[p])} outside "
            f"the vocabulary [0, {vocab_size})"
        )

    # ---- one SUM all-reduce --------------------------------------------------------------
    sum_parts = _sums(z_sup, m_sup, zs_sup, compute_entropy) + _sums(z_eos, m_eos, zs_eos, compute_entropy)
    if compute_support_mass:
        m_full = maxima[2]
        sum_parts.append(
            torch.cat(
                [
                    torch.exp(_scaled_rows(src, sel[i : i + chunk_size], cd, temperature) - m_full[i : i + chunk_size, None]).sum(1)
                    for i in range(0, sel.numel(), chunk_size)
                ]
            )
            if sel.numel()
            else z_sup.new_zeros(0)
        )
    sizes = [p.numel() for p in sum_parts]
    totals = list(reduce_sum_from_shards(torch.cat(sum_parts), tp_group).split(sizes))
    k = 3 if compute_entropy else 2
    sup, eos_t = totals[:k], totals[k : 2 * k]
    lp_sup, ent_sup = _finish(m_sup, sup[0], sup[1], sup[2] if compute_entropy else None)
    lp_eos, ent_eos = _finish(m_eos, eos_t[0], eos_t[1], eos_t[2] if compute_entropy else None)

    def place(a, b):
        out = torch.zeros(N, dtype=cd, device=device)
        return out.index_put((sel,), a).index_put((eos,), b).view(pos_shape)

    logmass = None
    if compute_support_mass:
        s_full = totals[2 * k]
        lm = (m_sup + torch.log(sup[0]) - maxima[2] - torch.log(s_full)).detach().clamp_max(0)
        logmass = place(lm, torch.zeros_like(lp_eos.detach()))
    return SupportScores(
        logprobs=place(lp_sup, lp_eos),
        valid_mask=scored.view(pos_shape),
        fallback_mask=fallback.view(pos_shape),
        entropy=place(ent_sup, ent_eos) if compute_entropy else None,
        support_logmass=logmass,
    )


def score_full_vocabulary(
    source: torch.Tensor,
    sampled_ids: torch.Tensor,
    *,
    loss_mask: Optional[torch.Tensor] = None,
    shard: Optional[VocabShard] = None,
    lm_head_weight: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
) -> SupportScores:
    """The replay-off path: ``log_softmax(z/T)[sampled]`` over the whole (sharded) vocabulary.

    Same shapes and TP rules as :func:`score_aligned_support` (one MAX, one SUM
    all-reduce). Positions where ``loss_mask`` is zero are not scored (all are by default).
    Builds ``[positions, V_local]`` float scores: this is the cost replay avoids.
    """
    _check_inputs(source, sampled_ids, None, loss_mask, None, lm_head_weight, temperature)
    pos_shape = source.shape[:-1]
    hidden_mode = lm_head_weight is not None
    v_local = lm_head_weight.shape[0] if hidden_mode else source.shape[-1]
    shard = _shard(shard, v_local)
    v_start, tp_group = shard.start, shard.group
    device = source.device
    cd = torch.float64 if source.dtype == torch.float64 else torch.float32
    src = source.reshape(-1, source.shape[-1])
    N = src.shape[0]
    mask = torch.ones(N, dtype=torch.bool, device=device) if loss_mask is None else (loss_mask.reshape(-1) != 0)
    sel = torch.nonzero(mask).flatten()
    if hidden_mode:
        z = (copy_to_shards(src, tp_group)[sel] @ lm_head_weight.t()).to(cd)
    else:
        z = src[sel].to(cd)
    # -inf logits (masked vocab entries) score ``lowest``: exp gives 0, gradients stay finite.
    z = (z / temperature).clamp_min(torch.finfo(cd).min)
    s_local = sampled_ids.reshape(-1).to(device=device, dtype=torch.int64)[sel] - v_start
    ok = (s_local >= 0) & (s_local < v_local)
    zs = z.gather(1, s_local.clamp(0, max(v_local - 1, 0))[:, None]).squeeze(1) if z.numel() else z.new_zeros(z.shape[0])
    zs = torch.where(ok, zs, torch.zeros_like(zs))
    m = all_reduce_max(_row_max(z), tp_group)
    parts = _sums(z, m, zs, compute_entropy)
    sizes = [p.numel() for p in parts]
    totals = reduce_sum_from_shards(torch.cat(parts), tp_group).split(sizes)
    lp, ent = _finish(m, totals[0], totals[1], totals[2] if compute_entropy else None)

    def place(a):
        return torch.zeros(N, dtype=cd, device=device).index_put((sel,), a).view(pos_shape)

    return SupportScores(
        logprobs=place(lp),
        valid_mask=torch.zeros(pos_shape, dtype=torch.bool, device=device),
        fallback_mask=mask.view(pos_shape),
        entropy=place(ent) if compute_entropy else None,
    )
