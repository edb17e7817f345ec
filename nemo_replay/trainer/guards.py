"""Run guards: no non-finite update is ever applied; a hung collective becomes an error.

Non-finite updates. :func:`check_update` runs between the backward and the optimizer step
of every minibatch. A NaN or infinite policy loss (on any rank) or gradient norm stops the
run with a :class:`NonFiniteError` naming the step, the quantity and the likely causes;
the optimizer step is never taken, so the weights stay those of the last good update. One
all-reduce of two flags per minibatch keeps every rank's decision the same (a loss that
is NaN on one rank only would otherwise let the others step and then wait forever).

Collectives. The process groups of a run time out after ``trainer.collective_timeout_s``
(gloo and NCCL honour it). The backend's error says only that a receive timed out, or that
a peer closed its connection; :func:`collective_failure` turns it into a
:class:`CollectiveError` naming the collective (the innermost ``torch.distributed`` frame
of the traceback: ``all_reduce``, ``broadcast``, FSDP's ``wait_for_unshard``, ...), the
line of this package that called it, the step, and what to do.
"""

from __future__ import annotations

import math
import re
import traceback
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["NonFiniteError", "CollectiveError", "check_update", "diverged_rollout", "collective_failure"]

_NON_FINITE_WORDS = re.compile(r"\b(nan|inf|infinity|non-finite)\b", re.IGNORECASE)
_TIMEOUT_WORDS = ("timed out", "timeout", "time out")
_PEER_WORDS = ("connection closed by peer", "connection reset", "broken pipe", "connection refused", "socket closed")


class NonFiniteError(ValueError):
    """A NaN or infinite loss or gradient norm: the update was not applied."""


class CollectiveError(RuntimeError):
    """A collective timed out or lost a peer: another rank stopped, crashed or hangs."""


def _causes(cfg) -> str:
    tr, m = cfg.trainer, cfg.model
    causes = [f"trainer.lr={tr.lr:g} too large for this model (the weights diverge; try a smaller value, e.g. {tr.lr / 10:g})"]
    if tr.grad_clip == 0:
        causes.append("trainer.grad_clip=0, which turns clipping off (set e.g. trainer.grad_clip=1.0)")
    else:
        causes.append(f"trainer.grad_clip={tr.grad_clip:g} letting large updates through (lower it)")
    if m.dtype == "float16":
        causes.append("model.dtype=float16 overflowing (use bfloat16 or float32)")
    return "; ".join(causes)


def check_update(
    cfg, *, step: int, minibatch: int, losses: Sequence[torch.Tensor], grad_norm: float,
    last_checkpoint: Optional[Path] = None, device: Optional[torch.device] = None,
) -> None:
    """Raise :class:`NonFiniteError` before a non-finite update (see the module doc); collective under a group.

    One host read however many micro-batches: the losses are tested on their device and the
    verdict travels with the gradient norm's in one flags tensor.

    Args:
        cfg: the run's recipe (for the likely causes).
        step, minibatch: where in the run (0-based).
        losses: this rank's policy losses of the minibatch, one 0-d tensor per micro-batch.
        grad_norm: the global gradient norm before clipping.
        last_checkpoint: where a resume would start, for the message.
        device: where the flags tensor lives (the process group's device).
    """
    # flags = [this rank has a non-finite loss, the gradient norm is not finite]
    flags = torch.tensor([0, int(not math.isfinite(grad_norm))], dtype=torch.int64, device=device)
    if losses:
        finite = torch.stack([torch.as_tensor(loss, device=flags.device).detach().reshape(()).isfinite() for loss in losses])
        flags[0] = (~finite.all()).to(torch.int64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    loss_bad, norm_bad = (bool(v) for v in flags.tolist())
    if not (loss_bad or norm_bad):
        return
    what = []
    if loss_bad:
        shown = next((v for v in (float(loss) for loss in losses) if not math.isfinite(v)), None)  # None: another rank's
        what.append(f"the policy loss is {shown}" if shown is not None else "the policy loss is not finite on another rank")
    if norm_bad:
        what.append(f"the gradient norm is {grad_norm}")
    where = f"a resume starts from {last_checkpoint}" if last_checkpoint else "no checkpoint was written yet"
    raise NonFiniteError(
        f"step {step}, minibatch {minibatch}: {' and '.join(what)} before the optimizer step; the update was not "
        f"applied and the run stops. Likely causes: {_causes(cfg)}. Continue with the fix: the same command with the "
        f"changed flag and --resume-override <flag> (e.g. --resume-override trainer.lr; {where}), or start a new run"
    )


def diverged_rollout(cfg, exc: Exception, *, step: int, model, last_checkpoint: Optional[Path] = None) -> Optional[NonFiniteError]:
    """A :class:`NonFiniteError` when sampling failed on non-finite logits (``exc`` says NaN or inf); else None.

    Finite gradients can still carry the weights too far (a learning rate of 1e20): the
    next rollout then meets non-finite logits. Costs nothing unless sampling failed.
    """
    # Whole words: "inf" and "nan" also sit inside "inference", "information", "finance".
    if not _NON_FINITE_WORDS.search(str(exc)):
        return None
    with torch.no_grad():
        # This rank's shards only (DTensor.to_local): other ranks may not be here to reduce with.
        local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in model.parameters()]
        peak = max((float(t.abs().max()) for t in local if t.numel()), default=0.0)
    weights = "are not finite" if not math.isfinite(peak) else f"reach |w| = {peak:.3g} (this rank's shards)"
    where = f"a resume starts from {last_checkpoint}" if last_checkpoint else "no checkpoint was written yet"
    first = str(exc).strip().splitlines()[0]
    return NonFiniteError(
        f"step {step}: sampling met non-finite logits ({first}); the policy's weights {weights} after the last "
        f"update, so the run stops. Likely causes: {_causes(cfg)}. Continue with the fix: the same command with the "
        f"changed flag and --resume-override <flag> ({where}), or start a new run"
    )


def _frames(tb) -> tuple[Optional[str], Optional[str]]:
    """(the innermost torch.distributed function, the innermost nemo_replay call site) of a traceback."""
    op = site = None
    for frame, lineno in traceback.walk_tb(tb):
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/distributed/" in path and not path.endswith("c10d_logger.py"):
            op = frame.f_code.co_name
        elif "/nemo_replay/" in path:
            site = f"{path[path.rindex('/nemo_replay/') + 1:]}:{lineno} ({frame.f_code.co_name})"
    return op, site


def collective_failure(exc: BaseException, *, step: int, timeout_s: float, last_checkpoint: Optional[Path] = None) -> Optional[CollectiveError]:
    """A :class:`CollectiveError` for a backend's timeout or lost-peer error; None for any other error."""
    text = str(exc).lower()
    if any(w in text for w in _TIMEOUT_WORDS):
        why = f"waited trainer.collective_timeout_s={timeout_s:g} s without every rank joining"
    elif any(w in text for w in _PEER_WORDS):
        why = "lost a peer rank (its connection closed)"
    else:
        return None
    op, site = _frames(exc.__traceback__)
    name = f"the collective {op}" if op else "a collective"
    called = f", called from {site}," if site else ""
    rank = f" on rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else ""
    resume = (
        f"Then run the same command to resume from {last_checkpoint}" if last_checkpoint
        else "No checkpoint was written yet"
    )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CollectiveError(
        f"step {step}{rank}: {name}{called} {why}: another rank stopped, crashed or hangs. Look at the other ranks' "
        f"output for the first error; if steps legitimately take longer, raise trainer.collective_timeout_s. "
        f"{resume}. (backend: {first})"
    )
