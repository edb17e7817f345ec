"""PackedTensor: ragged token-aligned rows of a batch held as one buffer (docs/design.md §2).

    values      (total_rows, *row_shape)   any dtype
    cu_seqlens  (batch_size + 1,) int32    segment i = values[cu_seqlens[i]:cu_seqlens[i+1]]

Worked example: three trajectories with 2, 0 and 3 response rows of width k=2

    values     = [[5, 7], [9, -1], [1, 2], [3, -1], [4, 8]]
    cu_seqlens = [0, 2, 2, 5]
    pt[2]      -> values[2:5]              (a tensor: one segment)
    pt[[2, 0]] -> values[[2, 3, 4, 0, 1]], cu_seqlens [0, 3, 5]
    pt.repeat_interleave(2)  -> segments 0, 0, 1, 1, 2, 2   (GRPO groups)
    pt.repeat(2)             -> segments 0, 1, 2, 0, 1, 2

Every batch operation addresses whole segments; no operation mutates its inputs. Rows
that passed the docs/design.md §2 checks keep that record through every batch operation
(:mod:`nemo_replay.support.checked`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from nemo_replay.support.checked import Checked, carry_checked, checked
from nemo_replay.support.dtypes import is_integer
from nemo_replay.support.validate import support_row_flags, validate_support_rows

__all__ = ["PackedTensor", "Segmented", "check_cu_seqlens", "lengths_to_cu_seqlens", "segment_row_index"]


def lengths_to_cu_seqlens(lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """(batch_size,) lengths -> (batch_size + 1,) int32 offsets starting at 0."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu.to(torch.int32)


def segment_row_index(cu_seqlens: torch.Tensor, segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of the chosen segments, concatenated, and the new lengths.

    Args:
        cu_seqlens: (batch_size + 1,), int32.
        segments: (n,), int64 segment indices (repeats allowed).

    Returns:
        rows: (sum of chosen lengths,), int64 row indices into the packed buffer.
        lengths: (n,), int64.

    Example: cu_seqlens [0, 2, 2, 5], segments [2, 0] -> rows [2, 3, 4, 0, 1], lengths [3, 2].
    """
    cu = cu_seqlens.to(torch.int64)
    starts = cu[segments]
    lengths = cu[segments + 1] - starts
    total = int(lengths.sum())
    # Position of each output row inside its segment: arange minus the segment's output start.
    out_starts = torch.cumsum(lengths, 0) - lengths
    seg_of_row = torch.repeat_interleave(torch.arange(segments.numel()), lengths, output_size=total)
    within = torch.arange(total) - out_starts[seg_of_row]
    return starts[seg_of_row] + within, lengths


def check_cu_seqlens(cu_seqlens: torch.Tensor, num_rows: int, *, name: str = "cu_seqlens") -> None:
    """Check segment offsets.

    Args:
        cu_seqlens: (batch_size + 1,), integer. Must start at 0, be non-decreasing and end
            at ``num_rows``.
        num_rows: number of rows in the packed buffer the offsets index.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be 1-D with batch_size + 1 entries, got shape {tuple(cu_seqlens.shape)}")
    if not is_integer(cu_seqlens):
        raise ValueError(f"{name} must be an integer tensor, got {cu_seqlens.dtype}")
    if int(cu_seqlens[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu_seqlens[0])}")
    if cu_seqlens.numel() > 1:
        wide = cu_seqlens.to(torch.int64)  # uint8 differences wrap: 3 - 5 would read 254
        steps = wide[1:] - wide[:-1]
        bad = torch.nonzero(steps < 0)
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"{name} must be non-decreasing: segment {i} has offsets "
                f"{int(cu_seqlens[i])} -> {int(cu_seqlens[i + 1])}"
            )
    if int(cu_seqlens[-1]) != num_rows:
        raise ValueError(
            f"{name} ends at {int(cu_seqlens[-1])} but the buffer holds {num_rows} rows; "
            f"the last offset must equal the number of rows"
        )


