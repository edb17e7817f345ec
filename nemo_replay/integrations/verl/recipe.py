"""Check a verl 0.9.1 config for every setting replay cannot run with, all at once (docs/design.md §9.3).

    from nemo_replay.integrations.verl.recipe import check_verl_config
    check_verl_config(config)        # the composed Hydra config of verl.trainer.main_ppo

Each line names the flag, the value that came and what to set. The rules follow verl's
config dataclasses and the code that reads them (paths inside the verl 0.9.1 wheel):

- ``RolloutConfig`` (``workers/config/rollout.py``): ``name`` (the server class: vLLM or
  SGLang only), ``temperature``, ``top_k``, ``top_p``, ``do_sample``, ``repetition_penalty``,
  ``logprobs_mode`` (default ``processed_logprobs``), ``engine_kwargs.vllm.max_logprobs``
  (vLLM's default cap is 20), ``calculate_log_probs``, ``disaggregation.enabled`` (PD serving
  rebuilds the output on a decode peer), ``mtp`` (speculative decoding), ``custom`` (replay's
  switches live in ``custom.replay``);
- ``AgentLoopConfig`` (same file): ``default_agent_loop`` and ``agent_loop_manager_class``;
- ``HFModelConfig.use_fused_kernels`` (``workers/config/model.py``): the fused head scores the
  full vocabulary from hidden states, outside the engine's log-prob path;
- ``trainer.use_v1`` / ``trainer.v1.trainer_mode`` (``trainer/config/ppo_trainer.yaml``): the
  async trainer modes use ``FullyAsyncLLMServerClient`` (``workers/rollout/llm_server.py``),
  which rebuilds each ``TokenOutput`` across resumed requests and drops its ``extra_fields``;
- ``actor_rollout_ref.actor.strategy``: replay's engines cover FSDP and Megatron;
- ``ray_kwargs.ray_init.runtime_env.env_vars``: ``VERL_USE_EXTERNAL_MODULES`` naming
  :mod:`.plugin` (and the trainer side's engine module), ``VERL_ENGINE_VENDOR=nemo_replay``.

Validation sampling (``val_kwargs``) is free: requests that do not carry the training
settings are served without rows (:mod:`.rollout`).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from nemo_replay.integrations.recipe_paths import get_path, is_int, is_number
from nemo_replay.rollout.engines.vllm import max_logprobs_problem

__all__ = ["check_verl_config", "PLUGIN_MODULE", "ENGINE_VENDOR"]

#: The module verl must import in every process (``VERL_USE_EXTERNAL_MODULES``).
PLUGIN_MODULE = "nemo_replay.integrations.verl.plugin"
#: ``VERL_ENGINE_VENDOR`` value that makes verl build replay's training engines.
ENGINE_VENDOR = "nemo_replay"
#: Trainer-side modules registering replay's engines, by ``actor_rollout_ref.actor.strategy``.
ENGINE_MODULES = {
    "fsdp": "nemo_replay.integrations.verl.fsdp",
    "fsdp2": "nemo_replay.integrations.verl.fsdp",
    "megatron": "nemo_replay.integrations.verl.megatron",
}
V0_MANAGER = "nemo_replay.integrations.verl.agent_loop.ReplayAgentLoopManager"
AGENT_LOOP_NAMES = ("replay_single_turn_agent", "replay_tool_agent")
_ROLLOUT = "actor_rollout_ref.rollout"


def _plain(config: Any) -> Any:
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover
        return config
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True, throw_on_missing=False)
    return config


def check_verl_config(config: Any) -> None:
    """Refuse a verl config under which replay cannot run or would be bypassed.

    Args:
        config: verl's composed config (``DictConfig`` from Hydra, or the same as a mapping).

    Raises:
        ValueError listing every problem, one line each: the flag, what came, what to set.
    """
    cfg = _plain(config)
    if not isinstance(cfg, Mapping) or not isinstance(get_path(cfg, _ROLLOUT), Mapping):
        raise ValueError("check_verl_config: expected verl's composed config, with an actor_rollout_ref.rollout section")
    problems: list[str] = []
    _check_switches(cfg, problems)
    _check_sampling(cfg, problems)
    _check_engine(cfg, problems)
    _check_agent_loop(cfg, problems)
    _check_trainer(cfg, problems)
    _check_plugin(cfg, problems)
    if problems:
        raise ValueError("verl config cannot run replay:\n  " + "\n  ".join(problems))


def _check_switches(cfg, problems: list) -> None:
    replay = get_path(cfg, f"{_ROLLOUT}.custom.replay")
    if not isinstance(replay, Mapping) or replay.get("enabled") is not True:
        got = None if not isinstance(replay, Mapping) else replay.get("enabled")
        problems.append(
            f"{_ROLLOUT}.custom.replay.enabled={got!r}: set true (the servers record supports and the loops carry them "
            f"only when it is on)"
        )
        return
    width, top_k = replay.get("support_width"), get_path(cfg, f"{_ROLLOUT}.top_k")
    if width is not None and (not is_int(width) or width < 2 or (is_int(top_k) and width < top_k)):
        problems.append(
            f"{_ROLLOUT}.custom.replay.support_width={width!r}: set null (the rollout's top_k) or an int >= top_k="
            f"{top_k!r} (a support wider than the row is left out of the loss)"
        )
    source = replay.get("source", "logits")
    if source not in ("logits", "hidden"):
        problems.append(f"{_ROLLOUT}.custom.replay.source={source!r}: set logits or hidden")


def _check_sampling(cfg, problems: list) -> None:
    temperature = get_path(cfg, f"{_ROLLOUT}.temperature")
    if not is_number(temperature) or temperature <= 0:
        problems.append(
            f"{_ROLLOUT}.temperature={temperature!r}: set a finite number > 0, e.g. 1.0 (0 is greedy decoding: no "
            f"distribution to replay; the trainer divides its logits by this temperature)"
        )
    top_k = get_path(cfg, f"{_ROLLOUT}.top_k")
    if not is_int(top_k) or top_k < 2:
        problems.append(
            f"{_ROLLOUT}.top_k={top_k!r}: set an int > 1, e.g. 64 (-1 or 0 leave the support unbounded: no engine "
            f"returns it whole; top_p alone does not bound it)"
        )
    top_p = get_path(cfg, f"{_ROLLOUT}.top_p")
    if not is_number(top_p) or not 0 < top_p <= 1:
        problems.append(f"{_ROLLOUT}.top_p={top_p!r}: set a number in (0, 1]")
    if get_path(cfg, f"{_ROLLOUT}.do_sample", True) is not True:
        problems.append(f"{_ROLLOUT}.do_sample={get_path(cfg, f'{_ROLLOUT}.do_sample')!r}: set true (replay needs sampled training rollouts)")
    penalty = get_path(cfg, f"{_ROLLOUT}.repetition_penalty", 1.0)
    if penalty != 1.0:
        problems.append(
            f"{_ROLLOUT}.repetition_penalty={penalty!r}: set 1.0 (a penalty rewrites logits from the generation "
            f"history; no trainer pass reproduces it)"
        )
    if get_path(cfg, f"{_ROLLOUT}.calculate_log_probs") is not True:
        problems.append(
            f"{_ROLLOUT}.calculate_log_probs={get_path(cfg, f'{_ROLLOUT}.calculate_log_probs')!r}: set true (the sampler's "
            f"log-probs, rollout_log_probs, are what the replayed ones are measured against)"
        )


def _verl_release() -> str:
    """The installed verl's version ("" when it is not installed)."""
    try:
        from importlib.metadata import version

        return version("verl")
    except Exception:  # noqa: BLE001 - not installed, or no metadata: no release to hold against
        return ""


