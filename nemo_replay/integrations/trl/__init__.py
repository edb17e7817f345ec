"""Replay inside TRL's ``GRPOTrainer`` (TRL 1.16; docs/design.md §9).

A drop-in subclass: the same constructor and ``GRPOConfig``, replay settings through one
extra argument::

    from nemo_replay.integrations.trl import ReplayGRPOTrainer, ReplaySettings

    trainer = ReplayGRPOTrainer(
        model=model, reward_funcs=reward, args=GRPOConfig(..., top_k=50, top_p=0.95),
        train_dataset=dataset, processing_class=tokenizer,
        replay=ReplaySettings(source="hidden"),        # the one extra argument
    )
    trainer.train()

Importing this package does not import TRL; ``ReplayGRPOTrainer`` does, on first access
(``pip install "nemo_replay[trl]"``). :class:`ReplaySettings` and the per-completion records
(:mod:`.records`) need no TRL.
"""

from nemo_replay.integrations.trl.settings import ReplaySettings

__all__ = ["ReplayGRPOTrainer", "ReplaySettings"]


def __getattr__(name: str):
    if name == "ReplayGRPOTrainer":
        try:
            from nemo_replay.integrations.trl.trainer import ReplayGRPOTrainer
        except ImportError as exc:
            raise ImportError(
                f"nemo_replay.integrations.trl.ReplayGRPOTrainer needs TRL 1.16 ({exc}); install it with "
                f"pip install \"nemo_replay[trl]\""
            ) from exc
        return ReplayGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
