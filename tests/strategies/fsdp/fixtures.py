"""Shared pieces of the fsdp tests: a tiny Llama, ragged replay batches, float64 references.

The reference scores every trajectory on its own, unpadded, with a plain copy of the model
(unsharded; SDPA attention, since eager attention runs its softmax in float32) and a Python
loop over support members: no padding, no packing, no sequence parallelism, no shared scorer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from nemo_replay.batch import ReplayBatch
from nemo_replay.objectives import TokenRatioObjective, clipped_policy_loss
from nemo_replay.support.packed import PackedTensor

VOCAB = 96
WIDTH = 4  # support row width k


def tiny_llama(seed: int = 0, *, heads: int = 4, kv_heads: int = 2, attn: str = "sdpa"):
    """A float64 two-layer LlamaForCausalLM built from a config (no download); head_dim 8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=64,
        rope_theta=100.0, tie_word_embeddings=False, attn_implementation=attn,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float64)
    # Larger logits than the default init so log-probs over a support differ clearly
    # from full-vocabulary ones.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def tiny_qwen2(seed: int = 0):
    """A float64 two-layer Qwen2ForCausalLM (q/k/v biases, no sliding window)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=False, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def plain_copy(model, attn: str = "sdpa"):
    """An unsharded copy of ``model`` (same weights) with the given attention."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation(attn)
    return ref


@dataclass(frozen=True)
class Trajectory:
    """prompt/response lengths; ``observation``: response indices with no row and no loss;
    ``eos``: the last response token is a synthetic EOS (loss-active, all -1 row)."""

    prompt: int
    response: int
    observation: tuple = ()
    eos: bool = False


def make_batch(trajs: list[Trajectory], *, seq_len: int, seed: int) -> ReplayBatch:
    """A left-padded ragged batch with distinct token ids and recorded support rows.

    Every sampled response token sits at a random place inside its row; rows have random
    trailing -1 padding; observation tokens and a synthetic EOS get all -1 rows.
    """
    g = torch.Generator().manual_seed(seed)
    B = len(trajs)
    lengths = [t.prompt + t.response for t in trajs]
    assert max(lengths) <= seq_len and sum(lengths) <= VOCAB
    ids = torch.randperm(VOCAB, generator=g)[: sum(lengths)]
    A = max(t.response for t in trajs)
    sequences = torch.zeros(B, seq_len, dtype=torch.int64)
    attention = torch.zeros(B, seq_len, dtype=torch.bool)
    loss_mask = torch.zeros(B, A, dtype=torch.bool)
    rows = []
    start = 0
    for i, t in enumerate(trajs):
        L = lengths[i]
        tokens = ids[start : start + L]
        start += L
        sequences[i, seq_len - L :] = tokens
        attention[i, seq_len - L :] = True
        for j in range(t.response):
            x = int(tokens[t.prompt + j])
            no_row = j in t.observation or (t.eos and j == t.response - 1)
            loss_mask[i, A - t.response + j] = j not in t.observation
            row = torch.full((WIDTH,), -1, dtype=torch.int32)
            if not no_row:
                members = int(torch.randint(2, WIDTH + 1, (1,), generator=g))
                others = [v for v in torch.randperm(VOCAB, generator=g).tolist() if v != x][: members - 1]
                where = int(torch.randint(0, members, (1,), generator=g))
                others.insert(where, x)
                row[:members] = torch.tensor(others, dtype=torch.int32)
            rows.append(row)
    support = PackedTensor(torch.stack(rows), [0] + torch.cumsum(torch.tensor([t.response for t in trajs]), 0).tolist())
    return ReplayBatch(
        sequences=sequences,
        attention_mask=attention,
        response_lengths=torch.tensor([t.response for t in trajs]),
        loss_mask=loss_mask,
        support=support,
        advantages=torch.linspace(-1.0, 1.5, B, dtype=torch.float64),
    )


# Ragged batches: lengths and totals are odd (never multiples of the SP size); trajectory
# 0 of BATCH_A ends in a synthetic EOS, trajectory 1 holds an observation token, and
# trajectory 1 fills the whole row (no left padding).
BATCH_A = dict(
    trajs=[Trajectory(4, 3, eos=True), Trajectory(6, 5, observation=(2,)), Trajectory(3, 2)], seq_len=11, seed=1
)
BATCH_B = dict(trajs=[Trajectory(2, 4), Trajectory(5, 4, eos=True)], seq_len=9, seed=2)


