"""Two guards every reader of ids repeats: an integer tensor, and ids inside a range.

Token ids, row ids, offsets and routes arrive from engines, wires and other frameworks in
any integer dtype (an engine's int32, a checkpoint's uint8). A float, complex or bool tensor
in their place is a caller's mistake each reader names in its own words; these answer the
question once.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

__all__ = ["is_integer", "first_outside"]


def is_integer(t) -> bool:
    """True for a tensor (or a support, anything with a torch ``dtype``) of an integer dtype: not
    float, complex or bool."""
    dtype = getattr(t, "dtype", None)
    return isinstance(dtype, torch.dtype) and not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def first_outside(ids, high: int, low: int = 0) -> Optional[int]:
    """The flat index of the first id outside ``[low, high)``, or None when all lie inside.

    ``ids``: a torch tensor (any integer dtype, compared in int64; one host read) or a numpy
    array. Errors name the position it returns.
    """
    if isinstance(ids, torch.Tensor):
        flat = ids.reshape(-1)
        if not flat.numel():
            return None
        try:  # the bounds in the ids' own dtype, read as Python ints: no widened copy of a long prompt
            least, most = torch.stack(torch.aminmax(flat)).tolist()
            if least >= low and most < high:
                return None
        except RuntimeError:  # a dtype aminmax does not take: the widened comparison below decides
            pass
        wide = flat.to(torch.int64)
        bad = torch.nonzero((wide < low) | (wide >= high))
        return int(bad[0]) if bad.numel() else None
    flat = np.asarray(ids).reshape(-1)
    if not flat.size or (flat.min() >= low and flat.max() < high):
        return None
    return int(np.flatnonzero((flat < low) | (flat >= high))[0])
