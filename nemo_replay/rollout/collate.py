"""Per-trajectory support and routes -> trainer batches (docs/design.md §2, §3).

Rollouts produce one support segment (``R_i`` rows) and optionally one routes segment
(``L_i`` rows) per trajectory. The trainer's batch lists trajectories in its own order,
possibly with repeats (GRPO groups sampled once and repeated, or a batch re-ordered for
packing). :func:`collate_support` and :func:`collate_routes` build the packed batch in
that order with one gather, after checking the data once per source trajectory:

- every row against docs/design.md §2, with the sampled ids: each non-empty row must contain
  the response token it scores;
- row counts against the trainer's response lengths (support) or sequence lengths
  (routes), batch position by batch position.

Worked example: three trajectories with 2, 3 and 1 response rows; the trainer's batch is
``index = [2, 0, 0]`` (trajectory 0 repeated) with response lengths ``[1, 2, 2]``:

    source cu_seqlens  [0, 2, 5, 6]
    batch segments     traj 2 (1 row), traj 0 (2 rows), traj 0 (2 rows)
    batch cu_seqlens   [0, 1, 3, 5]
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from nemo_replay.rollout.boundary import validate_support
from nemo_replay.rollout.capture.trace import SupportTrace
from nemo_replay.support.dtypes import is_integer
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport, is_support

__all__ = ["collate_support", "collate_routes"]

Support = Union[PackedTensor, RaggedSupport]
_INT32_MAX = torch.iinfo(torch.int32).max
SegmentLike = Union[torch.Tensor, PackedTensor, RaggedSupport, SupportTrace]


def _segment(item: SegmentLike, i: int) -> Support:
    """Trajectory ``i``'s rows as a one-segment PackedTensor or RaggedSupport."""
    if isinstance(item, SupportTrace):
        return item.support()
    if is_support(item):
        seg = item
    elif isinstance(item, torch.Tensor):
        if item.dim() != 2:
            raise ValueError(f"collation: trajectory {i} rows have shape {tuple(item.shape)}, expected (R_i, k)")
        seg = PackedTensor(item, [0, item.shape[0]])
    else:
        raise ValueError(
            f"collation: trajectory {i} is a {type(item).__name__}; expected an int (R_i, k) tensor, a one-segment "
            f"PackedTensor or RaggedSupport, or a SupportTrace"
        )
    if seg.batch_size != 1:
        raise ValueError(f"collation: trajectory {i} holds {seg.batch_size} segments, expected one")
    if isinstance(seg, PackedTensor) and not is_integer(seg):
        # Checked before the batch is cast to int32, which would truncate 3.7 to a valid-looking 3.
        raise ValueError(
            f"collation: trajectory {i} rows have dtype {seg.dtype}, expected integer token ids; pass the "
            f"sampler's int32 rows unchanged"
        )
    if isinstance(seg, PackedTensor) and seg.values.numel():
        # Also before the cast: int64 2**32 + 5 would wrap to a valid-looking 5. Widened first,
        # so a uint8 row is never compared with -1 as 255.
        wide = seg.values.to(torch.int64)
        lo, hi = int(wide.min()), int(wide.max())
        if lo < -1 or hi > _INT32_MAX:
            raise ValueError(
                f"collation: trajectory {i} rows hold {lo if lo < -1 else hi}, outside [-1, 2**31); token ids are "
                f"int32 with -1 padding"
            )
    return seg


def _batch_index(index, num_trajectories: int) -> torch.Tensor:
    if index is None:
        return torch.arange(num_trajectories)
    idx = torch.as_tensor(index)
    if idx.dim() != 1 or not is_integer(idx):
        raise ValueError(f"collation: index must be a 1-D int sequence (batch position -> trajectory), got {idx.dtype}")
    idx = idx.to(torch.int64)
    if idx.numel() and (idx.min() < 0 or idx.max() >= num_trajectories):
        raise ValueError(f"collation: index {idx.tolist()[:16]} refers outside the {num_trajectories} trajectories")
    return idx


def _check_lengths(have: torch.Tensor, want, index: torch.Tensor, what: str, rows: str, fix: str) -> None:
    if want is None:
        raise ValueError(f"collation: the trainer's {what}s are required, one per batch position; got None")
    want = torch.as_tensor(want)
    if not is_integer(want):
        raise ValueError(f"collation: {what}s have dtype {want.dtype}, expected integers")
    want = want.to(torch.int64).cpu()
    if want.shape != index.shape:
        raise ValueError(f"collation: {what} has shape {tuple(want.shape)}, expected ({index.numel()},) in batch order")
    got = have.cpu()[index]
    bad = torch.nonzero(got != want)
    if bad.numel():
        b = int(bad[0])
        raise ValueError(
            f"collation: batch position {b} (trajectory {int(index[b])}) has {int(got[b])} {rows} but its "
            f"{what} is {int(want[b])}; {fix}"
        )


