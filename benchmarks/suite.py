"""The benchmark run: every section of the table, measured in one process, and its report.

Sections (sizes from the profile in benchmarks/run.py):
    logits   forward of full / chunked / replay-off / support per (V, k, dtype), T fixed;
             the headline configuration also forward + backward and peak memory
    hidden   forward and forward + backward of full / chunked / two-proj / support per
             (V, H, k), T fixed, and peak memory; the headline configuration again with
             uniform (non-overlapping) supports
    scaling  support scoring against T (hidden and logits mode) and against V (hidden)
Full-vocabulary figures do not depend on k; they are measured once per (V, H) or (V, dtype).
"""

from __future__ import annotations

import gc
import time

import torch

from benchmarks import limits
from benchmarks.machine import Flusher, Rates, loadavg, median_ms
from benchmarks.memory import measure_in_subprocess
from benchmarks.report import Table, fmt_mib, fmt_ms, fmt_rate, fmt_ratio
from benchmarks.variants import HIDDEN_VARIANTS, LOGITS_VARIANTS, hidden_variant, logits_variant
from benchmarks.workloads import channels, hidden_inputs, logits_input, support_rows

__all__ = ["Suite"]

MiB = 1 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


class Suite:
    def __init__(self, cfg: dict, rates: Rates, flush: Flusher, *, threads: int, memory: bool, profile: str):
        self.cfg, self.rates, self.flush = cfg, rates, flush
        self.threads, self.memory, self.profile = threads, memory, profile
        lg, hd = cfg["logits"], cfg["hidden"]
        self.logits_head = (lg["T"], max(lg["V"]), max(lg["k"]))
        self.hidden_head = (hd["T"], max(hd["V"]), max(hd["H"]), max(hd["k"]))
        self.logits_rows: list[dict] = []
        self.logits_train: dict = {}
        self.hidden_rows: list[dict] = []
        self.sweep_hidden_T: list[dict] = []
        self.sweep_hidden_V: list[dict] = []
        self.sweep_logits_T: list[dict] = []
        self.load: dict[str, float] = {}  # 1-minute load average when each section started

    # ------------------------------------------------------------------ measuring

    def _time(self, fn, backward: bool) -> float:
        t0 = time.perf_counter()
        fn(backward)  # warm-up
        first = time.perf_counter() - t0
        repeats = 2 if first > 2.0 else 3 if first > 0.3 else self.cfg["repeats"]
        return median_ms(lambda: fn(backward), repeats=repeats, warmup=0, flush=self.flush)

    def _peak(self, **spec):
        if not self.memory:
            return None
        scope = self.cfg.get("memory_scope")  # None: every variant; else (mode, variant) pairs
        if scope is not None and (spec["mode"], spec["variant"]) not in scope:
            return None
        res = measure_in_subprocess({"threads": self.threads, "dtype": "float32", "model": "zipf", **spec})
        return res.get("peak_bytes", "error: " + res.get("error", "?"))

    # ------------------------------------------------------------------ sections

    def run_all(self) -> None:
        for name, section in (("logits", self.run_logits), ("hidden", self.run_hidden), ("sweeps", self.run_hidden_sweeps)):
            self.load[name] = loadavg()[0]
            section()
        self.load["end"] = loadavg()[0]

    def run_logits(self) -> None:
        cfg = self.cfg["logits"]
        T = cfg["T"]
        for V in cfg["V"]:
            base = logits_input(T, V, torch.float32)
            for dname in cfg["dtypes"]:
                logits = base.detach().to(DTYPES[dname]).requires_grad_()  # a new leaf (float32: same storage)
                full = {}
                for k in cfg["k"]:
                    ch = channels(support_rows(T, V, k))
                    row = {"V": V, "k": k, "dtype": dname}
                    for name in LOGITS_VARIANTS:
                        per_k = name.startswith("support")
                        if per_k or name not in full:
                            ms = self._time(logits_variant(name, logits, ch), backward=False)
                            if not per_k:
                                full[name] = ms
                        row[name] = ms if per_k else full[name]
                    P = int((ch.rows >= 0).sum())
                    row["limit"] = limits.logits_support_fwd(self.rates, P=P) * 1e3
                    row["full_limit"] = limits.logits_full_fwd(self.rates, N=T, V=V, b=logits.element_size()) * 1e3
                    self.logits_rows.append(row)
                    if (T, V, k) == self.logits_head and dname == "float32":
                        self._logits_headline(logits, ch)
                if dname == "float32" and V == self.logits_head[1]:
                    self._logits_sweep(base)
                del logits
                gc.collect()
            del base
            gc.collect()

    def _logits_headline(self, logits, ch) -> None:
        T, V, k = self.logits_head
        for name in LOGITS_VARIANTS:
            fn = logits_variant(name, logits, ch)
            self.logits_train[name] = {
                "fwdbwd": self._time(fn, backward=True),
                "peak": self._peak(mode="logits", variant=name, T=T, V=V, k=k, H=0),
            }
            gc.collect()

    def _logits_sweep(self, base) -> None:
        V, k = self.logits_head[1], self.logits_head[2]
        for T in self.cfg["logits_T"]:
            logits = base.detach()[:T].requires_grad_()
            ch = channels(support_rows(T, V, k))
            ms = self._time(logits_variant("support", logits, ch), backward=False)
            lim = limits.logits_support_fwd(self.rates, P=int((ch.rows >= 0).sum())) * 1e3
            self.sweep_logits_T.append({"T": T, "fwd": ms, "limit": lim})

    def _hidden_limits(self, ch, T, V, H) -> dict:
        rows = ch.rows
        P = int((rows >= 0).sum())
        U = int(torch.unique(rows[rows >= 0]).numel())
        r = self.rates
        return {
            "P": P,
            "U": U,
            "lim_fwd": limits.hidden_support_fwd(r, N=T, H=H, P=P, U=U, b=4) * 1e3,
            "lim_fwdbwd": limits.hidden_support_fwdbwd(r, N=T, V=V, H=H, P=P, U=U, b=4) * 1e3,
            "full_lim_fwd": limits.hidden_full_fwd(r, N=T, V=V, H=H, b=4) * 1e3,
            "full_lim_fwdbwd": limits.hidden_full_fwdbwd(r, N=T, V=V, H=H, b=4) * 1e3,
        }

    def _hidden_measure(self, name, hidden, weight, ch, T, V, H, k, model="zipf", memory=True) -> dict:
        fn = hidden_variant(name, hidden, weight, ch)
        out = {"fwd": self._time(fn, backward=False), "fwdbwd": self._time(fn, backward=True)}
        gc.collect()
        out["peak"] = self._peak(mode="hidden", variant=name, T=T, V=V, H=H, k=k, model=model) if memory else None
        return out

    def run_hidden(self) -> None:
        cfg = self.cfg["hidden"]
        T = cfg["T"]
        for V in cfg["V"]:
            for H in cfg["H"]:
                hidden, weight = hidden_inputs(T, V, H, torch.float32)
                hidden.requires_grad_(), weight.requires_grad_()
                full = {}
                for k in cfg["k"]:
                    ch = channels(support_rows(T, V, k))
                    row = {"V": V, "H": H, "k": k, "model": "zipf", **self._hidden_limits(ch, T, V, H)}
                    for name in HIDDEN_VARIANTS:
                        if name in ("full", "chunked"):
                            if name not in full:
                                full[name] = self._hidden_measure(name, hidden, weight, ch, T, V, H, k)
                            row[name] = full[name]
                        elif name == "support" or k == max(cfg["k"]):
                            row[name] = self._hidden_measure(name, hidden, weight, ch, T, V, H, k)
                    self.hidden_rows.append(row)
                    if (T, V, H, k) == self.hidden_head and self.cfg.get("uniform_row", True):
                        worst = channels(support_rows(T, V, k, model="uniform"))
                        wrow = {"V": V, "H": H, "k": k, "model": "uniform", **self._hidden_limits(worst, T, V, H)}
                        wrow["support"] = self._hidden_measure("support", hidden, weight, worst, T, V, H, k, "uniform")
                        wrow["full"], wrow["chunked"] = full["full"], full["chunked"]
                        self.hidden_rows.append(wrow)
                del hidden, weight
                gc.collect()

    def run_hidden_sweeps(self) -> None:
        T0, V0, H, k = self.hidden_head
        Tmax = max(self.cfg["hidden_T"])
        hidden, weight = hidden_inputs(Tmax, V0, H, torch.float32)
        for T in self.cfg["hidden_T"]:
            h = hidden[:T].clone().requires_grad_()
            w = weight.detach().requires_grad_()
            ch = channels(support_rows(T, V0, k))
            res = self._hidden_measure("support", h, w, ch, T, V0, H, k, memory=self.cfg.get("sweep_memory", True))
            self.sweep_hidden_T.append({"T": T, **res, **self._hidden_limits(ch, T, V0, H)})
        h = hidden[:T0].clone().requires_grad_()
        for V in self.cfg["hidden_V"]:
            w = weight.detach()[:V].requires_grad_()
            ch = channels(support_rows(T0, V, k))
            res = self._hidden_measure("support", h, w, ch, T0, V, H, k, memory=self.cfg.get("sweep_memory", True))
            self.sweep_hidden_V.append({"V": V, **res, **self._hidden_limits(ch, T0, V, H)})
            del w
            gc.collect()

    # ------------------------------------------------------------------ report

    def targets(self) -> Table:
        t = Table("Targets", ["target", "measured", "reference", "ratio", "bound", "met", "what dominates"])
        r = self.rates
        T, V, k = self.logits_head
        row = next((x for x in self.logits_rows if (x["V"], x["k"], x["dtype"]) == (V, k, "float32")), None)
        if row:
            ratio = row["support"] / row["limit"]
            P = T * k
            t.add(f"logits fwd T={T} V={V} k={k} fp32 vs gather limit", f"{fmt_ms(row['support'])} ms",
                  f"{fmt_ms(row['limit'])} ms", fmt_ratio(ratio), "<= 3", "yes" if ratio <= 3 else "no",
                  f"limit: {P} random lines, {P / r.gather * 1e3:.2f} ms of it; the row validation (a sort "
                  f"of every row) costs {fmt_ms(row['support'] - row['support-nv'])} ms of the measured time")
            ratio = row["support-nv"] / row["limit"]
            t.add("the same with validate=False (rows validated where they entered)",
                  f"{fmt_ms(row['support-nv'])} ms", f"{fmt_ms(row['limit'])} ms", fmt_ratio(ratio), "<= 3",
                  "yes" if ratio <= 3 else "no", "")
        T, V, H, k = self.hidden_head
        row = next((x for x in self.hidden_rows if (x["V"], x["H"], x["k"], x["model"]) == (V, H, k, "zipf")), None)
        if row:
            s = row["support"]
            ratio = s["fwdbwd"] / row["lim_fwdbwd"]
            grad_ms = V * H * 4 / r.fill_bw * 1e3
            fresh_ms = r.fresh_zero_s_per_gib * 1e3 * (V * H * 4) / (1 << 30)
            t.add(f"hidden fwd+bwd T={T} V={V} H={H} k={k} fp32 vs limit", f"{fmt_ms(s['fwdbwd'])} ms",
                  f"{fmt_ms(row['lim_fwdbwd'])} ms", fmt_ratio(ratio), "<= 2", "yes" if ratio <= 2 else "no",
                  f"limit: writing the dense weight gradient, {grad_ms:.1f} ms of it; a fresh zeroed tensor "
                  f"that size costs {fresh_ms:.0f} ms here (page faults); forward {fmt_ms(s['fwd'])} ms")
            floor = row["lim_fwdbwd"] - grad_ms + max(fresh_ms, grad_ms)
            ratio = s["fwdbwd"] / floor
            t.add("the same against that limit with the gradient priced as a fresh zeroed allocation",
                  f"{fmt_ms(s['fwdbwd'])} ms", f"{fmt_ms(floor)} ms", fmt_ratio(ratio), "<= 2",
                  "yes" if ratio <= 2 else "no", "any design returning a new dense weight gradient pays this floor")
            two = row.get("two-proj", {}).get("peak")
            if isinstance(s["peak"], int) and isinstance(two, int):
                ratio = s["peak"] / two
                t.add("hidden training peak vs two projections + two dense weight grads",
                      f"{fmt_mib(s['peak'])} MiB", f"{fmt_mib(two)} MiB", fmt_ratio(ratio), "<= 0.6",
                      "yes" if ratio <= 0.6 else "no",
                      f"the one dense weight gradient, {V * H * 4 / MiB:.0f} MiB; growth with T x k: Scaling")
        return t

    def render(self, info: dict, small: dict | None) -> str:
        r = self.rates
        parts = [
            "# Scorer benchmarks\n",
            f"Written by `{info['command']}` on {time.strftime('%Y-%m-%d %H:%M', time.localtime())} "
            f"({info['seconds']} s). Timing: one process, one warm-up call, then the median of repeats "
            f"(9 for calls under 0.3 s, 3 up to 2 s, 2 beyond), each repetition starting with cold caches "
            f"(a {2 * info['llc_mib']} MiB buffer written first). Forward = a training forward (inputs require "
            f"grad); forward+backward adds the gradient of a weighted sum of the log-probs. Peak memory: a fresh "
            f"process per variant, resident-set high-water mark of forward+backward above the inputs.\n",
        ]
        m = Table("Machine", ["item", "value"])
        m.add("CPU", info["cpu"])
        m.add("cores", info["cores"])
        m.add("memory", f"{info['memory_gib']} GiB")
        m.add("last-level cache", f"{info['llc_mib']} MiB")
        m.add("torch", info["torch"])
        m.add("torch threads", info["threads"])
        m.add("pages", ("transparent huge pages requested (THP_MEM_ALLOC_ENABLE=1)" if info["huge_pages"] else "4 KiB")
              + f"; kernel THP mode `{info['thp_kernel']}`")
        m.add("load average (1, 5, 15 min) at start", ", ".join(f"{x:.2f}" for x in info["load_start"]))
        m.add("load average at end", ", ".join(f"{x:.2f}" for x in info["load_end"]))
        m.add("1-minute load when each section started",
              ", ".join(f"{k} {v:.2f}" for k, v in self.load.items()) + " (the run itself adds up to its thread count; more means another process competed for the 2 cores)")
        parts.append(m.markdown())
        rt = Table("Measured rates", ["rate", "this run", "4 KiB pages (separate process)"])
        sm = small if small and "error" not in small else {}
        for key, label, unit in (("read_bw", "read bandwidth", "B/s"), ("fill_bw", "write (fill) bandwidth", "B/s"),
                                 ("copy_bw", "copy bandwidth (read+write)", "B/s"),
                                 ("gather", "random gather (cold lines)", "lines/s"), ("gemm", "fp32 GEMM", "flop/s")):
            rt.add(label, fmt_rate(getattr(r, key), unit), fmt_rate(sm[key], unit) if key in sm else "-")
        rt.add("fresh zeroed tensor, per GiB", f"{r.fresh_zero_s_per_gib * 1e3:.0f} ms",
               f"{sm['fresh_zero_s_per_gib'] * 1e3:.0f} ms" if "fresh_zero_s_per_gib" in sm else "-")
        parts.append(rt.markdown())
        parts.append(LIMIT_TEXT)
        parts.append(self.targets().markdown())
        parts.append(self._logits_tables())
        parts.append(self._hidden_tables())
        parts.append(self._sweep_tables())
        parts.append(READING_TEXT)
        return "\n".join(parts)

    def _logits_tables(self) -> str:
        t = Table(
            f"Logits mode, forward, T={self.cfg['logits']['T']}",
            ["V", "k", "dtype", "full ms", "chunked ms", "replay-off ms", "support ms", "support-nv ms",
             "support x full", "support limit ms", "support x limit", "support-nv x limit", "full limit ms"],
            "full = log_softmax + gather over the vocabulary; chunked = the same in 512-position chunks; "
            "replay-off = score_full_vocabulary; support = score_aligned_support (validation on, the "
            "default); support-nv = the same with validate=False.",
        )
        for r in self.logits_rows:
            t.add(r["V"], r["k"], r["dtype"], fmt_ms(r["full"]), fmt_ms(r["chunked"]), fmt_ms(r["replay-off"]),
                  fmt_ms(r["support"]), fmt_ms(r["support-nv"]), fmt_ratio(r["support"] / r["full"]),
                  fmt_ms(r["limit"]), fmt_ratio(r["support"] / r["limit"]), fmt_ratio(r["support-nv"] / r["limit"]),
                  fmt_ms(r["full_limit"]))
        out = t.markdown()
        if self.logits_train:
            T, V, k = self.logits_head
            tt = Table(f"Logits mode, training step, T={T} V={V} k={k} fp32",
                       ["variant", "fwd+bwd ms", "x full", "peak MiB", "peak x full"],
                       "Every variant returns a dense [T, V] logits gradient "
                       f"({T * V * 4 / MiB:.0f} MiB): the floor of any logits-mode backward.")
            f = self.logits_train["full"]
            for name, v in self.logits_train.items():
                peak_ratio = _ratio(v["peak"], f["peak"]) if isinstance(v["peak"], int) and isinstance(f["peak"], int) else None
                tt.add(name, fmt_ms(v["fwdbwd"]), fmt_ratio(v["fwdbwd"] / f["fwdbwd"]), fmt_mib(v["peak"]),
                       fmt_ratio(peak_ratio))
            out += "\n" + tt.markdown()
        return out

    def _hidden_tables(self) -> str:
        T = self.cfg["hidden"]["T"]
        t = Table(
            f"Hidden mode, T={T}, fp32",
            ["V", "H", "k", "supports", "distinct ids", "variant", "fwd ms", "fwd+bwd ms", "peak MiB",
             "fwd x full", "fwd+bwd x full", "fwd x limit", "fwd+bwd x limit", "peak x two-proj"],
            "full = matmul + log_softmax + gather; chunked = per 128 positions under activation "
            "checkpointing; two-proj = two separate projections, two dense weight gradients; "
            "support = score_aligned_support(lm_head_weight=...). Limits: support rows only "
            "(see Limit models); full-vocabulary rows show their own GEMM limit in the fwd x limit columns.",
        )
        for r in self.hidden_rows:
            full = r["full"]
            two = r.get("two-proj", {}).get("peak")
            for name in HIDDEN_VARIANTS:
                if name not in r:
                    continue
                v = r[name]
                is_full = name in ("full", "chunked")
                lf = r["full_lim_fwd"] if is_full else r["lim_fwd"]
                lb = r["full_lim_fwdbwd"] if is_full else r["lim_fwdbwd"]
                peak_ratio = v["peak"] / two if isinstance(v["peak"], int) and isinstance(two, int) else None
                t.add(r["V"], r["H"], r["k"], r["model"], f"{r['U']}/{r['P']}", name, fmt_ms(v["fwd"]),
                      fmt_ms(v["fwdbwd"]), fmt_mib(v["peak"]), fmt_ratio(v["fwd"] / full["fwd"]),
                      fmt_ratio(v["fwdbwd"] / full["fwdbwd"]), fmt_ratio(v["fwd"] / lf), fmt_ratio(v["fwdbwd"] / lb),
                      fmt_ratio(peak_ratio))
        return t.markdown()

    def _sweep_tables(self) -> str:
        T0, V0, H, k = self.hidden_head
        out = ["## Scaling\n"]
        wbytes = V0 * H * 4
        t = Table(f"Hidden mode support scoring against T (V={V0} H={H} k={k})",
                  ["T", "fwd ms", "fwd ms / T (us)", "fwd+bwd ms", "fwd+bwd x limit", "peak MiB",
                   "peak - weight grad, MiB", "per pair, KiB"],
                  f"The one dense weight gradient is {wbytes / MiB:.0f} MiB at every T; what grows with T is "
                  "the rest, per (position, id) pair.")
        for r in self.sweep_hidden_T:
            extra = r["peak"] - wbytes if isinstance(r["peak"], int) else None
            t.add(r["T"], fmt_ms(r["fwd"]), f"{r['fwd'] / r['T'] * 1e3:.1f}", fmt_ms(r["fwdbwd"]),
                  fmt_ratio(r["fwdbwd"] / r["lim_fwdbwd"]), fmt_mib(r["peak"]),
                  fmt_mib(extra) if extra is not None else "-",
                  f"{extra / r['P'] / 1024:.1f}" if extra is not None else "-")
        out.append(t.markdown())
        t = Table(f"Hidden mode support scoring against V (T={T0} H={H} k={k})",
                  ["V", "fwd ms", "fwd x limit", "fwd+bwd ms", "fwd+bwd x limit", "weight grad MiB", "peak MiB"],
                  "The forward reads only the support's rows: flat in V. The backward writes the dense "
                  "(V, H) weight gradient, so forward+backward and peak memory grow with V through that "
                  "one tensor alone.")
        for r in self.sweep_hidden_V:
            t.add(r["V"], fmt_ms(r["fwd"]), fmt_ratio(r["fwd"] / r["lim_fwd"]), fmt_ms(r["fwdbwd"]),
                  fmt_ratio(r["fwdbwd"] / r["lim_fwdbwd"]), fmt_mib(r["V"] * H * 4), fmt_mib(r["peak"]))
        out.append(t.markdown())
        T, V, k = self.logits_head
        t = Table(f"Logits mode support scoring against T (V={V} k={k} fp32, forward)",
                  ["T", "fwd ms", "fwd ms / T (us)", "limit ms", "x limit"])
        for r in self.sweep_logits_T:
            t.add(r["T"], fmt_ms(r["fwd"]), f"{r['fwd'] / r['T'] * 1e3:.2f}", fmt_ms(r["limit"]),
                  fmt_ratio(r["fwd"] / r["limit"]))
        out.append(t.markdown())
        return "\n".join(out)


