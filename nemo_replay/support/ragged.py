"""RaggedSupport: support sets of unbounded width in CSR form (docs/design.md §2).

When only top-p / min-p bound the candidates, rows have different lengths. This is the
form vLLM's and SGLang's sampling masks return:

    member_ids   (num_members,)   int32   all members, row after row, engine order
    row_offsets  (num_rows + 1,)  int64   row r = member_ids[row_offsets[r]:row_offsets[r+1]]
    cu_seqlens   (batch_size + 1,) int32  trajectory i = rows [cu_seqlens[i], cu_seqlens[i+1])

An empty row means "no support recorded" (the CSR counterpart of an all -1 row).

Worked example: trajectory 0 has rows {4, 9} and {} ; trajectory 1 has row {2, 3, 7}

    member_ids  = [4, 9, 2, 3, 7]
    row_offsets = [0, 2, 2, 5]
    cu_seqlens  = [0, 2, 3]
    to_padded() -> values [[4, 9, -1], [-1, -1, -1], [2, 3, 7]], cu_seqlens [0, 2, 3]
"""

from __future__ import annotations

from typing import Sequence

import torch

from nemo_replay.support.packed import PackedTensor, Segmented, lengths_to_cu_seqlens, segment_row_index
from nemo_replay.support.validate import check_cu_seqlens, describe_row

__all__ = ["RaggedSupport"]


