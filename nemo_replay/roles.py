"""The three role callbacks, bound to a strategy and settings, for any training loop.

For a hand-written megatron-core or FSDP2 loop (and behind :class:`ReplayCallback`)::

    roles = ReplayRoles("fsdp", settings=RoleSettings(temperature=0.7),
                        loss_fn=TokenRatioObjective(clip_eps=0.2, kl_coef=0.01))
    roles.recompute(policy, micro_batches)   # stores batch.old_logprobs, measures the mismatch
    roles.reference(ref_model, micro_batches)  # stores batch.ref_logprobs
    optimizer.zero_grad()
    roles.policy(policy, micro_batches)      # objective + backward (inside the strategy)
    optimizer.step()
    roles.last_metrics                       # mismatch, first-step ratio, kl, clip fraction

The objective is a plug point: ``roles.policy(policy, micro_batches, loss_fn=SequenceRatioObjective())``
or any ``loss_fn(logprobs (B, A), batch, mask (B, A)) -> (loss, metrics)``
(:mod:`nemo_replay.objectives`); ``ReplayRoles(..., loss_fn=...)`` sets it for every call.
With ``RoleSettings(replay=False)`` the same calls run the full-vocabulary path. Megatron
users who drive ``get_forward_backward_func`` themselves can hand the strategy's
:class:`~nemo_replay.strategies.megatron.steps.RoleForwardStep` to it instead.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from nemo_replay.batch import ReplayBatch
from nemo_replay.objectives import PolicyLoss
from nemo_replay.strategies.base import ReplayStrategy, RoleOutput, RoleSettings
from nemo_replay.diagnostics import StepStats, record_mismatch, record_policy

__all__ = ["ReplayRoles"]


class ReplayRoles:
    """Role callbacks over one strategy.

    Args:
        strategy: a registered strategy name, or a built :class:`ReplayStrategy`.
        settings: scoring settings shared by the roles (default ``RoleSettings()``: replay on).
        loss_fn: the policy objective (default ``TokenRatioObjective()``: clipped token ratios, no KL).
        **strategy_options: passed to the strategy's factory when ``strategy`` is a name.

    Attributes:
        last_metrics: diagnostics of the latest calls on this rank (``mismatch_mean``,
            ``mismatch_max``, ``ratio_mean``, ``ratio_max_dev``, ``clip_fraction``, ``kl``, ``loss``,
            ``ratio_old_max_dev``; see :func:`~nemo_replay.diagnostics.record_policy`).
    """

    def __init__(
        self,
        strategy: Union[str, ReplayStrategy] = "fsdp",
        *,
        settings: Optional[RoleSettings] = None,
        loss_fn: Optional[PolicyLoss] = None,
        **strategy_options,
    ):
        if isinstance(strategy, str):
            from nemo_replay.strategies.registry import get_strategy

            strategy = get_strategy(strategy).factory(**strategy_options)
        elif strategy_options:
            raise ValueError(f"strategy options {sorted(strategy_options)} only apply when the strategy is given by name")
        if not isinstance(strategy, ReplayStrategy):
            raise ValueError(f"strategy must be a registered name or a ReplayStrategy, got {type(strategy).__name__}")
        self.strategy = strategy
        self.settings = settings or RoleSettings()
        self.loss_fn = loss_fn
        self.last_metrics: dict = {}

    def recompute(self, model, batches: Sequence[ReplayBatch]) -> list[RoleOutput]:
        """Old-policy log-probs (no grad) into ``batch.old_logprobs``; mismatch vs ``rollout_logprobs``."""
        outs = self.strategy.run_role("recompute", model, batches, self.settings)
        stats = StepStats()
        for batch, out in zip(batches, outs):
            batch.old_logprobs = out.response(batch.response_width).logprobs
            if batch.rollout_logprobs is not None:
                record_mismatch(stats, batch.rollout_logprobs, batch.old_logprobs, batch.loss_mask.bool())
        self.last_metrics.update(stats.reduce(across_ranks=False))
        return outs

    def reference(self, model, batches: Sequence[ReplayBatch]) -> list[RoleOutput]:
        """Reference-model log-probs (no grad, policy temperature) into ``batch.ref_logprobs``."""
        outs = self.strategy.run_role("reference", model, batches, self.settings)
        for batch, out in zip(batches, outs):
            batch.ref_logprobs = out.response(batch.response_width).logprobs
        return outs

    def policy(self, model, batches: Sequence[ReplayBatch], *, loss_fn: Optional[PolicyLoss] = None) -> list[RoleOutput]:
        """The objective (``loss_fn``, else the roles' own) with backward; ratio vs ``rollout_logprobs`` of this forward."""
        outs = self.strategy.run_role("policy", model, batches, self.settings, loss_fn=loss_fn or self.loss_fn)
        stats = StepStats()
        for batch, out in zip(batches, outs):
            record_policy(stats, batch, out)
        self.last_metrics.update(stats.reduce(across_ranks=False))
        return outs
