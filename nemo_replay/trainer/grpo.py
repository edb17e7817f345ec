"""The reference GRPO trainer: rollouts with support capture, then three role passes.

One step, on every rank (NeMo-RL's GRPO loop, on Lightning Fabric):

1. **rollout**: this data-parallel rank's prompts, ``group_size`` responses each, sampled by
   the rollout engine (``generation.engine``): transformers' ``generate`` with a KV cache on
   an engine copy of the weights (``hf``, :mod:`.backends.hf_engine`), or the capture sampler on the
   policy's own forward (``trainer``, :mod:`.generation`); each token keeps its processed
   log-prob and its support row;
2. **reward and advantages**: the task's verifiable reward, group-normalised
   (:func:`~nemo_replay.objectives.group_advantages`);
3. **recompute**: old-policy log-probs (strategy role ``recompute``, no grad) with the
   weights that sampled: the train/inference mismatch is measured here;
4. **reference**: reference-model log-probs (role ``reference``, frozen initial weights);
5. **update**: per minibatch, role ``policy`` with the trainer's objective (``self.objective``,
   ``trainer.objective``'s: token ratio, GSPO's sequence ratio or truncated IS, + KL, handed to
   the strategy as ``loss_fn``; backward
   inside the strategy), gradient clip, optimizer step. The first policy forward of the step runs
   before any update: its ratio against the rollout log-probs is the first-step ratio.

Every role scores over the recorded support when ``replay.enabled`` (the strategy calls the
shared scorer), and over the full vocabulary otherwise; nothing else changes.

    from nemo_replay.trainer.config import load_config
    from nemo_replay.trainer import GRPOTrainer
    result = GRPOTrainer(load_config(overrides=["trainer.steps=20"])).fit()
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional, Union

import torch

from nemo_replay.batch import ReplayBatch
from nemo_replay.diagnostics import StepStats, record_mismatch, record_policy
from nemo_replay.objectives import SequenceRatioObjective, TokenRatioObjective, TruncatedISObjective, group_advantages
from nemo_replay.strategies.base import RoleSettings
from nemo_replay.trainer.config.loading import to_yaml
from nemo_replay.trainer.config.schema import RecipeConfig
from nemo_replay.trainer.config.validation import resolve_engine
from nemo_replay.trainer.generation import SamplingSettings, generate
from nemo_replay.trainer.rundir.checkpoint import (
    CHECKPOINTS, Checkpointer, CheckpointUnreadable, capture_rank_rng, restore_rank_rng,
)
from nemo_replay.trainer.guards import NonFiniteError, check_update, collective_failure, diverged_rollout
from nemo_replay.trainer.loggers import RunLoggers
from nemo_replay.trainer.loggers.metrics import plot_runs, write_atomic, write_summary
from nemo_replay.trainer.preemption import StopSignals
from nemo_replay.trainer.progress import Bar, Lines, progress
from nemo_replay.trainer.rundir import prepare_run_dir
from nemo_replay.trainer.runtime import launch_fabric, make_backend, seed_all
from nemo_replay.trainer.tasks import build_task

__all__ = ["GRPOTrainer", "RunResult", "role_settings", "sampling_settings", "split_batch"]


@dataclass
class RunResult:
    """What a finished run leaves behind.

    Attributes:
        output_dir: folder with ``metrics.jsonl``, ``config.yaml``, ``metrics.png``,
            ``summary.json`` and ``checkpoints/``.
        history: the per-step metrics (the rows of ``metrics.jsonl``), on every rank; a
            resumed run's history starts at step 0 (the checkpoint carries the earlier rows).
        summary: reward at the start and end of the run, worst mismatch and ratio.
        stopped_by: the signal that stopped the run early (``SIGTERM``, ...), else None.
        last_checkpoint: the newest complete checkpoint of the run, if any.
        first_step: the step this process started at (> 0 after a resume).
    """

    output_dir: Path
    history: list
    summary: dict
    stopped_by: Optional[str] = None
    last_checkpoint: Optional[Path] = None
    first_step: int = 0


def role_settings(cfg: RecipeConfig) -> RoleSettings:
    """The recipe's scoring settings for every role."""
    return RoleSettings(
        replay=cfg.replay.enabled,
        temperature=float(cfg.generation.temperature),
        source=cfg.replay.scorer.source,
        chunk_size=cfg.replay.scorer.chunk_size,
        compute_entropy=cfg.replay.scorer.compute_entropy,
        reference_full_vocab=cfg.replay.reference_full_vocab,
    )


