"""The generate client against the real loopback server: retries, reformatted bodies, traces."""

import asyncio
import json

import pytest
import torch
from aiohttp import web

from nemo_replay import capture
from nemo_replay.rollout.transport.client import GenerateClient, GenerateRequestError
from nemo_replay.rollout.transport.server import GenerateServer
from nemo_replay.rollout.capture.trace import RouteTrace, SupportTrace
from nemo_replay.rollout.transport.binary import BINARY_TYPE, JSON_TYPE, MAGIC, dumps_body, loads_body
from nemo_replay.rollout.transport.wire import WireError

V, EOS, LAYERS, TOPK = 48, 2, 3, 2
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 2


def logits_fn(tokens: torch.Tensor) -> torch.Tensor:
    """A toy causal model: the next-token logits depend on the last token and the length."""
    return TABLE[tokens[-1]] + 0.05 * tokens.numel()


def routes_fn(tokens: torch.Tensor) -> torch.Tensor:
    prefix = torch.cumsum(tokens * 7 + 3, 0)
    base = prefix[:, None, None] + torch.arange(LAYERS)[None, :, None] * 11 + torch.arange(TOPK)[None, None, :] * 3
    return (base % 16).to(torch.int16)


PARAMS = {"temperature": 0.9, "top_k": 6, "top_p": 0.95, "max_new_tokens": 7}


def local_generation(prompt, params, seed):
    """The same loop without a server: what the response must contain."""
    params = dict(params)
    max_new = params.pop("max_new_tokens")
    gen = torch.Generator().manual_seed(seed)
    tokens, ids, lps, rows = torch.tensor(prompt), [], [], []
    for _ in range(max_new):
        r = capture.sample(logits_fn(tokens)[None], generator=gen, **params)
        ids.append(int(r.ids[0])), lps.append(r.logprobs), rows.append(r.support.to_padded().values)
        tokens = torch.cat([tokens, r.ids])
        if ids[-1] == EOS:
            break
    return torch.tensor(ids), torch.cat(lps), torch.cat(rows)


def rows_of(support) -> list:
    """Each row as a sorted list: compact rows travel sorted (support/codec/), the sampler's ranked."""
    if isinstance(support, torch.Tensor):
        return [sorted(t for t in r.tolist() if t >= 0) for r in support]
    return [sorted(support.row(j).tolist()) for j in range(support.num_rows)]