def collate_support(
    per_trajectory: Sequence[SegmentLike],
    *,
    response_lengths,
    sampled_ids: Optional[Sequence[torch.Tensor]] = None,
    index=None,
    vocab_size: Optional[int] = None,
) -> Support:
    """Build the batch's support in the trainer's order.

    Args:
        per_trajectory: trajectory i's ``R_i`` rows: int ``(R_i, k)``, a one-segment
            PackedTensor / RaggedSupport, or a finished SupportTrace (CSR rows). All
            fixed-width with one ``k``, or all ragged.
        response_lengths: (B,) int, the trainer's ``R`` per batch position.
        sampled_ids: per trajectory, ``(R_i,)`` int response tokens (defaults to a
            SupportTrace's own tokens). Each non-empty row must contain its token.
        index: (B,) int, the trajectory at each batch position (repeats allowed); default
            ``0..len(per_trajectory)-1``.
        vocab_size: ids must be below it when given.

    Returns:
        ``PackedTensor`` (values (sum R, k) int32, cu_seqlens (B + 1,) int32) or
        ``RaggedSupport``, segment b = trajectory ``index[b]``.
    """
    segs = [_segment(item, i) for i, item in enumerate(per_trajectory)]
    if not segs:
        raise ValueError("collation: no trajectories to collate")
    kinds = {type(s) for s in segs}
    if len(kinds) > 1:
        raise ValueError(
            "collation: trajectories mix fixed-width and ragged rows; convert fixed rows with "
            "RaggedSupport.from_padded(...) or ragged rows with .to_padded(top_k)"
        )
    if isinstance(segs[0], PackedTensor):
        widths = {s.values.shape[1] for s in segs}
        if len(widths) > 1:
            raise ValueError(f"collation: trajectories have different row widths {sorted(widths)}; k is fixed per run")
        batch: Support = PackedTensor.cat([s.to(torch.int32) for s in segs])
    else:
        batch = RaggedSupport.cat(segs)
    if sampled_ids is None and all(isinstance(t, SupportTrace) for t in per_trajectory):
        sampled_ids = [t.response_ids for t in per_trajectory]
    sampled = None
    if sampled_ids is not None:
        if len(sampled_ids) != len(segs):
            raise ValueError(f"collation: {len(sampled_ids)} sampled-id sequences for {len(segs)} trajectories")
        parts = [torch.as_tensor(s).reshape(-1) for s in sampled_ids]
        for i, p in enumerate(parts):
            if not is_integer(p):
                raise ValueError(f"collation: trajectory {i} sampled ids have dtype {p.dtype}, expected integer token ids")
        parts = [p.to(torch.int64).cpu() for p in parts]
        for i, (p, s) in enumerate(zip(parts, segs)):
            n = s.num_rows
            if p.numel() != n:
                raise ValueError(
                    f"collation: trajectory {i} has {n} support rows but {p.numel()} response tokens; every "
                    f"response token needs exactly one row"
                )
        sampled = torch.cat(parts)
    validate_support(batch, sampled_ids=sampled, vocab_size=vocab_size, where="collation")
    idx = _batch_index(index, len(segs))
    _check_lengths(
        batch.lengths,
        response_lengths,
        idx,
        "response length",
        "support rows",
        "every response token needs exactly one row (padding rows for observations and a synthetic EOS)",
    )
    return batch.gather(idx)


def collate_routes(
    per_trajectory: Sequence[torch.Tensor],
    *,
    sequence_lengths,
    index=None,
) -> PackedTensor:
    """Build the batch's MoE routes in the trainer's order.

    Args:
        per_trajectory: trajectory i's routes ``(L_i, layers, topk)`` int over all its
            real tokens (prompt and response), e.g. ``RouteTrace.finish(...)``.
        sequence_lengths: (B,) int, the trainer's ``L`` per batch position.
        index: (B,) int, the trajectory at each batch position (repeats allowed).

    Returns:
        PackedTensor: values (sum L, layers, topk), cu_seqlens (B + 1,) int32.
    """
    if not per_trajectory:
        raise ValueError("collation: no trajectories to collate")
    for i, r in enumerate(per_trajectory):
        if not isinstance(r, torch.Tensor) or r.dim() != 3 or not is_integer(r):
            got = f"{r.dtype} {tuple(r.shape)}" if isinstance(r, torch.Tensor) else type(r).__name__
            raise ValueError(f"collation: trajectory {i} routes must be an int (L_i, layers, topk) tensor, got {got}")
        low = int(r.to(torch.int64).min()) if r.numel() else 0  # widened: uint8 routes never meet -1 as 255
        if low < -1:
            raise ValueError(f"collation: trajectory {i} routes hold expert id {low} < -1")
    shapes = {tuple(r.shape[1:]) for r in per_trajectory}
    if len(shapes) > 1:
        raise ValueError(f"collation: trajectories have different route shapes [layers, topk]: {sorted(shapes)}")
    dtypes = {r.dtype for r in per_trajectory}
    dtype = torch.int64 if len(dtypes) > 1 else dtypes.pop()
    batch = PackedTensor.from_segments([r.to(dtype) for r in per_trajectory])
    idx = _batch_index(index, len(per_trajectory))
    _check_lengths(
        batch.lengths,
        sequence_lengths,
        idx,
        "sequence length",
        "route rows",
        "routes cover every real token, prompt and response (RouteTrace.finish returns them)",
    )
    return batch.gather(idx)
