"""A megatron-core ``GPTModel``'s weights in the Hugging Face Llama layout an engine loads.

vLLM (and SGLang, and transformers) load a Llama from Hugging Face names and shapes; the
reference trainer's megatron models (RoPE, RMSNorm, SwiGLU, no biases, untied output layer:
:mod:`.megatron`) hold the same numbers differently arranged. :func:`hf_weights` renames and
re-splits them, gathering tensor-parallel shards over the TP group (collective: every TP rank
iterates, in the same order); :func:`hf_llama_config` gives the matching ``LlamaConfig``.

Arrangement, for ``h`` query heads in ``g`` groups (``num_query_groups``) of head size ``d``:

- ``linear_qkv.weight`` ``((h + 2g) d, H)`` holds, group after group, the group's ``h / g``
  query heads, then its key head, then its value head. Example h = 4, g = 2: rows
  ``[q0 q1 k0 v0 | q2 q3 k1 v1]`` -> ``q_proj`` ``[q0 q1 q2 q3]``, ``k_proj`` ``[k0 k1]``,
  ``v_proj`` ``[v0 v1]``. A TP rank holds whole groups, so the shards gather along rows.
- ``linear_fc1.weight`` ``(2 F, H)`` is ``[gate; up]`` on each TP rank (``F / tp`` rows of each),
  so each half gathers on its own: ``gate_proj`` = every rank's gate rows, ``up_proj`` likewise.
- ``linear_proj`` / ``linear_fc2`` shard along columns; the embedding and output layer along
  vocabulary rows; norms are whole on every rank.

Layer norms sit in their own modules under megatron's local layer spec
(``input_layernorm``, ``pre_mlp_layernorm``) and inside the next linear under Transformer
Engine's (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); both are read.
"""

from __future__ import annotations

import re
from typing import Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["hf_llama_config", "hf_weights", "check_complete"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megatron name (after the layer prefix) -> Hugging Face name, for tensors that only rename.
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def hf_llama_config(config, *, vocab_size: int, max_position_embeddings: int, rope_theta: float = 10000.0) -> dict:
    """The ``LlamaConfig`` fields of a megatron ``TransformerConfig`` (RoPE, RMSNorm, SwiGLU, no biases)."""
    problems = []
    if getattr(config, "num_moe_experts", None):
        problems.append(f"num_moe_experts={config.num_moe_experts} (an MoE model is not a Llama)")
    if getattr(config, "add_bias_linear", False) or getattr(config, "add_qkv_bias", False):
        problems.append("add_bias_linear / add_qkv_bias (a Llama has no linear biases)")
    if getattr(config, "normalization", "LayerNorm") != "RMSNorm" or not getattr(config, "gated_linear_unit", False):
        problems.append(f"normalization={config.normalization!r}, gated_linear_unit={config.gated_linear_unit} "
                        f"(a Llama takes RMSNorm and SwiGLU)")
    if getattr(config, "qk_layernorm", False):
        problems.append("qk_layernorm (a Llama has none)")
    if problems:
        raise ValueError("the megatron model has no Hugging Face Llama form for an engine to load: "
                         + "; ".join(problems) + "; use generation.engine=trainer for it")
    heads = config.num_attention_heads
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=int(vocab_size),
        hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=heads, num_key_value_heads=config.num_query_groups or heads, head_dim=config.kv_channels,
        max_position_embeddings=int(max_position_embeddings), rms_norm_eps=config.layernorm_epsilon,
        rope_theta=float(rope_theta), tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        hidden_act="silu",
    )


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The whole tensor from every TP rank's shard along ``dim`` (rank order)."""
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _split_qkv(qkv: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole ``linear_qkv.weight`` -> (q, k, v) weights in Hugging Face's head order (module doc)."""
    heads, groups, d = config.num_attention_heads, config.num_query_groups or config.num_attention_heads, config.kv_channels
    per = heads // groups
    blocks = qkv.reshape(groups, (per + 2) * d, qkv.shape[-1])
    q, k, v = blocks.split([per * d, d, d], dim=1)
    return (q.reshape(heads * d, -1), k.reshape(groups * d, -1), v.reshape(groups * d, -1))


def hf_weights(model, config, *, tp_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, whole tensor)`` for every parameter of a megatron ``GPTModel``.

    Args:
        model: the ``GPTModel`` (or its ``Float16Module`` wrapper), one pipeline stage holding every layer.
        config: its ``TransformerConfig``.
        tp_group: the tensor-parallel group its shards are spread over; None: not sharded.

    Raises:
        ValueError naming a parameter with no Llama counterpart, or (after the last pair) the Llama
        tensors none of the parameters gave: an engine would keep its old values for those.
    """
    model = getattr(model, "module", model)  # Float16Module keeps the GPTModel as .module
    yielded = set()
    for hf_name, tensor in _pairs(model, config, tp_group):
        yielded.add(hf_name)
        yield hf_name, tensor
    missing = check_complete(yielded, config)
    if missing:
        raise ValueError(f"{missing}; export a model holding every layer (one pipeline stage), or use "
                         f"generation.engine=trainer")


def _pairs(model, config, tp_group) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, whole tensor) of every parameter, unchecked for completeness (:func:`hf_weights`)."""
    unknown = ("megatron parameter {!r} has no Hugging Face Llama counterpart (this export knows the dense "
               "Llama layout of the reference trainer's GPTModel); use generation.engine=trainer for this model")
    for name, param in model.named_parameters():
        t = param.detach()
        if name in _TOP_NAMES:
            dim = 0 if getattr(param, "tensor_model_parallel", False) else None
            yield _TOP_NAMES[name], t if dim is None else _gather(t, dim, tp_group)
            continue
        m = _LAYER.match(name)
        if m is None:
            raise ValueError(unknown.format(name))
        layer, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest in _LAYER_NAMES:
            dim = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
            yield layer + _LAYER_NAMES[rest], t if dim is None else _gather(t, dim, tp_group)
        elif rest == "self_attention.linear_qkv.weight":
            q, k, v = _split_qkv(_gather(t, 0, tp_group), config)
            yield from ((layer + f"self_attn.{p}_proj.weight", w) for p, w in zip("qkv", (q, k, v)))
        elif rest == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            yield layer + "mlp.gate_proj.weight", _gather(gate, 0, tp_group)
            yield layer + "mlp.up_proj.weight", _gather(up, 0, tp_group)
        else:
            raise ValueError(unknown.format(name))


def check_complete(names: set, config) -> Optional[str]:
    """A sentence naming the Llama tensors :func:`hf_weights` did not yield, or None."""
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(config.num_layers):
        want |= {f"model.layers.{i}.{n}" for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
    missing = sorted(want - names)
    return f"the megatron model lacks {missing[:4]} ({len(missing)} in all) of a Llama" if missing else None
