"""The device's part of a decode: the reference's array steps over a whole batch, on any device and
with no host read (the checks that depend on the bits are flags), and the decodes that read those
flags at once and name what failed (the layout and the checks: :mod:`nemo_replay.support.codec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np
import torch

from nemo_replay.support.checked import record_checked
from nemo_replay.support.codec.header import GAP_LOW, GAP_UNARY, LEN_UNARY, MAX_V, CodecError
from nemo_replay.support.codec.parse import COL, NEVER, UNARY, Batch, parse_buffers
from nemo_replay.support.dtypes import is_integer
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.nonzero import nonzero_static
from nemo_replay.support.ragged import RaggedSupport
from nemo_replay.support.validate import describe_row


# ---------------------------------------------------------------------------- decode: array steps, any device
def _exclusive(t: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums with the total appended: ``(n + 1,)``."""
    return torch.cat([t.new_zeros(1), torch.cumsum(t, 0)])


def _segments(sizes: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) the segment of each element of segments sized ``sizes`` (their sum, ``total``, read on
    the host from headers: no device sync)."""
    return torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), sizes, output_size=total)


def _rice(universe: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """:func:`~nemo_replay.support.codec.rice_parameter` as torch operations."""
    q = torch.clamp((universe - m) // (m + 1), min=1)
    return torch.frexp(q.to(torch.float64))[1].to(torch.int64) - 1  # exact: q < 2**53


_BIT_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)  # a byte's bits, most significant first
_BYTE_SHIFTS = torch.tensor([24, 16, 8, 0], dtype=torch.int64)  # four bytes as a big-endian word
_CONSTANTS: dict = {}  # device -> both, there


def _constants(device: torch.device) -> tuple:
    got = _CONSTANTS.get(device)
    if got is None:
        got = _CONSTANTS[device] = (_BIT_SHIFTS.to(device), _BYTE_SHIFTS.to(device))
    return got


def set_bits(section: torch.Tensor, total: int) -> torch.Tensor:
    """(total + 1,) int64: where the set bits of ``section`` (one stream kind, ``total`` values) lie,
    found by ``nonzero_static`` (no host read); set bits missing from it, and a spare last slot, read
    as its end."""
    shifts, _ = _constants(section.device)
    bits = ((section.unsqueeze(1) >> shifts) & 1).reshape(-1)
    return nonzero_static(bits, total + 1, fill_value=bits.numel())


def _read_unary(ones: torch.Tensor, columns: torch.Tensor, total: int):
    """The ``total`` unary values of one stream kind from its :func:`set_bits` ``ones``;
    ``columns``: (buffers, UNARY.count) the kind's :class:`~nemo_replay.support.codec.parse.UnaryColumns`.

    Returns ``(values (total,), count flag (buffers,), padding flag (buffers,))``. A value is the
    distance between consecutive set bits, in bounds whatever the bits hold. The count flag: a
    buffer's stream does not hold exactly its count of set bits (checked as: the set bits before
    each stream's end are as many as the counts up to it); the padding flag: its last set bit is
    not in its last byte.
    """
    after, last = ones.index_select(0, columns[:, UNARY.after]), ones.index_select(0, columns[:, UNARY.last])
    prev = torch.cat([ones.new_full((1,), -1), ones[:-1]])  # its last slot spare, for empty streams
    prev.scatter_(0, columns[:, UNARY.first], columns[:, UNARY.bit_before])
    count_flag = (after < columns[:, UNARY.end]) | (last >= columns[:, UNARY.last_below])
    return (ones - prev - 1)[:total], count_flag, last < columns[:, UNARY.last_from]


def _windows(raw: torch.Tensor) -> torch.Tensor:
    """At every 4-byte boundary of ``raw`` (which ends in 8 zero bytes), the 8 bytes from there as one
    big-endian int64: a field of at most 31 bits lies in the window of its first bit's word."""
    _, shifts = _constants(raw.device)
    pad = torch.cat([raw, raw.new_zeros(-raw.numel() % 4)]) if raw.numel() % 4 else raw
    words = (pad.reshape(-1, 4).to(torch.int64) << shifts).sum(1)
    return (words[:-1] << 32) | words[1:]


