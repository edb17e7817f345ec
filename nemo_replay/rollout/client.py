"""Async client for a generate endpoint that returns captured support and routes (docs/design.md §7).

Request body (JSON)::

    {"input_ids": [int, ...],                       # the whole conversation so far
     "sampling_params": {"temperature": 1.0, "top_k": 64, "top_p": 1.0, "min_p": 0.0,
                         "max_new_tokens": 128},
     "routes_start": 37 | null,                     # return routes from this token on
     "seed": 0 | null}

Response body (wire format, :mod:`nemo_replay.rollout.wire`)::

    {"output_ids":  <int64 [n]>,
     "logprobs":    <float32 [n]>,                  # processed log-probs of output_ids
     "support":     {"rows": <int32 [n, k]>} | {"member_ids": ..., "row_offsets": ...},
     "routes":      <int [m, layers, topk]> | null, # tokens [routes_start, routes_start + m)
     "routes_start": int | null,
     "finish_reason": "stop" | "length"}

Retries. A request is retried with exponential backoff (with jitter) on connection
errors, timeouts, HTTP 429 and 5xx, and on bodies that fail to decode -- truncated or
corrupted payloads raise a ``ValueError`` in the reader and are treated as transient, as
a proxy cutting a body short is. Other 4xx answers are the caller's mistake and raise at
once. The session is an explicit argument or owned by the client (``async with``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import aiohttp
import torch

from nemo_replay.rollout.wire import WireError, dumps, loads, routes_from_wire, support_from_wire
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["GenerateClient", "GenerateResult", "GenerateRequestError"]

logger = logging.getLogger(__name__)


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
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise WireError(f"{where}: 'output_ids' must be a 1-D integer array")
        if not isinstance(lps, torch.Tensor) or lps.shape != ids.shape or not lps.dtype.is_floating_point:
            raise WireError(f"{where}: 'logprobs' must be a float array of shape {list(ids.shape)}")
        ids = ids.to(torch.int64)
        support = support_from_wire(body["support"], sampled_ids=ids, vocab_size=vocab_size)
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
    ):
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts!r}: expected an int >= 1")
        if backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(f"backoff_s={backoff_s}, max_backoff_s={max_backoff_s}: expected >= 0")
        self.base_url = base_url.rstrip("/")
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.vocab_size = vocab_size
        self._session = session
        self._own_session = session is None
        self.num_retries = 0  # retries made over the client's lifetime (diagnostics)

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

    def _delay(self, retry: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**retry) * random.uniform(0.5, 1.0)

    async def post(self, path: str, payload: Any, *, parse=None) -> Any:
        """POST ``payload`` (wire-encoded) and return the decoded body.

        Args:
            path: e.g. ``"/generate"``.
            payload: JSON value; tensors inside travel as envelopes.
            parse: optional ``body -> result`` run inside the retry loop; a ``ValueError``
                from it (a malformed body) is retried like a transport error.
        """
        data = dumps(payload)
        url = f"{self.base_url}/{path.lstrip('/')}"
        last: Optional[BaseException] = None
        for attempt in range(self.max_attempts):
            if attempt:
                self.num_retries += 1
                await asyncio.sleep(self._delay(attempt - 1))
            try:
                async with self._get_session().post(
                    url, data=data, headers={"Content-Type": "application/json"}, timeout=self.timeout
                ) as resp:
                    raw = await resp.read()
                    if resp.status == 429 or resp.status >= 500:
                        last = GenerateRequestError(f"{url} answered HTTP {resp.status}: {raw[:200]!r}")
                    elif resp.status >= 400:
                        raise GenerateRequestError(
                            f"{url} refused the request with HTTP {resp.status}: {raw[:500]!r} (not retried)"
                        )
                    else:
                        body = loads(raw)
                        return parse(body) if parse is not None else body
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                # ValueError covers WireError: truncated / corrupted bodies are transient.
                last = exc
            logger.warning("%s: attempt %d of %d failed: %s", url, attempt + 1, self.max_attempts, last)
        raise GenerateRequestError(f"{url}: all {self.max_attempts} attempts failed; last error: {last}") from last

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
            input_ids: (T,) int tokens.
            sampling_params: temperature, top_k, top_p, min_p, max_new_tokens.
            routes_start: ask for routes of tokens from here on (a RouteTrace's
                ``request_start``); None for no routes.
            seed: makes the engine's draws reproducible.
        """
        ids = [int(t) for t in torch.as_tensor(input_ids).reshape(-1).tolist()]
        payload = {"input_ids": ids, "sampling_params": dict(sampling_params), "routes_start": routes_start, "seed": seed}
        return await self.post("/generate", payload, parse=lambda b: GenerateResult.from_body(b, vocab_size=self.vocab_size))