def _check_engine(cfg, problems: list) -> None:
    name = get_path(cfg, f"{_ROLLOUT}.name")
    top_k = get_path(cfg, f"{_ROLLOUT}.top_k")
    if name not in ("vllm", "sglang"):
        problems.append(
            f"{_ROLLOUT}.name={name!r}: set vllm or sglang (replay's servers extend those two; sglang needs >= 0.5.23, "
            f"and a verl whose SGLang server runs it)"
        )
    if name == "vllm":
        mode = get_path(cfg, f"{_ROLLOUT}.logprobs_mode", "processed_logprobs")
        if mode != "processed_logprobs":
            problems.append(
                f"{_ROLLOUT}.logprobs_mode={mode!r}: set processed_logprobs (raw log-probs never mark the filtered "
                f"candidates, so no support can be read from them)"
            )
        vllm_kwargs = get_path(cfg, f"{_ROLLOUT}.engine_kwargs.vllm") or {}
        if vllm_kwargs.get("return_sampling_mask") is not True and is_int(top_k) and top_k >= 2:
            path = f"{_ROLLOUT}.engine_kwargs.vllm.max_logprobs"
            problem = max_logprobs_problem(top_k, vllm_kwargs.get("max_logprobs"), path, absent="max_logprobs" not in vllm_kwargs)
            if problem is not None:
                problems.append(problem)
    if name == "sglang" and _verl_release().startswith("0.9."):
        problems.append(
            f"{_ROLLOUT}.name='sglang': set vllm. verl {_verl_release()}'s SGLang server cannot run an SGLang that returns "
            f"sampling masks (>= 0.5.21 with the fields replay reads): its launch calls dataclasses.fields(ServerArgs), a "
            f"msgspec struct since SGLang 0.5.20, its weight sync lacks the weight-update session 0.5.21 requires, and "
            f"SGLang 0.5.22+ pins transformers past verl's < 5.11; SGLang 0.5.12 (verl's pin) returns no support"
        )
    if name == "sglang":
        limit = (get_path(cfg, f"{_ROLLOUT}.engine_kwargs.sglang") or {}).get("sampling_mask_max_tokens", 4096)
        if is_int(top_k) and is_int(limit) and top_k > limit:
            problems.append(
                f"{_ROLLOUT}.engine_kwargs.sglang.sampling_mask_max_tokens={limit!r}: set >= top_k={top_k} (SGLang "
                f"returns masks only for 1 < top_k <= this limit)"
            )
    if get_path(cfg, f"{_ROLLOUT}.disaggregation.enabled", False):
        problems.append(
            f"{_ROLLOUT}.disaggregation.enabled=True: set false (prefill/decode serving returns the decode peer's output, "
            f"not the request the support was asked on)"
        )
    mtp = get_path(cfg, f"{_ROLLOUT}.mtp") or {}
    if mtp.get("enable") and mtp.get("enable_rollout"):
        problems.append(
            f"{_ROLLOUT}.mtp.enable_rollout=True: set false (speculative decoding's accepted tokens are not reported "
            f"with whole supports)"
        )


