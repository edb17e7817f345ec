"""NeMo-RL's GRPO with replay switched on: ``examples/run_grpo.py``'s command line, replay's workers.

    python -m nemo_replay.integrations.nemo_rl.run_grpo --config examples/configs/grpo_math_1B_replay.yaml [key=value ...]
    python -m nemo_replay.integrations.nemo_rl.run_grpo --config ... --check    # checks and prints, starts nothing

Run it where ``examples/run_grpo.py`` runs (a NeMo-RL checkout at
:data:`~.layout.NEMO_RL_COMMIT` with the rollout patch applied, :mod:`.patch`; under
``uv run`` as NeMo-RL documents). In phases:

1. load the recipe with NeMo-RL's loader and Hydra overrides, resolve it, and refuse every
   setting replay cannot run with (:func:`~.recipe.check_nemo_rl_recipe`) before any
   cluster starts;
2. wire replay in the driver: the data path (:func:`~.datapath.install_data_path`), replay's
   vLLM worker in place of NeMo-RL's (``vllm_generation.resolve_generation_worker_cls``),
   the package importable by the workers (``PYTHONPATH``, which NeMo-RL's worker groups
   pass on), and, once Ray is up, each replay worker in the Python environment of the
   NeMo-RL worker it extends;
3. run NeMo-RL's own ``setup`` with a policy factory that passes replay's policy worker as
   ``worker_extension_cls_fqn``, then NeMo-RL's ``grpo_train``.

Synchronous GRPO only: the async trainer needs vLLM's async engine and the TransferQueue
trainer builds its batches elsewhere; the recipe check refuses both.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import pprint
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from nemo_replay.integrations.nemo_rl.datapath import install_data_path, replay_run
from nemo_replay.integrations.nemo_rl.metrics import policy_with_replay_metrics
from nemo_replay.integrations.nemo_rl.recipe import check_nemo_rl_recipe
from nemo_replay.integrations.nemo_rl.workers import nemo_rl_fqn, worker_fqn

__all__ = ["NemoRL", "parse_args", "load_recipe", "wire_driver", "register_worker_environments", "main"]


@dataclass
class NemoRL:
    """The NeMo-RL entry points the launcher calls (:meth:`load` imports them from NeMo-RL)."""

    register_omegaconf_resolvers: Callable
    load_config: Callable
    parse_hydra_overrides: Callable
    to_container: Callable
    MasterConfig: Callable
    get_next_experiment_dir: Callable
    init_ray: Callable
    get_tokenizer: Callable
    configure_generation_config: Callable
    setup_response_data: Callable
    Policy: Callable
    grpo: Any
    batched_data_dict: Any
    rollouts: Any
    vllm_generation: Any
    actor_registry: dict
    create_local_venv_on_each_node: Callable

    @classmethod
    def load(cls) -> "NemoRL":
        imp = importlib.import_module
        from omegaconf import OmegaConf

        config, venvs = imp("nemo_rl.utils.config"), imp("nemo_rl.utils.venvs")
        grpo = imp("nemo_rl.algorithms.grpo")
        return cls(
            register_omegaconf_resolvers=config.register_omegaconf_resolvers,
            load_config=config.load_config,
            parse_hydra_overrides=config.parse_hydra_overrides,
            to_container=lambda cfg: OmegaConf.to_container(cfg, resolve=True),
            MasterConfig=grpo.MasterConfig,
            get_next_experiment_dir=imp("nemo_rl.utils.logger").get_next_experiment_dir,
            init_ray=imp("nemo_rl.distributed.virtual_cluster").init_ray,
            get_tokenizer=imp("nemo_rl.algorithms.utils").get_tokenizer,
            configure_generation_config=imp("nemo_rl.models.generation").configure_generation_config,
            setup_response_data=imp("nemo_rl.data.utils").setup_response_data,
            Policy=imp("nemo_rl.models.policy.lm_policy").Policy,
            grpo=grpo,
            batched_data_dict=imp("nemo_rl.distributed.batched_data_dict"),
            rollouts=imp("nemo_rl.experience.rollouts"),
            vllm_generation=imp("nemo_rl.models.generation.vllm.vllm_generation"),
            actor_registry=imp("nemo_rl.distributed.ray_actor_environment_registry").ACTOR_ENVIRONMENT_REGISTRY,
            create_local_venv_on_each_node=venvs.create_local_venv_on_each_node,
        )


def parse_args(argv: Optional[list[str]] = None) -> tuple[str, list[str], bool]:
    """(config path, Hydra overrides, ``--check``), as ``examples/run_grpo.py`` reads them."""
    parser = argparse.ArgumentParser(
        prog="python -m nemo_replay.integrations.nemo_rl.run_grpo",
        description="NeMo-RL GRPO with support-conditioned replay (same command line as examples/run_grpo.py).",
    )
    parser.add_argument("--config", required=True, help="NeMo-RL recipe YAML, e.g. examples/configs/grpo_math_1B_replay.yaml")
    parser.add_argument("--check", action="store_true",
                        help="load and check the recipe as a run would, print what replay will ask of NeMo-RL and vLLM, "
                             "and exit without starting Ray")
    args, overrides = parser.parse_known_args(argv)
    return args.config, overrides, args.check


def load_recipe(nemo: NemoRL, config_path: str, overrides: list[str]) -> dict:
    """The resolved recipe, checked for replay (raises ValueError listing every problem)."""
    config = nemo.load_config(config_path)
    if overrides:
        config = nemo.parse_hydra_overrides(config, overrides)
    resolved = nemo.to_container(config)
    check_nemo_rl_recipe(resolved)
    return resolved


def replay_summary(recipe: dict) -> list[str]:
    """What replay will run with and ask for, one line each (``--check`` and the start of a run)."""
    from nemo_replay.rollout.engines.vllm import VLLM_DEFAULT_MAX_LOGPROBS, vllm_row_width

    gen = recipe["policy"]["generation"]
    top_k = gen["top_k"]
    vllm_kwargs = gen.get("vllm_kwargs") or {}
    max_logprobs = vllm_kwargs.get("max_logprobs", VLLM_DEFAULT_MAX_LOGPROBS)
    width = vllm_row_width(top_k, None if vllm_kwargs.get("return_sampling_mask") is True else max_logprobs)
    asked = ("the engine's sampling masks (return_sampling_mask; requests keep logprobs=0)"
             if vllm_kwargs.get("return_sampling_mask") is True else
             f"logprobs={width + 1} per token (max_logprobs={max_logprobs}, logprobs_mode="
             f"{(gen.get('vllm_cfg') or {}).get('logprobs_mode')}, flat_logprobs where vLLM has it)")
    lines = [
        f"replay: policy worker {_policy_worker(recipe)}, generation worker ReplayVllmGenerationWorker (vLLM, synchronous)",
        f"replay: sampling temperature={gen['temperature']} top_k={top_k} top_p={gen['top_p']}; vLLM is asked {asked}",
        f"replay: generation_support one compact SampleRows a sample: supports up to {width} ids read whole"
        + ("" if width >= top_k + 16 else f" (ties past that are flagged: max_logprobs={top_k + 17} reads {top_k + 16})"),
    ]
    val = recipe.get("grpo", {}).get("val_period", 0)
    if val:
        lines.append(f"replay: validation (grpo.val_period={val}) samples with the same top_k / top_p: the recipe's "
                     f"generation settings apply to it too")
    return lines


def _policy_worker(recipe: dict) -> str:
    return "ReplayMegatronPolicyWorker" if (recipe["policy"].get("megatron_cfg") or {}).get("enabled") else "ReplayDTensorPolicyWorkerV2"


def _expose_package(run_dir: str) -> str:
    """A ``PYTHONPATH`` entry that holds only this package (a link to it), prepended in this process's env."""
    entry = Path(run_dir).resolve() / "replay_pythonpath"
    entry.mkdir(parents=True, exist_ok=True)
    link, package = entry / "nemo_replay", Path(__file__).resolve().parents[2]
    if not link.is_symlink() or link.resolve() != package:
        if link.is_symlink():
            link.unlink()
        link.symlink_to(package, target_is_directory=True)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(entry)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(entry), *paths])
    return str(entry)


