"""The markdown report of a benchmark run (the measurements: benchmarks/suite.py)."""

from __future__ import annotations

import time

from benchmarks.report import Table, fmt_mib, fmt_ms, fmt_rate, fmt_ratio
from benchmarks.variants import HIDDEN_VARIANTS

__all__ = ["render"]

MiB = 1 << 20


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def _met(ratio, bound: float, below: bool = True) -> str:
    if ratio is None:
        return "-"
    return "yes" if (ratio <= bound if below else ratio < bound) else "no"


def _floor_label(r) -> str:
    return f"V={r['V']} k={r['k']} {r['dtype']}{' +' + r['extra'] if r['extra'] else ''}"


def _floor_ratio(r, ref: str) -> float:
    """The scorer's fastest round over the reference's (round-robin, so both saw the same load)."""
    return r["support"]["min"] / r[ref]["min"]


def _floor_targets(t: Table, rows: list, where: str) -> None:
    """Worst configuration against the gather limit (without the support mass, whose floor is a
    read of every logit) and against the plain scorer (every configuration)."""
    gathered = [r for r in rows if r["extra"] != "mass"]
    for ref, bound, name, among, what in (
        ("gather", 2.0, "the gather limit", gathered, "configurations without the support mass"),
        ("plain", 0.8, "the plain gather+logsumexp scorer", rows, "configurations"),
    ):
        if not among:
            continue
        worst = max(among, key=lambda r: _floor_ratio(r, ref))
        ratio = _floor_ratio(worst, ref)
        met = sum(_floor_ratio(r, ref) <= bound for r in among)
        best = min(_floor_ratio(r, ref) for r in among)
        t.add(f"logits fwd {where} vs {name}, worst of {len(among)} {what} ({_floor_label(worst)})",
              f"{fmt_ms(worst['support']['min'])} ms", f"{fmt_ms(worst[ref]['min'])} ms", fmt_ratio(ratio),
              f"<= {bound:g}", _met(ratio, bound),
              f"{met} of {len(among)} within the bound (best {fmt_ratio(best)}); table: against its floor")


def _logits_targets(s, t: Table) -> None:
    T = s.logits_head[0]
    _floor_targets(t, s.floor_rows, f"T={T}, one rank,")
    if s.tp.get("rows") and "error" not in s.tp["rows"]:
        _floor_targets(t, _tp_rows(s), f"T={s.tp['spec']['T']}, 2 TP ranks,")
    val = s.logits_validation
    if val:
        ratio = val["support"]["ms"] / val["support-nv"]["ms"]
        t.add(f"logits fwd, default call (rows checked where they entered) vs validate=False, round-robin",
              f"{fmt_ms(val['support']['ms'])} ms", f"{fmt_ms(val['support-nv']['ms'])} ms", fmt_ratio(ratio),
              "<= 1.1", _met(ratio, 1.1),
              f"rows never checked (the default's cost before rows recorded their check): "
              f"{fmt_ms(val['support-unchecked']['ms'])} ms, {fmt_ratio(val['support-unchecked']['ms'] / val['support-nv']['ms'])}x")


