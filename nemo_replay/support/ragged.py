"""RaggedSupport: support sets of unbounded width in CSR form (docs/design.md §2).

When only top-p / min-p bound the candidates, rows have different lengths. This is the
form vLLM's and SGLang's sampling masks return:

    member_ids   (num_members,)   int32   all members, row after row, engine order
    row_offsets  (num_rows + 1,)  int64   row r = member_ids[row_offsets[r]:row_offsets[r+1]]
    cu_seqlens   (batch_size + 1,) int32  trajectory i = rows [cu_seqlens[i], cu_seqlens[i+1])

An empty row means "no support recorded" (the CSR counterpart of an all -1 row). Rows that
passed the docs/design.md §2 checks keep that record through every batch operation
(:mod:`nemo_replay.support.checked`).

Worked example: trajectory 0 has rows {4, 9} and {} ; trajectory 1 has row {2, 3, 7}

    member_ids  = [4, 9, 2, 3, 7]
    row_offsets = [0, 2, 2, 5]
    cu_seqlens  = [0, 2, 3]
    to_padded() -> values [[4, 9, -1], [-1, -1, -1], [2, 3, 7]], cu_seqlens [0, 2, 3]
"""

from __future__ import annotations

from typing import Sequence

import torch

from nemo_replay.support.checked import Checked, carry_checked, checked, tensor_version
from nemo_replay.support.dtypes import is_integer
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.membership import csr_membership
from nemo_replay.support.packed import PackedTensor, Segmented, check_cu_seqlens, lengths_to_cu_seqlens, segment_row_index
from nemo_replay.support.validate import describe_row, validate_support_rows

__all__ = ["RaggedSupport", "as_support", "is_support"]

_MAX_ID = 2**31 - 1  # ids from outside stay below it: int32 storage, and the codec's largest vocabulary


