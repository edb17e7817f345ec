"""Peak memory of one forward + backward, each variant in a fresh process.

    python -m benchmarks.memory '{"mode": "hidden", "variant": "support", "T": 512, "V": 131072,
                                  "H": 2048, "k": 64, "dtype": "float32", "model": "zipf", "threads": 2}'

prints one JSON line with ``peak_bytes``: the kernel's high-water mark of the resident
set (VmHWM) during the call, minus the resident set once the inputs exist. The mark is
reset through ``/proc/self/clear_refs`` after the inputs are built; where that file is
missing, ``ru_maxrss`` is used and input-building peaks may hide in the baseline
(``method`` says which). The child inherits the parent's environment, so the page mode
(``THP_MEM_ALLOC_ENABLE``) matches the timing run.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

__all__ = ["measure_in_subprocess"]


def _worker(spec: dict) -> dict:
    import torch

    from benchmarks.variants import hidden_variant, logits_variant
    from benchmarks.workloads import channels, hidden_inputs, logits_input, support_rows
    from benchmarks.rss import reset_high_water, rss_high_water_kib, rss_kib

    torch.set_num_threads(int(spec.get("threads", 2)))
    dtype = getattr(torch, spec["dtype"])
    rows = support_rows(spec["T"], spec["V"], spec["k"], model=spec.get("model", "zipf"))
    ch = channels(rows, vocab_size=spec["V"])
    if spec["mode"] == "hidden":
        hidden, weight = hidden_inputs(spec["T"], spec["V"], spec["H"], dtype)
        hidden.requires_grad_(), weight.requires_grad_()
        fn = hidden_variant(spec["variant"], hidden, weight, ch)
    else:
        logits = logits_input(spec["T"], spec["V"], dtype).requires_grad_()
        fn = logits_variant(spec["variant"], logits, ch)
    if reset_high_water():
        method, base = "VmHWM", rss_kib()
    else:
        method, base = "ru_maxrss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grads = fn(backward=bool(spec.get("backward", True)))
    peak = rss_high_water_kib() if method == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del grads
    return {"peak_bytes": (peak - base) * 1024, "method": method}


def measure_in_subprocess(spec: dict, *, timeout: float = 300.0) -> dict:
    """Run the worker in a fresh interpreter; returns its JSON (``error`` on failure)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", json.dumps(spec)],
        cwd=root, capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
