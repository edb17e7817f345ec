"""Replay inside trainers that own their loop (docs/design.md §6).

One module per framework; each imports its framework inside itself, so importing this
package imports none of them:

- :mod:`~nemo_replay.integrations.lightning`: ``ReplayCallback`` for LightningModule trainers.
- :mod:`~nemo_replay.integrations.trl`: ``ReplayGRPOTrainer``, TRL 1.16's ``GRPOTrainer`` with
  replay (TRL is imported on first access to the class; docs/design.md §9.2).
- :mod:`~nemo_replay.integrations.nemo_rl`: NeMo-RL's GRPO with replay -- the post-processors,
  replay's vLLM and policy workers, the driver's data path, the one source patch and the
  ``run_grpo`` launcher (NeMo-RL is imported only by the workers and the launcher; docs/design.md §9.1).
- :mod:`~nemo_replay.integrations.verl`: verl 0.9.1's GRPO/PPO with replay -- its rollout servers,
  agent loops and batches, its FSDP and Megatron engines, the config overlays' check and the
  metrics (verl is imported by the submodules only; docs/design.md §9.3).
"""
