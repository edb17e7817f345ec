"""Peak resident memory of one scorer forward + backward, measured in a fresh process.

    python -m tests.scoring.peak_memory {support|full} TOKENS VOCAB HIDDEN K

prints one JSON line: ``peak_delta`` (bytes above the resident set once the inputs exist,
from the kernel's VmHWM after resetting it through /proc/self/clear_refs), ``input_bytes``,
``seconds``, ``checksum`` (sum of the log-probs) and ``max_error`` (largest per-token distance
of the log-probs from a float64 reference, computed after the peak is read).

Variants, same float32 inputs (hidden [T, H], LM head [V, H], one row of k distinct ids
per token, every token loss-active, gradients for hidden and weight):
    support  hidden mode: score_aligned_support(hidden, ..., lm_head_weight=weight)
    full     the full-logits path: logits = hidden @ weight.T, then the same scorer on them
"""

from __future__ import annotations

import json
import sys
import time

import torch

from benchmarks.rss import reset_high_water, rss_high_water_kib, rss_kib


def measure(variant: str, tokens: int, vocab: int, hidden_size: int, k: int) -> dict:
    from nemo_replay import PackedTensor, score_aligned_support
    from tests.scoring.batches import distinct_rows

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=g).mul_(hidden_size**-0.5).requires_grad_()
    rows = distinct_rows(tokens, k, vocab, g).to(torch.int32)
    support = PackedTensor(rows, [0, tokens])
    sampled = rows[:, 0].to(torch.int64)
    row_ids = torch.arange(tokens)
    loss_mask = torch.ones(tokens, dtype=torch.bool)
    input_bytes = sum(t.numel() * t.element_size() for t in (hidden, weight, rows))

    if not reset_high_water():
        raise OSError("cannot reset VmHWM here (/proc/self/clear_refs)")
    base = rss_kib()
    start = time.perf_counter()
    if variant == "support":
        out = score_aligned_support(hidden, sampled, row_ids, loss_mask, support, lm_head_weight=weight)
    elif variant == "full":
        logits = hidden @ weight.T
        out = score_aligned_support(logits, sampled, row_ids, loss_mask, support)
    else:
        raise ValueError(f"variant must be 'support' or 'full', got {variant!r}")
    out.logprobs.sum().backward()
    seconds = time.perf_counter() - start
    peak = rss_high_water_kib()
    with torch.no_grad():
        logits64 = hidden.double() @ weight.double().T
        reference = logits64.gather(1, sampled[:, None]).squeeze(1) - logits64.gather(1, rows.long()).logsumexp(1)
        max_error = float((out.logprobs.detach().double() - reference).abs().max())
    return {
        "variant": variant,
        "peak_delta": (peak - base) * 1024,
        "input_bytes": input_bytes,
        "seconds": seconds,
        "checksum": float(out.logprobs.detach().double().sum()),
        "max_error": max_error,
        "grad_norms": [float(hidden.grad.norm()), float(weight.grad.norm())],
    }


if __name__ == "__main__":
    variant, *sizes = sys.argv[1:]
    print(json.dumps(measure(variant, *map(int, sizes))))