def wire_driver(nemo: NemoRL, recipe: dict, run_dir: str) -> Callable:
    """Phase 2 before Ray: the data path, the vLLM worker swap, the package path; returns the policy factory."""
    install_data_path(grpo=nemo.grpo, batched_data_dict=nemo.batched_data_dict, rollouts=nemo.rollouts)
    ours, theirs = worker_fqn("ReplayVllmGenerationWorker"), nemo_rl_fqn("ReplayVllmGenerationWorker")
    resolve = nemo.vllm_generation.resolve_generation_worker_cls
    if not getattr(resolve, "nemo_replay", False):

        def resolve_replay_worker(default_cls: str, config: dict) -> str:
            if default_cls != theirs:
                raise ValueError(
                    f"replay's generation worker extends {theirs}; NeMo-RL asked for {default_cls} (set "
                    f"policy.generation.vllm_cfg.async_engine=false)"
                )
            return ours

        resolve_replay_worker.nemo_replay = True
        nemo.vllm_generation.resolve_generation_worker_cls = resolve_replay_worker
    _expose_package(run_dir)
    # Policies whose train() combines replay's metric parts into replay/mismatch_mean and _max (metrics.py).
    return policy_with_replay_metrics(
        functools.partial(nemo.Policy, worker_extension_cls_fqn=worker_fqn(_policy_worker(recipe)))
    )


