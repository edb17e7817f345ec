"""Scorer benchmarks: support scoring against full-vocabulary scoring, as ratios in one run.

    python -m benchmarks.run             # full tables, about 10-15 minutes on a quiet machine; writes docs/benchmarks.md
    python -m benchmarks.run --quick     # the two headline configurations and short sweeps
    python -m benchmarks.run --tiny --out /tmp/bench.md    # under a minute (the smoke test)
    python -m benchmarks.run --only logits "small T" --out /tmp/floor.md    # some sections
    python -m benchmarks.run --device cuda   # the GPU tables (benchmarks/gpu.py), written into docs/benchmarks.md

Options: ``--threads N`` (default 2), ``--out PATH``, ``--small-pages`` (keep 4 KiB pages:
by default the run sets ``THP_MEM_ALLOC_ENABLE=1`` before torch is imported, so the
allocator asks for transparent huge pages, as a training job on this machine should),
``--no-memory`` (skip the fresh-process peak-memory measurements), ``--no-training`` (skip
the whole-training-step section, benchmarks/training.py), ``--omp-wait {passive,active}``
(default passive: the run sets ``OMP_WAIT_POLICY=PASSIVE`` before torch is imported, unless
the environment already sets it, so idle OpenMP threads sleep instead of spinning. On a
machine shared with other processes, spinning threads of a 2-thread run wait for each other
at every parallel region and a call can take 20x longer (measured here: 146 ms instead of
7 ms); sleeping costs a few microseconds per region on a quiet machine).

One process times every variant (one warm-up call, then the median of repeats, each
repetition starting with cold caches); peak memory comes from a fresh process per variant
(benchmarks/memory.py). Before any timing the scorer is checked against a dense float64
reference (benchmarks/check.py). Every support figure is printed as a ratio to the
full-vocabulary figure of the same run and to a physical limit built from rates measured
in the same run (benchmarks/limits.py, benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

__all__ = ["main"]

PROFILES = {
    "full": {
        "logits": {"T": 4096, "V": (32768, 131072), "k": (20, 64), "dtypes": ("float32", "bfloat16")},
        "hidden": {"T": 512, "V": (32768, 131072), "H": (1024, 2048), "k": (20, 64)},
        "hidden_T": (128, 256, 512, 1024, 2048, 4096),
        "hidden_V": (16384, 32768, 65536, 131072),
        "logits_T": (512, 1024, 2048, 4096),
        "small_T": (64, 256),
        "tp": {"T": 4096, "V": 131072, "k": (20, 64), "dtypes": ("float32", "bfloat16"), "extras": ("", "entropy", "mass"),
               "rounds": 7},
        "repeats": 9,
        "rates_bytes": 1 << 30,
        "training_profile": "full",
    },
    "quick": {
        "logits": {"T": 4096, "V": (131072,), "k": (64,), "dtypes": ("float32",)},
        "hidden": {"T": 512, "V": (131072,), "H": (2048,), "k": (64,)},
        "hidden_T": (128, 512, 2048),
        "hidden_V": (32768, 131072),
        "logits_T": (1024, 4096),
        "small_T": (64, 256),
        "tp": {"T": 4096, "V": 131072, "k": (64,), "dtypes": ("float32",), "extras": ("",), "rounds": 7},
        "repeats": 7,
        "rates_bytes": 1 << 30,
        "training_profile": "quick",
    },
    "tiny": {
        "logits": {"T": 64, "V": (2048,), "k": (8,), "dtypes": ("float32",)},
        "hidden": {"T": 32, "V": (2048,), "H": (64,), "k": (8,)},
        "hidden_T": (16, 32),
        "hidden_V": (1024, 2048),
        "logits_T": (32, 64),
        "small_T": (16,),
        "small_T_rounds": 3,
        "tp": {"T": 32, "V": 2048, "k": (8,), "dtypes": ("float32",), "extras": ("",), "rounds": 2},
        "profile_calls": 2,
        "repeats": 2,
        "rates_bytes": 1 << 24,
        "memory_scope": (("hidden", "support"), ("hidden", "support-sparse")),
        "sweep_memory": False,
        "uniform_row": False,
        "training_profile": "tiny",
    },
}


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="headline configurations and short sweeps")
    size.add_argument("--tiny", action="store_true", help="tiny sizes (seconds); the smoke test")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="markdown output (default docs/benchmarks.md for the full run)")
    p.add_argument("--small-pages", action="store_true", help="do not request transparent huge pages")
    p.add_argument("--no-memory", action="store_true", help="skip the fresh-process peak-memory measurements")
    p.add_argument("--no-training", action="store_true", help="skip the whole-training-step section")
    p.add_argument("--omp-wait", choices=("passive", "active"), default="passive",
                   help="OMP_WAIT_POLICY for this run and its child processes (default passive)")
    p.add_argument("--only", nargs="+", metavar="SECTION", default=None,
                   help="run only these sections: logits, 'small T', tp, hidden, sweeps, profiles, 'host reads', training")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the GPU tables (benchmarks/gpu.py) instead of the CPU run")
    p.add_argument("--rates-json", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _small_page_rates(threads: int, size_bytes: int) -> dict:
    """The primitive rates again in a process with 4 KiB pages (no THP request)."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "benchmarks.run", "--rates-json", "--small-pages", "--threads", str(threads)]
    if size_bytes < (1 << 30):
        cmd.append("--tiny")
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = _parse(argv)
    profile = "tiny" if args.tiny else "quick" if args.quick else "full"
    if args.device == "cuda":
        from benchmarks.gpu import main as gpu_main

        return gpu_main(profile, out=args.out)
    torch_loaded = "torch" in sys.modules
    if not args.small_pages and not torch_loaded:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # read by the CPU allocator; must precede torch
    huge_pages = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and not torch_loaded
    if not torch_loaded:
        os.environ.setdefault("OMP_WAIT_POLICY", args.omp_wait.upper())  # read when OpenMP starts
    omp_wait = os.environ.get("OMP_WAIT_POLICY", "unset") if not torch_loaded else "unknown (torch already loaded)"

    import torch

    from benchmarks import machine
    from benchmarks.render import render
    from benchmarks.suite import SECTIONS, Suite

    torch.set_num_threads(args.threads)
    cfg = PROFILES[profile]
    flush = machine.Flusher(16 << 20 if profile == "tiny" else None)  # tiny: seconds, not cold caches
    if args.rates_json:
        print(json.dumps(machine.measure_rates(flush, size_bytes=cfg["rates_bytes"], repeats=3).as_dict()))
        return 0

    from benchmarks.check import run_checks

    started = time.time()
    load_start = machine.loadavg()
    problems = run_checks()
    if problems:
        print("scorer does not match the float64 reference; not timing it:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    rates = machine.measure_rates(flush, size_bytes=cfg["rates_bytes"])
    small = None if profile == "tiny" or args.small_pages else _small_page_rates(args.threads, cfg["rates_bytes"])
    suite = Suite(cfg, rates, flush, threads=args.threads, memory=not args.no_memory, profile=profile,
                  training=not args.no_training)
    unknown = sorted(set(args.only or ()) - set(SECTIONS))
    if unknown:
        print(f"--only: unknown section(s) {unknown}; the sections are {list(SECTIONS)}", file=sys.stderr)
        return 2
    suite.run_all(args.only)
    info = machine.describe(huge_pages)
    info["omp_wait"] = omp_wait
    info["flush_mib"] = flush.buf.numel() * 4 >> 20
    info["load_start"], info["load_end"] = load_start, machine.loadavg()
    info["seconds"] = round(time.time() - started)
    info["command"] = "python -m benchmarks.run" + {"full": "", "quick": " --quick", "tiny": " --tiny"}[profile]
    if args.only:
        info["command"] += " --only " + " ".join(repr(x) if " " in x else x for x in args.only)
    text = render(suite, info, small)
    print(text)
    out = args.out or ("docs/benchmarks.md" if profile == "full" and not args.only else None)
    if out:
        from benchmarks.gpu import PLACEHOLDER, section_of, splice

        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        old = open(out).read() if os.path.exists(out) else ""
        text = splice(text, section_of(old) or PLACEHOLDER)  # the GPU tables stay until a GPU run replaces them
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
