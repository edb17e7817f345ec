"""Naive dense-loop references for the scorer tests (ground truth, float64 by default).

Every quantity is computed one position at a time from the full logits row, with nothing
shared with the package's scorer:

    S          = the row's members, or every vocab id with a finite logit (no row: synthetic EOS)
    logprob    = z[x]/T - logsumexp_{s in S} z[s]/T
    entropy    = -sum_{s in S} p_s log p_s,  p = softmax over S of z/T
    logmass    = logsumexp_S z/T - logsumexp_V z/T   (0 where not scored over a row)

Positions that are not loss-active get 0 everywhere. The loop is differentiable, so
``torch.autograd.grad`` through it gives reference gradients.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["reference_scores"]


def reference_scores(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    row_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    sets: Sequence[Sequence[int]],
    *,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Score every position in a Python loop.

    Args:
        logits: (*, V) float, the full vocabulary (any dtype: the math stays in it).
        sampled_ids: (*,) int.
        row_ids: (*,) int, -1 for none.
        loss_mask: (*,) bool.
        sets: members of each global support row (an empty list: no row recorded).

    Returns:
        dict with ``logprobs``, ``entropy``, ``logmass`` of shape (*,) in the logits dtype,
        and bool masks ``valid`` (scored over a row) and ``fallback`` (scored over the vocab).
    """
    shape = logits.shape[:-1]
    z_all = logits.reshape(-1, logits.shape[-1])
    sampled = sampled_ids.reshape(-1).tolist()
    rows = row_ids.reshape(-1).tolist()
    active = loss_mask.reshape(-1).tolist()
    zero = z_all.new_zeros(())
    lps, ents, masses, valid, fallback = [], [], [], [], []
    for p in range(z_all.shape[0]):
        members = list(sets[rows[p]]) if rows[p] >= 0 else []
        if not active[p]:
            lps.append(zero), ents.append(zero), masses.append(zero)
            valid.append(False), fallback.append(False)
            continue
        z = z_all[p] / temperature
        finite = torch.nonzero(torch.isfinite(z)).flatten()
        kept = torch.tensor(members, dtype=torch.int64) if members else finite
        zs = z[kept]
        lse = torch.logsumexp(zs, 0)
        lps.append(z[sampled[p]] - lse)
        logp = zs - lse
        ents.append(-(torch.exp(logp) * logp).sum())
        masses.append(lse - torch.logsumexp(z[finite], 0) if members else zero)
        valid.append(bool(members))
        fallback.append(not members)
    return {
        "logprobs": torch.stack(lps).view(shape),
        "entropy": torch.stack(ents).view(shape),
        "logmass": torch.stack(masses).view(shape),
        "valid": torch.tensor(valid).view(shape),
        "fallback": torch.tensor(fallback).view(shape),
    }
