"""The benchmark run: every section of the table, measured in one process (report: benchmarks/render.py).

Sections (sizes from the profile in benchmarks/run.py):
    logits     forward of full / chunked / replay-off / support / support-unchecked /
               support-nv per (V, k, dtype), T fixed; the headline configuration also
               forward + backward and peak memory, and the three support variants again
               round-robin (the validation target)
    hidden     forward and forward + backward of full / chunked / two-proj / support /
               support-sparse per (V, H, k), T fixed, and peak memory; the headline
               configuration again with uniform (non-overlapping) supports, and dense
               against sparse weight gradient round-robin (the gradient target)
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
from benchmarks.variants import HIDDEN_VARIANTS, LOGITS_VARIANTS, hidden_variant, logits_variant
from benchmarks.workloads import channels, hidden_inputs, logits_input, support_rows

__all__ = ["Suite"]

MiB = 1 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VALIDATION_VARIANTS = ("support", "support-unchecked", "support-nv")


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


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

    def run_all(self) -> None:
        sections = (("logits", self.run_logits), ("hidden", self.run_hidden), ("sweeps", self.run_hidden_sweeps),
                    ("host reads", self.run_host_reads), ("training", self.run_training))
        for name, section in sections:
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
