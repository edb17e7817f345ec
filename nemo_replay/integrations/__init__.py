"""Replay inside trainers that own their loop (docs/design.md §6).

One module per framework; each imports its framework inside itself, so importing this
package imports none of them:

- :mod:`~nemo_replay.integrations.lightning`: ``ReplayCallback`` for LightningModule trainers.
- :mod:`~nemo_replay.integrations.trl`: ``ReplayGRPOTrainer``, TRL 1.16's ``GRPOTrainer`` with
  replay (TRL is imported on first access to the class; docs/design.md §9.2).
"""
