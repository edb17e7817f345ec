"""Wire codec: round trips, memory of a 64 MiB decode, malformed and reformatted bodies."""

import json
import tracemalloc

import pytest
import torch

from nemo_replay import capture
from nemo_replay.rollout.transport.wire import (
    WIRE_DTYPES,
    WireError,
    dumps,
    loads,
    routes_from_wire,
    support_from_wire,
    support_to_wire,
)
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport
from benchmarks.rss import reset_high_water, rss_high_water_kib, rss_kib

MiB = 1 << 20


def sample_array(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**62)), min(info.max, 2**62), shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
def test_every_allowed_dtype_round_trips(name):
    t = sample_array(WIRE_DTYPES[name])
    body = dumps({"a": t, "meta": {"n": 3, "s": 'quote " and {"data":"x"} inside a string'}, "empty": t[:0], "scalar": t[0, 0]})
    out = loads(body)
    for key, want in (("a", t), ("empty", t[:0]), ("scalar", t[0, 0])):
        assert out[key].dtype == want.dtype and out[key].shape == want.shape
        assert torch.equal(out[key].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))  # bit-exact
    assert out["meta"] == {"n": 3, "s": 'quote " and {"data":"x"} inside a string'}


def test_support_and_routes_round_trip():
    torch.manual_seed(0)
    logits = torch.randn(40, 300)
    fixed = capture.sample(logits, temperature=1.0, top_k=16, top_p=0.9)
    fixed_rows = fixed.support.to_padded()  # the fixed-width form an engine adapter hands over
    ragged = capture.sample(logits, temperature=1.0, top_p=0.9)
    routes = torch.randint(0, 64, (57, 4, 2), dtype=torch.int16)
    body = dumps({"fixed": support_to_wire(fixed_rows), "ragged": support_to_wire(ragged.support), "routes": routes})
    out = loads(body)
    got_fixed = support_from_wire(out["fixed"], sampled_ids=fixed.ids, vocab_size=300)
    got_ragged = support_from_wire(out["ragged"], sampled_ids=ragged.ids, vocab_size=300)
    assert isinstance(got_fixed, PackedTensor) and got_fixed == fixed_rows
    assert isinstance(got_ragged, RaggedSupport) and got_ragged == ragged.support
    assert torch.equal(routes_from_wire(out["routes"]), routes)