def _hidden_targets(s, t: Table) -> None:
    r = s.rates
    T, V, H, k = s.hidden_head
    row = next((x for x in s.hidden_rows if (x["V"], x["H"], x["k"], x["model"]) == (V, H, k, "zipf")), None)
    if not row:
        return
    d = row["support"]
    ratio = d["fwdbwd"] / row["lim_fwdbwd"]
    grad_ms = V * H * 4 / r.fill_bw * 1e3
    fresh_ms = r.fresh_zero_s_per_gib * 1e3 * (V * H * 4) / (1 << 30)
    t.add(f"hidden fwd+bwd T={T} V={V} H={H} k={k} fp32, dense weight gradient, vs limit", f"{fmt_ms(d['fwdbwd'])} ms",
          f"{fmt_ms(row['lim_fwdbwd'])} ms", fmt_ratio(ratio), "<= 2", _met(ratio, 2),
          f"limit: writing the dense weight gradient, {grad_ms:.1f} ms of it; a fresh zeroed tensor that size "
          f"costs {fresh_ms:.0f} ms here (page faults); forward {fmt_ms(d['fwd'])} ms")
    b = s.hidden_buffers
    if b:
        for name, label in (("support-sparse", "a kept .grad"), ("support-main-grad", "megatron's main_grad")):
            ratio = b[name]["min"] / b["fill"]["min"]
            t.add(f"hidden fwd+bwd T={T} V={V} H={H} k={k} fp32 into {label} vs filling the (V, H) buffer, round-robin",
                  f"{fmt_ms(b[name]['min'])} ms", f"{fmt_ms(b['fill']['min'])} ms", fmt_ratio(ratio), "<= 0.7",
                  _met(ratio, 0.7), f"fastest rounds; medians {fmt_ms(b[name]['ms'])} / {fmt_ms(b['fill']['ms'])} ms")
    g = s.hidden_gradient
    if g:
        ratio = g["support-sparse"]["ms"] / g["support"]["ms"]
        t.add("hidden fwd+bwd into a persistent gradient buffer vs a fresh dense gradient (before), round-robin",
              f"{fmt_ms(g['support-sparse']['ms'])} ms", f"{fmt_ms(g['support']['ms'])} ms", fmt_ratio(ratio),
              "<= 0.35", _met(ratio, 0.35),
              f"the sparse limit is {fmt_ms(row['lim_sparse_fwdbwd'])} ms (rows read twice, U buffer rows updated)")
    sp = row.get("support-sparse", {}).get("peak")
    if isinstance(sp, int):
        ratio = sp / (V * H * 4)
        t.add("hidden fwd+bwd peak above the inputs (persistent buffer) vs the weight's size", f"{fmt_mib(sp)} MiB",
              f"{fmt_mib(V * H * 4)} MiB", fmt_ratio(ratio), "<= 0.1", _met(ratio, 0.1),
              "no (V, H) temporary: the U touched rows' sums and the hidden rows in the compute dtype")
    two = row.get("two-proj", {}).get("peak")
    if isinstance(d["peak"], int) and isinstance(two, int):
        ratio = d["peak"] / two
        t.add("hidden training peak, dense gradient, vs two projections + two dense weight grads",
              f"{fmt_mib(d['peak'])} MiB", f"{fmt_mib(two)} MiB", fmt_ratio(ratio), "<= 0.6", _met(ratio, 0.6),
              f"the one dense weight gradient, {V * H * 4 / MiB:.0f} MiB; growth with T x k: Scaling")


def _other_targets(s, t: Table) -> None:
    if s.host_reads:
        worst = max(r["forward"] for r in s.host_reads.values())
        before = max((r["before"][0] for r in s.host_reads.values() if r.get("before")), default=None)
        t.add("host reads per scorer forward (every scenario)", str(worst), "-" if before is None else str(before),
              "-", "1", "yes" if worst == 1 else "no", "all guards and sizes read at once (Host reads)")
    for trainer, res in s.training_steps.items():
        if "error" in res:
            t.add(f"training step ({trainer})", "error", res["error"][:80], "-", "-", "no", "")
            continue
        ms = res["ms"]
        ratio = ms["logits, replay"] / ms["logits, replay off"]
        t.add(f"{trainer} policy step, logits mode: replay vs replay off", f"{fmt_ms(ms['logits, replay'])} ms",
              f"{fmt_ms(ms['logits, replay off'])} ms", fmt_ratio(ratio), "<= 1.02", _met(ratio, 1.02), "")
        ratio = ms["hidden, replay"] / ms["logits, replay off"]
        t.add(f"{trainer} policy step, hidden mode with replay vs the full-vocabulary pass",
              f"{fmt_ms(ms['hidden, replay'])} ms", f"{fmt_ms(ms['logits, replay off'])} ms", fmt_ratio(ratio), "< 1",
              _met(ratio, 1, below=False), f"hidden mode without replay: {fmt_ms(ms['hidden, replay off'])} ms")


def targets(s) -> Table:
    t = Table("Targets", ["target", "measured", "reference", "ratio", "bound", "met", "what dominates"])
    _logits_targets(s, t)
    _hidden_targets(s, t)
    _other_targets(s, t)
    return t