class Segmented:
    """Views shared by batches whose trajectories are addressed by ``cu_seqlens`` (B + 1,).

    Support rows come in two forms, fixed-width (:class:`PackedTensor` of ``(rows, k)`` ids with
    trailing -1) and CSR (:class:`~nemo_replay.support.ragged.RaggedSupport`). Both answer the
    same support methods, so no caller branches on the form (docs/design.md §2);
    ``RaggedSupport.of(support)`` is the CSR form of either:

    ============================  ====================================================
    ``all_ids``                   every id the rows hold (padding included), for bounds
    ``width_bound``               columns that hold any row padded with -1
    ``nonempty_rows()``           (rows,) bool: a support was recorded
    ``gather_padded(rows, w)``    (n, w) chosen rows, trailing -1, no host read
    ``invalid_flag(vocab_size)``  0-d bool: :meth:`validate` would raise; no host read
    ``validate(...)``             the §2 invariants and membership, naming the row
    ``resegment(cu_seqlens)``     the same rows under new trajectory boundaries
    ``widen(width)``              rows padded to at least ``width`` columns
    ``to_padded(width=None)``     the fixed-width form (``width_bound`` wide by default)
    ``gather``, ``cat``, ``to``   batch operations; a passed check carries over
    ``csr``                       the form: True for CSR rows (a wire or a store that
                                  writes each form its own way asks this, not the type)
    ============================  ====================================================
    """

    __slots__ = ()

    #: CSR rows (True) or a fixed-width buffer (False).
    csr = False

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens.numel() - 1

    def __len__(self) -> int:
        return self.batch_size

    @property
    def lengths(self) -> torch.Tensor:
        """(batch_size,), int64 rows per trajectory."""
        cu = self.cu_seqlens.to(torch.int64)
        return cu[1:] - cu[:-1]


