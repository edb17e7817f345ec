"""Rollouts with support capture: sample responses and return a canonical :class:`ReplayBatch`.

The generator calls ``next_token_logits(sequences, attention_mask)`` once per new token on
the whole left-padded buffer (no KV cache), so every sampled token is drawn from the logits
of exactly the forward the trainer runs later (same weights, same position ids
``nemo_replay.layout.canonical.position_ids``, same kernels); with replay on, the trainer's log-probs then
match the recorded ones to float noise. Sampling goes through
:func:`nemo_replay.capture.sample`, which returns each token's processed log-prob and its
support row.

Layout while generating (B = 2, prompts ``a b c`` and ``d e``, stop token ``#``)::

    step 0      _ a b c | x0          _ = left pad, | = prompt end
                _ _ d e | y0
    step 1      _ a b c x0 | x1
                _ _ d e y0 | #        row 1 samples the stop token: it is kept, row 1 ends
    step 2      _ a b c x0 x1 | x2
                _ _ d e y0 #  _       finished rows get a pad (attention_mask False)

At the end each trajectory is re-left-padded into the canonical batch (its real tokens a
suffix of its row) with ``R_i`` support rows, and the loss mask / rollout log-probs are
right-aligned ``(B, A)`` with ``A = max R_i``.

MoE routes (R3). When ``next_token_logits`` also returns the routes of every column of
the buffer, each token keeps the routes of the forward that first processed it, as a KV-cached
engine would record them: the prompt tokens from step 0, token ``t`` of the response from
step ``t + 1``. The last sampled token is never fed back; it gets experts ``0..topk-1``
(causal attention keeps its route from influencing any scored position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch

from nemo_replay.capture import sample
from nemo_replay.batch import ReplayBatch
from nemo_replay.support.packed import PackedTensor, lengths_to_cu_seqlens
from nemo_replay.support.ragged import RaggedSupport

if TYPE_CHECKING:
    from nemo_replay.rollout.capture.hf import HFRollout

__all__ = ["SamplingSettings", "Rollout", "left_pad", "generate", "rollout_batch", "replay_batches_from_generation"]

# (sequences, attention_mask) -> logits (B, V), or (logits, routes (B, S, layers, topk) int).
NextTokenLogits = Callable[[torch.Tensor, torch.Tensor], Union[torch.Tensor, tuple]]


@dataclass(frozen=True)
class SamplingSettings:
    """What the capture sampler needs (a view of ``generation.*`` and ``replay.sample_support.*``).

    Attributes:
        temperature, top_k, top_p, min_p: passed to :func:`nemo_replay.capture.sample`.
        max_new_tokens: tokens sampled per response.
        stop_token_id: a sampled token that ends a response (kept with its row), or None.
        row_width: columns of fixed-width support rows (>= top_k); None: ragged rows, each its support.
    """

    temperature: float
    top_k: Optional[int]
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 16
    stop_token_id: Optional[int] = None
    row_width: Optional[int] = None


@dataclass
class Rollout:
    """One rollout batch.

    Attributes:
        batch: canonical batch with ``support`` (always captured here; drop it for replay off)
            and ``rollout_logprobs`` (B, A) float32.
        prompts: the B prompts, each (P_i,) int64 on the CPU.
        responses: the B responses, each (R_i,) int64 on the CPU.
    """

    batch: ReplayBatch
    prompts: list[torch.Tensor]
    responses: list[torch.Tensor]


def left_pad(rows: Sequence[torch.Tensor], pad_id: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D int tensors left-padded: ``(sequences (B, S) int64, attention_mask (B, S) bool)``."""
    width = max(int(r.numel()) for r in rows)
    seq = torch.full((len(rows), width), pad_id, dtype=torch.int64, device=device)
    mask = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        n = int(r.numel())
        seq[i, width - n :] = r.to(device=device, dtype=torch.int64)
        mask[i, width - n :] = True
    return seq, mask


