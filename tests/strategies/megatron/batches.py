"""Batches of the megatron strategy tests: left-padded canonical ones, the same right-padded, float64 references."""

from __future__ import annotations

import torch

from nemo_replay.batch import ReplayBatch
from nemo_replay.support.packed import PackedTensor

TEMPERATURE = 0.9
EOS = 63


def make_batch(rolls, prompt_lengths, synthetic_eos: int | None = None) -> ReplayBatch:
    """Left-padded canonical batch; ``synthetic_eos`` appends an unsampled EOS (all -1 row)."""
    seqs, rows, R = [], [], []
    for i, (tokens, _, r) in enumerate(rolls):
        if i == synthetic_eos:
            tokens = torch.cat([tokens, torch.tensor([EOS])])
            r = torch.cat([r, torch.full((1, r.shape[1]), -1, dtype=r.dtype)])
        seqs.append(tokens)
        rows.append(r)
        R.append(tokens.numel() - prompt_lengths[i])
    B, S, A = len(seqs), max(s.numel() for s in seqs), max(R)
    sequences = torch.zeros(B, S, dtype=torch.int64)
    mask = torch.zeros(B, S, dtype=torch.bool)
    loss_mask = torch.zeros(B, A, dtype=torch.bool)
    for i, s in enumerate(seqs):
        sequences[i, S - s.numel() :] = s
        mask[i, S - s.numel() :] = True
        loss_mask[i, A - R[i] :] = True
    return ReplayBatch(sequences, mask, torch.tensor(R), loss_mask, support=PackedTensor.from_segments(rows))


def with_policy_inputs(batch: ReplayBatch, old: torch.Tensor, advantages: torch.Tensor) -> ReplayBatch:
    # A reference that differs from the policy, so the KL term has a gradient.
    shift = 0.05 * torch.linspace(-1, 1, old.numel()).view_as(old)
    return ReplayBatch(
        batch.sequences, batch.attention_mask, batch.response_lengths, batch.loss_mask, support=batch.support,
        old_logprobs=old, advantages=advantages, ref_logprobs=old + shift,
    )


def right_padded(batch: ReplayBatch) -> ReplayBatch:
    """The same trajectories right-padded (NeMo-RL's layout), with token-aligned [B, S] per-token fields."""
    B, S = batch.sequences.shape
    A = batch.loss_mask.shape[1]
    L = batch.attention_mask.sum(1)
    seq = torch.zeros_like(batch.sequences)
    am = torch.zeros_like(batch.attention_mask)
    fields = {n: getattr(batch, n) for n in ("old_logprobs", "ref_logprobs") if getattr(batch, n) is not None}
    out = {n: torch.zeros(B, S, dtype=v.dtype) for n, v in fields.items()}
    lm = torch.zeros(B, S, dtype=torch.bool)
    for i in range(B):
        n = int(L[i])
        seq[i, :n] = batch.sequences[i, S - n :]
        am[i, :n] = True
        # Left-padded token column S - A + a -> right-padded column n - A + a (shift by S - n).
        lm[i, max(n - A, 0) : n] = batch.loss_mask[i, max(A - n, 0) :]
        for name, v in fields.items():
            out[name][i, max(n - A, 0) : n] = v[i, max(A - n, 0) :]
    return ReplayBatch(seq, am, batch.response_lengths.clone(), lm, support=batch.support, advantages=batch.advantages, **out)


def naive_policy_logprobs(model, b: ReplayBatch) -> torch.Tensor:
    """(B, A) differentiable float64 log-probs of plain single-trajectory forwards (left-padded batch)."""
    from tests.strategies.megatron.harness import naive_scores

    B, A = b.loss_mask.shape
    lp = torch.zeros(B, A, dtype=torch.float64)
    for i in range(B):
        seq = b.sequences[i][b.attention_mask[i]]
        R = int(b.response_lengths[i])
        lp = lp.index_put((torch.tensor([i]), torch.arange(A - R, A)), naive_scores(model, seq, response_rows(b, i), R, TEMPERATURE))
    return lp


def response_rows(batch: ReplayBatch, i: int) -> torch.Tensor:
    return batch.support.segment(i)


def naive_response(model, batch: ReplayBatch, *, full_vocab: bool) -> torch.Tensor:
    """(B, A) float64 reference log-probs from one plain forward per trajectory."""
    from tests.strategies.megatron.harness import naive_scores

    B, A = batch.loss_mask.shape
    out = torch.zeros(B, A, dtype=torch.float64)
    for i in range(B):
        seq = batch.sequences[i][batch.attention_mask[i]]
        R = int(batch.response_lengths[i])
        rows = response_rows(batch, i)
        if full_vocab:
            rows = torch.full_like(rows, -1)
        out[i, A - R :] = naive_scores(model, seq, rows, R, TEMPERATURE)
    return out
