"""Hidden mode keeps the memory property of TRL's fused LM head: no (B, C, V) logits.

The test measures in its own process (TRL already imported there; ``python -m
tests.integrations.trl.test_memory`` prints the same figures from a fresh one) each variant in
turn, smallest first, returning freed memory to the system in between (``malloc_trim``), and
reports the peak resident memory above the baseline of one policy pass, forward and
backward, on the same batch (B = 8 completions of C = 96 tokens, V = 32000, H = 64):

    trl      TRL's own ``GRPOTrainer._get_per_token_logps_and_entropies`` (its fused head)
    hidden   ``ReplayGRPOTrainer`` with ``ReplaySettings(source="hidden")``
    logits   ``ReplayGRPOTrainer`` with ``ReplaySettings(source="logits")``

One (B, C, V) float32 logits tensor is 98 MB; logits mode holds it and its gradient. The
test keeps hidden mode below half of one such tensor and within TRL's fused path, and logits
mode above one tensor, so a change that materialises logits in hidden mode fails it.
Measured on the 2-core CPU: hidden 18 MB, logits 204 MB, TRL's fused head 887 MB (off
Triton devices it scores every position, in chunks of 32768 rows of the full vocabulary:
trl/trainer/utils.py, ``add_fused_lm_head`` and ``_CHUNKED_LOGPROB_CHUNK_SIZE``).
"""

from __future__ import annotations

import ctypes
import json
import tempfile

import pytest

from benchmarks.rss import reset_high_water, rss_high_water_kib, rss_kib

B, C, P, V, H, K = 8, 96, 8, 32000, 64, 64


def measure(variants=("hidden", "logits", "trl")) -> dict:
    """Peak memory (bytes above the resident set before the pass) of one policy pass of each variant."""
    import torch
    import transformers
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import GRPOConfig, GRPOTrainer

    from nemo_replay.integrations.trl import ReplayGRPOTrainer, ReplaySettings
    from nemo_replay.integrations.trl.records import CompletionRecord
    from nemo_replay.support.packed import PackedTensor
    from nemo_replay.support.rows import SampleRows

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=P + C + 8, pad_token_id=0, eos_token_id=1,
    ))
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "w": 2}, unk_token="w"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=B, num_generations=4, max_completion_length=C,
        report_to=[], use_cpu=True, bf16=False, top_k=K, beta=0.0, save_strategy="no", disable_tqdm=True,
    )
    trainer = ReplayGRPOTrainer(
        model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["w"] * B}), processing_class=tokenizer,
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, V, (B, P + C), generator=g)
    mask = torch.ones(B, P + C, dtype=torch.long)
    records = []
    for i in range(B):  # K distinct ids per row, the completion token first
        tokens = ids[i, P:]
        rows = []
        for t in tokens:
            others = torch.randperm(V - 2, generator=g)[:K].add(2)
            rows.append(torch.cat([t[None], others[others != t][: K - 1]]))
        rows = PackedTensor(torch.stack(rows).to(torch.int32), [0, C])
        records.append(CompletionRecord(tokens, torch.zeros(C), SampleRows.encode(rows, tokens, vocab_size=V, width=K)))
    model.train()
    libc = ctypes.CDLL("libc.so.6")

    def run(variant):
        if variant == "trl":
            return GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, C)[0]
        trainer.replay_settings = ReplaySettings(source=variant)
        with trainer._scoring(records, measure=False):
            return trainer._get_per_token_logps_and_entropies(model, ids, mask, C)[0]

    out = {"logits_bytes": B * C * V * 4}
    for variant in variants:
        run(variant).sum().backward()  # warm-up: allocator pools, lazy initialisation
        model.zero_grad(set_to_none=False)
        libc.malloc_trim(0)
        assert reset_high_water(), "cannot reset VmHWM here (/proc/self/clear_refs)"
        base = rss_kib()
        logps = run(variant)
        logps.sum().backward()
        out[variant] = (rss_high_water_kib() - base) * 1024
        out[f"{variant}_checksum"] = float(logps.detach().double().sum())
        del logps
        model.zero_grad(set_to_none=False)
        libc.malloc_trim(0)
    return out


def test_hidden_mode_peak_stays_at_trl_fused_head_level():
    pytest.importorskip("trl")
    import torch

    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng():
            peak = measure()
    finally:
        torch.set_num_threads(threads)
    one_logits = peak["logits_bytes"]
    assert peak["hidden"] < 0.5 * one_logits  # never (B, C, V) logits
    assert peak["hidden"] < 1.5 * peak["trl"] + 8 * 2**20
    assert peak["logits"] > one_logits > peak["hidden"]
    assert peak["hidden_checksum"] == pytest.approx(peak["logits_checksum"], rel=1e-5)


if __name__ == "__main__":
    print(json.dumps(measure()))