@torch.no_grad()
def generate(
    next_token_logits: NextTokenLogits,
    prompts: Sequence[torch.Tensor],
    settings: SamplingSettings,
    *,
    generator: Optional[torch.Generator] = None,
    device: Union[str, torch.device] = "cpu",
    pad_id: int = 0,
) -> Rollout:
    """Sample one response per prompt, capturing each token's support.

    Args:
        next_token_logits: ``(sequences (B, S) int64, attention_mask (B, S) bool) -> (B, V)``
            float logits at the last column; it must run the trainer's own forward.
            Called exactly ``max_new_tokens`` times (collective-safe: every rank calls it
            equally often even when its rows stop early). It may return ``(logits, routes)``
            with ``routes (B, S, layers, topk)`` int, the MoE routes of every column (R3).
        prompts: B prompts, each (P_i,) int, P_i >= 1.
        settings: sampler settings.
        generator: a ``torch.Generator`` on ``device`` for reproducible draws.
        device: where the buffer and the returned batch live.

    Returns:
        a :class:`Rollout`.
    """
    B = len(prompts)
    T = settings.max_new_tokens
    seq, mask = left_pad(prompts, pad_id, device)
    active = torch.ones(B, dtype=torch.bool, device=device)
    resp_len = torch.zeros(B, dtype=torch.int64, device=device)
    logprobs = torch.zeros(B, T, dtype=torch.float32, device=device)
    step_rows, step_owner = [], []
    routes = None  # (B, S_final, layers, topk) token routes, filled as columns are first processed
    for t in range(T):
        logits = next_token_logits(seq, mask)
        if isinstance(logits, tuple):
            logits, step_routes = logits
            routes = _record_routes(routes, step_routes, seq.shape[1], T)
        rows = torch.nonzero(active).flatten()
        ids = torch.full((B,), pad_id, dtype=torch.int64, device=device)
        if rows.numel():
            drawn, lp, support = sample(
                logits[rows], temperature=settings.temperature, top_k=settings.top_k,
                top_p=settings.top_p, min_p=settings.min_p, generator=generator,
            )
            ids[rows] = drawn
            logprobs[rows, t] = lp
            step_rows.append(support)
            step_owner.append(torch.stack([rows, torch.full_like(rows, t)], 1))
            resp_len[rows] += 1
        seq = torch.cat([seq, ids[:, None]], 1)
        mask = torch.cat([mask, active[:, None]], 1)
        if settings.stop_token_id is not None:
            active &= ids != settings.stop_token_id
    return _assemble(prompts, seq, mask, resp_len, logprobs, step_rows, step_owner, settings, pad_id, routes)


def _record_routes(routes, step_routes: torch.Tensor, width: int, T: int) -> torch.Tensor:
    """Keep the routes of the columns this step processed first: all of them at t = 0, else the last."""
    if step_routes.shape[1] != width:
        raise ValueError(f"routes cover {step_routes.shape[1]} columns, the buffer holds {width}")
    if routes is None:
        B, _, layers, topk = step_routes.shape
        routes = torch.full((B, width + T, layers, topk), -1, dtype=torch.int64, device=step_routes.device)
        routes[:, :width] = step_routes
    else:
        routes[:, width - 1] = step_routes[:, width - 1]
    return routes


def _token_routes(routes: torch.Tensor, mask: torch.Tensor) -> PackedTensor:
    """Per trajectory the routes of its real tokens, ``(L_i, layers, topk)`` each, packed."""
    real = routes[:, : mask.shape[1]][mask]  # (sum L_i, layers, topk), trajectory-major
    unknown = real[:, 0, 0] < 0  # the final sampled token of each row: never fed back
    real[unknown] = torch.arange(routes.shape[-1], dtype=torch.int64, device=routes.device)
    return PackedTensor(real, lengths_to_cu_seqlens(mask.sum(1).cpu()).to(routes.device))


