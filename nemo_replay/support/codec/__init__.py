"""Support rows at the size of their information: one byte buffer for a whole batch (docs/design.md §2).

A support row is a set of vocabulary ids that holds the token sampled from it. Given the
sampled tokens (the trainer has them), a row of ``n`` ids is the choice of ``n - 1`` ids among
the ``V - 1`` others: ``log2 C(V - 1, n - 1)`` bits, plus its length. The codec comes within a
few percent of that (docs/design.md §2 gives the argument and benchmarks/transport.py the
figures):

- each row is sorted; the sampled id is dropped and the ids above it shifted down by one,
  so the ``m = n - 1`` ids left lie in ``[0, U)`` with ``U = V - 1`` (without sampled tokens
  every id is kept and ``U = V``);
- the gaps between consecutive ids (``g_0 = id_0``, ``g_i = id_i - id_{i-1} - 1``) are Rice
  coded with a parameter ``b`` fixed by ``(U, m)`` alone: ``b = floor(log2((U - m) / (m + 1)))``
  (0 when that is below 1), the typical gap of ``m`` ids spread over ``U``. A gap costs its
  ``b`` low bits plus ``(g >> b) + 1`` bits of unary: about ``m * (2 + log2(U / m))`` bits a
  row, against ``log2 C(U, m) ~ m * (log2(U / m) + 1.44)``;
- the lengths ``n`` are Rice coded too, with one parameter for the batch (in the header).

Unary parts and low bits go to separate streams, so every step decodes with array
operations over the whole batch (the unary values are the gaps between the set bits of
their stream; the low bits sit at offsets that the lengths fix): no Python loop over rows
or tokens. Layout, all integers little-endian::

    magic b"NRSC" | version u8 | flags u8 (1: sampled ids dropped) | length parameter u8 | 0 u8
    V u32 | rows u64 | ids u64 (sum of the coded m) | trajectories u64 | max row length u32
    CRC-32 u32 of the whole buffer with these four bytes zero
    the four stream sizes in bytes, u64 each: length unary, length low bits, gap unary, gap low bits
    cu_seqlens int64 (trajectories + 1) | the four streams

Decoding is torch operations on any device, over several buffers at once (their rows back to
back), in two parts:

- on the host, everything a header says, before anything is copied or sized: the magic and
  version, every size against the buffer (a truncated or oversized buffer), the CRC-32 (a bit
  flipped in transit or at rest, which could otherwise decode to another valid row), the
  trajectory offsets, and the bounds that size every array (values each stream can hold, and the
  row width, which sizes a fixed-width decode, no more than the ids the rows hold).
  The host then regroups the streams by kind (every buffer's length unary stream back to
  back, and so on) and lays a table of every per-buffer integer the device needs beside them:
  one copy to the device, through pinned memory on CUDA (a copy from pageable memory would
  wait for every kernel queued before it);
- on the device, the array steps, with no host read: each size comes from the headers, every
  index is clamped into its tensor, and what depends on the bits is a flag per check: the
  unary streams' counts and padding, each length against the header's maximum (a count past
  the row width), the low-bit stream's size, each row's ids against ``U`` (a gap past the
  vocabulary), the sampled tokens against ``V``. A unary stream's set bits come from
  ``nonzero_static`` (its size from the header); each row gathers what its buffer says, and
  each id what its row says, in one gather. Each step between ids is clamped below ``2**31``
  (no gap reaches ``U``), so ids rise within a row whatever the bits hold once the counts
  hold: a row's first and last id bound all of it.

:func:`decode_support` and :func:`decode_batch` read the flags at once and raise a
:class:`CodecError` naming what and where; :class:`CompactRows` hands them to the scorer,
which reads them with its own guards in its one host read (the ``decode`` guard). A decoded
batch carries the record of a passed §2 check (ids distinct and in range, each sampled token
in its row).

Worked example, ``V = 10``, one row ``{2, 5, 7}`` whose sampled token is 5: ``{2, 7}`` shift
to ``{2, 6}`` in ``U = 9``; ``m = 2``, ``b = floor(log2(7 / 3)) = 1``; gaps ``2, 3`` ->
unary ``(1, 1)``, low bits ``0, 1``.

The modules, in the order a buffer meets them: :mod:`~nemo_replay.support.codec.header` (magic,
version, the header, :class:`CodecError`), :mod:`~nemo_replay.support.codec.encoder`,
:mod:`~nemo_replay.support.codec.parse` (the host's checks, and the per-buffer table with its
columns by name), :mod:`~nemo_replay.support.codec.decode` (the reference's array steps, and the
decodes that name what failed), :mod:`~nemo_replay.support.codec.fused` with
:mod:`~nemo_replay.support.codec.fused_kernels` (the same decode in two Triton kernels, and the
one choice between them and the reference), :mod:`~nemo_replay.support.codec.rows`
(:class:`CompactRows`, :class:`DecodedRows`).
"""

from nemo_replay.support.codec.decode import decode_batch, decode_support, row_lengths
from nemo_replay.support.codec.encoder import encode_kept, encode_support
from nemo_replay.support.codec.fused import fused_decode_serves
from nemo_replay.support.codec.header import MAGIC, VERSION, CodecError, Header, header_of, rice_parameter
from nemo_replay.support.codec.rows import CompactRows, DecodedRows

__all__ = [
    "MAGIC", "VERSION", "CodecError", "CompactRows", "DecodedRows", "encode_support", "encode_kept", "decode_support",
    "decode_batch",
    "row_lengths", "header_of", "rice_parameter",
]

# Importable by name as before, and outside ``__all__`` as before: the header's record
# (:func:`header_of`) and the one choice of decoder (benchmarks/gpu.py reports it).
_OUTSIDE_ALL = (Header, fused_decode_serves)
