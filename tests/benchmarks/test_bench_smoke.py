"""Smoke test of the benchmark entry point (speed and memory targets live in benchmarks/ only).

Runs ``python -m benchmarks.run --tiny`` in a fresh process (so the page-mode setting is
applied before torch loads, as in a real run) and checks that every section of the report
was written with numbers, the correctness gate passed, the peak-memory children ran (fresh
processes: the hidden-mode support variants, dense and sparse weight gradient), the host
reads were counted and both whole-training-step children (Llama, megatron-core GPTModel)
reported all four variants.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
                    "### Training step", "round-robin"):
        assert heading in text, heading
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
