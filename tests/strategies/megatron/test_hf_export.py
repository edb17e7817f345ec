"""A megatron-core GPTModel's weights in the Hugging Face Llama layout an engine loads
(``nemo_replay.trainer.backends.megatron_export``), checked on megatron-core's own model:

- exported from TP=2 (two gloo ranks, shards gathered over the TP group) they equal the TP=1
  export of the same weights, bit for bit;
- loaded into transformers' ``LlamaForCausalLM`` (every tensor used: ``strict``) they give the
  megatron model's logits (RoPE, grouped-query attention, RMSNorm, SwiGLU);
- what a Llama cannot hold (an MoE, biases, LayerNorm) is refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_workers
from tests.strategies.megatron.harness import VOCAB, forward_logits, full_weights, global_names, init_parallel, load_full_weights

MAX_POS = 64


def _config(tp: int, **extra):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
    )
    return TransformerConfig(**{**kwargs, **extra})


def _model(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=MAX_POS, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False).eval()


def _load(model, tp: int, tp_rank: int) -> None:
    """The harness's full weights, each TP rank its shard; ``linear_fc1`` is ``[gate; up]`` on every
    rank (megatron's SwiGLU layout), so its shard is each half's rows of that rank."""
    load_full_weights(model, tp, tp_rank)
    with torch.no_grad():
        for name, p in global_names(model).items():
            if name.endswith("linear_fc1.weight"):
                gate, up = full_weights(name, (p.shape[0] * tp, p.shape[1])).chunk(2)
                p.copy_(torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]]))


def _export(tp: int, rank: int):
    from megatron.core import parallel_state as ps

    from nemo_replay.trainer.backends.megatron_export import hf_weights

    init_parallel(tp)
    config = _config(tp)
    model = _model(config)
    _load(model, tp, ps.get_tensor_model_parallel_rank())
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    return config, model, {name: t.clone() for name, t in hf_weights(model, config, tp_group=group)}


def _worker(rank: int, world: int):
    import transformers

    from nemo_replay.trainer.backends.megatron_export import check_complete, hf_llama_config, hf_weights

    tokens = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(0))  # one input for both TP ranks
    _, model2, tp2 = _export(2, rank)
    with torch.no_grad():  # the TP=2 model's own logits, its vocabulary shards gathered (rank order)
        shards = [torch.empty(23, VOCAB // 2) for _ in range(2)]
        dist.all_gather(shards, forward_logits(model2, tokens).contiguous())
    config, model, tp1 = _export(1, rank)
    out = {"same_names": sorted(tp2) == sorted(tp1), "complete": check_complete(set(tp1), config)}
    out["export_diff"] = max(float((tp2[n] - tp1[n]).abs().max()) for n in tp1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config(
        config, vocab_size=VOCAB, max_position_embeddings=MAX_POS))).eval()
    hf.load_state_dict(tp1, strict=True)
    with torch.no_grad():
        ours = forward_logits(model, tokens).double()
        theirs = hf(input_ids=tokens[None]).logits[0].double()
    out["logit_diff"], out["logit_scale"] = float((ours - theirs).abs().max()), float(ours.abs().max())
    # The TP=2 shards were loaded to megatron's own layout (``_load``), not to the export's: the
    # TP=2 model computing the TP=1 model's logits is what makes the bit-equal exports evidence.
    out["tp_logit_diff"] = float((torch.cat(shards, -1).double() - ours).abs().max())
    # A pipeline stage holds half the layers: the export names what a Llama would lack.
    init_parallel(1, pp=2)
    stage_config = _config(1, pipeline_model_parallel_size=2)
    try:
        list(hf_weights(_model(stage_config), stage_config))
        out["stage"] = None
    except ValueError as exc:
        out["stage"] = str(exc)
    dist.barrier()
    return out


def test_tp2_export_equals_tp1_and_transformers_reproduces_the_logits():
    for out in run_workers(_worker, 2):
        assert out["same_names"] and out["complete"] is None
        assert out["export_diff"] == 0.0
        assert out["logit_scale"] > 1.0 and out["logit_diff"] < 1e-4, out
        assert out["tp_logit_diff"] < 1e-4, out
        assert "the megatron model lacks ['model.layers.1." in out["stage"] and "one pipeline stage" in out["stage"], out


@pytest.mark.parametrize("extra, named", [
    (dict(add_bias_linear=True), "add_bias_linear"),
    (dict(normalization="LayerNorm"), "normalization='LayerNorm'"),
    (dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48), "num_moe_experts=4"),
])
def test_what_a_llama_cannot_hold_is_refused(extra, named):
    from nemo_replay.trainer.backends.megatron_export import hf_llama_config

    with pytest.raises(ValueError, match="no Hugging Face Llama form") as err:
        hf_llama_config(_config(1, **extra), vocab_size=VOCAB, max_position_embeddings=MAX_POS)
    assert named in str(err.value) and "generation.engine=trainer" in str(err.value)