LIMIT_TEXT = """### Limit models

Each limit is the time the bytes that must move and the flops that must run take at the
rates above (P present pairs, U distinct ids among them, N positions, b bytes per element):

- logits, support forward: `P / gather + 4 P / read_bw` (P random cache lines, plus the rows);
- logits, full forward: `N V b / read_bw` (every logit read once);
- hidden, support forward: `max((U + N) H b / read_bw, 2 P H / gemm)`;
- hidden, support forward+backward: `max((2U + 2N) H b / read_bw + V H b / fill_bw, 6 P H / gemm)`
  (the weight rows read twice, and the dense (V, H) weight gradient the autograd contract
  returns, written once);
- hidden, full: `max(2 N V H / gemm, V H b / read_bw)` forward, three GEMMs with the backward.

Page faults of fresh allocations are not in any limit; the "fresh zeroed tensor" row
shows what they cost here.
"""

READING_TEXT = """## Reading the numbers

- Logits mode costs one random gather of P floats from the logits plus a dozen passes over
  `[positions, k]` (scores, stabiliser, exponentials, the sampled-member guard) and the row
  validation (a sort of every row). The full-vocabulary paths stream every logit, so their
  cost grows with V while support scoring's does not.
- Hidden mode reads only the rows the supports name; a forward is a few milliseconds at
  every V. Its backward must hand autograd a dense (V, H) weight gradient: writing that one
  tensor (plus the page faults of a fresh allocation) dominates forward+backward and the
  peak memory, and is the same tensor every full-vocabulary design also returns.
- Huge pages matter on this machine: with 4 KiB pages every random logit read is a TLB
  miss as well as a cache miss, and every fresh 4 KiB page of a new gradient is a page fault
  (compare the two columns of the rates table).
"""
