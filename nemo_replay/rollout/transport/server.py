"""A small generate endpoint on loopback that serves captured support and routes.

It runs a torch next-token model through :func:`nemo_replay.capture.sample` and answers
the request/response schema of :mod:`nemo_replay.rollout.transport.client`. It is the reference
endpoint for tests and single-host generation: it binds loopback addresses only. It reads a
request body by its ``Content-Type`` (:data:`~.binary.BINARY_TYPE`: the binary form; any other:
JSON) and answers binary when ``Accept`` names that type, JSON otherwise (docs/transport.md).

    async with GenerateServer(logits_fn, vocab_size=V, routes_fn=routes_fn, eos_id=2) as server:
        async with GenerateClient(server.url) as client:
            result = await client.generate([1, 5, 9], sampling_params={"temperature": 1.0, "top_k": 8})

``logits_fn(token_ids)`` gets the conversation so far, ``(T,) int64``, and returns the
next-token logits ``(V,)`` float. ``routes_fn(token_ids)`` returns the routes
``(T, layers, topk)`` int the model's forward would take over those tokens.

From the command line, serving the policy of a recipe (``model.pretrained=<path>`` for a
checkpoint; otherwise the recipe's model built from its sizes)::

    NEMO_REPLAY_GENERATE_TOKEN=SECRET nemo-replay serve [CONFIG] [key=value ...] --port 8000
    nemo-replay serve [CONFIG] --port 8000 --token-file ~/.nemo_replay_token    # chmod 600

(``--token SECRET`` works too, but the process list shows it to every user of the host.)

Hardening, in the order a request meets it:

0. **Connections**: at most ``max_connections`` open at once; the next one is answered 503
   with ``Retry-After`` and closed at once (the client retries it), never queued. A
   connection that is outside a request for ``idle_timeout_s`` -- idle between keep-alive
   requests, or still sending its request line and headers -- is closed: holding a
   descriptor costs a peer nothing, and at the process's descriptor limit every real
   request would wait. ``max_connections`` must leave descriptors under that limit
   (checked at start). Should ``accept()`` still run out of descriptors, the event loop's
   report is logged once per :data:`RESOURCE_LOG_INTERVAL_S` with the count since.
1. **Auth** (optional): with a token (``token=``, ``--token-file``, ``--token`` or the
   environment variable ``NEMO_REPLAY_GENERATE_TOKEN``) every request needs
   ``Authorization: Bearer <token>``, its raw header bytes compared in constant time
   (``hmac.compare_digest``); otherwise 401 -- a header that is not UTF-8 or appears twice
   included. Nothing of the body is read before this.
2. **Admission**: at most ``max_concurrent`` requests run; the next one gets 429 with
   ``Retry-After`` (the client retries it).
3. **Body**: at most ``max_body_bytes`` (413 beyond, a declared Content-Length before any
   byte is read), grown as its bytes arrive (a declared size reserves nothing), and it must
   arrive within ``body_timeout_s`` (408 and the connection closed).
4. **Decoding**, in a worker thread for bodies over 64 KiB, so the event loop keeps
   answering other requests. ``json`` turns every value into a Python object (a JSON-list
   ``input_ids`` took 8x its bytes of server memory, measured), so a body (a binary body's
   head) may hold at most ``max_json_values`` JSON values outside its array envelopes
   (:data:`MAX_JSON_VALUES`, 65,536: a list-form ``input_ids`` of about 65,000 tokens),
   counted from its separators before it is parsed; past that a 413 names the limit and the
   array forms, which decode straight into their buffers (``GenerateClient`` sends
   ``input_ids`` as an int32 array) and are bounded only by ``max_body_bytes`` (16 MiB:
   about 3 million tokens as base64, 4 million as a binary part). A binary body's framing
   is checked before anything is allocated: another version of it is a 415, a head or part
   past the body's end or bytes after the last part a 400 naming it. Memory per request is
   then a small multiple of its body: the body, its decoded arrays (at most 3/4 of a JSON
   body, all of a binary one) and the int64 conversation buffer -- 2.9-3.7x the body for a
   long prompt, measured -- plus the generated rows, at most ``max_new_tokens_cap`` of them.
   (The thread holds the GIL inside ``json`` and base64 calls; the value cap and the wire's
   4 MiB base64 chunks keep each such call to milliseconds.)
5. **Validation**: every field is checked before use -- no unknown keys; ``input_ids`` ints
   in ``[0, vocab_size)`` (a list of ints or an integer array; ``1.5`` or ``true`` is an
   error, never coerced); ``sampling_params`` a mapping with known keys and typed values
   (``top_k`` at most ``vocab_size``: rows are ``top_k`` wide);
   ``max_new_tokens`` an int in ``[1, max_new_tokens_cap]``; the prompt plus
   ``max_new_tokens`` at most ``max_context_tokens`` (the model's context: past it the
   positions have no embedding, and without a KV cache a long prompt holds a worker for
   hours); ``routes_start`` an int in the prompt; ``seed`` an int. A bad field is a 400
   naming it, never a 500.
6. **Generation** runs one step at a time in a worker thread and stops as soon as the client
   has gone (its connection closed), so an abandoned request holds no thread or memory.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import resource
import stat
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from aiohttp import web

from nemo_replay.rollout.capture.sampler import TIE_RULES, check_capture_settings, sample
from nemo_replay.rollout.transport.binary import (
    BINARY_TYPE,
    UnsupportedVersion,
    accepts_binary,
    dumps_body,
    head_of,
    loads_body,
)
from nemo_replay.rollout.transport.wire import support_to_wire
from nemo_replay.support.dtypes import first_outside, is_integer
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport

__all__ = [
    "GenerateServer",
    "GenerateRequest",
    "parse_request",
    "response_body",
    "read_token_file",
    "TOKEN_ENV",
    "MAX_JSON_VALUES",
    "RESOURCE_LOG_INTERVAL_S",
    "serve_until_cancelled",
]

logger = logging.getLogger(__name__)

#: The environment variable holding the bearer token (server and client).
TOKEN_ENV = "NEMO_REPLAY_GENERATE_TOKEN"

#: Default ``max_json_values``: the most JSON values a body may hold outside its array
#: envelopes -- about the longest ``input_ids`` the JSON-list form may carry (module doc, 4).
MAX_JSON_VALUES = 1 << 16

#: Seconds between two log lines of the event loop's "out of descriptors" report (module doc, 0).
RESOURCE_LOG_INTERVAL_S = 10.0
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_ACCEPT_RETRY_S = 1.0  # asyncio's constants.ACCEPT_RETRY_DELAY: a failed accept() is retried after it
_DESCRIPTOR_MARGIN = 64  # descriptors the process keeps beyond its connections (files, pipes, the listener)

_INLINE_DECODE_BYTES = 64 << 10  # bodies up to this decode on the event loop (well under 1 ms)
_FIELDS = {"input_ids", "sampling_params", "routes_start", "seed"}
_SAMPLING_KEYS = {"temperature", "top_k", "top_p", "min_p", "ties", "max_new_tokens"}


def _strict_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}={value!r}: expected an int ({type(value).__name__} is not coerced)")
    return value


@dataclass
class GenerateRequest:
    """A validated request (schema: :mod:`nemo_replay.rollout.transport.client`)."""

    input_ids: Optional[torch.Tensor]  # (T,) integer, every id in [0, vocab_size); released once copied
    sampling: dict  # keyword arguments of capture.sample
    max_new_tokens: int
    routes_start: Optional[int]
    seed: Optional[int]


def _input_ids(value: Any, vocab_size: int) -> torch.Tensor:
    """(T,) integer ids, checked; an array keeps its wire dtype (no widened copy)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or not is_integer(value):
            raise ValueError(f"input_ids: expected a 1-D integer array, got {value.dtype} {list(value.shape)}")
        ids = value
    elif isinstance(value, list):
        for i, t in enumerate(value):  # range-checked as Python ints: 2**64 never reaches torch's int64 conversion
            if not 0 <= _strict_int(t, f"input_ids[{i}]") < vocab_size:
                raise ValueError(f"input_ids[{i}]={t}: token ids must lie in [0, {vocab_size})")
        ids = torch.tensor(value, dtype=torch.int64)
    else:
        raise ValueError(f"input_ids: expected a list of token ids, got {type(value).__name__}")
    if ids.numel() == 0:
        raise ValueError("input_ids: empty; send the conversation so far (at least one token)")
    i = first_outside(ids, vocab_size)
    if i is not None:
        raise ValueError(f"input_ids[{i}]={int(ids[i])}: token ids must lie in [0, {vocab_size})")
    return ids


