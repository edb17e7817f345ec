"""The compact codec's device decode in two Triton kernels (docs/design.md §2, docs/transport.md).

:func:`~nemo_replay.support.codec.decode.decode_steps` is the reference: about 170 eager operations for a
batch, each a kernel launch on a GPU, whatever the batch's size. Here the same decode launches
14 of its own: the set bits of both unary streams (shift, mask and ``nonzero_static`` each, as
the reference finds them), four allocations, two kernels, one ``cumsum`` and the flag's
``any`` (17 with the copy's, the offsets' cast and the checked record, which every decode
shares: docs/transport.md counts both that way):

- ``rows_kernel``, one lane a row: the row's buffer (a binary search of the buffers' first
  rows), its length (unary part, then low bits), the ids it codes ``m``, its Rice parameter
  ``b``, the row-width and sampled-token checks;
- one ``cumsum`` of ``(m, m * b)`` over the rows: where each row's ids and gap low bits start;
- ``ids_kernel``, one program a row: its gaps, their running sum, the range check, the dropped
  sampled token back at its sorted place, every id written into the fixed-width rows; and one
  program a buffer for its streams' checks (counts, padding, ids, low-bit size).

Every check of the reference is a slot of one int32 flag vector (``FLAGS``, the reference's
order). The index arithmetic is the reference's, clamped where it clamps: a corrupted batch
decodes to garbage inside its tensors, flagged. Where every check before it holds, each check
reads the values the reference reads, so the two set the same flags; once they are clear the
rows match bit for bit (tests/support/test_fused_decode.py flips bits of a buffer). A set flag
is named by rerunning the reference (the failure path only).

:meth:`~nemo_replay.support.codec.CompactRows.decode` asks :func:`fused_decode_serves`, the one
choice of decoder: by default the kernels serve on CUDA where Triton imports, unless
``NEMO_REPLAY_FUSED_DECODE=0`` (:func:`switched_on`), once they have decoded a known batch there to
the reference's rows (:func:`known_batch_passes`, once a process and device: a Triton that cannot
compile them is named in a warning and the reference serves); the reference runs elsewhere. On the
CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``): that is how the tests check them without
a GPU, besides compiling them for sm_80 and sm_90.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from typing import Optional

import torch

from nemo_replay.support.codec.decode import decode_steps, host_to, set_bits
from nemo_replay.support.codec.encoder import encode_support
from nemo_replay.support.codec.header import GAP_UNARY, LEN_UNARY
from nemo_replay.support.codec.parse import Batch, parse_buffers
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["FLAGS", "available", "decode_fixed", "importable", "switched_on"]

FLAGS = ("length count", "length padding", "row width", "id count", "gap low size", "gap count", "gap padding",
         "id range", "sampled range")
_ROW_BLOCK = 128  # rows a program of ``rows`` takes
_ID_BLOCK = 32  # ids a row's program takes per step
SWITCH = "NEMO_REPLAY_FUSED_DECODE"
_OFF, _ON = ("0", "false", "off", "no"), ("1", "true", "on", "yes", "")


def switched_on() -> bool:
    """``NEMO_REPLAY_FUSED_DECODE``: unset or 1/true/on/yes leaves the kernels on, 0/false/off/no turns them off."""
    value = os.environ.get(SWITCH, "")
    if value.strip().lower() not in _OFF + _ON:
        raise ValueError(f"{SWITCH}={value!r}: expected one of {', '.join(_OFF + _ON[:-1])} (or unset); set {SWITCH}=0 "
                         f"to decode compact rows with the reference's steps, unset it to use the fused kernels on CUDA")
    return value.strip().lower() in _ON


def available(device: torch.device) -> bool:
    """Whether :func:`decode_fixed` may serve a decode on ``device`` by default: switched on, CUDA, and
    Triton importable."""
    return switched_on() and device.type == "cuda" and importable()


@functools.lru_cache(maxsize=None)
def importable() -> bool:
    """Whether the kernels' module (and so Triton) imports; asked once a process."""
    try:
        importlib.import_module("nemo_replay.support.codec.fused_kernels")
    except ImportError:
        return False
    return True


