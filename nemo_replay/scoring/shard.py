"""Where this rank's vocabulary shard sits: one options object for every call that scores.

Under tensor parallelism the LM head (and so the logits) is split along the vocabulary:
rank r holds global ids ``[start, end)`` and the scorer reduces over ``group``. The three
travel together everywhere a shard goes (the scorer, the strategies, the integrations).

Worked example, V = 423 split unevenly over two ranks as 200 / 223:

    rank 0: VocabShard(0, 200, group)      logits[..., j] is global id j
    rank 1: VocabShard(200, 423, group)    logits[..., j] is global id 200 + j

``VocabShard.from_group(group, local_size)`` learns that split with one all-gather of the
local sizes (call it once per model, not per step); ``VocabShard.even(vocab_size, group)``
is Megatron's split (the padded vocabulary divides by the TP size) and needs no collective.
Both also record the global vocabulary size (423 above), which lets the scorer check ids
against it before its first collective; a shard built by hand without it learns the size
from the scorer's MAX all-reduce and checks the ids after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from nemo_replay.distributed.groups import group_size_rank

__all__ = ["VocabShard"]


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice ``[start, end)`` of the vocabulary and the group it is sharded over.

    Attributes:
        start: first global id held by this rank (>= 0).
        end: one past the last global id held by this rank (> start).
        group: the tensor-parallel process group, or None when the vocabulary is whole.
        vocab_size: the global vocabulary size (>= end), or None when unknown; without a
            group it is ``end``.
    """

    start: int
    end: int
    group: Optional[object] = None
    vocab_size: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("start", "end") + (("vocab_size",) if self.vocab_size is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"VocabShard.{name} must be an int, got {value!r} ({type(value).__name__})")
        if self.start < 0 or self.end <= self.start:
            raise ValueError(
                f"VocabShard(start={self.start}, end={self.end}) must satisfy 0 <= start < end: it is this rank's "
                f"slice [start, end) of the global vocabulary"
            )
        if self.group is None:
            if self.start != 0:
                raise ValueError(
                    f"VocabShard(start={self.start}, end={self.end}) has no group, so it must hold the whole "
                    f"vocabulary [0, end); pass the tensor-parallel group the vocabulary is sharded over"
                )
            if self.vocab_size is None:
                object.__setattr__(self, "vocab_size", self.end)
        if self.vocab_size is not None and self.vocab_size < self.end:
            raise ValueError(
                f"VocabShard(start={self.start}, end={self.end}, vocab_size={self.vocab_size}): the global vocabulary "
                f"size must be >= end"
            )

    @property
    def size(self) -> int:
        """Number of vocabulary rows this rank holds."""
        return self.end - self.start

    @property
    def world_size(self) -> int:
        """Ranks the vocabulary is sharded over (1 without a group)."""
        return group_size_rank(self.group)[0]

    @classmethod
    def whole(cls, vocab_size: int) -> "VocabShard":
        """The unsharded vocabulary ``[0, vocab_size)``."""
        return cls(0, int(vocab_size), None)

    @classmethod
    def even(cls, vocab_size: int, group) -> "VocabShard":
        """Rank r of ``group`` holds ``[r * V / tp, (r + 1) * V / tp)``; ``vocab_size`` must divide by tp.

        This is Megatron-Core's split (its padded vocabulary is a multiple of the TP size). No collective.
        """
        tp, rank = group_size_rank(group)
        if vocab_size % tp:
            raise ValueError(
                f"VocabShard.even: vocabulary size {vocab_size} does not divide by the {tp} ranks of the group; "
                f"pad the vocabulary to a multiple of {tp} or use VocabShard.from_group(group, local_size)"
            )
        per = vocab_size // tp
        return cls(rank * per, (rank + 1) * per, group, vocab_size)

    @classmethod
    def from_group(cls, group, local_size: int, *, device=None) -> "VocabShard":
        """The shard of this rank when each rank holds ``local_size`` consecutive rows, in rank order.

        One all-gather of the local sizes over ``group`` (every rank must call it), so uneven
        splits work. ``device``: where the gathered sizes live (the group's backend device;
        default CPU, which gloo needs; pass the CUDA device under NCCL).
        """
        if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
            raise ValueError(
                f"VocabShard.from_group: local_size must be this rank's number of vocabulary rows (an int >= 1), "
                f"got {local_size!r}"
            )
        tp, rank = group_size_rank(group)
        if tp == 1:
            return cls(0, int(local_size), group, int(local_size))
        mine = torch.tensor([int(local_size)], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(mine) for _ in range(tp)]
        dist.all_gather(sizes, mine, group=group)
        sizes = [int(s) for s in sizes]
        start = sum(sizes[:rank])
        return cls(start, start + sizes[rank], group, sum(sizes))
