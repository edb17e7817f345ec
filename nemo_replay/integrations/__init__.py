"""Replay inside trainers that own their loop (docs/design.md §6).

One module per framework; each imports its framework inside itself, so importing this
package imports none of them:

- :mod:`~nemo_replay.integrations.lightning`: ``ReplayCallback`` for LightningModule trainers.
"""