def _machine(s, info: dict, small: dict | None) -> list[str]:
    r = s.rates
    m = Table("Machine", ["item", "value"])
    m.add("CPU", info["cpu"])
    m.add("cores", info["cores"])
    m.add("memory", f"{info['memory_gib']} GiB")
    m.add("last-level cache", f"{info['llc_mib']} MiB")
    m.add("torch", info["torch"])
    m.add("torch threads", info["threads"])
    m.add("OpenMP wait policy", info.get("omp_wait", "unset"))
    m.add("pages", ("transparent huge pages requested (THP_MEM_ALLOC_ENABLE=1)" if info["huge_pages"] else "4 KiB")
          + f"; kernel THP mode `{info['thp_kernel']}`")
    m.add("load average (1, 5, 15 min) at start", ", ".join(f"{x:.2f}" for x in info["load_start"]))
    m.add("load average at end", ", ".join(f"{x:.2f}" for x in info["load_end"]))
    m.add("1-minute load when each section started",
          ", ".join(f"{k} {v:.2f}" for k, v in s.load.items())
          + f" (the run itself adds up to its thread count; more means another process competed for the {info['cores']} cores)")
    rt = Table("Measured rates", ["rate", "this run", "4 KiB pages (separate process)"])
    sm = small if small and "error" not in small else {}
    for key, label, unit in (("read_bw", "read bandwidth", "B/s"), ("fill_bw", "write (fill) bandwidth", "B/s"),
                             ("copy_bw", "copy bandwidth (read+write)", "B/s"),
                             ("gather", "random gather (cold lines)", "lines/s"), ("gemm", "fp32 GEMM", "flop/s")):
        rt.add(label, fmt_rate(getattr(r, key), unit), fmt_rate(sm[key], unit) if key in sm else "-")
    rt.add("fresh zeroed tensor, per GiB", f"{r.fresh_zero_s_per_gib * 1e3:.0f} ms",
           f"{sm['fresh_zero_s_per_gib'] * 1e3:.0f} ms" if "fresh_zero_s_per_gib" in sm else "-")
    return [m.markdown(), rt.markdown()]


def render(s, info: dict, small: dict | None) -> str:
    parts = [
        "# Scorer benchmarks\n",
        f"Written by `{info['command']}` on {time.strftime('%Y-%m-%d %H:%M', time.localtime())} "
        f"({info['seconds']} s). Timing: one process, one warm-up call, then the median of repeats "
        f"(9 for calls under 0.3 s, 3 up to 2 s, 2 beyond), each repetition starting with cold caches "
        f"(a {info.get('flush_mib', 2 * info['llc_mib'])} MiB buffer written first); the ratios a target compares are measured "
        f"round-robin (the variants timed in turn, every round), so load from another process hits both "
        f"sides alike. Forward = a training forward (inputs require grad); forward+backward adds the "
        f"gradient of a weighted sum of the log-probs. Peak memory: a fresh process per variant, "
        f"resident-set high-water mark of forward+backward above the inputs.\n",
    ]
    parts += _machine(s, info, small)
    parts.append(LIMIT_TEXT)
    parts.append(targets(s).markdown())
    parts.append(_logits_tables(s))
    parts.append(_floor_tables(s))
    parts.append(_hidden_tables(s))
    parts.append(_sweep_tables(s))
    parts.append(_host_read_table(s))
    parts.append(_training_table(s))
    parts.append(_profile_tables(s))
    parts.append(READING_TEXT)
    return "\n".join(p for p in parts if p)