def sampling_settings(cfg: RecipeConfig) -> SamplingSettings:
    g, cap = cfg.generation, cfg.replay.sample_support
    return SamplingSettings(
        temperature=float(g.temperature), top_k=g.top_k, top_p=g.top_p, min_p=g.min_p,
        max_new_tokens=g.max_new_tokens, stop_token_id=g.stop_token_id,
        row_width=cap.top_k,
    )


def make_objective(cfg: RecipeConfig):
    """The policy loss ``trainer.objective`` names, with the recipe's clip and KL settings."""
    tr = cfg.trainer
    if tr.objective == "sequence_ratio":
        return SequenceRatioObjective(clip_eps=tr.clip_eps, clip_eps_high=None, kl_coef=tr.kl_coef)
    if tr.objective == "tis":
        return TruncatedISObjective(cap=tr.tis_cap, clip_eps=tr.clip_eps, kl_coef=tr.kl_coef)
    return TokenRatioObjective(clip_eps=tr.clip_eps, kl_coef=tr.kl_coef)


def split_batch(batch: ReplayBatch, size: int) -> list[ReplayBatch]:
    """Consecutive slices of at most ``size`` trajectories."""
    return [batch.select(torch.arange(i, min(i + size, batch.batch_size))) for i in range(0, batch.batch_size, size)]


