"""Binary wire bodies: the layout, bit-exact round trips, malformed bodies named."""

import json
import struct

import numpy as np
import pytest
import torch

from nemo_replay.rollout.transport.binary import (
    BINARY_TYPE,
    JSON_TYPE,
    MAGIC,
    UnsupportedVersion,
    accepts_binary,
    dumps_binary,
    dumps_body,
    loads_binary,
    loads_body,
)
from nemo_replay.rollout.transport.client import GenerateResult
from nemo_replay.rollout.transport.server import response_body
from nemo_replay.rollout.transport.wire import WIRE_DTYPES, WireError, dumps, support_from_wire, support_to_wire
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport


def sample_array(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**62)), min(info.max, 2**62), shape, generator=g, dtype=torch.int64).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
def test_every_allowed_dtype_round_trips_bit_for_bit(name):
    t = sample_array(WIRE_DTYPES[name])
    if t.dtype.is_floating_point:
        t.view(-1)[:3] = torch.tensor([float("nan"), float("-inf"), -0.0], dtype=t.dtype)
    obj = {"a": t, "meta": {"n": 3, "s": 'quote " and {"data":0} inside a string'}, "empty": t[:0], "scalar": t[0, 0],
           "strided": t[:, ::2], "numpy": t.numpy() if t.dtype != torch.bfloat16 else t}
    out = loads_binary(dumps_binary(obj))
    for key, want in (("a", t), ("empty", t[:0]), ("scalar", t[0, 0]), ("strided", t[:, ::2]), ("numpy", t)):
        assert out[key].dtype == want.dtype and out[key].shape == want.shape, key
        assert torch.equal(bits(out[key]), bits(want.contiguous())), key
    assert out["meta"] == obj["meta"]


def test_the_layout_is_the_worked_example():
    body = dumps_binary({"ids": torch.tensor([1, 2], dtype=torch.int32), "n": 2})
    head = b'{"ids":{"data":0,"shape":[2],"dtype":"int32"},"n":2}'
    assert body == MAGIC + struct.pack("<I", 52) + head + bytes([1, 0, 0, 0, 2, 0, 0, 0]) and len(body) == 68


def ragged_rows(n: int, V: int, seed: int) -> tuple[list, torch.Tensor]:
    """Rows of 1..64 distinct ids over V, each holding its sampled id (at a random place)."""
    rng = np.random.default_rng(seed)
    rows = [rng.choice(V, int(k), replace=False).tolist() for k in rng.integers(1, 65, n)]
    return rows, torch.tensor([r[int(rng.integers(0, len(r)))] for r in rows])


@pytest.mark.parametrize("V", [131072, 2**31 - 1])
def test_ragged_rows_with_distinct_ids_travel_bit_for_bit(V):
    rows, sampled = ragged_rows(300, V, seed=V % 97)
    logprobs = -torch.rand(300, generator=torch.Generator().manual_seed(1))
    logprobs[:2] = torch.tensor([-0.0, -1e-38])
    routes = torch.randint(-1, 200, (280, 3, 2), dtype=torch.int16)
    reply = response_body(sampled, logprobs, RaggedSupport.from_rows([rows]), vocab_size=V, finish_reason="length",
                          routes=routes, routes_start=20)
    for binary in (True, False):
        body, media_type = dumps_body(reply, binary)
        got = GenerateResult.from_body(loads_body(body, media_type), vocab_size=V)
        assert [got.support.row(j).tolist() for j in range(300)] == [sorted(r) for r in rows]
        assert torch.equal(got.output_ids, sampled) and torch.equal(bits(got.logprobs), bits(logprobs))
        assert got.routes.dtype == torch.int16 and torch.equal(got.routes, routes) and got.routes_start == 20
    # The older row forms travel in a binary body too, bit for bit.
    fixed = RaggedSupport.from_rows([rows]).to_padded()
    for support in (fixed, RaggedSupport.from_rows([rows])):
        back = support_from_wire(loads_binary(dumps_binary({"s": support_to_wire(support)}))["s"], sampled_ids=sampled,
                                 vocab_size=V)
        assert back == support


def small_body() -> bytes:
    return dumps_binary({
        "output_ids": torch.tensor([5, 9, 11, 2], dtype=torch.int64),
        "support": {"rows": torch.tensor([[5, 1, -1], [9, 3, 4], [11, -1, -1], [2, 7, -1]], dtype=torch.int32)},
        "done": torch.tensor([False, True]),
        "finish_reason": "stop",
    })


def test_every_truncation_and_every_extension_is_a_wire_error():
    body = small_body()
    for cut in range(len(body)):
        with pytest.raises(WireError):
            loads_binary(body[:cut])
    with pytest.raises(WireError, match="1 bytes follow the last part"):
        loads_binary(body + b"\x00")


def test_corruption_raises_value_error_or_decodes_never_crashes():
    body = small_body()
    for pos in range(len(body)):
        for byte in (0x00, 0x21, 0x5D, 0x22, 0x39, 0xFF):
            try:
                loads_binary(body[:pos] + bytes([byte]) + body[pos + 1:])
            except ValueError:
                pass


def binary_with_head(head: bytes, parts: bytes = b"", head_len=None) -> bytes:
    return MAGIC + struct.pack("<I", len(head) if head_len is None else head_len) + head + parts


WIDE = ",".join(["2147483647"] * 5)


