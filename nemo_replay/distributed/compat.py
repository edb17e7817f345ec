"""FSDP2's and DTensor's names wherever this torch keeps them (the package takes ``torch>=2.4``).

``fully_shard`` and ``FSDPModule`` are public in ``torch.distributed.fsdp`` from torch 2.6 and
live in ``torch.distributed._composable.fsdp`` in 2.4 and 2.5; ``DTensor``, ``Replicate`` and
``Shard`` are public in ``torch.distributed.tensor`` from 2.5 and live in
``torch.distributed._tensor`` in 2.4. Imported when asked for, so that importing the package
loads neither.
"""

from __future__ import annotations

__all__ = ["dtensor_names", "fsdp2_names"]


def fsdp2_names():
    """``(fully_shard, FSDPModule)``."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:  # torch 2.4 and 2.5
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard
    return fully_shard, FSDPModule


def dtensor_names():
    """``(DTensor, Replicate, Shard)``."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor, Replicate, Shard
    return DTensor, Replicate, Shard