class GRPOTrainer:
    """GRPO with support-conditioned replay (see the module doc for one step).

    Args:
        cfg: a validated recipe (:func:`nemo_replay.trainer.config.load_config`).
        backend: the model side; None builds the one for ``replay.strategy``
            (:func:`~nemo_replay.trainer.runtime.make_backend`).
        fabric: a launched Fabric; None launches one for ``cfg``.
        output_suffix: appended to the default output folder name.
        resume_overrides: optimizer and objective flags a resume may change on purpose
            (:data:`~nemo_replay.trainer.rundir.OVERRIDABLE`); each change is recorded in the
            run's ``resume.log``.
    """

    def __init__(self, cfg: RecipeConfig, *, backend=None, fabric=None, output_suffix: str = "", resume_overrides=()):
        self.cfg = cfg
        self.fabric = fabric or launch_fabric(cfg)
        # Before any model is built: a folder that cannot be used fails in seconds.
        self.run_dir = prepare_run_dir(cfg, self.fabric, output_suffix, overrides=resume_overrides)
        self.output_dir = self.run_dir.path
        self.loggers = RunLoggers(cfg.trainer.loggers, self.output_dir, active=self.fabric.is_global_zero)
        try:
            self._build(backend)
        except BaseException:
            # The folder's lock is this process's: a retry here (a notebook, a test) must find it free.
            self.close_engine()
            self.loggers.close("failed")
            self.run_dir.release()
            raise

    def _build(self, backend) -> None:
        """Models, optimizer, task, engine, RNGs, logger and checkpoints; then resume or record the recipe."""
        cfg = self.cfg
        seed_all(cfg.trainer.seed, self.fabric)
        self.device = self.fabric.device
        self.backend = backend or make_backend(cfg, self.fabric)
        self.policy, self.reference = self.backend.build_models()
        self.strategy = self.backend.make_strategy()
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
        self.task = build_task(
            cfg.task.name, vocab_size=cfg.task.num_symbols or cfg.model.vocab_size, min_prompt_len=cfg.task.min_prompt_len,
            max_prompt_len=cfg.task.max_prompt_len, response_len=cfg.generation.max_new_tokens,
        )
        self.settings = role_settings(cfg)
        self.objective = make_objective(cfg)
        # Support mass needs full logits: logits mode with replay on.
        self.recompute_settings = dataclasses.replace(
            self.settings, compute_support_mass=cfg.replay.enabled and cfg.replay.scorer.source == "logits"
        )
        self.sampling = sampling_settings(cfg)
        # The hf and vllm engines hold their own copy of the weights, synced before every rollout.
        engine = resolve_engine(cfg)
        self.engine = self.backend.build_engine(self.policy, self.sampling, engine) if engine != "trainer" else None
        # Prompts differ per data-parallel rank and agree within a model-parallel group
        # (TP / CP / SP ranks must hold the same rollouts); sampling draws alike.
        seed = cfg.trainer.seed * 1_000_003 + self.backend.dp_rank
        self.prompt_rng = torch.Generator().manual_seed(seed)
        self.sample_rng = torch.Generator(device=self.device).manual_seed(seed + 17)
        self.prompts_per_rank = cfg.trainer.prompts_per_step // self.backend.dp_size
        self.checkpoints = Checkpointer(
            self.output_dir / CHECKPOINTS, self.fabric, every=cfg.trainer.checkpoint_every,
            keep=cfg.trainer.keep_checkpoints, config=to_yaml(cfg),
        )
        self.start_step, self.history, self.current_step = 0, [], 0
        if self.fabric.is_global_zero:
            for gone in self.checkpoints.clean():
                self.note(f"removed {gone.name}, left by an interrupted checkpoint write")
            for line in self.checkpoints.set_aside_unreadable_manifests():
                self.note(line)
        if self.run_dir.resume is not None:
            self._resume()
        elif self.fabric.is_global_zero:
            if self.run_dir.restart:
                notes = self.loggers.start("restart", hparams=recipe_params(cfg))
                side = self.loggers.jsonl_side
                self.note(f"no complete checkpoint in {self.output_dir}: starting again at step 0 under the same recipe"
                          + (f"; the earlier rows are in {side.name}" if side else ""))
                for line in notes:
                    self.note(line)
            else:
                self.loggers.start("new", hparams=recipe_params(cfg))
            write_atomic(self.output_dir / "config.yaml", to_yaml(cfg))  # read back by a restart: never torn
        self._record_overrides()

    # ------------------------------------------------------------------ checkpoints
    def _generators(self) -> dict:
        """The trainer's own RNGs: prompt order (the data position) and sampling."""
        return {"prompt": self.prompt_rng, "sample": self.sample_rng}

    def save_checkpoint(self, step: int) -> Path:
        """Checkpoint steps ``0..step`` (collective; see :mod:`nemo_replay.trainer.rundir.checkpoint`)."""
        rank_state = {"rng": capture_rank_rng(self._generators())}
        return self.checkpoints.save(step, self.policy, self.optimizer, history=self.history, rank_state=rank_state)

    def resume_line(self) -> Optional[str]:
        """What this run continues from, for rank 0 to print; None for a new run."""
        info = self.run_dir.resume
        return None if info is None else f"resuming {self.output_dir} after step {info.step} ({info.path.name})"

    def note(self, text: str) -> None:
        """Rank 0: a line on stderr and in the run's log (``<output_dir>/resume.log``)."""
        if not self.fabric.is_global_zero:
            return
        print(f"nemo-replay: {text}", file=sys.stderr, flush=True)
        with open(self.output_dir / "resume.log", "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")

    def _resume(self) -> None:
        """Weights, optimizer, RNGs and metrics from the run folder's latest checkpoint that loads.

        A newest checkpoint that does not load (a truncated or missing file or shard under an
        intact ``complete.json``) is moved aside, named in the run's log, and the one before
        it is used; with none left the error says what to delete.
        """
        info = self.run_dir.resume
        while True:
            try:
                self.history, rank_state = self.checkpoints.load(info, self.policy, self.optimizer)
                break
            except CheckpointUnreadable as bad:
                info = self.checkpoints.set_aside(bad)
                aside = self.checkpoints.set_aside_as
                self.note(f"{bad}; moved it to {aside} and "
                          + (f"resuming from {info.path.name}" if info else "no complete checkpoint is left"))
                if info is None:
                    raise ValueError(
                        f"no checkpoint of {self.output_dir} loads (the newest, moved to {aside}, failed with "
                        f"{bad.cause}); to start this run again from step 0 delete {self.output_dir / CHECKPOINTS} and "
                        f"run the same command, or choose a new trainer.output_dir"
                    ) from None
                if info.world_size != self.fabric.world_size:
                    raise ValueError(
                        f"the checkpoint {info.path} was written by {info.world_size} process(es) and this run has "
                        f"{self.fabric.world_size}; resume with the process count that wrote it"
                    ) from None
        self.run_dir.resume = info
        # Before the first save: a lower trainer.keep_checkpoints frees the space that save checks for.
        self.checkpoints.prune()
        if info.step + 1 >= self.cfg.trainer.steps:
            self.note(f"the checkpoint {info.path.name} holds steps 0..{info.step}, trainer.steps={self.cfg.trainer.steps} "
                      f"asks for no more: nothing to train; set trainer.steps above {info.step + 1} to continue the run")
        restore_rank_rng(rank_state["rng"], self._generators())
        # The optimizer's state brought back its old settings; the recipe's are the ones in force
        # (equal unless changed on purpose with --resume-override).
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = self.cfg.trainer.lr, self.cfg.trainer.weight_decay
        self.start_step = info.step + 1
        if self.fabric.is_global_zero:
            notes = self.loggers.start("resume", self.history, hparams=recipe_params(self.cfg))
            side = self.loggers.jsonl_side
            if side:
                self.note(f"rows of steps after {info.step} (written after that checkpoint) moved to {side.name}")
            for line in notes:
                self.note(line)

    def _record_overrides(self) -> None:
        """Log each flag a resume changed on purpose; config.yaml holds the recipe in force."""
        if self.run_dir.overridden:
            self.note(f"resumed at step {self.start_step} with changed settings (--resume-override): "
                      f"{'; '.join(self.run_dir.overridden)}")
        if self.run_dir.resume is not None and self.fabric.is_global_zero:
            write_atomic(self.output_dir / "config.yaml", to_yaml(self.cfg))

    # ------------------------------------------------------------------ one step
    def rollout(self) -> tuple[ReplayBatch, torch.Tensor]:
        """Sample this rank's responses: the canonical batch (with advantages) and the rewards (B,)."""
        G = self.cfg.trainer.group_size
        prompts = self.task.prompts(self.prompts_per_rank, self.prompt_rng)
        repeated = [p for p in prompts for _ in range(G)]
        if self.engine is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.sample_rng, device=self.device))
            ro = self.engine.rollout(self.policy, repeated, seed=seed)
        else:
            logits_fn = partial(self.backend.next_token_logits, self.policy)
            ro = generate(logits_fn, repeated, self.sampling, generator=self.sample_rng, device=self.device)
        rewards = self.task.rewards(ro.prompts, ro.responses)
        batch = ro.batch
        batch.advantages = group_advantages(rewards, G).to(self.device)
        if not (self.cfg.replay.enabled and self.cfg.replay.sample_support.enabled):
            # Capture off, or the full-vocabulary baseline: no rows are kept or replayed
            # (validation refuses replay on with capture off).
            batch.support = None
        if not self.cfg.replay.route_replay:
            batch.routes = None
        return batch, rewards

    def score_old_and_reference(self, micro: list[ReplayBatch], stats: StepStats) -> None:
        """Roles ``recompute`` and ``reference``; stores old/ref log-probs on each micro-batch."""
        old = self.strategy.run_role("recompute", self.policy, micro, self.recompute_settings)
        ref = self.strategy.run_role("reference", self.reference, micro, self.settings)
        for mb, o, r in zip(micro, old, ref):
            A = mb.response_width
            o, r = o.response(A), r.response(A)
            mask = mb.loss_mask.bool()
            record_mismatch(stats, mb.rollout_logprobs, o.logprobs, mask, log_mass=o.support_logmass,
                            mass_mask=o.valid_mask & mask.to(o.valid_mask.device))
            if o.entropy is not None:
                ent = o.entropy.double()[mask.to(o.entropy.device)]
                stats.add_mean("entropy", float(ent.sum()), ent.numel())
            mb.old_logprobs = o.logprobs if self.cfg.trainer.old_logprobs == "recompute" else mb.rollout_logprobs
            mb.ref_logprobs = r.logprobs

    def update(self, minibatches: list[list[ReplayBatch]], stats: StepStats) -> None:
        """Role ``policy`` per minibatch, then clip and step; the first forward gives the first-step ratio."""
        for k, group in enumerate(minibatches):
            self.optimizer.zero_grad(set_to_none=True)
            outs = self.strategy.run_role("policy", self.policy, group, self.settings, loss_fn=self.objective)
            self.backend.finish_gradients(self.policy)
            norm = self.backend.clip_gradients(self.policy, self.cfg.trainer.grad_clip)
            check_update(
                self.cfg, step=self.current_step, minibatch=k, grad_norm=norm, last_checkpoint=self.checkpoints.last,
                losses=[o.loss for o in outs if o.loss is not None], device=self._flag_device(),
            )
            self.optimizer.step()
            stats.add_mean("grad_norm", norm, 1)
            for mb, out in zip(group, outs):
                record_policy(stats, mb, out, first_forward=k == 0)

    def step(self) -> dict:
        """One GRPO iteration; returns the metrics reduced over every rank."""
        start = time.perf_counter()
        stats = StepStats()
        try:
            batch, rewards = self.rollout()
        except ValueError as exc:
            diverged = diverged_rollout(self.cfg, exc, step=self.current_step, model=self.policy, last_checkpoint=self.checkpoints.last)
            if diverged is None:
                raise
            raise diverged from exc
        stats.add_mean("reward", float(rewards.sum()), rewards.numel())
        stats.add_mean("response_len", float(batch.response_lengths.sum()), batch.batch_size)
        # Minibatches (one optimizer step each) of micro-batches (one forward each).
        index = torch.arange(batch.batch_size).tensor_split(min(self.cfg.trainer.minibatches_per_step, batch.batch_size))
        minibatches = [split_batch(batch.select(ix), self.cfg.trainer.micro_batch_size) for ix in index]
        self.score_old_and_reference([mb for group in minibatches for mb in group], stats)
        self.update(minibatches, stats)
        stats.add_max("step_time_s", time.perf_counter() - start)
        return stats.reduce(device=self.device if self.device.type == "cuda" else None)

    # ------------------------------------------------------------------ the run
    def _flag_device(self) -> Optional[torch.device]:
        """Where one-off flag tensors for a collective live: the GPU under NCCL, else the CPU."""
        return self.device if self.device.type == "cuda" else None

    def fit(self) -> RunResult:
        """Run steps ``start_step .. trainer.steps - 1``: checkpoints, stop signals, metrics, plot, summary.

        Phases: the loop (:meth:`_loop`), then the report (:meth:`_finish`). A stop signal
        ends the loop after the step in flight, with a checkpoint (:mod:`.preemption`).
        """
        signals = StopSignals(announce=self.fabric.is_global_zero)
        status = "failed"
        try:
            with signals:
                try:
                    stopped_by = self._loop(signals)
                except NonFiniteError as exc:
                    # Diverged: the rows so far and why it stopped, as for any run that ends.
                    self._finish(None, failed=str(exc))
                    raise
            result = self._finish(stopped_by)
            status = "success" if stopped_by is None else "stopped"
            return result
        finally:
            # Also when a step fails (a non-finite update, a lost rank): every logger's run is
            # ended and the folder is free again for this process, whose next run there resumes
            # from the last checkpoint.
            self.close_engine()
            self.loggers.close(status)
            self.run_dir.release()

    def close_engine(self) -> None:
        """Stop an engine that runs processes of its own (vLLM's); the run's other state stays."""
        close = getattr(getattr(self, "engine", None), "close", None)
        if close is not None:
            close()

    def _loop(self, signals: StopSignals) -> Optional[str]:
        """The steps; returns the stop signal's name when one ended the loop early."""
        steps = self.cfg.trainer.steps
        bar = _progress(self.cfg, self.fabric, initial=min(self.start_step, steps))
        try:
            for i in range(self.start_step, steps):
                self.current_step = i
                try:
                    metrics = self.step()
                    self.history.append({"step": i, **metrics})
                    self.loggers.log(metrics, step=i)
                    stopped_by = signals.agreed(self._flag_device())
                    if self.checkpoints.due(i, last=i == steps - 1, stopping=stopped_by is not None):
                        self.save_checkpoint(i)
                except RuntimeError as exc:
                    failure = collective_failure(
                        exc, step=i, timeout_s=self.cfg.trainer.collective_timeout_s, last_checkpoint=self.checkpoints.last
                    )
                    if failure is None:
                        raise
                    raise failure from exc
                if bar is not None:
                    bar.advance(metrics)
                if stopped_by is not None:
                    return stopped_by
            return None
        finally:
            if bar is not None:
                bar.close()

    def _finish(self, stopped_by: Optional[str], failed: Optional[str] = None) -> RunResult:
        """Plot and summary.json (rank 0; ``failed``: why the run stopped); the result on every rank."""
        summary = summarize(self.history)
        if self.fabric.is_global_zero:
            if self.cfg.trainer.plot and self.history:
                label = f"replay {'on' if self.cfg.replay.enabled else 'off'}"
                plot_runs([(label, self.history)], self.output_dir / "metrics.png", title=f"{self.cfg.replay.strategy}, {label}")
            extra = {"failed": failed} if failed else {}
            write_summary(self.output_dir / "summary.json", dict(summary, stopped_by=stopped_by, first_step=self.start_step, **extra))
        self.fabric.barrier()
        return RunResult(self.output_dir, self.history, summary, stopped_by, self.checkpoints.last, self.start_step)


