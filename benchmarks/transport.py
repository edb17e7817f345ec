"""What support rows cost to carry: bytes per token by form, against the information limit.

    python -m benchmarks.transport                  # about a minute; prints the markdown tables
    python -m benchmarks.transport --tokens 1024    # smaller sets

Row sets (``top_k = 64``):

- ``zipf``: top-k 64 + top-p 0.95 supports captured (``capture.sample``) from Zipf logits
  ``z_r = -s log r`` over V = 128k, ``s`` drawn per token so that the sizes come near what
  prime-rl measured on H200 (mean ~8, median 2, ~45% singletons); each support's ranks are
  then given distinct ids drawn uniformly from V (no clustering of ids to exploit);
- ``tiny llama``: top-k 64 + top-p 0.95 supports captured from the logits of a Llama built
  from a config (random weights, V = 32000) on random prompts: a real softmax;
- ``full k=64``: rows of 64 distinct uniform ids, V = 128k (the widest row a request makes).

Forms, in bytes per token: ``fixed int32`` (``k`` int32 ids, -1 padded: the in-memory
``PackedTensor``), ``base64 int32`` (the same in the JSON envelopes of the wire),
``ids+count int32`` (the members and a count per token: prime-rl's form), ``codec``
(``support/codec/``, the sampled ids dropped, headers included), and the ``limit``:
per row ``log2 C(V - 1, n - 1)`` bits for the ids plus the length's entropy over the set.
Then the wire: generate responses of 256 tokens (and one of the whole set) as the server
writes them, in the JSON body servers sent before (base64 envelopes, int64 ``output_ids``)
and in the binary body (docs/transport.md): the bytes the rows add to a body, and the whole
body, against their limits (the rows' limit; for the body, that plus ``log2 V`` bits a token
id and the 4 bytes of a float32 log-prob).
Then encode and decode rates, decoding a micro-batch (on the host, and at the scorer's entry
from one buffer a sample) against the scorer's forward over the same rows (logits mode,
V = 128k; hidden mode), the forward from compact rows against the one from fixed rows, and the pickle size (what Ray ships) of a NeMo-RL
``BatchedDataDict`` and a verl ``DataProto`` holding the rows, each where importable.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import torch

from benchmarks.machine import median_ms

__all__ = ["main", "row_sets", "sizes", "wire_sizes"]

K = 64
V_LARGE = 131072
HIDDEN = 1024
NEMO_RL_SRC = Path(os.environ.get("NEMO_RL_SRC", Path(__file__).resolve().parents[2] / "shared" / "nemo-rl-7ea279a"))


def _capture(logits: torch.Tensor, gen) -> tuple[list, list]:
    from nemo_replay import capture

    r = capture.sample(logits, temperature=1.0, top_k=K, top_p=0.95, generator=gen)
    vals = r.support.to_padded().values
    return [row[row >= 0].tolist() for row in vals], r.ids.tolist()


def _zipf(n: int, seed: int) -> tuple:
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    log_rank = torch.arange(1, V_LARGE + 1, dtype=torch.float32).log()
    s = np.where(rng.random(n) < 0.45, rng.uniform(5, 8, n), rng.uniform(0.9, 4.2, n))
    rows, sampled = [], []
    for i in range(0, n, 256):
        ranks, picks = _capture(-torch.tensor(s[i:i + 256], dtype=torch.float32)[:, None] * log_rank[None], gen)
        for r, pick in zip(ranks, picks):
            ids = rng.choice(V_LARGE, len(r), replace=False)
            rows.append(ids.tolist())
            sampled.append(int(ids[r.index(pick)]))
    return rows, sampled, V_LARGE


def _tiny_llama(n: int, seed: int) -> tuple:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    rows, sampled = [], []
    with torch.no_grad():
        while len(rows) < n:
            prompts = torch.randint(0, 32000, (8, 64), generator=gen)
            logits = model(prompts).logits.reshape(-1, 32000).float()
            r, s = _capture(logits, gen)
            rows += r
            sampled += s
    return rows[:n], sampled[:n], 32000


def _full(n: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    rows = [rng.choice(V_LARGE, K, replace=False).tolist() for _ in range(n)]
    return rows, [r[int(rng.integers(0, K))] for r in rows], V_LARGE


def row_sets(n: int) -> dict:
    return {"zipf": _zipf(n, 0), "tiny llama": _tiny_llama(n, 1), "full k=64": _full(n, 2)}


def _support(rows):
    from nemo_replay.support.ragged import RaggedSupport

    return RaggedSupport.from_rows([rows])


def _limit_bits(lengths: np.ndarray, V: int) -> float:
    ids = sum(math.lgamma(V) - math.lgamma(n) - math.lgamma(V - n + 1) for n in lengths.tolist() if n) / math.log(2)
    _, counts = np.unique(lengths, return_counts=True)
    p = counts / counts.sum()
    return ids + len(lengths) * float(-(p * np.log2(p)).sum())


def _rate(fn, items: int, repeats: int = 5) -> float:
    return items / (median_ms(fn, repeats=repeats) / 1e3)


def sizes(rows, sampled, V) -> dict:
    from nemo_replay.support.codec import decode_support, encode_support

    n = len(rows)
    lengths = np.array([len(r) for r in rows])
    support, ids = _support(rows), torch.tensor(sampled)
    buf = encode_support(support, vocab_size=V, sampled_ids=ids)
    return {
        "tokens": n, "V": V, "mean": float(lengths.mean()), "median": float(np.median(lengths)),
        "singletons": float((lengths == 1).mean()),
        "fixed int32": 4 * K, "base64 int32": 4 * math.ceil(4 * K / 3), "ids+count int32": 4 * (float(lengths.mean()) + 1),
        "codec": len(buf) / n, "limit": _limit_bits(lengths, V) / 8 / n,
        "encode tok/s": _rate(lambda: encode_support(support, vocab_size=V, sampled_ids=ids), n),
        "decode tok/s": _rate(lambda: decode_support(buf, sampled_ids=ids), n),
    }


def wire_sizes(rows, sampled, V, response_tokens: int = 256) -> dict:
    """Bytes per token of the generate responses that carry the set, ``response_tokens`` tokens each.

    Each response is ``response_body``'s, as the server writes it, in either body form: ``json``
    as servers wrote it before (int64 ``output_ids``, null routes), ``binary`` as they write it
    now. ``rows ...``: the bytes the support adds to a body (the body less the same body
    without it); ``response ...``: whole bodies. ``rows limit``: the set's limit (module doc);
    ``response limit``: that plus ``log2 V`` bits a token id and 4 bytes a float32 log-prob.
    """
    from nemo_replay.rollout.transport.binary import dumps_binary
    from nemo_replay.rollout.transport.server import response_body
    from nemo_replay.rollout.transport.wire import dumps

    n = len(rows)
    logprobs = -torch.rand(n, generator=torch.Generator().manual_seed(0))
    got = dict.fromkeys(("rows json", "rows binary", "response json", "response binary"), 0)
    for a in range(0, n, response_tokens):
        ids = torch.tensor(sampled[a:a + response_tokens])
        now = response_body(ids, logprobs[a:a + response_tokens], _support(rows[a:a + response_tokens]), vocab_size=V,
                            finish_reason="length")
        before = dict(now, output_ids=ids.to(torch.int64), routes=None, routes_start=None)
        for form, body, dump in (("json", before, dumps), ("binary", now, dumps_binary)):
            whole, bare = len(dump(body)), len(dump({k: v for k, v in body.items() if k != "support"}))
            got[f"rows {form}"] += whole - bare
            got[f"response {form}"] += whole
    rows_limit = _limit_bits(np.array([len(r) for r in rows]), V) / 8 / n
    return {**{k: v / n for k, v in got.items()}, "tokens": n, "response tokens": min(response_tokens, n),
            "rows limit": rows_limit, "response limit": rows_limit + math.log2(V) / 8 + 4}


def decode_vs_scorer(rows, sampled, V, micro: int, buffers: int = 8) -> dict:
    """Decoding one micro-batch's rows against the scorer's forward on them.

    ``decode_s``: one buffer decoded and checked on the host (``decode_support``, what the wire
    and the rollout side run). ``entry_s``: the micro-batch as ``buffers`` buffers (one a sample,
    as NeMo-RL's and verl's batches hand them), headers checked and decoded at the scorer's entry
    (``CompactRows(...).decode``), its checks left as the device flag the scorer reads.
    ``scorer_s`` / ``compact_s``: the logits-mode forward from the fixed rows / from the compact
    rows (decode included); ``hidden_s``: the hidden-mode forward from the fixed rows.
    """
    from nemo_replay.scoring.scorer import score_aligned_support
    from nemo_replay.support.codec import CompactRows, decode_support, encode_support

    rows, sampled = rows[:micro], torch.tensor(sampled[:micro])
    support = _support(rows)
    buf = encode_support(support, vocab_size=V, sampled_ids=sampled)
    decode = 1 / _rate(lambda: decode_support(buf, sampled_ids=sampled), 1)
    cut = np.linspace(0, micro, buffers + 1).astype(int)
    parts = [encode_support(_support(rows[a:b]), vocab_size=V, sampled_ids=sampled[a:b]) for a, b in zip(cut, cut[1:])]
    compact = lambda: CompactRows(parts, sampled_ids=sampled)  # noqa: E731
    entry = 1 / _rate(lambda: compact().decode("cpu"), 1)
    g = torch.Generator().manual_seed(0)
    rows_t, loss = torch.arange(micro), torch.ones(micro, dtype=torch.bool)
    padded = decode_support(buf, sampled_ids=sampled).to_padded()  # sorted rows as wide as the widest, as decoded
    logits = torch.randn(micro, V, generator=g)
    score = 1 / _rate(lambda: score_aligned_support(logits, sampled, rows_t, loss, padded), 1, repeats=3)
    from_compact = 1 / _rate(lambda: score_aligned_support(logits, sampled, rows_t, loss, compact()), 1, repeats=3)
    same = score_aligned_support(logits, sampled, rows_t, loss, compact()).logprobs
    assert torch.equal(same, score_aligned_support(logits, sampled, rows_t, loss, padded).logprobs)
    del logits
    hidden, weight = torch.randn(micro, HIDDEN, generator=g), torch.randn(V, HIDDEN, generator=g) / HIDDEN**0.5
    project = 1 / _rate(lambda: score_aligned_support(hidden, sampled, rows_t, loss, padded, lm_head_weight=weight), 1,
                        repeats=3)
    return {"micro": micro, "decode_s": decode, "entry_s": entry, "scorer_s": score, "compact_s": from_compact,
            "hidden_s": project}


def policy_step(rows, sampled, V, micro: int, buffers: int = 8, rounds: int = 5) -> dict:
    """One policy step (forward, scorer, backward) of a Llama built from a config (2 layers, hidden 64,
    V = 32000) on ``micro`` positions, from fixed rows against from compact rows decoded at the entry.

    Rows: the ``tiny llama`` set (that model's own top-k / top-p supports), ``buffers`` buffers of one
    sample each; the fixed rows are the ones the buffers decode to (same member order).
    """
    import transformers

    from nemo_replay.scoring.entry import ScorerChannels, score_positions
    from nemo_replay.support.codec import CompactRows, decode_batch, encode_support

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config)
    rows, sampled = rows[:micro], torch.tensor(sampled[:micro])
    cut = np.linspace(0, micro, buffers + 1).astype(int)
    parts = [encode_support(_support(rows[a:b]), vocab_size=V, sampled_ids=sampled[a:b]) for a, b in zip(cut, cut[1:])]
    fixed = decode_batch(parts, sampled_ids=sampled).to_padded()
    ids = torch.randint(0, V, (buffers, micro // buffers + 1), generator=torch.Generator().manual_seed(1))
    ch = ScorerChannels(sampled, torch.arange(micro), torch.ones(micro, dtype=torch.bool), torch.zeros(micro, dtype=torch.int64))

    def step(support):
        model.zero_grad(set_to_none=True)
        logits = model(ids).logits[:, :-1].reshape(-1, V)
        scores = score_positions(logits, ch, support())
        (-scores.logprobs.mean()).backward()
        return scores.logprobs.detach()

    assert torch.equal(step(lambda: fixed), step(lambda: CompactRows(parts, sampled_ids=sampled)))
    times = {"fixed": [], "compact": []}
    for _ in range(rounds):  # round-robin, so a slower stretch of the machine hits both
        for name, make in (("fixed", lambda: fixed), ("compact", lambda: CompactRows(parts, sampled_ids=sampled))):
            times[name].append(median_ms(lambda: step(make), repeats=1, warmup=0))
    return {"micro": micro, "fixed_ms": float(np.median(times["fixed"])), "compact_ms": float(np.median(times["compact"]))}


def batch_pickles(rows, sampled, V) -> dict:
    """Pickled sizes of a batch of 8 responses whose rows are token-aligned int32 ``(B, S, k)``
    (prompt positions -1, as NeMo-RL carried ``generation_support``; verl's ``(B, R, k)`` holds
    response positions only) against one compact entry per response (NeMo-RL: the
    ``SampleRows`` its data path ships; verl: the buffer column its agent loop ships)."""
    B, P, R = 8, 256, len(rows) // 8
    fixed = torch.full((B, P + R, K), -1, dtype=torch.int32)
    for i in range(B):
        for j, r in enumerate(rows[i * R:(i + 1) * R]):
            fixed[i, P + j, : len(r)] = torch.tensor(r, dtype=torch.int32)
    out = {}
    if NEMO_RL_SRC.is_dir():
        sys.path.insert(0, str(NEMO_RL_SRC))
        try:
            from nemo_rl.distributed.batched_data_dict import BatchedDataDict

            from nemo_replay.support.rows import SampleRows

            # What the replay data path ships: one SampleRows a sample, its rows after the prompt's columns.
            entries = [
                SampleRows.encode(fixed[i, P:], torch.tensor(sampled[i * R:(i + 1) * R]), start=P)
                for i in range(B)
            ]
            out["NeMo-RL BatchedDataDict"] = (
                len(pickle.dumps(BatchedDataDict({"generation_support": fixed}))),
                len(pickle.dumps(BatchedDataDict({"generation_support": entries}))),
            )
        except ImportError as exc:
            out["NeMo-RL BatchedDataDict"] = f"not importable ({exc})"
    try:
        from verl import DataProto

        from nemo_replay.integrations.verl.response_rows import encode_response_rows, object_column
        from nemo_replay.support.rows import SampleRows

        # What replay's agent loop ships: one buffer a sample, the server's buffer of its one turn with each
        # row's response position (SampleRows.to_bytes).
        holder = object_column([
            SampleRows.whole(encode_response_rows(fixed[i, P:], sampled[i * R:(i + 1) * R]), R).to_bytes()
            for i in range(B)
        ])
        out["verl DataProto"] = (
            len(pickle.dumps(DataProto.from_dict(tensors={"generation_support": fixed[:, P:].contiguous()}))),
            len(pickle.dumps(DataProto.from_dict(tensors={"responses": torch.zeros(B, R, dtype=torch.int64)},
                                                 non_tensors={"generation_support": holder})))
            - len(pickle.dumps(DataProto.from_dict(tensors={"responses": torch.zeros(B, R, dtype=torch.int64)}))),
        )
    except ImportError:
        out["verl DataProto"] = "verl is not installed in this environment (run it with verl's: README)"
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    sets = row_sets(args.tokens)
    print("| set | tokens | V | mean / median size | singletons | fixed int32 | base64 int32 | ids+count int32 | codec | "
          "limit | codec / ids+count | codec / limit | encode | decode |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (rows, sampled, V) in sets.items():
        r = sizes(rows, sampled, V)
        print(f"| {name} | {r['tokens']} | {V} | {r['mean']:.1f} / {r['median']:.0f} | {100 * r['singletons']:.0f}% | "
              f"{r['fixed int32']:.0f} | {r['base64 int32']:.0f} | {r['ids+count int32']:.1f} | {r['codec']:.2f} | "
              f"{r['limit']:.2f} | {r['codec'] / r['ids+count int32']:.3f} | {r['codec'] / r['limit']:.3f} | "
              f"{r['encode tok/s'] / 1e6:.2f} M tok/s | {r['decode tok/s'] / 1e6:.2f} M tok/s |", flush=True)
    print()
    print("| set | tokens a response | rows, JSON (before) | rows, binary (now) | rows limit | JSON / limit | "
          "binary / limit | response, JSON (before) | response, binary (now) | response limit | JSON / limit | "
          "binary / limit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (rows, sampled, V) in sets.items():
        for response_tokens in sorted({256, args.tokens}):
            w = wire_sizes(rows, sampled, V, response_tokens)
            print(f"| {name} | {w['response tokens']} | " + " | ".join(
                f"{w[f'{what} json']:.2f} | {w[f'{what} binary']:.2f} | {w[f'{what} limit']:.2f} | "
                f"{w[f'{what} json'] / w[f'{what} limit']:.3f} | {w[f'{what} binary'] / w[f'{what} limit']:.3f}"
                for what in ("rows", "response")) + " |", flush=True)
    print()
    print(f"| set | micro-batch | decode, host (1 buffer) | decode at the entry (8 buffers) | scorer forward, logits "
          f"(V = 128k) | entry decode / it | forward from compact / from fixed rows | scorer forward, hidden "
          f"(H = {HIDDEN}) | entry decode / it |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("zipf", "full k=64"):
        rows, sampled, V = sets[name]
        d = decode_vs_scorer(rows, sampled, V, args.micro)
        print(f"| {name} | {d['micro']} | {1e3 * d['decode_s']:.2f} ms | {1e3 * d['entry_s']:.2f} ms | "
              f"{1e3 * d['scorer_s']:.1f} ms | {d['entry_s'] / d['scorer_s']:.2f} | {d['compact_s'] / d['scorer_s']:.2f} | "
              f"{1e3 * d['hidden_s']:.1f} ms | {d['entry_s'] / d['hidden_s']:.2f} |", flush=True)
    print()
    print("| policy step (Llama from a config, 2 layers, V = 32000, tiny llama rows) | micro-batch | from fixed rows | "
          "from compact rows (decoded at the entry) | ratio |")
    print("|---|---|---|---|---|")
    p = policy_step(*sets["tiny llama"], args.micro)
    print(f"| forward, scorer, backward | {p['micro']} | {p['fixed_ms']:.1f} ms | {p['compact_ms']:.1f} ms | "
          f"{p['compact_ms'] / p['fixed_ms']:.2f} |", flush=True)
    print()
    print("| batch (8 x 256 prompt + responses, zipf rows) | token-aligned int32 rows | compact | ratio |")
    print("|---|---|---|---|")
    for name, got in batch_pickles(*sets["zipf"]).items():
        if isinstance(got, str):
            print(f"| {name} | {got} | | |")
        else:
            print(f"| {name} | {got[0]:,} B | {got[1]:,} B | {got[0] / got[1]:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
