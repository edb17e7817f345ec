"""Test harness: tiny megatron-core GPTModels on CPU with identical weights across layouts.

Weights. :func:`full_weights` draws every parameter's *full* (unsharded) tensor from a
generator seeded by the parameter's global name, so a TP=1 model, a TP=2 model and the two
stages of a PP=2 model all get the same numbers: :func:`load_full_weights` copies each
rank's shard (megatron marks sharded parameters with ``tensor_model_parallel`` and
``partition_dim``) and :func:`full_grads` reassembles the gradients the same way.

Names are global: a pipeline stage's ``decoder.layers.0`` is renamed to the layer's
global index (``layer_number - 1``), so every configuration speaks of the same tensor.

Rollouts. :func:`generate` samples responses token by token from the model's own logits
(``nemo_replay.rollout.capture.sample``, top-k), recording the sampler's log-probs and
support rows, on single-trajectory ``[1, t]`` forwards that share nothing with the
strategy's batched layout.
"""

from __future__ import annotations

import hashlib
import re

import torch
import torch.distributed as dist

from tests.strategies.megatron.cpu_shims import install_cpu_shims, install_moe_without_te_shim

VOCAB = 64
HIDDEN = 32
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """(Re)initialise megatron's parallel state in this spawned worker."""
    install_cpu_shims()
    install_moe_without_te_shim()
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )


def make_config(*, tp: int = 1, pp: int = 1, num_layers: int = 2, moe: bool = False, **extra):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, batch_p2p_comm=False,
    )
    if moe:
        kwargs.update(
            num_moe_experts=4, moe_router_topk=2, moe_enable_routing_replay=True, moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none", add_bias_linear=False, moe_ffn_hidden_size=2 * HIDDEN,
        )
    kwargs.update(extra)
    return TransformerConfig(**kwargs)


def build_model(config, *, moe: bool = False, share: bool = False):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False) if moe else get_gpt_layer_local_spec()
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=share,
    )


def global_names(model) -> dict[str, torch.nn.Parameter]:
    """Parameters keyed by their global name (pipeline stages renumber layers)."""
    out = {}
    for name, p in model.named_parameters():
        m = _LAYER.match(name)
        if m:
            layer = model.decoder.layers[int(m.group(1))]
            name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
        out[name] = p
    return out


def _shard_info(p, tp: int):
    if getattr(p, "tensor_model_parallel", False) and tp > 1:
        dim = p.partition_dim
        shape = list(p.shape)
        shape[dim] *= tp
        return dim, tuple(shape)
    return None, tuple(p.shape)


def full_weights(name: str, shape) -> torch.Tensor:
    """The full tensor of parameter ``name`` (deterministic in the name)."""
    seed = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
    g = torch.Generator().manual_seed(seed)
    if name.endswith("layer_norm_weight") or name.endswith("final_layernorm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    return 0.3 * torch.randn(shape, generator=g)


def load_full_weights(model, tp: int, tp_rank: int, perturb: dict | None = None) -> None:
    """Copy each parameter's shard of :func:`full_weights` (plus ``perturb[name]`` if given)."""
    with torch.no_grad():
        for name, p in global_names(model).items():
            dim, shape = _shard_info(p, tp)
            full = full_weights(name, shape)
            if perturb and name in perturb:
                full = full + perturb[name]
            if dim is not None:
                full = full.chunk(tp, dim=dim)[tp_rank]
            p.copy_(full)


def full_grads(model, tp: int, tp_group) -> dict[str, torch.Tensor]:
    """Gradients reassembled to full tensors (all-gather of sharded ones over ``tp_group``)."""
    out = {}
    for name, p in global_names(model).items():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dim, _ = _shard_info(p, tp)
        if dim is not None:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=tp_group)
            g = torch.cat(parts, dim)
        out[name] = g.clone()
    return out


def forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits ``[L, V]`` of one trajectory ``tokens (L,)`` on a TP=1 model."""
    pos = torch.arange(tokens.numel())[None]
    return model(tokens[None], pos, None)[0]


def generate(model, prompts, response_lengths, *, top_k: int, temperature: float, seed: int):
    """Sample responses with the sampler's capture; returns per trajectory (tokens, logprobs, rows)."""
    from nemo_replay.rollout.capture.sampler import sample

    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for prompt, R in zip(prompts, response_lengths):
            tokens = prompt.clone()
            lps, rows = [], []
            for _ in range(R):
                logits = forward_logits(model, tokens)[-1:]
                ids, lp, sup = sample(logits, temperature=temperature, top_k=top_k, generator=g)
                tokens = torch.cat([tokens, ids])
                lps.append(lp)
                rows.append(sup.to_padded().values)
            out.append((tokens, torch.cat(lps), torch.cat(rows)))
    return out


def naive_scores(model, sequence: torch.Tensor, rows: torch.Tensor, response_length: int, temperature: float):
    """Float64 support-conditioned log-probs of one trajectory's response, from a plain forward.

    Returns (R,) float64; rows with no member (all -1) are scored over the full vocabulary.
    """
    logits = forward_logits(model, sequence).double() / temperature
    L = sequence.numel()
    out = []
    for j in range(response_length):
        z = logits[L - response_length - 1 + j]
        target = int(sequence[L - response_length + j])
        members = rows[j][rows[j] >= 0].long()
        denom = torch.logsumexp(z[members] if members.numel() else z, 0)
        out.append(z[target] - denom)
    return torch.stack(out)
