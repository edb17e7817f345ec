"""The one shared scorer (docs/design.md §4).

Every trainer pass (policy, old-policy recompute, reference) of every strategy calls
:func:`score_aligned_support` on channels that a strategy already aligned:

    log p(x | S) = z[x]/T - logsumexp_{s in S} z[s]/T

Legend: N flattened positions, V local vocabulary rows, H hidden size, n positions scored
over a support row, e positions scored over the full vocabulary (synthetic EOS), w support
width.

Tensor parallel (vocabulary sharded over ``shard.group``): each rank scores the members in
its shard. Forward: one MAX all-reduce (stabilisers; when the shard does not know the
global vocabulary size, also this rank's vocab end, so every rank learns it) and one SUM
all-reduce carrying denominators,
sampled scores, entropy terms and the support-mass denominators together. Backward: none
in logits mode; one SUM all-reduce of the hidden-state gradient in hidden mode.

A call runs four named phases, shared by both entry points:

    plan          arguments checked, channels flattened, every guard computed as a device
                  flag and read with the sizes in ONE host read, positions selected
                  (:mod:`nemo_replay.scoring.plan`)
    local scores  this rank's scores z/T of the support pairs and of the rows scored over
                  the vocabulary, from logits (:mod:`~nemo_replay.scoring.selection`) or
                  from hidden states (:mod:`~nemo_replay.scoring.projection`)
    reduce        the MAX and SUM all-reduces and the log-probs, entropies, support mass
    scatter       results placed back at the positions ``[*]`` of the input

Math runs in float32 (float64 when the source or the LM-head weight is float64) whatever
the input dtype. Inputs are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from nemo_replay.scoring.collectives import all_reduce_max, copy_to_shards, reduce_sum_from_shards
from nemo_replay.layout.checks import check_synthetic_eos, has_support_row
from nemo_replay.scoring.guards import raise_sampled_vocab
from nemo_replay.scoring.plan import Plan, plan_full, plan_support, prepare
from nemo_replay.scoring.projection import project_support
from nemo_replay.scoring.selection import select_scores
from nemo_replay.scoring.shard import VocabShard
from nemo_replay.support.codec import CompactRows
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport, as_support

__all__ = [
    "SupportScores",
    "SupportAlignmentError",
    "score_aligned_support",
    "score_full_vocabulary",
    "check_synthetic_eos",
    "has_support_row",
]

SupportArg = Union[PackedTensor, RaggedSupport, CompactRows, torch.Tensor]


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


@dataclass
class _Local:
    """This rank's scores z/T. z_sup: (n, w) support entries (``lowest`` where absent), z_full: (e, V_local)
    vocabulary rows; zs_*: the sampled entry's score, 0 where this rank does not hold it."""

    z_sup: torch.Tensor
    zs_sup: torch.Tensor
    z_full: torch.Tensor
    zs_full: torch.Tensor


@dataclass
class _Totals:
    lp_sup: torch.Tensor
    lp_full: torch.Tensor
    ent_sup: Optional[torch.Tensor]
    ent_full: Optional[torch.Tensor]
    logmass: Optional[torch.Tensor]


# ---------------------------------------------------------------------------- local scores


def _sampled_in_rows(plan: Plan, z_full: torch.Tensor) -> torch.Tensor:
    """(e,) the sampled id's score in each vocabulary row, 0 where another rank holds it."""
    call = plan.call
    if not plan.full_pos.numel():
        return z_full.new_zeros(0)
    v_local = call.shard.size
    s_local = call.sampled[plan.full_pos] - call.shard.start
    zs = z_full.gather(1, s_local.clamp(0, v_local - 1)[:, None]).squeeze(1)
    return torch.where((s_local >= 0) & (s_local < v_local), zs, torch.zeros_like(zs))


