"""The benchmark run: every section of the table, measured in one process (report: benchmarks/render.py).

Sections (sizes from the profile in benchmarks/run.py):
    logits     forward of full / chunked / replay-off / plain / support / support-unchecked /
               support-nv per (V, k, dtype), T fixed; per (V, k, dtype) and extra (none,
               entropy, support mass) the gather limit, the plain scorer and the scorer
               round-robin (the floor targets); the headline configuration also forward +
               backward and peak memory, and the three support variants again round-robin
               (the validation target)
    small T    the floor round-robin at small T (host overhead against the gather limit)
    tp         the floor round-robin on two tensor-parallel ranks (benchmarks/tp.py)
    hidden     forward and forward + backward of full / chunked / two-proj / support /
               support-sparse per (V, H, k), T fixed, and peak memory; the headline
               configuration again with uniform (non-overlapping) supports, dense against
               sparse weight gradient round-robin, and the persistent buffers (.grad,
               main_grad) against filling a (V, H) buffer round-robin (the gradient targets)
    profiles   the top operators (torch.profiler, self CPU time) of the headline variants
    scaling    support scoring against T (hidden and logits mode) and against V (hidden,
               dense and sparse weight gradient)
    host reads per scorer call, before and after (benchmarks/syncs.py)
    training   the policy step with replay against the same step without, on the
               reference trainer's model and a megatron-core GPTModel (benchmarks/training.py)
Full-vocabulary figures do not depend on k; they are measured once per (V, H) or (V, dtype).
"""

from __future__ import annotations

import gc
import time

import torch

from benchmarks import limits
from benchmarks.machine import Flusher, Rates, interleaved_ms, loadavg, median_ms
from benchmarks.memory import measure_in_subprocess
from benchmarks.variants import (
    FLOOR_EXTRAS,
    HIDDEN_VARIANTS,
    LOGITS_VARIANTS,
    floor_variants,
    hidden_variant,
    logits_variant,
    sparse_gradient_variants,
)
from benchmarks.workloads import channels, hidden_inputs, logits_input, support_rows

__all__ = ["Suite", "SECTIONS", "top_ops"]

SECTIONS = ("logits", "small T", "tp", "hidden", "sweeps", "profiles", "host reads", "training")

