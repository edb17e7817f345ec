"""A megatron-core GPTModel's rollouts from a live vLLM, in a process of its own (run by
``tests/strategies/megatron/test_hf_export.py``; prints one JSON line).

The model runs on the CPU under the test shims (a one-rank gloo group, megatron's parallel
state at TP=1); :class:`~nemo_replay.trainer.backends.vllm_engine.VLLMEngine` holds its weights in
the Hugging Face Llama layout (:mod:`nemo_replay.trainer.backends.megatron_export`), as the
megatron backend builds it. Each rollout's log-probs are compared with the megatron model's own
logits, scored over the recorded rows in float64: before a weight update, after it, and with the
old weights against the new rollout (which must differ).
"""

from __future__ import annotations

import json
import math
import os
import sys
from functools import partial

import torch
import torch.distributed as dist

V, HIDDEN, MAX_POS = 48, 128, 64


def _model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, ffn_hidden_size=256, num_attention_heads=2, num_query_groups=1,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, init_method_std=0.2,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V,
                     max_sequence_length=MAX_POS, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).eval()
    return config, model


def _gap(model, ro, temperature: float) -> float:
    """max |vLLM's log-prob - float64 log-softmax over the row of the megatron model's logits|."""
    from tests.strategies.megatron.harness import forward_logits

    worst, batch = 0.0, ro.batch
    rows = batch.support
    for i, (prompt, response) in enumerate(zip(ro.prompts, ro.responses)):
        seq = torch.cat([prompt, response])
        with torch.no_grad():
            z = forward_logits(model, seq).double()[prompt.numel() - 1 : -1] / temperature
        lps = batch.rollout_logprobs[i, batch.response_width - response.numel():]
        for j in range(response.numel()):
            row = rows.row(int(rows.cu_seqlens[i]) + j).long()
            want = float(z[j, response[j]] - torch.logsumexp(z[j, row], 0))
            worst = max(worst, abs(want - float(lps[j])))
    return worst


def main() -> int:
    from tests.strategies.megatron.cpu_shims import install_cpu_shims

    install_cpu_shims()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    from nemo_replay.trainer.backends.megatron_export import hf_llama_config, hf_weights
    from nemo_replay.trainer.backends.vllm_engine import VLLMEngine
    from nemo_replay.trainer.generation import SamplingSettings

    torch.manual_seed(0)
    config, model = _model()
    settings = SamplingSettings(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=5)
    engine = VLLMEngine(model, settings, dtype="float32", device=torch.device("cpu"),
                        config=hf_llama_config(config, vocab_size=V, max_position_embeddings=MAX_POS),
                        export=partial(hf_weights, config=config, tp_group=None))
    try:
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, V, (int(n),), generator=g) for n in torch.randint(2, 8, (8,), generator=g)]
        before = _gap(model, engine.rollout(model, prompts, seed=1), settings.temperature)
        old = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        ro = engine.rollout(model, prompts, seed=2)
        after = _gap(model, ro, settings.temperature)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(old[n])
        stale = _gap(model, ro, settings.temperature)
    finally:
        engine.close()
    print(json.dumps({"before": before, "after": after, "stale": stale}))
    return 0 if all(math.isfinite(x) for x in (before, after, stale)) else 1


if __name__ == "__main__":
    sys.exit(main())