def _read_fields(windows: torch.Tensor, bit: torch.Tensor, widths: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """The fields of ``widths`` bits (<= 31, ``masks`` their ``2**w - 1``) at absolute bits ``bit``;
    int64. The window's index is clamped: a corrupted stream reads its neighbour's bits, never
    outside the tensor. An arithmetic shift brings copies of the sign bit in at the top; the mask
    drops them."""
    window = windows.index_select(0, torch.clamp(bit >> 5, 0, windows.numel() - 1))
    return (window >> (64 - (bit & 31) - widths)) & masks


@dataclass
class Decoded:
    """One batch's decode, every index in bounds, and its data-dependent checks as device flags.

    cu: the batch's trajectory offsets on the device; lengths, buf_row, universe (rows,): each row's
    length, buffer and the ids it is coded among; row_of, col, ids (coded ids,): each coded id's row,
    column and id; put (rows,): the column of a dropped sampled token (-1 where none goes in);
    sampled (rows,) or None; flags: check name -> (buffers,) or (rows,) bool, in the decode's order;
    details: what the error of a failed check names.
    """

    batch: Batch
    cu: torch.Tensor
    lengths: torch.Tensor
    buf_row: torch.Tensor
    universe: torch.Tensor
    row_of: torch.Tensor
    col: torch.Tensor
    ids: torch.Tensor
    put: torch.Tensor
    sampled: Optional[torch.Tensor]
    flags: dict
    details: dict

    def any_flag(self) -> torch.Tensor:
        """0-d bool: some check failed (no host read)."""
        return torch.cat([f.reshape(-1) for f in self.flags.values()]).any()

    def failed(self) -> list:
        """The names of the checks that failed, in order: one host read."""
        bad = torch.stack([f.any() for f in self.flags.values()]).tolist()
        return [name for name, b in zip(self.flags, bad) if b]

    def place(self, starts: Optional[torch.Tensor], total: int, width: int = 0) -> torch.Tensor:
        """(total,) int32: the members at ``starts[row] + column`` (``row * width + column`` without
        ``starts``), -1 elsewhere; a spare last slot takes what a corrupted batch would put out of range."""
        flat = torch.full((total + 1,), -1, dtype=torch.int32, device=self.lengths.device)
        first = self.row_of * width if starts is None else starts.index_select(0, self.row_of)
        flat.scatter_(0, torch.clamp(first + self.col, 0, total), self.ids.to(torch.int32))
        if self.sampled is not None:
            first = torch.arange(self.lengths.numel(), device=flat.device) * width if starts is None else starts
            at = torch.where(self.put >= 0, torch.clamp(first + self.put, 0, total), total)
            flat.scatter_(0, at, self.sampled.to(torch.int32))
        return flat[:total]


def host_to(t: Union[np.ndarray, torch.Tensor], device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; from the host to a CUDA device through pinned memory, so the copy joins the
    stream instead of waiting for every kernel queued before it (what a copy from pageable memory does)."""
    t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def decode_steps(batch: Batch, sampled: Optional[torch.Tensor], device, *, lengths_only: bool = False) -> Decoded:
    """The array steps of :mod:`nemo_replay.support.codec`'s doc over every buffer of ``batch`` at once,
    on ``device`` (``lengths_only``: the rows' lengths and their checks, no id decoded).

    One copy to the device (the streams and the table); sizes come from the headers (host), so
    nothing here waits for the device: the checks that depend on the bits are flags
    (``Decoded.flags``), and every index is clamped into its tensor, so a corrupted batch decodes
    to garbage inside its tensors, flagged. The steps below run in this order, each recording its
    checks in ``a.flags``: the order :meth:`Decoded.failed` names them in.
    """
    raw, t, cu = batch.split(host_to(batch.blob, device))
    windows = _windows(raw)
    buf_row = _segments(t[:, COL.rows], batch.rows)
    per_row = t[:, :COL.per_row].index_select(0, buf_row)  # what each row takes from its buffer
    a = _Arrays(batch=batch, raw=raw, windows=windows, table=t, per_row=per_row, lb=per_row[:, COL.lb],
                vocab=per_row[:, COL.vocab], drop=per_row[:, COL.drop], universe=per_row[:, COL.universe],
                first_row=t[:, COL.first_row], end_row=t[:, COL.end_row])
    lengths = _lengths(a)
    if lengths_only:
        none = lengths.new_zeros(0)
        return Decoded(batch=batch, cu=cu, lengths=lengths, buf_row=buf_row, universe=a.universe, row_of=none, col=none,
                       ids=none, put=torch.full_like(lengths, -1), sampled=None, flags=a.flags, details=a.details)
    m, row_start, row_of = _rows_of_ids(a, lengths)
    per_id = _per_id(a, m, row_start, row_of, sampled)
    coded, j = _coded_ids(a, per_id, row_start, row_of)
    _id_range(a, coded, m, row_start)
    col, ids, put = _sampled_back(a, coded, j - per_id[:, _ID.first], m, lengths, row_of, per_id, sampled)
    return Decoded(batch=batch, cu=cu, lengths=lengths, buf_row=buf_row, universe=a.universe, row_of=row_of, col=col,
                   ids=ids, put=put, sampled=sampled, flags=a.flags, details=a.details)


@dataclass
class _Arrays:
    """What the steps of :func:`decode_steps` share, on the device: the batch, its streams by kind
    (``raw``) and their 4-byte windows, its table (``(buffers, COL.count)``) and two of its columns by
    name (a buffer's first row, the row after its last), each row's columns of its buffer (``per_row``:
    ``(rows, COL.per_row)``) and four of them by name; ``flags`` and ``details`` take each check's flag
    and what its error names, as the steps run."""

    batch: Batch
    raw: torch.Tensor
    windows: torch.Tensor
    table: torch.Tensor
    per_row: torch.Tensor
    lb: torch.Tensor
    vocab: torch.Tensor
    drop: torch.Tensor
    universe: torch.Tensor
    first_row: torch.Tensor
    end_row: torch.Tensor
    flags: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)


class _IdColumns:
    """The columns of ``per_id`` (:func:`_per_id`), by name: what each coded id takes from its row."""

    __slots__ = ()
    b, mask, low_at, first, far = range(5)  # Rice parameter, 2**b - 1, low bits' origin, first id, dropped token


_ID = _IdColumns()


def _lengths(a: _Arrays) -> torch.Tensor:
    """(rows,) int64, each row's length: unary high parts, then ``lb`` low bits a row, back to back.
    Checks: ``length count``, ``length padding``, ``row width``."""
    R, t, dev = a.batch.rows, a.table, a.raw.device
    ones = set_bits(a.batch.section(a.raw, LEN_UNARY), R)
    high, a.flags["length count"], a.flags["length padding"] = _read_unary(
        ones, t[:, COL.len_ones:COL.len_ones + UNARY.count], R)
    in_buf = torch.arange(R, device=dev) - a.per_row[:, COL.first_row]
    # Clamped where no row reaches (lengths <= V < 2**31): a corrupted stream's value cannot overflow.
    low = _read_fields(a.windows, a.per_row[:, COL.len_low_bit] + in_buf * a.lb, a.lb, a.per_row[:, COL.mask])
    lengths = (high.clamp_(max=MAX_V) << a.lb) | low
    a.flags["row width"] = (lengths > a.per_row[:, COL.width]) | (lengths < 0)  # < 0: set bits missing from the stream
    a.details["row width"] = lengths
    return lengths.clamp(min=0)


def _rows_of_ids(a: _Arrays, lengths: torch.Tensor) -> tuple:
    """``(m (rows,), row_start (rows + 1,), row_of (ids,))``: the ids each row codes, where each row's
    first coded id lies (then their total, clamped to the header's), each coded id's row.
    Check: ``id count``."""
    I, t, dev = a.batch.ids, a.table, a.raw.device
    m = lengths - a.drop * (lengths > 0)
    row_start = _exclusive(m)  # each row's first coded id, then their total
    coded_sum = row_start.index_select(0, a.end_row) - row_start.index_select(0, a.first_row)
    a.flags["id count"] = coded_sum != t[:, COL.ids]
    a.details["id count"] = coded_sum
    row_start = row_start.clamp(max=I)
    # Each coded id's row: every row marks the id it starts at (the last of the rows starting there
    # owns it: the ones before are empty), and a running maximum carries the mark; in bounds
    # whatever the lengths say.
    marks = torch.zeros(I + 1, dtype=torch.int64, device=dev)
    marks.scatter_reduce_(0, row_start[:-1], torch.arange(a.batch.rows, device=dev), "amax")
    row_of = torch.cummax(marks[:I], 0).values if I else marks[:0]
    return m, row_start, row_of


def _per_id(a: _Arrays, m: torch.Tensor, row_start: torch.Tensor, row_of: torch.Tensor,
            sampled: Optional[torch.Tensor]) -> torch.Tensor:
    """(ids, 5) int64, what each coded id needs from its row (:class:`_IdColumns`), in one gather.

    A row's gaps share its Rice parameter b; their low bits run from the row's first one, in a
    buffer's stream that starts on a byte. Check: ``gap low size``.
    """
    b = _rice(a.universe, m)
    low = _exclusive(m * b)
    low_bits = low.index_select(0, a.end_row) - low.index_select(0, a.first_row)
    a.flags["gap low size"] = (low_bits + 7) // 8 != a.table[:, COL.size + GAP_LOW]
    a.details["gap low size"] = low_bits
    low_at = (a.per_row[:, COL.gap_low_bit] + low[:-1] - low.index_select(0, a.per_row[:, COL.first_row])
              - row_start[:-1] * b)
    far = torch.full_like(m, NEVER) if sampled is None else torch.where(a.drop > 0, sampled, NEVER)
    columns = {_ID.b: b, _ID.mask: (1 << b) - 1, _ID.low_at: low_at, _ID.first: row_start[:-1], _ID.far: far}
    return torch.stack([columns[c] for c in range(len(columns))], 1).index_select(0, row_of)


def _coded_ids(a: _Arrays, per_id: torch.Tensor, row_start: torch.Tensor, row_of: torch.Tensor) -> tuple:
    """``(coded (ids,), j (ids,))``: each coded id (before the dropped token goes back), and its index.
    Checks: ``gap count``, ``gap padding``."""
    I = a.batch.ids
    b_id, j = per_id[:, _ID.b], torch.arange(I, device=a.raw.device)
    ones = set_bits(a.batch.section(a.raw, GAP_UNARY), I)
    high, a.flags["gap count"], a.flags["gap padding"] = _read_unary(
        ones, a.table[:, COL.gap_ones:COL.gap_ones + UNARY.count], I)
    # Each id's step from the one before (its gap + 1), clamped where no gap reaches (U < 2**31), so
    # that no sum overflows: a corrupted row still rises, its last id past U.
    low = _read_fields(a.windows, per_id[:, _ID.low_at] + j * b_id, b_id, per_id[:, _ID.mask])
    steps = (high.clamp_(max=MAX_V) << b_id) + low + 1
    steps = _exclusive(steps.clamp_(max=MAX_V + 1))
    return steps[1:] - steps.index_select(0, row_start[:-1]).index_select(0, row_of) - 1, j


def _id_range(a: _Arrays, coded: torch.Tensor, m: torch.Tensor, row_start: torch.Tensor) -> None:
    """Check ``id range``: ids rise within a row once the counts hold (every gap >= 0), so a row's
    first and last id bound it."""
    I = a.batch.ids
    ends = torch.stack([row_start[:-1], row_start[1:] - 1], 1).clamp(0, max(I - 1, 0))
    ends = coded.index_select(0, ends.reshape(-1)).reshape(-1, 2) if I else ends
    a.flags["id range"] = (m > 0) & ((ends[:, 0] < 0) | (ends[:, 1] >= a.universe))
    a.details["id range"] = torch.where(ends[:, 0] < 0, ends[:, 0], ends[:, 1])


def _sampled_back(a: _Arrays, coded: torch.Tensor, col: torch.Tensor, m: torch.Tensor, lengths: torch.Tensor,
                  row_of: torch.Tensor, per_id: torch.Tensor, sampled: Optional[torch.Tensor]) -> tuple:
    """``(col, ids, put)`` (:class:`Decoded`): the sampled token goes back into a row that dropped it,
    at its sorted place (the ids past it one up, one column on). Check: ``sampled range``."""
    put = torch.full_like(lengths, -1)
    if sampled is not None:
        a.flags["sampled range"] = (sampled < 0) | (sampled >= a.vocab)
        above = coded >= per_id[:, _ID.far]
        coded, col = coded + above, col + above
        below = m - torch.zeros_like(m).index_add_(0, row_of, above.to(torch.int64))
        put = torch.where((a.drop > 0) & (lengths > 0), below, -1)
    return col, coded, put


# ---------------------------------------------------------------------------- decode: named errors
_PER_ROW = ("row width", "id range", "sampled range")  # the other flags are one a buffer


def _stream_facts(batch: Batch, i: int, kind: int) -> tuple:
    """Buffer ``i``'s unary stream ``kind`` (``LEN_UNARY`` or ``GAP_UNARY``), read on the host: its set
    bits and how many bits run past the last one."""
    at, size = int(batch.table[i, COL.at + kind]), int(batch.table[i, COL.size + kind])
    ones = np.flatnonzero(np.unpackbits(batch.raw[at:at + size]))
    return ones.size, 8 * size - 1 - (int(ones[-1]) if ones.size else -1)


def _raise_named(d: Decoded, name: str, labels: Sequence[str]) -> None:
    """Name the first failure of check ``name`` (host reads: the failure path only)."""
    t = d.batch.table
    j = int(torch.nonzero(d.flags[name].cpu())[0])
    i = int(np.repeat(np.arange(len(t)), t[:, COL.rows])[j]) if name in _PER_ROW else j  # the row's buffer
    row = j - int(t[i, COL.first_row])
    if name in ("length count", "length padding", "gap count", "gap padding"):
        lengths = name.startswith("length")
        what, kind, count = ("length", LEN_UNARY, t[i, COL.rows]) if lengths else ("gap", GAP_UNARY, t[i, COL.ids])
        pop, past = _stream_facts(d.batch, i, kind)
        msg = (f"the {what} stream holds {pop} values, the header says {int(count)}" if name.endswith("count") else
               f"the {what} stream runs {past} bits past its last value")
    elif name == "row width":
        msg = f"row {row} decodes to {int(d.details['row width'][j])} ids, past the header's row width {int(t[i, COL.width])}"
    elif name == "id count":
        msg = f"the lengths give {int(d.details['id count'][i])} ids, the header says {int(t[i, COL.ids])}"
    elif name == "gap low size":
        need = -(-int(d.details["gap low size"][i]) // 8)
        msg = f"the gap low-bit stream holds {int(t[i, COL.size + GAP_LOW])} bytes where its fields need {need}"
    elif name == "id range":
        msg = f"row {row} decodes id {int(d.details['id range'][j])}, past the {int(d.universe[j])} ids it is coded among"
    else:  # sampled range
        raise CodecError(f"{labels[i] + ': ' if labels else ''}compact support: sampled token {int(d.sampled[j])} of "
                         f"row {row} is outside [0, {int(t[i, COL.vocab])})")
    raise CodecError(f"{labels[i] + ': ' if labels else ''}compact support: {msg}; a corrupted buffer")


def check_flags(d: Decoded, labels: Sequence[str]) -> None:
    """Read every flag of ``d`` at once (one host read) and raise for the first set one, in the decode's order."""
    failed = d.failed()
    if failed:
        _raise_named(d, failed[0], labels)


def sampled_arg(sampled_ids, rows: int, dropped: bool, device) -> Optional[torch.Tensor]:
    if sampled_ids is None:
        if dropped:
            raise CodecError("compact support: the rows were coded without their sampled tokens; pass sampled_ids "
                             "(the tokens sampled from them, one per row)")
        return None
    sampled = torch.as_tensor(sampled_ids)
    if not is_integer(sampled):
        raise CodecError(f"compact support: sampled_ids have dtype {sampled.dtype}, expected integer token ids; "
                         f"pass the response's token ids as they came (torch.long)")
    if sampled.shape != (rows,):
        raise CodecError(f"compact support: sampled_ids has shape {tuple(sampled.shape)}, expected ({rows},): one per row")
    return sampled.to(device=device, dtype=torch.int64)


def decode_batch(
    buffers: Sequence,
    *,
    sampled_ids: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    device=None,
    labels: Sequence[str] = (),
) -> RaggedSupport:
    """The rows of several buffers, back to back (their trajectories in order), decoded at once.

    Args:
        buffers: what :func:`~nemo_replay.support.codec.encode_support` wrote, one or more.
        sampled_ids: (rows,) the sampled tokens of every row, in order; required when an encoder
            dropped them; given for rows coded with them, each non-empty row must hold its own.
        vocab_size: when given, every buffer's ``V`` must equal it.
        device: where the decode runs and the rows go (default CPU); one host read of the checks.
        labels: one name per buffer, prefixed to its errors.

    Raises:
        CodecError (a ValueError) for a buffer that is not one the encoder wrote
        (:mod:`nemo_replay.support.codec`); SupportAlignmentError (a ValueError) for a sampled token
        missing from its row.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    batch = parse_buffers(buffers, vocab_size, labels)
    sampled = sampled_arg(sampled_ids, batch.rows, batch.dropped, device)
    d = decode_steps(batch, sampled, device)
    check_flags(d, labels)
    kept = torch.from_numpy(batch.table[:, COL.drop] == 0).to(device)
    starts = _exclusive(d.lengths)
    members = d.place(starts[:-1], int(starts[-1]))
    if sampled is not None and bool(kept.any()):
        # Coded with the sampled tokens in: each non-empty row must hold its own (docs/design.md §2).
        buf_row = d.buf_row
        hit = torch.zeros_like(d.lengths).index_add_(0, d.row_of, (d.ids == sampled[d.row_of]).to(torch.int64)) > 0
        missing = torch.nonzero((d.lengths > 0) & ~hit & kept[buf_row]).flatten()
        if missing.numel():
            r = int(missing[0])
            i = int(buf_row[r])
            row = members[int(starts[r]):int(starts[r + 1])]
            cu = torch.from_numpy(batch.cu)
            raise SupportAlignmentError(
                f"{labels[i] + ': ' if labels else ''}compact support: {describe_row(cu, r)}: sampled token "
                f"{int(sampled[r])} is not a member of its support row {row[:16].tolist()}; rows and tokens are "
                f"misaligned -- pass this response's own token ids")
    out = RaggedSupport(members, starts, torch.from_numpy(batch.cu.astype(np.int32)))
    record_checked(out, batch.vocab_size)
    return out


def row_lengths(buf: Union[np.ndarray, bytes, torch.Tensor]) -> np.ndarray:
    """(rows,) int64: each row's number of ids, from the length streams alone (no id is decoded).

    Raises:
        CodecError as :func:`decode_support` for a buffer whose header or lengths do not decode.
    """
    d = decode_steps(parse_buffers([buf], None, ()), None, torch.device("cpu"), lengths_only=True)
    check_flags(d, ())
    return d.lengths.numpy()


def decode_support(
    buf: Union[np.ndarray, bytes, torch.Tensor],
    *,
    sampled_ids: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    device=None,
) -> RaggedSupport:
    """A batch's rows back from :func:`~nemo_replay.support.codec.encode_support`'s buffer (sorted ids,
    record of a passed check).

    Args:
        sampled_ids: (rows,) the sampled tokens, required when the encoder dropped them; given
            for rows coded with them, each non-empty row must hold its own.
        vocab_size: when given, must equal the buffer's ``V``.
        device: where the decode runs and the rows go (default CPU).

    Raises:
        CodecError (a ValueError) for a buffer that is not one the encoder wrote
        (:mod:`nemo_replay.support.codec`); SupportAlignmentError (a ValueError) for a sampled token
        missing from its row.
    """
    return decode_batch([buf], sampled_ids=sampled_ids, vocab_size=vocab_size, device=device)

