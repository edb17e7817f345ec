"""Moved: the role callbacks are package API, not part of the reference trainer."""

raise ImportError("nemo_replay.trainer.roles moved to nemo_replay.roles; use `from nemo_replay.roles import ReplayRoles`")
