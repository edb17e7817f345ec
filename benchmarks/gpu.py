"""The GPU tables: logits and hidden mode, forward and forward+backward, float32 and bfloat16,
against full-vocabulary scoring and the bandwidth limit, as ratios in one run.

    python -m benchmarks.run --device cuda            # writes its section into docs/benchmarks.md
    python -m benchmarks.run --device cuda --quick    # float32 only
    python -m benchmarks.run --device cuda --tiny --out /tmp/gpu.md

Timing: one warm-up call, then per round every variant of a configuration in turn (round-
robin), each call after the L2 cache is flushed (a buffer twice its size written) and
bracketed by CUDA events; times are the median over rounds, and the fastest round. Peak
memory: ``torch.cuda.max_memory_allocated`` during forward+backward above what was
allocated before it.

Rates, measured on the device in the same run (benchmarks/limits.py turns them into limits):

    read_bw   bytes/s   ``x.sum()`` over 1 GiB
    fill_bw   bytes/s   ``x.fill_(0)`` over 1 GiB
    copy_bw   bytes/s   ``y.copy_(x)``, 1 GiB each, read + write bytes counted
    gather    elems/s   ``torch.gather`` of 2**22 random float32 from a (4096, 131072) buffer
    gemm      flop/s    (4096 x 4096) @ (4096 x 8192) in the variant's dtype

Variants: logits (T, V) -> full (``log_softmax`` over the vocabulary in float32, then the
sampled entry), plain (benchmarks/variants.py ``plain_scores``), support
(``score_aligned_support``), gather (the bare read of the support ids, forward only).
Hidden (T, H) with the LM head (V, H) -> full (the logits GEMM, then as above), support
(a fresh dense weight gradient), support-sparse (a kept ``.grad``: only the support's rows
are written). Before timing, support and plain log-probs are compared on the device (the
``max |support - plain|`` column; the float64 reference gate runs on the CPU first).

The CPU run (``python -m benchmarks.run``) keeps this section when it rewrites the file:
it sits between the markers :data:`BEGIN` and :data:`END`. ``main(profile, device="cpu")``
runs the same code on the CPU (wall-clock timing, no peak memory): the smoke test's check
that the GPU path runs where no GPU is.
"""

from __future__ import annotations

import os
import statistics
import time

__all__ = ["main", "BEGIN", "END", "section_of", "splice"]

BEGIN = "<!-- gpu tables: python -m benchmarks.run --device cuda -->"
END = "<!-- end of gpu tables -->"
PLACEHOLDER = (f"{BEGIN}\n## GPU\n\nNot measured yet: run `python -m benchmarks.run --device cuda` on a machine with a "
               f"CUDA device; it fills this section (logits and hidden mode, forward and forward+backward, bf16 and "
               f"fp32, against full-vocabulary scoring and the bandwidth limit).\n{END}\n")

PROFILES = {
    "full": {"logits": {"T": 4096, "V": 131072, "k": (20, 64)}, "hidden": {"T": 4096, "V": 131072, "H": 2048, "k": 64},
             "dtypes": ("float32", "bfloat16"), "rounds": 9, "rates_bytes": 1 << 30},
    "quick": {"logits": {"T": 4096, "V": 131072, "k": (64,)}, "hidden": {"T": 4096, "V": 131072, "H": 2048, "k": 64},
              "dtypes": ("float32",), "rounds": 7, "rates_bytes": 1 << 30},
    "tiny": {"logits": {"T": 64, "V": 2048, "k": (8,)}, "hidden": {"T": 32, "V": 2048, "H": 64, "k": 8},
             "dtypes": ("float32", "bfloat16"), "rounds": 2, "rates_bytes": 1 << 24},
}


def section_of(text: str) -> str | None:
    """The GPU section of a report (markers included), or None."""
    a, b = text.find(BEGIN), text.find(END)
    return text[a : b + len(END)] + "\n" if a >= 0 and b > a else None


