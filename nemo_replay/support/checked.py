"""Which support batches already passed the docs/design.md §2 checks, and against which vocabulary.

Rows are checked where they enter the package (capture, engine adapters, wire decode,
traces, collation: all through ``rollout.boundary.validate_support``). A batch that passed
records it, so the scorer does not sort every row again on every call.

Where the record lives. On the support's id tensor itself (``values`` of a
:class:`PackedTensor`, ``member_ids`` of a :class:`RaggedSupport`, which also pins its
``row_offsets``), with the tensors' version counters at the time of the check. So:

- re-wrapping the same rows with other segment offsets (``PackedTensor(values, cu)``)
  keeps the record: validity does not depend on the segmentation;
- an in-place edit of the rows (through any view: views share the version counter)
  bumps the version and voids the record, so a stale record is never trusted;
- batch operations that build new tensors from checked rows (slicing, ``gather``,
  ``repeat``, ``cat``, ``to``) copy the record over with :func:`carry_checked`: rows taken
  from checked rows are checked rows;
- writes the version counter never sees (through ``.data``, a ``.numpy()`` or
  ``torch.from_numpy`` alias, a DLPack view) are caught by a fingerprint of the ids taken
  with the record: :func:`stale_flag` recomputes it on the device, and the scorer reads it
  with its other guards (no extra host read) and checks the rows again when it changed.

Worked example::

    sup = PackedTensor(rows, cu)            # checked(sup) is None
    validate_support(sup, vocab_size=V, where="collation")
    checked(sup)                            # Checked(vocab_size=V)
    checked(sup[[1, 0]].to(device))         # Checked(vocab_size=V): carried
    sup.values[0, 0] = 7; checked(sup)      # None: edited after the check
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = [
    "Checked", "checked", "record_checked", "carry_checked", "tensor_version", "fingerprint", "stale_flag", "SupportCheck",
]

_ATTR = "_nemo_replay_checked"


@dataclass(frozen=True)
class Checked:
    """A support batch passed the docs/design.md §2 row checks.

    Attributes:
        vocab_size: every id is below it; None when the check had no vocabulary size
            (the ids are then known to be >= -1, trailing-padded and distinct per row,
            and the scorer still checks them against its vocabulary).
    """

    vocab_size: Optional[int]

    def covers(self, vocab_size: Optional[int]) -> bool:
        """True when the record already implies ``ids < vocab_size``."""
        return vocab_size is None or (self.vocab_size is not None and self.vocab_size <= vocab_size)


@dataclass(frozen=True)
class _Record:
    check: Checked
    version: Optional[int]
    offsets: Optional[weakref.ref]  # RaggedSupport: the row_offsets checked with the members
    offsets_version: Optional[int]
    fingerprint: torch.Tensor  # 0-d int64 on the ids' device, :func:`fingerprint` at the check


# Odd 64-bit constants (as signed values): entry i is weighted by 2 * _STEP * i + _ODD, an odd number, so changing
# one entry by d changes the sum by d times an odd weight: never 0 mod 2**b for 0 < |d| < 2**b, b = 64 for int64 ids
# and 32 for int32 ids (summed in their own width). Swapping entries a, b at i, j changes it by
# (a - b) * 2 * _STEP * (i - j), 0 only when (a - b) * (i - j) is a multiple of 2**(b - 1).
_STEP, _ODD = 0x5851F42D4C957F2D, 0x14057B7EF767814F
_WEIGHTS: dict = {}  # (device, dtype) -> the weights of the longest tensor fingerprinted there


def _weights(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (device, dtype)
    w = _WEIGHTS.get(key)
    if w is None or w.numel() < n:
        i = torch.arange(max(n, 1024), device=device, dtype=torch.int64)
        w = (i * (2 * _STEP) + _ODD).to(dtype)  # int32: the low 32 bits, still odd
        _WEIGHTS[key] = w
    return w[:n]


def fingerprint(ids: torch.Tensor) -> torch.Tensor:
    """0-d int64 on ``ids``' device: ``sum_i ids[i] * weight_i`` (wrapping), no host sync.

    Integer ids only; computed in their own dtype (int32 rows stay int32 until the sum).
    Catches any single changed entry and any swap of two entries; it is a check against
    accidental edits, not against an adversary.
    """
    flat = ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        flat = flat.to(torch.int64)
    weights = _weights(flat.numel(), flat.device, flat.dtype)
    if flat.device.type == "cpu":  # an integer dot product: one pass, no temporary (a tenth of mul + sum here)
        return torch.dot(flat, weights).to(torch.int64)
    return torch.sum(flat * weights, dtype=torch.int64)  # CUDA has no integer dot


def tensor_version(t: torch.Tensor) -> Optional[int]:
    """The tensor's version counter; None for an inference tensor, which has none (and which
    cannot be edited in place outside ``torch.inference_mode``)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _parts(support) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(id tensor, row offsets or None) of a PackedTensor (``values``), a RaggedSupport or bare rows."""
    if isinstance(support, torch.Tensor):
        return support, None
    if hasattr(support, "member_ids"):
        return support.member_ids, support.row_offsets
    return support.values, None


def checked(support) -> Optional[Checked]:
    """The support's record, or None when it was never checked or its rows changed since."""
    ids, offsets = _parts(support)
    rec = getattr(ids, _ATTR, None)
    if not isinstance(rec, _Record) or rec.version != tensor_version(ids):
        return None
    if offsets is not None and (
        rec.offsets is None or rec.offsets() is not offsets or rec.offsets_version != tensor_version(offsets)
    ):
        return None
    return rec.check


