"""Switch replay on for a LightningModule-based trainer (docs/design.md §6).

Add the callback; the module finds the role callbacks at ``self.replay``
(:class:`~nemo_replay.roles.ReplayRoles`) and calls them from its training step::

    import lightning
    import torch

    from nemo_replay.integrations.lightning import ReplayCallback
    from nemo_replay.strategies.base import RoleSettings

    class MyRL(lightning.LightningModule):
        def __init__(self, policy, reference):
            super().__init__()
            self.automatic_optimization = False      # the policy role runs backward itself
            self.policy, self.reference = policy, reference.requires_grad_(False)

        def training_step(self, micro_batches, batch_idx):   # a list of ReplayBatch
            self.replay.recompute(self.policy, micro_batches)
            self.replay.reference(self.reference, micro_batches)
            opt = self.optimizers()
            opt.zero_grad()
            self.replay.policy(self.policy, micro_batches)   # backward through self.manual_backward
            opt.step()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.policy.parameters(), lr=1e-5)

    trainer = lightning.Trainer(max_epochs=1, callbacks=[ReplayCallback("fsdp", settings=RoleSettings(temperature=0.7))])
    trainer.fit(MyRL(policy, reference), loader)   # loader yields lists of ReplayBatch
    # another objective: ReplayCallback("fsdp", loss_fn=SequenceRatioObjective(kl_coef=0.01))

``loader`` yields lists of :class:`~nemo_replay.batch.ReplayBatch` with their
support rows; from transformers' ``generate``,
:func:`nemo_replay.trainer.generation.replay_batches_from_generation` builds them
(``examples/lightning_replay.py`` runs the whole loop on CPU).

What the callback does:

- ``setup``: builds the strategy and attaches ``pl_module.replay``; refuses automatic
  optimization (Lightning would run a second backward on the returned loss); hands the
  strategy ``pl_module.manual_backward`` as the policy role's backward, so Lightning's
  strategy sees every backward: under DDP it prepares the reducer, which all-reduces the
  gradients (a plain ``loss.backward()`` would leave each rank with its own gradients and
  the replicas would drift apart), and the precision plugin scales the loss. A replay
  strategy whose backward runs inside its own schedule (``megatron``) cannot take it and
  is refused under a Lightning DDP strategy;
- ``on_train_batch_start``: with replay on, every :class:`ReplayBatch` of the batch must
  carry its support rows: a ValueError names the micro-batch otherwise;
- ``on_train_batch_end``: logs the diagnostics of the step (``replay/mismatch_max``,
  ``replay/ratio_max_dev``, ``replay/kl``, ``replay/clip_fraction``) with ``pl_module.log_dict``;
- ``teardown``: gives the strategy back the backward it had.

``ReplayCallback(enabled=False)`` keeps the same calls on the full-vocabulary path, so one
flag switches a trainer between replay and the previous behaviour.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from lightning.pytorch.callbacks import Callback

from nemo_replay.batch import ReplayBatch
from nemo_replay.objectives import PolicyLoss
from nemo_replay.strategies.base import ReplayStrategy, RoleSettings
from nemo_replay.roles import ReplayRoles

__all__ = ["ReplayCallback"]


def _replay_batches(batch) -> list[ReplayBatch]:
    if isinstance(batch, ReplayBatch):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return [b for b in batch if isinstance(b, ReplayBatch)]
    return []


class ReplayCallback(Callback):
    """Attach :class:`ReplayRoles` to a LightningModule as ``pl_module.replay``.

    Args:
        strategy: registered strategy name (``fsdp``, ``megatron``, a plugin) or a built strategy.
        settings: role settings; ``replay`` is overridden by ``enabled``.
        loss_fn: the policy objective (:mod:`nemo_replay.objectives`; default
            ``TokenRatioObjective()``: clipped token ratios, no KL term).
        enabled: score over the recorded support (True) or the full vocabulary (False).
        attribute: the module attribute that receives the role callbacks.
        **strategy_options: forwarded to the strategy's factory.
    """

    def __init__(
        self,
        strategy: Union[str, ReplayStrategy] = "fsdp",
        *,
        settings: Optional[RoleSettings] = None,
        loss_fn: Optional[PolicyLoss] = None,
        enabled: bool = True,
        attribute: str = "replay",
        **strategy_options,
    ):
        super().__init__()
        self.settings = dataclasses.replace(settings or RoleSettings(), replay=bool(enabled))
        self.strategy = strategy
        self.strategy_options = strategy_options
        self.loss_fn = loss_fn
        self.attribute = attribute
        self.roles: Optional[ReplayRoles] = None
        self._bound = None  # (strategy, its backward before setup), restored at teardown

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and pl_module.automatic_optimization:
            raise ValueError(
                f"{type(pl_module).__name__} uses automatic optimization, but the replay policy role runs backward "
                f"itself; set self.automatic_optimization = False in __init__ and step the optimizer in training_step"
            )
        self.roles = ReplayRoles(self.strategy, settings=self.settings, loss_fn=self.loss_fn, **self.strategy_options)
        setattr(pl_module, self.attribute, self.roles)
        self._use_manual_backward(trainer, pl_module, self.roles.strategy)

    def _use_manual_backward(self, trainer, pl_module, strategy: ReplayStrategy) -> None:
        """Route the policy role's backward through ``pl_module.manual_backward``.

        Lightning's DDP strategy prepares the reducer only inside ``manual_backward`` in
        manual optimization (lightning/pytorch/strategies/ddp.py, ``DDPStrategy.pre_backward``,
        and its ``_DDPForwardRedirection`` turns the sync off around ``training_step``), so a
        plain ``loss.backward()`` inside the role would skip the gradient all-reduce.
        """
        if hasattr(strategy, "backward"):
            if self._bound is None:
                self._bound = (strategy, strategy.backward)
            strategy.backward = pl_module.manual_backward
            return
        from lightning.pytorch.strategies import DDPStrategy

        if isinstance(trainer.strategy, DDPStrategy) and trainer.world_size > 1:
            raise ValueError(
                f"the {strategy.name or type(strategy).__name__} replay strategy runs the policy backward inside its "
                f"own schedule, where Lightning's {type(trainer.strategy).__name__} cannot prepare the gradient "
                f"all-reduce, so the {trainer.world_size} replicas would drift apart; use the fsdp replay strategy "
                f"with Lightning's DDP/FSDP, or let the backend's own data parallelism reduce the gradients"
            )

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._bound is not None:
            strategy, previous = self._bound
            strategy.backward = previous
            self._bound = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if not self.settings.replay:
            return
        for i, b in enumerate(_replay_batches(batch)):
            if b.support is None:
                raise ValueError(
                    f"training batch {batch_idx}, micro-batch {i}: replay is on but the ReplayBatch carries no support "
                    f"rows; capture them at rollout (nemo_replay.capture.sample) or use ReplayCallback(enabled=False)"
                )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.roles is None or not self.roles.last_metrics:
            return
        logged = {f"replay/{k}": float(v) for k, v in self.roles.last_metrics.items()}
        pl_module.log_dict(logged, on_step=True, on_epoch=False, batch_size=max(1, len(_replay_batches(batch))))
