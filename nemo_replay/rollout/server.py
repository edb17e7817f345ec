"""A small generate endpoint on loopback that serves captured support and routes.

It runs a torch next-token model through :func:`nemo_replay.capture.sample` and answers
the request/response schema of :mod:`nemo_replay.rollout.client`. It is the reference
endpoint for tests and single-host generation: it binds loopback addresses only.

    async with GenerateServer(logits_fn, routes_fn=routes_fn, eos_id=2) as server:
        async with GenerateClient(server.url) as client:
            result = await client.generate([1, 5, 9], sampling_params={"temperature": 1.0, "top_k": 8})

``logits_fn(token_ids)`` gets the conversation so far, ``(T,) int64``, and returns the
next-token logits ``(V,)`` float. ``routes_fn(token_ids)`` returns the routes
``(T, layers, topk)`` int the model's forward would take over those tokens.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Callable, Optional, Sequence, Union

import torch
from aiohttp import web

from nemo_replay.rollout.capture import sample
from nemo_replay.rollout.wire import WireError, dumps, loads, support_to_wire
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["GenerateServer"]

_SAMPLING_KEYS = {"temperature", "top_k", "top_p", "min_p", "max_new_tokens"}


def _join_supports(parts: list) -> Union[PackedTensor, RaggedSupport]:
    """Per-step one-row supports -> one segment of n rows."""
    steps = type(parts[0]).cat(parts)  # n segments of one row each
    one_segment = torch.tensor([0, steps.num_rows], dtype=torch.int32)
    if isinstance(steps, PackedTensor):
        return PackedTensor(steps.values, one_segment)
    return RaggedSupport(steps.member_ids, steps.row_offsets, one_segment)


class GenerateServer:
    """aiohttp ``POST /generate`` over a next-token model.

    Args:
        logits_fn: ``(T,) int64 -> (V,) float`` next-token logits.
        routes_fn: optional ``(T,) int64 -> (T, layers, topk) int`` routes.
        eos_id: generation stops after sampling it (finish_reason ``"stop"``).
        host: a loopback address.
        port: 0 picks a free port at start.
        middlewares: aiohttp middlewares (tests use them to disturb responses).
    """

    def __init__(
        self,
        logits_fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        routes_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        eos_id: Optional[int] = None,
        host: str = "127.0.0.1",
        port: int = 0,
        middlewares: Sequence = (),
    ):
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"GenerateServer: host={host!r} is not a loopback address; use 127.0.0.1 or ::1")
        self.logits_fn = logits_fn
        self.routes_fn = routes_fn
        self.eos_id = eos_id
        self.host, self.port = host, port
        self._app = web.Application(middlewares=list(middlewares), client_max_size=1 << 30)
        self._app.router.add_post("/generate", self._handle)
        self._runner: Optional[web.AppRunner] = None
        self.url: Optional[str] = None
        self.num_requests = 0

    async def start(self) -> str:
        self._runner = web.AppRunner(self._app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> "GenerateServer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _handle(self, request: web.Request) -> web.Response:
        self.num_requests += 1
        try:
            body = loads(await request.read())
            reply = await asyncio.to_thread(self._generate, body)
        except (WireError, ValueError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.Response(body=dumps(reply), content_type="application/json")

    def _generate(self, body: dict) -> dict:
        """Run one request (schema: :mod:`nemo_replay.rollout.client`)."""
        if not isinstance(body, dict) or not isinstance(body.get("input_ids"), list) or not body["input_ids"]:
            raise ValueError("request needs a non-empty 'input_ids' list")
        params = dict(body.get("sampling_params") or {})
        unknown = set(params) - _SAMPLING_KEYS
        if unknown:
            raise ValueError(f"unknown sampling params {sorted(unknown)}; this endpoint takes {sorted(_SAMPLING_KEYS)}")
        max_new = int(params.pop("max_new_tokens", 16))
        if max_new < 1:
            raise ValueError(f"max_new_tokens={max_new}: expected >= 1")
        seed = body.get("seed")
        gen = torch.Generator().manual_seed(int(seed)) if seed is not None else None
        tokens = torch.tensor(body["input_ids"], dtype=torch.int64)
        prompt_len = tokens.numel()
        out_ids, out_lps, parts = [], [], []
        finish = "length"
        for _ in range(max_new):
            logits = self.logits_fn(tokens)
            res = sample(logits.reshape(1, -1), generator=gen, **params)
            tok = int(res.ids[0])
            out_ids.append(tok)
            out_lps.append(res.logprobs)
            parts.append(res.support)
            tokens = torch.cat([tokens, res.ids])
            if self.eos_id is not None and tok == self.eos_id:
                finish = "stop"
                break
        reply = {
            "output_ids": torch.tensor(out_ids, dtype=torch.int64),
            "logprobs": torch.cat(out_lps),
            "support": support_to_wire(_join_supports(parts)),
            "finish_reason": finish,
            "routes": None,
            "routes_start": None,
        }
        start = body.get("routes_start")
        if start is not None and self.routes_fn is not None:
            # The forward ran over every token but the last sampled one.
            forwarded = tokens[:-1]
            if not 0 <= int(start) <= prompt_len:
                raise ValueError(f"routes_start={start} must lie in [0, {prompt_len}] (the prompt)")
            reply["routes"] = self.routes_fn(forwarded)[int(start) :]
            reply["routes_start"] = int(start)
        return reply