def _fingerprint_of(ids: torch.Tensor, offsets: Optional[torch.Tensor]) -> torch.Tensor:
    fp = fingerprint(ids)
    return fp if offsets is None else fp * 3 + fingerprint(offsets.to(ids.device))


def record_checked(support, vocab_size: Optional[int]) -> None:
    """Record that ``support`` passed the §2 checks (ids < ``vocab_size`` when given)."""
    ids, offsets = _parts(support)
    rec = _Record(
        Checked(None if vocab_size is None else int(vocab_size)),
        tensor_version(ids),
        None if offsets is None else weakref.ref(offsets),
        None if offsets is None else tensor_version(offsets),
        _fingerprint_of(ids, offsets),
    )
    setattr(ids, _ATTR, rec)


def stale_flag(support) -> Optional[torch.Tensor]:
    """0-d bool on the ids' device: True when the rows changed since their record without the
    version counter knowing (:func:`fingerprint`); None when there is no valid record."""
    if checked(support) is None:
        return None
    ids, offsets = _parts(support)
    return _fingerprint_of(ids, offsets) != getattr(ids, _ATTR).fingerprint


def _keeps_ids(old: torch.dtype, new: torch.dtype) -> bool:
    """A dtype change that cannot alter an id: signed integer at least as wide."""
    if new == old:
        return True
    if new.is_floating_point or new.is_complex or new == torch.bool or not new.is_signed:
        return False
    return torch.iinfo(new).bits >= torch.iinfo(old).bits


def carry_checked(sources: Sequence, result):
    """Give ``result`` (built from the rows of ``sources``) their record when every source has one.

    The vocabulary bound is the loosest of the sources' (None if any has none). Returns ``result``.
    """
    checks = [checked(s) for s in sources]
    if not checks or any(c is None for c in checks):
        return result
    ids, _ = _parts(result)
    if not all(_keeps_ids(_parts(s)[0].dtype, ids.dtype) for s in sources):
        return result
    sizes = [c.vocab_size for c in checks]
    record_checked(result, None if any(v is None for v in sizes) else max(sizes))
    return result


@dataclass
class SupportCheck:
    """The scorer's §2 check of a support batch, split around the call's one host read.

    :meth:`begin` builds the device flag: nothing for ``validate=False``; for rows recorded as
    checked against a vocabulary at most ``vocab_size``, only the fingerprint (rows edited
    behind the version counter); for rows checked without one (or against a larger one), that
    plus the id bound; for anything else the full check (a sort of every row). After the read,
    :meth:`raise_first_bad_row` names the first row that breaks an invariant when the flag was
    set, and :meth:`passed` records rows that got through.
    """

    support: object
    vocab_size: Optional[int]
    flag: Optional[torch.Tensor]
    record: bool

    @classmethod
    def begin(cls, support, vocab_size: Optional[int], validate: bool) -> "SupportCheck":
        if not validate:
            return cls(support, vocab_size, None, False)
        rec = checked(support)
        if rec is None:
            return cls(support, vocab_size, support.invalid_flag(vocab_size=vocab_size), True)
        flag, ids = stale_flag(support), support.all_ids
        if not rec.covers(vocab_size) and ids.numel():  # the vocabulary bound is new
            flag = flag | (ids.amax() >= vocab_size)
        return cls(support, vocab_size, flag, not rec.covers(vocab_size))  # a tighter bound is recorded once it passed

    def raise_first_bad_row(self, where: str = "scorer support") -> None:
        """Raise naming the first row that breaks the §2 invariants (errors prefixed by ``where``).
        Rows that pass (a record whose rows changed behind the version counter but are still valid)
        return: see :meth:`passed`."""
        self.support.validate(vocab_size=self.vocab_size, where=where)

    def passed(self, *, again: bool = False) -> None:
        """The call's guards passed: record the rows when they were newly checked, or ``again``
        (the flag was set but :meth:`raise_first_bad_row` found every row valid)."""
        if self.record or again:
            record_checked(self.support, self.vocab_size)
