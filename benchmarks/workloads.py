"""Benchmark inputs: logits, hidden states, LM-head weights and support rows (deterministic per seed).

Support model. A language model's top-k candidate sets overlap heavily across positions
(punctuation, frequent words), which matters to hidden mode (distinct weight rows read)
and not at all to logits mode (every (position, id) pair is its own cache line). Rows
are drawn as k distinct ids sampled without replacement from a Zipf(1.1) unigram
distribution over a random permutation of the vocabulary: draw ``4k`` ids with
replacement by inverse CDF, keep first occurrences in draw order, take the first k.
That is successive sampling, the same distribution as Gumbel-top-k on the log prior,
at ``O(T k log V)`` cost instead of ``O(T V)``. At T=512, V=128k, k=64 about a third of
the pairs carry distinct ids. ``uniform`` draws k distinct ids uniformly (no overlap:
the worst case for hidden mode).

Every position is loss-active, has its own row (row_ids = arange) and samples one
member chosen uniformly from its row. Given the vocabulary size, the rows are checked as
collation checks a trainer's rows (``validate_support``, which records the check on them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_replay.rollout.boundary import validate_support
from nemo_replay.support.packed import PackedTensor

__all__ = ["Channels", "support_rows", "channels", "logits_input", "hidden_inputs"]

ZIPF_EXPONENT = 1.1


@dataclass
class Channels:
    """Scorer channels for T positions, one row each.

    sampled: (T,), int64.  row_ids: (T,), int64 = arange(T).  loss_mask: (T,), bool, all True.
    support: PackedTensor with values (T, k), int32, one segment.
    """

    sampled: torch.Tensor
    row_ids: torch.Tensor
    loss_mask: torch.Tensor
    support: PackedTensor

    @property
    def rows(self) -> torch.Tensor:
        return self.support.values


def support_rows(T: int, V: int, k: int, *, model: str = "zipf", seed: int = 0) -> torch.Tensor:
    """(T, k) int32 rows of k distinct ids in [0, V) (trailing -1 if a row found fewer)."""
    g = torch.Generator().manual_seed(seed)
    if model == "uniform":
        # k distinct ids per row: a random base plus distinct offsets in [0, V).
        offsets = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(min(T, 64))])
        base = torch.randint(0, V, (T, 1), generator=g)
        return ((offsets.repeat((T + 63) // 64, 1)[:T] + base) % V).to(torch.int32)
    if model != "zipf":
        raise ValueError(f"support model must be 'zipf' or 'uniform', got {model!r}")
    m = 4 * k
    prob = torch.arange(1, V + 1, dtype=torch.float64).pow_(-ZIPF_EXPONENT)
    cdf = torch.cumsum(prob, 0)
    cdf /= cdf[-1].clone()
    relabel = torch.randperm(V, generator=g)  # popular ids spread over the vocabulary
    draws = torch.searchsorted(cdf, torch.rand(T, m, generator=g, dtype=torch.float64)).clamp_(max=V - 1)
    # Keep first occurrences in draw order. Example (m = 5): draws [7, 3, 7, 9, 3]
    #   sorted values [3, 3, 7, 7, 9] at draw positions [1, 4, 0, 2, 3]
    #   first occurrence?  [T, F, T, F, T] -> key [1, 5, 0, 5, 3] (5 = not first)
    #   ascending key -> values 7, 3, 9: the distinct ids in the order they were drawn.
    values, where = torch.sort(draws, dim=1, stable=True)
    first = torch.ones_like(values, dtype=torch.bool)
    first[:, 1:] = values[:, 1:] != values[:, :-1]
    key = torch.where(first, where, torch.full_like(where, m))
    key_sorted, order = torch.sort(key, dim=1)
    rows = relabel[values.gather(1, order[:, :k])]
    rows = torch.where(key_sorted[:, :k] < m, rows, torch.full_like(rows, -1))
    return rows.to(torch.int32)


def channels(rows: torch.Tensor, *, vocab_size: int | None = None, seed: int = 1) -> Channels:
    """Channels for rows (T, k) int32: each position samples a uniformly chosen member.

    With ``vocab_size`` the rows are checked (and record it) as collation does; without, they
    stay unchecked and the scorer checks them on its first call.
    """
    g = torch.Generator().manual_seed(seed)
    T = rows.shape[0]
    width = (rows >= 0).sum(1).clamp(min=1)
    col = (torch.rand(T, generator=g) * width).long().clamp_(max=rows.shape[1] - 1)
    sampled = rows.gather(1, col[:, None]).squeeze(1).long()
    support = PackedTensor(rows, [0, T])
    if vocab_size is not None:
        validate_support(support, sampled_ids=sampled, vocab_size=vocab_size, where="collation")
    return Channels(sampled=sampled, row_ids=torch.arange(T), loss_mask=torch.ones(T, dtype=torch.bool), support=support)


def logits_input(T: int, V: int, dtype: torch.dtype, *, seed: int = 2) -> torch.Tensor:
    """(T, V) logits in ``dtype``, standard normal times 2."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(T, V, dtype=dtype)
    step = max(1, (1 << 24) // V)  # generate in float32 blocks of ~64 MiB
    for i in range(0, T, step):
        out[i : i + step] = torch.randn(min(step, T - i), V, generator=g).mul_(2.0)
    return out


def hidden_inputs(T: int, V: int, H: int, dtype: torch.dtype, *, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (T, H) and LM-head weight (V, H) in ``dtype``; weight scaled by H**-0.5."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = torch.empty(V, H, dtype=dtype)
    step = max(1, (1 << 24) // H)
    for i in range(0, V, step):
        weight[i : i + step] = torch.randn(min(step, V - i), H, generator=g).mul_(H**-0.5)
    return hidden, weight