class PackedTensor(Segmented):
    """Ragged per-trajectory rows in one buffer.

    Args:
        values: (total_rows, *row_shape), any dtype (support rows: int32 (rows, k);
            MoE routes: int [tokens, layers, topk]).
        cu_seqlens: (batch_size + 1,), int32 (other integer dtypes are converted).
    """

    __slots__ = ("values", "cu_seqlens")

    def __init__(self, values: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int]):
        if not isinstance(values, torch.Tensor):
            raise ValueError(f"PackedTensor values must be a torch.Tensor, got {type(values).__name__}")
        if values.dim() < 1:
            raise ValueError("PackedTensor values must have a leading row dimension, got a scalar")
        if cu_seqlens is None:
            raise ValueError(
                f"PackedTensor cu_seqlens is required: (batch_size + 1,) segment offsets ending at {values.shape[0]} "
                f"(pass [0, {values.shape[0]}] for one segment), got None"
            )
        cu_seqlens = torch.as_tensor(cu_seqlens)
        check_cu_seqlens(cu_seqlens, values.shape[0], name="PackedTensor cu_seqlens")
        self.values = values
        self.cu_seqlens = cu_seqlens.to(device=values.device, dtype=torch.int32)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_segments(
        cls,
        segments: Sequence[torch.Tensor],
        *,
        row_shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> "PackedTensor":
        """Pack per-trajectory tensors ``(R_i, *row_shape)`` into one buffer.

        ``row_shape``/``dtype`` are needed only when every segment is empty or the list is
        empty; otherwise they are taken from the segments (and must agree).
        """
        segments = [torch.as_tensor(s) for s in segments]
        shapes = {tuple(s.shape[1:]) for s in segments if s.dim() >= 1}
        if any(s.dim() < 1 for s in segments):
            raise ValueError("every segment needs a leading row dimension")
        if len(shapes) > 1:
            raise ValueError(f"segments disagree on row shape: {sorted(shapes)}")
        if row_shape is None:
            if not shapes:
                raise ValueError("cannot infer row_shape from an empty list of segments: pass row_shape=")
            row_shape = next(iter(shapes))
        elif shapes and tuple(row_shape) not in shapes:
            raise ValueError(f"segments have row shape {shapes.pop()}, expected {tuple(row_shape)}")
        if dtype is None:
            dtype = segments[0].dtype if segments else torch.int32
        lengths = [s.shape[0] for s in segments]
        if segments:
            values = torch.cat([s.to(dtype) for s in segments], 0)
        else:
            values = torch.empty((0, *row_shape), dtype=dtype)
        return cls(values, lengths_to_cu_seqlens(lengths))

    # ------------------------------------------------------------------ views
    @property
    def num_rows(self) -> int:
        return self.values.shape[0]

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def checked(self) -> Checked | None:
        """The record of a passed docs/design.md §2 check (and its vocabulary), or None."""
        return checked(self)

    def segment(self, i: int) -> torch.Tensor:
        """The rows of trajectory ``i`` (a view)."""
        if not -self.batch_size <= i < self.batch_size:
            raise IndexError(f"segment {i} out of range for a batch of {self.batch_size}")
        i %= self.batch_size
        return self.values[int(self.cu_seqlens[i]) : int(self.cu_seqlens[i + 1])]

    def segments(self) -> list[torch.Tensor]:
        return [self.segment(i) for i in range(self.batch_size)]

    def segment_ids(self) -> torch.Tensor:
        """(total_rows,), int64: the trajectory each row belongs to."""
        return torch.repeat_interleave(torch.arange(self.batch_size, device=self.device), self.lengths.to(self.device),
                                       output_size=int(self.cu_seqlens[-1]))

    # ------------------------------------------------------------------ batch ops
    def _normalise_index(self, index) -> torch.Tensor:
        if index is None:
            raise ValueError("segment index is required: an int, slice, 1-D int list/tensor or bool mask, got None")
        if isinstance(index, slice):
            # range() slicing also takes negative steps, which tensor slicing rejects.
            return torch.tensor(range(self.batch_size)[index], dtype=torch.int64)
        idx = torch.as_tensor(index)
        if idx.numel() == 0 and idx.dim() == 1:
            return torch.zeros(0, dtype=torch.int64)  # an empty selection ([] parses as float)
        if idx.dtype == torch.bool:
            if idx.shape != (self.batch_size,):
                raise ValueError(f"boolean segment mask must have shape ({self.batch_size},), got {tuple(idx.shape)}")
            return torch.nonzero(idx).flatten()
        if idx.dtype.is_floating_point or idx.dim() != 1:
            raise ValueError(f"segment index must be an int, slice, 1-D int list/tensor or bool mask, got {index!r}")
        idx = idx.to(torch.int64).cpu()
        if idx.numel() and (idx.min() < -self.batch_size or idx.max() >= self.batch_size):
            raise IndexError(f"segment index {idx.tolist()} out of range for a batch of {self.batch_size}")
        return idx % max(self.batch_size, 1)

    def __getitem__(self, index):
        if isinstance(index, int):
            return self.segment(index)
        return self.gather(self._normalise_index(index))

    def gather(self, segments: torch.Tensor | Sequence[int]) -> "PackedTensor":
        """A new batch holding the chosen segments in the given order (repeats allowed)."""
        segments = self._normalise_index(segments)
        rows, lengths = segment_row_index(self.cu_seqlens.cpu(), segments)
        return carry_checked([self], PackedTensor(self.values[rows.to(self.device)], lengths_to_cu_seqlens(lengths)))

    def repeat(self, n: int) -> "PackedTensor":
        """The whole batch ``n`` times: segments 0..B-1, 0..B-1, ..."""
        _check_repeat(n)
        return self.gather(torch.arange(self.batch_size).repeat(n))

    def repeat_interleave(self, n: int) -> "PackedTensor":
        """Each segment ``n`` times in a row: 0, 0, 1, 1, ... (GRPO group sampling)."""
        _check_repeat(n)
        return self.gather(torch.arange(self.batch_size).repeat_interleave(n))

    @staticmethod
    def cat(items: Sequence["PackedTensor"]) -> "PackedTensor":
        """Concatenate batches: segments of the first, then of the second, ..."""
        items = list(items)
        if not items:
            raise ValueError("PackedTensor.cat needs at least one batch")
        shapes = {tuple(p.values.shape[1:]) for p in items}
        if len(shapes) > 1:
            raise ValueError(f"cannot concatenate batches with different row shapes: {sorted(shapes)}")
        dtypes = {p.dtype for p in items}
        if len(dtypes) > 1:
            raise ValueError(f"cannot concatenate batches with different dtypes: {sorted(map(str, dtypes))}")
        values = torch.cat([p.values for p in items], 0)
        lengths = torch.cat([p.lengths.cpu() for p in items])
        return carry_checked(items, PackedTensor(values, lengths_to_cu_seqlens(lengths)))

    def to(self, *args, **kwargs) -> "PackedTensor":
        """Move/cast ``values`` like ``Tensor.to``; ``cu_seqlens`` follows the device, stays int32."""
        return carry_checked([self], PackedTensor(self.values.to(*args, **kwargs), self.cu_seqlens))

    # ------------------------------------------------------------------ support rows: (rows, k) int
    @property
    def all_ids(self) -> torch.Tensor:
        return self.values

    @property
    def width_bound(self) -> int:
        return self.values.shape[1]

    def nonempty_rows(self) -> torch.Tensor:
        """(num_rows,) bool: rows whose first entry is an id (a row is all -1 or starts with a member)."""
        values = self.values
        if values.shape[1] == 0:
            return torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
        return values[:, 0] >= 0

    def gather_padded(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """(n, max(width, k)) rows ``rows`` (int64 indices in ``[0, num_rows)``) with trailing -1 columns
        beyond ``k``; no host read. Example: rows ``[[4, 9], [2, -1]]``, ``rows = [1, 0]``, width 3 ->
        ``[[2, -1, -1], [4, 9, -1]]``."""
        values = self.values
        k = values.shape[1]
        out = values.index_select(0, rows) if values.shape[0] else values.new_full((rows.numel(), k), -1)
        if width > k:
            out = torch.cat([out, out.new_full((out.shape[0], width - k), -1)], 1)
        return out

    def invalid_flag(self, *, vocab_size: int | torch.Tensor | None = None) -> torch.Tensor:
        """0-d bool, True when :meth:`validate` would raise (membership aside); no host sync."""
        return support_row_flags(self.values, vocab_size=vocab_size)

    def validate(self, *, vocab_size: int | None = None, sampled_ids: torch.Tensor | None = None, where: str = "support") -> None:
        """The docs/design.md §2 invariants; each non-empty row holds its ``sampled_ids`` entry when given."""
        if sampled_ids is not None:
            sampled_ids = torch.as_tensor(sampled_ids).to(self.device)
        validate_support_rows(self.values, vocab_size=vocab_size, cu_seqlens=self.cu_seqlens, sampled_ids=sampled_ids, where=where)

    def resegment(self, cu_seqlens: torch.Tensor | Sequence[int]) -> "PackedTensor":
        """The same rows, split into trajectories by ``cu_seqlens``; a passed check carries over."""
        return carry_checked([self], PackedTensor(self.values, cu_seqlens))

    def widen(self, width: int) -> "PackedTensor":
        """Rows padded with trailing -1 columns to at least ``width``: every row stays valid, the
        check record carries over."""
        if width <= self.values.shape[1]:
            return self
        wide = self.gather_padded(torch.arange(self.num_rows, device=self.device), width)
        return carry_checked([self], PackedTensor(wide, self.cu_seqlens))

    def to_padded(self, width: int | None = None) -> "PackedTensor":
        """The fixed-width form, which this already is (``RaggedSupport.to_padded``'s twin, so
        callers need not ask which form they hold): padded to ``width`` when it is wider."""
        return self if width is None else self.widen(width)

    def __eq__(self, other) -> bool:
        if not isinstance(other, PackedTensor):
            return NotImplemented
        return (
            self.values.shape == other.values.shape
            and self.values.dtype == other.values.dtype
            and torch.equal(self.cu_seqlens.cpu(), other.cu_seqlens.cpu())
            and torch.equal(self.values.cpu(), other.values.cpu())
        )

    __hash__ = None  # mutable tensors inside

    def __repr__(self) -> str:
        return (
            f"PackedTensor(batch_size={self.batch_size}, rows={self.num_rows}, "
            f"row_shape={tuple(self.values.shape[1:])}, dtype={self.dtype})"
        )


def _check_repeat(n: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"repeat count must be a positive int, got {n!r}")
