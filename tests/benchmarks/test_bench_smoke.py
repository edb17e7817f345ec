"""Smoke test of the benchmark entry point (speed and memory targets live in benchmarks/ only).

Runs ``python -m benchmarks.run --tiny`` in a fresh process (so the page-mode setting is
applied before torch loads, as in a real run) and checks that every section of the report
was written with numbers, the correctness gate passed, the peak-memory children ran (fresh
processes: the hidden-mode support variants, dense and sparse weight gradient), the host
reads were counted, both whole-training-step children (Llama, megatron-core GPTModel)
reported all four variants, the tensor-parallel ranks reported, and the GPU section was
left for a GPU run. Also: the plain gather+logsumexp scorer the floor tables compare with
computes what the scorer computes, and the GPU tables' code runs (on the CPU device).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_benchmark_writes_every_section(tmp_path):
    out = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--tiny", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for heading in ("## Scaling", "### Machine", "### Measured rates", "### Targets", "### Logits mode, forward",
                    "### Hidden mode, T=32", "against T", "against V", "### Host reads per scorer call",
                    "### Training step", "round-robin", "### Logits mode against its floor, T=64",
                    "### Logits mode at small T", "two tensor-parallel ranks", "persistent gradient buffers against",
                    "## Profiles", "### logits support, T=16", "### hidden support-sparse", "## GPU"):
        assert heading in text, heading
    # Floor tables: every configuration (3 extras; small T; TP) with the three times and ratios.
    floor = [line for line in text.splitlines() if re.match(r"\| V=2048 (T=16 )?k=8 float32", line)]
    assert len(floor) == 5 and all(re.search(r"(\| [\d.]+ ){7}\|$", r) for r in floor), floor
    assert re.search(r"\| logits fwd T=64, one rank, vs the gather limit, worst of 2 configurations without the "
                     r"support mass", text)
    assert re.search(r"\| logits fwd T=32, 2 TP ranks, vs the plain gather\+logsumexp scorer", text)
    assert re.search(r"\| hidden fwd\+bwd T=32 .* into megatron's main_grad vs filling the \(V, H\) buffer", text)
    assert "Not measured yet: run `python -m benchmarks.run --device cuda`" in text
    assert "THP_MEM_ALLOC_ENABLE=1" in text  # the run asked for huge pages before torch loaded
    # A support row of the hidden table carries a measured time and a peak in MiB.
    row = next(line for line in text.splitlines() if line.startswith("| 2048 | 64 | 8 | zipf") and "| support |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[6]) > 0 and float(cells[7]) > 0 and int(cells[8]) >= 0, row
    row = next(line for line in text.splitlines() if line.startswith("| 2048 | 64 | 8 | zipf") and "| support-sparse |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[6]) > 0 and float(cells[7]) > 0 and int(cells[8]) >= 0, row
    assert re.search(r"\| logits, validate=True \| 1 \| 16 \|", text)  # one host read now, 16 before
    for model in ("reference trainer", "megatron-core GPTModel"):
        rows = [line for line in text.splitlines() if line.startswith(f"| {model}")]
        assert len(rows) == 4 and all(re.search(r"\| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", r) for r in rows), rows
    # Every target row carries measured and reference numbers.
    assert re.search(r"\| hidden fwd\+bwd T=32 .*\| [\d.]+ ms \| [\d.]+ ms \| [\d.]+ \|", text), text


def test_plain_scorer_computes_what_the_scorer_computes():
    """The floor tables' comparison point is a fair one: same log-probs, entropy, support mass and gradients."""
    from benchmarks.variants import plain_scores
    from benchmarks.workloads import channels, logits_input, support_rows
    from nemo_replay import score_aligned_support

    ch = channels(support_rows(48, 300, 9), vocab_size=300)
    logits = logits_input(48, 300, torch.float32).requires_grad_()  # both scorers compute in float32
    lp, ent, mass = plain_scores(logits, ch, entropy=True, mass=True)
    out = score_aligned_support(logits, ch.sampled, ch.row_ids, ch.loss_mask, ch.support, compute_entropy=True,
                                compute_support_mass=True)
    for got, want in ((lp, out.logprobs), (ent, out.entropy), (mass, out.support_logmass)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    g1 = torch.autograd.grad((lp * 0.3 + ent).sum(), logits)[0]
    g2 = torch.autograd.grad((out.logprobs * 0.3 + out.entropy).sum(), logits)[0]
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=0)
    assert not torch.equal(lp, torch.roll(lp, 1))  # distinct rows: a swapped position would show


