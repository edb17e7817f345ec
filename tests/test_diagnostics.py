"""Step diagnostics: exact sums / counts / maxima over micro-batches, read back once."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from nemo_replay.diagnostics import StepStats, record_mismatch, record_policy


def _micro_batches():
    """Three (B, A) micro-batches, ragged masks (the last one empty), distinct values per row."""
    g = torch.Generator().manual_seed(0)
    out = []
    for k, (B, A) in enumerate([(2, 5), (3, 4), (2, 3)]):
        rollout = -torch.rand(B, A, generator=g, dtype=torch.float64) * 3
        trainer = (rollout + 0.2 * torch.randn(B, A, generator=g, dtype=torch.float64)).float()
        mask = torch.rand(B, A, generator=g) < 0.6 if k < 2 else torch.zeros(B, A, dtype=torch.bool)
        mask[0, -1] = k < 2
        out.append((rollout, trainer, mask, torch.tensor(0.5 + k), {"kl": 0.01 * (k + 1), "ratio_max_dev": 0.1 * k}))
    return out


def _record(stats, items):
    for rollout, trainer, mask, loss, metrics in items:
        record_mismatch(stats, rollout, trainer, mask)
        batch = SimpleNamespace(loss_mask=mask, rollout_logprobs=rollout, response_width=mask.shape[1])
        view = SimpleNamespace(logprobs=trainer)
        out = SimpleNamespace(response=lambda width, v=view: v, loss=loss, metrics=metrics)
        record_policy(stats, batch, out)


def test_step_stats_match_a_float64_loop_with_one_host_read():
    from benchmarks.syncs import HostReads

    items = _micro_batches()
    stats = StepStats()
    with HostReads() as reads:
        _record(stats, items)
        got = stats.reduce(across_ranks=False)
    assert reads.total == 1, dict(reads.where)

    diffs, ratios, weighted = [], [], {"loss": [0.0, 0], "kl": [0.0, 0]}
    for rollout, trainer, mask, loss, metrics in items:
        for i, a in zip(*torch.nonzero(mask, as_tuple=True)):
            d = float(trainer[i, a].double()) - float(rollout[i, a])
            diffs.append(abs(d))
            ratios.append(math.exp(d))
        n = int(mask.sum())
        weighted["loss"][0] += float(loss) * n
        weighted["kl"][0] += metrics["kl"] * n
        weighted["loss"][1] += n
        weighted["kl"][1] += n
    assert math.isclose(got["mismatch_mean"], sum(diffs) / len(diffs), rel_tol=1e-12)
    assert math.isclose(got["mismatch_max"], max(diffs), rel_tol=1e-12)
    assert math.isclose(got["ratio_mean"], sum(ratios) / len(ratios), rel_tol=1e-12)
    assert math.isclose(got["ratio_max_dev"], max(abs(r - 1) for r in ratios), rel_tol=1e-12)
    for key, (total, n) in weighted.items():
        assert math.isclose(got[key], total / n, rel_tol=1e-12)
    assert got["ratio_old_max_dev"] == 0.2


def test_numbers_and_tensors_mix_and_empty_names_reduce():
    stats = StepStats()
    stats.add_mean("reward", 3.0, 2)
    stats.add_mean("reward", torch.tensor(1.0, dtype=torch.float64), torch.tensor(2))
    stats.add_max("step_time_s", 0.5)
    stats.add_max("step_time_s", torch.tensor(0.25))
    stats.add_max("step_time_s", 0.75)
    stats.add_mean("empty", torch.tensor(0.0), torch.tensor(0))
    got = stats.reduce(across_ranks=False)
    assert got["reward"] == 1.0 and got["step_time_s"] == 0.75 and math.isnan(got["empty"])
    assert StepStats().reduce(across_ranks=False) == {}


def test_the_normalisation_gap_apart_matches_a_float64_loop():
    """``record_mismatch`` with the support's log mass, and ``record_gap`` alone, against a loop."""
    from nemo_replay.diagnostics import GAP_NAMES, MISMATCH_NAMES, record_gap

    g = torch.Generator().manual_seed(7)
    rollout = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 3
    replayed = (rollout + torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.1).float()  # some ratios outside [0.9, 1.1]
    log_mass = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(3, 6, generator=g) > 0.3
    rowful = mask & (torch.arange(6) < 5)  # the last column scored over the vocabulary: no support mass
    stats = StepStats()
    record_mismatch(stats, rollout, replayed, mask, log_mass=log_mass.float(), mass_mask=rowful)
    got = stats.reduce(across_ranks=False)
    assert set(got) == set(MISMATCH_NAMES) | set(GAP_NAMES)
    pos = [(i, j) for i in range(3) for j in range(6) if mask[i, j]]
    kept = [(i, j) for i, j in pos if rowful[i, j]]
    lm = lambda i, j: float(log_mass.float()[i, j])  # noqa: E731
    mism = [abs(float(rollout[i, j]) - float(replayed[i, j])) for i, j in pos]
    full = [abs(float(rollout[i, j]) - (float(replayed[i, j]) + lm(i, j))) for i, j in kept]
    out = lambda a, b: abs(math.exp(b - a) - 1) > 0.1  # noqa: E731  -- the ratio outside [0.9, 1.1]
    want = {
        "ratio_outside_share": sum(out(float(rollout[i, j]), float(replayed[i, j])) for i, j in pos) / len(pos),
        "full_vocab_ratio_outside_share": sum(out(float(rollout[i, j]), float(replayed[i, j]) + lm(i, j)) for i, j in kept) / len(kept),
        "mismatch_mean": sum(mism) / len(mism), "mismatch_max": max(mism),
        "support_mass_mean": sum(math.exp(lm(i, j)) for i, j in kept) / len(kept),
        "normalisation_gap_mean": sum(-lm(i, j) for i, j in kept) / len(kept),
        "full_vocab_mismatch_mean": sum(full) / len(full), "full_vocab_mismatch_max": max(full),
    }
    for name, value in want.items():
        assert math.isclose(got[name], value, rel_tol=1e-12, abs_tol=1e-15), (name, got[name], value)
    alone = StepStats()
    record_gap(alone, log_mass, rowful)
    assert set(alone.reduce(across_ranks=False)) == {"support_mass_mean", "normalisation_gap_mean"}
