"""The logits forward against its floor under tensor parallelism: two gloo ranks, one thread each.

    python -m benchmarks.tp '{"T": 4096, "V": 131072, "k": [64], "dtypes": ["float32"], "extras": [""], "rounds": 9}'

prints one JSON line. Each rank holds half of the vocabulary (``VocabShard.even``) and
times, round-robin and in lockstep (a barrier before every call, so both ranks start
together and a collective never waits for a late peer):

    gather   the bare ``torch.gather`` of this rank's columns of the support ids (other ranks'
             ids clamped to an edge column, as the scorer reads them), built before timing
    plain    a plain vocabulary-parallel gather+logsumexp scorer (:func:`plain_tp`): local
             gather, -inf where another rank holds the id, MAX all-reduce of the row maxima,
             SUM all-reduce of the exp-sums and the sampled scores (and the extras' terms)
    support  ``score_aligned_support(..., shard=VocabShard.even(V, group))``

A round's time is the slower rank's (the step waits for it). Ranks run in spawned
processes with a free port picked at run time.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time

__all__ = ["measure_in_subprocess", "plain_tp"]


def _sum_over_ranks():
    import torch
    import torch.distributed as dist

    class SumOverRanks(torch.autograd.Function):
        """SUM all-reduce of partial sums; backward identity (each rank's part enters the total once)."""

        @staticmethod
        def forward(ctx, x, group):
            out = x.clone()
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    return SumOverRanks


def plain_tp(logits, ch, shard, *, entropy: bool = False, mass: bool = False):
    """(logp, entropy or None, log support mass or None), (N,) float32, on this rank's shard ``logits`` (N, V_local).

    The straightforward vocabulary-parallel version of ``benchmarks.variants.plain_scores``
    (Megatron's vocab-parallel cross-entropy, restricted to the support): no checks.
    """
    import torch
    import torch.distributed as dist

    _SumOverRanks = _sum_over_ranks()
    v_local = logits.shape[1]
    rows = ch.rows.index_select(0, ch.row_ids).long()
    held = (rows >= shard.start) & (rows < shard.end)
    z = torch.gather(logits, 1, (rows - shard.start).clamp(0, v_local - 1)).float().masked_fill(~held, float("-inf"))
    m = z.detach().amax(1)
    lse_full = torch.logsumexp(logits.detach().float(), 1) if mass else None
    maxima = torch.cat([m, lse_full]) if mass else m.clone()
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=shard.group)
    m = maxima[: m.numel()]
    s_id = ch.sampled - shard.start
    own = (s_id >= 0) & (s_id < v_local)
    zs = torch.gather(logits, 1, s_id.clamp(0, v_local - 1)[:, None]).squeeze(1).float()
    parts = [torch.exp(z - m[:, None]).sum(1), torch.where(own, zs, torch.zeros_like(zs))]
    if entropy:
        e = torch.exp(z - m[:, None])
        parts.append((e * (z - m[:, None]).masked_fill(~held, 0)).sum(1))
    if mass:
        parts.append(torch.exp(lse_full - maxima[m.numel() :]))
    sums = _SumOverRanks.apply(torch.stack(parts), shard.group)
    log_s = torch.log(sums[0])
    logp = sums[1] - m - log_s
    ent = (log_s - sums[2] / sums[0]) if entropy else None
    logmass = (m + log_s - maxima[m.numel() :] - torch.log(sums[-1])).detach() if mass else None
    return logp, ent, logmass


def _rank(rank: int, port: int, spec: dict, out) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.variants import floor_variants
    from benchmarks.workloads import channels, logits_input, support_rows
    from nemo_replay.scoring.shard import VocabShard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    T, V = spec["T"], spec["V"]
    shard = VocabShard.even(V, dist.group.WORLD)
    res = {}
    for dname in spec["dtypes"]:
        logits = logits_input(T, shard.size, getattr(torch, dname), seed=2 + rank).requires_grad_()
        for k in spec["k"]:
            ch = channels(support_rows(T, V, k), vocab_size=V)
            for extra in spec["extras"]:
                plain = (lambda e=extra: plain_tp(logits, ch, shard, entropy=e == "entropy", mass=e == "mass"))
                fns = floor_variants(logits, ch, extra, shard=shard, plain=plain)
                times = {n: [] for n in fns}
                for r in range(spec["rounds"] + 1):  # round 0 warms up
                    for name, fn in fns.items():
                        dist.barrier()
                        t0 = time.perf_counter()
                        fn()
                        if r:
                            times[name].append(time.perf_counter() - t0)
                mine = torch.tensor([times[n] for n in fns], dtype=torch.float64)
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # a round's time is the slower rank's
                res[f"{dname} {k} {extra}"] = {
                    n: {"ms": statistics.median(t) * 1e3, "min": min(t) * 1e3, "times": [x * 1e3 for x in t]}
                    for n, t in zip(fns, mine.tolist())
                }
    if rank == 0:
        out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(spec: dict) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, spec, out)) for r in range(2)]
    for p in procs:
        p.start()
    res = out.get(timeout=spec.get("timeout", 1200))
    for p in procs:
        p.join()
    return res


def measure_in_subprocess(spec: dict, *, timeout: float = 1800.0) -> dict:
    """Run the two ranks from a fresh interpreter; returns ``{"dtype k extra": {variant: {ms, min, times}}}``
    (``error`` on failure)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.tp", json.dumps(spec)], cwd=root, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ))
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(_main(json.loads(sys.argv[1]))))
