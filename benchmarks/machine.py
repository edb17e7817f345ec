"""The machine: description, and the primitive rates the physical limits are built from.

Measured in the same process and run as the table, with the same thread count, cold
caches (a buffer twice the last-level cache is written before every repetition) and the
same page mode as the inputs:

    read_bw    bytes/s  ``x.sum()`` over 1 GiB
    fill_bw    bytes/s  ``x.fill_(0)`` over 1 GiB already mapped
    copy_bw    bytes/s  ``y.copy_(x)``, 1 GiB each, read + write bytes counted
    gather     lines/s  ``flat.index_select(0, idx)`` of 2**20 random float32 from a 2 GiB
                        buffer: each lands on its own 64-byte cache line (and, with 4 KiB
                        pages, usually its own page: a TLB miss as well)
    gemm       flop/s   float32 (2048 x 2048) @ (2048 x 8192)
    fresh_zero s/GiB    ``torch.zeros`` in fresh memory (page faults included), per GiB:
                        what any backward that returns a new dense gradient pays
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

__all__ = [
    "Rates", "Flusher", "describe", "loadavg", "measure_rates", "median_ms", "interleaved_ms", "last_level_cache_bytes",
]

GiB = 1 << 30


def last_level_cache_bytes() -> int:
    """Largest cache size reported by sysfs (32 MiB when unreadable)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        entries = []
    for entry in entries:  # index0, index1, ... (other entries, such as uevent, have no size)
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
            best = max(best, int(text.rstrip("KM")) * scale)
        except (OSError, ValueError, IndexError):
            continue
    return best or 32 << 20


class Flusher:
    """Writes a buffer twice the last-level cache (or ``size_bytes``), so the next timed call starts cold."""

    def __init__(self, size_bytes: int | None = None):
        self.buf = torch.empty((size_bytes or 2 * last_level_cache_bytes()) // 4)

    def __call__(self):
        self.buf.fill_(1.0)


def median_ms(fn: Callable[[], object], *, repeats: int, warmup: int = 1, flush: Flusher | None = None) -> float:
    """Median wall time of ``fn`` in milliseconds after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def interleaved_ms(fns: dict, *, rounds: int, warmup: int = 1, flush: Flusher | None = None) -> dict:
    """Median wall time (ms) of each function, the functions run round-robin.

    Every round times each function once, in turn, so a burst of load from another process
    lands on all of them alike and a ratio of two medians compares like with like.
    Returns name -> {"ms": median, "min": fastest, "max": slowest}.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if flush is not None:
                flush()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {n: {"ms": statistics.median(t) * 1e3, "min": min(t) * 1e3, "max": max(t) * 1e3} for n, t in times.items()}


@dataclass
class Rates:
    read_bw: float
    fill_bw: float
    copy_bw: float
    gather: float
    gemm: float
    fresh_zero_s_per_gib: float

    def as_dict(self) -> dict:
        return asdict(self)


def measure_rates(flush: Flusher, *, size_bytes: int = GiB, repeats: int = 5) -> Rates:
    """Primitive rates of this machine (see the module docstring)."""
    n = size_bytes // 4
    x = torch.ones(n)
    y = torch.empty(n)
    y.fill_(0)
    read = median_ms(lambda: x.sum(), repeats=repeats, flush=flush)
    fill = median_ms(lambda: y.fill_(0), repeats=repeats, flush=flush)
    copy = median_ms(lambda: y.copy_(x), repeats=repeats, flush=flush)
    del y
    big = torch.cat([x, x])  # 2 GiB source for the random gather
    del x
    g = torch.Generator().manual_seed(0)
    num = 1 << 20
    idx = [torch.randint(0, big.numel(), (num,), generator=g) for _ in range(repeats + 1)]
    it = iter(idx)
    gather = median_ms(lambda: big.index_select(0, next(it)), repeats=repeats, flush=flush)
    del big, idx
    a, b = torch.randn(2048, 2048), torch.randn(2048, 8192)
    gemm = median_ms(lambda: a @ b, repeats=repeats, flush=flush)
    fresh = median_ms(lambda: torch.zeros(n), repeats=3, flush=flush)
    return Rates(
        read_bw=size_bytes / (read * 1e-3),
        fill_bw=size_bytes / (fill * 1e-3),
        copy_bw=2 * size_bytes / (copy * 1e-3),
        gather=num / (gather * 1e-3),
        gemm=2 * 2048 * 2048 * 8192 / (gemm * 1e-3),
        fresh_zero_s_per_gib=fresh * 1e-3 * GiB / size_bytes,
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
        return text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return "unknown"


def loadavg() -> tuple[float, float, float]:
    try:
        with open("/proc/loadavg") as f:
            a, b, c = f.read().split()[:3]
        return float(a), float(b), float(c)
    except (OSError, ValueError):
        return (float("nan"),) * 3


def describe(huge_pages: bool) -> dict:
    """CPU model, cores, memory, torch version and threads, page mode."""
    try:
        with open("/proc/meminfo") as f:
            mem_kib = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kib = 0
    return {
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(mem_kib / (1 << 20), 1),
        "llc_mib": last_level_cache_bytes() >> 20,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "thp_kernel": _thp_mode(),
        "huge_pages": huge_pages,
    }