def disturb_first(n_bad: int, how: str):
    state = {"seen": 0}

    @web.middleware
    async def middleware(request, handler):
        resp = await handler(request)
        state["seen"] += 1
        if state["seen"] > n_bad and how != "pretty":
            return resp
        binary = resp.content_type == BINARY_TYPE
        if how == "truncate":
            return web.Response(body=resp.body[: len(resp.body) * 2 // 3], content_type=resp.content_type)
        if how == "corrupt":
            body = bytearray(resp.body)
            if binary:  # the support part's dtype, in the head: uint8 -> uint9
                body[body.index(b'"dtype":"uint8"') + 13] = ord("9")
            else:
                at = body.index(b'"codec":"nrsc-1","data":{"data":"') + 40
                body[at : at + 4] = b"!!!!"
            return web.Response(body=bytes(body), content_type=resp.content_type)
        if how == "overflow":  # an empty array whose strides overflow int64
            shape = b"[0" + b",2147483647" * 5 + b"]"
            if binary:
                head = b'{"output_ids":{"data":0,"shape":' + shape + b',"dtype":"int32"}}'
                return web.Response(body=MAGIC + len(head).to_bytes(4, "little") + head, content_type=BINARY_TYPE)
            return web.Response(body=b'{"output_ids":{"data":"","shape":' + shape + b',"dtype":"int32"}}',
                                content_type="application/json")
        if how == "unavailable":
            return web.Response(status=503, text="warming up")
        if how == "pretty":  # a proxy re-indenting JSON
            return web.Response(body=json.dumps(json.loads(resp.body), indent=2).encode(), content_type="application/json")
        raise AssertionError(how)

    return middleware


async def one_request(how, n_bad, *, max_attempts=4, prompt=(5, 6, 7), binary=True):
    async with GenerateServer(logits_fn, vocab_size=V, routes_fn=routes_fn, eos_id=EOS, middlewares=[disturb_first(n_bad, how)]) as server:
        assert server.url.startswith("http://127.0.0.1:")
        async with GenerateClient(server.url, max_attempts=max_attempts, backoff_s=0.01, vocab_size=V, binary=binary) as client:
            try:
                return await client.generate(list(prompt), sampling_params=PARAMS, routes_start=0, seed=3), client, server
            except GenerateRequestError as exc:
                return exc, client, server


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("how", ["truncate", "corrupt", "unavailable", "overflow"])
def test_client_retries_a_bad_response_then_succeeds(how, binary):
    result, client, server = asyncio.run(one_request(how, 1, binary=binary))
    assert client.num_retries == 1 and server.num_requests == 2
    ids, lps, rows = local_generation([5, 6, 7], PARAMS, 3)
    assert torch.equal(result.output_ids, ids)
    torch.testing.assert_close(result.logprobs, lps, rtol=0, atol=0)
    assert rows_of(result.support) == rows_of(rows) and result.support.cu_seqlens.tolist() == [0, ids.numel()]
    forwarded = torch.cat([torch.tensor([5, 6, 7]), ids])[:-1]
    assert result.routes_start == 0 and torch.equal(result.routes, routes_fn(forwarded))


def test_reformatted_response_parses():
    result, client, _ = asyncio.run(one_request("pretty", 0, binary=False))  # a JSON client: what a proxy may re-indent
    assert client.num_retries == 0
    ids, _, rows = local_generation([5, 6, 7], PARAMS, 3)
    assert torch.equal(result.output_ids, ids) and rows_of(result.support) == rows_of(rows)


def test_ragged_support_travels_as_one_segment():
    params = {"temperature": 0.9, "top_p": 0.8, "max_new_tokens": 6}  # no top_k: CSR rows

    async def go():
        async with GenerateServer(logits_fn, vocab_size=V, eos_id=EOS) as server:
            async with GenerateClient(server.url, vocab_size=V) as client:
                return await client.generate([5, 6, 7], sampling_params=params, seed=4)

    result = asyncio.run(go())
    gen, tokens, rows = torch.Generator().manual_seed(4), torch.tensor([5, 6, 7]), []
    for tok in result.output_ids.tolist():
        r = capture.sample(logits_fn(tokens)[None], generator=gen, temperature=0.9, top_p=0.8)
        assert int(r.ids[0]) == tok
        rows.append(r.support.row(0).tolist())
        tokens = torch.cat([tokens, r.ids])
    n = len(rows)
    assert result.support.cu_seqlens.tolist() == [0, n]
    assert rows_of(result.support) == [sorted(r) for r in rows] and len({len(r) for r in rows}) > 1


def test_client_gives_up_after_max_attempts():
    exc, client, server = asyncio.run(one_request("truncate", 10, max_attempts=3))
    assert isinstance(exc, GenerateRequestError) and "all 3 attempts failed" in str(exc)
    assert isinstance(exc.__cause__, WireError)
    assert client.num_retries == 2 and server.num_requests == 3


def test_client_does_not_retry_a_refused_request():
    async def run():
        async with GenerateServer(logits_fn, vocab_size=V, eos_id=EOS) as server:
            async with GenerateClient(server.url, backoff_s=0.01) as client:
                with pytest.raises(GenerateRequestError, match="HTTP 400.*temperature"):
                    await client.generate([1, 2], sampling_params={"temperature": 0.0, "top_k": 4})
                return client.num_retries, server.num_requests

    assert asyncio.run(run()) == (0, 1)


def test_server_binds_loopback_only():
    with pytest.raises(ValueError, match="loopback"):
        GenerateServer(logits_fn, vocab_size=V, host="0.0.0.0")


def test_multi_turn_rollout_over_loopback_traces_support_and_routes():
    prompt = [9, 10, 11, 12]
    observations = [[20, 21], [22, 23, 24]]

    async def run():
        support, routes = SupportTrace(top_k=PARAMS["top_k"], eos_id=EOS, vocab_size=V), RouteTrace(num_layers=LAYERS, topk=TOPK, dtype=torch.int16)
        conversation = list(prompt)
        routes.add_tokens(len(prompt))
        starts = []
        async with GenerateServer(logits_fn, vocab_size=V, routes_fn=routes_fn, eos_id=EOS) as server:
            async with GenerateClient(server.url, backoff_s=0.01, vocab_size=V) as client:
                for t in range(3):
                    start = routes.request_start
                    starts.append(start)
                    res = await client.generate(conversation, sampling_params=PARAMS, routes_start=start, seed=t)
                    support.add_turn(res.output_ids, res.support)
                    routes.add_request(res.routes, start=res.routes_start, num_generated=res.output_ids.numel())
                    conversation += res.output_ids.tolist()
                    if t < 2:
                        support.add_observation(observations[t])
                        routes.add_tokens(len(observations[t]))
                        conversation += observations[t]
        return support, routes, conversation, starts

    support, routes, conversation, starts = asyncio.run(run())
    response = conversation[len(prompt) :]
    support.check_response(response)
    assert support.num_rows == len(response)
    assert starts[0] == 0 and starts[1] < starts[2] < len(conversation)  # each request asks only for a suffix
    out = routes.finish(support.loss_mask)
    full = routes_fn(torch.tensor(conversation))
    assert torch.equal(out[:-1], full[:-1]) and (out[-1] == -1).all()


def test_uint8_routes_travel_through_the_client():
    # Engines narrow MoE routes to uint8; every wire check widens before comparing with -1.
    def uint8_routes(tokens):
        return routes_fn(tokens).to(torch.uint8)

    async def go():
        async with GenerateServer(logits_fn, vocab_size=V, routes_fn=uint8_routes, eos_id=EOS) as server:
            async with GenerateClient(server.url, vocab_size=V) as client:
                return await client.generate([5, 6, 7], sampling_params=PARAMS, routes_start=1, seed=3)

    result = asyncio.run(go())
    forwarded = torch.cat([torch.tensor([5, 6, 7]), result.output_ids])[:-1]
    assert result.routes.dtype == torch.uint8 and torch.equal(result.routes, uint8_routes(forwarded)[1:])


def test_a_response_that_fails_validation_is_not_retried():
    @web.middleware
    async def misalign(request, handler):  # a server bug: the support of another response
        resp = await handler(request)
        body = loads_body(resp.body, resp.content_type)
        body["output_ids"], body["logprobs"] = torch.tensor([1]), torch.zeros(1)
        data, media_type = dumps_body(body, resp.content_type == BINARY_TYPE)
        return web.Response(body=data, content_type=media_type)

    async def go():
        async with GenerateServer(logits_fn, vocab_size=V, middlewares=[misalign]) as server:
            async with GenerateClient(server.url, backoff_s=0.01) as client:
                with pytest.raises(GenerateRequestError, match="failed validation \\(not retried\\)"):
                    await client.generate([5], sampling_params={**PARAMS, "max_new_tokens": 3}, seed=0)
                return client.num_retries, server.num_requests

    assert asyncio.run(go()) == (0, 1)


@pytest.mark.parametrize("fault, match", [
    ("nan", r"'logprobs' at generated token 1 is nan; a sampled token's log-prob is finite and <= 0"),
    ("inf", r"'logprobs' at generated token 1 is inf"),
    ("positive", r"'logprobs' at generated token 1 is 0.5"),
    ("empty_row", r"the support row of generated token 1 \(id \d+\) is empty; every generated token comes with the row"),
])
def test_the_client_applies_the_adapters_value_checks(fault, match):
    """The engine adapters refuse these values; the wire client returned them as a rollout."""
    @web.middleware
    async def spoil(request, handler):
        resp = await handler(request)
        body = loads_body(resp.body, resp.content_type)
        if fault == "empty_row":  # rows coded without their sampled ids: an empty row can be sent
            from nemo_replay.rollout.transport.wire import support_from_wire, support_to_wire
            from nemo_replay.support.ragged import RaggedSupport

            got = support_from_wire(body["support"], sampled_ids=body["output_ids"])
            rows = [got.row(j).tolist() for j in range(got.num_rows)]
            rows[1] = []
            body["support"] = support_to_wire(RaggedSupport.from_rows([rows]), vocab_size=V)
        else:
            body["logprobs"] = body["logprobs"].clone()
            body["logprobs"][1] = {"nan": float("nan"), "inf": float("inf"), "positive": 0.5}[fault]
        data, media_type = dumps_body(body, resp.content_type == BINARY_TYPE)
        return web.Response(body=data, content_type=media_type)

    async def go():
        async with GenerateServer(logits_fn, vocab_size=V, middlewares=[spoil]) as server:
            async with GenerateClient(server.url, backoff_s=0.01) as client:
                with pytest.raises(GenerateRequestError, match="failed validation") as err:
                    await client.generate([5], sampling_params={**PARAMS, "max_new_tokens": 3}, seed=0)
                return err.value, client.num_retries

    err, retries = asyncio.run(go())
    assert retries == 0 and isinstance(err.__cause__, WireError) and __import__("re").search(match, str(err.__cause__)), err.__cause__


def media_types(seen: list, *, old_server: bool = False, refuse_binary: bool = False):
    """Notes (request type, answer type) of each request. ``old_server``: the server as it was before
    binary bodies, which read every body as JSON and answered JSON whatever the Accept header named;
    ``refuse_binary``: a server that answers a binary body 415 (one that no longer reads this form)."""

    @web.middleware
    async def middleware(request, handler):
        sent = request.content_type
        if sent == BINARY_TYPE and (old_server or refuse_binary):
            status, error = (400, "wire decode: body is not valid JSON") if old_server else (415, "format not read")
            resp = web.json_response({"error": error}, status=status)
        else:
            if old_server:
                request = request.clone(headers={k: v for k, v in request.headers.items() if k.lower() != "accept"})
            resp = await handler(request)
        seen.append((sent, resp.content_type))
        return resp

    return middleware


async def three_requests(middleware, **client_kwargs):
    async with GenerateServer(logits_fn, vocab_size=V, eos_id=EOS, middlewares=[middleware]) as server:
        async with GenerateClient(server.url, vocab_size=V, backoff_s=0.01, **client_kwargs) as client:
            results = [await client.generate([5, 6, 7], sampling_params=PARAMS, seed=seed) for seed in (3, 4, 5)]
            return results, client


def assert_generated(results):
    for result, seed in zip(results, (3, 4, 5)):
        ids, lps, rows = local_generation([5, 6, 7], PARAMS, seed)
        assert torch.equal(result.output_ids, ids) and torch.equal(result.logprobs.view(torch.int32), lps.view(torch.int32))
        assert rows_of(result.support) == rows_of(rows)


def test_binary_both_ways_once_the_server_has_answered_binary():
    seen = []
    results, client = asyncio.run(three_requests(media_types(seen)))
    assert seen == [(JSON_TYPE, BINARY_TYPE)] + [(BINARY_TYPE, BINARY_TYPE)] * 2  # the first request cannot know
    assert client.binary_requests is True and client.num_retries == 0
    assert_generated(results)


def test_a_json_client_sends_and_reads_json():
    seen = []
    results, client = asyncio.run(three_requests(media_types(seen), binary=False))
    assert seen == [(JSON_TYPE, JSON_TYPE)] * 3 and client.num_retries == 0
    assert_generated(results)


def test_a_new_client_against_an_old_server_sends_and_reads_json():
    seen = []
    results, client = asyncio.run(three_requests(media_types(seen, old_server=True)))
    assert seen == [(JSON_TYPE, JSON_TYPE)] * 3 and client.binary_requests is None and client.num_retries == 0
    assert_generated(results)


def test_a_415_to_a_binary_request_sends_it_again_as_json_at_once_and_for_good():
    seen = []
    results, client = asyncio.run(three_requests(media_types(seen, refuse_binary=True)))
    assert seen == [(JSON_TYPE, BINARY_TYPE), (BINARY_TYPE, JSON_TYPE), (JSON_TYPE, BINARY_TYPE), (JSON_TYPE, BINARY_TYPE)]
    assert client.binary_requests is False and client.num_retries == 0
    assert_generated(results)