def _assemble(prompts, seq, mask, resp_len, logprobs, step_rows, step_owner, settings, pad_id, routes=None) -> Rollout:
    B, T = logprobs.shape
    lengths = resp_len.tolist()  # one host copy; the per-trajectory slices below take Python ints
    sampled = seq[:, seq.shape[1] - T :].cpu()
    responses = [sampled[i, :n] for i, n in enumerate(lengths)]
    # Rows were collected step-major (t, then active trajectory); the batch wants them
    # trajectory-major (i, then t). Sort the (trajectory, step) owner pairs to get the order.
    owner = torch.cat(step_owner)
    order = torch.argsort(owner[:, 0] * T + owner[:, 1])
    step_major = type(step_rows[0]).cat(step_rows)
    one_per_row = step_major.resegment(torch.arange(step_major.num_rows + 1))  # so gather reorders single rows
    rows = one_per_row.gather(order.cpu()).resegment(lengths_to_cu_seqlens(resp_len.cpu()))
    # Step t of trajectory i is its token t: the step-major matrix already reads in token order.
    flat = logprobs[torch.arange(T, device=logprobs.device)[None, :] < resp_len[:, None]]
    # Real tokens in buffer order: the prompt (a suffix of the prompt block) then R_i responses;
    # a stopped row's trailing pads carry mask False and drop out.
    token_routes = None if routes is None else _token_routes(routes, mask)
    return rollout_batch(prompts, responses, flat, rows, row_width=settings.row_width, pad_id=pad_id, device=seq.device, routes=token_routes)


def rollout_batch(
    prompts: Sequence[torch.Tensor],
    responses: Sequence[torch.Tensor],
    logprobs: torch.Tensor,
    support: Union[PackedTensor, RaggedSupport],
    *,
    row_width: Optional[int] = None,
    pad_id: int = 0,
    device: Union[str, torch.device] = "cpu",
    routes: Optional[PackedTensor] = None,
    token_mask: Optional[torch.Tensor] = None,
) -> Rollout:
    """The canonical batch of B sampled responses, whatever sampled them.

    Args:
        prompts: B prompts, each (P_i,) int.
        responses: B responses, each (R_i,) int, R_i >= 1.
        logprobs: (sum R_i,), float32, response-major: each token's processed log-prob.
        support: one segment of R_i rows per response (fixed-width or CSR).
        row_width: fixed-width rows narrower than this are padded with -1 to it; None: the
            batch carries CSR rows (fixed-width ones lose their -1 padding).
        routes: per-trajectory MoE routes of the real tokens, or None.
        token_mask: (sum R_i,) bool, response-major, or None (every token): False keeps a
            token out of the loss (an engine adapter's flagged position, whose row is empty).

    Right-aligned ``(B, A)`` response coordinates, ``A = max R_i``: token j of trajectory i
    sits at column ``A - R_i + j``. Example A = 3, R = [3, 1]: row 0 holds tokens [0 1 2],
    row 1 holds [- - 0] (- = left of the response: loss mask False, log-prob 0).
    """
    lengths = [int(r.numel()) for r in responses]
    resp_len = torch.tensor(lengths, dtype=torch.int64, device=device)
    A = max(lengths)  # from the host list: no read back from the device
    loss_mask = torch.arange(A, device=device)[None, :] >= (A - resp_len)[:, None]
    rollout_lp = torch.zeros(len(responses), A, dtype=torch.float32, device=device)
    rollout_lp[loss_mask] = logprobs.to(device=device, dtype=torch.float32)  # row-major = response-major
    if token_mask is not None:
        if token_mask.shape != (sum(lengths),) or token_mask.dtype != torch.bool:
            raise ValueError(f"rollout_batch: token_mask must be ({sum(lengths)},) bool, one per response token, got "
                             f"{tuple(token_mask.shape)} {token_mask.dtype}; pass the responses' tokens in order, "
                             f"e.g. an engine adapter's loss_mask per response, concatenated")
        loss_mask[loss_mask.clone()] = token_mask.to(device)
    # Rows cost what they hold: CSR unless fixed-width rows were asked for (the scorer pads
    # them on the device, to the width they were captured at: docs/design.md §4).
    if not row_width:
        support = RaggedSupport.of(support)
    elif support.width_bound <= row_width:
        support = support.to_padded(row_width)  # rows wider than the width (ties) stay as they came
    full = [torch.cat([p.to(device=device, dtype=torch.int64), r.to(device=device, dtype=torch.int64)]) for p, r in zip(prompts, responses)]
    sequences, attention_mask = left_pad(full, pad_id, device)
    batch = ReplayBatch(
        sequences=sequences,
        attention_mask=attention_mask,
        response_lengths=resp_len,
        loss_mask=loss_mask,
        support=support.to(device),
        routes=routes,
        rollout_logprobs=rollout_lp,
    )
    return Rollout(batch, [p.cpu() for p in prompts], [r.cpu().to(torch.int64) for r in responses])


