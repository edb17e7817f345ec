"""The main job on a live vLLM, measured step by step (docs/benchmarks.md, "A live vLLM").

    python -m benchmarks.vllm_live                       # in the vLLM environment; writes docs/benchmarks.md
    python -m benchmarks.vllm_live --steps 5 --out /tmp/vllm.md --plot /tmp/vllm.png

Each setting trains ``configs/vllm.yaml`` with replay on, rollouts from ``vllm.LLM`` whose weights
are reloaded from the policy before every rollout. Per step, on the same sampled tokens: the
rollout-trainer log-prob gap with replay (the trainer's recompute over the recorded supports)
and over the full vocabulary (the same scores plus the log support mass), as max, mean and the
share of tokens whose ratio falls outside [0.9, 1.1]; and the time of the weight sync, of vLLM's
generation, and of the capture (the adapter reading every position's processed log-probs, and
the batch), per token and against the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

__all__ = ["main", "SETTINGS"]

#: (name, overrides): the recipe's sampler; top-p 0.8 alone (top_k bounds nothing at V - 1 = 31);
#: the server path; and a larger model (hidden 512, 4 layers: about 15 M parameters, 50x the
#: recipe's 0.3 M), where generation costs more per token and the capture does not.
SETTINGS = [
    ("top_k 8, top_p 0.95", []),
    ("top_p 0.8", ["generation.top_k=31", "generation.top_p=0.8"]),
    ("top_k 8, top_p 0.95, vllm-server", ["generation.engine=vllm-server"]),
    ("top_k 8, top_p 0.95, 15 M parameters", ["model.hidden_size=512", "model.intermediate_size=2048",
                                              "model.num_attention_heads=8", "model.num_key_value_heads=2",
                                              "model.num_layers=4"]),
]
BEGIN, END = "<!-- vllm live: python -m benchmarks.vllm_live -->", "<!-- end of vllm live -->"


def run_setting(overrides: list[str], steps: int, folder: Path) -> dict:
    """Train one setting; its per-step metrics and the engine's per-rollout times."""
    from nemo_replay.trainer import GRPOTrainer
    from nemo_replay.trainer.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "vllm.yaml", overrides=[
        f"trainer.steps={steps}", f"trainer.output_dir={folder}", "trainer.progress_bar=false", "trainer.plot=false",
        "trainer.checkpoint_every=0", *overrides,
    ])
    trainer = GRPOTrainer(cfg)
    result = trainer.fit()
    e = trainer.engine
    return {"history": result.history, "sync": e.sync_seconds, "generate": e.generate_seconds,
            "capture": e.capture_seconds, "tokens": e.tokens}


def _row(name: str, r: dict) -> str:
    h = r["history"]
    col = lambda k: [x[k] for x in h]  # noqa: E731
    steady = slice(1, None) if len(h) > 1 else slice(None)  # step 0 holds vLLM's first-call warm-up
    per_tok = lambda k: sum(r[k][steady]) / sum(r["tokens"][steady]) * 1e6  # noqa: E731  -- microseconds per token
    step = statistics.median(col("step_time_s")[steady])
    return (
        f"| {name} | {len(h)} | {max(col('mismatch_max')):.2g} | {statistics.mean(col('mismatch_mean')):.2g} | "
        f"{100 * statistics.mean(col('ratio_outside_share')):.1f}% | {max(col('full_vocab_mismatch_max')):.3g} | "
        f"{statistics.mean(col('full_vocab_mismatch_mean')):.3g} | {100 * statistics.mean(col('full_vocab_ratio_outside_share')):.1f}% | "
        f"{per_tok('capture'):.1f} / {per_tok('generate'):.0f} = {100 * per_tok('capture') / per_tok('generate'):.1f}% | "
        f"{1e3 * statistics.median(r['sync'][steady]):.1f} / {1e3 * step:.0f} = {100 * statistics.median(r['sync'][steady]) / step:.1f}% |"
    )


def table(results: dict, seconds: float) -> str:
    lines = [
        BEGIN,
        f"Written by `python -m benchmarks.vllm_live` on {time.strftime('%Y-%m-%d %H:%M')} ({seconds:.0f} s), vLLM's CPU build "
        f"({_vllm_version()}), `configs/vllm.yaml` (float32, a tiny Llama, 16 prompts x 8 responses x 6 tokens a step), "
        f"replay on; the full-vocabulary columns score the same tokens over the whole vocabulary (the same forward plus "
        f"the log support mass). Capture: the adapter reading each position's processed log-probs and the batch, "
        f"against vLLM's generation, per token, after step 0 (vLLM's first call warms up). Sync: the weights written "
        f"and reloaded in place, median over steps, against the median step.",
        "",
        "| sampler | steps | replay: max gap | mean gap | ratio outside [0.9, 1.1] | full vocab: max gap | mean gap | "
        "ratio outside [0.9, 1.1] | capture / generation, us per token | sync / step, ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(_row(name, r) for name, r in results.items()),
        "",
        "![per step: the gap with replay and over the full vocabulary, the share of ratios outside [0.9, 1.1], the "
        "time of each part](vllm-live.png)",
        END,
    ]
    return "\n".join(lines)


def _vllm_version() -> str:
    import vllm

    return f"vLLM {vllm.__version__}"


def plot(results: dict, path: Path) -> None:
    """Three panels per step: the max gap, the share outside [0.9, 1.1], the time of each part."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 5.6))
    for (name, r), color in zip(results.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        steps = [x["step"] for x in r["history"]]
        axes[0].semilogy(steps, [x["full_vocab_mismatch_max"] for x in r["history"]], "--", color=color, label=f"{name}: full vocab")
        axes[0].semilogy(steps, [max(x["mismatch_max"], 1e-9) for x in r["history"]], "-", color=color, label=f"{name}: replay")
        axes[1].plot(steps, [100 * x["full_vocab_ratio_outside_share"] for x in r["history"]], "--", color=color, label=f"{name}: full vocab")
        axes[1].plot(steps, [100 * x["ratio_outside_share"] for x in r["history"]], "-", color=color, label=f"{name}: replay")
    first = next(iter(results.values()))
    steps = [x["step"] for x in first["history"]]
    for key, label in (("sync", "weight sync"), ("generate", "vLLM generation"), ("capture", "capture")):
        axes[2].semilogy(steps, [1e3 * t for t in first[key]], label=label)
    axes[2].semilogy(steps, [1e3 * x["step_time_s"] for x in first["history"]], "k:", label="whole step")
    titles = ("max |rollout - trainer| log-prob", "tokens with ratio outside [0.9, 1.1], %", f"ms per step ({next(iter(results))})")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes:  # under each panel: legends never cover a curve
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_section(text: str, out: Path) -> None:
    """Replace the section between the markers in ``out`` (append it when absent)."""
    old = out.read_text() if out.exists() else ""
    if BEGIN in old and END in old:
        new = old[: old.index(BEGIN)] + text + old[old.index(END) + len(END):]
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    out.write_text(new)


def main(argv=None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--plot", type=Path, default=None, help="default: vllm-live.png beside --out")
    args = parser.parse_args(argv)
    start, results = time.perf_counter(), {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(SETTINGS):
            results[name] = run_setting(overrides, args.steps, Path(tmp) / f"run{i}")
    text = table(results, time.perf_counter() - start)
    write_section(text, args.out)
    plot(results, args.plot or args.out.with_name("vllm-live.png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