def _logits_tables(s) -> str:
    t = Table(
        f"Logits mode, forward, T={s.cfg['logits']['T']}",
        ["V", "k", "dtype", "full ms", "chunked ms", "replay-off ms", "support ms", "support-unchecked ms",
         "support-nv ms", "support x full", "support limit ms", "support x limit", "support-nv x limit", "full limit ms"],
        "full = log_softmax + gather over the vocabulary; chunked = the same in 512-position chunks; "
        "replay-off = score_full_vocabulary; support = score_aligned_support, the default call, on rows "
        "checked where they entered (collation records it); support-unchecked = the same on rows never "
        "checked (the scorer sorts every row; the default's cost before rows recorded their check); "
        "support-nv = validate=False.",
    )
    for r in s.logits_rows:
        t.add(r["V"], r["k"], r["dtype"], fmt_ms(r["full"]), fmt_ms(r["chunked"]), fmt_ms(r["replay-off"]),
              fmt_ms(r["support"]), fmt_ms(r["support-unchecked"]), fmt_ms(r["support-nv"]),
              fmt_ratio(r["support"] / r["full"]), fmt_ms(r["limit"]), fmt_ratio(r["support"] / r["limit"]),
              fmt_ratio(r["support-nv"] / r["limit"]), fmt_ms(r["full_limit"]))
    out = t.markdown()
    if s.logits_validation:
        T, V, k = s.logits_head
        vt = Table(f"Logits mode, the three support calls round-robin, T={T} V={V} k={k} fp32, forward",
                   ["variant", "median ms", "fastest ms", "slowest ms", "x validate=False"])
        nv = s.logits_validation["support-nv"]["ms"]
        for name, v in s.logits_validation.items():
            vt.add(name, fmt_ms(v["ms"]), fmt_ms(v["min"]), fmt_ms(v["max"]), fmt_ratio(v["ms"] / nv))
        out += "\n" + vt.markdown()
    if s.logits_train:
        T, V, k = s.logits_head
        tt = Table(f"Logits mode, training step, T={T} V={V} k={k} fp32",
                   ["variant", "fwd+bwd ms", "x full", "peak MiB", "peak x full"],
                   f"Every variant returns a dense [T, V] logits gradient ({T * V * 4 / MiB:.0f} MiB): the floor "
                   "of any logits-mode backward.")
        f = s.logits_train["full"]
        for name, v in s.logits_train.items():
            peak_ratio = _ratio(v["peak"], f["peak"]) if isinstance(v["peak"], int) and isinstance(f["peak"], int) else None
            tt.add(name, fmt_ms(v["fwdbwd"]), fmt_ratio(v["fwdbwd"] / f["fwdbwd"]), fmt_mib(v["peak"]), fmt_ratio(peak_ratio))
        out += "\n" + tt.markdown()
    return out


def _tp_rows(s) -> list:
    """The TP section's configurations as floor rows (``dtype k extra`` keys)."""
    rows = []
    for key, res in s.tp["rows"].items():
        dtype, k, extra = (key.split(" ", 2) + [""])[:3]
        rows.append({"T": s.tp["spec"]["T"], "V": s.tp["spec"]["V"], "k": int(k), "dtype": dtype, "extra": extra, **res})
    return rows


def _floor_table(title: str, rows: list, note: str, unit: str = "ms") -> str:
    scale = 1e3 if unit == "us" else 1.0
    t = Table(title, ["configuration", f"gather {unit}", f"plain {unit}", f"support {unit}", "support x gather",
                      "support x plain", "plain x gather", "support x gather, medians"], note)
    for r in rows:
        val = lambda name: fmt_ms(r[name]["min"] * scale)  # noqa: E731
        t.add(_floor_label(r), val("gather"), val("plain"), val("support"), fmt_ratio(_floor_ratio(r, "gather")),
              fmt_ratio(_floor_ratio(r, "plain")), fmt_ratio(r["plain"]["min"] / r["gather"]["min"]),
              fmt_ratio(r["support"]["ms"] / r["gather"]["ms"]))
    return t.markdown()


FLOOR_NOTE = ("gather = the bare `torch.gather(logits, 1, ids)` of the (T, k) support ids, int64 and in range "
              "before timing: the random read any support scorer needs (the limit); plain = a plain "
              "gather+logsumexp scorer over the same rows, no checks (benchmarks/variants.py `plain_scores`); "
              "support = score_aligned_support, the default call on rows checked where they entered. The three "
              "round-robin, each call on cold caches; times are the fastest round, ratios of fastest rounds "
              "(last column: of medians). +entropy / +mass: both scorers also return the entropy / the support "
              "mass (which reads every logit of the rows: its floor is the full-row read, not the gather).")


