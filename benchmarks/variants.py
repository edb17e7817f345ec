"""The measured variants: full-vocabulary baselines, the two-projection design, and the scorer.

Each builder returns ``fn(backward: bool)``: one forward (autograd recording, as in
training) and, with ``backward=True``, the gradient of ``sum(c * logp)`` with respect to
the differentiable inputs (logits, or hidden states and LM-head weight). Gradients are
fresh tensors every call, as with ``zero_grad(set_to_none=True)``, except for
``support-sparse``, whose LM-head weight keeps a persistent gradient buffer.

Logits mode, source (N, V):
    full        ``log_softmax(logits.float(), -1).gather(1, x)``, float32 math
    chunked     the same over position chunks of ``chunk`` rows (each chunk's
                ``[chunk, V]`` float32 scores are freed before the next)
    replay-off  ``nemo_replay`` ``score_full_vocabulary`` (the package's full-vocabulary path)
    plain       a plain gather+logsumexp scorer over the same rows (:func:`plain_scores`): what a
                trainer would write by hand, with no checks
    support     ``score_aligned_support`` (validation on, as by default) on rows checked
                where they entered (``validate_support`` at collation records it), as a
                trainer's rows are
    support-unchecked  the same on rows never checked (a fresh copy of the rows each
                call): the scorer sorts every row (the default's cost before rows
                recorded their check)
    support-nv  ``validate=False``
Logits mode against its floor (:func:`floor_variants`), forward only:
    gather      the limit: the bare ``torch.gather(logits, 1, ids)`` of the (N, k) support ids,
                already int64 and in range (built before timing): the random read any
                support scorer needs
    plain       :func:`plain_scores`, with the same extras as the scorer
    support     ``score_aligned_support``, the default call, with the extras (entropy, support mass)
Hidden mode, hidden (N, H), weight (V, H):
    full        ``log_softmax((hidden @ weight.T).float(), -1).gather(1, x)``
    chunked     per position chunk under ``torch.utils.checkpoint``: the ``[chunk, V]``
                logits are recomputed in backward instead of kept
    two-proj    two separate projections: the support pairs through
                ``weight[ids]`` (a kept ``[pairs, H]`` activation) and the sampled token
                through ``weight[x]``, each with its own dense weight gradient
    support     ``score_aligned_support(hidden, ..., lm_head_weight=weight)``, a fresh dense
                weight gradient (the trainer keeps no gradient buffer)
    support-sparse  the same with a persistent ``weight.grad`` (``loss.backward()``): the
                backward adds the support's rows into it and returns no dense gradient
    support-main-grad  the same through megatron-core's protocol (``main_grad`` and
                ``grad_added_to_main_grad`` on the weight): rows go into ``main_grad``
    fill        the reference of the two above: ``buffer.fill_(0)`` of a (V, H) float32 buffer
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from benchmarks.workloads import Channels
from nemo_replay.scoring.scorer import score_aligned_support, score_full_vocabulary
from nemo_replay.support.packed import PackedTensor

__all__ = [
    "LOGITS_VARIANTS", "HIDDEN_VARIANTS", "FLOOR_EXTRAS", "logits_variant", "hidden_variant", "plain_scores",
    "floor_variants", "sparse_gradient_variants",
]

LOGITS_VARIANTS = ("full", "chunked", "replay-off", "plain", "support", "support-unchecked", "support-nv")
HIDDEN_VARIANTS = ("full", "chunked", "two-proj", "support", "support-sparse")
FLOOR_EXTRAS = ("", "entropy", "mass")


def _log_softmax_pick(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(z.float(), dim=-1).gather(1, x[:, None]).squeeze(1)


def _grad_fn(inputs: tuple[torch.Tensor, ...], forward: Callable[[], torch.Tensor], coeff: torch.Tensor):
    def run(backward: bool):
        logp = forward()
        if backward:
            return torch.autograd.grad((logp * coeff).sum(), inputs)
        return logp

    return run


def plain_scores(logits: torch.Tensor, ch: Channels, *, entropy: bool = False, mass: bool = False):
    """(logp, entropy or None, log support mass or None), each (N,) float32: a plain gather+logsumexp scorer.

    Every position has a row (the benchmark's channels); no argument or row is checked::

        rows = support[row_ids]                      (N, k) int32, -1 padded
        z = gather(logits, 1, rows.clamp(min=0)).float(), -inf where padded
        logp = logits[i, sampled[i]] - logsumexp(z)
        entropy = logsumexp(z) - sum softmax(z) * z      mass = logsumexp(z) - logsumexp(logits[i])
    """
    rows = ch.rows.index_select(0, ch.row_ids)
    present = rows >= 0
    z = torch.gather(logits, 1, rows.clamp(min=0).long()).float().masked_fill(~present, float("-inf"))
    lse = torch.logsumexp(z, 1)
    logp = torch.gather(logits, 1, ch.sampled[:, None]).squeeze(1).float() - lse
    ent = None
    if entropy:
        p = torch.softmax(z, 1)
        ent = lse - (p * z.masked_fill(~present, 0)).sum(1)
    logmass = (lse - torch.logsumexp(logits.detach().float(), 1)).detach() if mass else None
    return logp, ent, logmass


def floor_variants(logits: torch.Tensor, ch: Channels, extra: str = "", *, shard=None, plain=None) -> dict:
    """name -> ``fn()``: one forward of the gather limit, the plain scorer and the scorer (see the module docstring).

    ``extra``: ``""``, ``"entropy"`` or ``"mass"`` (support mass), for the plain scorer and the
    scorer alike. ``shard`` / ``plain``: a tensor-parallel rank's vocabulary shard and its
    plain scorer (benchmarks/tp.py); default the whole vocabulary and :func:`plain_scores`.
    """
    if extra not in FLOOR_EXTRAS:
        raise ValueError(f"floor extra must be one of {FLOOR_EXTRAS}, got {extra!r}")
    start = 0 if shard is None else shard.start
    rows = ch.rows.index_select(0, ch.row_ids).long()
    ids = (rows - start).clamp_(0, logits.shape[1] - 1)  # this rank's columns, built before timing
    src = logits.detach()
    kw = {"compute_entropy": extra == "entropy", "compute_support_mass": extra == "mass"}
    plain = plain or (lambda: plain_scores(logits, ch, entropy=extra == "entropy", mass=extra == "mass"))
    return {
        "gather": lambda: torch.gather(src, 1, ids),
        "plain": plain,
        "support": lambda: score_aligned_support(logits, ch.sampled, ch.row_ids, ch.loss_mask, ch.support, shard=shard, **kw),
    }


def logits_variant(name: str, logits: torch.Tensor, ch: Channels, *, chunk: int = 512):
    """``fn(backward)`` for a logits-mode variant; ``logits`` (N, V) requires grad."""
    x = ch.sampled
    coeff = torch.linspace(-1.0, 1.0, x.numel(), device=x.device)
    if name == "full":
        forward = lambda: _log_softmax_pick(logits, x)  # noqa: E731
    elif name == "chunked":
        forward = lambda: torch.cat(  # noqa: E731
            [_log_softmax_pick(logits[i : i + chunk], x[i : i + chunk]) for i in range(0, x.numel(), chunk)]
        )
    elif name == "replay-off":
        forward = lambda: score_full_vocabulary(logits, x).logprobs  # noqa: E731
    elif name == "plain":
        forward = lambda: plain_scores(logits, ch)[0]  # noqa: E731
    elif name in ("support", "support-nv"):
        validate = name == "support"
        forward = lambda: score_aligned_support(  # noqa: E731
            logits, x, ch.row_ids, ch.loss_mask, ch.support, validate=validate
        ).logprobs
    elif name == "support-unchecked":
        cu = ch.support.cu_seqlens
        forward = lambda: score_aligned_support(  # noqa: E731
            logits, x, ch.row_ids, ch.loss_mask, PackedTensor(ch.rows.clone(), cu)
        ).logprobs
    else:
        raise ValueError(f"logits variant must be one of {LOGITS_VARIANTS}, got {name!r}")
    return _grad_fn((logits,), forward, coeff)


def _two_projections(hidden: torch.Tensor, weight: torch.Tensor, ch: Channels) -> torch.Tensor:
    rows = ch.rows
    present = rows >= 0
    ids = rows.clamp(min=0).long()
    h = hidden.float()
    z = torch.einsum("nh,nwh->nw", h, weight[ids].float())  # projection 1: [pairs, H] kept for backward
    z = z.masked_fill(~present, float("-inf"))
    zs = (h * weight[ch.sampled].float()).sum(-1)  # projection 2: the sampled token
    return zs - torch.logsumexp(z, dim=1)


def hidden_variant(name: str, hidden: torch.Tensor, weight: torch.Tensor, ch: Channels, *, chunk: int = 128):
    """``fn(backward)`` for a hidden-mode variant; ``hidden`` (N, H) and ``weight`` (V, H) require grad."""
    x = ch.sampled
    coeff = torch.linspace(-1.0, 1.0, x.numel(), device=x.device)

    def chunk_scores(h, w, xs):
        return _log_softmax_pick(h @ w.t(), xs)

    if name == "full":
        forward = lambda: chunk_scores(hidden, weight, x)  # noqa: E731
    elif name == "chunked":
        forward = lambda: torch.cat(  # noqa: E731
            [
                checkpoint(chunk_scores, hidden[i : i + chunk], weight, x[i : i + chunk], use_reentrant=False)
                for i in range(0, x.numel(), chunk)
            ]
        )
    elif name == "two-proj":
        forward = lambda: _two_projections(hidden, weight, ch)  # noqa: E731
    elif name in ("support", "support-sparse"):
        forward = lambda: score_aligned_support(  # noqa: E731
            hidden, x, ch.row_ids, ch.loss_mask, ch.support, lm_head_weight=weight
        ).logprobs
    else:
        raise ValueError(f"hidden variant must be one of {HIDDEN_VARIANTS}, got {name!r}")
    if name == "support-sparse":
        return _into_buffers(hidden, weight, forward, coeff)
    return _grad_fn((hidden, weight), forward, coeff)


def _into_buffers(hidden: torch.Tensor, weight: torch.Tensor, forward, coeff: torch.Tensor):
    """``fn(backward)`` with ``loss.backward()`` into a persistent ``weight.grad`` (allocated here,
    zero, before any timing or memory baseline) and a fresh hidden gradient each call."""
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)

    def run(backward: bool):
        logp = forward()
        if backward:
            hidden.grad = None
            (logp * coeff).sum().backward(inputs=[hidden, weight])
            return hidden.grad, weight.grad
        return logp

    return run


def sparse_gradient_variants(hidden: torch.Tensor, weight: torch.Tensor, ch: Channels) -> dict:
    """name -> ``fn()`` for the persistent-buffer round-robin: forward+backward into a kept ``.grad``
    (support-sparse), into megatron-core's ``main_grad`` (support-main-grad), and the reference
    ``fill`` of a (V, H) float32 buffer. ``weight`` (V, H) float32 requires grad; its ``.grad`` is
    kept between calls.

    The main_grad variant follows megatron's DistributedDataParallel: ``main_grad`` is the
    buffer, ``grad_added_to_main_grad`` is reset before each backward; the dummy gradient the
    backward hands autograd lands in ``.grad`` (no copy: autograd keeps the tensor), which
    megatron's hook would drop, so it is set to None after the step.
    """
    fill_buffer = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    x = ch.sampled
    coeff = torch.linspace(-1.0, 1.0, x.numel(), device=x.device)
    sparse = _into_buffers(hidden, weight, lambda: score_aligned_support(
        hidden, x, ch.row_ids, ch.loss_mask, ch.support, lm_head_weight=weight).logprobs, coeff)
    megatron_weight = weight.detach().requires_grad_()  # a leaf of its own: .grad stays None
    megatron_weight.main_grad = torch.zeros_like(weight)

    def main_grad():
        megatron_weight.grad_added_to_main_grad = False
        hidden.grad = None
        logp = score_aligned_support(hidden, x, ch.row_ids, ch.loss_mask, ch.support, lm_head_weight=megatron_weight).logprobs
        (logp * coeff).sum().backward(inputs=[hidden, megatron_weight])
        megatron_weight.grad = None  # the dummy; megatron's hook drops it

    return {"fill": lambda: fill_buffer.fill_(0), "support-sparse": lambda: sparse(True), "support-main-grad": main_grad}