class RaggedSupport(Segmented):
    """Per-token support sets of varying size, batched by trajectory.

    Args:
        member_ids: (num_members,), int32.
        row_offsets: (num_rows + 1,), int64.
        cu_seqlens: (batch_size + 1,), int32.
    """

    __slots__ = ("member_ids", "row_offsets", "cu_seqlens")

    def __init__(self, member_ids: torch.Tensor, row_offsets: torch.Tensor, cu_seqlens: torch.Tensor):
        member_ids = torch.as_tensor(member_ids)
        row_offsets = torch.as_tensor(row_offsets)
        cu_seqlens = torch.as_tensor(cu_seqlens)
        if member_ids.dim() != 1:
            raise ValueError(f"RaggedSupport member_ids must be 1-D [num_members], got shape {tuple(member_ids.shape)}")
        if member_ids.dtype.is_floating_point or member_ids.dtype == torch.bool:
            raise ValueError(f"RaggedSupport member_ids must be integer (int32), got {member_ids.dtype}")
        check_cu_seqlens(row_offsets, member_ids.numel(), name="RaggedSupport row_offsets")
        check_cu_seqlens(cu_seqlens, row_offsets.numel() - 1, name="RaggedSupport cu_seqlens")
        self.member_ids = member_ids.to(torch.int32)
        self.row_offsets = row_offsets.to(device=member_ids.device, dtype=torch.int64)
        self.cu_seqlens = cu_seqlens.to(device=member_ids.device, dtype=torch.int32)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_rows(cls, trajectories: Sequence[Sequence[Sequence[int]]]) -> "RaggedSupport":
        """Build from Python lists: ``trajectories[i][j]`` is the member list of row j of trajectory i."""
        rows = [list(r) for traj in trajectories for r in traj]
        members = torch.tensor([m for r in rows for m in r], dtype=torch.int32)
        row_offsets = lengths_to_cu_seqlens([len(r) for r in rows]).to(torch.int64)
        return cls(members, row_offsets, lengths_to_cu_seqlens([len(t) for t in trajectories]))

    @classmethod
    def from_padded(cls, support: PackedTensor) -> "RaggedSupport":
        """Convert fixed-width rows (trailing -1 padding) to CSR."""
        values = support.values
        keep = values >= 0
        row_offsets = lengths_to_cu_seqlens(keep.sum(1).cpu()).to(torch.int64)
        return cls(values[keep].to(torch.int32), row_offsets.to(values.device), support.cu_seqlens)

    # ------------------------------------------------------------------ views
    @property
    def num_rows(self) -> int:
        return self.row_offsets.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.member_ids.device

    @property
    def row_lengths(self) -> torch.Tensor:
        """(num_rows,), int64 members per row."""
        return self.row_offsets[1:] - self.row_offsets[:-1]

    def row(self, r: int) -> torch.Tensor:
        return self.member_ids[int(self.row_offsets[r]) : int(self.row_offsets[r + 1])]

    def padded_rows(self, rows: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """Chosen rows as a fixed-width int32 matrix with trailing -1.

        Args:
            rows: (n,), int64 global row indices.
            width: columns of the result; defaults to the widest chosen row (at least 1).

        Returns:
            (n, width), int32.
        """
        rows = rows.to(device=self.device, dtype=torch.int64)
        starts = self.row_offsets[rows]
        lengths = self.row_offsets[rows + 1] - starts
        if width is None:
            width = max(int(lengths.max()) if lengths.numel() else 0, 1)
        elif lengths.numel() and int(lengths.max()) > width:
            raise ValueError(f"a chosen row holds {int(lengths.max())} members, more than width={width}")
        cols = torch.arange(width, device=self.device)
        present = cols[None, :] < lengths[:, None]
        flat = (starts[:, None] + cols[None, :]).clamp(max=max(self.member_ids.numel() - 1, 0))
        if self.member_ids.numel() == 0:
            return torch.full((rows.numel(), width), -1, dtype=torch.int32, device=self.device)
        return torch.where(present, self.member_ids[flat], torch.full_like(self.member_ids[flat], -1))

    def to_padded(self, width: int | None = None) -> PackedTensor:
        """The fixed-width form: ``[num_rows, width]`` int32 rows with trailing -1."""
        values = self.padded_rows(torch.arange(self.num_rows), width)
        return PackedTensor(values, self.cu_seqlens)

    # ------------------------------------------------------------------ batch ops
    def gather(self, segments: torch.Tensor | Sequence[int]) -> "RaggedSupport":
        """A new batch holding the chosen trajectories in the given order (repeats allowed)."""
        index = PackedTensor(torch.empty(self.num_rows, 0), self.cu_seqlens.cpu())._normalise_index(segments)
        rows, seg_lengths = segment_row_index(self.cu_seqlens.cpu(), index)
        members, row_lengths = segment_row_index(self.row_offsets.cpu(), rows)
        return RaggedSupport(
            self.member_ids[members.to(self.device)],
            lengths_to_cu_seqlens(row_lengths).to(torch.int64),
            lengths_to_cu_seqlens(seg_lengths),
        )

    def __getitem__(self, index) -> "RaggedSupport":
        if isinstance(index, int):
            index = [index]
        elif isinstance(index, slice):
            index = torch.tensor(range(self.batch_size)[index], dtype=torch.int64)
        return self.gather(index)

    def repeat(self, n: int) -> "RaggedSupport":
        return self.gather(torch.arange(self.batch_size).repeat(_positive(n)))

    def repeat_interleave(self, n: int) -> "RaggedSupport":
        return self.gather(torch.arange(self.batch_size).repeat_interleave(_positive(n)))

    @staticmethod
    def cat(items: Sequence["RaggedSupport"]) -> "RaggedSupport":
        items = list(items)
        if not items:
            raise ValueError("RaggedSupport.cat needs at least one batch")
        return RaggedSupport(
            torch.cat([s.member_ids for s in items]),
            lengths_to_cu_seqlens(torch.cat([s.row_lengths.cpu() for s in items])).to(torch.int64),
            lengths_to_cu_seqlens(torch.cat([s.lengths.cpu() for s in items])),
        )

    def to(self, device) -> "RaggedSupport":
        return RaggedSupport(self.member_ids.to(device), self.row_offsets.to(device), self.cu_seqlens.to(device))

    def __eq__(self, other) -> bool:
        if not isinstance(other, RaggedSupport):
            return NotImplemented
        return all(
            a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
            for a, b in (
                (self.member_ids, other.member_ids),
                (self.row_offsets, other.row_offsets),
                (self.cu_seqlens, other.cu_seqlens),
            )
        )

    __hash__ = None

    def __repr__(self) -> str:
        return f"RaggedSupport(batch_size={self.batch_size}, rows={self.num_rows}, members={self.member_ids.numel()})"

    # ------------------------------------------------------------------ invariants
    def validate(self, *, vocab_size: int | None = None, where: str = "support") -> None:
        """Members in ``[0, vocab_size)`` and no duplicate id in a row (vectorised)."""
        ids = self.member_ids.to(torch.int64)
        if ids.numel() == 0:
            return
        row_of = torch.repeat_interleave(torch.arange(self.num_rows, device=self.device), self.row_lengths)

        def fail(bad: torch.Tensor, what: str) -> None:
            r = int(row_of[torch.nonzero(bad)[0]])
            raise ValueError(f"{where}: {describe_row(self.cu_seqlens, r)} {what}: {self.row(r).tolist()[:16]}")

        if (ids < 0).any():
            fail(ids < 0, "holds a negative id (CSR rows carry members only, no -1 padding)")
        if vocab_size is not None and (ids >= vocab_size).any():
            fail(ids >= vocab_size, f"holds an id >= vocab_size={vocab_size}")
        # Sort by (row, id) with two stable sorts, then compare neighbours.
        order = torch.sort(ids, stable=True).indices
        order = order[torch.sort(row_of[order], stable=True).indices]
        same = (ids[order][1:] == ids[order][:-1]) & (row_of[order][1:] == row_of[order][:-1])
        if same.any():
            bad = torch.zeros_like(ids, dtype=torch.bool)
            bad[order[1:][same]] = True
            fail(bad, "holds a duplicate id")


def _positive(n: int) -> int:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"repeat count must be a positive int, got {n!r}")
    return n
