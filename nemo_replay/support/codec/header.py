"""The compact buffer's header: its magic and version, the header's fields and CRC-32, and the
error a reader raises for a buffer that is not one the encoder wrote (the layout:
:mod:`nemo_replay.support.codec`)."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

MAGIC = b"NRSC"
VERSION = 1
HEAD = struct.Struct("<4sBBBBIQQQII4Q")  # the header's fields, in the layout's order
DROPPED = 1  # the header's flag: the sampled ids were dropped
CRC_AT = 40  # the CRC's offset in the header
MAX_V = 2**31 - 1  # the largest vocabulary a buffer codes: ids and lengths fit int32
# The four streams, in their order in a buffer (and in the header's sizes): each kind's index.
LEN_UNARY, LEN_LOW, GAP_UNARY, GAP_LOW = range(4)


class CodecError(ValueError):
    """A compact support buffer that cannot be what :func:`~nemo_replay.support.codec.encode_support` wrote
    (truncated, corrupted)."""


@dataclass(frozen=True)
class Header:
    dropped: bool
    length_bits: int
    vocab_size: int
    rows: int
    ids: int
    trajectories: int
    max_length: int
    crc: int
    streams: tuple


def rice_parameter(universe: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``floor(log2((U - m) // (m + 1)))``, 0 where that quotient is below 2
    (:mod:`nemo_replay.support.codec`); int64."""
    q = np.maximum((universe - m) // (m + 1), 1).astype(np.int64)
    return (np.frexp(q.astype(np.float64))[1] - 1).astype(np.int64)  # exact: q < 2**53


def header_of(buf: Union[np.ndarray, bytes, torch.Tensor]) -> Header:
    """The header of a compact buffer, checked against the buffer's size."""
    raw = as_bytes(buf)
    if raw.size < HEAD.size:
        raise CodecError(f"compact support: {raw.size} bytes, fewer than the {HEAD.size}-byte header; a truncated buffer")
    magic, version, flags, lb, _, V, rows, ids, trajectories, max_length, crc, *streams = HEAD.unpack(raw[:HEAD.size].tobytes())
    if magic != MAGIC:
        raise CodecError(f"compact support: magic {magic!r}, expected {MAGIC!r}; not a compact support buffer")
    if version != VERSION:
        raise CodecError(f"compact support: version {version}; this reader knows {VERSION} (upgrade nemo_replay)")
    if flags & ~DROPPED or lb > 31 or not 1 <= V <= MAX_V:
        raise CodecError(f"compact support: header flags {flags}, length parameter {lb}, V {V} out of range; a corrupted buffer")
    need = HEAD.size + 8 * (trajectories + 1) + sum(streams)
    if need != raw.size:
        raise CodecError(f"compact support: the header describes {need} bytes, the buffer holds {raw.size} "
                         f"({'truncated' if raw.size < need else 'oversized'})")
    return Header(bool(flags & DROPPED), lb, V, rows, ids, trajectories, max_length, crc, tuple(streams))


def crc(raw: np.ndarray, at: int = CRC_AT) -> int:
    """CRC-32 of ``raw`` with its 4-byte CRC field at ``at`` read as zero (no copy of ``raw``)."""
    crc = zlib.crc32(raw[:at])
    crc = zlib.crc32(b"\0\0\0\0", crc)
    return zlib.crc32(raw[at + 4:], crc)


def as_bytes(buf) -> np.ndarray:
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise CodecError(f"compact support: expected a 1-D uint8 buffer, got {buf.dtype} {tuple(buf.shape)}")
        return buf.cpu().numpy()
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return np.frombuffer(buf, np.uint8)
    if isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1:
        return buf
    raise CodecError(f"compact support: expected a uint8 buffer, got {type(buf).__name__}")

