"""Moved: the built-in tasks are package-level (recipe validation reads their names)."""

raise ImportError("nemo_replay.trainer.task moved to nemo_replay.tasks; use `from nemo_replay.tasks import SuccessorTask`")
