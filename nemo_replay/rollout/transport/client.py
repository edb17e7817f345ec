"""Async client for a generate endpoint that returns captured support and routes (docs/design.md §7).

Bodies take one of two forms (docs/transport.md): JSON with base64 array envelopes
(:mod:`~nemo_replay.rollout.transport.wire`, ``application/json``), or binary, a JSON head and
the arrays' raw little-endian bytes (:mod:`~nemo_replay.rollout.transport.binary`,
``application/vnd.nemo-replay.wire``). The client asks for binary answers (``Accept``), reads
each answer by its ``Content-Type``, and sends binary requests once the server has answered
one in binary (it reads them too); until then, and against a server from before the binary
form (which answers JSON), it sends JSON. A 415 to a binary request sends it again as JSON at
once, within the same attempt, and JSON from then on. ``binary=False``: JSON both ways.

Request body::

    {"input_ids": <int32 [T]> | [int, ...],         # the whole conversation so far
     "sampling_params": {"temperature": 1.0, "top_k": 64, "top_p": 1.0, "min_p": 0.0,
                         "ties": "index_order", "max_new_tokens": 128},
     "routes_start": 37 | null,                     # return routes from this token on
     "seed": 0 | null}

Response body::

    {"output_ids":  <int32 [n]> | <int64 [n]>,     # int64 from older servers or V past 2**31
     "logprobs":    <float32 [n]>,                  # processed log-probs of output_ids
     "support":     {"codec": "nrsc-1", "data": <uint8>}    # compact rows, sampled ids dropped
                    | {"rows": <int32 [n, k]>} | {"member_ids": ..., "row_offsets": ...},  # older servers
     "routes":      <int [m, layers, topk]> | null, # tokens [routes_start, routes_start + m);
     "routes_start": int | null,                    #   both absent (null) when no routes are sent
     "finish_reason": "stop" | "length"}

Retries. Only what can succeed on a second try is retried, with exponential backoff
(with jitter, at least the server's ``Retry-After``): connection errors and bodies cut
short in transit, timeouts, HTTP 429 (the server is full), 502, 503 and 504 (a proxy or
a server not ready), and bodies the wire codec cannot decode -- truncated or corrupted
in transit, as a proxy cutting a body short leaves them (either form). Every other answer raises at
once: a 4xx is the caller's mistake, a 500 or 501 the server's, and a response that
decodes but fails validation (a sampled token outside its row) would fail again.

Auth. With a token (``token=`` or the environment variable ``NEMO_REPLAY_GENERATE_TOKEN``)
every request carries ``Authorization: Bearer <token>``.

The session is an explicit argument or owned by the client (``async with``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import aiohttp
import torch

from nemo_replay.rollout.transport.binary import BINARY_TYPE, JSON_TYPE, dumps_body, loads_body
from nemo_replay.rollout.transport.wire import WireError, routes_from_wire, support_from_wire
from nemo_replay.support.dtypes import first_outside, is_integer
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["GenerateClient", "GenerateResult", "GenerateRequestError", "RETRY_STATUSES"]

logger = logging.getLogger(__name__)

#: HTTP statuses that can succeed on retry.
RETRY_STATUSES = frozenset((429, 502, 503, 504))
_TOKEN_ENV = "NEMO_REPLAY_GENERATE_TOKEN"


class GenerateRequestError(RuntimeError):
    """The endpoint refused the request, or every attempt failed."""


@dataclass
class GenerateResult:
    """One decoded generate response.

    Attributes:
        output_ids: (n,), int64 sampled tokens.
        logprobs: (n,), float32 processed log-probs.
        support: one-segment ``PackedTensor`` (int32 [n, k]) or ``RaggedSupport`` (n rows),
            checked: every sampled token is a member of its row.
        routes: (m, layers, topk) integer routes of tokens ``[routes_start, routes_start + m)``,
            or None.
        routes_start: the first routed token, or None.
        finish_reason: ``"stop"`` or ``"length"``.
        extra: any other response fields.
    """

    output_ids: torch.Tensor
    logprobs: torch.Tensor
    support: Union[PackedTensor, RaggedSupport]
    routes: Optional[torch.Tensor] = None
    routes_start: Optional[int] = None
    finish_reason: Optional[str] = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_body(cls, body: Any, *, vocab_size: Optional[int] = None) -> "GenerateResult":
        """Validate a decoded response body (schema: module doc). Raises WireError."""
        where = "generate response"
        if not isinstance(body, dict):
            raise WireError(f"{where}: expected a JSON object, got {type(body).__name__}")
        missing = [k for k in ("output_ids", "logprobs", "support") if k not in body]
        if missing:
            raise WireError(f"{where}: missing fields {missing}")
        ids, lps = body["output_ids"], body["logprobs"]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or not is_integer(ids):
            raise WireError(f"{where}: 'output_ids' must be a 1-D integer array")
        if not isinstance(lps, torch.Tensor) or lps.shape != ids.shape or not lps.dtype.is_floating_point:
            raise WireError(f"{where}: 'logprobs' must be a float array of shape {list(ids.shape)}")
        ids = ids.to(torch.int64)
        # The checks the engine adapters apply (rollout/engines/base.py): a sampled token has a
        # finite log-prob <= 0, and every generated token has the row it was drawn from.
        bad = ~torch.isfinite(lps) | (lps > 1e-5)
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0])
            raise WireError(
                f"{where}: 'logprobs' at generated token {j} is {float(lps[j])!r}; a sampled token's log-prob is finite "
                f"and <= 0 -- the server's output is corrupted ({int(bad.sum())} of {bad.numel()} such values)"
            )
        support = support_from_wire(body["support"], sampled_ids=ids, vocab_size=vocab_size)
        empty = ~support.nonempty_rows()
        if bool(empty.any()):
            j = int(torch.nonzero(empty)[0])
            raise WireError(
                f"{where}: the support row of generated token {j} (id {int(ids[j])}) is empty; every generated token "
                f"comes with the row it was sampled from -- the server's output is corrupted ({int(empty.sum())} of "
                f"{empty.numel()} rows empty)"
            )
        routes, start = body.get("routes"), body.get("routes_start")
        if routes is not None:
            routes = routes_from_wire(routes)
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise WireError(f"{where}: 'routes' come with an int 'routes_start' >= 0, got {start!r}")
        known = {"output_ids", "logprobs", "support", "routes", "routes_start", "finish_reason"}
        return cls(
            output_ids=ids,
            logprobs=lps.to(torch.float32),
            support=support,
            routes=routes,
            routes_start=start if routes is not None else None,
            finish_reason=body.get("finish_reason"),
            extra={k: v for k, v in body.items() if k not in known},
        )


class GenerateClient:
    """POST to ``{base_url}/generate`` with retry and backoff.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"``.
        max_attempts: attempts per request (>= 1).
        backoff_s: first retry delay; doubles per retry, with jitter in [0.5, 1] x.
        max_backoff_s: cap on one delay.
        timeout_s: total time for one attempt.
        vocab_size: when given, support ids are checked against it.
        session: an ``aiohttp.ClientSession`` to use (not closed by the client).
        token: bearer token; None reads ``NEMO_REPLAY_GENERATE_TOKEN`` (unset: none).
        binary: ask for binary responses and, once the server has answered one, send binary
            requests (module doc); False: JSON both ways.

    Attributes:
        binary_requests: None until the server answers a binary body, then True (requests go
            binary); False for good after a 415 to a binary request.
        num_retries: retries made over the client's lifetime.
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_attempts: int = 4,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        timeout_s: float = 600.0,
        vocab_size: Optional[int] = None,
        session: Optional[aiohttp.ClientSession] = None,
        token: Optional[str] = None,
        binary: bool = True,
    ):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r}: expected an http(s) URL such as 'http://127.0.0.1:8000'")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts!r}: expected an int >= 1")
        if not (backoff_s >= 0 and max_backoff_s >= 0 and timeout_s > 0):
            raise ValueError(
                f"backoff_s={backoff_s}, max_backoff_s={max_backoff_s}, timeout_s={timeout_s}: expected delays >= 0 "
                f"and a timeout > 0"
            )
        token = os.environ.get(_TOKEN_ENV) if token is None else token
        self._headers = {"Accept": f"{BINARY_TYPE}, {JSON_TYPE};q=0.5" if binary else JSON_TYPE}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.base_url = base_url.rstrip("/")
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.vocab_size = vocab_size
        self._session = session
        self._own_session = session is None
        self.num_retries = 0  # retries made over the client's lifetime (diagnostics)
        self.binary = binary
        # Whether requests go binary: None until the server answers a binary body (then True: it reads
        # them too); False for good once it answered 415 to one.
        self.binary_requests: Optional[bool] = None

    async def __aenter__(self) -> "GenerateClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    def _delay(self, retry: int, retry_after: float = 0.0) -> float:
        jittered = min(self.max_backoff_s, self.backoff_s * 2**retry) * random.uniform(0.5, 1.0)
        return max(jittered, min(retry_after, self.max_backoff_s))

    async def post(self, path: str, payload: Any, *, parse=None) -> Any:
        """POST ``payload`` (wire-encoded) and return the decoded body.

        Args:
            path: e.g. ``"/generate"``.
            payload: JSON value; tensors inside travel as envelopes.
            parse: optional ``body -> result`` check of a decoded body; a ``ValueError`` from
                it is raised at once (a valid body that fails validation would fail again).
        """
        url = f"{self.base_url}/{path.lstrip('/')}"
        bodies: dict = {}  # form -> (bytes, media type), each encoded once
        self._body(payload, bodies, self.binary and bool(self.binary_requests))  # a payload that cannot travel raises here
        last: Optional[BaseException] = None
        retry_after = 0.0
        for attempt in range(self.max_attempts):
            if attempt:
                self.num_retries += 1
                await asyncio.sleep(self._delay(attempt - 1, retry_after))
            retry_after = 0.0
            try:
                status, headers, raw, sent_binary = await self._exchange(url, payload, bodies)
                if status == 415 and sent_binary:
                    # The server no longer reads this binary form (module doc): JSON from now on, at once.
                    logger.warning("%s: answered 415 to a binary body (%r); sending JSON bodies from now on", url, raw[:200])
                    self.binary_requests = False
                    status, headers, raw, _ = await self._exchange(url, payload, bodies)
                if status in RETRY_STATUSES:
                    last = GenerateRequestError(f"{url} answered HTTP {status}: {raw[:200]!r}")
                    retry_after = _seconds(headers.get("Retry-After"))
                elif status >= 400:
                    raise GenerateRequestError(f"{url} answered HTTP {status}: {raw[:500]!r} (not retried: it would fail again)")
                else:
                    content_type = headers.get("Content-Type", "").split(";")[0].strip().lower()
                    body = loads_body(raw, content_type)
                    if self.binary and content_type == BINARY_TYPE and self.binary_requests is None:
                        self.binary_requests = True
                    if parse is None:
                        return body
                    try:
                        return parse(body)
                    except ValueError as exc:
                        raise GenerateRequestError(f"{url}: the response failed validation (not retried): {exc}") from exc
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError, WireError) as exc:
                last = exc  # the connection failed, or the body was cut or corrupted in transit
            logger.warning("%s: attempt %d of %d failed: %s", url, attempt + 1, self.max_attempts, last)
        raise GenerateRequestError(f"{url}: all {self.max_attempts} attempts failed; last error: {last}") from last

    @staticmethod
    def _body(payload: Any, bodies: dict, binary: bool) -> tuple[bytes, str]:
        if binary not in bodies:
            bodies[binary] = dumps_body(payload, binary)
        return bodies[binary]

    async def _exchange(self, url: str, payload: Any, bodies: dict) -> tuple[int, Any, bytes, bool]:
        """One POST of ``payload`` in the form the server reads; (status, headers, body, sent binary)."""
        binary = self.binary and bool(self.binary_requests)
        data, media_type = self._body(payload, bodies, binary)
        headers = {**self._headers, "Content-Type": media_type}
        async with self._get_session().post(url, data=data, headers=headers, timeout=self.timeout) as resp:
            return resp.status, resp.headers, await resp.read(), binary

    async def generate(
        self,
        input_ids,
        *,
        sampling_params: Mapping[str, Any],
        routes_start: Optional[int] = None,
        seed: Optional[int] = None,
    ) -> GenerateResult:
        """Generate from ``input_ids`` (the whole conversation) and decode support and routes.

        Args:
            input_ids: (T,) int tokens: a list of ints or a 1-D integer tensor (a float or a
                bool is refused, never rounded); sent as an int32 array.
            sampling_params: temperature, top_k, top_p, min_p, ties, max_new_tokens.
            routes_start: ask for routes of tokens from here on (a RouteTrace's
                ``request_start``); None for no routes.
            seed: makes the engine's draws reproducible.
        """
        if not isinstance(sampling_params, Mapping):
            raise ValueError(f"sampling_params: expected a mapping, got {type(sampling_params).__name__}")
        for name, value in (("routes_start", routes_start), ("seed", seed)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name}={value!r}: expected an int or None")
        payload = {
            "input_ids": _token_array(input_ids),
            "sampling_params": dict(sampling_params),
            "routes_start": routes_start,
            "seed": seed,
        }
        return await self.post("/generate", payload, parse=lambda b: GenerateResult.from_body(b, vocab_size=self.vocab_size))


