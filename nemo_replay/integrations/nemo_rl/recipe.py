"""Check a resolved NeMo-RL recipe for the options replay depends on (the overlay in configs/nemo_rl/).

Call it on the launcher's config before building workers; every problem is reported at
once, each naming the NeMo-RL flag and the value replay needs:

    from nemo_replay.integrations.nemo_rl import check_nemo_rl_recipe
    check_nemo_rl_recipe(OmegaConf.to_container(config, resolve=True))
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["check_nemo_rl_recipe"]


def _get(cfg: Mapping[str, Any], path: str, default=None):
    node: Any = cfg
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return default
        node = node[key]
    return node


def check_nemo_rl_recipe(config: Mapping[str, Any]) -> None:
    """Refuse a NeMo-RL recipe under which replay cannot run or would be bypassed.

    Args:
        config: the resolved recipe as a mapping (top level ``policy``, ``loss_fn``, ...).

    Raises:
        ValueError listing every problem, one line each: the flag, what came, what to set.
    """
    if not isinstance(config, Mapping) or not isinstance(config.get("policy"), Mapping):
        raise ValueError("check_nemo_rl_recipe: expected NeMo-RL's resolved recipe, a mapping with a 'policy' section")
    problems = []
    top_k = _get(config, "policy.generation.top_k")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 2:
        problems.append(
            f"policy.generation.top_k={top_k!r}: set an int > 1 (the recorded support is the sampler's top-k set; the "
            f"engine returns whole supports only when they are bounded)"
        )
    mode = _get(config, "policy.generation.vllm_cfg.logprobs_mode")
    if _get(config, "policy.generation.backend") == "vllm" and mode != "processed_logprobs":
        problems.append(
            f"policy.generation.vllm_cfg.logprobs_mode={mode!r}: set processed_logprobs (raw log-probs never mark "
            f"the filtered candidates, so no support can be read from them)"
        )
    megatron = bool(_get(config, "policy.megatron_cfg.enabled", False))
    if megatron and _get(config, "policy.megatron_cfg.use_fused_linear_logprobs", False):
        problems.append(
            "policy.megatron_cfg.use_fused_linear_logprobs=true: set false (the fused kernel gathers full-vocabulary "
            "log-probs from hidden states and skips the replay hooks)"
        )
    if _get(config, "policy.sequence_packing.enabled", False) and _get(config, "policy.sequence_packing.fuse_loss", False):
        problems.append(
            "policy.sequence_packing.fuse_loss=true: set false (the fused packed loss ignores prepare_fn, where replay "
            "scores the policy log-probs)"
        )
    if not megatron and bool(_get(config, "policy.dtensor_cfg.enabled", False)):
        if not _get(config, "policy.dtensor_cfg._v2", False):
            problems.append("policy.dtensor_cfg._v2=false: set true (replay replaces the automodel v2 post-processors)")
        cp = _get(config, "policy.dtensor_cfg.context_parallel_size", 1)
        if cp is not None and (isinstance(cp, bool) or not isinstance(cp, int) or cp < 1):
            problems.append(f"policy.dtensor_cfg.context_parallel_size={cp!r}: set an int >= 1 (1: no context parallelism)")
        elif cp is not None and cp > 1:
            problems.append(
                f"policy.dtensor_cfg.context_parallel_size={cp}: set 1, or use the Megatron backend (replay lays out "
                f"Megatron's context parallelism, not torch's context_parallel)"
            )
    if problems:
        raise ValueError("NeMo-RL recipe cannot run replay:\n  " + "\n  ".join(problems))