def _local_support_scores(plan: Plan, compute_entropy: bool) -> _Local:
    """Phase 2 of a support call: pair scores and the synthetic-EOS vocabulary rows."""
    call, lowest = plan.call, plan.call.lowest
    if call.weight is not None:
        h = copy_to_shards(call.src, call.shard.group)
        lid = plan.ids.to(torch.int64) - call.shard.start
        # Support pairs and the few full-vocabulary rows in one function: one weight-sized gradient.
        z_sup, z_full = project_support(
            h, call.weight, plan.support_pos, lid, plan.flat, plan.full_pos, plan.chunks, sizes=plan.sizes,
            fill=lowest, temperature=call.temperature, chunk_size=call.chunk_size, compute_dtype=call.cd,
        )
    else:
        # One gather, temperature and fill in place, one (N, V) gradient for pairs and EOS rows.
        z_sup, z_full = select_scores(
            call.src, plan.support_pos, plan.ids, plan.local, plan.full_pos, vocab_start=call.shard.start,
            temperature=call.temperature, fill=lowest, compute_dtype=call.cd,
        )
        if compute_entropy:
            z_sup = z_sup.clamp_min(lowest)  # -inf source logits on members
    if z_full.numel():
        z_full = z_full.clamp_min(lowest)  # -inf logits on masked vocab entries
    zs_sup = z_sup.gather(1, plan.col[:, None]).squeeze(1)
    if call.tp > 1 and plan.local is not None:
        zs_sup = torch.where(plan.local.gather(1, plan.col[:, None]).squeeze(1), zs_sup, torch.zeros_like(zs_sup))
    return _Local(z_sup, zs_sup, z_full, _sampled_in_rows(plan, z_full))


def _local_full_scores(plan: Plan) -> _Local:
    """Phase 2 of the full-vocabulary path: every scored position is a vocabulary row."""
    call = plan.call
    if call.weight is not None:
        # The LM head's own product, in the weight's dtype (float64 when either side is).
        mm = torch.float64 if call.cd == torch.float64 else call.weight.dtype
        h = copy_to_shards(call.src, call.shard.group)[plan.full_pos]
        z = (h.to(mm) @ call.weight.to(mm).t()).to(call.cd) / call.temperature
    else:
        empty = torch.zeros(0, 0, dtype=torch.int64, device=call.device)
        _, z = select_scores(call.src, plan.support_pos, empty, None, plan.full_pos, vocab_start=call.shard.start,
                             temperature=call.temperature, fill=call.lowest, compute_dtype=call.cd)
    z = z.clamp_min(call.lowest)  # -inf logits (masked vocab entries): exp gives 0, gradients stay finite
    empty = z.new_zeros(0, 0)
    return _Local(empty, z.new_zeros(0), z, _sampled_in_rows(plan, z))


# ---------------------------------------------------------------------------- reduce


def _row_max(z: torch.Tensor) -> torch.Tensor:
    """Detached row maxima of (m, w) scores; ``lowest`` rows stay finite."""
    if z.shape[1] == 0:
        return z.new_full((z.shape[0],), torch.finfo(z.dtype).min)
    return z.detach().amax(1)


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


