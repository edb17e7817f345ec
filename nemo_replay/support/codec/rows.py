"""Compact rows where the scorer runs: :class:`CompactRows` keeps a batch's buffers compact until the
scorer's entry point decodes them on its device into :class:`DecodedRows` (docs/design.md §2)."""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from nemo_replay.support.checked import record_checked
from nemo_replay.support.codec.decode import check_flags, decode_steps, host_to, sampled_arg
from nemo_replay.support.codec.fused import FLAGS, decode_fused, fused_decode_serves
from nemo_replay.support.codec.parse import COL, parse_buffers
from nemo_replay.support.packed import PackedTensor

class DecodedRows(PackedTensor):
    """Fixed-width rows ``(rows, width)`` decoded on a device from :class:`CompactRows`, -1 padded, whose
    data-dependent checks are still a device flag (``decode_flag``, 0-d bool).

    The scorer reads the flag with its other guards in its one host read and, when it is set,
    :meth:`raise_decode_error` names the buffer and what is wrong. Until then the rows may be
    garbage, but every index the decode formed stayed inside its tensor (docs/design.md §2).

    Args:
        values: (rows, width) int32; cu_seqlens: (trajectories + 1,) int32, on the same device.
        decode_flag: 0-d bool, set when a check failed.
        name_failure: called on the failure path; raises the named error.
    """

    def __init__(self, values: torch.Tensor, cu_seqlens: torch.Tensor, decode_flag: torch.Tensor, name_failure):
        # The offsets were checked on the host (parse_buffers): PackedTensor's own check would read the device.
        self.values, self.cu_seqlens = values, cu_seqlens
        self._name_failure = name_failure
        self.decode_flag: Optional[torch.Tensor] = decode_flag

    def raise_decode_error(self) -> None:
        """Raise the named :class:`~nemo_replay.support.codec.CodecError` of the first failed check
        (host reads: the failure path)."""
        self._name_failure()

    def check(self) -> None:
        """Read the flag now (one host read) and raise when it is set; the scorer then skips it."""
        if self.decode_flag is not None and bool(self.decode_flag):
            self.raise_decode_error()
        self.decode_flag = None


class CompactRows:
    """Several compact buffers as one batch of rows (their trajectories back to back), kept compact
    until the scorer's entry point decodes them on the device it runs on
    (:func:`~nemo_replay.scoring.entry.score_positions`, docs/design.md §2).

    Everything a header says is checked here, on the host (magic, version, sizes, CRC-32,
    trajectory offsets): the rest is the decode's device flag.

    Args:
        buffers: what :func:`~nemo_replay.support.codec.encode_support` wrote, one or more.
        sampled_ids: (rows,) every row's sampled token, needed when an encoder dropped them.
        labels: one name per buffer for its errors (for example the caller's sample).
        width: decode to at least this many columns (rows captured at a fixed width score bit for
            bit as those rows when decoded as wide).
    """

    def __init__(self, buffers: Sequence, *, sampled_ids: Optional[torch.Tensor] = None, labels: Sequence[str] = (),
                 width: Optional[int] = None):
        if labels and len(labels) != len(buffers):
            raise ValueError(f"CompactRows: {len(labels)} labels for {len(buffers)} buffers; give one per buffer or none")
        self.labels, self._width = tuple(labels), width
        self._batch = parse_buffers(list(buffers), None, self.labels)
        self._sampled = sampled_arg(sampled_ids, self._batch.rows, self._batch.dropped, None)

    @property
    def num_rows(self) -> int:
        return self._batch.rows

    @property
    def width_bound(self) -> int:
        """The decoded rows' width: the widest row, or the ``width`` asked when that is wider."""
        return max(self._batch.width, self._width or 0, 1)

    def rows_of(self, i: int) -> int:
        """The rows buffer ``i`` holds (its header)."""
        return int(self._batch.table[i, COL.rows])

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.from_numpy(self._batch.cu)

    @property
    def nbytes(self) -> int:
        return self._batch.nbytes

    def decode(self, device, *, check: bool = False, fused: Optional[bool] = None) -> DecodedRows:
        """The rows on ``device`` as :class:`DecodedRows`: one copy to the device (the streams, a table
        of their headers and the trajectory offsets; the sampled ids too where they are on the host),
        array steps there, no host read; with ``check``, the decode's flag read at once (one host
        read: for a caller that reads the rows before the scorer does).

        ``fused``: None decodes with :mod:`~nemo_replay.support.codec.fused`'s two kernels on CUDA where
        Triton imports (``NEMO_REPLAY_FUSED_DECODE=0`` turns them off) and with the reference's
        array steps elsewhere; True always with the kernels (on the CPU, under Triton's interpreter,
        ``TRITON_INTERPRET=1``); False always with the reference. Both give the same rows and flags.
        """
        device = torch.device(device)
        sampled = None if self._sampled is None else host_to(self._sampled, device)
        decode = self._decode_fused if fused_decode_serves(device, fused) else self._decode_reference
        values, cu, flag, name_failure = decode(sampled, device, self.width_bound)
        out = DecodedRows(values, cu.to(torch.int32), flag, name_failure)
        record_checked(out, self._batch.vocab_size)  # what the decode guarantees once its flag reads clear
        if check:
            out.check()
        return out

    def to(self, device) -> DecodedRows:
        """The rows decoded on ``device`` (:meth:`decode`): compact rows decode where they are moved to."""
        return self.decode(device)

    def _decode_fused(self, sampled: Optional[torch.Tensor], device: torch.device, width: int) -> tuple:
        """The fused kernels' decode: ``(values (rows, width) int32, cu, flag (0-d bool), name_failure)``."""
        values, flags, cu = decode_fused(self._batch, sampled, device, width)
        return values, cu, flags.any(), functools.partial(self._name_fused, sampled, device, flags)

    def _decode_reference(self, sampled: Optional[torch.Tensor], device: torch.device, width: int) -> tuple:
        """The reference's array steps, placed at ``width``: what :meth:`_decode_fused` returns."""
        d, rows = decode_steps(self._batch, sampled, device), self._batch.rows
        values = d.place(None, rows * width, width).reshape(rows, width)
        return values, d.cu, d.any_flag(), functools.partial(check_flags, d, self.labels)

    def _name_fused(self, sampled: Optional[torch.Tensor], device: torch.device, flags: torch.Tensor) -> None:
        """Name what the fused decode flagged by rerunning the reference, which sets the same flags."""
        check_flags(decode_steps(self._batch, sampled, device), self.labels)
        names = [name for name, bad in zip(FLAGS, flags.tolist()) if bad]
        raise RuntimeError(f"compact support: the fused decode flagged {names}, the reference decode finds every check "
                           f"holds; decode with the reference (NEMO_REPLAY_FUSED_DECODE=0) and report this batch")

    def __repr__(self) -> str:
        return (f"CompactRows(buffers={self._batch.buffers}, rows={self.num_rows}, width={self.width_bound}, "
                f"bytes={self.nbytes})")