def _check_agent_loop(cfg, problems: list) -> None:
    loop = get_path(cfg, f"{_ROLLOUT}.agent.default_agent_loop")
    if loop not in AGENT_LOOP_NAMES:
        problems.append(
            f"{_ROLLOUT}.agent.default_agent_loop={loop!r}: set replay_single_turn_agent (or replay_tool_agent with "
            f"multi_turn tools): verl's own loops drop the rows (a dataset's agent_name column must name these too)"
        )
    manager = get_path(cfg, f"{_ROLLOUT}.agent.agent_loop_manager_class")
    use_v1 = get_path(cfg, "trainer.use_v1", True)
    if use_v1 and manager is not None:
        problems.append(
            f"{_ROLLOUT}.agent.agent_loop_manager_class={manager!r}: set null with trainer.use_v1=true (verl's "
            f"AgentLoopManagerTQ stores each output's as_dict(), rows included; another manager may not)"
        )
    if not use_v1 and manager != V0_MANAGER:
        problems.append(
            f"{_ROLLOUT}.agent.agent_loop_manager_class={manager!r}: set {V0_MANAGER} with trainer.use_v1=false (its "
            f"workers pad the rows into the batch as routed_experts is padded; on the command line "
            f"+{_ROLLOUT}.agent.agent_loop_manager_class=..., a key verl's yaml does not list)"
        )


def _check_trainer(cfg, problems: list) -> None:
    mode = get_path(cfg, "trainer.v1.trainer_mode", "sync")
    if get_path(cfg, "trainer.use_v1", True) and mode != "sync":
        problems.append(
            f"trainer.v1.trainer_mode={mode!r}: set sync (the async modes' FullyAsyncLLMServerClient rebuilds each "
            f"TokenOutput across resumed requests and drops the rows in its extra_fields)"
        )
    strategy = get_path(cfg, "actor_rollout_ref.actor.strategy")
    if strategy not in ENGINE_MODULES:
        problems.append(
            f"actor_rollout_ref.actor.strategy={strategy!r}: set fsdp, fsdp2 or megatron (replay's training engines "
            f"extend verl's FSDP and Megatron engines)"
        )
    source = get_path(cfg, f"{_ROLLOUT}.custom.replay.source", "logits")
    if get_path(cfg, "actor_rollout_ref.model.use_fused_kernels", False) and source != "hidden":
        problems.append(
            "actor_rollout_ref.model.use_fused_kernels=True: set false (the fused head scores the whole vocabulary from "
            f"hidden states, outside the log-probs replay scores), or {_ROLLOUT}.custom.replay.source=hidden"
        )


def _check_plugin(cfg, problems: list) -> None:
    env = get_path(cfg, "ray_kwargs.ray_init.runtime_env.env_vars") or {}
    modules = str(env.get("VERL_USE_EXTERNAL_MODULES", os.environ.get("VERL_USE_EXTERNAL_MODULES", "")))
    names = {m.strip() for m in modules.split(",") if m.strip()}
    strategy = get_path(cfg, "actor_rollout_ref.actor.strategy")
    wanted = [PLUGIN_MODULE] + ([ENGINE_MODULES[strategy]] if strategy in ENGINE_MODULES else [])
    if not set(wanted) <= names:
        problems.append(
            f"ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES={modules or None!r}: set "
            f"{','.join(wanted)} (verl imports these in every process: they register replay's servers, agent loops "
            f"and engines)"
        )
    vendor = env.get("VERL_ENGINE_VENDOR", os.environ.get("VERL_ENGINE_VENDOR"))
    if vendor != ENGINE_VENDOR:
        problems.append(
            f"ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR={vendor!r}: set {ENGINE_VENDOR} (verl builds "
            f"replay's engines for the actor and reference only under this vendor)"
        )
