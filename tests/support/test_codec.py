"""The compact support codec (nemo_replay/support/codec/) against a naive reference.

The reference writes the same bit streams with Python integers one field at a time; the
codec must write them byte for byte, and read back the sorted sets on ragged rows with
empty rows, singletons, ids 0 and V - 1, V up to 2**31 - 1 and rows up to 4096 wide.
Every truncation, extension and single bit flip of a buffer is a CodecError.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

from nemo_replay.support.codec import CodecError, decode_support, encode_support, header, header_of, rice_parameter
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport


def random_rows(seed: int, V: int, trajectories: int, max_len: int, *, singletons: float = 0.4, empty: float = 0.1):
    """Ragged rows of distinct ids with the sampled token in each non-empty row; edges 0 and V - 1 included."""
    g = np.random.default_rng(seed)
    rows, sampled, cu = [], [], [0]
    for _ in range(trajectories):
        T = int(g.integers(1, 9))
        for _ in range(T):
            u = g.random()
            n = 0 if u < empty else 1 if u < empty + singletons else int(g.integers(2, max_len + 1))
            n = min(n, V)
            ids = set()
            while len(ids) < n:
                ids.update(int(x) for x in g.integers(0, V, n - len(ids)))
            if n >= 2 and g.random() < 0.3:
                ids = set(list(ids)[: n - 2]) | {0, V - 1}
            row = list(ids)
            g.shuffle(row)
            rows.append(row)
            sampled.append(row[int(g.integers(0, n))] if n else int(g.integers(0, V)))
        cu.append(cu[-1] + T)
    members = torch.tensor([t for r in rows for t in r], dtype=torch.int32)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum([len(r) for r in rows])]), dtype=torch.int64)
    return RaggedSupport(members, offsets, torch.tensor(cu, dtype=torch.int32)), torch.tensor(sampled), rows


class Bits:
    """A big-endian bit writer, one field at a time (the naive reference)."""

    def __init__(self):
        self.bits = []

    def unary(self, v: int):
        self.bits += [0] * v + [1]

    def field(self, v: int, w: int):
        self.bits += [(v >> (w - 1 - i)) & 1 for i in range(w)]

    def bytes(self) -> bytes:
        bits = self.bits + [0] * (-len(self.bits) % 8)
        return bytes(int("".join(map(str, bits[i:i + 8])), 2) for i in range(0, len(bits), 8))


def naive_streams(rows, sampled, V, dropped):
    """The four streams, from the module doc's definitions, with Python integers."""
    lengths = [len(r) for r in rows]
    lb = max(0, int(sum(lengths) // len(lengths)).bit_length() - 2) if rows else 0
    lh, ll, gh, gl = Bits(), Bits(), Bits(), Bits()
    for r, s in zip(rows, sampled):
        lh.unary(len(r) >> lb)
        ll.field(len(r) & ((1 << lb) - 1), lb)
        ids = sorted(r)
        U = V
        if dropped and ids:
            ids = [t - (t > s) for t in ids if t != s]
            U = V - 1
        elif dropped:
            U = V - 1
        m = len(ids)
        q = max((U - m) // (m + 1), 1)
        b = q.bit_length() - 1
        prev = -1
        for t in ids:
            g = t - prev - 1
            gh.unary(g >> b)
            gl.field(g & ((1 << b) - 1), b)
            prev = t
    return [x.bytes() for x in (lh, ll, gh, gl)]


@pytest.mark.parametrize("seed, V, max_len", [(0, 10, 6), (1, 97, 20), (2, 128256, 64), (3, 2**31 - 1, 40),
                                              (4, 5000, 4096), (5, 2, 2)])
@pytest.mark.parametrize("dropped", [False, True])
def test_round_trip_and_the_streams_match_the_naive_writer(seed, V, max_len, dropped):
    support, sampled, rows = random_rows(seed, V, 6 if max_len < 4096 else 2, max_len)
    buf = encode_support(support, vocab_size=V, sampled_ids=sampled if dropped else None)
    h = header_of(buf)
    body = buf[header.HEAD.size + 8 * (h.trajectories + 1):].tobytes()
    expected = b"".join(naive_streams(rows, sampled.tolist(), V, dropped))
    assert body == expected
    out = decode_support(buf, sampled_ids=sampled if dropped else None, vocab_size=V)
    assert out.cu_seqlens.tolist() == support.cu_seqlens.tolist()
    assert [out.row(i).tolist() for i in range(out.num_rows)] == [sorted(r) for r in rows]
    from nemo_replay.support.checked import checked

    assert checked(out).vocab_size == V  # a decoded batch needs no second check


def test_the_worked_example_and_fixed_width_rows():
    rows = PackedTensor(torch.tensor([[5, 2, 7, -1], [1, -1, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32), [0, 3])
    sampled = torch.tensor([5, 1, 3])
    buf = encode_support(rows, vocab_size=10, sampled_ids=sampled)
    out = decode_support(buf, sampled_ids=sampled)
    assert [out.row(i).tolist() for i in range(3)] == [[2, 5, 7], [1], []]
    # {2, 7} -> {2, 6} in U = 9, m = 2, b = 1: gaps 2, 3 -> unary 1, 1 and low bits 0, 1.
    assert rice_parameter(np.int64(9), np.array([2]))[0] == 1


def test_rows_coded_with_their_sampled_tokens_are_checked_against_them_at_decode():
    """The decoder is the wire's only check (rollout/transport/wire.py): rows that kept their
    sampled tokens must hold the ones the reader passes, named by trajectory and row."""
    from nemo_replay.support.errors import SupportAlignmentError

    support = RaggedSupport.from_rows([[[4, 9], [2]], [[], [1, 3, 8]]])
    buf = encode_support(support, vocab_size=10)
    out = decode_support(buf, sampled_ids=torch.tensor([9, 2, 5, 3]))  # the empty row is exempt
    assert [out.row(i).tolist() for i in range(4)] == [[4, 9], [2], [], [1, 3, 8]]
    with pytest.raises(SupportAlignmentError, match=r"trajectory 1, row 1: sampled token 7 is not a member of its "
                                                    r"support row \[1, 3, 8\]"):
        decode_support(buf, sampled_ids=torch.tensor([9, 2, 5, 7]))
    with pytest.raises(CodecError, match="dtype torch.float32, expected integer"):
        decode_support(buf, sampled_ids=torch.tensor([9.0, 2.0, 5.0, 3.0]))


def test_bad_rows_are_refused_at_encode_naming_the_row():
    r = RaggedSupport.from_rows([[[1, 2], [3, 3]]])
    with pytest.raises(ValueError, match="row 1 holds id 3 twice"):
        encode_support(r, vocab_size=10)
    with pytest.raises(ValueError, match=r"row 0 holds id 12, outside \[0, 10\)"):
        encode_support(RaggedSupport.from_rows([[[12]]]), vocab_size=10)
    with pytest.raises(ValueError, match="row 0 does not hold its sampled token 4"):
        encode_support(RaggedSupport.from_rows([[[1, 2]]]), vocab_size=10, sampled_ids=torch.tensor([4]))


def test_fixed_width_rows_and_float_ids_are_held_to_the_row_rule_at_encode():
    """Fixed-width rows are read as their members: every entry >= 0 was one wherever it sat ([5, -1, 1]
    coded {1, 5}; [5, -25536, -1] coded {5}), and float rows and sampled ids were cut to integers (3.7
    coded 3). Both encoders now hold them to docs/design.md §2 first (-1 only as a trailing pad, integer
    ids), naming the trajectory and row; rows that keep the rule code as before."""
    from nemo_replay.support.codec import encode_kept

    def packed(rows, dtype=torch.int32):
        return PackedTensor(torch.tensor(rows, dtype=dtype), [0, 1, len(rows)])

    good = [[4, 9, -1], [5, 1, 3]]
    bad = [
        (packed([good[0], [5, -1, 1]]), r"trajectory 1, row 0 has a member after -1 padding .*\[5, -1, 1\]"),
        (packed([good[0], [5, -25536, -1]], torch.int16), r"trajectory 1, row 0 holds an id below -1 .*\[5, -25536, -1\]"),
        (packed([good[0], [-1, -1, 5]]), r"trajectory 1, row 0 has a member after -1 padding"),
        (packed([good[0], [5, 2**32 + 1, -1]], torch.int64), r"trajectory 1, row 0 holds an id >= vocab_size="),
        (packed([[4.0, 9.0, -1.0], [5.0, 1.0, 3.7]], torch.float32), r"support rows must be an integer tensor .*got torch.float32"),
    ]
    for support, match in bad:
        with pytest.raises(ValueError, match=rf"encode_support: {match}"):
            encode_support(support, vocab_size=10)
        with pytest.raises(ValueError, match=rf"where: {match}"):
            encode_kept(support, where="where")
    for sampled in (torch.tensor([4.0, 5.0]), torch.tensor([4, 5]).double(), np.array([4.0, 5.0]), [4.0, 5.7]):
        with pytest.raises(ValueError, match=r"encode_support: sampled_ids of dtype torch.float\d+; expected integer"):
            encode_support(packed(good), vocab_size=10, sampled_ids=sampled)
        with pytest.raises(ValueError, match=r"where: sampled_ids of dtype torch.float\d+; expected integer"):
            encode_kept(packed(good), sampled, where="where")
    want = [[4, 9], [1, 3, 5]]
    for dtype in (torch.int16, torch.int32, torch.int64):
        rows = decode_support(encode_support(packed(good, dtype), vocab_size=10, sampled_ids=torch.tensor([4, 5])),
                              sampled_ids=torch.tensor([4, 5]))
        assert [rows.row(i).tolist() for i in range(2)] == want
        kept = decode_support(encode_kept(packed(good, dtype), torch.tensor([9, 3], dtype=torch.int16), where="w"))
        assert [kept.row(i).tolist() for i in range(2)] == want


def test_every_truncation_extension_and_bit_flip_is_a_named_error():
    support, sampled, _ = random_rows(7, 300, 3, 12)
    buf = encode_support(support, vocab_size=300, sampled_ids=sampled)
    for cut in range(len(buf)):
        with pytest.raises(CodecError):
            decode_support(buf[:cut], sampled_ids=sampled)
    with pytest.raises(CodecError, match="oversized"):
        decode_support(np.concatenate([buf, np.zeros(1, np.uint8)]), sampled_ids=sampled)
    for byte in range(len(buf)):
        for bit in range(8):
            bad = buf.copy()
            bad[byte] ^= 1 << bit
            with pytest.raises(CodecError):
                decode_support(bad, sampled_ids=sampled)
    with pytest.raises(CodecError, match="pass sampled_ids"):
        decode_support(buf)
    with pytest.raises(CodecError, match="coded for V = 300, this model has 301"):
        decode_support(buf, sampled_ids=sampled, vocab_size=301)
    with pytest.raises(CodecError, match="sampled token 300 of row 0 is outside"):
        decode_support(buf, sampled_ids=torch.full_like(sampled, 300))


def _forged(support, vocab, sampled_ids=None, **fields):
    """A buffer whose header says ``fields`` (CRC recomputed: a writer's bug, not a transit error)."""
    import struct

    buf = encode_support(support, vocab_size=vocab, sampled_ids=sampled_ids)
    names = ["magic", "version", "flags", "lb", "pad", "V", "rows", "ids", "trajectories", "max_length", "crc",
             "s0", "s1", "s2", "s3"]
    values = dict(zip(names, header.HEAD.unpack(buf[:header.HEAD.size].tobytes())))
    values.update(fields)
    values["crc"] = 0
    out = np.concatenate([np.frombuffer(header.HEAD.pack(*values.values()), np.uint8), buf[header.HEAD.size:]])
    out[header.CRC_AT:header.CRC_AT + 4] = np.frombuffer(struct.pack("<I", header.crc(out)), np.uint8)
    return out


def test_consistent_but_wrong_headers_never_read_outside_the_buffer():
    support = RaggedSupport.from_rows([[[1, 5, 9], [4]], [[2, 3]]])
    with pytest.raises(CodecError, match=r"decodes to 3 ids, past the header's row width 2"):
        decode_support(_forged(support, 10, max_length=2))
    with pytest.raises(CodecError, match="says 3 rows and 1000000000000 ids, the streams hold at most"):
        decode_support(_forged(support, 10, ids=10**12))
    # Rows {0, 15} of V = 16 and of V = 15 take the same Rice parameter: only the range check can tell.
    with pytest.raises(CodecError, match="row 0 decodes id 15, past the 15 ids it is coded among"):
        decode_support(_forged(RaggedSupport.from_rows([[[0, 15]]]), 16, V=15))
    with pytest.raises(CodecError, match="version 2"):
        decode_support(_forged(support, 10, version=2))


def test_a_row_width_past_what_the_rows_hold_is_refused_before_anything_is_sized():
    """The header's row width sizes every fixed-width decode (rows x width): 93 bytes holding one empty
    row and a width of 2**31 - 1 (CRC valid) asked CompactRows.decode for 8 GiB. A row holds at most
    every coded id, plus its sampled token when the encoder dropped it: a wider width is refused on the
    host, by every reader, before a byte is copied; a width inside that bound still decodes the rows."""
    from nemo_replay.support.codec import CompactRows, decode_batch

    V = 2**31 - 1
    empty = RaggedSupport.from_rows([[[]]])
    forged = [_forged(empty, V, max_length=width) for width in (2**31 - 1, 2 * 10**8, 1)]
    assert len(forged[0]) == 93
    for buf in forged:
        width = header_of(buf).max_length
        for read in (lambda: CompactRows([buf]), lambda: decode_support(buf), lambda: decode_batch([buf]),
                     lambda: CompactRows([encode_support(empty, vocab_size=V), buf], labels=["a", "b"])):
            with pytest.raises(CodecError, match=rf"row width {width} exceeds V = {V} or the 0 ids the rows hold; a corrupted"):
                read()
    for seed, dropped in ((31, False), (32, True)):
        support, sampled, rows = random_rows(seed, 500, 3, 40)
        sampled = sampled if dropped else None
        ids = header_of(encode_support(support, vocab_size=500, sampled_ids=sampled)).ids
        bound = ids + dropped
        plus = " plus the sampled token" if dropped else ""
        with pytest.raises(CodecError, match=rf"row width {bound + 1} exceeds V = 500 or the {ids} ids the rows hold{plus};"):
            CompactRows([_forged(support, 500, sampled, max_length=bound + 1)], sampled_ids=sampled)
        at_bound = CompactRows([_forged(support, 500, sampled, max_length=bound)], sampled_ids=sampled).decode("cpu")
        assert not bool(at_bound.decode_flag) and at_bound.values.shape == (support.num_rows, bound)
        assert [sorted(r) for r in rows] == [[v for v in r if v >= 0] for r in at_bound.values.tolist()]


def test_the_codec_is_within_the_information_limit_s_margins():
    """Full k = 64 rows of V = 128k: about m * (2 + log2(U / m)) bits against log2 C(U, m)."""
    g = np.random.default_rng(0)
    V, k, T = 131072, 64, 256
    rows = np.stack([g.choice(V, k, replace=False) for _ in range(T)])
    sampled = torch.tensor(rows[:, 0])
    support = PackedTensor(torch.tensor(rows, dtype=torch.int32), [0, T])
    size = len(encode_support(support, vocab_size=V, sampled_ids=sampled)) - header.HEAD.size - 16
    limit_bits = T * (math.lgamma(V) - math.lgamma(k) - math.lgamma(V - k + 1)) / math.log(2)
    assert size * 8 / limit_bits < 1.1, size * 8 / limit_bits


def _recrc(buf: np.ndarray) -> np.ndarray:
    import struct

    out = buf.copy()
    out[header.CRC_AT:header.CRC_AT + 4] = 0
    out[header.CRC_AT:header.CRC_AT + 4] = np.frombuffer(struct.pack("<I", header.crc(out)), np.uint8)
    return out


def test_several_buffers_decode_at_once_as_each_alone():
    """decode_batch / CompactRows over buffers of different V, dropped and kept sampled ids, buffers
    without rows anywhere in the batch and empty rows: the rows of each buffer alone, back to back."""
    from nemo_replay.support.codec import CompactRows, decode_batch

    parts = [random_rows(s, V, 4, L) for s, V, L in ((11, 97, 9), (12, 128256, 64), (13, 50, 5), (14, 2**31 - 1, 30))]
    buffers = [encode_support(sup, vocab_size=V, sampled_ids=sampled if i % 2 else None)
               for i, ((sup, sampled, _), V) in enumerate(zip(parts, (97, 128256, 50, 2**31 - 1)))]
    # Buffers with no rows (first, between, last) and one whose rows are all empty.
    nothing, empty_rows = (encode_support(RaggedSupport.from_rows(r), vocab_size=7) for r in ([], [[[], []], [[]]]))
    buffers = [nothing, *buffers[:2], nothing, empty_rows, *buffers[2:], nothing]
    sampled = torch.cat([parts[0][1], parts[1][1], torch.zeros(3, dtype=torch.int64), parts[2][1], parts[3][1]])
    alone = [decode_support(b, sampled_ids=p[1]) for b, p in zip(buffers[1:3] + buffers[5:7], parts)]
    want = RaggedSupport.cat(alone[:2] + [decode_support(empty_rows)] + alone[2:])
    got = decode_batch(buffers, sampled_ids=sampled)
    assert got == want
    dev = CompactRows(buffers, sampled_ids=sampled).decode("cpu")
    assert not bool(dev.decode_flag)
    assert torch.equal(dev.values, want.to_padded(dev.values.shape[1]).values)
    assert dev.cu_seqlens.tolist() == want.cu_seqlens.tolist()
    # A failure after buffers without rows names its own buffer and its own row.
    forged = _forged(RaggedSupport.from_rows([[[4], [1, 5, 9]], [[2, 3]]]), 10, max_length=2)
    labels = [f"b{i}" for i in range(len(buffers))]
    with pytest.raises(CodecError, match=r"^b7: compact support: row 1 decodes to 3 ids, past the header's row width 2"):
        CompactRows(buffers[:7] + [forged], sampled_ids=torch.cat([sampled, torch.tensor([4, 1, 2])]),
                    labels=labels).decode("cpu", check=True)


def test_any_bit_of_a_forged_buffer_is_a_named_error_or_rows_that_hold_the_invariants():
    """Every single bit flip past the header, with the CRC recomputed (a writer's bug, not transit):
    the device decode never indexes outside a tensor, and when its flag reads clear the rows hold
    the docs/design.md §2 invariants (sorted, distinct, inside V, the sampled token in its row);
    the host decode agrees with the flag."""
    from nemo_replay.support.codec import CompactRows, decode_batch

    support, sampled, _ = random_rows(21, 300, 3, 12)
    for dropped in (False, True):
        buf = encode_support(support, vocab_size=300, sampled_ids=sampled if dropped else None)
        start = header.HEAD.size + 8 * (header_of(buf).trajectories + 1)
        flagged = clean = 0
        for byte in range(start, len(buf)):
            for bit in range(8):
                bad = buf.copy()
                bad[byte] ^= 1 << bit
                bad = _recrc(bad)
                try:
                    rows = CompactRows([bad], sampled_ids=sampled if dropped else None).decode("cpu")
                except CodecError:
                    flagged += 1
                    continue
                if bool(rows.decode_flag):
                    flagged += 1
                    with pytest.raises(CodecError):
                        rows.raise_decode_error()
                    with pytest.raises(CodecError):
                        decode_batch([bad], sampled_ids=sampled if dropped else None)
                    continue
                clean += 1
                rows.validate(vocab_size=300, sampled_ids=sampled if dropped else None)
        assert flagged > 0 and clean > 0, (flagged, clean)  # both outcomes happen: the test can fail either way


def test_a_unary_stream_s_count_and_padding_are_named_from_its_bytes():
    """Set bits added, missing or followed by a whole spare byte in one buffer of a batch: its label,
    the values its stream holds against its header, the bits past its last value."""
    import struct

    from nemo_replay.support.codec import decode_batch

    good = encode_support(RaggedSupport.from_rows([[[1, 5, 9], [4]], [[2, 3]]]), vocab_size=10)
    h = header_of(good)
    start = header.HEAD.size + 8 * (h.trajectories + 1)  # the length unary stream: 0001 01 001 -> [0x14, 0x80]
    assert good[start:start + 2].tolist() == [0x14, 0x80]
    extra = good.copy()
    extra[start + 1] |= 1  # a fourth set bit
    with pytest.raises(CodecError, match=r"^b: compact support: the length stream holds 4 values, the header says 3"):
        decode_batch([good, _recrc(extra)], labels=["a", "b"])
    gaps = start + h.streams[0] + h.streams[1]
    missing = good.copy()
    last = gaps + h.streams[2] - 1
    assert missing[last] > 0  # a stream's last set bit lies in its last byte
    missing[last] &= missing[last] - 1  # clear it: the last value's end is gone
    with pytest.raises(CodecError, match=r"^b: compact support: the gap stream holds 5 values, the header says 6"):
        decode_batch([good, _recrc(missing)], labels=["a", "b"])
    # A zero byte after the length stream (its size in the header grown by one): 15 bits past its last value.
    head = list(header.HEAD.unpack(good[:header.HEAD.size].tobytes()))
    head[10], head[11] = 0, head[11] + 1
    spare = np.concatenate([np.frombuffer(header.HEAD.pack(*head), np.uint8), good[header.HEAD.size:start + 2],
                            np.zeros(1, np.uint8), good[start + 2:]])
    spare[header.CRC_AT:header.CRC_AT + 4] = np.frombuffer(struct.pack("<I", header.crc(spare)), np.uint8)
    with pytest.raises(CodecError, match=r"^b: compact support: the length stream runs 15 bits past its last value"):
        decode_batch([good, spare], labels=["a", "b"])


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="Triton is installed here")
def test_the_fused_decode_asked_for_without_triton_is_refused_by_name():
    from nemo_replay.support.codec import CompactRows

    compact = CompactRows([encode_support(RaggedSupport.from_rows([[[1, 5, 9]]]), vocab_size=10)])
    with pytest.raises(ValueError, match=r"decode\(fused=True\) needs Triton \(pip install triton\); pass fused=None"):
        compact.decode("cpu", fused=True)
    assert compact.decode("cpu").values.tolist() == [[1, 5, 9]]  # the default: the reference's steps


def test_the_fused_decode_s_switch_takes_the_usual_words_and_names_any_other(monkeypatch):
    from nemo_replay.support.codec import CompactRows, fused

    for value, on in (("1", True), ("true", True), ("", True), ("0", False), ("No", False), (" off ", False)):
        monkeypatch.setenv("NEMO_REPLAY_FUSED_DECODE", value)
        assert fused.switched_on() is on, value
    monkeypatch.setenv("NEMO_REPLAY_FUSED_DECODE", "fast")
    compact = CompactRows([encode_support(RaggedSupport.from_rows([[[1, 5, 9]]]), vocab_size=10)])
    with pytest.raises(ValueError, match=r"NEMO_REPLAY_FUSED_DECODE='fast': expected one of 0, false, off, no, 1, true, "
                                         r"on, yes \(or unset\); set NEMO_REPLAY_FUSED_DECODE=0"):
        compact.decode("cpu")
    monkeypatch.delenv("NEMO_REPLAY_FUSED_DECODE")
    assert not fused.available(torch.device("cpu"))
