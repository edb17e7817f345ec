"""Replay inside verl 0.9.1 (docs/design.md §9.3). Importing this package imports no verl.

A verl run switches replay on with an overlay (``configs/verl/replay_fsdp.yaml`` or
``replay_megatron.yaml``) and checks the composed config with :func:`check_verl_config`. The
modules, those that need verl importing it themselves (``pip install "nemo_replay[verl]"``):

- :mod:`.keys`: ``SUPPORT_KEY``, ``PAD_ID`` and the other names both sides share;
- :mod:`.rollout`: rows from verl's vLLM and SGLang servers into ``TokenOutput.extra_fields``,
  and the replica classes whose servers record them (verl imported on first build);
- :mod:`.agent_loop`: verl's agent loops, worker and manager carrying the rows into the batch
  as ``routed_experts`` is carried (imports verl);
- :mod:`.plugin`: registers replay's replicas and agent loops in verl's registries when verl
  imports it (``VERL_USE_EXTERNAL_MODULES``);
- :mod:`.recipe`: :func:`check_verl_config`, every setting replay cannot run with, at once;
- :mod:`.metrics`: :func:`replay_metrics`, :func:`engine_metrics` for verl's metrics dict;
- the trainer side: verl's FSDP and Megatron engines scoring over the rows (:mod:`.engine`,
  :mod:`.fsdp`, :mod:`.megatron`, :mod:`.layout`).
"""

from nemo_replay.integrations.verl.keys import LOG_SUPPORT_MASS_KEY, PAD_ID, SUPPORT_KEY

__all__ = ["LOG_SUPPORT_MASS_KEY", "PAD_ID", "SUPPORT_KEY", "check_verl_config", "engine_metrics", "replay_metrics"]

_LAZY = {
    "check_verl_config": "nemo_replay.integrations.verl.recipe",
    "engine_metrics": "nemo_replay.integrations.verl.metrics",
    "replay_metrics": "nemo_replay.integrations.verl.metrics",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