def test_gpu_tables_code_runs_and_keeps_its_section(tmp_path):
    """``--device cuda``'s code, run on the CPU device: every row measured, support equal to the plain
    scorer (logits) and to logits mode (hidden); its section replaces a placeholder and survives a CPU rewrite."""
    from benchmarks import gpu

    out = tmp_path / "bench.md"
    out.write_text("# CPU tables\n\n" + gpu.PLACEHOLDER + "\n## after\n")
    assert gpu.main("tiny", out=str(out), device="cpu") == 0
    text = out.read_text()
    assert text.startswith("# CPU tables") and text.rstrip().endswith("## after") and "Not measured yet" not in text
    rows = [line for line in text.splitlines() if line.startswith(("| logits |", "| hidden |"))]
    assert len(rows) == 2 * (4 + 3), rows  # two dtypes: logits full/plain/support/gather, hidden full/support/sparse
    checks = [float(r.rstrip(" |").rsplit("| ", 1)[1]) for r in rows if "| support |" in r]
    assert len(checks) == 4 and max(checks[:2] + checks[2:3]) < 1e-4 and max(checks) < 0.1, checks  # bf16 hidden: rounding
    compact = [line for line in text.splitlines() if line.startswith("| T=64 V=2048 k=8 |")]
    assert len(compact) == 2, compact  # compact rows decoded at the entry, one row a dtype, scoring as the fixed rows
    assert all(float(r.rstrip(" |").rsplit("| ", 1)[1]) == 0 for r in compact), compact  # same rows, same order
    section = gpu.section_of(text)
    assert section and gpu.splice("# new CPU run\n", section).count("\n## GPU\n") == 1


def test_the_transport_and_checkpoint_benchmarks_run_and_their_figures_hold_together():
    """benchmarks/transport.py and benchmarks/checkpoint.py on small sizes, in this process: every
    column is filled and the codec lies between the limit and prime-rl's form. (Their targets are
    measured by the commands themselves: docs/transport.md.)"""
    from benchmarks import checkpoint, transport

    for make in (transport._zipf, transport._full):
        rows, sampled, V = make(64, 0)
        r = transport.sizes(rows, sampled, V)
        assert r["limit"] <= r["codec"] < min(r["ids+count int32"], r["fixed int32"]) < r["base64 int32"], r
        assert r["encode tok/s"] > 0 and r["decode tok/s"] > 0
        w = transport.wire_sizes(rows, sampled, V, 16)  # the binary body: the codec's buffer and a small head
        assert w["rows limit"] <= w["rows binary"] < w["rows json"] and w["rows limit"] < w["response limit"], w
        assert w["response binary"] < w["response json"] and w["rows binary"] < w["response binary"], w
    # The micro-batch section: the forward from compact rows equals the one from fixed rows (asserted inside).
    d = transport.decode_vs_scorer(*transport._zipf(64, 2), 64)
    assert min(d["decode_s"], d["entry_s"], d["scorer_s"], d["compact_s"], d["hidden_s"]) > 0, d
    g = np.random.default_rng(0)
    rows = [g.choice(512, int(n), replace=False).tolist() for n in g.integers(1, 9, 64)]
    p = transport.policy_step(rows, [r[0] for r in rows], 512, 64, rounds=1)  # trains bit for bit from either form (inside)
    assert p["fixed_ms"] > 0 and p["compact_ms"] > 0, p
    got = checkpoint.measure(4, 1)
    assert got["digest_s"] > 0 and got["check_s"] > 0 and got["MiB"] >= 4, got  # one 1024 x 1024 layer at least


def test_the_pickled_nemo_rl_batch_shrinks_with_compact_rows():
    """The transport benchmark's NeMo-RL row needs NeMo-RL's tree beside the checkout (or NEMO_RL_SRC);
    without it this was a KeyError, now a skip naming where it looked, as the other NeMo-RL tests do."""
    from benchmarks import transport

    if not transport.NEMO_RL_SRC.is_dir():
        pytest.skip(f"needs NeMo-RL's tree at 7ea279a: set NEMO_RL_SRC (looked in {transport.NEMO_RL_SRC})")
    pickles = transport.batch_pickles(*transport._zipf(64, 1))
    sizes = pickles["NeMo-RL BatchedDataDict"]
    if isinstance(sizes, str):
        pytest.skip(f"NeMo-RL's BatchedDataDict is {sizes}: run with the Python of scripts/nemo_rl_env.sh")
    before, after = sizes
    assert after < before / 4, pickles


def test_the_capture_benchmark_reads_the_same_supports_on_every_path():
    """benchmarks/capture.py on a short response: every output path (offline dicts and flat,
    completions, chat, generate, the entry-by-entry reader, the sampling mask) reads the supports
    the response was built from (``measure`` asserts it) and gets a time; the server's table (its
    engine wrapper reading a response off the event loop and on it) gets both gaps."""
    from benchmarks import capture

    got = capture.measure(64, 8)
    assert set(got) == {"offline dicts", "offline flat", "completions", "chat", "generate", "entry by entry (before)",
                        "sampling mask"} and all(v > 0 for v in got.values())
    stall = capture.server_stall(256, 8)
    assert set(stall) == {"off the loop", "on the loop"} and all(v > 0 for v in stall.values()), stall