def reference_scores(model, batch: ReplayBatch, *, temperature: float, full_vocab: bool = False):
    """Naive float64 log-probs in response coordinates.

    Returns:
        logprobs: (B, A) float64, differentiable w.r.t. the model; 0 where not loss-active.
        valid: (B, A) bool, scored over a row. fallback: (B, A) bool, over the full vocabulary.
    """
    B, S = batch.sequences.shape
    A = batch.response_width
    cu = batch.support.cu_seqlens.tolist()
    values = batch.support.values
    out = [[torch.zeros((), dtype=torch.float64) for _ in range(A)] for _ in range(B)]
    valid = torch.zeros(B, A, dtype=torch.bool)
    fallback = torch.zeros(B, A, dtype=torch.bool)
    for i in range(B):
        L = int(batch.attention_mask[i].sum())
        R = int(batch.response_lengths[i])
        P = L - R
        tokens = batch.sequences[i, S - L :]
        logits = model(input_ids=tokens[None]).logits[0].to(torch.float64) / temperature
        for j in range(R):
            col = A - R + j
            if not batch.loss_mask[i, col]:
                continue
            z = logits[P - 1 + j]
            x = int(tokens[P + j])
            members = [int(m) for m in values[cu[i] + j] if m >= 0]
            if full_vocab or not members:
                out[i][col] = z[x] - torch.logsumexp(z, 0)
                fallback[i, col] = True
            else:
                out[i][col] = z[x] - torch.logsumexp(z[members], 0)
                valid[i, col] = True
    return torch.stack([torch.stack(r) for r in out]), valid, fallback


def reference_entropy_and_mass(model, batch: ReplayBatch, *, temperature: float):
    """Naive float64 entropy of the scoring distribution and the support's log-mass, (B, A) each.

    Entropy over the support row (over the full vocabulary at a synthetic EOS); log-mass
    ``logsumexp_S z/T - logsumexp_V z/T`` at support positions, 0 elsewhere.
    """
    B, S = batch.sequences.shape
    A = batch.response_width
    cu = batch.support.cu_seqlens.tolist()
    entropy = torch.zeros(B, A, dtype=torch.float64)
    logmass = torch.zeros(B, A, dtype=torch.float64)
    for i in range(B):
        L = int(batch.attention_mask[i].sum())
        R = int(batch.response_lengths[i])
        logits = model(input_ids=batch.sequences[i, S - L :][None]).logits[0] / temperature
        for j in range(R):
            col = A - R + j
            if not batch.loss_mask[i, col]:
                continue
            z = logits[L - R - 1 + j]
            members = [int(m) for m in batch.support.values[cu[i] + j] if m >= 0]
            kept = z[members] if members else z
            p = torch.softmax(kept, 0)
            entropy[i, col] = -(p * torch.log(p)).sum()
            if members:
                logmass[i, col] = torch.logsumexp(kept, 0) - torch.logsumexp(z, 0)
    return entropy, logmass


def reference_full_positions(model, batch: ReplayBatch, *, temperature: float) -> torch.Tensor:
    """Replay off: full-vocabulary log-probs at every real logit position, (B, S-1) float64."""
    B, S = batch.sequences.shape
    out = torch.zeros(B, S - 1, dtype=torch.float64)
    for i in range(B):
        L = int(batch.attention_mask[i].sum())
        tokens = batch.sequences[i, S - L :]
        logp = torch.log_softmax(model(input_ids=tokens[None]).logits[0] / temperature, -1)
        out[i, S - L : S - 1] = logp[:-1].gather(1, tokens[1:, None])[:, 0]
    return out


def with_old_and_ref(model, batch: ReplayBatch, temperature: float) -> ReplayBatch:
    """Give the batch old and reference log-probs near the current ones (ratios != 1)."""
    with torch.no_grad():
        lp, _, _ = reference_scores(model, batch, temperature=temperature)
    B, A = lp.shape
    wobble = 0.3 * torch.sin(torch.arange(B * A, dtype=torch.float64)).view(B, A)
    batch.old_logprobs = lp + wobble
    batch.ref_logprobs = lp - 0.5 * wobble
    return batch


OBJECTIVE = TokenRatioObjective(clip_eps=0.2, kl_coef=0.1)  # the policy role's loss_fn in these tests


def reference_policy_grads(model, batches, temperature: float, objective=OBJECTIVE) -> dict[str, torch.Tensor]:
    """Gradients of the mean over micro-batches of the clipped objective, naive scores."""
    model.zero_grad(set_to_none=True)
    for batch in batches:
        lp, _, _ = reference_scores(model, batch, temperature=temperature)
        loss, _ = clipped_policy_loss(
            lp, batch.old_logprobs, batch.advantages, batch.loss_mask,
            clip_eps=objective.clip_eps, kl_coef=objective.kl_coef, ref_logprobs=batch.ref_logprobs,
        )
        (loss / len(batches)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def canonical_from_response(x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(B, A) response columns placed in (B, S-1) canonical logit columns, 0 elsewhere."""
    B, A = x.shape
    out = torch.zeros(B, seq_len - 1, dtype=x.dtype)
    out[:, -A:] = x
    return out
