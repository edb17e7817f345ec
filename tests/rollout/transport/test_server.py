"""The loopback generate server, hardened: validation, auth, slow bodies, disconnects, load."""

import asyncio
import json
import os
import random
import re
import threading
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from nemo_replay.rollout.transport.client import GenerateClient, GenerateRequestError
from nemo_replay.rollout.transport import server as server_module
from nemo_replay.rollout.transport.server import MAX_JSON_VALUES, TOKEN_ENV, GenerateServer, read_token_file
from nemo_replay.rollout.transport.binary import dumps_body
from nemo_replay.rollout.transport.wire import dumps
from benchmarks.rss import reset_high_water, rss_high_water_kib

V, EOS = 48, 2
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 2
OK = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.9, "top_k": 6, "max_new_tokens": 4}, "seed": 1}


def logits_fn(tokens: torch.Tensor) -> torch.Tensor:
    return TABLE[tokens[-1]] + 0.05 * tokens.numel()


async def post_raw(url: str, body: bytes, headers=None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/generate", data=body, headers=headers or {}) as resp:
            text = await resp.read()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, {"raw": text[:200]}


def with_server(coro_fn, logits=logits_fn, vocab_size=V, eos_id=EOS, **kwargs):
    async def go():
        async with GenerateServer(logits, vocab_size=vocab_size, eos_id=eos_id, **kwargs) as server:
            return await coro_fn(server)

    return asyncio.run(go())


def edit(path: str, value):
    """OK with one field set (``"sampling_params.top_k"``) or removed (value is ``...``)."""
    body = json.loads(json.dumps(OK))
    *parents, key = path.split(".")
    node = body
    for p in parents:
        node = node[p]
    if value is ...:
        del node[key]
    else:
        node[key] = value
    return json.dumps(body).encode()


BAD = [
    (edit("input_ids", [5, 1.5]), r"input_ids\[1\]=1.5: expected an int"),
    (edit("input_ids", [True, 6]), r"input_ids\[0\]=True: expected an int"),
    (edit("input_ids", [5, V]), rf"input_ids\[1\]={V}: token ids must lie in \[0, {V}\)"),
    (edit("input_ids", [-1]), r"input_ids\[0\]=-1"),
    (edit("input_ids", [5, 2**64]), rf"input_ids\[1\]={2**64}: token ids must lie in \[0, {V}\)"),  # past int64
    (edit("input_ids", []), "input_ids: empty"),
    (edit("input_ids", "5 6 7"), "input_ids: expected a list"),
    (edit("input_ids", ...), "input_ids: missing"),
    (dumps({**OK, "input_ids": torch.tensor([5.0, 6.0])}), "input_ids: expected a 1-D integer array"),
    (dumps({**OK, "input_ids": torch.tensor([[5, 6]])}), "input_ids: expected a 1-D integer array"),
    (edit("sampling_params", [0.9, 6]), "sampling_params: expected an object"),
    (edit("sampling_params", None), "sampling_params: expected an object"),
    (edit("sampling_params", ...), "sampling_params: expected an object"),
    (edit("sampling_params.top_n", 3), r"sampling_params: unknown keys \['top_n'\]"),
    (edit("sampling_params.max_new_tokens", 0), r"max_new_tokens=0: expected an int in \[1, 64\]"),
    (edit("sampling_params.max_new_tokens", 65), r"max_new_tokens=65: expected an int in \[1, 64\]"),
    (edit("sampling_params.max_new_tokens", 1.5), "max_new_tokens=1.5: expected an int"),
    (edit("sampling_params.max_new_tokens", True), "max_new_tokens=True: expected an int"),
    (edit("sampling_params.max_new_tokens", "3"), "max_new_tokens='3': expected an int"),
    (edit("sampling_params.top_k", 6.0), "top_k=6.0"),
    (edit("sampling_params.top_k", True), "top_k=True"),
    # Rows are top_k wide: an unbounded top_k would allocate and send top_k ids per token.
    (edit("sampling_params.top_k", V + 1), rf"sampling_params.top_k={V + 1}: expected at most the vocabulary size {V}"),
    (edit("sampling_params.top_k", 2**70), rf"sampling_params.top_k={2**70}: expected at most the vocabulary size"),
    (edit("sampling_params.temperature", "1"), "temperature='1'"),
    (edit("sampling_params.temperature", ...), "temperature=None"),
    (edit("sampling_params.temperature", 0.0), r"temperature=0.0: .* set sampling_params.temperature, e.g. 1.0"),
    (edit("sampling_params.temperature", 10**400), r"temperature=1000.*: capture needs a finite temperature > 0"),  # was a 500
    (edit("sampling_params.top_p", None), "top_p=None"),
    (edit("sampling_params.ties", "lowest"), "ties='lowest'"),
    (edit("routes_start", -1), r"routes_start=-1: must lie in \[0, 3\]"),
    (edit("routes_start", 4), r"routes_start=4"),
    (edit("routes_start", 1.5), "routes_start=1.5: expected an int"),
    (edit("seed", True), "seed=True: expected an int"),
    (edit("seed", -3), r"seed=-3: expected an int in \[0, 2\*\*63\)"),
    (edit("prompt", "hi"), r"unknown fields \['prompt'\]"),
    (b"[1, 2, 3]", "expected a JSON object"),
    (b'{"input_ids": [5, 6', "not valid JSON"),
    (b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),
    (b'{"input_ids": {"data": "AQ==", "shape": [1], "dtype": "int8", "x": 1}}', "unexpected keys"),
    # Values the checks once let through to a 500 (issue: "400, never 500").
    (edit("sampling_params.temperature", 1e-320), r"temperature=1e-320: capture serves temperatures in \[0.01, 100.0\]"),
    (edit("sampling_params.temperature", 1e308), r"temperature=1e\+308: capture serves temperatures"),
    (b'{"input_ids": {"data": "", "shape": [0, 100000000000000000000000], "dtype": "int32"}}',
     r"has a dimension over 2147483647"),  # was a TypeError
    (b'{"input_ids": {"data": "", "shape": [0' + b",2147483647" * 5 + b'], "dtype": "int32"}}',
     r"spans more than 2147483647 \(2\*\*31 - 1\) elements"),  # was a 500 (stride overflow)
    (b'{"input_ids": {"data":"","shape":[0' + b",2147483647" * 5 + b'],"dtype":"int32"}}', "spans more than"),
    (b'{"input_ids": [5], "seed": ' + b"9" * 4301 + b"}", "an integer of more than 4300 digits; no field"),
    (b'{"input_ids": {"data": "", "shape": [0,' + b"9" * 4301 + b'], "dtype": "int32"}}', "more than 4300 digits"),
]


def test_every_bad_field_is_a_400_naming_it():
    async def run(server):
        return [await post_raw(server.url, body) for body, _ in BAD] + [await post_raw(server.url, edit("seed", 4))]

    answers = with_server(run, max_new_tokens_cap=64)
    for (status, reply), (body, match) in zip(answers, BAD):
        assert status == 400, (body[:80], status, reply)
        assert re.search(match, reply["error"]), (reply["error"], match)
        assert "set_int_max_str_digits" not in reply["error"]  # Python's advice is not the client's fix
    assert answers[-1][0] == 200  # the same server still answers a good request


def test_client_refuses_coercion_before_sending():
    async def run(server):
        async with GenerateClient(server.url) as client:
            for ids, match in (([5, 1.5], r"input_ids\[1\]=1.5"), ([True], r"input_ids\[0\]=True"),
                               (torch.tensor([5.0]), "1-D integer tensor"), ([-2], r"\[0, 2\*\*31\)"),
                               ([5, 2**64], rf"input_ids\[1\]={2**64}: token ids must lie in \[0, 2\*\*31\)")):
                with pytest.raises(ValueError, match=match):
                    await client.generate(ids, sampling_params=OK["sampling_params"])
            with pytest.raises(ValueError, match="seed=1.5"):
                await client.generate([5], sampling_params=OK["sampling_params"], seed=1.5)
            with pytest.raises(ValueError, match="sampling_params: expected a mapping"):
                await client.generate([5], sampling_params=[("temperature", 1.0)])
        return server.num_requests

    assert with_server(run) == 0


def test_bearer_token_from_argument_or_environment(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)

    async def run(server, client_token):
        missing = await post_raw(server.url, edit("seed", 2))
        wrong = await post_raw(server.url, edit("seed", 2), {"Authorization": "Bearer s3cres"})
        right = await post_raw(server.url, edit("seed", 2), {"Authorization": "Bearer s3cret"})
        async with GenerateClient(server.url, token="nope", backoff_s=0.01) as client:
            with pytest.raises(GenerateRequestError, match="HTTP 401.*not retried"):
                await client.generate([5], sampling_params=OK["sampling_params"])
            assert client.num_retries == 0
        async with GenerateClient(server.url, token=client_token) as client:
            result = await client.generate([5, 6], sampling_params=OK["sampling_params"], seed=0)
        return [missing[0], wrong[0], right[0]], missing[1], result

    statuses, reply, result = with_server(lambda server: run(server, "s3cret"), token="s3cret")
    assert statuses == [401, 401, 200] and "bearer token" in reply["error"] and result.output_ids.numel() >= 1
    monkeypatch.setenv(TOKEN_ENV, "s3cret")  # now server and client both read it
    statuses, _, result = with_server(lambda server: run(server, None))
    assert statuses == [401, 401, 200] and result.output_ids.numel() >= 1
    with pytest.raises(ValueError, match="empty"):
        GenerateServer(logits_fn, vocab_size=V, token="")


async def post_bytes(url: str, head: bytes, body: bytes, timeout_s: float = 10.0) -> tuple[bytes, bytes]:
    """One request written byte for byte (headers aiohttp would re-encode); (status line, body)."""
    host, port = url[len("http://"):].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head
                     + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    status, _, rest = answer.partition(b"\r\n")
    return status, rest.partition(b"\r\n\r\n")[2]


def test_an_authorization_header_that_is_not_utf8_is_a_401_not_a_500():
    # aiohttp keeps non-UTF-8 header bytes as surrogates; str.encode() of them raised
    # UnicodeEncodeError, a logged 500 that anyone could trigger without a token.
    async def run(server):
        answers = []
        for head in (b"Authorization: Bearer \xff\xfe\r\n", b"Authorization: \xc3(s3cret\r\n",
                     b"Authorization: Bearer s3cret\r\nAuthorization: Bearer s3cret\r\n",  # two: which one counts?
                     b"Authorization: Bearer s3cret\r\n"):
            answers.append(await post_bytes(server.url, head, edit("seed", 3)))
        return answers

    answers = with_server(run, token="s3cret")
    assert [status for status, _ in answers] == [b"HTTP/1.1 401 Unauthorized"] * 3 + [b"HTTP/1.1 200 OK"]
    assert json.loads(answers[0][1]) == {"error": "missing or wrong bearer token (Authorization: Bearer <token>)"}


async def _timed_exchange(server, request: bytes, read):
    """Send ``request`` as raw bytes on a new connection; (``await read(reader)``, seconds it took)."""
    host, port = server.url[len("http://"):].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    t0 = time.monotonic()
    got = await asyncio.wait_for(read(reader), 5)
    waited = time.monotonic() - t0
    writer.close()
    await writer.wait_closed()
    return got, waited


def test_authentication_comes_before_the_body():
    # A 10 MB Content-Length whose body never comes: the 401 does not wait for it (a 408 would).
    async def run(server):
        return await _timed_exchange(server, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n{",
                                     lambda reader: reader.readline())

    status, waited = with_server(run, token="s3cret", body_timeout_s=3.0)
    assert status.startswith(b"HTTP/1.1 401") and waited < 2


V_BIG = 32000  # ids of 5 digits: a JSON list of them is a realistic 6-7 bytes per token
TABLE_BIG = torch.randn(8, V_BIG, generator=torch.Generator().manual_seed(1))


def big_vocab_logits(tokens: torch.Tensor) -> torch.Tensor:
    return TABLE_BIG[int(tokens[-1]) % 8]


def test_a_list_input_ids_over_the_value_cap_is_a_413_before_parsing():
    """Measured with the server in its own process, this body (9.5 MiB, 1.5M ids): before, it
    was parsed on the event loop -- 200 after 2.54 s, a small request and a 401 each waiting
    2.5 s, +77 MiB peak server RSS (json builds an int object per id); after, 413 in 0.07 s,
    neither waits over 0.05 s, +11 MiB (the body buffer). Here client and server share one
    process and one event loop, so the bounds are looser."""
    if not reset_high_water():
        pytest.skip("cannot reset the RSS high-water mark here")
    rng = random.Random(0)
    params = {"temperature": 1.0, "top_k": 4, "max_new_tokens": 2}
    big = json.dumps({"input_ids": [rng.randrange(V_BIG) for _ in range(1_500_000)], "sampling_params": params}).encode()
    small = json.dumps({"input_ids": [1, 2, 3], "sampling_params": params}).encode()
    auth = b"Authorization: Bearer s3cret\r\n"

    async def run(server):
        await post_bytes(server.url, auth, small)  # warm up the code paths
        reset_high_water()
        base = rss_high_water_kib()
        t0 = time.monotonic()
        big_task = asyncio.create_task(post_bytes(server.url, auth, big, timeout_s=30))
        waits = []
        while not big_task.done() or not waits:  # at least one round while the big body is handled
            t1 = time.monotonic()
            answers = await asyncio.gather(post_bytes(server.url, auth, small), post_bytes(server.url, b"", small))
            waits.append((time.monotonic() - t1, [a[0] for a in answers]))
            await asyncio.sleep(0.01)
        status, body = await big_task
        return status, json.loads(body), time.monotonic() - t0, waits, (rss_high_water_kib() - base) * 1024

    status, reply, answered_in, waits, extra = with_server(
        run, token="s3cret", max_body_bytes=32 << 20, logits=big_vocab_logits, vocab_size=V_BIG)
    assert status == b"HTTP/1.1 413 Request Entity Too Large"
    assert reply["error"] == (
        f"request body holds up to {1_500_000 + 11} JSON values outside array envelopes, over the server's "
        f"max_json_values={MAX_JSON_VALUES} (input_ids as a JSON list is limited to about {MAX_JSON_VALUES} "
        f"tokens); send input_ids as an int32 array, a binary body's part or the envelope "
        f'{{"data": <base64>, "shape": [T], "dtype": "int32"}} in JSON (GenerateClient and wire.dumps of a tensor do), '
        f"which may fill the body limit of {32 << 20} bytes"
    )
    assert all(statuses == [b"HTTP/1.1 200 OK", b"HTTP/1.1 401 Unauthorized"] for _, statuses in waits)
    print(f"413 after {answered_in:.2f} s; small requests waited at most {max(w for w, _ in waits):.3f} s; "
          f"peak extra RSS {extra / 2**20:.0f} MiB for a {len(big) / 2**20:.1f} MiB body")
    assert answered_in < 2 and max(w for w, _ in waits) < 1
    assert extra < 3 * len(big), f"peak extra memory {extra / 2**20:.0f} MiB for a {len(big) / 2**20:.1f} MiB body"


def test_a_list_input_ids_under_the_cap_is_served():
    ids = [(7 * i) % V for i in range(MAX_JSON_VALUES - 16)]
    body = json.dumps({"input_ids": ids, "sampling_params": OK["sampling_params"], "seed": 0}).encode()

    async def run(server):
        return await post_raw(server.url, body)

    status, reply = with_server(run)
    assert status == 200 and reply["finish_reason"] in ("length", "stop")


def test_a_large_body_decodes_off_the_event_loop(monkeypatch):
    # Decoding the big body is held (in whatever thread runs it) until a small request has been
    # answered. On the event loop (before the fix) that could never happen: the hold ran its
    # full 5 s, and the test's own coroutines, on the same loop, stood still with it.
    released, held_for = threading.Event(), []
    real_loads = server_module.loads_body

    def slow_loads(raw, content_type):
        if len(raw) > 1 << 20:
            t0 = time.monotonic()
            released.wait(5)
            held_for.append(time.monotonic() - t0)
        return real_loads(raw, content_type)

    monkeypatch.setattr(server_module, "loads_body", slow_loads)
    big = dumps({"input_ids": torch.randint(0, V, (1_000_000,), dtype=torch.int32), "sampling_params": OK["sampling_params"]})

    async def run(server):
        big_task = asyncio.create_task(post_raw(server.url, big))
        while server.num_active == 0:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # the big body is read and handed to its decoder
        t0 = time.monotonic()
        small = await asyncio.wait_for(post_raw(server.url, edit("seed", 1)), 10)
        small_in = time.monotonic() - t0
        released.set()
        return small[0], small_in, (await big_task)[0]

    small_status, small_in, big_status = with_server(run)
    assert small_status == 200 and big_status == 200
    assert small_in < 1 and held_for and held_for[0] < 4, (small_in, held_for)


def write_token_file(tmp_path, content: bytes, mode: int = 0o600):
    path = tmp_path / "token"
    path.write_bytes(content)
    os.chmod(path, mode)
    return path


def test_token_file_strips_one_newline_and_refuses_what_would_leak_or_lock_out(tmp_path):
    assert read_token_file(write_token_file(tmp_path, b"s3cret\n")) == "s3cret"
    assert read_token_file(write_token_file(tmp_path, b"s3cret\r\n")) == "s3cret"
    assert read_token_file(write_token_file(tmp_path, b"s3cret\n\n")) == "s3cret\n"  # one newline only
    assert read_token_file(write_token_file(tmp_path, b"s3cret", 0o400)) == "s3cret"
    path = tmp_path / "token"
    for content, mode, message in (
        (b"s3cret\n", 0o644, f"token file '{path}' is readable by group or others (mode -rw-r--r--); it holds a "
                             f"password: run `chmod 600 {path}`"),
        (b"s3cret\n", 0o640, f"token file '{path}' is readable by group or others (mode -rw-r-----); it holds a "
                             f"password: run `chmod 600 {path}`"),
        (b"", 0o600, f"token file '{path}' is empty; write the bearer token into it (then `chmod 600 {path}`)"),
        (b"\n", 0o600, f"token file '{path}' is empty; write the bearer token into it (then `chmod 600 {path}`)"),
        (b"\xff\xfe", 0o600, f"token file '{path}' is not UTF-8 text; write the bearer token as text"),
    ):
        with pytest.raises(ValueError) as info:
            read_token_file(write_token_file(tmp_path, content, mode))
        assert str(info.value) == message
    with pytest.raises(ValueError, match=re.escape(f"token file '{tmp_path / 'absent'}': cannot open it (No such file")):
        read_token_file(tmp_path / "absent")


def test_command_line_token_file_and_help(tmp_path, capsys):
    from nemo_replay.cli import _parser, build_server, main

    path = write_token_file(tmp_path, b"from-file\n")
    ns = _parser()[0].parse_args(["serve", "model.vocab_size=32", "model.num_layers=1", "--port", "0",
                                  "--token-file", str(path), "--max-new-tokens-cap", "8"])
    server = build_server(ns.args, ns)

    async def go():
        async with server:
            denied = await post_raw(server.url, edit("input_ids", [1, 2]), {"Authorization": "Bearer from-fil"})
            async with GenerateClient(server.url, token="from-file", vocab_size=32) as client:
                result = await client.generate([1, 2], sampling_params={"temperature": 1.0, "top_k": 4, "max_new_tokens": 3})
            return denied[0], result

    denied, result = asyncio.run(go())
    assert denied == 401 and result.output_ids.numel() == 3

    os.chmod(path, 0o644)
    assert main(["serve", "--token-file", str(path), "--port", "0"]) == 2
    assert f"is readable by group or others (mode -rw-r--r--); it holds a password: run `chmod 600 {path}`" in capsys.readouterr().err
    assert main(["serve", "--token", "x", "--token-file", str(path)]) == 2
    assert "argument --token-file: not allowed with argument --token" in capsys.readouterr().err
    assert main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("Other users of the host see it in the process list (ps): prefer --token-file or "
            f"${TOKEN_ENV}") in text
    assert "--token-file PATH read the bearer token clients must send from PATH" in text


def test_retries_only_what_can_succeed():
    seen = []

    def answer_with(status):
        @web.middleware
        async def mw(request, handler):
            seen.append(status)
            if len(seen) == 1:
                return web.Response(status=status, text="nope", headers={"Retry-After": "0"})
            return await handler(request)

        return mw

    async def attempt(status):
        seen.clear()
        async with GenerateServer(logits_fn, vocab_size=V, middlewares=[answer_with(status)]) as server:
            async with GenerateClient(server.url, backoff_s=0.01) as client:
                try:
                    await client.generate([5], sampling_params=OK["sampling_params"])
                    return "ok", client.num_retries
                except GenerateRequestError as exc:
                    return str(exc), client.num_retries

    for status in (429, 502, 503, 504):
        assert asyncio.run(attempt(status)) == ("ok", 1), status
    for status in (500, 501, 400, 404, 413):
        msg, retries = asyncio.run(attempt(status))
        assert retries == 0 and f"HTTP {status}" in msg and "not retried" in msg, (status, msg)


def test_a_body_that_does_not_arrive_is_dropped():
    async def read_all(reader):
        head = await asyncio.wait_for(reader.read(200), 5)
        return head + await asyncio.wait_for(reader.read(), 5)  # then the server closes the connection

    async def run(server):
        answer, waited = await _timed_exchange(
            server, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{\"in",
            read_all,
        )
        return answer, waited, server.num_active

    answer, waited, active = with_server(run, body_timeout_s=0.3)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.3 s" in answer
    assert 0.2 < waited < 3 and active == 0


def test_a_body_over_the_limit_is_refused():
    async def run(server):
        return await post_raw(server.url, dumps({**OK, "input_ids": torch.zeros(5000, dtype=torch.int32)}))

    status, reply = with_server(run, max_body_bytes=4096)
    assert status == 413 and "4096" in reply["error"]


def test_load_abandoned_requests_stop_and_an_ordinary_one_is_served_promptly():
    steps = {"n": 0}

    def counting_logits(tokens):
        steps["n"] += 1
        return logits_fn(tokens)

    async def go():
        async with GenerateServer(counting_logits, vocab_size=V, max_new_tokens_cap=10**6) as server:
            async with GenerateClient(server.url, backoff_s=0.01, vocab_size=V, timeout_s=30) as client:
                normal = {"temperature": 0.9, "top_k": 6, "max_new_tokens": 8}
                huge = {"temperature": 0.9, "top_k": 6, "max_new_tokens": 10**6}
                ordinary = [asyncio.create_task(client.generate([i % V, 3], sampling_params=normal, seed=i)) for i in range(50)]
                abandoned = [asyncio.create_task(client.generate([7, i], sampling_params=huge, seed=i)) for i in range(6)]
                results = await asyncio.gather(*ordinary)
                await asyncio.sleep(0.2)
                assert server.num_active == 6  # the huge ones are still generating
                for task in abandoned:
                    task.cancel()
                await asyncio.gather(*abandoned, return_exceptions=True)
                t0 = time.monotonic()
                while server.num_active and time.monotonic() - t0 < 5:
                    await asyncio.sleep(0.02)
                stopped_after = time.monotonic() - t0
                before = steps["n"]
                await asyncio.sleep(0.2)
                idle_steps = steps["n"] - before
                t0 = time.monotonic()
                late = await client.generate([1, 2, 3], sampling_params=normal, seed=99)
                served_in = time.monotonic() - t0
                return results, late, server, stopped_after, idle_steps, served_in

    results, late, server, stopped_after, idle_steps, served_in = asyncio.run(go())
    assert all(r.output_ids.numel() == 8 for r in results) and late.output_ids.numel() == 8
    assert server.num_abandoned == 6 and server.num_active == 0
    assert stopped_after < 2 and idle_steps == 0  # nothing generates for a client that left
    assert served_in < 2, f"an ordinary request took {served_in:.2f} s after the load"


def test_full_server_answers_429_and_the_client_retries():
    async def run(server):
        async with GenerateClient(server.url, backoff_s=0.05, max_attempts=40) as client:
            hog = asyncio.create_task(client.generate([7], sampling_params={"temperature": 1.0, "top_k": 4, "max_new_tokens": 10**6}))
            while server.num_active == 0:
                await asyncio.sleep(0.01)
            status, reply = await post_raw(server.url, edit("seed", 5))
            waiting = asyncio.create_task(client.generate([5], sampling_params=OK["sampling_params"]))
            await asyncio.sleep(0.3)
            hog.cancel()
            result = await waiting
            return status, reply, result, client.num_retries

    # No EOS: the hog must still be running when the second request comes (it sampled EOS
    # within 8 steps in 1 of 10 seeds, a race the 429 sometimes lost).
    status, reply, result, retries = with_server(run, max_concurrent=1, max_new_tokens_cap=10**6, eos_id=None)
    assert status == 429 and "retry" in reply["error"] and retries >= 1 and result.output_ids.numel() >= 1


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_memory_per_request_is_a_small_multiple_of_its_body(binary):
    if not reset_high_water():
        pytest.skip("cannot reset the RSS high-water mark here")
    n = 4_000_000  # a 16 MB int32 prompt: about 21 MB of base64 in JSON, 16 MB as a binary part
    body, media_type = dumps_body({"input_ids": torch.randint(0, V, (n,), dtype=torch.int32),
                                   "sampling_params": OK["sampling_params"]}, binary)

    async def run(server):
        await post_raw(server.url, edit("seed", 0))  # warm up the code paths
        reset_high_water()
        base = rss_high_water_kib()
        status, _ = await post_raw(server.url, body, {"Content-Type": media_type})
        return status, (rss_high_water_kib() - base) * 1024

    status, extra = with_server(run, max_body_bytes=32 << 20)
    assert status == 200
    # The test's client shares the process: its allocations count here too. JSON: the body (1x), the
    # decoded int32 prompt (0.75x) and the int64 conversation buffer (1.5x), 3.7x measured; binary: the
    # body (1x), its part copied (1x) and the buffer (2x).
    assert extra < 5 * len(body), f"peak extra memory {extra / 2**20:.0f} MiB for a {len(body) / 2**20:.0f} MiB body"
    print(f"peak extra memory {extra / len(body):.2f}x a {len(body) / 2**20:.1f} MiB {media_type} body")


def test_command_line_server_serves_a_recipe_model_with_a_token():
    from nemo_replay.cli import _parser, build_server

    ns = _parser()[0].parse_args(["serve", "model.vocab_size=32", "model.num_layers=1", "--port", "0", "--token", "abc",
                                  "--max-new-tokens-cap", "8"])
    server = build_server(ns.args, ns)

    async def go():
        async with server:
            denied = await post_raw(server.url, edit("input_ids", [1, 2]))
            async with GenerateClient(server.url, token="abc", vocab_size=32) as client:
                result = await client.generate([1, 2, 3], sampling_params={"temperature": 1.0, "top_k": 4, "max_new_tokens": 5}, seed=0)
            return denied, result

    denied, result = asyncio.run(go())
    assert denied[0] == 401 and result.output_ids.numel() == 5 and int(result.support.row_lengths.max()) <= 4 and result.support.num_rows == 5
    assert server.max_new_tokens_cap == 8 and server.vocab_size == 32