def _mass_rows(call) -> int:
    """Positions per block of the support-mass pass: about 8 MiB of compute-dtype scores (a
    block stays in cache between its max and its exponentials), at most ``chunk_size``."""
    width = call.src.shape[1] * torch.finfo(call.cd).bits // 8
    return max(1, min(call.chunk_size, (8 << 20) // max(width, 1)))


def _mass_partials(plan: Plan) -> torch.Tensor:
    """(n,) this rank's ``logsumexp`` of the detached full rows ``src[support_pos] / T``, in ONE pass over
    the rows, block by block (support mass); -inf rows (a shard all -inf) give ``lowest``.

    Once the MAX all-reduce gives the global maxima M of these, ``exp(lse - M)`` is this rank's
    share of ``sum exp(z - M)``, so the ``(n, V_local)`` rows are read and converted once.
    Every position scored (``n == N``): the blocks are slices of the source, not copies.
    """
    call, pos = plan.call, plan.support_pos
    n, step = pos.numel(), _mass_rows(call)
    src = call.src.detach()
    parts = []
    for i in range(0, n, step):
        rows = src[i : i + step] if n == call.N else src.index_select(0, pos[i : i + step])
        z = rows.to(call.cd)
        if call.temperature != 1.0:
            z = z / call.temperature
        parts.append(torch.logsumexp(z, 1))
    if not parts:
        return torch.zeros(0, dtype=call.cd, device=call.device)
    return torch.cat(parts).clamp_min_(call.lowest)


def _deferred_checks(plan: Plan, vocab_max: torch.Tensor) -> None:
    """Under TP with a shard that does not know the global vocabulary size, the checks that need it
    run after the MAX all-reduce brought it (one more host read)."""
    call = plan.call
    bad = plan.fallback & ((call.sampled < 0) | (call.sampled >= vocab_max))
    flags = [vocab_max.to(torch.int64), bad.any().to(torch.int64)]
    if plan.deferred_support_check and plan.support is not None:
        ids = plan.support.all_ids
        flags.append((ids.amax() >= vocab_max).to(torch.int64) if ids.numel() else bad.new_zeros(()).long())
    got = torch.stack(flags).tolist()
    vocab = got[0]
    if len(got) > 2 and got[2]:
        plan.support.validate(vocab_size=vocab, where="scorer support")
    if got[1]:
        raise_sampled_vocab(bad, call.sampled, vocab, call.where)


def _reduce(plan: Plan, local: _Local, compute_entropy: bool, compute_support_mass: bool) -> _Totals:
    """Phase 3: one MAX all-reduce (stabilisers), one SUM all-reduce (partial sums), then the results.

    The synthetic-EOS rows' parts are left out when there are none (positions are replicated
    over the TP group, so every rank leaves them out alike); one rank issues no collective
    and concatenates nothing.
    """
    call, group = plan.call, plan.call.shard.group
    full = plan.full_pos.numel() > 0
    max_parts = [_row_max(local.z_sup), _row_max(local.z_full) if full else local.zs_full]
    if compute_support_mass:
        lse_full_local = _mass_partials(plan)
        max_parts.append(lse_full_local)
    if plan.vocab_size is None:  # every rank learns the global vocabulary size
        max_parts.append(torch.tensor([float(call.shard.end)], dtype=call.cd, device=call.device))
    if call.tp > 1:
        sizes = [p.numel() for p in max_parts]
        max_parts = all_reduce_max(torch.cat(max_parts), group).split(sizes)
    m_sup, m_full = max_parts[0], max_parts[1]
    if plan.vocab_size is None:
        _deferred_checks(plan, max_parts[-1][0])

    sum_parts = _sums(local.z_sup, m_sup, local.zs_sup, compute_entropy)
    k = len(sum_parts)
    if full:
        sum_parts += _sums(local.z_full, m_full, local.zs_full, compute_entropy)
    if compute_support_mass:
        sum_parts.append(torch.exp(lse_full_local - max_parts[2]))
    if call.tp > 1:
        sizes = [p.numel() for p in sum_parts]
        sum_parts = list(reduce_sum_from_shards(torch.cat(sum_parts), group).split(sizes))
    sup = sum_parts[:k]
    lp_sup, ent_sup = _finish(m_sup, sup[0], sup[1], sup[2] if compute_entropy else None)
    if full:
        ends = sum_parts[k : 2 * k]
        lp_full, ent_full = _finish(m_full, ends[0], ends[1], ends[2] if compute_entropy else None)
    else:
        lp_full = ent_full = local.zs_full  # (0,)
    logmass = None
    if compute_support_mass:
        logmass = (m_sup + torch.log(sup[0]) - max_parts[2] - torch.log(sum_parts[-1])).detach().clamp_max(0)
    return _Totals(lp_sup, lp_full, ent_sup, ent_full if compute_entropy else None, logmass)


# ---------------------------------------------------------------------------- scatter


def _scatter(plan: Plan, t: _Totals, compute_entropy: bool) -> SupportScores:
    """Phase 4: results at the input's positions ``[*]``, zero where not scored."""
    call = plan.call

    def place(a, b):
        if a.numel() == call.N:  # every position scored over a support: support_pos is arange(N)
            return a.view(call.pos_shape)
        if b.numel() == call.N:  # every position scored over the vocabulary: full_pos is arange(N)
            return b.view(call.pos_shape)
        out = torch.zeros(call.N, dtype=call.cd, device=call.device)
        return out.index_put((plan.support_pos,), a).index_put((plan.full_pos,), b).view(call.pos_shape)

    return SupportScores(
        logprobs=place(t.lp_sup, t.lp_full),
        valid_mask=plan.valid.view(call.pos_shape),
        fallback_mask=plan.fallback.view(call.pos_shape),
        entropy=place(t.ent_sup, t.ent_full) if compute_entropy else None,
        support_logmass=None if t.logmass is None else place(t.logmass, torch.zeros_like(t.lp_full.detach())),
    )


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
    token_positions: Optional[torch.Tensor] = None,
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
            positions have >= 2 dims, (B, T), else a single trajectory 0.
        compute_entropy: also return the entropy over the support (differentiable).
        compute_support_mass: also return log of the kept mass (logits mode only).
        chunk_size: hidden mode projects the present (position, id) pairs in chunks of at
            most this many pairs (default 8192; a row wider than a chunk is split); in logits
            mode, at most this many positions per block of the support-mass pass (fewer
            when a block's scores would pass 8 MiB).
        validate: check the support invariants (docs/design.md §2) of rows that were not
            checked where they entered (a support records a passed check: rows from capture,
            the engine adapters, wire decode, traces and collation, and rows this function
            already checked, skip the sort). The alignment guard, the synthetic-EOS rule and
            the range of every id the kernels read always run.
        token_positions: (*,), int. The caller's column of the token each position
            predicts, for error messages (a strategy passes it, so errors name the same token
            the same way under any packing or slicing); default the position along the last
            axis of the input.

    Scored positions: loss-active with a row (``valid_mask``), plus at most one loss-active
    position per trajectory without a row, which must be its last loss-active position
    (``fallback_mask``, scored over the full vocabulary).

    Guards: every check of the call (row ids, support invariants, the synthetic-EOS rule,
    membership, sampled ids scored over the vocabulary) is computed on the device and read
    with the sizes the call needs in one host read (a second one only under tensor
    parallelism when ``shard`` does not know the global vocabulary size).

    Raises:
        ValueError on malformed or missing input, naming the argument, what came and the fix;
        SupportAlignmentError (a ValueError) when a loss-active sampled token is not in its
        row, or the row-less positions break the synthetic-EOS rule, naming the trajectory
        and the logit position.
    """
    call = prepare(source, sampled_ids, row_ids, loss_mask, trajectory_ids, shard=shard, lm_head_weight=lm_head_weight,
                   temperature=temperature, chunk_size=chunk_size, needs_rows=True, token_positions=token_positions)
    hidden = lm_head_weight is not None
    if hidden and compute_support_mass:
        raise ValueError(
            "compute_support_mass needs full logits; in hidden mode (lm_head_weight given) the scorer never builds "
            "them. Pass logits as source, or set compute_support_mass=False"
        )
    plan = plan_support(call, as_support(support, call.device), validate=validate, hidden=hidden)
    local = _local_support_scores(plan, compute_entropy)
    totals = _reduce(plan, local, compute_entropy, compute_support_mass)
    return _scatter(plan, totals, compute_entropy)


def score_full_vocabulary(
    source: torch.Tensor,
    sampled_ids: torch.Tensor,
    *,
    loss_mask: Optional[torch.Tensor] = None,
    shard: Optional[VocabShard] = None,
    lm_head_weight: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    trajectory_ids: Optional[torch.Tensor] = None,
    token_positions: Optional[torch.Tensor] = None,
) -> SupportScores:
    """The replay-off path: ``log_softmax(z/T)[sampled]`` over the whole (sharded) vocabulary.

    Same shapes, phases, compute dtype and TP rules as :func:`score_aligned_support` (one
    MAX, one SUM all-reduce; one host read for its guard, a sampled id outside the
    vocabulary). Positions where ``loss_mask`` is zero are not scored (all are by default).
    Builds ``[positions, V_local]`` float scores: this is the cost replay avoids. In hidden
    mode the logits are the LM head's own product in the weight's dtype (float64 when the
    hidden states or the weight are), converted to the compute dtype. ``trajectory_ids`` and
    ``token_positions`` only name a bad position in an error, as in :func:`score_aligned_support`.
    """
    call = prepare(source, sampled_ids, None, loss_mask, trajectory_ids, shard=shard, lm_head_weight=lm_head_weight,
                   temperature=temperature, chunk_size=None, needs_rows=False, token_positions=token_positions)
    plan = plan_full(call)
    totals = _reduce(plan, _local_full_scores(plan), compute_entropy, False)
    return _scatter(plan, totals, compute_entropy)
