"""Random ragged scoring batches for the scorer tests (deterministic per seed).

Layout of one case, positions ``[B, T]`` in logit coordinates, trajectory i left-padded:

    column          0 .. T-L_i-1 | T-L_i .. T-R_i-1 | T-R_i .. T-1
    trajectory_ids  -1             i                  i
    row_ids         -1             -1                 cu[i] + j      (j = 0 .. R_i-1)
    loss_mask       0              0                  1, except observation rows

Rows hold 1..k distinct ids (trailing -1 up to k); every 5th response row (j % 5 == 3)
is an observation: an all -1 row, loss-inactive. A trajectory listed in ``eos`` ends
with a synthetic EOS: its last row is all -1 but the position is loss-active.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_replay.support.packed import PackedTensor

__all__ = ["Case", "make_case", "distinct_rows"]


@dataclass
class Case:
    logits: torch.Tensor  # (B, T, V) float64 = hidden @ weight.T, -inf on masked ids
    hidden: torch.Tensor  # (B, T, H) float64
    weight: torch.Tensor  # (V, H) float64
    sampled_ids: torch.Tensor  # (B, T) int64
    row_ids: torch.Tensor  # (B, T) int64
    loss_mask: torch.Tensor  # (B, T) bool
    trajectory_ids: torch.Tensor  # (B, T) int64
    support: PackedTensor  # int32 (rows, k)
    sets: list  # members of each global row
    masked: torch.Tensor  # (n,) int64 vocab ids whose logits are -inf

    def channels(self) -> tuple:
        return self.sampled_ids, self.row_ids, self.loss_mask, self.support


def make_case(
    *,
    B: int = 3,
    T: int = 37,
    V: int = 423,
    k: int = 7,
    H: int = 24,
    seed: int = 0,
    eos: tuple = (1,),
    eos_without_row_id: bool = False,
    masked_vocab: int = 0,
) -> Case:
    """Build a case; ``eos_without_row_id`` puts row id -1 (not a padding row) at the EOS."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(V, generator=g)
    masked, allowed = perm[:masked_vocab].sort().values, perm[masked_vocab:]
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    logits = hidden @ weight.T
    logits[..., masked] = float("-inf")

    sampled = allowed[torch.randint(len(allowed), (B, T), generator=g)]
    row_ids = torch.full((B, T), -1, dtype=torch.int64)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    traj = torch.full((B, T), -1, dtype=torch.int64)
    rows, sets, segments = [], [], []
    for i in range(B):
        L = T - (i * 11) % max(T // 2, 1)
        R = max(L - 3 - i, 2)
        traj[i, T - L :] = i
        for j in range(R):
            col = T - R + j
            row_ids[i, col] = len(rows)
            is_eos = i in eos and j == R - 1
            if j % 5 == 3 or is_eos:
                rows.append(torch.full((k,), -1, dtype=torch.int32))
                sets.append([])
                loss_mask[i, col] = is_eos
                if is_eos and eos_without_row_id:
                    row_ids[i, col] = -1
                continue
            width = 1 + int(torch.randint(k, (1,), generator=g))
            members = allowed[torch.randperm(len(allowed), generator=g)[:width]]
            rows.append(torch.cat([members, torch.full((k - width,), -1, dtype=torch.int64)]).to(torch.int32))
            sets.append(members.tolist())
            sampled[i, col] = members[int(torch.randint(width, (1,), generator=g))]
            loss_mask[i, col] = True
        segments.append(torch.stack(rows[len(rows) - R :]))
    support = PackedTensor.from_segments(segments)
    return Case(logits, hidden, weight, sampled, row_ids, loss_mask, traj, support, sets, masked)


def distinct_rows(num_rows: int, k: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """(num_rows, k) int64 rows of k distinct ids in [0, vocab) without a (rows, vocab) buffer.

    Row r is ``(a_r + j * b_r) mod vocab`` for j < k with ``b_r`` coprime to ``vocab`` (odd,
    ``vocab`` a power of two), so the k ids of a row are distinct.
    """
    if vocab & (vocab - 1):
        raise ValueError(f"vocab must be a power of two, got {vocab}")
    a = torch.randint(vocab, (num_rows, 1), generator=generator)
    b = 2 * torch.randint(vocab // 2, (num_rows, 1), generator=generator) + 1
    return (a + torch.arange(k)[None, :] * b) % vocab