def _token_array(input_ids: Any) -> torch.Tensor:
    """(T,) int32 from a list of ints or a 1-D integer tensor; no coercion."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 1 or not is_integer(input_ids):
            raise ValueError(f"input_ids: expected a 1-D integer tensor, got {input_ids.dtype} {list(input_ids.shape)}")
        ids = input_ids.to(torch.int64).cpu()
    elif isinstance(input_ids, (list, tuple)):
        for i, t in enumerate(input_ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"input_ids[{i}]={t!r}: expected an int token id ({type(t).__name__} is not coerced)")
            if not 0 <= t <= torch.iinfo(torch.int32).max:  # before torch's int64 conversion, which 2**64 overflows
                raise ValueError(f"input_ids[{i}]={t}: token ids must lie in [0, 2**31)")
        ids = torch.tensor(list(input_ids), dtype=torch.int64)
    else:
        raise ValueError(f"input_ids: expected a list of ints or an integer tensor, got {type(input_ids).__name__}")
    i = first_outside(ids, 2**31)
    if i is not None:
        raise ValueError(f"input_ids[{i}]={int(ids[i])}: token ids must lie in [0, 2**31)")
    return ids.to(torch.int32)


def _seconds(value: Optional[str]) -> float:
    """A ``Retry-After`` header in seconds (0 when absent or not a number of seconds)."""
    try:
        return max(0.0, float(value)) if value is not None else 0.0
    except ValueError:
        return 0.0
