"""The Fabric logger behind ``metrics.jsonl`` (docs/design.md §10): one JSON object per step.

Non-finite values are written as ``null`` (:func:`nemo_replay.trainer.loggers.metrics.row_text`), so
every line is strict JSON. Kept apart from :mod:`nemo_replay.trainer.loggers.metrics` because it
imports Lightning, which the readers of the rows do not need.
"""

from __future__ import annotations

import json
import os
from argparse import Namespace
from pathlib import Path
from typing import Any, Optional, Union

from lightning.fabric.loggers import Logger
from lightning.fabric.utilities.rank_zero import rank_zero_only

from nemo_replay.trainer.loggers.metrics import row_text

__all__ = ["JsonlLogger"]


class JsonlLogger(Logger):
    """Fabric logger appending one JSON object per ``log_metrics`` call to ``<root_dir>/metrics.jsonl``.

    Writes on global rank 0 only; ``log_hyperparams`` writes ``hparams.json``.
    """

    def __init__(self, root_dir: Union[str, os.PathLike], filename: str = "metrics.jsonl"):
        super().__init__()
        self._root = Path(root_dir)
        self._filename = filename

    @property
    def name(self) -> Optional[str]:
        return "jsonl"

    @property
    def version(self) -> Optional[Union[int, str]]:
        return 0

    @property
    def root_dir(self) -> Optional[str]:
        return str(self._root)

    @property
    def path(self) -> Path:
        return self._root / self._filename

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self._root.mkdir(parents=True, exist_ok=True)
        row = {"step": step, **metrics} if step is not None else dict(metrics)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(row_text(row) + "\n")

    @rank_zero_only
    def log_hyperparams(self, params: Union[dict[str, Any], Namespace], *args: Any, **kwargs: Any) -> None:
        self._root.mkdir(parents=True, exist_ok=True)
        params = vars(params) if isinstance(params, Namespace) else params
        with open(self._root / "hparams.json", "w", encoding="utf-8") as f:
            json.dump(params, f, indent=2, default=str)
