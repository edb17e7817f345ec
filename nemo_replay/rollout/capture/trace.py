"""Token-aligned traces of multi-turn rollouts (docs/design.md §2, §3, §7).

A multi-turn rollout alternates engine turns and environment observations. Instead of
re-gathering supports and routes for the whole conversation after every turn, the traces
below append the new rows turn by turn into growing buffers of a fixed row schema.

:class:`SupportTrace` holds one support row per *response* token (the tokens after the
first prompt), in the order they enter the conversation:

- sampled tokens keep the engine's row (loss-active); a sampled token an engine adapter
  flagged (its support could not be recorded, docs/design.md §7) keeps an empty row and is
  not loss-active;
- observation tokens get a padding row (all ``-1`` / empty; not loss-active);
- a synthetic EOS the trainer appends gets a padding row (loss-active, scored over the
  full vocabulary, at most one and only last);
- a sampled EOS that the generator strips from its output keeps its row: the row waits,
  and the next token appended to the conversation takes it if it is that EOS (the chat
  template closing the turn, or the trainer's final EOS); otherwise the row is dropped.

Worked example (EOS = 2), turn 1 samples ``[5, 7, 2]`` and the generator strips the EOS;
the observation arrives as ``[2, 9, 9]`` (template re-closes the turn, then tool output);
turn 2 samples ``[6, 3]`` (truncated), the trainer appends a synthetic EOS:

    response tokens   5    7    2    9    9    6    3    2
    row               r0   r1   r2   pad  pad  s0   s1   pad
    loss-active       1    1    1    0    0    1    1    1

:class:`RouteTrace` holds MoE routes ``[layers, topk]`` for *every* token (prompt and
response; R3 router replay). A token gets its routes from the request whose forward
pass first ran over it. Each request therefore asks the engine only for routes from
:attr:`RouteTrace.request_start` on: the prompt start grows with the conversation.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from nemo_replay.rollout.boundary import validate_support
from nemo_replay.support.dtypes import is_integer
from nemo_replay.support.packed import PackedTensor, lengths_to_cu_seqlens
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["TokenAlignedAccumulator", "SupportTrace", "RouteTrace"]

RowsLike = Union[torch.Tensor, PackedTensor, RaggedSupport, Sequence[Sequence[int]]]

_INT32_MAX = torch.iinfo(torch.int32).max

# Kinds of response tokens in a SupportTrace.
_SAMPLED, _OBSERVATION, _SYNTHETIC_EOS, _FLAGGED = 0, 1, 2, 3  # _FLAGGED: sampled, support not recorded


class TokenAlignedAccumulator:
    """Rows of a fixed schema appended in chunks into one growing buffer.

    Appending is amortised O(rows appended): the buffer doubles when full, nothing already
    stored is copied again per turn.

    Args:
        row_shape: the shape of one row (``(k,)`` support, ``(layers, topk)`` routes,
            ``()`` scalars).
        dtype: the dtype of every row; appended rows must have this dtype.
        fill: the value of a padding row.
    """

    def __init__(self, row_shape: Sequence[int], dtype: torch.dtype, *, fill=0, capacity: int = 64):
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"TokenAlignedAccumulator: dtype={dtype!r}, expected a torch.dtype")
        if not isinstance(row_shape, (tuple, list, torch.Size)) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in row_shape):
            raise ValueError(f"TokenAlignedAccumulator: row_shape={row_shape!r}, expected a tuple of ints >= 0")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"TokenAlignedAccumulator: capacity={capacity!r}, expected an int >= 0")
        self.row_shape = tuple(int(s) for s in row_shape)
        self.dtype = dtype
        self.fill = fill
        self._buf = torch.empty((max(capacity, 1), *self.row_shape), dtype=dtype)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _reserve(self, n: int) -> None:
        need = self._len + n
        if need > self._buf.shape[0]:
            cap = max(need, 2 * self._buf.shape[0])
            buf = torch.empty((cap, *self.row_shape), dtype=self.dtype)
            buf[: self._len] = self._buf[: self._len]
            self._buf = buf

    def append(self, rows: torch.Tensor, *, where: str = "accumulator") -> None:
        """Append ``rows``: (n, *row_shape), exactly this accumulator's dtype."""
        if not isinstance(rows, torch.Tensor):
            raise ValueError(f"{where}: rows must be a torch.Tensor, got {type(rows).__name__}")
        if tuple(rows.shape[1:]) != self.row_shape or rows.dim() != len(self.row_shape) + 1:
            raise ValueError(
                f"{where}: rows have shape {tuple(rows.shape)}, expected (n, {', '.join(map(str, self.row_shape))}) "
                f"-- the row schema is fixed for the whole trace"
            )
        if rows.dtype != self.dtype:
            raise ValueError(f"{where}: rows have dtype {rows.dtype}, the trace stores {self.dtype}")
        self._reserve(rows.shape[0])
        self._buf[self._len : self._len + rows.shape[0]] = rows.cpu()
        self._len += rows.shape[0]

    def append_fill(self, n: int) -> None:
        """Append ``n`` padding rows; ``n`` an int >= 0 (a bool is not a count).

        A negative ``n`` would move the end back over stored rows, and ``True`` would pass
        as 1: both are refused.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"TokenAlignedAccumulator.append_fill: n={n!r}, expected an int >= 0 (rows to append)")
        self._reserve(n)
        self._buf[self._len : self._len + n] = self.fill
        self._len += n

    def values(self) -> torch.Tensor:
        """(len, *row_shape): a copy of the stored rows."""
        return self._buf[: self._len].clone()


def _as_ids(token_ids, where: str) -> torch.Tensor:
    if token_ids is None:
        raise ValueError(f"{where}: token ids are required, got None")
    t = torch.as_tensor(token_ids)
    if t.dim() != 1 or not is_integer(t):
        raise ValueError(f"{where}: token ids must be a 1-D integer sequence, got {t.dtype} {tuple(t.shape)}")
    return t.to(torch.int64).cpu()


class SupportTrace:
    """One support row per response token, accumulated turn by turn (see the module doc).

    Args:
        top_k: the width of the fixed-width rows turns bring (each checked against it; a
            RaggedSupport's rows must fit it); None for ragged (CSR) input. The trace keeps
            every row as CSR either way: a row costs its members, not ``top_k`` columns.
        eos_id: the EOS token id (needed to recognise a stripped sampled EOS).
        vocab_size: ids must be below it when given.
    """

    def __init__(self, *, top_k: Optional[int], eos_id: Optional[int] = None, vocab_size: Optional[int] = None):
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"SupportTrace: top_k={top_k!r}, expected a positive int or None (ragged rows)")
        self.top_k = top_k
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self._tokens = TokenAlignedAccumulator((), torch.int64)
        self._kinds = TokenAlignedAccumulator((), torch.int8)
        # CSR whatever the input form: a row costs its members, not top_k columns.
        self._members = TokenAlignedAccumulator((), torch.int32)
        self._lengths = TokenAlignedAccumulator((), torch.int64, fill=0)
        self._pending_eos = None  # (row, kind) of the stripped EOS, waiting for the EOS to reappear
        self._closed = False
        self._turns = 0

    # ------------------------------------------------------------------ rows
    def _normalise_rows(self, rows: RowsLike, n: int, where: str):
        """-> fixed (n, k) int32 tensor for fixed-width input, or (members int32, lengths int64)."""
        if self.top_k is not None and getattr(rows, "csr", False):
            # CSR rows of a top-k trace (the adapters' and the wire's rows): they must fit top_k.
            widest = int(rows.row_lengths.max()) if rows.num_rows else 0
            if widest > self.top_k:
                raise ValueError(f"{where}: a row holds {widest} ids, wider than this trace's top_k={self.top_k}")
        elif self.top_k is not None:
            values = rows.values if isinstance(rows, PackedTensor) else rows
            if not isinstance(values, torch.Tensor):
                raise ValueError(f"{where}: this trace holds fixed-width rows; pass an int [n, {self.top_k}] tensor "
                                 f"or a RaggedSupport of rows at most that wide")
            if values.dim() != 2 or values.shape != (n, self.top_k):
                raise ValueError(
                    f"{where}: rows have shape {tuple(values.shape)}, expected ({n}, {self.top_k}): one row of "
                    f"width top_k per sampled token"
                )
            if not is_integer(values):
                # Checked before the cast to int32, which would truncate 3.7 to a valid-looking 3.
                raise ValueError(
                    f"{where}: rows have dtype {values.dtype}, expected integer token ids; pass the sampler's "
                    f"int32 rows unchanged"
                )
            if values.numel():
                # Also before the cast: int64 2**32 + 5 would wrap to 5. Widened, never compared as uint8.
                wide = values.to(torch.int64)
                lo, hi = int(wide.min()), int(wide.max())
                if lo < -1 or hi > _INT32_MAX:
                    raise ValueError(f"{where}: rows hold {lo if lo < -1 else hi}, outside [-1, 2**31)")
            return values.to(torch.int32).cpu()
        if getattr(rows, "csr", False):
            ragged = rows
        elif isinstance(rows, (torch.Tensor, PackedTensor)):
            raise ValueError(f"{where}: this trace holds ragged rows; pass a RaggedSupport or a list of id lists")
        else:
            lists = [list(r) for r in rows]
            for j, r in enumerate(lists):
                for t in r:
                    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _INT32_MAX:
                        raise ValueError(f"{where}: row {j} holds {t!r}, expected int token ids in [0, 2**31)")
            ragged = RaggedSupport.from_rows([lists])
        if ragged.num_rows != n:
            raise ValueError(f"{where}: {ragged.num_rows} support rows for {n} sampled tokens; expected one per token")
        return ragged.member_ids.to(torch.int32).cpu(), ragged.row_lengths.cpu()

    def _append_rows(self, rows) -> None:
        members, lengths = rows
        self._members.append(members)
        self._lengths.append(lengths)

    def _append_padding(self, n: int) -> None:
        self._lengths.append_fill(n)

    def _take_row(self, rows, j: int):
        """Row ``j`` of ``(members, lengths)`` rows, in the same form."""
        members, lengths = rows
        start = int(lengths[:j].sum())
        return members[start : start + int(lengths[j])], lengths[j : j + 1]

    def _append_tokens(self, ids: torch.Tensor, kind: int) -> None:
        self._tokens.append(ids)
        self._kinds.append(torch.full((ids.numel(),), kind, dtype=torch.int8))

    def _check_open(self, where: str) -> None:
        if self._closed:
            raise ValueError(f"{where}: the trace already ends with a synthetic EOS; nothing may follow it")

    def _consume_pending(self, first_token: int) -> bool:
        """Give the waiting stripped-EOS row to ``first_token`` if it is that EOS."""
        pending, self._pending_eos = self._pending_eos, None
        if pending is None or first_token != self.eos_id:
            return False
        row, kind = pending
        self._append_tokens(torch.tensor([first_token]), kind)
        self._append_rows(row)
        return True

    def _flags(self, flagged, norm, n: int, where: str) -> torch.Tensor:
        """(n,) bool flagged positions, whose rows must be empty."""
        if flagged is None:
            return torch.zeros(n, dtype=torch.bool)
        flags = torch.as_tensor(flagged).cpu()
        if flags.dtype != torch.bool or flags.shape != (n,):
            raise ValueError(f"{where}: flagged must be a bool ({n},) mask, got {flags.dtype} {tuple(flags.shape)}")
        filled = norm[1] > 0
        if (flags & filled).any():
            j = int(torch.nonzero(flags & filled)[0])
            raise ValueError(f"{where}: position {j} is flagged but its row is not empty; a flagged position has no support")
        return flags

    # ------------------------------------------------------------------ turns
    def add_turn(
        self,
        sampled_ids,
        rows: RowsLike,
        *,
        response_ids=None,
        flagged=None,
    ) -> None:
        """Append one engine turn.

        Args:
            sampled_ids: (n,) int, every token the engine sampled this turn.
            rows: their n support rows: int ``[n, top_k]`` (or a one-segment PackedTensor),
                or for ragged traces a RaggedSupport of n rows / a list of n id lists; or an
                engine adapter's :class:`~nemo_replay.rollout.engines.base.EngineSupport`, whose
                flagged positions are taken with it.
            response_ids: the tokens the generator keeps for the conversation, when it
                differs from ``sampled_ids``: equal to ``sampled_ids`` with a final sampled
                EOS stripped. That EOS's row then waits for the EOS to reappear.
            flagged: (n,) bool, positions whose support was not recorded (empty rows): they
                stay in the response but leave the loss (:attr:`loss_mask` False).
        """
        where = f"SupportTrace turn {self._turns}"
        self._check_open(where)
        if hasattr(rows, "flagged") and hasattr(rows, "support"):  # an EngineSupport
            if flagged is not None:
                raise ValueError(f"{where}: pass flagged= or an EngineSupport, not both")
            rows, flagged = rows.support, rows.flagged
        sampled = _as_ids(sampled_ids, where)
        n = sampled.numel()
        norm = self._normalise_rows(rows, n, where)
        if isinstance(norm, torch.Tensor):  # fixed-width input, checked as such, kept as CSR
            validate_support(norm, sampled_ids=sampled, vocab_size=self.vocab_size, where=where)
            keep = norm >= 0  # padding is trailing (checked)
            norm = (norm[keep], keep.sum(1))
        else:
            check = RaggedSupport(
                norm[0], lengths_to_cu_seqlens(norm[1]).to(torch.int64), torch.tensor([0, n], dtype=torch.int32)
            )
            validate_support(check, sampled_ids=sampled, vocab_size=self.vocab_size, where=where)
        kinds = torch.where(self._flags(flagged, norm, n, where), _FLAGGED, _SAMPLED).to(torch.int8)
        kept = sampled if response_ids is None else _as_ids(response_ids, where)
        stripped = False
        if not torch.equal(kept, sampled):
            if self.eos_id is None:
                raise ValueError(f"{where}: response_ids differ from sampled_ids; pass eos_id= to the trace")
            stripped = n >= 1 and int(sampled[-1]) == self.eos_id and torch.equal(kept, sampled[:-1])
            if not stripped:
                raise ValueError(
                    f"{where}: response_ids ({kept.numel()} tokens) must equal sampled_ids ({n} tokens) or "
                    f"sampled_ids without a final EOS {self.eos_id}; the generator may only strip a sampled EOS"
                )
        self._pending_eos = None  # a row that waited across a whole turn belongs to no token
        if stripped:
            self._pending_eos = (self._take_row(norm, n - 1), int(kinds[-1]))
            kinds = kinds[:-1]
            members, lengths = norm
            norm = (members[: int(lengths[:-1].sum())], lengths[:-1])
        self._tokens.append(kept)
        self._kinds.append(kinds)
        self._append_rows(norm)
        self._turns += 1
        assert len(self._tokens) == self.num_rows, "one row per appended token"

    def add_observation(self, token_ids) -> None:
        """Append environment / template tokens: padding rows, not loss-active.

        If a stripped sampled EOS is waiting and the first token is that EOS, it takes its
        sampled row back (loss-active) -- the template closing the turn.
        """
        where = f"SupportTrace observation after turn {self._turns}"
        self._check_open(where)
        ids = _as_ids(token_ids, where)
        if ids.numel() and self._consume_pending(int(ids[0])):
            ids = ids[1:]
        self._append_tokens(ids, _OBSERVATION)
        self._append_padding(ids.numel())
        assert len(self._tokens) == self.num_rows, "one row per appended token"

    def add_synthetic_eos(self, eos_id: Optional[int] = None) -> None:
        """Append the trainer's final EOS.

        If the last turn's sampled EOS was stripped, this is that EOS coming back: it keeps
        its row. Otherwise it is synthetic: a padding row, loss-active, scored over the full
        vocabulary. Nothing may be appended afterwards.
        """
        where = "SupportTrace synthetic EOS"
        self._check_open(where)
        eos = self.eos_id if eos_id is None else eos_id
        if eos is None:
            raise ValueError(f"{where}: no EOS id; pass eos_id= here or to the trace")
        if not self._consume_pending(int(eos)):
            self._append_tokens(torch.tensor([int(eos)]), _SYNTHETIC_EOS)
            self._append_padding(1)
        self._closed = True
        assert len(self._tokens) == self.num_rows, "one row per appended token"

    # ------------------------------------------------------------------ results
    @property
    def num_rows(self) -> int:
        return len(self._lengths)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def response_ids(self) -> torch.Tensor:
        """(R,), int64: the response tokens in conversation order."""
        return self._tokens.values()

    @property
    def loss_mask(self) -> torch.Tensor:
        """(R,), bool: sampled tokens (but flagged ones) and the synthetic EOS."""
        kinds = self._kinds.values()
        return (kinds == _SAMPLED) | (kinds == _SYNTHETIC_EOS)

    def support(self) -> RaggedSupport:
        """The R rows as one segment of CSR rows (padding and observation rows empty); with
        ``top_k``, their padded copies are ``top_k`` wide (:meth:`RaggedSupport.bounded`)."""
        R = self.num_rows
        lengths = self._lengths.values()
        rows = RaggedSupport(
            self._members.values(), lengths_to_cu_seqlens(lengths).to(torch.int64), torch.tensor([0, R], dtype=torch.int32)
        )
        return rows if self.top_k is None else rows.bounded(self.top_k)

    def check_response(self, response_ids) -> None:
        """The trainer's response tokens must be exactly the traced ones, row for row."""
        where = "SupportTrace.check_response"
        ids = _as_ids(response_ids, where)
        mine = self.response_ids
        if ids.numel() != mine.numel():
            raise ValueError(
                f"{where}: the trainer's response has {ids.numel()} tokens but the trace holds {mine.numel()} "
                f"rows; every response token needs exactly one row"
            )
        diff = torch.nonzero(ids != mine)
        if diff.numel():
            j = int(diff[0])
            raise ValueError(
                f"{where}: response position {j} holds token {int(ids[j])} but the trace recorded "
                f"{int(mine[j])}; rows and tokens would be misaligned"
            )


class RouteTrace:
    """MoE routes ``[layers, topk]`` for every conversation token, request by request (R3).

    Flow, for a conversation that starts with a prompt of P tokens:

        trace.add_tokens(P)                          # prompt, no routes yet
        start = trace.request_start                  # ask the engine for routes from here
        trace.add_request(routes, start=start, num_generated=n)
        trace.add_tokens(len(observation))           # next turn's prompt suffix
        ...
        routes = trace.finish(loss_mask)             # (T, layers, topk)

    Worked example: P = 4, turn 1 generates 3 tokens. The engine's forward ran over tokens
    0..5 (the last sampled token, 6, was never fed back), so it returns 6 rows from start
    0. An observation of 2 tokens follows (tokens 7, 8). Turn 2 starts at
    ``request_start = 6``: the engine prefills tokens 6..8 and returns their routes plus
    those of turn 2's generated tokens but its last.

    Args:
        num_layers, topk: the route row schema.
        dtype: integer dtype of expert ids.
    """

    def __init__(self, *, num_layers: int, topk: int, dtype: torch.dtype = torch.int32):
        for name, value in (("num_layers", num_layers), ("topk", topk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RouteTrace: {name}={value!r}, expected an int >= 1")
        if dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
            raise ValueError(
                f"RouteTrace: dtype={dtype} must be a signed integer dtype (torch.int8/16/32/64): routes use -1 for "
                f"'no route', which an unsigned dtype would store as its maximum. Routes an engine sends as uint8 are "
                f"widened on add_request"
            )
        self.dtype = dtype
        self._routes = TokenAlignedAccumulator((num_layers, topk), dtype, fill=-1)
        self._num_tokens = 0
        self._requests = 0

    @property
    def num_tokens(self) -> int:
        """Tokens in the conversation so far."""
        return self._num_tokens

    @property
    def request_start(self) -> int:
        """The first token without routes: the next request's route start."""
        return len(self._routes)

    def add_tokens(self, n: int) -> None:
        """Append ``n`` tokens whose routes a later request will return (prompt, observation)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"RouteTrace.add_tokens: n={n!r}, expected an int >= 0")
        self._num_tokens += n

    def add_request(self, routes: torch.Tensor, *, start: int, num_generated: int) -> None:
        """Add one request's routes.

        Args:
            routes: (m, layers, topk), any integer dtype (an engine's uint8 routes too): routes
                of tokens ``[start, start + m)``; cast to the trace's dtype after a range check.
            start: where the engine's routes begin; must equal :attr:`request_start`.
            num_generated: tokens the request generated (0 for a prefill-only request).
                They join the conversation now. ``m`` must reach the last token the forward
                ran over: ``num_tokens - 1`` after adding them (the last sampled token was never
                fed back), or ``num_tokens`` (an engine that routes it too, or prefill only).
        """
        where = f"RouteTrace request {self._requests}"
        if start != self.request_start:
            raise ValueError(
                f"{where}: routes start at token {start}, but tokens [0, {self.request_start}) are routed "
                f"and the rest are not; request routes from start={self.request_start}"
            )
        if isinstance(num_generated, bool) or not isinstance(num_generated, int) or num_generated < 0:
            raise ValueError(f"{where}: num_generated={num_generated!r}, expected an int >= 0")
        if not isinstance(routes, torch.Tensor) or routes.dim() == 0:
            got = f"a {routes.dim()}-D tensor" if isinstance(routes, torch.Tensor) else type(routes).__name__
            raise ValueError(f"{where}: routes must be an int (m, layers, topk) tensor, got {got}")
        total = self._num_tokens + num_generated
        m = routes.shape[0]
        allowed = {total - start} if num_generated == 0 else {total - start - 1, total - start}
        if m not in allowed:
            raise ValueError(
                f"{where}: got {m} route rows from token {start} for a conversation of {total} tokens; "
                f"expected {' or '.join(map(str, sorted(allowed)))} (every token the forward ran over)"
            )
        self._routes.append(self._cast(routes, where), where=where)
        self._num_tokens = total
        self._requests += 1

    def _cast(self, routes: torch.Tensor, where: str) -> torch.Tensor:
        """``routes`` in the trace's dtype, every value checked against ``[-1, dtype max]`` first."""
        if not is_integer(routes):
            raise ValueError(f"{where}: routes have dtype {routes.dtype}, expected integer expert ids")
        if routes.numel() == 0:
            return routes.to(self.dtype)
        # Also in the trace's own dtype (-7 is no expert id either); read as Python ints, so a
        # uint8 array is never compared with -1 in its own dtype.
        lo, hi = (int(v) for v in torch.aminmax(routes))
        if lo < -1:
            raise ValueError(f"{where}: routes hold expert id {lo}; expert ids are >= 0, or -1 for none")
        if hi > torch.iinfo(self.dtype).max:
            raise ValueError(f"{where}: expert id {hi} does not fit the trace's {self.dtype}; build the RouteTrace with a wider dtype")
        return routes.to(self.dtype)

    def finish(self, loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The routes of all tokens, ``(num_tokens, layers, topk)``, ``-1`` where none was recorded.

        Token ``u``'s routes shape the logits of positions ``>= u``, which score targets
        ``u + 1, u + 2, ...``. Unrouted tokens are the suffix ``[request_start, T)``, so every
        loss-active target must sit at or before ``request_start``; a route is never invented
        for anything a loss-active target depends on.

        Args:
            loss_mask: token-position mask, bool, right-aligned: ``(T,)`` or the last ``A``
                tokens ``(A,)`` (e.g. a SupportTrace's response mask). None: nothing checked.
        """
        T, start = self._num_tokens, self.request_start
        if loss_mask is not None:
            lm = torch.as_tensor(loss_mask).bool().cpu()
            if lm.dim() != 1 or lm.numel() > T:
                raise ValueError(f"RouteTrace.finish: loss_mask has shape {tuple(lm.shape)}, expected (A,) with A <= {T}")
            positions = torch.nonzero(lm).flatten() + (T - lm.numel())
            bad = positions[positions > start]
            if bad.numel():
                raise ValueError(
                    f"RouteTrace.finish: tokens [{start}, {T}) have no routes, but the loss-active target at "
                    f"position {int(bad[0])} depends on them; refusing to invent routes. Send one prefill-only "
                    f"request over the whole conversation with routes from start={start} and add it with "
                    f"add_request(routes, start={start}, num_generated=0)"
                )
        out = self._routes.values()
        if T > start:
            pad = torch.full((T - start, *out.shape[1:]), -1, dtype=out.dtype)
            out = torch.cat([out, pad], 0)
        return out