@pytest.mark.parametrize("body, match", [
    (b"NRW", "holds 3 bytes, fewer than the 8"),
    (b'{"a":1}\x00\x00\x00\x00', r"starts with b'\{\"a\"', not the magic b'NRW1'"),
    (binary_with_head(b'{"a":1}', head_len=8), "head's length 8 at byte 4 runs past the body's end"),
    (binary_with_head(b'{"a":{"data":0,"shape":[3],"dtype":"int32"}}', b"\x01\x00\x00\x00" * 2),
     r"at \$\.a: part 0 \(\[3\] int32, 12 bytes from byte 52\) runs past the body's end \(60 bytes\)"),
    (binary_with_head(b'{"a":{"data":1,"shape":[1],"dtype":"int8"}}', b"\x01"), "data is 1, expected the part index 0"),
    (binary_with_head(b'{"a":{"data":"AQ==","shape":[1],"dtype":"int8"}}', b""),
     r"data is 'AQ==', expected the part index 0.*a base64 envelope belongs in a JSON body"),
    (binary_with_head(b'{"a":{"data":true,"shape":[1],"dtype":"int8"}}', b"\x01"), "data is True"),
    (binary_with_head(b'{"a":{"data":0,"shape":[1],"dtype":"int8","x":1}}', b"\x01"), r"unexpected keys \['x'\]"),
    (binary_with_head(b'{"a":{"data":0,"shape":[1],"dtype":"object"}}', b"\x01"), "allow-list"),
    (binary_with_head(b'{"a":{"data":0,"shape":[-1],"dtype":"int8"}}', b"\x01"), "non-negative ints"),
    (binary_with_head(b'{"a":{"data":0,"shape":[0,' + WIDE.encode() + b'],"dtype":"int8"}}'), "spans more than"),
    (binary_with_head(b'{"a":{"data":0,"shape":[2],"dtype":"bool"}}', b"\x01\x02"), "bool part 0 holds bytes other"),
    (binary_with_head(b'{"a":1', b""), "head is not valid JSON"),
    (binary_with_head(b'{"a":"\xff"}', b""), "head is not UTF-8"),
    (binary_with_head(b"[" * 100_000 + b"]" * 100_000), "nested too deeply"),
    (binary_with_head(b'{"a":' + b"9" * 4301 + b"}"), "the head holds an integer of more than 4300 digits"),
    (binary_with_head(b'{"a":{"data":0,"shape":[1],"dtype":"int8"}}', b"\x01\x02"), "1 bytes follow the last part"),
])
def test_malformed_binary_bodies_are_named(body, match):
    with pytest.raises(WireError, match=match):
        loads_binary(body)


def test_another_version_is_unsupported_and_a_mislabelled_body_is_named():
    with pytest.raises(UnsupportedVersion, match=r"format version b'NRW2', this reader takes b'NRW1'"):
        loads_binary(b"NRW2" + small_body()[4:])
    with pytest.raises(WireError, match=f"binary wire body .* sent as 'application/json'; label it Content-Type: {BINARY_TYPE}"):
        loads_body(small_body(), JSON_TYPE)
    with pytest.raises(WireError, match="not the magic"):
        loads_body(dumps({"a": 12345}), BINARY_TYPE)
    assert loads_body(dumps({"a": torch.tensor([1])}), "text/plain")["a"].tolist() == [1]  # any other label: JSON


def test_reserved_envelope_shapes_and_unserialisable_values_are_refused_on_encode():
    with pytest.raises(WireError, match=r"\$\.meta\[0\].*'data', 'dtype', 'shape'"):
        dumps_binary({"meta": [{"data": 0, "shape": [1], "dtype": "int8"}]})
    with pytest.raises(WireError, match="set is not JSON serialisable"):
        dumps_binary({"a": {1, 2}})
    with pytest.raises(WireError, match="allow-list"):
        dumps_binary({"a": torch.zeros(2, dtype=torch.complex64)})


@pytest.mark.parametrize("accept, want", [
    (None, False), ("*/*", False), ("application/json", False), (BINARY_TYPE, True),
    (f"{BINARY_TYPE}, application/json;q=0.5", True), (f"application/json, {BINARY_TYPE.upper()}; q=0.2", True),
    (f"{BINARY_TYPE};q=0", False), (f"{BINARY_TYPE};q=0.0", False), (f"{BINARY_TYPE};q=x", False),
    (f"{BINARY_TYPE}x", False),
])
def test_accepts_binary_only_when_named(accept, want):
    assert accepts_binary(accept) is want


def test_a_binary_response_is_the_json_one_less_its_base64():
    rows, sampled = ragged_rows(512, 131072, seed=3)
    reply = response_body(sampled, -torch.rand(512), RaggedSupport.from_rows([rows]), vocab_size=131072,
                          finish_reason="stop")
    binary, text = dumps_binary(reply), dumps(reply)
    raw = sum(t.numel() * t.element_size() for t in (reply["output_ids"], reply["logprobs"], reply["support"]["data"]))
    assert reply["output_ids"].dtype == torch.int32 and len(binary) < raw + 250 < 0.8 * len(text)
    assert json.loads(text)["finish_reason"] == loads_binary(binary)["finish_reason"] == "stop"
    padded = PackedTensor(RaggedSupport.from_rows([rows]).to_padded().values, [0, 512])
    assert support_from_wire(loads_binary(dumps_binary({"s": support_to_wire(padded)}))["s"]) == padded
