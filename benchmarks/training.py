"""The scorer's share of a whole training step: the policy pass with replay against the same pass without.

One policy step is what a trainer runs per optimizer step before ``optimizer.step()``:
every micro-batch's model forward, scoring, the clipped policy objective and its
backward through the whole model. Four variants of that step are timed on the same model
and micro-batches:

    logits, replay        score_aligned_support on the model's logits (the default source)
    logits, replay off    score_full_vocabulary on the same logits (log_softmax over V)
    hidden, replay        the LM head skipped; the scorer projects only the support pairs
    hidden, replay off    score_full_vocabulary from the hidden states (the LM head's product)

on two models, each in a fresh process (``python -m benchmarks.training SPEC``):

    hf        the reference trainer's model: a Llama built from a config
              (``nemo_replay.trainer.backends.hf.build_hf_model``) through the fsdp strategy
    megatron  a megatron-core GPTModel (local layer spec) through the megatron strategy,
              on one gloo rank, with the CPU shims of tests/strategies/megatron/cpu_shims.py

Timing: the variants run round-robin (one warm-up round, then ``rounds`` rounds), each
step with fresh gradients (``zero_grad(set_to_none=True)``, so micro-batch 1 of hidden
mode writes a dense LM-head gradient and micro-batch 2 accumulates rows into it); the
figure is the median per variant, so a burst of load from another process hits every
variant alike. Support rows come from collation (recorded as checked), 64 per position.

Targets: ``logits, replay`` at most 1.02x ``logits, replay off``; ``hidden, replay`` faster
than the full-vocabulary pass (``logits, replay off``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from statistics import median

import torch

__all__ = ["PROFILES", "VARIANTS", "measure_in_subprocess"]

VARIANTS = (("logits", True), ("logits", False), ("hidden", True), ("hidden", False))
PROFILES = {
    "full": dict(vocab=32768, hidden=512, ffn=1408, layers=2, heads=8, kv_heads=4, batch=4, prompt=32, response=96,
                 k=64, micro_batches=2, rounds=5),
    "quick": dict(vocab=32768, hidden=512, ffn=1408, layers=2, heads=8, kv_heads=4, batch=4, prompt=32, response=64,
                  k=64, micro_batches=2, rounds=3),
    "tiny": dict(vocab=512, hidden=64, ffn=128, layers=1, heads=4, kv_heads=2, batch=2, prompt=4, response=8, k=8,
                 micro_batches=2, rounds=1),
}


def _batches(spec: dict):
    """Micro-batches of left-padded trajectories with support rows recorded at collation."""
    from nemo_replay.batch import ReplayBatch
    from nemo_replay.rollout.boundary import validate_support
    from nemo_replay.support.packed import PackedTensor

    g = torch.Generator().manual_seed(0)
    V, k, P, R, B = spec["vocab"], spec["k"], spec["prompt"], spec["response"], spec["batch"]
    out = []
    for _ in range(spec["micro_batches"]):
        lengths = [R - (3 * i) % max(R // 4, 1) for i in range(B)]  # ragged responses
        S, A = P + R, R
        seq = torch.zeros(B, S, dtype=torch.int64)
        mask = torch.zeros(B, S, dtype=torch.bool)
        loss = torch.zeros(B, A, dtype=torch.bool)
        rows = []
        for i, r in enumerate(lengths):
            ids = (torch.randint(0, V, (r, 1), generator=g) + torch.arange(k) * 7919) % V  # k distinct ids per row
            sampled = ids[torch.arange(r), torch.randint(0, k, (r,), generator=g)]  # each token drawn from its row
            tokens = torch.cat([torch.randint(0, V, (P,), generator=g), sampled])
            seq[i, S - P - r :], mask[i, S - P - r :], loss[i, A - r :] = tokens, True, True
            rows.append(ids.to(torch.int32))
        support = PackedTensor.from_segments(rows)
        validate_support(support, sampled_ids=torch.cat([seq[i, S - r :] for i, r in enumerate(lengths)]), vocab_size=V,
                         where="collation")
        out.append(ReplayBatch(seq, mask, torch.tensor(lengths), loss, support=support,
                               advantages=torch.linspace(-1.0, 1.0, B)))
    return out


def _hf_model(spec: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["ffn"],
        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=spec["prompt"] + spec["response"], tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _megatron_model(spec: dict):
    """A GPTModel on one gloo rank (the CPU shims are test code: tests/strategies/megatron/cpu_shims.py)."""
    import socket

    import torch.distributed as dist

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from tests.strategies.megatron.cpu_shims import install_cpu_shims

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    install_cpu_shims()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    config = TransformerConfig(
        num_layers=spec["layers"], hidden_size=spec["hidden"], ffn_hidden_size=spec["ffn"],
        num_attention_heads=spec["heads"], num_query_groups=spec["kv_heads"], use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
    )
    torch.manual_seed(0)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=spec["vocab"],
                    max_sequence_length=spec["prompt"] + spec["response"], share_embeddings_and_output_weights=False)


def _worker(spec: dict) -> dict:
    """Time the four variants round-robin in this process; returns medians in ms."""
    from nemo_replay import get_strategy
    from nemo_replay.strategies.base import RoleSettings

    torch.set_num_threads(int(spec.get("threads", 2)))
    trainer = spec["trainer"]
    model = _hf_model(spec) if trainer == "hf" else _megatron_model(spec)
    strategy = get_strategy("fsdp" if trainer == "hf" else "megatron").factory()
    batches = _batches(spec)

    def step(source: str, replay: bool):
        settings = RoleSettings(replay=replay, source=source, temperature=1.0, chunk_size=8192)
        for p in model.parameters():
            p.grad = None
        strategy.run_role("policy", model, batches, settings)

    times = {v: [] for v in VARIANTS}
    for r in range(spec["rounds"] + 1):
        for v in VARIANTS:
            t0 = time.perf_counter()
            step(*v)
            if r:  # round 0 warms up
                times[v].append(time.perf_counter() - t0)
    tokens = sum(int(b.attention_mask.sum()) for b in batches)
    return {"ms": {f"{s}, {'replay' if on else 'replay off'}": median(t) * 1e3 for (s, on), t in times.items()},
            "spread": {f"{s}, {'replay' if on else 'replay off'}": (min(t) * 1e3, max(t) * 1e3) for (s, on), t in times.items()},
            "tokens": tokens}


def measure_in_subprocess(trainer: str, profile: str, *, threads: int, timeout: float = 1800.0) -> dict:
    """Run :func:`_worker` for ``trainer`` in a fresh interpreter; its JSON, or ``{"error": ...}``."""
    spec = dict(PROFILES[profile], trainer=trainer, threads=threads)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.training", json.dumps(spec)], cwd=root,
                              capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
