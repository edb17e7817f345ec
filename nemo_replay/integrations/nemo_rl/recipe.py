"""Check a resolved NeMo-RL recipe for the options replay depends on (the overlays in configs/nemo_rl/).

Call it on the launcher's config before building workers; every problem is reported at
once, each naming the NeMo-RL flag, the value that came, and what to set:

    from nemo_replay.integrations.nemo_rl import check_nemo_rl_recipe
    check_nemo_rl_recipe(OmegaConf.to_container(config, resolve=True))

The rules follow NeMo-RL at :data:`~nemo_replay.integrations.nemo_rl.token_aligned.NEMO_RL_COMMIT`.
A key NeMo-RL reads with a default (``.get``) reads as that default when absent; a
parallel or cluster size reads as 1, its value in NeMo-RL's ``grpo_math_1B.yaml``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from nemo_replay.integrations.recipe_paths import get_path, is_int, is_number
from nemo_replay.rollout.engines.vllm import VLLM_DEFAULT_MAX_LOGPROBS, VLLM_TIE_MARGIN, max_logprobs_problem

__all__ = ["check_nemo_rl_recipe"]


_ABSENT = object()


def _size(cfg, path: str, problems: list, *, default: Optional[int] = 1, minimum: int = 1, why: str) -> Optional[int]:
    """The int at ``path`` (``default`` when absent), or None after appending its problem line."""
    value = get_path(cfg, path, _ABSENT)
    if value is _ABSENT:
        value = default
    if not is_int(value) or value < minimum:
        problems.append(f"{path}={value!r}: set an int >= {minimum} ({why})")
        return None
    return value


def check_nemo_rl_recipe(config: Mapping[str, Any]) -> None:
    """Refuse a NeMo-RL recipe under which replay cannot run or would be bypassed.

    Args:
        config: the resolved recipe as a mapping (top level ``policy``, ``grpo``, ``cluster``, ...).

    Raises:
        ValueError listing every problem, one line each: the flag, what came, what to set.
    """
    if not isinstance(config, Mapping) or not isinstance(config.get("policy"), Mapping):
        raise ValueError("check_nemo_rl_recipe: expected NeMo-RL's resolved recipe, a mapping with a 'policy' section")
    problems: list[str] = []
    _check_sampling(config, problems)
    _check_generation_engine(config, problems)
    _check_trainer(config, problems)
    _check_training_backend(config, problems)
    _check_cluster(config, problems)
    if problems:
        raise ValueError("NeMo-RL recipe cannot run replay:\n  " + "\n  ".join(problems))


def _check_sampling(config, problems: list) -> None:
    top_k = get_path(config, "policy.generation.top_k")
    if not is_int(top_k) or top_k < 2:
        problems.append(
            f"policy.generation.top_k={top_k!r}: set an int > 1 (the recorded support is the sampler's top-k set; the "
            f"engine returns whole supports only when they are bounded)"
        )
    temperature = get_path(config, "policy.generation.temperature")
    if not is_number(temperature) or temperature <= 0:
        problems.append(
            f"policy.generation.temperature={temperature!r}: set a finite number > 0, e.g. 1.0 (0 is greedy decoding, "
            f"a one-token support: NeMo-RL's vLLM worker samples greedy requests with top_k=1, and the trainer divides "
            f"the logits by the temperature)"
        )


def _check_generation_engine(config, problems: list) -> None:
    backend = get_path(config, "policy.generation.backend")
    if backend != "vllm":
        problems.append(
            f"policy.generation.backend={backend!r}: set vllm (only NeMo-RL's vLLM worker can return each token's "
            f"support, and replay's generation worker extends it)"
        )
    mode = get_path(config, "policy.generation.vllm_cfg.logprobs_mode")
    if mode != "processed_logprobs":
        problems.append(
            f"policy.generation.vllm_cfg.logprobs_mode={mode!r}: set processed_logprobs (raw log-probs never mark "
            f"the filtered candidates, so no support can be read from them)"
        )
    # VllmGeneration picks the async worker by truthiness; a string 'false' is async there too.
    async_engine = get_path(config, "policy.generation.vllm_cfg.async_engine", False)
    if async_engine:
        problems.append(
            f"policy.generation.vllm_cfg.async_engine={async_engine!r}: set false (the async worker's HTTP server "
            f"asserts top_k is unset, and replay's generation worker extends the synchronous VllmGenerationWorker)"
        )
    quant_cfg = get_path(config, "policy.generation.quant_cfg")
    if quant_cfg is not None:
        problems.append(
            f"policy.generation.quant_cfg={quant_cfg!r}: set null (a quant_cfg makes NeMo-RL swap in its quantized "
            f"vLLM worker, resolve_generation_worker_cls, in place of replay's)"
        )
    top_k = get_path(config, "policy.generation.top_k")
    if get_path(config, "policy.generation.vllm_kwargs.return_sampling_mask", False) is True:
        return  # exact sets from the engine (vLLM >= 0.33): no log-prob list to size
    path = "policy.generation.vllm_kwargs.max_logprobs"
    max_logprobs = get_path(config, path, _ABSENT)
    if not is_int(top_k) or top_k < 2:
        # Sized from a top_k not chosen yet: said now, so that fixing top_k does not reveal it.
        if max_logprobs is _ABSENT or not is_int(max_logprobs) or 0 <= max_logprobs < 3:
            have = f"{path} absent (vLLM's default {VLLM_DEFAULT_MAX_LOGPROBS})" if max_logprobs is _ABSENT else f"{path}={max_logprobs!r}"
            problems.append(
                f"{have}: set it with top_k, to top_k + {1 + VLLM_TIE_MARGIN} (at least top_k + 1; e.g. "
                f"{64 + 1 + VLLM_TIE_MARGIN} for top_k 64): each request asks that many log-probs and vLLM refuses one "
                f"above max_logprobs"
            )
        return
    problem = max_logprobs_problem(top_k, max_logprobs, path, absent=max_logprobs is _ABSENT)
    if problem is not None:
        problems.append(problem)


def _check_trainer(config, problems: list) -> None:
    data_plane = get_path(config, "data_plane.enabled", False)
    if data_plane:
        problems.append(
            f"data_plane.enabled={data_plane!r}: set false (the TransferQueue trainer, grpo_train_sync, builds its "
            f"batches outside the path that carries generation_support)"
        )
    async_grpo = get_path(config, "grpo.async_grpo.enabled", False)
    if async_grpo:
        problems.append(
            f"grpo.async_grpo.enabled={async_grpo!r}: set false (async GRPO needs the async vLLM engine, which "
            f"replay cannot use)"
        )


def _check_training_backend(config, problems: list) -> None:
    quant_cfg = get_path(config, "policy.quant_cfg")
    if quant_cfg is not None:
        problems.append(
            f"policy.quant_cfg={quant_cfg!r}: set null (a quant_cfg makes NeMo-RL pick its quantized policy worker, "
            f"resolve_policy_worker_cls, which replay's worker extension would replace with the plain one)"
        )
    megatron = bool(get_path(config, "policy.megatron_cfg.enabled", False))
    dtensor = bool(get_path(config, "policy.dtensor_cfg.enabled", False))
    if megatron == dtensor:
        state = "both true" if megatron else "both false"
        problems.append(
            f"policy.megatron_cfg.enabled and policy.dtensor_cfg.enabled are {state}: set exactly one true (NeMo-RL's "
            f"Policy trains with one backend)"
        )
    if megatron:
        if get_path(config, "policy.megatron_cfg.use_fused_linear_logprobs", False):
            problems.append(
                "policy.megatron_cfg.use_fused_linear_logprobs=true: set false (the fused kernel gathers "
                "full-vocabulary log-probs from hidden states and skips the replay hooks)"
            )
        # Only the Megatron path reads fuse_loss (nemo_rl/models/megatron/train.py); DTensor ignores it.
        if get_path(config, "policy.sequence_packing.enabled", False) and get_path(
            config, "policy.sequence_packing.fuse_loss", False
        ):
            problems.append(
                "policy.sequence_packing.fuse_loss=true: set false (the fused packed loss ignores prepare_fn, where "
                "replay scores the policy log-probs)"
            )
    elif dtensor:
        if not get_path(config, "policy.dtensor_cfg._v2", False):
            problems.append("policy.dtensor_cfg._v2=false: set true (replay replaces the automodel v2 post-processors)")
        cp = _size(config, "policy.dtensor_cfg.context_parallel_size", problems, why="1: no context parallelism")
        if cp is not None and cp > 1:
            problems.append(
                f"policy.dtensor_cfg.context_parallel_size={cp}: set 1, or use the Megatron backend (replay lays out "
                f"Megatron's context parallelism, not torch's context_parallel)"
            )


def _model_parallel(config, problems: list) -> Optional[tuple[int, str]]:
    """PP * CP * TP of the training backend and how it was read, or None when it cannot be."""
    megatron = bool(get_path(config, "policy.megatron_cfg.enabled", False))
    dtensor = bool(get_path(config, "policy.dtensor_cfg.enabled", False))
    if megatron == dtensor:
        return None  # _check_training_backend names it
    if megatron:
        why = "a Megatron parallel size"
        pp = _size(config, "policy.megatron_cfg.pipeline_model_parallel_size", problems, why=why)
        cp = _size(config, "policy.megatron_cfg.context_parallel_size", problems, why=why)
        tp = _size(config, "policy.megatron_cfg.tensor_model_parallel_size", problems, why=why)
        section = "policy.megatron_cfg"
    else:
        pp = 1  # the DTensor worker has no pipeline parallelism
        cp = get_path(config, "policy.dtensor_cfg.context_parallel_size", 1)
        cp = cp if is_int(cp) and cp >= 1 else None  # _check_training_backend names a bad one
        tp = _size(config, "policy.dtensor_cfg.tensor_parallel_size", problems, why="a DTensor parallel size")
        section = "policy.dtensor_cfg"
    if pp is None or cp is None or tp is None:
        return None
    return pp * cp * tp, f"PP*CP*TP = {pp}*{cp}*{tp} = {pp * cp * tp} ({section})"


def _uses_reward_model(config) -> bool:
    # NeMo-RL's extract_necessary_env_names: the env_name of data.train / validation / default.
    for key in ("train", "validation", "default"):
        entries = get_path(config, f"data.{key}")
        for entry in entries if isinstance(entries, list) else [entries]:
            if isinstance(entry, Mapping) and entry.get("env_name") == "reward_model":
                return True
    return False


def _training_layout(config, problems: list):
    """How many (nodes, GPUs per node) NeMo-RL gives the policy, as a function of cluster.gpus_per_node.

    Mirrors the cluster setup of ``nemo_rl/algorithms/grpo.py`` ``setup``: colocated generation
    shares the policy's GPUs; non-colocated generation takes
    ``policy.generation.colocated.resources`` out of the cluster (GPUs of the one policy node,
    whole nodes otherwise), and so does a reward-model environment (``env.reward_model.resources``).

    Returns:
        (layout, flags, follows): ``layout(gpus_per_node) -> (nodes, gpus)``; the flags it read,
        as ``path=value``; the other flags that must equal cluster.gpus_per_node. None after
        appending a problem line when a size is malformed.
    """
    why = "NeMo-RL sizes its Ray cluster from it"
    num_nodes = _size(config, "cluster.num_nodes", problems, why=why)
    gpus = _size(config, "cluster.gpus_per_node", problems, why=why)
    flags = [f"cluster.gpus_per_node={gpus}", f"cluster.num_nodes={num_nodes}"]
    rm_nodes = rm_gpus = 0
    if _uses_reward_model(config):
        why = "the reward model's GPUs come out of the cluster"
        path = "env.reward_model.resources"
        rm_nodes = _size(config, f"{path}.num_nodes", problems, default=0, minimum=0, why=why)
        rm_gpus = _size(config, f"{path}.gpus_per_node", problems, default=0, minimum=0, why=why)
        flags += [f"{path}.gpus_per_node={rm_gpus}", f"{path}.num_nodes={rm_nodes}"]
    if num_nodes is None or rm_nodes is None or rm_gpus is None:
        return None
    policy_nodes = num_nodes if num_nodes == 1 else num_nodes - rm_nodes
    rm_here = rm_gpus if num_nodes == 1 else 0  # a reward model shares the node only on a 1-node cluster
    if bool(get_path(config, "policy.generation.colocated.enabled", True)):
        if gpus is None:
            return None
        return (lambda g: (policy_nodes, g - rm_here)), flags, []
    why = "non-colocated generation takes its GPUs out of the cluster"
    path = "policy.generation.colocated.resources"
    flags.append("policy.generation.colocated.enabled=false")
    if policy_nodes == 1:
        inference_gpus = _size(config, f"{path}.gpus_per_node", problems, default=None, why=why)
        flags.append(f"{path}.gpus_per_node={inference_gpus}")
        if gpus is None or inference_gpus is None:
            return None
        return (lambda g: (1, g - inference_gpus - rm_here)), flags, []
    inference_nodes = _size(config, f"{path}.num_nodes", problems, default=None, why=why)
    flags.append(f"{path}.num_nodes={inference_nodes}")
    if gpus is None or inference_nodes is None:
        return None
    # NeMo-RL asserts resources.gpus_per_node == cluster.gpus_per_node here: whole nodes generate.
    return (lambda g: (policy_nodes - inference_nodes, g)), flags, [f"{path}.gpus_per_node"]


def _check_cluster(config, problems: list) -> None:
    model_parallel = _model_parallel(config, problems)
    training = _training_layout(config, problems)
    if model_parallel is None or training is None:
        return
    (size, sizes), (layout, flags, follows) = model_parallel, training
    gpus = get_path(config, "cluster.gpus_per_node", 1)
    nodes, per_node = layout(gpus)
    came = ", ".join(flags)
    if nodes < 1 or per_node < 1:
        problems.append(
            f"{came}: leave training at least one node and one GPU (NeMo-RL's setup gives the policy {nodes} "
            f"node(s) x {per_node} GPU(s))"
        )
        return
    if nodes * per_node % size == 0:
        return
    # Worked example: the Megatron overlay, TP=2 x CP=2, on 1 node x 1 GPU, colocated: 1 GPU
    # against PP*CP*TP = 4; gpus_per_node = 2, 3 give 2, 3 GPUs; 4 gives 4, the first multiple.
    fix = next(
        (g for g in range(gpus + 1, gpus + 64 * size) if min(layout(g)) >= 1 and math.prod(layout(g)) % size == 0),
        None,
    )
    if fix is None:
        advice = "set the cluster or the parallel sizes so that PP*CP*TP divides the training GPUs"
    else:
        advice = " and ".join(f"{path}={fix}" for path in ["cluster.gpus_per_node", *follows])
        advice = f"e.g. set {advice}"
    problems.append(
        f"{came}: the policy trains on {nodes} x {per_node} = {nodes * per_node} GPU(s), not a multiple of "
        f"{sizes}; {advice} (NeMo-RL's Policy refuses a world size that PP*CP*TP does not divide)"
    )