class RaggedSupport(Segmented):
    """Per-token support sets of varying size, batched by trajectory.

    Args:
        member_ids: (num_members,), int32.
        row_offsets: (num_rows + 1,), int64.
        cu_seqlens: (batch_size + 1,), int32.
    """

    __slots__ = ("member_ids", "row_offsets", "cu_seqlens", "_width")

    csr = True

    def __init__(self, member_ids: torch.Tensor, row_offsets: torch.Tensor, cu_seqlens: torch.Tensor):
        for name, value in (("member_ids", member_ids), ("row_offsets", row_offsets), ("cu_seqlens", cu_seqlens)):
            if value is None:
                raise ValueError(f"RaggedSupport {name} is required (see the class docstring for its shape), got None")
        member_ids = torch.as_tensor(member_ids)
        row_offsets = torch.as_tensor(row_offsets)
        cu_seqlens = torch.as_tensor(cu_seqlens)
        if member_ids.dim() != 1:
            raise ValueError(f"RaggedSupport member_ids must be 1-D [num_members], got shape {tuple(member_ids.shape)}")
        if not is_integer(member_ids):
            raise ValueError(f"RaggedSupport member_ids must be integer (int32), got {member_ids.dtype}")
        if member_ids.dtype == torch.int64 and member_ids.numel():
            low, high = (int(x) for x in torch.aminmax(member_ids))
            if low < -(2**31) or high >= 2**31:  # int32 storage would wrap them onto other ids
                raise ValueError(
                    f"RaggedSupport member_ids hold {low if low < -(2**31) else high}, outside int32; member ids are "
                    f"vocabulary ids"
                )
        check_cu_seqlens(row_offsets, member_ids.numel(), name="RaggedSupport row_offsets")
        check_cu_seqlens(cu_seqlens, row_offsets.numel() - 1, name="RaggedSupport cu_seqlens")
        self.member_ids = member_ids.to(torch.int32)
        self.row_offsets = row_offsets.to(device=member_ids.device, dtype=torch.int64)
        self.cu_seqlens = cu_seqlens.to(device=member_ids.device, dtype=torch.int32)
        self._width = None

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
        out = cls(values[keep].to(torch.int32), row_offsets.to(values.device), support.cu_seqlens)
        return carry_checked([support], out.bounded(int(values.shape[1])))

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

    @property
    def checked(self) -> Checked | None:
        """The record of a passed docs/design.md §2 check (and its vocabulary), or None."""
        return checked(self)

    @property
    def width_bound(self) -> int:
        """An upper bound on the members of any row (at least 1): the width of a padded copy.

        Computed from the rows on first use (one host read) and kept while ``row_offsets``
        is not edited in place; batches taken from this one (``gather``, slices, ``repeat``,
        ``to``) inherit it, ``cat`` takes the largest.
        """
        if self._cached_width() is None:
            lengths = self.row_lengths
            self._set_width(max(int(lengths.max()) if lengths.numel() else 0, 1))
        return self._width[0]

    def bounded(self, width: int) -> "RaggedSupport":
        """Sets, on these rows, the width of their padded copies (the fixed width they were captured
        at, so that scores from them equal the fixed-width rows' bit for bit) and returns them.
        ``width`` must hold the widest row: a narrower one would cut rows when padded."""
        widest = int(self.row_lengths.max()) if self.num_rows else 0
        if width < max(widest, 1):
            raise ValueError(
                f"RaggedSupport.bounded: width {width} is narrower than the widest row ({widest} ids); pass a width "
                f">= {max(widest, 1)} (the row width the rows were captured at), or leave the rows unbounded"
            )
        self._set_width(width)
        return self

    def _cached_width(self) -> int | None:
        w = self._width
        if w is None or w[1] is not self.row_offsets or w[2] != tensor_version(self.row_offsets):
            return None
        return w[0]

    def _set_width(self, width: int) -> None:
        self._width = (int(width), self.row_offsets, tensor_version(self.row_offsets))

    def _derived(self, out: "RaggedSupport", sources: Sequence["RaggedSupport"]) -> "RaggedSupport":
        """``out`` built from the rows of ``sources``: their check record and width bound carry over."""
        widths = [s._cached_width() for s in sources]
        if all(w is not None for w in widths):
            out._set_width(max(widths))
        return carry_checked(sources, out)

    @property
    def all_ids(self) -> torch.Tensor:
        return self.member_ids

    def nonempty_rows(self) -> torch.Tensor:
        """(num_rows,) bool: rows holding at least one member."""
        return self.row_lengths > 0

    def resegment(self, cu_seqlens: torch.Tensor | Sequence[int]) -> "RaggedSupport":
        """The same rows, split into trajectories by ``cu_seqlens``; a passed check carries over."""
        cu_seqlens = torch.as_tensor(cu_seqlens).to(device=self.device, dtype=torch.int32)
        return self._derived(RaggedSupport(self.member_ids, self.row_offsets, cu_seqlens), [self])

    def widen(self, width: int) -> "RaggedSupport":
        """CSR rows have no columns to pad: the rows as they are."""
        return self

    @classmethod
    def of(cls, support: "RaggedSupport | PackedTensor") -> "RaggedSupport":
        """The CSR form of either support form (fixed-width rows lose their -1 padding)."""
        return support if support.csr else cls.from_padded(support)

    @classmethod
    def checked_of(cls, rows: "RaggedSupport | PackedTensor | torch.Tensor", *, where: str) -> "RaggedSupport":
        """The CSR form of rows handed over from outside (an engine's, another framework's): CSR rows as they
        are, fixed-width rows (a :class:`PackedTensor`, or bare ``(rows, k)`` as one segment) held to
        docs/design.md §2 first unless a passed check says so. :meth:`of` keeps every id >= 0 wherever it
        sits: ``[5, -1, 1]`` would read as {1, 5}, ``[5, -25536, -1]`` (token 40000 wrapped by int16) as {5},
        a float 3.7 as 3.

        Raises:
            ValueError naming ``where`` and the row: not an integer ``(rows, k)`` tensor, an id below -1 or
            at or past ``2**31 - 1`` (int32 storage, the codec's largest vocabulary), a member after -1
            padding, an id twice in a row.
        """
        if getattr(rows, "csr", False):
            return rows
        packed = rows if isinstance(rows, PackedTensor) else None
        values = rows.values if packed is not None else rows
        record = checked(rows) if packed is not None or isinstance(rows, torch.Tensor) else None
        if record is None or not record.covers(_MAX_ID):
            cu = packed.cu_seqlens if packed is not None and packed.batch_size > 1 else None  # else "row r" names it
            validate_support_rows(values, vocab_size=_MAX_ID, cu_seqlens=cu, where=where)
        return cls.from_padded(packed if packed is not None else PackedTensor(values, [0, values.shape[0]]))

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
        if not isinstance(rows, torch.Tensor) or not is_integer(rows):
            raise ValueError(f"padded_rows: rows must be an integer tensor of row indices, got {type(rows).__name__}")
        rows = rows.to(device=self.device, dtype=torch.int64)
        lengths = self.row_offsets[rows + 1] - self.row_offsets[rows]
        if width is None:
            width = max(int(lengths.max()) if lengths.numel() else 0, 1)
        elif lengths.numel() and int(lengths.max()) > width:
            raise ValueError(f"a chosen row holds {int(lengths.max())} members, more than width={width}")
        return self.gather_padded(rows, width)

    def gather_padded(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """:meth:`padded_rows` without its checks or host reads: ``width`` must bound every chosen row
        (:attr:`width_bound` does).

        Args:
            rows: (n,), int64 row indices in ``[0, num_rows)``, on this support's device.
            width: columns of the result (>= 1).

        Returns:
            (n, width), int32; row i is ``member_ids[row_offsets[rows[i]]:row_offsets[rows[i] + 1]]``
            then -1. Example: rows {4, 9}, {}, {2, 3, 7}, ``rows = [2, 0]``, width 3 ->
            ``[[2, 3, 7], [4, 9, -1]]``.
        """
        if self.member_ids.numel() == 0:
            return torch.full((rows.numel(), width), -1, dtype=torch.int32, device=self.device)
        starts = self.row_offsets[rows]
        lengths = self.row_offsets[rows + 1] - starts
        cols = torch.arange(width, device=self.device)
        present = cols[None, :] < lengths[:, None]
        flat = (starts[:, None] + cols[None, :]).clamp_(max=self.member_ids.numel() - 1)
        members = self.member_ids[flat]
        return torch.where(present, members, torch.full_like(members, -1))

    def to_padded(self, width: int | None = None) -> PackedTensor:
        """The fixed-width form: ``[num_rows, width]`` int32 rows with trailing -1; ``width``
        defaults to :attr:`width_bound` (the captured width of rows that had one)."""
        values = self.padded_rows(torch.arange(self.num_rows), self.width_bound if width is None else width)
        return carry_checked([self], PackedTensor(values, self.cu_seqlens))  # padding keeps checked rows valid

    # ------------------------------------------------------------------ batch ops
    def gather(self, segments: torch.Tensor | Sequence[int]) -> "RaggedSupport":
        """A new batch holding the chosen trajectories in the given order (repeats allowed)."""
        index = PackedTensor(torch.empty(self.num_rows, 0), self.cu_seqlens.cpu())._normalise_index(segments)
        rows, seg_lengths = segment_row_index(self.cu_seqlens.cpu(), index)
        members, row_lengths = segment_row_index(self.row_offsets.cpu(), rows)
        out = RaggedSupport(
            self.member_ids[members.to(self.device)],
            lengths_to_cu_seqlens(row_lengths).to(torch.int64),
            lengths_to_cu_seqlens(seg_lengths),
        )
        return self._derived(out, [self])

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
        out = RaggedSupport(
            torch.cat([s.member_ids for s in items]),
            lengths_to_cu_seqlens(torch.cat([s.row_lengths.cpu() for s in items])).to(torch.int64),
            lengths_to_cu_seqlens(torch.cat([s.lengths.cpu() for s in items])),
        )
        return items[0]._derived(out, items)

    def to(self, device) -> "RaggedSupport":
        out = RaggedSupport(self.member_ids.to(device), self.row_offsets.to(device), self.cu_seqlens.to(device))
        return self._derived(out, [self])

    def __eq__(self, other) -> bool:
        if not getattr(other, "csr", False):
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

    def __reduce__(self):
        """Pickled (Ray, multiprocessing, ``torch.save``) as its three tensors and its width bound,
        rebuilt through the constructor. The check record stays behind (it holds a weak reference
        to ``row_offsets``, which pickle refuses): the rows come back unchecked and are checked
        again where they are used. ``detach()`` gives the ids without the record, same storage."""
        return RaggedSupport, (self.member_ids.detach(), self.row_offsets, self.cu_seqlens), self._cached_width()

    def __setstate__(self, width: int | None) -> None:
        """The width bound of the pickled rows (None: computed again on first use)."""
        if width is not None:
            self.bounded(width)

    def __repr__(self) -> str:
        return f"RaggedSupport(batch_size={self.batch_size}, rows={self.num_rows}, members={self.member_ids.numel()})"

    # ------------------------------------------------------------------ invariants
    def _sorted_members(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Members in (row, id) order: (ids int64, row of each member, order), by two stable sorts."""
        ids = self.member_ids.to(torch.int64)
        row_of = torch.repeat_interleave(
            torch.arange(self.num_rows, device=self.device), self.row_lengths, output_size=ids.numel()
        )
        order = torch.sort(ids, stable=True).indices
        order = order[torch.sort(row_of[order], stable=True).indices]
        return ids, row_of, order

    def invalid_flag(self, *, vocab_size: int | torch.Tensor | None = None) -> torch.Tensor:
        """0-d bool, True when :meth:`validate` would raise; no host sync.

        ``vocab_size``: an int or a 0-d integer tensor on the members' device.
        """
        if self.member_ids.numel() == 0:
            return torch.zeros((), dtype=torch.bool, device=self.device)
        ids, row_of, order = self._sorted_members()
        lowest, highest = torch.aminmax(ids)
        bad = lowest < 0
        if vocab_size is not None:
            bad = bad | (highest >= vocab_size)
        same = (ids[order][1:] == ids[order][:-1]) & (row_of[order][1:] == row_of[order][:-1])
        return bad | same.any()

    def validate(self, *, vocab_size: int | None = None, sampled_ids: torch.Tensor | None = None, where: str = "support") -> None:
        """Members in ``[0, vocab_size)``, no duplicate id in a row, and each non-empty row holding its
        ``sampled_ids`` entry when given (vectorised).

        Valid rows cost one host read (:meth:`invalid_flag`), two with ``sampled_ids``; only a failure
        pays for naming the row.
        """
        if bool(self.invalid_flag(vocab_size=vocab_size)):
            self._name_invalid_row(vocab_size, where)
        if sampled_ids is not None:
            self._check_members(torch.as_tensor(sampled_ids), where)

    def _check_members(self, sampled_ids: torch.Tensor, where: str) -> None:
        """Each non-empty row must contain its sampled token.

        Worked example: member_ids [4, 9, 2, 3, 7], row_offsets [0, 2, 2, 5], sampled [9, 5, 1]
        -> row_of_member [0, 0, 2, 2, 2]; hits at member 1 (row 0); row 1 is empty (exempt);
        row 2 has no hit -> error naming row 2.
        """
        if sampled_ids.shape != (self.num_rows,):
            raise ValueError(
                f"{where}: sampled_ids has shape {tuple(sampled_ids.shape)}, expected ({self.num_rows},) "
                f"-- one sampled token per support row"
            )
        lengths = self.row_lengths
        row_of = torch.repeat_interleave(torch.arange(self.num_rows, device=self.device), lengths,
                                         output_size=self.member_ids.numel())  # no host read of the total
        sampled = sampled_ids.to(device=self.device, dtype=torch.int64)
        found, _ = csr_membership(self.member_ids, row_of, sampled)
        missing = (lengths > 0) & ~found
        if missing.any():
            r = int(torch.nonzero(missing)[0])
            raise SupportAlignmentError(
                f"{where}: {describe_row(self.cu_seqlens, r)}: sampled token {int(sampled[r])} is not a member "
                f"of its support row {self.row(r).tolist()[:16]}; rows and tokens are misaligned"
            )

    def _name_invalid_row(self, vocab_size: int | None, where: str) -> None:
        ids, row_of, order = self._sorted_members()

        def fail(bad: torch.Tensor, what: str) -> None:
            r = int(row_of[torch.nonzero(bad)[0]])
            raise ValueError(f"{where}: {describe_row(self.cu_seqlens, r)} {what}: {self.row(r).tolist()[:16]}")

        if (ids < 0).any():
            fail(ids < 0, "holds a negative id (CSR rows carry members only, no -1 padding)")
        if vocab_size is not None and (ids >= vocab_size).any():
            fail(ids >= vocab_size, f"holds an id >= vocab_size={vocab_size}")
        # Sorted by (row, id): a duplicate sits next to its twin.
        same = (ids[order][1:] == ids[order][:-1]) & (row_of[order][1:] == row_of[order][:-1])
        if same.any():
            bad = torch.zeros_like(ids, dtype=torch.bool)
            bad[order[1:][same]] = True
            fail(bad, "holds a duplicate id")
        raise AssertionError("the support flag was set but no row breaks the checks")  # pragma: no cover


def _positive(n: int) -> int:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"repeat count must be a positive int, got {n!r}")
    return n


def is_support(x) -> bool:
    """Support rows of either form (:class:`~nemo_replay.support.packed.PackedTensor` or :class:`RaggedSupport`)."""
    return isinstance(x, (PackedTensor, RaggedSupport))


def as_support(support, device) -> "PackedTensor | RaggedSupport":
    """The scorer's support argument as a PackedTensor of int32/int64 ``(rows, k)`` rows or a
    RaggedSupport, on ``device``. A bare ``(rows, k)`` tensor becomes one segment; compact rows
    (:class:`~nemo_replay.support.codec.CompactRows`) decode themselves on the device they are
    moved to."""
    if isinstance(support, torch.Tensor):
        if support.dim() != 2:
            raise ValueError(f"support rows must be (rows, k), got shape {tuple(support.shape)}")
        support = PackedTensor(support, [0, support.shape[0]])
    elif hasattr(support, "decode") and hasattr(support, "to"):
        support = support.to(device)
    if not is_support(support):
        raise ValueError(
            f"support must be a PackedTensor of (rows, k) int rows, a RaggedSupport, compact rows or a (rows, k) "
            f"tensor, got {type(support).__name__}"
        )
    ids = support.all_ids  # RaggedSupport checked its members' dtype when it was built
    if ids.dim() != 2 and isinstance(support, PackedTensor):
        raise ValueError(f"fixed-width support values must be (rows, k), got {tuple(ids.shape)}")
    if not is_integer(ids):
        raise ValueError(f"support rows must be integer (int32), got {ids.dtype}")
    if ids.dtype not in (torch.int32, torch.int64):
        support = support.to(torch.int64)  # narrow ids would wrap in comparisons (uint8: -1 is 255)
    return support if support.device == device else support.to(device)