def register_worker_environments(nemo: NemoRL, recipe: dict) -> dict[str, str]:
    """Each replay worker runs in the Python of the NeMo-RL worker it extends (after Ray is up).

    A ``uv ...`` environment is resolved to the virtualenv NeMo-RL builds for its own class
    (named after that class), so no second environment is built for replay's.
    """
    done = {}
    for name in ("ReplayVllmGenerationWorker", _policy_worker(recipe)):
        theirs = nemo_rl_fqn(name)
        env = nemo.actor_registry[theirs]
        if env.startswith("uv"):
            env = nemo.create_local_venv_on_each_node(py_executable=env, venv_name=theirs)
        nemo.actor_registry[worker_fqn(name)] = done[worker_fqn(name)] = env
    return done


def main(argv: Optional[list[str]] = None, nemo: Optional[NemoRL] = None) -> int:
    nemo = nemo or NemoRL.load()
    nemo.register_omegaconf_resolvers()
    config_path, overrides, check = parse_args(argv)
    try:
        recipe = load_recipe(nemo, config_path, overrides)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"Loaded configuration from: {config_path}" + (f" with overrides {overrides}" if overrides else ""))
    for line in replay_summary(recipe):
        print(line)
    if check:
        print("replay: the recipe passes every check; no cluster was started (--check)")
        return 0
    print("Final config:")
    pprint.pprint(recipe)
    config = nemo.MasterConfig(**recipe)
    config.logger["log_dir"] = nemo.get_next_experiment_dir(config.logger["log_dir"])
    print(f"Using log directory: {config.logger['log_dir']}")
    policy_factory = wire_driver(nemo, recipe, config.logger["log_dir"])
    nemo.init_ray()
    register_worker_environments(nemo, recipe)

    tokenizer = nemo.get_tokenizer(config.policy["tokenizer"])
    megatron_cfg = config.policy.get("megatron_cfg") or {}
    config.policy["generation"] = nemo.configure_generation_config(
        config.policy["generation"], tokenizer, has_refit_draft_weights=bool(config.policy["draft"]["enabled"]),
        trains_mtp=bool(megatron_cfg.get("mtp_num_layers")),
    )
    dataset, val_dataset, task_to_env, val_task_to_env = nemo.setup_response_data(tokenizer, config.data, config.env)
    # The wrapped data path insists on rows inside this run only (datapath.replay_run).
    with replay_run(worker=worker_fqn("ReplayVllmGenerationWorker")):
        (policy, policy_generation, _gym, _cluster, dataloader, val_dataloader, loss_fn, logger, checkpointer, grpo_state,
         master_config, _teachers, _aliases) = nemo.grpo.setup(config, tokenizer, dataset, val_dataset,
                                                               policy_factory=policy_factory)
        try:
            with checkpointer:
                nemo.grpo.grpo_train(
                    policy, policy_generation, dataloader, val_dataloader, tokenizer, loss_fn, task_to_env,
                    val_task_to_env, logger, checkpointer, grpo_state, master_config,
                )
        finally:
            nemo.grpo.shutdown_environments(task_to_env, val_task_to_env)
            policy_generation.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
