"""Run metrics: the JSON-lines rows, their files and PNG plots (matplotlib, Agg backend).

The Fabric logger that writes the rows is :class:`~nemo_replay.trainer.loggers.jsonl.JsonlLogger`;
this module imports no Lightning, so run folders and checkpoints that read or write rows stay cheap.

``metrics.jsonl`` holds one JSON object per training step (``{"step": 3, "reward": 0.41,
"mismatch_mean": 2.1e-07, ...}``); non-finite values are written as ``null`` so every line
is strict JSON. :func:`plot_runs` draws the main diagnostics of one or more runs (the
compare mode overlays replay on and off) on a log scale where they span decades.

A resumed run continues the same file: :func:`restore_rows` sets it to the rows its
checkpoint holds; rows of steps after the checkpoint (a run killed before it could write
the next one) are moved to ``metrics.after-step-<n>-<time>.jsonl``, never dropped.
:func:`write_summary` writes ``summary.json`` atomically.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union


__all__ = ["clean", "current_names", "row_text", "read_jsonl", "draw_runs", "plot_runs", "restore_rows", "write_summary", "write_atomic", "PLOTTED"]

# (metric, title, log scale) in plot order.
PLOTTED = (
    ("reward", "reward (mean over rollouts)", False),
    ("mismatch_mean", "|rollout - trainer| log-prob, mean", True),
    ("mismatch_max", "|rollout - trainer| log-prob, max", True),
    ("ratio_max_dev", "first-step max |PPO ratio - 1|", True),
    ("kl", "KL to reference", False),
    ("clip_fraction", "clip fraction", False),
    ("support_mass_mean", "support mass (kept probability)", False),
    ("loss", "policy loss", False),
)


def clean(value: Any) -> Any:
    """``value`` as strict JSON holds it: non-finite floats as None, tensors as numbers, nested dicts and lists too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if hasattr(value, "item"):
        return clean(value.item())
    return value


#: Metric names rows carried before ``nemo_replay.diagnostics`` gave every integration one spelling.
RENAMED = {"support_mass": "support_mass_mean", "normalisation_gap": "normalisation_gap_mean"}


def current_names(row: dict) -> dict:
    """``row`` with its metrics under today's names (a run folder written before the renaming resumes whole)."""
    return {RENAMED.get(k, k): v for k, v in row.items()}


def read_jsonl(path: Union[str, os.PathLike]) -> list[dict]:
    """The rows of a metrics file, metrics under today's names (:data:`RENAMED`)."""
    with open(path, encoding="utf-8") as f:
        return [current_names(json.loads(line)) for line in f if line.strip()]


def row_text(row: dict) -> str:
    """One line of ``metrics.jsonl`` (no newline): strict JSON, non-finite values as null."""
    return json.dumps({k: clean(v) for k, v in row.items()})


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` durably and atomically: a hidden temp file beside it, fsynced, renamed over it.

    A failed write (a full disk) removes its temp file and raises.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk must not also keep a (0-byte) temp file
        raise


def _after(line: str, last: int) -> bool:
    """Whether a metrics line is not among a checkpoint's rows up to step ``last``: a later step, or unreadable."""
    try:
        row = json.loads(line)
    except ValueError:
        return True
    return not isinstance(row, dict) or not isinstance(row.get("step"), int) or row["step"] > last


def restore_rows(path: Union[str, os.PathLike], rows: Sequence[dict]) -> Optional[Path]:
    """Make ``path`` hold exactly ``rows`` (a checkpoint's history) before a resumed run appends.

    Rows already there past the last of ``rows`` are kept in a side file next to it, whose
    path is returned (None when there were none); so is a line that does not parse (the
    last row of a process killed while appending it), which would otherwise block the resume.
    """
    path = Path(path)
    existing = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
    last = rows[-1]["step"] if rows else -1
    extra = [line for line in existing if line.strip() and _after(line, last)]
    if extra and not extra[-1].endswith("\n"):
        extra[-1] += "\n"
    side = None
    if extra:
        side = path.with_name(f"{path.stem}.after-step-{last}-{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}")
        write_atomic(side, "".join(extra))
    write_atomic(path, "".join(row_text(r) + "\n" for r in rows))
    return side


def write_summary(path: Union[str, os.PathLike], summary: dict) -> Path:
    """``summary.json`` (non-finite values as null, nested ones too), written atomically."""
    path = Path(path)
    write_atomic(path, json.dumps(clean(summary), indent=2, allow_nan=False) + "\n")
    return path


def draw_runs(
    runs: Sequence[tuple[str, Sequence[dict]]], title: str = "", legends: Optional[Mapping[str, Sequence[str]]] = None
):
    """The figure of :func:`plot_runs` (a matplotlib ``Figure``, Agg backend), left open for the caller."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    legends = legends or {}
    panels = [(k, t, log) for k, t, log in PLOTTED if any(r.get(k) is not None for _, rows in runs for r in rows)]
    cols = 3
    nrows = max(1, math.ceil(len(panels) / cols))
    # Constrained layout sizes each panel around its title, labels and the legend under it.
    height = 3.0 if len(runs) < 2 else 3.9
    fig, axes = plt.subplots(nrows, cols, figsize=(4.4 * cols, height * nrows), squeeze=False, layout="constrained")
    for ax, (key, label, log) in zip(axes.flat, panels):
        names = legends.get(key, [name for name, _ in runs])
        for (_, rows), name in zip(runs, names):
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if log:
                pts = [(s, max(v, 1e-12)) for s, v in pts]
            if pts:
                ax.plot(*zip(*pts), label=name, linewidth=1.2)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(which="both", labelsize=7)  # a log axis labels minor ticks too
        if log:
            ax.set_yscale("log")
        if len(runs) > 1:
            # Under the panel, outside its axes: a legend inside would cover curves that fill it.
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.17), frameon=False)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_runs(
    runs: Sequence[tuple[str, Sequence[dict]]],
    out_png: Union[str, os.PathLike],
    title: str = "",
    legends: Optional[Mapping[str, Sequence[str]]] = None,
) -> Path:
    """One panel per metric of :data:`PLOTTED` that any run logged; one line per run.

    With more than one run each panel has its own legend, under the panel where it cannot
    cover a curve.

    Args:
        runs: ``(label, rows)`` pairs, rows as written by :class:`JsonlLogger`; the label is the
            run's name in every panel's legend.
        out_png: where the figure goes.
        legends: for a metric, the legend's names of the runs in that panel instead of their
            labels (one per run, in order): what the line means in that panel.
    """
    fig = draw_runs(runs, title, legends)
    import matplotlib.pyplot as plt  # after draw_runs chose the Agg backend

    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
