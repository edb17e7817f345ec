"""Replay's classes in verl's registries, in every process verl runs (docs/design.md §9.3).

verl imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` at the end of ``import
verl`` (``verl/__init__.py``), in the driver and in every Ray actor that imports it. Replay's
overlays (``configs/verl/replay_*.yaml``) set it through
``ray_kwargs.ray_init.runtime_env.env_vars``, so the process that launches the rollout
servers and the agent loop workers import this module before they build anything. Importing
it calls :func:`install`:

- ``RolloutReplicaRegistry`` (``workers/rollout/replica.py``): ``vllm`` and ``sglang`` load
  replay's replica classes (:mod:`.rollout`). They are verl's when their rollout config
  leaves replay off, and for reward-model and teacher replicas;
- verl's agent loop registry (``experimental/agent_loop/agent_loop.py``, ``register``):
  ``replay_single_turn_agent`` and ``replay_tool_agent`` (:mod:`.agent_loop`).

Registering a name twice replaces it with the same class: installing again changes nothing.
"""

from __future__ import annotations

__all__ = ["install"]


def _load_vllm() -> type:
    from nemo_replay.integrations.verl.rollout import replay_vllm_replica_class

    return replay_vllm_replica_class()


def _load_sglang() -> type:
    from nemo_replay.integrations.verl.rollout import replay_sglang_replica_class

    return replay_sglang_replica_class()


def install() -> None:
    """Register replay's replica loaders and agent loops in this process's verl registries."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from nemo_replay.integrations.verl.agent_loop import register_agent_loops

    RolloutReplicaRegistry.register("vllm", _load_vllm)
    RolloutReplicaRegistry.register("sglang", _load_sglang)
    register_agent_loops()


install()