def _floor_tables(s) -> str:
    out = []
    if s.floor_rows:
        out.append(_floor_table(f"Logits mode against its floor, T={s.logits_head[0]}, forward, round-robin",
                                s.floor_rows, FLOOR_NOTE))
    if s.small_T:
        out.append(_floor_table(
            "Logits mode at small T: host overhead against the gather limit, forward, round-robin",
            [dict(r, V=f"{r['V']} T={r['T']}") for r in s.small_T],
            "The same three calls at small T, in microseconds: what is left above the gather is the "
            "scorer's host work (argument checks, plan, guards, the one host read, Python dispatch of each "
            "operation); the profile of the support call at the smallest T is under Profiles.", unit="us"))
    if s.tp.get("rows"):
        spec = s.tp["spec"]
        if "error" in s.tp["rows"]:
            out.append(f"### Tensor parallel\n\nerror: {s.tp['rows']['error']}\n")
        else:
            out.append(_floor_table(
                f"Logits mode against its floor on two tensor-parallel ranks, T={spec['T']} V={spec['V']}, forward",
                _tp_rows(s),
                "Two gloo ranks in spawned processes, one thread each, each holding half the vocabulary "
                "(benchmarks/tp.py): gather = this rank's columns of the support ids; plain = a plain "
                "vocabulary-parallel gather+logsumexp scorer (one MAX and one SUM all-reduce); support = "
                "score_aligned_support(shard=VocabShard.even(V, group)). Lockstep round-robin; a round's time is "
                "the slower rank's."))
    if s.hidden_buffers:
        T, V, H, k = s.hidden_head
        bt = Table(f"Hidden mode, persistent gradient buffers against a (V, H) fill, T={T} V={V} H={H} k={k} fp32, "
                   "forward+backward, round-robin",
                   ["variant", "median ms", "fastest ms", "slowest ms", "x fill (fastest)"],
                   "fill = `buffer.fill_(0)` of a (V, H) float32 buffer (writing it once); support-sparse = the "
                   "scorer's forward+backward with a kept `.grad`; support-main-grad = the same through "
                   "megatron-core's `main_grad` protocol.")
        for name, v in s.hidden_buffers.items():
            bt.add(name, fmt_ms(v["ms"]), fmt_ms(v["min"]), fmt_ms(v["max"]), fmt_ratio(v["min"] / s.hidden_buffers["fill"]["min"]))
        out.append(bt.markdown())
    return "\n".join(out)


def _profile_tables(s) -> str:
    if not s.profiles:
        return ""
    out = ["## Profiles\n",
           "The top operators of each headline variant by self CPU time (`torch.profiler`, several calls, "
           "warm), so a regression shows where it came from. Wall = ms per call with the profiler on; "
           "self = the operators' own CPU time per call, summed over threads.\n"]
    for label, p in s.profiles.items():
        t = Table(f"{label}: wall {fmt_ms(p['wall_ms'])} ms, self CPU {fmt_ms(p['self_ms'])} ms",
                  ["operator", "self ms per call", "share"])
        for name, ms, share in p["ops"]:
            t.add(f"`{name}`", fmt_ms(ms), f"{share:.0%}")
        out.append(t.markdown())
    return "\n".join(out)


def _hidden_tables(s) -> str:
    T = s.cfg["hidden"]["T"]
    t = Table(
        f"Hidden mode, T={T}, fp32",
        ["V", "H", "k", "supports", "distinct ids", "variant", "fwd ms", "fwd+bwd ms", "peak MiB",
         "fwd x full", "fwd+bwd x full", "fwd x limit", "fwd+bwd x limit", "peak x two-proj"],
        "full = matmul + log_softmax + gather; chunked = per 128 positions under activation "
        "checkpointing; two-proj = two separate projections, two dense weight gradients; "
        "support = score_aligned_support(lm_head_weight=...) returning a fresh dense weight gradient; "
        "support-sparse = the same with a persistent weight.grad the backward adds the support's rows "
        "into. Limits: support rows only (see Limit models; support-sparse against its own); "
        "full-vocabulary rows show their own GEMM limit in the fwd x limit columns.",
    )
    for r in s.hidden_rows:
        full = r["full"]
        two = r.get("two-proj", {}).get("peak")
        for name in HIDDEN_VARIANTS:
            if name not in r:
                continue
            v = r[name]
            is_full = name in ("full", "chunked")
            lf = r["full_lim_fwd"] if is_full else r["lim_fwd"]
            lb = r["full_lim_fwdbwd"] if is_full else r["lim_sparse_fwdbwd"] if name == "support-sparse" else r["lim_fwdbwd"]
            peak_ratio = v["peak"] / two if isinstance(v["peak"], int) and isinstance(two, int) else None
            t.add(r["V"], r["H"], r["k"], r["model"], f"{r['U']}/{r['P']}", name, fmt_ms(v["fwd"]),
                  fmt_ms(v["fwdbwd"]), fmt_mib(v["peak"]), fmt_ratio(v["fwd"] / full["fwd"]),
                  fmt_ratio(v["fwdbwd"] / full["fwdbwd"]), fmt_ratio(v["fwd"] / lf), fmt_ratio(v["fwdbwd"] / lb),
                  fmt_ratio(peak_ratio))
    out = t.markdown()
    if s.hidden_gradient:
        T, V, H, k = s.hidden_head
        gt = Table(f"Hidden mode, weight gradient round-robin, T={T} V={V} H={H} k={k} fp32, forward+backward",
                   ["variant", "median ms", "fastest ms", "slowest ms", "x dense"])
        dense = s.hidden_gradient["support"]["ms"]
        for name, v in s.hidden_gradient.items():
            gt.add(name, fmt_ms(v["ms"]), fmt_ms(v["min"]), fmt_ms(v["max"]), fmt_ratio(v["ms"] / dense))
        out += "\n" + gt.markdown()
    return out