def _sampling(value: Any, cap: int, vocab_size: int) -> tuple[dict, int]:
    if not isinstance(value, dict):
        raise ValueError(
            f"sampling_params: expected an object with temperature (and top_k, top_p, min_p, ties, max_new_tokens), "
            f"got {type(value).__name__}"
        )
    unknown = sorted(set(value) - _SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"sampling_params: unknown keys {unknown}; this endpoint takes {sorted(_SAMPLING_KEYS)}")
    params = dict(value)
    max_new = _strict_int(params.pop("max_new_tokens", 16), "sampling_params.max_new_tokens")
    if not 1 <= max_new <= cap:
        raise ValueError(f"sampling_params.max_new_tokens={max_new}: expected an int in [1, {cap}] (the server's cap)")
    ties = params.setdefault("ties", "index_order")
    if not isinstance(ties, str) or ties not in TIE_RULES:
        raise ValueError(f"sampling_params.ties={ties!r}: expected one of {sorted(TIE_RULES)}")
    for key in ("top_p", "min_p"):
        if key in params and params[key] is None:
            raise ValueError(f"sampling_params.{key}=None: send a number or leave the key out")
    top_k = params.get("top_k")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > vocab_size:
        # Fixed-width rows are top_k wide: top_k=10**8 would allocate and send 400 MB per token.
        raise ValueError(
            f"sampling_params.top_k={top_k}: expected at most the vocabulary size {vocab_size}; leave it out for no "
            f"top-k bound"
        )
    check_capture_settings(
        temperature=params.get("temperature"),
        top_k=params.get("top_k"),
        top_p=params.get("top_p", 1.0),
        min_p=params.get("min_p", 0.0),
        where="sampling_params",
        prefix="sampling_params.",
    )
    return params, max_new


