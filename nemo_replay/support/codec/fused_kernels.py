"""The two Triton kernels of the fused compact decode (:mod:`nemo_replay.support.codec.fused` says what
they compute and how they are checked). Imported only where Triton is: this module imports it.

Pointers: ``table`` (buffers, COLS) int64, the codec's per-buffer table; ``ones_len`` (rows + 1,)
and ``ones_gap`` (ids + 1,) int64, the set bits of the length and gap unary streams;
``raw`` uint8, the streams by kind; ``sampled`` (rows,) int64; ``scan`` (rows + 1, 2) int64;
``info`` (rows, 3) int64: each row's length, Rice parameter and buffer; ``out`` (rows * width + 1,)
int32; ``flags`` (9,) int32, one slot a check in the reference's order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nemo_replay.support.codec.header import GAP_LOW as _GAP_LOW_STREAM, MAX_V as _MAX_V
from nemo_replay.support.codec.parse import COL, NEVER as _NEVER, UNARY

# The table's columns (parse.TableColumns, parse.UnaryColumns), as compile-time constants.
COLS = tl.constexpr(COL.count)
LB, V, DROP, WIDTH = tl.constexpr(COL.lb), tl.constexpr(COL.vocab), tl.constexpr(COL.drop), tl.constexpr(COL.width)
FIRST_ROW, UNIVERSE, MASK = tl.constexpr(COL.first_row), tl.constexpr(COL.universe), tl.constexpr(COL.mask)
LEN_LOW, GAP_LOW = tl.constexpr(COL.len_low_bit), tl.constexpr(COL.gap_low_bit)
IDS, END_ROW = tl.constexpr(COL.ids), tl.constexpr(COL.end_row)
GAP_LOW_SIZE = tl.constexpr(COL.size + _GAP_LOW_STREAM)
LEN_ONES, GAP_ONES = tl.constexpr(COL.len_ones), tl.constexpr(COL.gap_ones)  # a unary stream's columns: U_ below
U_AFTER, U_LAST, U_END = tl.constexpr(UNARY.after), tl.constexpr(UNARY.last), tl.constexpr(UNARY.end)
U_FIRST, U_BIT_BEFORE = tl.constexpr(UNARY.first), tl.constexpr(UNARY.bit_before)
U_LAST_BELOW, U_LAST_FROM = tl.constexpr(UNARY.last_below), tl.constexpr(UNARY.last_from)
MAX_V, NEVER = tl.constexpr(_MAX_V), tl.constexpr(_NEVER)


@triton.jit
def _field(raw, n_raw, bit, width, mask):
    # The ``width``-bit field (<= 31) at absolute bit ``bit`` of ``raw``, big-endian: the five bytes
    # from the field's first byte hold it (7 + 31 <= 40 bits). Bytes outside ``raw`` read as 0.
    at = bit >> 3
    word = tl.zeros_like(bit)
    for j in tl.static_range(5):
        byte = tl.load(raw + at + j, mask=(at + j >= 0) & (at + j < n_raw), other=0)
        word = (word << 8) | byte.to(tl.int64)
    return (word >> (40 - (bit & 7) - width)) & mask


@triton.jit
def _floor_log2(q):
    # floor(log2(q)) for 1 <= q < 2**32, by halving: exact, where a float log2 may round.
    out = tl.zeros_like(q)
    for s in tl.static_range(5):
        big = (q >> (16 >> s)) > 0
        q = tl.where(big, q >> (16 >> s), q)
        out = tl.where(big, out + (16 >> s), out)
    return out


# Sizes vary from batch to batch, and so does the alignment of ``table`` (the first multiple of 8
# bytes past the batch's streams) and of ``sampled`` (the caller's view). Neither is specialised
# on, so one compiled kernel a ``HAS_SAMPLED`` serves every batch: the one fused.known_batch_passes
# checks. The other pointers are fresh allocations, always aligned.
@triton.jit(do_not_specialize=["table", "sampled", "n_raw", "R", "B", "search_steps"])
def rows_kernel(table, ones_len, raw, n_raw, sampled, scan, info, flags, R, B, search_steps,
                HAS_SAMPLED: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = r < R
    # The row's buffer: the last whose first row is <= r (an empty buffer shares the next one's first
    # row and comes before it). Buffers 0, 1, 2 with first rows 0, 5, 5 (1 empty): row 5 -> buffer 2.
    lo = tl.zeros_like(r)
    hi = tl.zeros_like(r) + B
    for _ in range(search_steps):
        active = lo < hi
        mid = (lo + hi) // 2
        first = tl.load(table + mid * COLS + FIRST_ROW, mask=active & live, other=0)
        lo = tl.where(active & (first <= r), mid + 1, lo)
        hi = tl.where(active & (first > r), mid, hi)
    buf = tl.minimum(tl.maximum(lo - 1, 0), B - 1)
    row = table + buf * COLS
    lb = tl.load(row + LB)
    # Its unary value: the distance from the set bit before (for a buffer's first row, the bit
    # before its stream) to its own.
    one = tl.load(ones_len + r, mask=live, other=0)
    before = tl.load(ones_len + r - 1, mask=live & (r > 0), other=-1)
    before = tl.where(r == tl.load(row + LEN_ONES + U_FIRST), tl.load(row + LEN_ONES + U_BIT_BEFORE), before)
    high = tl.minimum(one - before - 1, MAX_V)
    low = _field(raw, n_raw, tl.load(row + LEN_LOW) + (r - tl.load(row + FIRST_ROW)) * lb, lb, tl.load(row + MASK))
    length = (high << lb) | low
    ones = tl.full(r.shape, 1, tl.int32)
    tl.store(flags + 2 + tl.zeros_like(r), ones, mask=live & ((length > tl.load(row + WIDTH)) | (length < 0)))
    length = tl.maximum(length, 0)
    m = length - tl.load(row + DROP) * (length > 0)
    b = _floor_log2(tl.maximum((tl.load(row + UNIVERSE) - m) // (m + 1), 1))
    tl.store(scan + (r + 1) * 2, m, mask=live)
    tl.store(scan + (r + 1) * 2 + 1, m * b, mask=live)
    tl.store(info + r * 3, length, mask=live)
    tl.store(info + r * 3 + 1, b, mask=live)
    tl.store(info + r * 3 + 2, buf, mask=live)
    if HAS_SAMPLED:
        token = tl.load(sampled + r, mask=live, other=0)
        tl.store(flags + 8 + tl.zeros_like(r), ones, mask=live & ((token < 0) | (token >= tl.load(row + V))))


@triton.jit
def _unary_checks(ones, columns, flags, slot):
    # A buffer's unary stream holds exactly its count of set bits (the one after its last value lies
    # past its end, its last value inside), and its last set bit lies in its last byte.
    after = tl.load(ones + tl.load(columns + U_AFTER))
    last = tl.load(ones + tl.load(columns + U_LAST))
    tl.store(flags + slot, 1, mask=(after < tl.load(columns + U_END)) | (last >= tl.load(columns + U_LAST_BELOW)))
    tl.store(flags + slot + 1, 1, mask=last < tl.load(columns + U_LAST_FROM))


@triton.jit(do_not_specialize=["table", "sampled", "n_raw", "R", "I", "width", "total"])
def ids_kernel(table, ones_len, ones_gap, raw, n_raw, sampled, scan, info, out, flags, R, I, width, total,
               HAS_SAMPLED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    if pid < R:
        r = pid
        length = tl.load(info + r * 3)
        b = tl.load(info + r * 3 + 1)
        row = table + tl.load(info + r * 3 + 2) * COLS
        # scan holds the exclusive sums of (m, m * b): the row's first id, clamped as the reference
        # clamps, and where its gap low bits start (from its buffer's first row).
        start = tl.minimum(tl.load(scan + r * 2), I)
        count = tl.minimum(tl.load(scan + r * 2 + 2), I) - start
        first_low = tl.load(row + GAP_LOW) + tl.load(scan + r * 2 + 1) - tl.load(scan + tl.load(row + FIRST_ROW) * 2 + 1)
        zero = start * 0  # an int64 scalar: the running values below start from it
        mask_b = ((zero + 1) << b) - 1
        first_id = tl.load(row + GAP_ONES + U_FIRST)
        bit_before = tl.load(row + GAP_ONES + U_BIT_BEFORE)
        far = zero + NEVER  # the dropped sampled token, where the row dropped one
        if HAS_SAMPLED:
            if tl.load(row + DROP) > 0:
                far = tl.load(sampled + r)
        base = r * width
        carry = zero
        above_sum = zero
        lowest = zero + NEVER
        highest = zero - NEVER
        for at in tl.range(0, count, BLOCK):
            k = at + tl.arange(0, BLOCK).to(tl.int64)
            live = k < count
            j = start + k
            one = tl.load(ones_gap + j, mask=live, other=0)
            before = tl.load(ones_gap + j - 1, mask=live & (j > 0), other=-1)
            before = tl.where(j == first_id, bit_before, before)
            high = tl.minimum(one - before - 1, MAX_V)
            low = _field(raw, n_raw, first_low + k * b, b, mask_b)
            # The step from the id before (its gap + 1), clamped where no gap reaches: no sum overflows.
            step = tl.where(live, tl.minimum((high << b) + low + 1, MAX_V + 1), 0)
            ids = carry + tl.cumsum(step, 0) - 1
            carry += tl.sum(step, 0)
            lowest = tl.minimum(lowest, tl.min(tl.where(live, ids, NEVER), 0))
            highest = tl.maximum(highest, tl.max(tl.where(live, ids, -NEVER), 0))
            above = (live & (ids >= far)).to(tl.int64)  # past the dropped token: one column on
            above_sum += tl.sum(above, 0)
            tl.store(out + tl.minimum(tl.maximum(base + k + above, 0), total), (ids + above).to(tl.int32), mask=live)
        # Ids rise within a row once the counts hold: its lowest and highest bound it.
        tl.store(flags + 7, 1, mask=(count > 0) & ((lowest < 0) | (highest >= tl.load(row + UNIVERSE))))
        if HAS_SAMPLED:
            put = tl.minimum(tl.maximum(base + count - above_sum, 0), total)
            tl.store(out + put, tl.load(sampled + r).to(tl.int32), mask=(far != NEVER) & (length > 0))
    else:
        row = table + (pid - R) * COLS
        _unary_checks(ones_len, row + LEN_ONES, flags, 0)
        _unary_checks(ones_gap, row + GAP_ONES, flags, 5)
        first = tl.load(row + FIRST_ROW)
        end = tl.load(row + END_ROW)
        tl.store(flags + 3, 1, mask=tl.load(scan + end * 2) - tl.load(scan + first * 2) != tl.load(row + IDS))
        low_bits = tl.load(scan + end * 2 + 1) - tl.load(scan + first * 2 + 1)
        tl.store(flags + 4, 1, mask=(low_bits + 7) // 8 != tl.load(row + GAP_LOW_SIZE))
