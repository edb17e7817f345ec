"""What reading a vLLM response's supports costs per token, by output path.

    python -m benchmarks.capture                  # k = 64, 2048 tokens; prints a markdown table
    python -m benchmarks.capture --tokens 512 --k 20

One response of ``--tokens`` positions at ``top_k = k`` (V = 128k), each position's supports of
8 members on average, its processed log-probs listed as vLLM lists them with
``logprobs = k + 1`` (the sampled token first, then the top ``k + 1`` entries: the members,
then filtered ``-inf`` entries): the offline ``list[dict[int, Logprob]]``, the offline
``FlatLogprobs`` (``SamplingParams(flat_logprobs=True)``), ``/v1/completions``,
``/v1/chat/completions``, ``/inference/v1/generate`` and the sampling mask. Each is timed
(median of 5) through the adapter its users call; the offline dicts also through the
entry-by-entry reader (values as ``{"logprob": ...}`` mappings, the reader every form took
before), the cost the array reader replaced.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.machine import median_ms

__all__ = ["main", "response"]

V = 131072


@dataclass
class _Logprob:
    """The fields of vLLM's ``Logprob`` (vllm/logprobs.py)."""

    logprob: float
    rank: int
    decoded_token: object = None


@dataclass
class _Flat:
    """The fields of vLLM's ``FlatLogprobs`` the adapter reads (vllm/logprobs.py)."""

    start_indices: list
    end_indices: list
    token_ids: list
    logprobs: list


def response(n: int, k: int, seed: int = 0) -> dict:
    """Per position: sampled id, entries [(id, log-prob)] in vLLM's order, and the support."""
    rng = np.random.default_rng(seed)
    sizes = np.minimum(rng.geometric(1 / 8, n), k)
    positions, sampled, supports = [], [], []
    for size in sizes.tolist():
        ids = rng.choice(V, k + 1, replace=False)
        probs = rng.dirichlet(np.ones(size))
        lps = np.full(k + 1, -np.inf)
        lps[:size] = np.sort(np.log(probs))[::-1]
        pick = int(rng.integers(0, size))
        entries = [(int(ids[pick]), float(lps[pick]))] + [(int(t), float(v)) for t, v in zip(ids, lps)]
        positions.append(entries)
        sampled.append(int(ids[pick]))
        supports.append(sorted(int(t) for t in ids[:size]))
    return {"positions": positions, "sampled": sampled, "supports": supports}


def _forms(r: dict) -> dict:
    pos, sampled = r["positions"], r["sampled"]
    dicts = [{t: _Logprob(v, i) for i, (t, v) in enumerate(p)} for p in pos]
    flat_ids = [t for p in pos for t, _ in p]
    starts = np.cumsum([0] + [len(p) for p in pos])
    flat = _Flat(starts[:-1].tolist(), starts[1:].tolist(), flat_ids, [v for p in pos for _, v in p])
    json_lp = lambda v: max(v, -9999.0)  # noqa: E731 - vLLM's JSON clamps -inf
    completions = {"tokens": [f"token_id:{t}" for t in sampled], "token_logprobs": [p[0][1] for p in pos],
                   "top_logprobs": [{f"token_id:{t}": json_lp(v) for t, v in p} for p in pos], "text_offset": []}
    chat = {"content": [{"token": f"token_id:{p[0][0]}", "logprob": p[0][1], "bytes": None,
                         "top_logprobs": [{"token": f"token_id:{t}", "logprob": json_lp(v), "bytes": None} for t, v in p]}
                        for p in pos]}
    generate = {"content": [{"token_id": p[0][0], "logprob": p[0][1], "rank": 1,
                             "top_logprobs": [{"token_id": t, "logprob": json_lp(v), "rank": i} for i, (t, v) in enumerate(p)]}
                            for p in pos]}
    slow = [{t: {"logprob": v} for t, v in p} for p in pos]
    return {"offline dicts": dicts, "offline flat": flat, "completions": completions, "chat": chat,
            "generate": generate, "entry by entry (before)": slow}


def measure(n: int, k: int) -> dict:
    from nemo_replay.rollout.engines.vllm import support_from_vllm_logprobs, support_from_vllm_sampling_mask

    r = response(n, k)
    out = {}
    for name, form in _forms(r).items():
        ids = None if name in ("completions", "chat", "generate") else r["sampled"]
        got = support_from_vllm_logprobs(form, ids, vocab_size=V)
        rows = [sorted(got.support.row(j).tolist()) for j in range(n)]
        assert rows == r["supports"], name  # every path reads the same supports
        out[name] = median_ms(lambda f=form, i=ids: support_from_vllm_logprobs(f, i, vocab_size=V), repeats=5) / 1e3 / n
    mask = [list(s) for s in r["supports"]]
    out["sampling mask"] = median_ms(lambda: support_from_vllm_sampling_mask(mask, r["sampled"], vocab_size=V),
                                     repeats=5) / 1e3 / n
    return out


def server_stall(n: int, k: int) -> dict:
    """verl's vLLM server (``RecordingVllmEngine``) finishing one ``n``-token response: the longest
    gap of a 1 ms ticker on its event loop while the rows are read, off the loop (as it runs) and
    on it (the read called in place, as it ran before)."""
    import asyncio
    import time
    from types import SimpleNamespace

    from nemo_replay.integrations.verl.rollout import RecordingVllmEngine, RolloutReplay, VllmSupportRecorder

    r = response(n, k)
    completion = SimpleNamespace(token_ids=r["sampled"], logprobs=_forms(r)["offline dicts"], sampling_mask=None)
    final = SimpleNamespace(outputs=[completion])
    recorder = VllmSupportRecorder(RolloutReplay(True, k, 1.0, k, 1.0), vocab_size=V)
    params = SimpleNamespace(temperature=1.0, top_k=k, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                             presence_penalty=0.0, frequency_penalty=0.0, logprobs=0, flat_logprobs=False)

    class Engine:
        async def generate(self, *args, **kwargs):
            yield final

    async def gap(read) -> float:
        gaps, done = [0.0], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        await read()
        done.set()
        await task
        return max(gaps)

    async def off_loop():
        async for _ in RecordingVllmEngine(Engine(), recorder, {}).generate(sampling_params=params, request_id="r"):
            pass

    async def on_loop():
        recorder.read(completion, params)

    return {"off the loop": asyncio.run(gap(off_loop)), "on the loop": asyncio.run(gap(on_loop))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--k", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    got = measure(args.tokens, args.k)
    before = got["entry by entry (before)"]
    print(f"| path (k = {args.k}, {args.k + 1} log-probs a token) | us per token | against entry by entry |")
    print("|---|---|---|")
    for name, seconds in got.items():
        print(f"| {name} | {1e6 * seconds:.1f} | {seconds / before:.2f} |")
    stall = server_stall(4096, args.k)
    print()
    print(f"| verl's vLLM server, one 4096-token response at k = {args.k} | longest event-loop gap |")
    print("|---|---|")
    for name, seconds in stall.items():
        print(f"| rows read {name} | {1e3 * seconds:.1f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