MiB = 1 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VALIDATION_VARIANTS = ("support", "support-unchecked", "support-nv")


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def top_ops(fn, *, calls: int, top: int) -> dict:
    """``fn()`` ``calls`` times under ``torch.profiler``: wall ms per call (profiler on) and the
    ``top`` operators by self CPU time, each ``(name, self ms per call, share of all self time)``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        wall = (time.perf_counter() - t0) / calls
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    events.sort(key=lambda e: -e.self_cpu_time_total)
    ops = [(e.key, e.self_cpu_time_total / calls / 1e3, e.self_cpu_time_total / total) for e in events[:top]]
    return {"wall_ms": wall * 1e3, "self_ms": total / calls / 1e3, "ops": ops}


class Suite:
    def __init__(self, cfg: dict, rates: Rates, flush: Flusher, *, threads: int, memory: bool, profile: str,
                 training: bool = True):
        self.cfg, self.rates, self.flush = cfg, rates, flush
        self.threads, self.memory, self.profile, self.training = threads, memory, profile, training
        lg, hd = cfg["logits"], cfg["hidden"]
        self.logits_head = (lg["T"], max(lg["V"]), max(lg["k"]))
        self.hidden_head = (hd["T"], max(hd["V"]), max(hd["H"]), max(hd["k"]))
        self.logits_rows: list[dict] = []
        self.logits_train: dict = {}
        self.logits_validation: dict = {}  # round-robin forward of the three support variants
        self.floor_rows: list[dict] = []  # round-robin gather limit / plain scorer / scorer, per configuration
        self.small_T: list[dict] = []  # the same at small T
        self.tp: dict = {}  # the same on two tensor-parallel ranks
        self.hidden_buffers: dict = {}  # round-robin fwd+bwd into .grad / main_grad against a (V, H) fill
        self.profiles: dict = {}  # variant -> top_ops()
        self.hidden_rows: list[dict] = []
        self.hidden_gradient: dict = {}  # round-robin fwd+bwd, dense vs sparse weight gradient
        self.sweep_hidden_T: list[dict] = []
        self.sweep_hidden_V: list[dict] = []
        self.sweep_logits_T: list[dict] = []
        self.host_reads: dict = {}
        self.training_steps: dict = {}
        self.load: dict[str, float] = {}  # 1-minute load average when each section started

    # ------------------------------------------------------------------ measuring

    def _time(self, fn, backward: bool) -> float:
        t0 = time.perf_counter()
        fn(backward)  # warm-up
        first = time.perf_counter() - t0
        repeats = 2 if first > 2.0 else 3 if first > 0.3 else self.cfg["repeats"]
        return median_ms(lambda: fn(backward), repeats=repeats, warmup=0, flush=self.flush)

    def _rounds(self) -> int:
        return max(2 * self.cfg["repeats"], 3)

    def _peak(self, **spec):
        if not self.memory:
            return None
        scope = self.cfg.get("memory_scope")  # None: every variant; else (mode, variant) pairs
        if scope is not None and (spec["mode"], spec["variant"]) not in scope:
            return None
        res = measure_in_subprocess({"threads": self.threads, "dtype": "float32", "model": "zipf", **spec})
        return res.get("peak_bytes", "error: " + res.get("error", "?"))

    # ------------------------------------------------------------------ sections

    def run_all(self, only=None) -> None:
        """Every section in order, or those named in ``only`` (names from :data:`SECTIONS`)."""
        sections = (("logits", self.run_logits), ("small T", self.run_small_T), ("tp", self.run_tp),
                    ("hidden", self.run_hidden), ("sweeps", self.run_hidden_sweeps), ("profiles", self.run_profiles),
                    ("host reads", self.run_host_reads), ("training", self.run_training))
        for name, section in sections:
            if only and name not in only:
                continue
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
                    ch = channels(support_rows(T, V, k), vocab_size=V)
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
                    for extra in self.cfg.get("floor_extras", FLOOR_EXTRAS):
                        self.floor_rows.append({"T": T, "V": V, "k": k, "dtype": dname, "extra": extra,
                                                **self._floor(logits, ch, extra)})
                    if (T, V, k) == self.logits_head and dname == "float32":
                        self._logits_headline(logits, ch)
                if dname == "float32" and V == self.logits_head[1]:
                    self._logits_sweep(base)
                del logits
                gc.collect()
            del base
            gc.collect()

    def _floor(self, logits, ch, extra: str, rounds: int | None = None) -> dict:
        """The gather limit, the plain scorer and the scorer round-robin: name -> {ms, min, max}."""
        fns = floor_variants(logits, ch, extra)
        rounds = rounds or (max(3, self.cfg["repeats"] // 2) if extra == "mass" else self._rounds())
        res = interleaved_ms(fns, rounds=rounds, flush=self.flush)
        gc.collect()
        return res

    def run_small_T(self) -> None:
        V, k = self.logits_head[1], self.logits_head[2]
        for T in self.cfg.get("small_T", ()):
            logits = logits_input(T, V, torch.float32).requires_grad_()
            ch = channels(support_rows(T, V, k), vocab_size=V)
            res = self._floor(logits, ch, "", rounds=self.cfg.get("small_T_rounds", 50))
            self.small_T.append({"T": T, "V": V, "k": k, "dtype": "float32", "extra": "", **res})

    def run_tp(self) -> None:
        from benchmarks.tp import measure_in_subprocess as measure_tp

        spec = self.cfg.get("tp")
        if spec:
            self.tp = {"spec": spec, "rows": measure_tp(spec)}

    def run_profiles(self) -> None:
        """Top operators of the headline variants: where the time goes, so a regression shows where it came from."""
        T, V, k = self.logits_head
        calls, top = self.cfg.get("profile_calls", 10), self.cfg.get("profile_top", 6)
        logits = logits_input(T, V, torch.float32).requires_grad_()
        ch = channels(support_rows(T, V, k), vocab_size=V)
        for extra in ("", "entropy"):
            fns = floor_variants(logits, ch, extra)
            names = ("gather", "plain", "support") if not extra else ("plain", "support")
            for name in names:
                label = f"logits {name}{' +' + extra if extra else ''}, T={T} V={V} k={k} fp32, forward"
                self.profiles[label] = top_ops(fns[name], calls=calls, top=top)
        del logits
        for T_small in self.cfg.get("small_T", ())[:1]:
            small = logits_input(T_small, V, torch.float32).requires_grad_()
            ch = channels(support_rows(T_small, V, k), vocab_size=V)
            fn = floor_variants(small, ch)["support"]
            self.profiles[f"logits support, T={T_small} V={V} k={k} fp32, forward"] = top_ops(fn, calls=5 * calls, top=top)
        Th, Vh, H, kh = self.hidden_head
        hidden, weight = hidden_inputs(Th, Vh, H, torch.float32)
        hidden.requires_grad_(), weight.requires_grad_()
        ch = channels(support_rows(Th, Vh, kh), vocab_size=Vh)
        fns = sparse_gradient_variants(hidden, weight, ch)
        label = f"hidden support-sparse, T={Th} V={Vh} H={H} k={kh} fp32, forward+backward"
        self.profiles[label] = top_ops(fns["support-sparse"], calls=max(1, calls // 2), top=top)
        weight.grad = None
        gc.collect()

    def _logits_headline(self, logits, ch) -> None:
        T, V, k = self.logits_head
        fns = {name: logits_variant(name, logits, ch) for name in VALIDATION_VARIANTS}
        self.logits_validation = interleaved_ms({n: (lambda f=f: f(False)) for n, f in fns.items()},
                                                rounds=self._rounds(), flush=self.flush)
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
            ch = channels(support_rows(T, V, k), vocab_size=V)
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
            "lim_sparse_fwdbwd": limits.hidden_support_sparse_fwdbwd(r, N=T, H=H, P=P, U=U, b=4) * 1e3,
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
                    ch = channels(support_rows(T, V, k), vocab_size=V)
                    row = {"V": V, "H": H, "k": k, "model": "zipf", **self._hidden_limits(ch, T, V, H)}
                    for name in HIDDEN_VARIANTS:
                        if name in ("full", "chunked"):
                            if name not in full:
                                full[name] = self._hidden_measure(name, hidden, weight, ch, T, V, H, k)
                            row[name] = full[name]
                        elif name.startswith("support") or k == max(cfg["k"]):
                            row[name] = self._hidden_measure(name, hidden, weight, ch, T, V, H, k)
                    self.hidden_rows.append(row)
                    if (T, V, H, k) == self.hidden_head:
                        self._hidden_headline(hidden, weight, ch, full)
                weight.grad = None  # the persistent buffer of support-sparse
                del hidden, weight
                gc.collect()

    def _hidden_headline(self, hidden, weight, ch, full) -> None:
        T, V, H, k = self.hidden_head
        fns = {name: hidden_variant(name, hidden, weight, ch) for name in ("support", "support-sparse")}
        self.hidden_gradient = interleaved_ms({n: (lambda f=f: f(True)) for n, f in fns.items()},
                                              rounds=self._rounds(), flush=self.flush)
        self.hidden_buffers = interleaved_ms(sparse_gradient_variants(hidden, weight, ch), rounds=self._rounds(),
                                             flush=self.flush)
        gc.collect()
        if self.cfg.get("uniform_row", True):
            worst = channels(support_rows(T, V, k, model="uniform"), vocab_size=V)
            wrow = {"V": V, "H": H, "k": k, "model": "uniform", **self._hidden_limits(worst, T, V, H)}
            for name in ("support", "support-sparse"):
                wrow[name] = self._hidden_measure(name, hidden, weight, worst, T, V, H, k, "uniform")
            wrow["full"], wrow["chunked"] = full["full"], full["chunked"]
            self.hidden_rows.append(wrow)

    def run_hidden_sweeps(self) -> None:
        T0, V0, H, k = self.hidden_head
        Tmax = max(self.cfg["hidden_T"])
        hidden, weight = hidden_inputs(Tmax, V0, H, torch.float32)
        memory = self.cfg.get("sweep_memory", True)
        for T in self.cfg["hidden_T"]:
            h = hidden[:T].clone().requires_grad_()
            w = weight.detach().requires_grad_()
            ch = channels(support_rows(T, V0, k), vocab_size=V0)
            res = self._hidden_measure("support", h, w, ch, T, V0, H, k, memory=memory)
            self.sweep_hidden_T.append({"T": T, **res, **self._hidden_limits(ch, T, V0, H)})
        h = hidden[:T0].clone().requires_grad_()
        for V in self.cfg["hidden_V"]:
            w = weight.detach()[:V].requires_grad_()
            ch = channels(support_rows(T0, V, k), vocab_size=V)
            res = self._hidden_measure("support", h, w, ch, T0, V, H, k, memory=memory)
            sparse = self._hidden_measure("support-sparse", h, w, ch, T0, V, H, k, memory=memory)
            self.sweep_hidden_V.append({"V": V, **res, "sparse": sparse, **self._hidden_limits(ch, T0, V, H)})
            w.grad = None
            del w
            gc.collect()

    def run_host_reads(self) -> None:
        from benchmarks.syncs import BEFORE, measure

        self.host_reads = {name: dict(r, before=BEFORE.get(name)) for name, r in measure().items()}

    def run_training(self) -> None:
        if not self.training:
            return
        from benchmarks.training import measure_in_subprocess as measure_step

        profile = self.cfg.get("training_profile", "full")
        for trainer in ("hf", "megatron"):
            self.training_steps[trainer] = measure_step(trainer, profile, threads=self.threads)
