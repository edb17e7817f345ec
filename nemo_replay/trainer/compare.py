"""Compare mode: the same recipe with replay on and off, from the same seed, plotted together.

Both runs start from the same weights and draw the same first prompts and samples; only
the scoring differs. The summary reports the train/inference mismatch of each run (the
recompute log-prob against the rollout's, before any update) and separates its two causes:

- the **normalisation gap**: scoring over the full vocabulary instead of the support the
  engine sampled from adds ``-log(support mass)`` to every token; replay removes it
  (measured in the replay-on run, logits mode: ``normalisation_gap_mean``);
- the **engine's numeric gap**: what stays with replay on -- the engine's KV cache, kernels
  and dtype (``generation.engine``, ``generation.dtype``) against the trainer's forward. With
  ``generation.engine: trainer`` it is float noise; with ``vllm`` in float32, about 1e-6.

Output folder: ``<dir>/replay-on``, ``<dir>/replay-off`` (each a normal run folder),
``<dir>/compare.png`` and ``<dir>/summary.json``.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from nemo_replay.trainer.config.schema import RecipeConfig
from nemo_replay.trainer.config.validation import resolve_engine
from nemo_replay.trainer.grpo import GRPOTrainer, RunResult
from nemo_replay.trainer.loggers.metrics import plot_runs, write_summary
from nemo_replay.trainer.rundir import default_run_name, new_run_dir
from nemo_replay.trainer.runtime import launch_fabric

__all__ = ["CompareResult", "run_compare", "format_summary", "effects", "effects_line", "compare_panels"]


@dataclass
class CompareResult:
    """Both runs and where the comparison went.

    ``stopped_by`` names the signal that stopped the comparison early (then the run it
    stopped holds a checkpoint, and ``replay_off`` is None when replay on was stopped).
    """

    output_dir: Path
    replay_on: RunResult
    replay_off: Optional[RunResult]
    stopped_by: Optional[str] = None
    effects: Optional[dict] = None


def _mean(rows: list, key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def effects(cfg: RecipeConfig, replay_on: RunResult, replay_off: RunResult) -> dict:
    """The two causes of the mismatch, apart (module doc), averaged over the steps."""
    on, off = replay_on.history, replay_off.history
    return {
        "engine": resolve_engine(cfg),
        "engine_dtype": (cfg.generation.dtype or cfg.model.dtype) if resolve_engine(cfg) != "trainer" else cfg.model.dtype,
        "trainer_dtype": cfg.model.dtype,
        "normalisation_gap_mean": _mean(on, "normalisation_gap_mean"),
        "numeric_gap_mean": _mean(on, "mismatch_mean"),
        "numeric_gap_max": max((r["mismatch_max"] for r in on if r.get("mismatch_max") is not None), default=float("nan")),
        "replay_off_mismatch_mean": _mean(off, "mismatch_mean"),
    }


def _gap_rows(history: list) -> list:
    """The replay-on run's normalisation gap as a third line of the mean-mismatch panel."""
    gap = "normalisation_gap_mean"
    return [{"step": r["step"], "mismatch_mean": r[gap]} for r in history if r.get(gap) is not None]


def compare_panels(fx: dict, on: list, off: list) -> tuple[list, dict]:
    """``compare.png``'s runs and legends (:func:`~nemo_replay.trainer.loggers.metrics.plot_runs`).

    Every panel names the two runs; the mismatch panels also say which gap each line is, and
    the mean-mismatch panel draws the normalisation gap alone as a third line.
    """
    runs = [("replay on", on), ("replay off", off), ("normalisation gap alone", _gap_rows(on))]
    gaps = [f"replay on: the {fx['engine']} engine's numeric gap", "replay off: normalisation + numeric gap"]
    legends = {
        "mismatch_mean": [*gaps, "normalisation gap alone (-log support mass)"],
        "mismatch_max": gaps,
    }
    return runs, legends


def effects_line(fx: dict) -> str:
    """One line naming both effects with their sizes."""
    engine = f"{fx['engine']} engine ({fx['engine_dtype']}{', no KV cache' if fx['engine'] == 'trainer' else ', KV cache'})"
    return (
        f"replay removes the normalisation gap (mean {fx['normalisation_gap_mean']:.3g} nats, -log support mass); "
        f"the {engine} leaves a numeric gap of mean {fx['numeric_gap_mean']:.3g}, max {fx['numeric_gap_max']:.3g} nats "
        f"against the {fx['trainer_dtype']} trainer (replay off: mean {fx['replay_off_mismatch_mean']:.3g})"
    )


def _with_replay(cfg: RecipeConfig, enabled: bool, out_dir: Path) -> RecipeConfig:
    replay = dataclasses.replace(cfg.replay, enabled=enabled)
    # Each half keeps a checkpoint of its last step even with checkpoint_every=0: a compare
    # stopped in its second half is continued by the same command, which must find the
    # first half finished rather than a folder it cannot continue.
    trainer = dataclasses.replace(
        cfg.trainer, output_dir=str(out_dir / f"replay-{'on' if enabled else 'off'}"),
        checkpoint_every=cfg.trainer.checkpoint_every or cfg.trainer.steps,
    )
    return dataclasses.replace(cfg, replay=replay, trainer=trainer)


def run_compare(cfg: RecipeConfig) -> CompareResult:
    """Run ``cfg`` with replay on, then off; plot both; write summary.json on rank 0."""
    fabric = launch_fabric(cfg)
    if cfg.trainer.output_dir:
        root = cfg.trainer.output_dir  # a named root: each half resumes like any named run
    elif fabric.is_global_zero:
        root = str(new_run_dir(Path("runs"), default_run_name(cfg, kind="compare")))  # unique, never reused
    else:
        root = None
    root = Path(fabric.broadcast(root, src=0) if fabric.world_size > 1 else root)
    results = {}
    for enabled in (True, False):
        run_cfg = _with_replay(cfg, enabled, root)
        trainer = GRPOTrainer(run_cfg, fabric=fabric)
        if fabric.is_global_zero and trainer.resume_line():
            print(f"nemo-replay compare: {trainer.resume_line()}", file=sys.stderr)
        results[enabled] = trainer.fit()
        if results[enabled].stopped_by:  # a stop signal: the same command resumes where it left off
            return CompareResult(root, results[True], results.get(False), stopped_by=results[enabled].stopped_by)
    out = CompareResult(root, results[True], results[False], effects=effects(cfg, results[True], results[False]))
    if fabric.is_global_zero:
        fx = out.effects
        runs, legends = compare_panels(fx, out.replay_on.history, out.replay_off.history)
        title = (
            f"{cfg.replay.strategy}, {fx['engine']} engine ({fx['engine_dtype']}) vs {fx['trainer_dtype']} trainer: "
            f"replay on vs off (seed {cfg.trainer.seed})"
        )
        plot_runs(runs, root / "compare.png", title=title, legends=legends)
        summary = {"replay_on": out.replay_on.summary, "replay_off": out.replay_off.summary, "effects": fx}
        write_summary(root / "summary.json", summary)
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
    if result.effects is not None:
        lines.append(effects_line(result.effects))
    lines.append(f"plots: {result.output_dir / 'compare.png'}")
    return "\n".join(lines)