def parse_request(body: Any, *, vocab_size: int, max_new_tokens_cap: int,
                  max_context_tokens: Optional[int] = None) -> GenerateRequest:
    """Validate a decoded request body; every problem is a ``ValueError`` naming its field.

    ``max_context_tokens``: the model's context; the prompt plus ``max_new_tokens`` must fit (None: unchecked).
    """
    if not isinstance(body, dict):
        raise ValueError(f"request body: expected a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise ValueError(f"request body: unknown fields {unknown}; expected {sorted(_FIELDS)}")
    if "input_ids" not in body:
        raise ValueError("input_ids: missing; send the conversation so far as token ids")
    ids = _input_ids(body["input_ids"], vocab_size)
    sampling, max_new = _sampling(body.get("sampling_params"), max_new_tokens_cap, vocab_size)
    if max_context_tokens is not None and ids.numel() + max_new > max_context_tokens:
        raise ValueError(
            f"input_ids: {ids.numel()} tokens plus sampling_params.max_new_tokens={max_new} exceed the model's context "
            f"of {max_context_tokens} tokens; send at most {max(max_context_tokens - max_new, 0)} prompt tokens or "
            f"lower max_new_tokens"
        )
    start, seed = body.get("routes_start"), body.get("seed")
    if start is not None and not 0 <= _strict_int(start, "routes_start") <= ids.numel():
        raise ValueError(f"routes_start={start}: must lie in [0, {ids.numel()}] (the prompt)")
    if seed is not None and not 0 <= _strict_int(seed, "seed") < 2**63:
        raise ValueError(f"seed={seed}: expected an int in [0, 2**63)")
    return GenerateRequest(ids, sampling, max_new, start, seed)


def response_body(
    output_ids: torch.Tensor,
    logprobs: torch.Tensor,
    support: Union[PackedTensor, RaggedSupport],
    *,
    vocab_size: int,
    finish_reason: str,
    routes: Optional[torch.Tensor] = None,
    routes_start: Optional[int] = None,
) -> dict:
    """A generate response (schema: :mod:`nemo_replay.rollout.transport.client`), either form's value.

    Args:
        output_ids: (n,) integer, the sampled tokens; sent as int32 (int64 for a vocabulary
            past 2**31), which every reader widens.
        logprobs: (n,) float32, their processed log-probs.
        support: the n rows, one segment; sent compact (support/codec/), the sampled ids
            dropped (the response carries them).
        routes: (m, layers, topk) integer, or None; ``routes_start`` is sent with them, and
            neither field when there are none.
    """
    body = {
        "output_ids": output_ids.to(torch.int32 if vocab_size <= 2**31 else torch.int64),
        "logprobs": logprobs.to(torch.float32),
        "support": support_to_wire(support, vocab_size=vocab_size, sampled_ids=output_ids),
        "finish_reason": finish_reason,
    }
    if routes is not None:  # absent otherwise: every reader takes a missing field as null
        body.update(routes=routes, routes_start=routes_start)
    return body


class _TooManyValues(ValueError):
    """A body whose JSON outside array envelopes is too large to parse (a 413, not a 400)."""


def _json_values_bound(raw: Union[bytes, bytearray]) -> int:
    """An upper bound on the values (and keys) ``json`` would build from ``raw``.

    Every JSON value but the outermost follows a ``[``, ``,`` or ``:``, and every key a
    ``{`` or ``,``; base64 (the envelopes' payload) holds none of these bytes, so an array
    envelope counts 7 however long it is. Worked example: ``{"input_ids":[5,6,7],"seed":1}``
    has one ``{``, one ``[``, three ``,`` and two ``:`` -> 1 + 7 = 8, its objects exactly
    (the dict, two keys, the list, four ints). Bytes inside strings only over-count.
    """
    return 1 + raw.count(b"[") + raw.count(b"{") + raw.count(b",") + raw.count(b":")


def read_token_file(path: Union[str, os.PathLike]) -> str:
    """The bearer token stored in ``path`` (``nemo-replay serve --token-file``).

    One trailing newline (``\n`` or ``\r\n``) is stripped, nothing else. The file must be
    readable by its owner only, as ssh asks of a private key: the token is a password.

    Raises:
        ValueError naming the path: unreadable, readable by group or others (the fix is
        ``chmod 600``), empty, or not UTF-8.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ValueError(f"token file {str(path)!r}: cannot open it ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode  # of the file opened, not of whatever the path names later
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            raise ValueError(
                f"token file {str(path)!r} is readable by group or others (mode {stat.filemode(mode)}); "
                f"it holds a password: run `chmod 600 {path}`"
            )
        data = f.read()
    for newline in (b"\r\n", b"\n"):
        if data.endswith(newline):
            data = data[: -len(newline)]
            break
    if not data:
        raise ValueError(f"token file {str(path)!r} is empty; write the bearer token into it (then `chmod 600 {path}`)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"token file {str(path)!r} is not UTF-8 text; write the bearer token as text") from None


def _join_supports(parts: list) -> Union[PackedTensor, RaggedSupport]:
    """Per-step one-row supports -> one segment of n rows."""
    steps = type(parts[0]).cat(parts)  # n segments of one row each
    one_segment = torch.tensor([0, steps.num_rows], dtype=torch.int32)
    return steps.resegment(one_segment)


def _error(status: int, message: str, **headers) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


class GenerateServer:
    """aiohttp ``POST /generate`` over a next-token model (hardening: module doc).

    Args:
        logits_fn: ``(T,) int64 -> (V,) float`` next-token logits.
        vocab_size: ``V``; request token ids must lie in ``[0, V)``.
        routes_fn: optional ``(T,) int64 -> (T, layers, topk) int`` routes.
        eos_id: generation stops after sampling it (finish_reason ``"stop"``).
        host: a loopback address.
        port: 0 picks a free port at start.
        token: bearer token; None reads ``NEMO_REPLAY_GENERATE_TOKEN`` (unset: no auth).
        max_new_tokens_cap: the largest ``max_new_tokens`` a request may ask for.
        max_body_bytes: the largest request body.
        max_json_values: the most JSON values a body may hold outside its array envelopes
            (module doc, 4): about the longest list-form ``input_ids``; more get 413.
        body_timeout_s: a body must arrive within this many seconds.
        max_concurrent: requests run at once; more get 429.
        max_context_tokens: the model's context (e.g. ``max_position_embeddings``): the prompt
            plus ``max_new_tokens`` must fit, else 400; None leaves it unchecked.
        max_connections: connections open at once; more get 503 and are closed (module doc, 0).
        idle_timeout_s: a connection outside a request this long is closed (module doc, 0).
        middlewares: aiohttp middlewares (tests use them to disturb responses).
    """

    def __init__(
        self,
        logits_fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        vocab_size: int,
        routes_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        eos_id: Optional[int] = None,
        host: str = "127.0.0.1",
        port: int = 0,
        token: Optional[str] = None,
        max_new_tokens_cap: int = 4096,
        max_body_bytes: int = 16 << 20,
        max_json_values: int = MAX_JSON_VALUES,
        body_timeout_s: float = 30.0,
        max_concurrent: int = 64,
        max_context_tokens: Optional[int] = None,
        max_connections: int = 256,
        idle_timeout_s: float = 15.0,
        middlewares: Sequence = (),
    ):
        if not callable(logits_fn) or (routes_fn is not None and not callable(routes_fn)):
            raise ValueError("GenerateServer: logits_fn (and routes_fn when given) must be callable: (T,) int64 -> logits")
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"GenerateServer: host={host!r} is not a loopback address; use 127.0.0.1 or ::1")
        for name, value in (("vocab_size", vocab_size), ("max_new_tokens_cap", max_new_tokens_cap),
                            ("max_body_bytes", max_body_bytes), ("max_json_values", max_json_values),
                            ("max_concurrent", max_concurrent), ("max_connections", max_connections),
                            ("max_context_tokens", 1 if max_context_tokens is None else max_context_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GenerateServer: {name}={value!r}, expected an int >= 1")
        for name, value in (("body_timeout_s", body_timeout_s), ("idle_timeout_s", idle_timeout_s)):
            if not value > 0:
                raise ValueError(f"GenerateServer: {name}={value!r}, expected > 0")
        token = os.environ.get(TOKEN_ENV) if token is None else token
        if token is not None and not token:
            raise ValueError(f"GenerateServer: the bearer token is empty; pass a non-empty token or unset {TOKEN_ENV}")
        self.logits_fn, self.routes_fn, self.eos_id, self.vocab_size = logits_fn, routes_fn, eos_id, vocab_size
        self.host, self.port = host, port
        self.max_new_tokens_cap, self.body_timeout_s, self.max_concurrent = max_new_tokens_cap, body_timeout_s, max_concurrent
        self.max_body_bytes, self.max_json_values = max_body_bytes, max_json_values
        self.max_context_tokens, self.max_connections, self.idle_timeout_s = max_context_tokens, max_connections, idle_timeout_s
        self._loop_handler = None  # the event loop's exception handler before start (restored at stop)
        self._resource_log = [0.0, 0]  # when the descriptor report was last logged, reports since
        self._last_resource_report = 0.0  # when the loop last reported one (logged or not)
        self._expected_auth = b"Bearer " + token.encode() if token else None
        self._app = web.Application(middlewares=list(middlewares), client_max_size=max_body_bytes)
        self._app.router.add_post("/generate", self._handle)
        self._runner: Optional[web.AppRunner] = None
        self.url: Optional[str] = None
        self.num_requests = 0  # requests received
        self.num_active = 0  # requests running now
        self.num_abandoned = 0  # generations stopped because their client left
        self.num_refused_connections = 0  # connections past max_connections, answered 503

    async def start(self) -> str:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if limit != resource.RLIM_INFINITY and self.max_connections + _DESCRIPTOR_MARGIN > limit:
            raise ValueError(
                f"GenerateServer: max_connections={self.max_connections} plus {_DESCRIPTOR_MARGIN} descriptors for the "
                f"process exceed its descriptor limit of {limit} (ulimit -n); lower max_connections to "
                f"{max(limit - _DESCRIPTOR_MARGIN, 1)} or raise the limit"
            )
        # aiohttp's keep-alive timer runs from a connection's start and from each response until the
        # next request's headers are complete (web_protocol.py, connection_made and _process_keepalive):
        # it closes the idle and the header-trickling connections alike.
        self._runner = web.AppRunner(self._app, access_log=None, keepalive_timeout=self.idle_timeout_s)
        await self._runner.setup()
        server = self._runner.server
        admit = server.connection_made

        def connection_made(handler, transport):
            admit(handler, transport)
            if len(server.connections) > self.max_connections:
                self.num_refused_connections += 1
                transport.write(_BUSY)
                transport.close()

        server.connection_made = connection_made
        loop = asyncio.get_running_loop()
        self._loop_handler = loop.get_exception_handler()
        loop.set_exception_handler(self._on_loop_error)
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            left = self._last_resource_report + _ACCEPT_RETRY_S + 0.2 - time.monotonic()
            if self._last_resource_report and left > 0:
                # Each failed accept() left a retry timer (asyncio's ACCEPT_RETRY_DELAY) that outlives the
                # closed listener and fails on its descriptor -1: they fire here, under this handler.
                await asyncio.sleep(left)
            asyncio.get_running_loop().set_exception_handler(self._loop_handler)

    def _on_loop_error(self, loop, context: dict) -> None:
        """The loop's report of ``accept()`` out of descriptors, once per interval; the rest as before."""
        exc = context.get("exception")
        if isinstance(exc, ValueError) and "_start_serving" in repr(context.get("handle")) and self._last_resource_report:
            return  # a retry timer of a failed accept() that outlived the closed listener (see stop)
        if "out of system resource" not in str(context.get("message", "")):
            if self._loop_handler is not None:
                self._loop_handler(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        last, count = self._resource_log
        now = self._last_resource_report = time.monotonic()
        if last and now - last < RESOURCE_LOG_INTERVAL_S:
            self._resource_log[1] = count + 1
            return
        logger.error("GenerateServer: accept() failed for want of file descriptors (%s); %d more such reports since "
                     "the last line; max_connections=%d", context.get("exception"), count, self.max_connections)
        self._resource_log[:] = [now, 0]

    async def __aenter__(self) -> "GenerateServer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ------------------------------------------------------------------ phases of one request
    def _authorized(self, request: web.Request) -> bool:
        if self._expected_auth is None:
            return True
        # The raw bytes as sent: aiohttp's str of a non-UTF-8 header holds surrogates that
        # str.encode() refuses (a 500); bytes compare in constant time whatever they hold.
        given = [value for name, value in request.raw_headers if name.lower() == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(given[0], self._expected_auth)

    async def _read_body(self, request: web.Request) -> Union[bytearray, web.Response]:
        try:
            return await asyncio.wait_for(self._read_limited(request), self.body_timeout_s)
        except asyncio.TimeoutError:
            resp = _error(408, f"request body did not arrive within {self.body_timeout_s} s")
            resp.force_close()
            await resp.prepare(request)
            await resp.write_eof()
            if request.transport is not None:
                request.transport.close()  # aiohttp would otherwise linger reading the body that is not coming
            return resp
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body over the server's limit of {request.client_max_size} bytes")

    async def _read_limited(self, request: web.Request) -> bytearray:
        """The body in one buffer grown as its bytes arrive: a declared Content-Length reserves
        nothing (twelve one-byte bodies declaring 16 MiB once held 190 MB), only refuses early."""
        limit, size = request.client_max_size, request.content_length
        if size is not None and size > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        buf = bytearray()
        async for chunk in request.content.iter_chunked(1 << 20):
            if len(buf) + len(chunk) > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(buf) + len(chunk))
            buf += chunk
        return buf

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.num_requests += 1
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)", **{"WWW-Authenticate": "Bearer"})
        if self.num_active >= self.max_concurrent:
            return _error(429, f"{self.max_concurrent} requests are running; retry shortly", **{"Retry-After": "1"})
        self.num_active += 1
        try:
            raw = await self._read_body(request)
            if isinstance(raw, web.Response):
                return raw
            content_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
            try:
                if len(raw) <= _INLINE_DECODE_BYTES:
                    req = self._decode(raw, content_type)
                else:  # off the event loop: other requests, 401s included, are answered meanwhile
                    req = await asyncio.to_thread(self._decode, raw, content_type)
            except _TooManyValues as exc:
                return _error(413, str(exc))
            except UnsupportedVersion as exc:
                return _error(415, str(exc))
            except ValueError as exc:  # WireError included
                return _error(400, str(exc))
            del raw  # the body is not needed once decoded
            reply = await self._generate(request, req)
            if reply is None:  # the client left; nobody reads an answer
                self.num_abandoned += 1
                return _error(499, "client closed the request")
            body, media_type = dumps_body(reply, accepts_binary(request.headers.get("Accept")))
            return web.Response(body=body, content_type=media_type)
        finally:
            self.num_active -= 1

    def _decode(self, raw: bytearray, content_type: str) -> GenerateRequest:
        """Body bytes -> a validated request; refuses, before parsing, JSON too large to parse.

        ``content_type``: the request's media type; :data:`BINARY_TYPE` reads the binary form, any
        other the JSON form (old clients, curl). A binary body's values are counted in its head.
        """
        binary = content_type == BINARY_TYPE
        bound = _json_values_bound(bytes(head_of(raw)) if binary else raw)
        if bound > self.max_json_values:
            where = "request head holds" if binary else "request body holds"
            raise _TooManyValues(
                f"{where} up to {bound} JSON values outside array envelopes, over the server's "
                f"max_json_values={self.max_json_values} (input_ids as a JSON list is limited to about "
                f"{self.max_json_values} tokens); send input_ids as an int32 array, a binary body's part or the "
                f'envelope {{"data": <base64>, "shape": [T], "dtype": "int32"}} in JSON (GenerateClient and '
                f"wire.dumps of a tensor do), which may fill the body limit of {self.max_body_bytes} bytes"
            )
        return parse_request(loads_body(raw, content_type), vocab_size=self.vocab_size,
                             max_new_tokens_cap=self.max_new_tokens_cap, max_context_tokens=self.max_context_tokens)

    def _gone(self, request: web.Request) -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    async def _generate(self, request: web.Request, req: GenerateRequest) -> Optional[dict]:
        """Run one request step by step; None when the client disconnects midway.

        The conversation lives in one int64 buffer of ``T + max_new_tokens`` tokens (the prompt
        array is released once copied); each step hands ``logits_fn`` a view of its prefix.
        """
        gen = torch.Generator().manual_seed(req.seed) if req.seed is not None else None
        T = req.input_ids.numel()
        tokens = torch.empty(T + req.max_new_tokens, dtype=torch.int64)
        tokens[:T] = req.input_ids
        req.input_ids = None
        n, out_lps, parts, finish = T, [], [], "length"
        for _ in range(req.max_new_tokens):
            if self._gone(request):
                return None
            res = await asyncio.to_thread(self._step, tokens[:n], req.sampling, gen)
            tokens[n] = res.ids[0]
            n += 1
            out_lps.append(res.logprobs)
            parts.append(res.support)
            if self.eos_id is not None and int(res.ids[0]) == self.eos_id:
                finish = "stop"
                break
        routes = None
        if req.routes_start is not None and self.routes_fn is not None:
            # The forward ran over every token but the last sampled one.
            routes = self.routes_fn(tokens[: n - 1])[req.routes_start :]
        return response_body(tokens[T:n], torch.cat(out_lps), _join_supports(parts), vocab_size=self.vocab_size,
                             finish_reason=finish, routes=routes, routes_start=req.routes_start)

    def _step(self, tokens: torch.Tensor, sampling: dict, gen: Optional[torch.Generator]):
        logits = self.logits_fn(tokens)
        if logits.shape != (self.vocab_size,):
            raise RuntimeError(f"logits_fn returned shape {tuple(logits.shape)}, expected ({self.vocab_size},) -- check vocab_size")
        return sample(logits.reshape(1, -1), generator=gen, **sampling)


async def serve_until_cancelled(server: GenerateServer, announce: Callable[[str], None] = print) -> None:
    """Start ``server``, report its URL through ``announce``, and serve until the task is cancelled."""
    url = await server.start()
    announce(f"serving POST {url}/generate (auth: {'bearer token' if server._expected_auth else 'none'})")
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