def _sweep_tables(s) -> str:
    T0, V0, H, k = s.hidden_head
    out = ["## Scaling\n"]
    wbytes = V0 * H * 4
    t = Table(f"Hidden mode support scoring against T (V={V0} H={H} k={k}, dense weight gradient)",
              ["T", "fwd ms", "fwd ms / T (us)", "fwd+bwd ms", "fwd+bwd x limit", "peak MiB",
               "peak - weight grad, MiB", "per pair, KiB"],
              f"The one dense weight gradient is {wbytes / MiB:.0f} MiB at every T; what grows with T is "
              "the rest, per (position, id) pair.")
    for r in s.sweep_hidden_T:
        extra = r["peak"] - wbytes if isinstance(r["peak"], int) else None
        t.add(r["T"], fmt_ms(r["fwd"]), f"{r['fwd'] / r['T'] * 1e3:.1f}", fmt_ms(r["fwdbwd"]),
              fmt_ratio(r["fwdbwd"] / r["lim_fwdbwd"]), fmt_mib(r["peak"]),
              fmt_mib(extra) if extra is not None else "-",
              f"{extra / r['P'] / 1024:.1f}" if extra is not None else "-")
    out.append(t.markdown())
    t = Table(f"Hidden mode support scoring against V (T={T0} H={H} k={k})",
              ["V", "fwd ms", "fwd x limit", "fwd+bwd ms (dense)", "fwd+bwd x limit", "fwd+bwd ms (sparse)",
               "sparse x limit", "weight grad MiB", "peak MiB (dense)", "peak MiB (sparse)"],
              "The forward reads only the support's rows: flat in V. A dense weight gradient writes all "
              "(V, H) of it, so forward+backward and peak memory grow with V through that one tensor; "
              "into a persistent buffer (sparse) only the support's rows are written: flat in V.")
    for r in s.sweep_hidden_V:
        sp = r["sparse"]
        t.add(r["V"], fmt_ms(r["fwd"]), fmt_ratio(r["fwd"] / r["lim_fwd"]), fmt_ms(r["fwdbwd"]),
              fmt_ratio(r["fwdbwd"] / r["lim_fwdbwd"]), fmt_ms(sp["fwdbwd"]),
              fmt_ratio(sp["fwdbwd"] / r["lim_sparse_fwdbwd"]), fmt_mib(r["V"] * H * 4), fmt_mib(r["peak"]),
              fmt_mib(sp["peak"]))
    out.append(t.markdown())
    T, V, k = s.logits_head
    t = Table(f"Logits mode support scoring against T (V={V} k={k} fp32, forward)",
              ["T", "fwd ms", "fwd ms / T (us)", "limit ms", "x limit"])
    for r in s.sweep_logits_T:
        t.add(r["T"], fmt_ms(r["fwd"]), f"{r['fwd'] / r['T'] * 1e3:.2f}", fmt_ms(r["limit"]), fmt_ratio(r["fwd"] / r["limit"]))
    out.append(t.markdown())
    return "\n".join(out)


def _host_read_table(s) -> str:
    if not s.host_reads:
        return ""
    t = Table("Host reads per scorer call", ["call", "forward", "forward before", "backward", "backward before", "where (forward)"],
              "Counted by benchmarks/syncs.py (`python -m benchmarks.syncs`): explicit device reads and "
              "operations whose output size depends on the data, each of which makes the CPU wait for a "
              "GPU. Before = the scorer at commit c409b38, the same scenarios and counter.")
    for name, r in s.host_reads.items():
        before = r.get("before") or ("-", "-")
        t.add(name, r["forward"], before[0], r["backward"], before[1], "; ".join(sorted(r["where"])))
    return t.markdown()


