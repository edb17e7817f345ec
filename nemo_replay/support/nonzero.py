"""Where a 1-D mask is set, at a size known beforehand: no host read, on every torch the package
takes (``torch>=2.4``) and every device.

The scorer and the compact decode learn how many entries a mask sets from a read they make
anyway (or from a header), then need their indices without a second read: what
``torch.nonzero_static`` does. But torch has that operation on CUDA only from 2.6: the CUDA
kernel is missing from torch 2.4's and 2.5's ``native_functions.yaml`` (``nonzero_static:
dispatch: CPU: nonzero_static_cpu`` alone), so there it raises ``NotImplementedError`` on a
CUDA tensor. Where the device has it, it serves; elsewhere the same result comes from a
``cumsum`` and a ``scatter_`` (:func:`nonzero_static_portable`). Which one a device gets is
found once a process, by calling it on one element of that device.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["nonzero_static", "nonzero_static_portable"]


def nonzero_static(mask: torch.Tensor, size: int, fill_value: int = -1) -> torch.Tensor:
    """(size,) int64: the indices of ``mask``'s nonzero entries in order, the first ``size`` of
    them, then ``fill_value`` where it has fewer; ``torch.nonzero_static(mask, size=size,
    fill_value=fill_value).flatten()`` for a 1-D mask, with no host read."""
    if mask.dim() != 1:
        raise ValueError(f"nonzero_static: expected a 1-D mask, got shape {tuple(mask.shape)}; flatten it first")
    if _torch_has_it(mask.device.type):
        return torch.nonzero_static(mask, size=size, fill_value=fill_value).flatten()
    return nonzero_static_portable(mask, size, fill_value)


def nonzero_static_portable(mask: torch.Tensor, size: int, fill_value: int = -1) -> torch.Tensor:
    """What :func:`nonzero_static` returns, from operations every device has: each set entry's
    place in the output is the count of set entries before it; those past ``size``, and every
    unset entry, go to a spare last slot that is cut off."""
    device = mask.device
    kept = mask != 0
    place = torch.cumsum(kept, 0) - 1
    place = torch.where(kept & (place < size), place, size)
    out = torch.full((size + 1,), fill_value, dtype=torch.int64, device=device)
    out.scatter_(0, place, torch.arange(mask.numel(), dtype=torch.int64, device=device))
    return out[:size]


@functools.lru_cache(maxsize=None)
def _torch_has_it(device_type: str) -> bool:
    """Whether this torch runs ``nonzero_static`` on ``device_type`` (asked once a process)."""
    try:
        torch.nonzero_static(torch.zeros(1, dtype=torch.bool, device=device_type), size=1)
    except NotImplementedError:  # "Could not run 'aten::nonzero_static' with arguments from the 'CUDA' backend"
        return False
    return True