def replay_batches_from_generation(
    rollout: HFRollout,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    advantages: Optional[torch.Tensor] = None,
    micro_batch_size: Optional[int] = None,
    row_width: Optional[int] = None,
    pad_id: int = 0,
    device: Union[str, torch.device, None] = None,
) -> list[ReplayBatch]:
    """The trainer micro-batches of one :func:`generate_with_support` call.

    The canonical batch is built by :func:`rollout_batch`, as
    for every other sampler: each prompt's real tokens followed by its completion,
    re-left-padded, ``R_i`` support rows per trajectory, the loss mask and the rollout
    log-probs right-aligned ``(B, A)`` with ``A = max R_i``. Example, prompts ``[_ a b]``
    and ``[c d e]`` (``_`` = left pad), completions ``[x y #]`` and ``[z]``: sequences
    ``[a b x y #]`` and ``[_ c d e z]``, loss mask ``[[1 1 1], [0 0 1]]`` over the last
    ``A = 3`` columns.

    Args:
        rollout: what :func:`generate_with_support` returned for these prompts.
        input_ids: (B, P), int64, the left-padded prompts given to it.
        attention_mask: (B, P), bool or int, 0 on the left padding (the same one).
        advantages: optional (B,) or (B, A) float, stored on the batch (``A`` = the longest
            completion); set it later on each micro-batch when rewards come after.
        micro_batch_size: trajectories per micro-batch, in order (the last may be smaller);
            None: one micro-batch.
        row_width: fixed-width rows narrower than this are padded with -1 to it.
        pad_id: the token of the new left padding (masked out, any valid id).
        device: where the batches live; default ``input_ids.device``.

    Returns:
        a list of :class:`~nemo_replay.batch.ReplayBatch` with ``support`` and
        ``rollout_logprobs``, ready for the roles (``ReplayRoles``, ``ReplayCallback``).
    """
    B = len(rollout.completions)
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape or input_ids.shape[0] != B:
        raise ValueError(
            f"replay_batches_from_generation: input_ids and attention_mask (B={B}, P) expected, the prompts given to "
            f"generate_with_support, got {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise ValueError(f"replay_batches_from_generation: micro_batch_size must be an int >= 1 or None, got {micro_batch_size!r}")
    mask = attention_mask.bool()
    prompts = [input_ids[i][mask[i]] for i in range(B)]
    captured = rollout.captured
    batch = rollout_batch(
        prompts, rollout.completions, captured.logprobs, captured.support,
        row_width=row_width, pad_id=pad_id, device=input_ids.device if device is None else device,
    ).batch
    if advantages is not None:
        advantages = torch.as_tensor(advantages, dtype=torch.float32, device=batch.sequences.device)
        if advantages.shape not in ((B,), (B, batch.response_width)):
            raise ValueError(
                f"replay_batches_from_generation: advantages of shape {tuple(advantages.shape)}; expected ({B},) or "
                f"({B}, {batch.response_width}) (one per trajectory, or per token of the longest completion)"
            )
        batch.advantages = advantages
    size = B if micro_batch_size is None else micro_batch_size
    if size >= B:
        return [batch]
    return [batch.select(torch.arange(start, min(start + size, B))) for start in range(0, B, size)]
