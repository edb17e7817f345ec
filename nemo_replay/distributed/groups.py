"""Process groups: a group's size and this rank's place in it, and its ranks failing together.

Every process group is an explicit argument; ``None`` means no group (one rank, no
collective). The scorer, the layouts, the strategies, the integrations and the checkpoints
all ask these questions here.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

__all__ = ["group_size_rank", "flag_device", "agree", "check_together", "RankError"]


def group_size_rank(group) -> tuple[int, int]:
    """(size, this process's rank within ``group``); (1, 0) for None.

    Any other group needs torch.distributed initialized (its own calls raise otherwise).
    """
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def flag_device(group, fallback: torch.device) -> torch.device:
    """Where a flag all-reduced over ``group`` lives: the CPU for gloo, ``fallback`` (the tensors'
    device) for any other backend or without a group."""
    if group is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return fallback
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else fallback


class RankError(RuntimeError):
    """What another rank raised inside :func:`agree`, when its type cannot be rebuilt from its message."""


# Never held back for the others: the process is being stopped (its peers see the group fail).
_PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit)


def _rebuilt(kind: tuple, message: str) -> BaseException:
    """An exception of the type ``kind`` (module, qualified name) with ``message``; a
    :class:`RankError` naming that type when the type cannot be imported or built from one string."""
    module, qualname = kind
    try:
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(cls, _PASS_THROUGH):
            return cls(message)
    except Exception:
        pass
    return RankError(f"{message} ({module}.{qualname})")


def agree(fn, group, *, device, name: str):
    """Run ``fn`` on every rank of ``group``; when any rank raises, every rank raises the same error.

    A check that fails on one rank only (its slice of a sequence under context or sequence
    parallelism, a batch check, an out-of-memory error) would leave the others waiting in the
    next collective until the group's timeout. Here one int32 MAX all-reduce tells every rank
    (plus one object all-gather when some rank failed); each then raises an exception of the
    first failing rank's type (a :class:`RankError` naming the type when it cannot be rebuilt
    from a message) with that rank's message prefixed with ``"<name> rank r of n: "``, chained
    on the failing rank to its own error. ``KeyboardInterrupt``, ``SystemExit`` and
    ``GeneratorExit`` propagate at once. With ``group`` None or of size 1 it is ``fn()``.

    Args:
        device: where the flag lives (the group's backend: CUDA for NCCL, CPU for gloo).
        name: the group's name in the message (``"CP"``, ``"SP"``).
    """
    size, _ = group_size_rank(group)
    if size == 1:
        return fn()
    error, result = None, None
    try:
        result = fn()
    except _PASS_THROUGH:
        raise
    except BaseException as exc:
        error = exc
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag) == 0:
        return result
    got = [None] * size
    mine = None if error is None else ((type(error).__module__, type(error).__qualname__), str(error))
    dist.all_gather_object(got, mine, group=group)
    rank = next(r for r, m in enumerate(got) if m is not None)
    kind, message = got[rank]
    raise _rebuilt(kind, f"{name} rank {rank} of {size}: {message}") from error


def check_together(fn, group, *, name: str, device: torch.device):
    """``fn()`` on every rank of ``group``: when any rank raises, every rank raises the same error,
    prefixed with ``"<name> rank r of n: "`` (:func:`agree`).

    For a check of a batch that the ranks hold different shards of, run before a collective
    (a rank that failed alone would leave the others waiting in it). ``device``: the device the
    group's backend reduces on (the accelerator under NCCL); under gloo the flag goes to the CPU.
    """
    return agree(fn, group, device=flag_device(group, torch.device(device)), name=name)