def _training_table(s) -> str:
    if not s.training_steps:
        return ""
    t = Table("Training step: the policy pass with replay against the same pass without",
              ["model", "tokens", "variant", "median ms", "fastest ms", "slowest ms", "x logits replay off"],
              "One policy step = every micro-batch's forward, scoring, clipped objective and backward "
              "through the whole model (benchmarks/training.py); the four variants round-robin in a fresh "
              "process per model; gradients set to None before each step.")
    names = {"hf": "reference trainer (Llama, fsdp strategy)", "megatron": "megatron-core GPTModel"}
    for trainer, res in s.training_steps.items():
        if "error" in res:
            t.add(names[trainer], "-", "error: " + res["error"][:100], "-", "-", "-", "-")
            continue
        base = res["ms"]["logits, replay off"]
        for variant, ms in res["ms"].items():
            lo, hi = res["spread"][variant]
            t.add(names[trainer], res["tokens"], variant, fmt_ms(ms), fmt_ms(lo), fmt_ms(hi), fmt_ratio(ms / base))
    return t.markdown()


LIMIT_TEXT = """### Limit models

Each limit is the time the bytes that must move and the flops that must run take at the
rates above (P present pairs, U distinct ids among them, N positions, b bytes per element):

- logits, support forward: `P / gather + 4 P / read_bw` (P random cache lines, plus the rows);
  the floor tables also time the bare `torch.gather(logits, 1, ids)` of the same P ids beside
  each call (the gather limit: what the device offers for that read, measured, not modelled);
- logits, full forward: `N V b / read_bw` (every logit read once);
- hidden, support forward: `max((U + N) H b / read_bw, 2 P H / gemm)`;
- hidden, support forward+backward: `max((2U + 2N) H b / read_bw + V H b / fill_bw, 6 P H / gemm)`
  (the weight rows read twice, and a dense (V, H) weight gradient written once);
- hidden, support forward+backward into a persistent gradient buffer:
  `max((2U + 2N) H b / read_bw + 2 U H b / copy_bw, 6 P H / gemm)` (only the U touched rows updated);
- hidden, full: `max(2 N V H / gemm, V H b / read_bw)` forward, three GEMMs with the backward.

Page faults of fresh allocations are not in any limit; the "fresh zeroed tensor" row
shows what they cost here.
"""

READING_TEXT = """## Reading the numbers

- Logits mode's floor is one random gather of P floats from the logits (the gather limit
  of the floor tables). A plain gather+logsumexp scorer adds a few passes over the
  (positions, k) scores and checks nothing. The scorer adds, before its gather, the passes
  of its plan over the (positions, k) integer rows: each position's row read, the sampled
  id's membership, the id range, the count of absent entries, the rows' fingerprint, the
  synthetic-EOS sort, all read in one host read (docs/design.md §4); and after it the same
  float passes as the plain scorer. The profiles name those operators; at small T the
  per-operator dispatch of both dominates. A fused pass compiled with `torch.compile`
  (gather, max, exp-sum and normalise in one kernel) was measured on this machine against
  the eager passes it would replace (T=4096, V=128k, k=64, two threads, fastest of 21
  rounds): float32 3.42 against 3.84 ms (0.4 ms, 5% of a call), bfloat16 5.42 against
  4.61 ms (slower), after 7 to 49 s of compilation per process; the scorer keeps the eager
  passes.
- Rows that were checked where they entered skip the row validation (a sort of every row);
  rows never checked pay it once, on the first call that sees them. The full-vocabulary
  paths stream every logit, so their cost grows with V while support scoring's does not.
  The support mass reads every logit of the scored rows too (one logsumexp per block of
  rows), so with it a call costs about a full-vocabulary pass.
- Hidden mode reads only the rows the supports name; a forward is a few milliseconds at
  every V. With a fresh dense weight gradient, writing that one (V, H) tensor (plus the
  page faults of a fresh allocation) dominates forward+backward and the peak memory; with
  a persistent gradient buffer (megatron's main_grad, or .grad kept between micro-batches)
  only the support's rows are written, and neither grows with V. Into a buffer, the
  backward reads each pair's weight row for the hidden-state gradient, sums each distinct
  id's hidden rows block by block and adds the block to the buffer's rows (a
  read-modify-write of U rows, near the memory bandwidth); the forward reads each pair's
  weight row once more.
- Huge pages matter on this machine: with 4 KiB pages every random logit read is a TLB
  miss as well as a cache miss, and every fresh 4 KiB page of a new gradient is a page fault
  (compare the two columns of the rates table).
"""
