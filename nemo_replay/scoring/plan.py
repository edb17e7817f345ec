"""The plan phase of a scorer call: arguments checked, channels flattened, guards read once.

:func:`prepare` checks the arguments on the host (types, shapes, the shard, the
temperature) and flattens the four channels (docs/design.md §3). :func:`plan_support`
then computes every guard of :mod:`nemo_replay.scoring.guards` as a device flag, together
with the sizes the later phases need (positions scored over a row, synthetic-EOS positions, present
pairs, hidden-mode chunk bounds), and reads them all with ONE host read. Only then does
it select the positions scored over a row, whose count it now knows.

The row of every position (``ids_all``, ``(N, w)``) is read before the selection, so the
membership guard runs over all N positions; positions that are not scored are masked
out. That costs one ``(N, w)`` integer gather, a sequential read, against the scorer's
random reads of ``n * w`` scores.

Legend: N positions, n positions scored over a row, e positions scored over the
vocabulary, w support width, P present pairs (ids this rank holds), C chunk size.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch

from nemo_replay.distributed.groups import group_size_rank
from nemo_replay.layout.checks import Where, check_synthetic_eos, synthetic_eos_flag
from nemo_replay.scoring.guards import GUARDS, raise_id_range, raise_membership, raise_row_range, raise_sampled_vocab
from nemo_replay.scoring.projection import PairChunk, RunSizes, run_sizes_after_read, run_sizes_before_read, weight_grad_sizes
from nemo_replay.scoring.shard import VocabShard
from nemo_replay.support.checked import SupportCheck
from nemo_replay.support.dtypes import is_integer
from nemo_replay.support.membership import row_membership
from nemo_replay.support.nonzero import nonzero_static
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["Call", "Plan", "prepare", "plan_support", "plan_full", "check_guards"]

DEFAULT_CHUNK_SIZE = 8192
#: The most (position, id) pairs one chunk may hold: past an int32 count (2**31 - 1) no device
#: holds the chunk, and a Python int past int64 overflows the first index built from it.
MAX_CHUNK_SIZE = 2**31 - 1


@dataclass
class Call:
    """One call's arguments, checked and flattened to the N positions.

    src: (N, V_local) logits or (N, H) hidden states; weight: (V_local, H) or None.
    sampled, traj: (N,) int64; lmask: (N,) bool; rows: (N,) int64 or None (full path).
    """

    pos_shape: torch.Size
    src: torch.Tensor
    weight: Optional[torch.Tensor]
    sampled: torch.Tensor
    rows: Optional[torch.Tensor]
    lmask: torch.Tensor
    traj: torch.Tensor
    shard: VocabShard
    tp: int
    cd: torch.dtype
    temperature: float
    chunk_size: int
    where: Where

    @property
    def N(self) -> int:
        return self.src.shape[0]

    @property
    def device(self) -> torch.device:
        return self.src.device

    @property
    def lowest(self) -> float:
        """The score of an absent entry: ``exp`` gives exactly 0 and no ``0 * inf`` reaches a gradient."""
        return torch.finfo(self.cd).min


@dataclass
class Plan:
    """What the local-score phase needs, all selections done.

    support_pos: (n,) int64 positions scored over their support row; full_pos: (e,) int64 positions
    scored over the full vocabulary (a synthetic EOS; every one with replay off). valid, fallback:
    (N,) bool masks of the same positions (``SupportScores.valid_mask`` / ``fallback_mask``).
    ids: (n, w) global ids of each scored row; col: (n,) int64 the sampled member's column.
    local: (n, w) bool (present and held by this rank) or None when every entry is.
    flat, chunks: hidden mode's present pairs (indices into the n * w grid) and chunk bounds.
    sizes: hidden mode's weight-gradient run sizes, read with the guards (None when no weight
    gradient can be asked for: grad mode off, or a frozen LM head).
    vocab_size: the global vocabulary size, None under TP until the MAX all-reduce says.
    """

    call: Call
    support_pos: torch.Tensor
    full_pos: torch.Tensor
    valid: torch.Tensor
    fallback: torch.Tensor
    ids: Optional[torch.Tensor] = None
    col: Optional[torch.Tensor] = None
    local: Optional[torch.Tensor] = None
    flat: Optional[torch.Tensor] = None
    chunks: tuple = ()
    sizes: Optional[RunSizes] = None
    vocab_size: Optional[int] = None
    support: Optional[Union[PackedTensor, RaggedSupport]] = None
    deferred_support_check: bool = False


# ---------------------------------------------------------------------------- arguments


def _check_channel(name: str, t, pos_shape, *, integer: bool) -> None:
    if t is None:
        raise ValueError(
            f"{name} is required: a tensor shaped like the source positions {tuple(pos_shape)} (source.shape[:-1]), got None"
        )
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.shape != pos_shape:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)} but source positions are {tuple(pos_shape)}; every channel must be "
            f"aligned to the source positions (source.shape[:-1])"
        )
    if integer and not is_integer(t):
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")


def _what(t) -> str:
    """A tensor's dtype, or the type of anything else (for error messages)."""
    return str(t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_source(source, lm_head_weight, temperature) -> None:
    if not isinstance(source, torch.Tensor) or not source.is_floating_point():
        raise ValueError(
            f"source must be a floating-point tensor (*, V_local) (logits) or (*, H) (hidden states), got {_what(source)}"
        )
    if source.dim() < 2:
        raise ValueError(f"source must have a position dimension and a last vocab/hidden dimension, got {tuple(source.shape)}")
    if lm_head_weight is not None:
        if not isinstance(lm_head_weight, torch.Tensor) or not lm_head_weight.is_floating_point():
            raise ValueError(f"lm_head_weight must be a floating-point tensor (V_local, H), got {_what(lm_head_weight)}")
        if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != source.shape[-1]:
            raise ValueError(
                f"lm_head_weight must be (V_local, H={source.shape[-1]}) to match the hidden states, "
                f"got {tuple(lm_head_weight.shape)}"
            )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
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


def compute_dtype(source: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.dtype:
    """float64 when the source or the LM-head weight is float64, else float32 (docs/design.md §4)."""
    if source.dtype == torch.float64 or (weight is not None and weight.dtype == torch.float64):
        return torch.float64
    return torch.float32


def prepare(source, sampled_ids, row_ids, loss_mask, trajectory_ids, *, shard, lm_head_weight, temperature,
            chunk_size, needs_rows: bool, token_positions=None) -> Call:
    """Check every argument (host only, no device read) and flatten the channels."""
    _check_source(source, lm_head_weight, temperature)
    pos_shape = source.shape[:-1]
    _check_channel("sampled_ids", sampled_ids, pos_shape, integer=True)
    if needs_rows:
        _check_channel("row_ids", row_ids, pos_shape, integer=True)
    if needs_rows or loss_mask is not None:
        _check_channel("loss_mask", loss_mask, pos_shape, integer=False)
    if trajectory_ids is not None:
        _check_channel("trajectory_ids", trajectory_ids, pos_shape, integer=True)
    if token_positions is not None:
        _check_channel("token_positions", token_positions, pos_shape, integer=True)
    given = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    try:
        chunk_size = -1 if isinstance(given, bool) else operator.index(given)
    except TypeError:
        chunk_size = -1
    if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be an int in [1, {MAX_CHUNK_SIZE}] (pairs per chunk), got {given!r}")
    v_local = lm_head_weight.shape[0] if lm_head_weight is not None else source.shape[-1]
    shard = _shard(shard, v_local)
    device = source.device
    src = source.reshape(-1, source.shape[-1])
    N = src.shape[0]
    if trajectory_ids is not None:
        traj = trajectory_ids.reshape(-1).to(device=device, dtype=torch.int64)
    elif len(pos_shape) >= 2:  # (B, T): trajectory b is row b
        traj = torch.arange(pos_shape[0], device=device).repeat_interleave(N // max(pos_shape[0], 1))
    else:
        traj = torch.zeros(N, dtype=torch.int64, device=device)
    lmask = torch.ones(N, dtype=torch.bool, device=device) if loss_mask is None else (loss_mask.reshape(-1) != 0).to(device)
    return Call(
        pos_shape=pos_shape,
        src=src,
        weight=lm_head_weight,
        sampled=sampled_ids.reshape(-1).to(device=device, dtype=torch.int64),
        rows=None if row_ids is None else row_ids.reshape(-1).to(device=device, dtype=torch.int64),
        lmask=lmask,
        traj=traj,
        shard=shard,
        tp=group_size_rank(shard.group)[0],
        cd=compute_dtype(source, lm_head_weight),
        temperature=float(temperature),
        chunk_size=chunk_size,
        where=Where(traj, pos_shape, None if token_positions is None else token_positions.reshape(-1)),
    )


# ---------------------------------------------------------------------------- the one host read


def check_guards(got: dict, raisers: dict) -> None:
    """Raise for the first guard whose flag was read set, in :data:`GUARDS` order.

    ``got``: the host read (name -> value); ``raisers``: name -> function that raises.
    """
    for name in GUARDS:
        if got.get(name):
            raisers[name]()


# ---------------------------------------------------------------------------- support plan


def _rows_of_positions(call: Call, support) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_all (N, w), has_row (N,) bool): every position's row (clamped row ids), no host sync.

    A row id outside ``[0, rows)`` reads row 0 and counts as no row (the row_range guard
    names it). Rows are padded to the support's width bound with -1.
    """
    rows, R = call.rows, support.num_rows
    width = support.width_bound
    if R == 0:
        return support.all_ids.new_full((call.N, width), -1), torch.zeros(call.N, dtype=torch.bool, device=call.device)
    valid = (rows >= 0) & (rows < R)
    r = rows.clamp(0, R - 1)
    return support.gather_padded(r, width), valid & support.nonempty_rows()[r]


def _held(ids: torch.Tensor, call: Call) -> torch.Tensor:
    """(N, w) bool: the entries this rank holds (present, and inside its vocabulary shard)."""
    return ids >= 0 if call.tp == 1 else (ids >= call.shard.start) & (ids < call.shard.end)


def _chunk_rows(present: torch.Tensor, valid: torch.Tensor, chunk_size: int):
    """(pairs per position (N,), scored-row bounds (2, K)) of hidden mode's pair chunks.

    Chunk c holds the present pairs ``[c C, (c + 1) C)`` in row-major order; its rows run
    from the scored row holding its first pair to the one holding its last (clamped to the
    last scored row when it ends early). Example, C = 2, present pairs per scored position
    [3, 1, 2]: cum [3, 4, 6]; chunk starts [0, 2, 4] lie in rows [0, 0, 2], chunk ends
    [1, 3, 5] in rows [0, 1, 2] -> chunks rows [0, 1), [0, 2), [2, 3).

    present: (N, w) bool, the pairs (held entries of scored rows); valid: (N,) the scored rows.
    """
    N, w = present.shape
    counts = present.sum(1)
    cum = torch.cumsum(counts, 0)
    K = -(-(N * w) // chunk_size)
    starts = torch.arange(K, device=cum.device, dtype=torch.int64) * chunk_size
    rank = torch.cumsum(valid, 0) - 1  # scored-row index of each position
    first = torch.searchsorted(cum, starts, right=True).clamp_(max=max(N - 1, 0))
    last = torch.searchsorted(cum, starts + (chunk_size - 1), right=True).clamp_(max=max(N - 1, 0))
    bounds = torch.stack([rank[first], rank[last]]) if N else torch.zeros(2, K, dtype=torch.int64, device=cum.device)
    return cum, bounds


def _chunks_from(bounds: list, num_pairs: int, chunk_size: int, n: int) -> tuple:
    first, last = bounds
    chunks = []
    for c, p0 in enumerate(range(0, num_pairs, chunk_size)):
        chunks.append(PairChunk(p0, min(p0 + chunk_size, num_pairs), first[c], min(last[c] + 1, n)))
    return tuple(chunks)


class _Reads:
    """Device scalars and vectors gathered into one int64 tensor, read with one ``tolist()``.

    0-d flags and counts are stacked as they come (one cast, at the read); vectors are
    appended after them.
    """

    def __init__(self, device):
        self.device, self.scalars, self.vectors = device, {}, {}

    def add(self, name: str, t) -> None:
        t = torch.as_tensor(t, device=self.device)
        (self.scalars if t.dim() == 0 else self.vectors)[name] = t

    def read(self) -> dict:
        by_dtype: dict = {}  # one stack and one cast per dtype (the flags are bool, the counts int64)
        for name, t in self.scalars.items():
            by_dtype.setdefault(t.dtype, {})[name] = t
        names = [name for group in by_dtype.values() for name in group]
        parts = [torch.stack(list(group.values())).to(torch.int64) for group in by_dtype.values()]
        parts += [t.reshape(-1).to(torch.int64) for t in self.vectors.values()]
        flat = torch.cat(parts).tolist() if parts else []
        got, a = dict(zip(names, flat)), len(names)
        for name, t in self.vectors.items():
            got[name], a = flat[a : a + t.numel()], a + t.numel()
        return got


def _weight_grad_sizes(call: Call, ids_all, present, reads: _Reads) -> int:
    """Add the weight gradient's run sizes (hidden mode) to ``reads``; returns the ids per block."""
    block, step = weight_grad_sizes(call.weight, call.chunk_size, call.cd)
    V = call.weight.shape[0]
    # Clamped into the histogram's V + 1 bins: an id >= V (rows coded for a larger vocabulary, a corrupted
    # decode) counts as no pair here, and the id_range / decode guard read with these sizes raises by name.
    keys = torch.where(present, ids_all.to(torch.int64) - call.shard.start, V).clamp_(0, V)
    for name, t in run_sizes_before_read(keys, V, block, step).items():
        reads.add(name, t)
    return block


def plan_support(call: Call, support, *, validate: bool, hidden: bool) -> Plan:
    """Guards, sizes and selections of a support call, with one host read (docs/design.md §4)."""
    shard, N = call.shard, call.N
    vocab = shard.vocab_size  # None under TP when the shard does not know it
    ids_all, has_row = _rows_of_positions(call, support)
    valid, fallback = call.lmask & has_row, call.lmask & ~has_row
    member, col_all = row_membership(ids_all, call.sampled)
    # Each row's least and greatest id (two cheap reductions) answer the id bound and, on one
    # rank, whether a scored row holds padding, without an (N, w) mask of either.
    low, high = (ids_all.amin(1), ids_all.amax(1)) if ids_all.shape[1] else (call.rows.new_zeros(N),) * 2
    local_all = None if call.tp == 1 and not hidden else _held(ids_all, call)

    reads = _Reads(call.device)
    decode_flag = getattr(support, "decode_flag", None)  # DecodedRows: the decode's own checks, always read
    if decode_flag is not None:
        reads.add("decode", decode_flag)
    reads.add("row_range", ((call.rows < -1) | (call.rows >= support.num_rows)).any())
    # Memory safety on every path: the kernels read logits / LM-head rows at these ids. Under
    # TP without the global size only ids inside this shard are read, so only < -1 is known bad.
    bad_rows = valid & ((low < -1) if vocab is None else (low < -1) | (high >= vocab))
    reads.add("id_range", bad_rows.any())
    check = SupportCheck.begin(support, vocab, validate)
    if check.flag is not None:
        reads.add("support", check.flag)
    reads.add("synthetic_eos", synthetic_eos_flag(fallback, call.lmask, call.traj))
    missing = valid & ~member
    reads.add("membership", missing.any())
    bad_sampled = fallback & ((call.sampled < 0) | (call.sampled >= (vocab if vocab is not None else 2**62)))
    reads.add("sampled_vocab", bad_sampled.any())
    reads.add("n", valid.sum())
    reads.add("e", fallback.sum())
    # An absent entry: padding (-1) in a scored row, or under TP an id another rank holds.
    reads.add("absent", (valid & (low < 0)).any() if call.tp == 1 else (valid[:, None] & ~local_all).any())
    block = None
    if hidden:
        present = local_all & valid[:, None]
        cum, bounds = _chunk_rows(present, valid, call.chunk_size)
        reads.add("pairs", cum[-1] if N else 0)
        reads.add("bounds", bounds)
        if torch.is_grad_enabled() and call.weight.requires_grad:  # the backward's sizes, read here
            block = _weight_grad_sizes(call, ids_all, present, reads)
    got = reads.read()  # THE host read of this call's guards and sizes

    check_guards(got, {
        "decode": lambda: support.raise_decode_error(),
        "row_range": lambda: raise_row_range(call.rows, support.num_rows, call.where),
        "id_range": lambda: raise_id_range(bad_rows, ids_all, call.rows, vocab, call.where),
        "support": check.raise_first_bad_row,
        "synthetic_eos": lambda: check_synthetic_eos(fallback, call.lmask, call.traj, call.pos_shape, call.where),
        "membership": lambda: raise_membership(missing, ids_all, call.sampled, call.rows, call.where),
        "sampled_vocab": lambda: raise_sampled_vocab(bad_sampled, call.sampled, vocab, call.where),
    })
    check.passed(again=bool(got.get("support")))  # got here: the rows passed
    n, e = got["n"], got["e"]
    every = n == N
    support_pos = torch.arange(N, device=call.device) if every else nonzero_static(valid, n)
    full_pos = nonzero_static(fallback, e) if e else support_pos.new_zeros(0)
    pick = lambda t: t if every else t.index_select(0, support_pos)  # noqa: E731
    ids, col = pick(ids_all), pick(col_all)
    local = None
    if got["absent"]:
        local = pick(_held(ids_all, call) if local_all is None else local_all)
    plan = Plan(call, support_pos, full_pos, valid, fallback, ids=ids, col=col, local=local,
                vocab_size=vocab, support=support, deferred_support_check=validate and vocab is None)
    if hidden:
        P = got["pairs"]
        w = ids.shape[1]
        plan.flat = torch.arange(n * w, device=call.device) if local is None else nonzero_static(local.reshape(-1), P)
        bounds = got["bounds"]
        K = len(bounds) // 2
        plan.chunks = _chunks_from([bounds[:K], bounds[K:]], P, call.chunk_size, n)
        if block is not None:
            plan.sizes = run_sizes_after_read(got, block)
    return plan


def plan_full(call: Call) -> Plan:
    """The full-vocabulary path: every loss-active position is scored over the vocabulary.

    One guard (a sampled id outside the vocabulary) and one host read, as for a support call.
    """
    vocab = call.shard.vocab_size
    reads = _Reads(call.device)
    bad = call.lmask & ((call.sampled < 0) | (call.sampled >= (vocab if vocab is not None else 2**62)))
    reads.add("sampled_vocab", bad.any())
    reads.add("e", call.lmask.sum())
    got = reads.read()
    check_guards(got, {"sampled_vocab": lambda: raise_sampled_vocab(bad, call.sampled, vocab, call.where)})
    empty = torch.zeros(0, dtype=torch.int64, device=call.device)
    none = torch.zeros(call.N, dtype=torch.bool, device=call.device)
    return Plan(call, empty, nonzero_static(call.lmask, got["e"]), none, call.lmask, vocab_size=vocab)
