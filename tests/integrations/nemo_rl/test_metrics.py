"""Replay's metrics in NeMo-RL's logs (integrations/nemo_rl/metrics.py): per-call parts against a float64 loop, and
their combination over the sequences of a packed micro-batch, micro-batches and ranks into a pooled mean and a
global maximum -- what NeMo-RL's own summing of per-key lists (grpo.py, after policy.train) would get wrong."""

from __future__ import annotations

import math

import torch

from nemo_replay.integrations.nemo_rl.metrics import combine_parts, merge_parts, metric_parts, to_floats


def _data(seed: int, B: int = 3, S: int = 9):
    g = torch.Generator().manual_seed(seed)
    return {
        "generation_logprobs": -torch.rand(B, S, generator=g, dtype=torch.float64).float() * 3,
        "token_mask": (torch.rand(B, S, generator=g) > 0.3).long(),
        "sample_mask": torch.tensor([1.0, 0.0, 1.0]),
    }, -torch.rand(B, S - 1, generator=g, dtype=torch.float64).float() * 3


def _loop(items):
    diffs = []
    for data, lp in items:
        for b in range(lp.shape[0]):
            for c in range(lp.shape[1]):
                if data["token_mask"][b, c + 1] and data["sample_mask"][b]:
                    diffs.append(abs(float(data["generation_logprobs"][b, c + 1]) - float(lp[b, c])))
    return sum(diffs) / len(diffs), max(diffs)


def test_parts_combine_into_the_pooled_mean_and_the_global_max():
    items = [_data(s) for s in range(5)]
    # Micro-batch 0 is packed: its three sequences are three calls, merged into one entry.
    packed = to_floats(merge_parts([metric_parts(lp[b : b + 1], {k: v[b : b + 1] for k, v in d.items()})
                                    for d, lp in items[:1] for b in range(3)]))
    rest = [to_floats(metric_parts(lp, d)) for d, lp in items[1:]]
    assert set(packed) == {"replay/mismatch_mean:sum", "replay/mismatch_mean:count", "replay/mismatch_max"}
    gathered = {key: [p[key] for p in [packed, *rest]] for key in packed}  # NeMo-RL's per-key lists
    gathered["loss"] = [1.0] * 5
    combine_parts(gathered)
    mean, peak = _loop(items)
    assert math.isclose(gathered["replay/mismatch_mean"][0], mean, rel_tol=1e-12)
    assert gathered["replay/mismatch_max"] == [peak] and gathered["loss"] == [1.0] * 5
    assert not any(":" in key for key in gathered)


def test_nothing_scored_leaves_the_mean_out_and_no_rollout_log_probs_gives_no_parts():
    data, lp = _data(7)
    data["sample_mask"] = torch.zeros(3)
    gathered = {key: [value] for key, value in to_floats(metric_parts(lp, data)).items()}
    assert gathered["replay/mismatch_mean:count"] == [0.0]
    combine_parts(gathered)
    assert "replay/mismatch_mean" not in gathered and gathered["replay/mismatch_max"] == [0.0]
    assert metric_parts(lp, {k: v for k, v in data.items() if k != "generation_logprobs"}) == {}