def splice(text: str, section: str) -> str:
    """``text`` with its GPU section replaced by ``section`` (appended when it has none)."""
    a, b = text.find(BEGIN), text.find(END)
    if a >= 0 and b > a:
        return text[:a] + section.rstrip("\n") + text[b + len(END) :]
    return text.rstrip("\n") + "\n\n" + section


class _Timer:
    def __init__(self, torch, device):
        self.torch, self.device, self.cuda = torch, device, device.type == "cuda"
        l2 = (getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) if self.cuda else 0) or (64 << 20)
        self.flush_buf = torch.empty(2 * l2 // 4, device=device)

    def once(self, fn) -> float:
        torch = self.torch
        self.flush_buf.fill_(1.0)
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(self.device)
        return start.elapsed_time(end)

    def rounds(self, fns: dict, rounds: int) -> dict:
        """name -> {ms: median, min: fastest}: the functions round-robin, one warm-up call each."""
        for fn in fns.values():
            fn()
        times = {n: [] for n in fns}
        for _ in range(rounds):
            for n, fn in fns.items():
                times[n].append(self.once(fn))
        return {n: {"ms": statistics.median(t), "min": min(t)} for n, t in times.items()}

    def peak(self, fn):
        torch = self.torch
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        out = fn()
        torch.cuda.synchronize(self.device)
        del out
        return torch.cuda.max_memory_allocated(self.device) - base


def _rates(torch, timer: _Timer, size_bytes: int, dtype) -> "object":
    from benchmarks.machine import Rates

    dev = timer.device
    n = size_bytes // 4
    x, y = torch.ones(n, device=dev), torch.empty(n, device=dev)
    t = timer.rounds({"read": lambda: x.sum(), "fill": lambda: y.fill_(0), "copy": lambda: y.copy_(x)}, 5)
    del x, y
    rows, cols = (4096, 131072) if size_bytes >= (1 << 30) else (64, 2048)
    big = torch.ones(rows, cols, device=dev)
    num = min(1 << 22, rows * cols)
    idx = torch.randint(0, cols, (rows, num // rows), device=dev)
    g = timer.rounds({"gather": lambda: torch.gather(big, 1, idx)}, 5)["gather"]
    del big, idx
    m = 4096 if size_bytes >= (1 << 30) else 256
    a, b = torch.randn(m, m, device=dev, dtype=dtype), torch.randn(m, 2 * m, device=dev, dtype=dtype)
    mm = timer.rounds({"gemm": lambda: a @ b}, 5)["gemm"]
    fresh = timer.rounds({"zeros": lambda: torch.zeros(n, device=dev)}, 3)["zeros"]
    med = lambda r: r["ms"] * 1e-3  # noqa: E731
    return Rates(read_bw=size_bytes / med(t["read"]), fill_bw=size_bytes / med(t["fill"]),
                 copy_bw=2 * size_bytes / med(t["copy"]), gather=num / med(g), gemm=2 * m * m * 2 * m / med(mm),
                 fresh_zero_s_per_gib=med(fresh) * (1 << 30) / size_bytes)


def _logits(torch, timer, cfg, dname, rates, rows_out) -> None:
    from benchmarks import limits
    from benchmarks.variants import floor_variants, logits_variant, plain_scores
    from benchmarks.workloads import channels, logits_input, support_rows

    dev, dtype = timer.device, getattr(torch, dname)
    T, V = cfg["T"], cfg["V"]
    logits = logits_input(T, V, dtype).to(dev).requires_grad_()
    for k in cfg["k"]:
        ch = _on(channels(support_rows(T, V, k), vocab_size=V), dev)
        check = (plain_scores(logits, ch)[0] - floor_variants(logits, ch)["support"]().logprobs).abs().max().item()
        fwd = timer.rounds({**{n: (lambda f=logits_variant(n, logits, ch): f(False)) for n in ("full", "plain", "support")},
                            "gather": floor_variants(logits, ch)["gather"]}, cfg["rounds"])
        bwd = timer.rounds({n: (lambda f=logits_variant(n, logits, ch): f(True)) for n in ("full", "plain", "support")},
                           cfg["rounds"])
        P = int((ch.rows >= 0).sum())
        lim_sup = limits.logits_support_fwd(rates, P=P) * 1e3
        lim_full = limits.logits_full_fwd(rates, N=T, V=V, b=logits.element_size()) * 1e3
        grad_write = T * V * logits.element_size() / rates.fill_bw * 1e3  # every variant returns a dense (T, V) gradient
        for n in ("full", "plain", "support", "gather"):
            lf = lim_full if n == "full" else lim_sup
            rows_out.append({
                "mode": "logits", "config": f"T={T} V={V} k={k}", "dtype": dname, "variant": n, "fwd": fwd[n],
                "fwdbwd": bwd.get(n), "full_fwd": fwd["full"], "full_fwdbwd": bwd["full"], "lim_fwd": lf,
                "lim_fwdbwd": lf + grad_write, "check": check if n == "support" else None,
                "peak": timer.peak(lambda f=logits_variant(n, logits, ch): f(True)) if n != "gather" else None,
            })
    del logits


def _hidden(torch, timer, cfg, dname, rates, rows_out) -> None:
    from benchmarks import limits
    from benchmarks.variants import hidden_variant
    from nemo_replay.scoring.scorer import score_aligned_support
    from benchmarks.workloads import channels, hidden_inputs, support_rows

    dev, dtype = timer.device, getattr(torch, dname)
    T, V, H, k = cfg["T"], cfg["V"], cfg["H"], cfg["k"]
    hidden, weight = (t.to(dev).requires_grad_() for t in hidden_inputs(T, V, H, dtype))
    ch = _on(channels(support_rows(T, V, k), vocab_size=V), dev)
    fns = {n: hidden_variant(n, hidden, weight, ch) for n in ("full", "support", "support-sparse")}
    with torch.no_grad():  # hidden mode against logits mode on the product it never builds
        logits = (hidden.float() @ weight.float().t()).to(dtype)
        ref = score_aligned_support(logits, ch.sampled, ch.row_ids, ch.loss_mask, ch.support).logprobs
        del logits
    check = (fns["support"](False) - ref).abs().max().item()
    fwd = timer.rounds({n: (lambda f=f: f(False)) for n, f in fns.items()}, cfg["rounds"])
    bwd = timer.rounds({n: (lambda f=f: f(True)) for n, f in fns.items()}, cfg["rounds"])
    present = ch.rows >= 0
    P, U = int(present.sum()), int(torch.unique(ch.rows[present]).numel())
    b = hidden.element_size()
    lim = {"full": (limits.hidden_full_fwd(rates, N=T, V=V, H=H, b=b), limits.hidden_full_fwdbwd(rates, N=T, V=V, H=H, b=b)),
           "support": (limits.hidden_support_fwd(rates, N=T, H=H, P=P, U=U, b=b),
                       limits.hidden_support_fwdbwd(rates, N=T, V=V, H=H, P=P, U=U, b=b)),
           "support-sparse": (limits.hidden_support_fwd(rates, N=T, H=H, P=P, U=U, b=b),
                              limits.hidden_support_sparse_fwdbwd(rates, N=T, H=H, P=P, U=U, b=b))}
    for n in fns:
        rows_out.append({
            "mode": "hidden", "config": f"T={T} V={V} H={H} k={k} ({U} distinct ids / {P} pairs)", "dtype": dname,
            "variant": n, "fwd": fwd[n], "fwdbwd": bwd[n], "full_fwd": fwd["full"], "full_fwdbwd": bwd["full"],
            "lim_fwd": lim[n][0] * 1e3, "lim_fwdbwd": lim[n][1] * 1e3, "check": check if n == "support" else None,
            "peak": timer.peak(lambda f=fns[n]: f(True)),
        })
    weight.grad = None
    del hidden, weight


def _compact(torch, timer, cfg, dname, rows_out) -> None:
    """Compact rows decoded at the scorer's entry (eight buffers, one a sample) against the logits-mode
    forward from the fixed rows they decode to, and the same forward from the compact rows."""
    from benchmarks.workloads import channels, logits_input, support_rows
    from nemo_replay.scoring.scorer import score_aligned_support
    from nemo_replay.support.codec import CompactRows, decode_batch, encode_support, fused_decode_serves
    from nemo_replay.support.ragged import RaggedSupport

    dev, T, V = timer.device, cfg["T"], cfg["V"]
    logits = logits_input(T, V, getattr(torch, dname)).to(dev)
    for k in cfg["k"]:
        ch = channels(support_rows(T, V, k), vocab_size=V)
        cuts = [T * i // 8 for i in range(9)]
        ragged = RaggedSupport.from_padded(ch.support).resegment(cuts)
        buffers = [encode_support(ragged[[i]], vocab_size=V) for i in range(8)]
        compact = CompactRows(buffers)
        fixed = decode_batch(buffers).to_padded().to(dev)  # the rows the decode gives, sorted
        args = (ch.sampled.to(dev), ch.row_ids.to(dev), ch.loss_mask.to(dev))
        with torch.no_grad():
            check = (score_aligned_support(logits, *args, compact).logprobs
                     - score_aligned_support(logits, *args, fixed).logprobs).abs().max().item()
            # The default decode (the fused kernels on CUDA where Triton imports) gives the reference's rows.
            assert torch.equal(compact.decode(dev).values, compact.decode(dev, fused=False).values)
            got = timer.rounds({"decode": lambda: compact.decode(dev), "reference": lambda: compact.decode(dev, fused=False),
                                "fixed": lambda: score_aligned_support(logits, *args, fixed),
                                "compact": lambda: score_aligned_support(logits, *args, compact)}, cfg["rounds"])
        rows_out.append({"config": f"T={T} V={V} k={k}", "dtype": dname, "bytes": sum(b.size for b in buffers) / T,
                         "fused": fused_decode_serves(dev),
                         **{n: got[n]["ms"] for n in got}, "check": check})
    del logits


def _empty_cache(torch, dev) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _on(ch, dev):
    """Channels moved to ``dev`` (the support keeps its record of the check)."""
    from benchmarks.workloads import Channels

    return Channels(ch.sampled.to(dev), ch.row_ids.to(dev), ch.loss_mask.to(dev), ch.support.to(dev))


def _render(info: dict, rates: dict, rows: list, compact: list = ()) -> str:
    from benchmarks.report import Table, fmt_mib, fmt_ms, fmt_rate, fmt_ratio

    parts = [BEGIN, "## GPU\n",
             f"Written by `{info['command']}` on {info['when']} ({info['seconds']} s), {info['device']}, torch "
             f"{info['torch']}. Method: benchmarks/gpu.py (round-robin per configuration, CUDA events, L2 flushed "
             f"before each call; times are medians over rounds). Limits: the Limit models above, over the rates "
             f"measured here.\n"]
    rt = Table("GPU rates", ["rate", *rates])
    for key, label, unit in (("read_bw", "read bandwidth", "B/s"), ("fill_bw", "write (fill) bandwidth", "B/s"),
                             ("copy_bw", "copy bandwidth (read+write)", "B/s"), ("gather", "random gather", "elem/s"),
                             ("gemm", "GEMM", "flop/s")):
        rt.add(label, *(fmt_rate(getattr(r, key), unit) for r in rates.values()))
    parts.append(rt.markdown())
    t = Table("GPU: support scoring against full-vocabulary scoring and the bandwidth limit",
              ["mode", "configuration", "dtype", "variant", "fwd ms", "fwd+bwd ms", "fwd x full", "fwd+bwd x full",
               "fwd x limit", "fwd+bwd x limit", "peak MiB (fwd+bwd)", "support: max abs diff"],
              "Logits: every variant's backward writes a dense (T, V) logits gradient (in the fwd+bwd limit at the "
              "fill rate). Hidden: support returns a fresh dense (V, H) weight gradient, support-sparse adds the "
              "support's rows to a kept .grad. Last column, checked before timing: logits mode against the plain "
              "scorer, hidden mode against logits mode on the product `hidden @ weight.T` rounded to the dtype "
              "(both ~0 up to the dtype's rounding of the scores).")
    for r in rows:
        fb = r["fwdbwd"]
        t.add(r["mode"], r["config"], r["dtype"], r["variant"], fmt_ms(r["fwd"]["ms"]), fmt_ms(fb["ms"]) if fb else "-",
              fmt_ratio(r["fwd"]["ms"] / r["full_fwd"]["ms"]), fmt_ratio(fb["ms"] / r["full_fwdbwd"]["ms"]) if fb else "-",
              fmt_ratio(r["fwd"]["ms"] / r["lim_fwd"]), fmt_ratio(fb["ms"] / r["lim_fwdbwd"]) if fb else "-",
              fmt_mib(r["peak"]), "-" if r["check"] is None else f"{r['check']:.1e}")
    parts.append(t.markdown())
    if compact:
        c = Table("GPU: compact rows decoded at the scorer's entry point",
                  ["configuration", "dtype", "compact B/token", "decode", "decode ms", "reference steps ms",
                   "forward, fixed rows ms", "decode / forward", "forward from compact rows ms", "compact / fixed",
                   "max abs diff"],
                  "Eight buffers, one a sample, decoded on the device by `CompactRows.decode` (no host read): by "
                  "the fused kernels where Triton imports (`decode`: fused), else by the reference's array steps, "
                  "which the next column times alone; the logits-mode forward (no grad) from the fixed rows they "
                  "decode to, and from the compact rows (the decode included).")
        for r in compact:
            c.add(r["config"], r["dtype"], f"{r['bytes']:.1f}", "fused" if r["fused"] else "reference",
                  fmt_ms(r["decode"]), fmt_ms(r["reference"]), fmt_ms(r["fixed"]), fmt_ratio(r["decode"] / r["fixed"]),
                  fmt_ms(r["compact"]),
                  fmt_ratio(r["compact"] / r["fixed"]), f"{r['check']:.1e}")
        parts.append(c.markdown())
    parts.append(END)
    return "\n".join(parts) + "\n"


def main(profile: str, *, out: str | None = None, device: str = "cuda") -> int:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); run on a GPU machine "
              "with a CUDA build of torch, or drop --device cuda for the CPU tables")
        return 2
    from benchmarks.check import run_checks

    problems = run_checks()
    if problems:
        print("scorer does not match the float64 reference; not timing it:\n" + "\n".join(problems))
        return 1
    started = time.time()
    cfg = PROFILES[profile]
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    timer = _Timer(torch, dev)
    rates, rows, compact = {}, [], []
    for dname in cfg["dtypes"]:
        rates[dname] = _rates(torch, timer, cfg["rates_bytes"], getattr(torch, dname))
        _logits(torch, timer, {**cfg["logits"], "rounds": cfg["rounds"]}, dname, rates[dname], rows)
        _empty_cache(torch, dev)
        _hidden(torch, timer, {**cfg["hidden"], "rounds": cfg["rounds"]}, dname, rates[dname], rows)
        _empty_cache(torch, dev)
        _compact(torch, timer, {**cfg["logits"], "rounds": cfg["rounds"]}, dname, compact)
        _empty_cache(torch, dev)
    info = {"command": "python -m benchmarks.run --device cuda" + {"full": "", "quick": " --quick", "tiny": " --tiny"}[profile],
            "when": time.strftime("%Y-%m-%d %H:%M"), "seconds": round(time.time() - started),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{dev} (the GPU code on the CPU)",
            "torch": torch.__version__}
    section = _render(info, rates, rows, compact)
    print(section)
    out = out or ("docs/benchmarks.md" if profile == "full" else None)
    if out:
        old = open(out).read() if os.path.exists(out) else ""
        with open(out, "w") as f:
            f.write(splice(old, section) if old else section)
        print(f"wrote {out}")
    return 0
