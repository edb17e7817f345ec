"""Reading another system's resolved recipe: a dotted key and the types its checks accept.

The NeMo-RL and verl recipe checks read plain mappings (a Hydra/OmegaConf config turned
into containers) and list every problem at once; these are the three reads they share.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["get_path", "is_int", "is_number"]


def get_path(cfg: Mapping[str, Any], path: str, default: Any = None) -> Any:
    """``cfg["a"]["b"]`` for ``path="a.b"``; ``default`` where a key or a mapping on the way is missing."""
    node: Any = cfg
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return default
        node = node[key]
    return node


def is_int(value: Any) -> bool:
    """An int that is not a bool (YAML's ``true`` is no size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
