"""The loopback generate server's connections: idle and header-trickling ones closed, a cap on
open ones, bodies that reserve nothing, the model's context, the descriptor limit."""

import asyncio
import json
import os
import time

import pytest

from nemo_replay.rollout.transport.client import GenerateClient
from tests.rollout.transport.test_server import OK, post_raw, with_server


# ---------------------------------------------------------------------------- connections


async def _open(server, n: int) -> list:
    host, port = server.url.rsplit("/", 1)[-1].rsplit(":", 1)
    return [await asyncio.open_connection(host, int(port)) for _ in range(n)]


async def _closed(reader, within: float) -> bool:
    """True when the server closed the connection within ``within`` seconds (bounded wait)."""
    try:
        return await asyncio.wait_for(reader.read(), within) is not None
    except asyncio.TimeoutError:
        return False


def test_idle_and_header_trickling_connections_are_closed_and_real_requests_still_served():
    """aiohttp kept an idle or header-trickling connection for its default 3630 s; at the
    descriptor limit every real request then timed out. A connection outside a request for
    idle_timeout_s is closed now, however slowly it dribbles its headers."""
    async def trickle(writer, stop):
        head = b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        for byte in head:  # one byte each 50 ms: 10 s for the whole header, were it allowed
            if stop.is_set() or writer.is_closing():
                return
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)

    async def run(server):
        idle = await _open(server, 3)
        slow = await _open(server, 2)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(trickle(w, stop)) for _, w in slow]
        start = time.monotonic()
        closed = await asyncio.gather(*(_closed(r, 5) for r, _ in idle + slow))
        waited = time.monotonic() - start
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        status, reply = await post_raw(server.url, json.dumps(OK).encode())  # a real request, after them
        for _, w in idle + slow:
            w.close()
        return closed, waited, status

    closed, waited, status = with_server(run, idle_timeout_s=0.5)
    assert closed == [True] * 5 and waited < 3, (closed, waited)
    assert status == 200


def test_connections_past_the_cap_get_503_at_once_and_the_client_retries_through():
    async def run(server):
        held = await _open(server, 4)
        (reader, writer), = await _open(server, 1)
        answer = await asyncio.wait_for(reader.read(), 5)  # the surplus: answered and closed, not queued
        writer.close()
        async def release():
            await asyncio.sleep(0.3)
            for _, w in held:
                w.close()
        releasing = asyncio.create_task(release())
        async with GenerateClient(server.url, backoff_s=0.2, max_attempts=6) as client:
            result = await client.generate([5, 6], sampling_params={"temperature": 1.0, "top_k": 4, "max_new_tokens": 2}, seed=0)
            retries = client.num_retries
        await releasing
        return answer, retries, result.output_ids.numel(), server.num_refused_connections

    answer, retries, n, refused = with_server(run, max_connections=4, idle_timeout_s=30)
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable") and b"Retry-After: 1" in answer
    assert retries >= 1 and n == 2 and refused >= 2  # the raw surplus and the client's first attempt


def test_a_declared_content_length_reserves_no_memory():
    """Twelve one-byte requests each declaring 16 MiB once held 190 MB; the body now grows as it arrives."""
    import tracemalloc

    async def run(server):
        conns = await _open(server, 12)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for _, w in conns:
            w.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 16777000\r\n\r\n{")
        await asyncio.sleep(0.5)
        grown = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
        for _, w in conns:
            w.close()
        return grown, server.num_active

    grown, active = with_server(run, body_timeout_s=5)
    assert active == 12  # all twelve are inside a request, waiting for their bodies
    assert grown < 4 << 20, grown  # not 12 x 16 MiB


def test_a_prompt_past_the_models_context_is_a_400():
    async def run(server):
        fits = await post_raw(server.url, json.dumps({**OK, "input_ids": [5, 6, 7, 8]}).encode())
        past = await post_raw(server.url, json.dumps({**OK, "input_ids": [5, 6, 7, 8, 9]}).encode())
        return fits, past

    (ok, _), (status, reply) = with_server(run, max_context_tokens=8)
    assert ok == 200 and status == 400
    assert reply["error"] == ("input_ids: 5 tokens plus sampling_params.max_new_tokens=4 exceed the model's context of 8 "
                              "tokens; send at most 4 prompt tokens or lower max_new_tokens")


def test_a_cap_past_the_descriptor_limit_is_refused_at_start():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    with pytest.raises(ValueError, match=rf"max_connections={soft} plus 64 descriptors .* exceed its descriptor limit of {soft}"):
        with_server(lambda server: asyncio.sleep(0), max_connections=soft)


_EMFILE_SCRIPT = r"""
import asyncio, logging, resource, socket, sys, time
import torch
from nemo_replay.rollout.transport.server import GenerateServer
logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
resource.setrlimit(resource.RLIMIT_NOFILE, (160, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

async def main():
    server = GenerateServer(lambda t: torch.zeros(8), vocab_size=8, max_connections=80, idle_timeout_s=60)
    await server.start()
    port = int(server.url.rsplit(":", 1)[1])
    held = []
    while True:  # the client side of this process takes every descriptor left
        try:
            s = socket.socket(); s.setblocking(False)
        except OSError:
            break
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        held.append(s)
        await asyncio.sleep(0)
    await asyncio.sleep(3.0)  # the server's accept() meets EMFILE meanwhile
    for s in held:
        s.close()
    print("held", len(held), "refused", server.num_refused_connections, flush=True)
    await server.stop()

asyncio.run(main())
"""


def test_accept_out_of_descriptors_is_logged_once_per_interval():
    """At the descriptor limit the event loop reports every failed accept(); the report is logged
    once per RESOURCE_LOG_INTERVAL_S (10 s) with a count, not in a loop (asyncio's
    selector_events.py, _accept_connection, reports EMFILE through the loop's exception handler)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EMFILE_SCRIPT], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    reports = [line for line in lines if "accept() failed for want of file descriptors" in line]
    assert len(reports) <= 1 and len(lines) <= 3, proc.stderr[-3000:]
    assert "held" in proc.stdout
