"""The loopback generate server, hardened: validation, auth, slow bodies, disconnects, load."""

import asyncio
import json
import re
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from nemo_replay.rollout.client import GenerateClient, GenerateRequestError
from nemo_replay.rollout.server import TOKEN_ENV, GenerateServer
from nemo_replay.rollout.wire import dumps

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


def with_server(coro_fn, **kwargs):
    async def go():
        async with GenerateServer(logits_fn, vocab_size=V, eos_id=EOS, **kwargs) as server:
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
]


def test_every_bad_field_is_a_400_naming_it():
    async def run(server):
        return [await post_raw(server.url, body) for body, _ in BAD] + [await post_raw(server.url, edit("seed", 4))]

    answers = with_server(run, max_new_tokens_cap=64)
    for (status, reply), (body, match) in zip(answers, BAD):
        assert status == 400, (body[:80], status, reply)
        assert re.search(match, reply["error"]), (reply["error"], match)
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
    async def run(server):
        host, port = server.url[len("http://"):].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{\"in")
        await writer.drain()
        t0 = time.monotonic()
        head = await asyncio.wait_for(reader.read(200), 5)
        rest = await asyncio.wait_for(reader.read(), 5)  # then the server closes the connection
        writer.close()
        return head + rest, time.monotonic() - t0, server.num_active

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

    status, reply, result, retries = with_server(run, max_concurrent=1, max_new_tokens_cap=10**6)
    assert status == 429 and "retry" in reply["error"] and retries >= 1 and result.output_ids.numel() >= 1


def _rss_high_water_kib():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))


def _reset_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def test_memory_per_request_is_a_small_multiple_of_its_body():
    if not _reset_high_water():
        pytest.skip("cannot reset the RSS high-water mark here")
    n = 4_000_000  # a 16 MB int32 prompt: about 21 MB of base64 on the wire
    body = dumps({"input_ids": torch.randint(0, V, (n,), dtype=torch.int32), "sampling_params": OK["sampling_params"]})

    async def run(server):
        await post_raw(server.url, edit("seed", 0))  # warm up the code paths
        _reset_high_water()
        base = _rss_high_water_kib()
        status, _ = await post_raw(server.url, body)
        return status, (_rss_high_water_kib() - base) * 1024

    status, extra = with_server(run, max_body_bytes=32 << 20)
    assert status == 200
    # The test's client shares the process: its allocations count here too.
    # The body (1x), the decoded int32 prompt (0.75x) and the int64 conversation buffer (1.5x): 3.7x measured.
    assert extra < 5 * len(body), f"peak extra memory {extra / 2**20:.0f} MiB for a {len(body) / 2**20:.0f} MiB body"


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
    assert denied[0] == 401 and result.output_ids.numel() == 5 and result.support.values.shape == (5, 4)
    assert server.max_new_tokens_cap == 8 and server.vocab_size == 32
