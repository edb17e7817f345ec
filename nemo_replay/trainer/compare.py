"""Compare mode: the same recipe with replay on and off, from the same seed, plotted together.

Both runs start from the same weights and draw the same first prompts and samples; only
the scoring differs. The summary reports the train/inference mismatch of each run (the
recompute log-prob against the rollout's, before any update): with replay it sits at
float noise, without it is the log of the probability mass the sampler's truncation
dropped.

Output folder: ``<dir>/replay-on``, ``<dir>/replay-off`` (each a normal run folder),
``<dir>/compare.png`` and ``<dir>/summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from nemo_replay.config.schema import RecipeConfig
from nemo_replay.trainer.grpo import GRPOTrainer, RunResult
from nemo_replay.trainer.metrics import plot_runs
from nemo_replay.trainer.runtime import launch_fabric

__all__ = ["CompareResult", "run_compare", "format_summary"]


@dataclass
class CompareResult:
    """Both runs and where the comparison went."""

    output_dir: Path
    replay_on: RunResult
    replay_off: RunResult


def _with_replay(cfg: RecipeConfig, enabled: bool, out_dir: Path) -> RecipeConfig:
    replay = dataclasses.replace(cfg.replay, enabled=enabled)
    trainer = dataclasses.replace(cfg.trainer, output_dir=str(out_dir / f"replay-{'on' if enabled else 'off'}"))
    return dataclasses.replace(cfg, replay=replay, trainer=trainer)


def run_compare(cfg: RecipeConfig) -> CompareResult:
    """Run ``cfg`` with replay on, then off; plot both; write summary.json on rank 0."""
    fabric = launch_fabric(cfg)
    if cfg.trainer.output_dir:
        root = cfg.trainer.output_dir
    else:
        root = os.path.join("runs", f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.replay.strategy}-compare")
    root = Path(fabric.broadcast(root, src=0) if fabric.world_size > 1 else root)
    results = {}
    for enabled in (True, False):
        run_cfg = _with_replay(cfg, enabled, root)
        results[enabled] = GRPOTrainer(run_cfg, fabric=fabric).fit()
    out = CompareResult(root, results[True], results[False])
    if fabric.is_global_zero:
        plot_runs(
            [("replay on", out.replay_on.history), ("replay off", out.replay_off.history)],
            root / "compare.png",
            title=f"{cfg.replay.strategy}: support-conditioned replay on vs off (seed {cfg.trainer.seed})",
        )
        summary = {"replay_on": out.replay_on.summary, "replay_off": out.replay_off.summary}
        (root / "summary.json").write_text(json.dumps(summary, indent=2))
    fabric.barrier()
    return out


def format_summary(result: CompareResult) -> str:
    """A small table of the two runs."""
    rows = [("", "replay on", "replay off")]
    keys = (
        ("mismatch_max", "max |rollout - trainer| log-prob"),
        ("mismatch_mean", "mean |rollout - trainer| log-prob"),
        ("first_step_ratio_max_dev", "first-step max |ratio - 1|"),
        ("reward_first", "reward, first 10% of steps"),
        ("reward_last", "reward, last 10% of steps"),
    )
    for key, label in keys:
        rows.append((label, f"{result.replay_on.summary[key]:.3g}", f"{result.replay_off.summary[key]:.3g}"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{a:<{width}}  {b:>10}  {c:>10}" for a, b, c in rows]
    lines.append(f"plots: {result.output_dir / 'compare.png'}")
    return "\n".join(lines)