def recipe_params(cfg: RecipeConfig) -> dict:
    """The recipe as nested plain data: the run's config / params in the experiment loggers."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))


def summarize(history: list[dict]) -> dict:
    """Reward over the first and last tenth of the run, worst mismatch and first-step ratio."""
    n = max(1, len(history) // 10)
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows) if rows else float("nan")  # noqa: E731
    finite = lambda k: [r[k] for r in history if r.get(k) is not None and math.isfinite(r[k])]  # noqa: E731
    return {
        "steps": len(history),
        "reward_first": mean(history[:n], "reward"),
        "reward_last": mean(history[-n:], "reward"),
        "mismatch_mean": sum(finite("mismatch_mean")) / max(1, len(finite("mismatch_mean"))),
        "mismatch_max": max(finite("mismatch_max"), default=float("nan")),
        "ratio_max_dev": max(finite("ratio_max_dev"), default=float("nan")),
        "first_step_ratio_max_dev": history[0]["ratio_max_dev"] if history else float("nan"),
    }


def _progress(cfg: RecipeConfig, fabric, initial: int = 0) -> Optional[Union[Bar, Lines]]:
    """Rank 0's progress (a bar on a terminal, plain lines otherwise), or None with ``trainer.progress_bar=false``."""
    if not (cfg.trainer.progress_bar and fabric.is_global_zero):
        return None
    mode = "on" if cfg.replay.enabled else "off"
    return progress(f"GRPO {cfg.replay.strategy} replay-{mode}", cfg.trainer.steps, initial=initial)