def decode_fixed(raw: torch.Tensor, table: torch.Tensor, ones_len: torch.Tensor, ones_gap: torch.Tensor,
                 sampled: Optional[torch.Tensor], width: int):
    """A checked batch's rows (:class:`~nemo_replay.support.codec.parse.Batch`, on the device) decoded into
    fixed-width rows.

    Args:
        raw: the batch's streams by kind, uint8, 8 zero bytes at the end.
        table: (buffers, COL.count) int64, the per-buffer table
            (:class:`~nemo_replay.support.codec.parse.TableColumns`).
        ones_len, ones_gap: (rows + 1,) and (ids + 1,) int64, where the set bits of the length and
            gap unary streams lie (:func:`~nemo_replay.support.codec.decode.set_bits`).
        sampled: (rows,) int64, or None.
        width: the rows' width (at least the widest row).

    Returns:
        ``(values (rows, width) int32 -1 padded, flags (len(FLAGS),) int32)`` on the same device,
        with no host read; a flag is set where the reference sets that check's flag (module doc).
    """
    kernels = importlib.import_module("nemo_replay.support.codec.fused_kernels")  # imports Triton: only here

    R, I, B, device = ones_len.numel() - 1, ones_gap.numel() - 1, table.shape[0], raw.device
    scan = torch.zeros(R + 1, 2, dtype=torch.int64, device=device)
    info = torch.empty(R, 3, dtype=torch.int64, device=device)
    flags = torch.zeros(len(FLAGS), dtype=torch.int32, device=device)
    out = torch.full((R * width + 1,), -1, dtype=torch.int32, device=device)  # a spare last slot
    if R:  # without rows a buffer holds no stream (parse.parse_buffers): nothing to decode or check
        has = sampled is not None
        token = sampled if has else scan
        # Triton launches on the current device's current stream: make that the tensors' device, for
        # a loop that places its tensors with .to(f"cuda:{rank}") and never calls set_device.
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            kernels.rows_kernel[(-(-R // _ROW_BLOCK),)](table, ones_len, raw, raw.numel(), token, scan, info, flags, R,
                                                       B, B.bit_length(), HAS_SAMPLED=has, BLOCK=_ROW_BLOCK)
            scan = torch.cumsum(scan, 0)
            kernels.ids_kernel[(R + B,)](table, ones_len, ones_gap, raw, raw.numel(), token, scan, info, out, flags, R,
                                        I, width, R * width, HAS_SAMPLED=has, BLOCK=_ID_BLOCK)
    return out[:R * width].reshape(R, width), flags


def decode_fused(batch: Batch, sampled: Optional[torch.Tensor], device: torch.device, width: int):
    """What the reference gives (:func:`~nemo_replay.support.codec.decode.decode_steps`, placed
    fixed-width by :meth:`~nemo_replay.support.codec.decode.Decoded.place`), by the two kernels of this
    module: ``(values (rows, width) int32, flags (9,) int32, cu)``, no host read."""
    raw, t, cu = batch.split(host_to(batch.blob, device))
    ones_len = set_bits(batch.section(raw, LEN_UNARY), batch.rows)
    ones_gap = set_bits(batch.section(raw, GAP_UNARY), batch.ids)
    values, flags = decode_fixed(raw, t, ones_len, ones_gap, sampled, width)
    return values, flags, cu


def fused_decode_serves(device: torch.device, fused: Optional[bool] = None) -> bool:
    """The one choice of decoder: whether :meth:`~nemo_replay.support.codec.CompactRows.decode` decodes
    on ``device`` with the fused kernels (True) or with the reference's array steps (False).

    ``fused`` is the caller's ask. None: the kernels where they are available (:func:`available`:
    switched on, CUDA, Triton) and passed their check on that device (:func:`known_batch_passes`),
    the reference elsewhere. True: the kernels (a ValueError without Triton). False: the reference.
    """
    if fused is None:
        return available(device) and known_batch_passes(device)
    if fused and not importable():
        raise ValueError("CompactRows.decode(fused=True) needs Triton (pip install triton); pass fused=None to "
                         "decode with the kernels where they run and the reference elsewhere")
    return bool(fused)


@functools.lru_cache(maxsize=None)
def known_batch_passes(device: torch.device) -> bool:
    """Whether the fused kernels decode a known batch on ``device`` to the reference's rows: run once
    a process and device before they serve by default. Both compiled forms are checked: with sampled
    ids (a batch that dropped them) and without (NeMo-RL's and verl's batches keep theirs in the
    rows). A Triton that cannot compile them, or compiles them wrongly, is named in a warning and
    the reference serves instead: the same rows, with more launches."""
    rows = RaggedSupport.from_rows([[[1, 5, 9], [4], []], [[0, 2, 3, 7, 8, 9]]])
    tokens = torch.tensor([5, 4, 6, 9])
    kept, dropped = encode_support(rows, vocab_size=10), encode_support(rows, vocab_size=10, sampled_ids=tokens)
    failed = ""
    for buffers, sampled in (([kept, dropped], torch.cat([tokens, tokens]).to(device)), ([kept, kept], None)):
        batch, form = parse_buffers(buffers, None, ()), "with sampled ids" if sampled is not None else "without sampled ids"
        R, width = batch.rows, batch.width
        try:
            values, flags, _ = decode_fused(batch, sampled, device, width)
            want = decode_steps(batch, sampled, device).place(None, R * width, width).reshape(R, width)
            if not torch.equal(values, want) or bool(flags.any()):
                failed = f"{form}, rows that differ from the reference's"
        except Exception as exc:  # a compiler's or a driver's error: named below, never swallowed silently
            failed = f"{form}, {type(exc).__name__}: {exc}"
        if failed:
            break
    if failed:
        import warnings

        import triton

        warnings.warn(f"nemo_replay: the fused compact decode failed its check on {device} (Triton {triton.__version__}: "
                      f"{failed[:300]}); CompactRows decode with the reference's steps there (the same rows, more kernel "
                      f"launches). {SWITCH}=0 skips the check.", RuntimeWarning, stacklevel=3)
    return not failed

