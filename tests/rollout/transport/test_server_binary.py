"""The generate server with binary bodies: the form each side reads, the caps, auth and malformed bodies."""

import asyncio
import json
import struct

import aiohttp
import pytest
import torch

from nemo_replay.rollout.transport.binary import BINARY_TYPE, JSON_TYPE, MAGIC, dumps_binary, loads_body
from nemo_replay.rollout.transport.client import GenerateResult
from nemo_replay.rollout.transport.wire import dumps, loads
from tests.rollout.transport.test_server import OK, V, _timed_exchange, with_server

BINARY_OK = dumps_binary({**OK, "input_ids": torch.tensor(OK["input_ids"], dtype=torch.int32)})


async def post(url: str, body: bytes, headers: dict) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/generate", data=body, headers=headers) as resp:
            return resp.status, resp.content_type, await resp.read()


def error_of(raw: bytes) -> str:
    return json.loads(raw)["error"]


@pytest.mark.parametrize("accept, answer", [
    (None, JSON_TYPE),  # an old client: aiohttp's default */*
    ("application/json", JSON_TYPE),
    (f"{BINARY_TYPE}, application/json;q=0.5", BINARY_TYPE),
    (f"{BINARY_TYPE};q=0, application/json", JSON_TYPE),
])
def test_either_request_form_is_read_and_the_answer_takes_the_form_accept_names(accept, answer):
    headers = {"Accept": accept} if accept else {}

    async def run(server):
        return [await post(server.url, body, {**headers, "Content-Type": media_type})
                for body, media_type in ((json.dumps(OK).encode(), JSON_TYPE), (dumps(OK), JSON_TYPE),
                                         (BINARY_OK, BINARY_TYPE), (json.dumps(OK).encode(), "text/plain"))]

    replies = with_server(run)
    assert [(status, media_type) for status, media_type, _ in replies] == [(200, answer)] * 4
    results = [GenerateResult.from_body(loads_body(raw, media_type), vocab_size=V) for _, media_type, raw in replies]
    if answer == JSON_TYPE:  # what an old client runs on the body: wire.loads, then the same checks
        assert [GenerateResult.from_body(loads(raw)).output_ids.tolist() for _, _, raw in replies] == \
            [r.output_ids.tolist() for r in results]
    first = results[0]
    for r in results[1:]:  # one seed, one generation: the same tokens, log-probs and rows, bit for bit
        assert torch.equal(r.output_ids, first.output_ids) and torch.equal(r.logprobs.view(torch.int32),
                                                                          first.logprobs.view(torch.int32))
        assert r.support == first.support


def binary_request(head: bytes, parts: bytes = b"", head_len=None) -> bytes:
    return MAGIC + struct.pack("<I", len(head) if head_len is None else head_len) + head + parts


SAMPLING = json.dumps(OK["sampling_params"]).encode()
IDS_HEAD = b'{"input_ids":{"data":0,"shape":[3],"dtype":"int32"},"sampling_params":' + SAMPLING + b"}"


@pytest.mark.parametrize("body, media_type, status, match", [
    (BINARY_OK[:-2], BINARY_TYPE, 400, r"part 0 \(\[3\] int32, 12 bytes from byte \d+\) runs past the body's end"),
    (binary_request(IDS_HEAD, b"\x05\x00\x00\x00" * 3, head_len=10_000), BINARY_TYPE, 400,
     "head's length 10000 at byte 4 runs past the body's end"),
    (binary_request(IDS_HEAD.replace(b"[3]", b"[300000]"), b"\x05\x00\x00\x00" * 3), BINARY_TYPE, 400,
     r"part 0 \(\[300000\] int32, 1200000 bytes from byte \d+\) runs past the body's end"),
    (BINARY_OK + b"\x00", BINARY_TYPE, 400, "1 bytes follow the last part"),
    (b"NRW2" + BINARY_OK[4:], BINARY_TYPE, 415, r"format version b'NRW2', this reader takes b'NRW1'"),
    (BINARY_OK, JSON_TYPE, 400, f"a binary wire body .* sent as 'application/json'; label it Content-Type: {BINARY_TYPE}"),
    (json.dumps(OK).encode(), BINARY_TYPE, 400, "starts with .*, not the magic b'NRW1'"),
    (binary_request(IDS_HEAD, b"\x05\x00\x00\x00\x06\x00\x00\x00\x30\x00\x00\x00"), BINARY_TYPE, 400,
     rf"input_ids\[2\]=48: token ids must lie in \[0, {V}\)"),
    (binary_request(b'{"input_ids":[' + b"1," * 70_000 + b'1],"sampling_params":' + SAMPLING + b"}"), BINARY_TYPE, 413,
     r"request head holds up to 700\d\d JSON values outside array envelopes, over the server's max_json_values=65536"),
], ids=["truncated part", "head past the end", "part past the end", "trailing bytes", "other version",
        "binary sent as json", "json sent as binary", "id out of range", "head over the value cap"])
def test_a_malformed_binary_request_is_a_4xx_naming_it(body, media_type, status, match):
    async def run(server):
        return await post(server.url, body, {"Content-Type": media_type})

    got, _, raw = with_server(run)
    assert got == status and __import__("re").search(match, error_of(raw)), (got, raw[:300])


def test_a_binary_body_needs_the_token():
    async def run(server):
        return [(await post(server.url, BINARY_OK, {"Content-Type": BINARY_TYPE, **auth}))[0]
                for auth in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer s3cret"})]

    assert with_server(run, token="s3cret") == [401, 401, 200]


def test_a_binary_body_past_the_cap_is_refused_before_it_is_read_whole():
    # Declared: a 413 at once, with 100 of its 10 MB sent (a 408 would mean the server waited for it).
    declared = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: " + BINARY_TYPE.encode()
                + b"\r\nContent-Length: 10000000\r\n\r\n" + BINARY_OK[:100])
    # Sent without a declared length (chunked): refused once past the cap.
    big = dumps_binary({**OK, "input_ids": torch.zeros(5000, dtype=torch.int32)})

    async def run(server):
        status, waited = await _timed_exchange(server, declared, lambda reader: reader.readline())

        async def chunks():
            for i in range(0, len(big), 1024):
                yield big[i:i + 1024]

        chunked = await post(server.url, chunks(), {"Content-Type": BINARY_TYPE})
        return status, waited, chunked

    status, waited, (chunked, _, raw) = with_server(run, max_body_bytes=4096, body_timeout_s=3.0)
    assert status.startswith(b"HTTP/1.1 413") and waited < 2
    assert chunked == 413 and "over the server's limit of 4096 bytes" in error_of(raw)


def test_a_binary_body_that_does_not_arrive_is_dropped():
    async def read_all(reader):
        head = await asyncio.wait_for(reader.read(200), 5)
        return head + await asyncio.wait_for(reader.read(), 5)

    async def run(server):
        request = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: " + BINARY_TYPE.encode()
                   + b"\r\nContent-Length: %d\r\n\r\n" % len(BINARY_OK) + BINARY_OK[:20])
        return await _timed_exchange(server, request, read_all)

    answer, waited = with_server(run, body_timeout_s=0.3)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.3 s" in answer and waited < 3
