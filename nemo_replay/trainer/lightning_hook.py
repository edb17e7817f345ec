"""Moved: integrations with other trainers live in nemo_replay.integrations."""

raise ImportError(
    "nemo_replay.trainer.lightning_hook moved to nemo_replay.integrations.lightning; "
    "use `from nemo_replay.integrations.lightning import ReplayCallback`"
)