def test_64_mib_decode_peak_memory_under_twice_its_size():
    size = 64 * MiB
    array = torch.randint(-(2**31), 2**31 - 1, (size // 4,), dtype=torch.int32)
    body = dumps({"routes": array, "n": 1})
    assert len(body) > 4 * size // 3  # the base64 alone is 4/3 of the array
    # Python-level allocations (bytes, str, numpy chunks) during the decode.
    tracemalloc.start()
    out = loads(body)
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert torch.equal(out["routes"], array)
    assert py_peak < 16 * MiB, f"decode built {py_peak / MiB:.1f} MiB of Python objects"
    del out
    # Process memory, which also sees the tensor buffer: reset the high-water mark, decode.
    if not reset_high_water():
        pytest.skip("cannot reset VmHWM here (/proc/self/clear_refs); the tracemalloc bound above held")
    base = rss_kib()
    out = loads(body)
    extra = (rss_high_water_kib() - base) * 1024
    assert torch.equal(out["routes"][:1000], array[:1000])
    assert extra < 2 * size, f"peak extra memory {extra / MiB:.1f} MiB for a {size / MiB:.0f} MiB array"


def small_body() -> bytes:
    return dumps({
        "output_ids": torch.tensor([5, 9, 11, 2], dtype=torch.int64),
        "support": {"rows": torch.tensor([[5, 1, -1], [9, 3, 4], [11, -1, -1], [2, 7, -1]], dtype=torch.int32)},
        "finish_reason": "stop",
    })


def test_every_truncation_raises_value_error():
    body = small_body()
    for cut in range(len(body)):
        with pytest.raises(ValueError):
            loads(body[:cut])


def test_corruption_raises_value_error_or_decodes_never_crashes():
    body = small_body()
    for pos in range(len(body)):
        for ch in (b"!", b"A", b"]", b'"', b"9", b"\xff"):
            bad = body[:pos] + ch + body[pos + 1 :]
            try:
                loads(bad)
            except ValueError:
                pass


@pytest.mark.parametrize(
    "envelope, match",
    [
        ('{"data":"AQAAAAIAAAA=","shape":[3],"dtype":"int32"}', "needs 12"),  # wrong shape
        ('{"data":"AQAAAAIAAAA=","shape":[2],"dtype":"int64"}', "needs 16"),  # wrong dtype size
        ('{"data":"AQAAAAIAAAA=","shape":[2],"dtype":"object"}', "allow-list"),
        ('{"data":"AQAAAAIAAAA=","shape":[2],"dtype":"complex64"}', "allow-list"),
        ('{"data":"AQAA!AIAAAA=","shape":[2],"dtype":"int32"}', "base64"),
        ('{"data":"AQAAAAIAAA","shape":[2],"dtype":"int32"}', "multiple of 4"),
        ('{"data":"AgA=","shape":[2],"dtype":"bool"}', "0 and 1"),
        ('{"data":"AQAAAAIAAAA=","shape":[-2],"dtype":"int32"}', "shape"),
        ('{"data": "AQAAAAIAAAA=", "shape": [2.5], "dtype": "int32"}', "shape"),
        ('{"data": "AQAAAAIAAAA=", "shape": [2], "dtype": "int32", "x": 1}', "unexpected keys"),
    ],
)
def test_malformed_envelopes(envelope, match):
    with pytest.raises(ValueError, match=match):
        loads(('{"a":' + envelope + "}").encode())


WIDE = ",".join(["2147483647"] * 5)


@pytest.mark.parametrize("envelope", [
    f'{{"data":"","shape":[0,{WIDE}],"dtype":"int32"}}',  # torch: "Stride calculation overflowed"
    f'{{"data": "", "shape": [0, {WIDE}], "dtype": "int8"}}',  # the fallback path
    f'{{"dtype":"int64","shape":[{WIDE},0],"data":""}}',
    '{"data":"","shape":[0,2147483647,2],"dtype":"int32"}',
    '{"data":"","shape":[0,65536,65536],"dtype":"bool"}',
])
def test_an_empty_array_whose_other_dimensions_overflow_a_stride_is_a_wire_error(envelope):
    with pytest.raises(WireError, match=r"spans more than 2147483647 \(2\*\*31 - 1\) elements with its zero dimensions"):
        loads(('{"a":' + envelope + "}").encode())


def test_an_empty_array_as_wide_as_one_dimension_may_be_still_decodes():
    assert loads(b'{"a":{"data":"","shape":[0,2147483647],"dtype":"int32"}}')["a"].shape == (0, 2**31 - 1)


def test_reformatted_bodies_parse():
    body = small_body()
    want = loads(body)
    for text in (
        json.dumps(json.loads(body), indent=2),  # pretty-printed
        json.dumps(json.loads(body), sort_keys=True),  # keys re-ordered: dtype, shape, data
        json.dumps(json.loads(body), separators=(", ", ": ")),
    ):
        assert b'{"data":"' not in text.encode()
        got = loads(text.encode())
        assert torch.equal(got["output_ids"], want["output_ids"])
        assert torch.equal(got["support"]["rows"], want["support"]["rows"])
        assert got["finish_reason"] == "stop"


def test_support_schema_errors():
    rows = torch.tensor([[5, 1, -1], [9, 3, 4]], dtype=torch.int32)
    with pytest.raises(WireError, match="must hold integers"):
        support_from_wire(loads(dumps({"rows": rows.float()})))
    with pytest.raises(WireError, match="2-D"):
        support_from_wire(loads(dumps({"rows": rows[0]})))
    with pytest.raises(WireError, match="row 1: sampled token 7"):
        support_from_wire(loads(dumps({"rows": rows})), sampled_ids=torch.tensor([5, 7]))
    with pytest.raises(WireError, match="2 support rows for 3 sampled tokens"):
        support_from_wire(loads(dumps({"rows": rows})), sampled_ids=torch.tensor([5, 9, 1]))
    with pytest.raises(WireError, match="padding must be trailing"):
        support_from_wire(loads(dumps({"rows": torch.tensor([[5, -1, 2]], dtype=torch.int32)})))
    with pytest.raises(WireError, match="row_offsets"):
        support_from_wire(loads(dumps({"member_ids": rows[1], "row_offsets": torch.tensor([0, 5])})))
    with pytest.raises(WireError, match="expert ids"):
        routes_from_wire(torch.full((2, 1, 1), -3))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_unsigned_and_narrow_envelopes_are_checked_after_widening(dtype):
    # A uint8 tensor compared with -1 compares with 255: every check on wire data widens first.
    routes = torch.tensor([[[0, 3]], [[7, 1]]], dtype=dtype)
    got = routes_from_wire(loads(dumps({"r": routes}))["r"])
    assert got.dtype == dtype and torch.equal(got, routes)
    rows = torch.tensor([[5, 1], [9, 3]], dtype=dtype)
    support = support_from_wire(loads(dumps({"rows": rows})), sampled_ids=torch.tensor([1, 9]), vocab_size=10)
    assert support.to_padded().values.dtype == torch.int32 and support.to_padded().values.tolist() == rows.tolist()
    members, offsets = torch.tensor([5, 1, 9], dtype=dtype), torch.tensor([0, 2, 3], dtype=dtype)
    ragged = support_from_wire(loads(dumps({"member_ids": members, "row_offsets": offsets})), sampled_ids=torch.tensor([5, 9]))
    assert ragged.member_ids.dtype == torch.int32 and ragged.member_ids.tolist() == [5, 1, 9]
    assert ragged.row_offsets.dtype == torch.int64 and ragged.row_offsets.tolist() == [0, 2, 3]


def test_out_of_range_ids_are_refused_for_every_integer_dtype():
    with pytest.raises(WireError, match="expert ids must be >= -1, got -2"):
        routes_from_wire(torch.tensor([[[0, -2]]], dtype=torch.int8))
    with pytest.raises(WireError, match=r"outside \[-1, 2\*\*31\)"):
        support_from_wire({"rows": torch.tensor([[2**31, 1]], dtype=torch.int64)})
    with pytest.raises(WireError, match=r"outside \[-1, 2\*\*31\)"):
        support_from_wire({"rows": torch.tensor([[-2, 1]], dtype=torch.int16)})
    with pytest.raises(WireError, match=r"member_ids.*outside \[0, 2\*\*31\)"):
        support_from_wire({"member_ids": torch.tensor([-1, 3], dtype=torch.int8), "row_offsets": torch.tensor([0, 2])})
    with pytest.raises(WireError, match=r"member_ids.*outside \[0, 2\*\*31\)"):
        support_from_wire({"member_ids": torch.tensor([2**31, 3]), "row_offsets": torch.tensor([0, 2])})


def test_user_json_cannot_be_taken_for_the_codec_s_own_markers():
    # An object holding the marker key round-trips unchanged, next to real arrays.
    user = {"\x00wire": 0, "list": [{"\x00wire": 1}], "\x00wire:x": "y"}
    body = dumps({"user": user, "a": torch.tensor([1, 2], dtype=torch.int32), "b": torch.tensor([3.5])})
    out = loads(body)
    assert out["user"] == user and out["a"].tolist() == [1, 2] and out["b"].tolist() == [3.5]
    # The same objects sent by a client that never used dumps parse as plain JSON.
    assert loads(json.dumps({"user": user}).encode()) == {"user": user}
    # An object shaped like an envelope is the codec's own syntax: refused on encode, naming where.
    with pytest.raises(WireError, match=r"\$\.meta\[1\].*'data', 'dtype', 'shape'"):
        dumps({"meta": [1, {"data": "AAAA", "shape": [3], "dtype": "uint8", "note": "mine"}]})


def test_deeply_nested_json_is_a_wire_error():
    with pytest.raises(WireError, match="nested"):
        loads(b"[" * 100_000 + b"]" * 100_000)


def test_compact_rows_travel_tagged_and_old_forms_still_read():
    """The compact form (support/codec/) carries a version tag; the fixed and CSR envelopes of
    older servers decode as before; a damaged or unknown compact payload is a WireError."""
    from nemo_replay.rollout.transport.wire import CODEC_TAG

    rows = torch.tensor([[3, 9, -1], [4, -1, -1], [0, 7, 46]], dtype=torch.int32)
    sampled = torch.tensor([9, 4, 46])
    wire = support_to_wire(PackedTensor(rows, [0, 3]), vocab_size=47, sampled_ids=sampled)
    assert wire["codec"] == CODEC_TAG and wire["data"].dtype == torch.uint8
    back = support_from_wire(loads(dumps({"s": wire}))["s"], sampled_ids=sampled, vocab_size=47)
    assert [back.row(j).tolist() for j in range(3)] == [[3, 9], [4], [0, 7, 46]]
    fixed = support_from_wire(loads(dumps({"s": support_to_wire(PackedTensor(rows, [0, 3]))}))["s"], sampled_ids=sampled)
    assert torch.equal(fixed.values, rows)
    csr = RaggedSupport.from_padded(PackedTensor(rows, [0, 3]))
    again = support_from_wire(loads(dumps({"s": support_to_wire(csr)}))["s"], sampled_ids=sampled)
    assert [again.row(j).tolist() for j in range(3)] == [[3, 9], [4], [0, 7, 46]]
    damaged = dict(wire, data=wire["data"].clone())
    damaged["data"][-1] ^= 4
    with pytest.raises(WireError, match="CRC-32 does not match"):
        support_from_wire(damaged, sampled_ids=sampled, vocab_size=47)
    with pytest.raises(WireError, match="truncated"):
        support_from_wire(dict(wire, data=wire["data"][:-3]), sampled_ids=sampled, vocab_size=47)
    with pytest.raises(WireError, match="codec 'nrsc-9'.*upgrade the reader"):
        support_from_wire(dict(wire, codec="nrsc-9"), sampled_ids=sampled)
    with pytest.raises(WireError, match="wire decode: support: compact support: .*pass sampled_ids"):
        support_from_wire(wire)
    kept = support_to_wire(PackedTensor(rows, [0, 3]), vocab_size=47)  # coded with the sampled ids in
    with pytest.raises(WireError, match="row 1: sampled token 5 is not a member"):
        support_from_wire(kept, sampled_ids=torch.tensor([9, 5, 46]), vocab_size=47)
