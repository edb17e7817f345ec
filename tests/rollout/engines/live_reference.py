"""What the tests against a live vLLM (offline and server) share: the tiny Llama both serve, a
float64 statement of vLLM's sampler to check each recorded row against, and the trainer's own
scoring of a rollout batch (the fsdp strategy's recompute role)."""

from __future__ import annotations

import copy
import math

import torch

V, TOL = 32, 1e-4


def tiny_llama(seed: int = 0):
    """A Llama of head size 64 (vLLM's CPU attention refuses 16), logits a few nats apart."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random init gives logits ~0.2 apart: supports would hardly truncate
        model.lm_head.weight.mul_(10.0)
    return model


def updated(model, scale: float = 0.05):
    """A copy of ``model`` after a "training step": every parameter moved by ``scale`` x noise."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn_like(p))
    return out


def kept(x: torch.Tensor, top_k, top_p: float, min_p: float, slack: float) -> torch.Tensor:
    """(V,) bool: vLLM's support of one row of float64 logits / temperature, every threshold moved
    by ``slack`` (> 0 looser, < 0 stricter): min-p on the probabilities, then top-k keeping every
    token tied with the k-th (``vllm/v1/sample/ops/topk_topp_sampler.py``, the PyTorch path), then
    top-p over what is left, summed from the bottom (a token stays while the mass above it is
    below ``top_p``)."""
    keep = torch.ones_like(x, dtype=torch.bool)
    if min_p > 0:
        keep &= x >= x.max() + math.log(min_p) - slack
    if top_k is not None:
        beaten_by = ((x[None, :] > x[:, None] + slack) & keep[None, :]).sum(1)  # [t]: kept tokens above t
        keep &= beaten_by < top_k
    if top_p < 1.0:
        p = torch.where(keep, x, -math.inf).softmax(0)
        keep &= ((x[None, :] > x[:, None]) * p[None, :]).sum(1) < top_p + slack
    return keep


def logits64(model, prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """(R, V) float64: the model's next-token logits at each response position."""
    seq = torch.cat([prompt, response])[None]
    with torch.no_grad():
        z = model(input_ids=seq).logits[0].double()
    return z[prompt.numel() - 1 : seq.shape[1] - 1]


def check_rows(model, prompts, responses, row_of, *, top_k, top_p=1.0, min_p=0.0, temperature=1.0) -> None:
    """Each recorded row (``row_of(i, j)``: trajectory i's token j, None where flagged) holds every
    token the float64 sampler surely keeps and none it surely drops."""
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        z = logits64(model, prompt, response) / temperature
        for j in range(z.shape[0]):
            row = row_of(i, j)
            if row is None:
                continue
            sure = set(torch.nonzero(kept(z[j], top_k, top_p, min_p, -TOL)).flatten().tolist())
            maybe = set(torch.nonzero(kept(z[j], top_k, top_p, min_p, TOL)).flatten().tolist())
            assert sure <= set(row) <= maybe, (i, j, sorted(row), sorted(sure), sorted(maybe))


def trainer_logprobs(model, batch, *, replay: bool, temperature: float = 1.0) -> torch.Tensor:
    """(B, A): the fsdp strategy's recompute role over ``batch``, the trainer's own scoring path
    (over the recorded rows with ``replay``, else over the full vocabulary)."""
    from nemo_replay.strategies.base import RoleSettings
    from nemo_replay.strategies.registry import get_strategy

    strategy = get_strategy("fsdp").factory(sp_group=None)
    settings = RoleSettings(replay=replay, temperature=temperature, source="logits", chunk_size=8192,
                            compute_entropy=False, reference_full_vocab=False)
    if not replay:
        batch = copy.copy(batch)
        batch.support = None
    return strategy.run_role("recompute", model, [batch], settings)[0].response(batch.response_width).logprobs


def gap(model, batch, *, replay: bool = True, temperature: float = 1.0) -> float:
    """max |engine - trainer| log-prob over the batch's loss positions."""
    lp = trainer_logprobs(model, batch, replay=replay, temperature=temperature)
    return float((lp - batch.rollout_logprobs).abs()[batch.loss_mask.bool()].max())


def check_weight_update(engine, model, prompts) -> None:
    """An engine's rollout after a weight update: the trainer with the new weights reproduces its
    log-probs, the old weights do not (the update reached the engine), the sync stays quick, and
    the same seeds draw the same tokens again. The engine holds ``model`` again at the end."""
    new = updated(model)
    batch = engine.rollout(new, prompts, seed=123).batch
    assert gap(new, batch) <= TOL
    assert gap(model, batch) > 1e-2
    assert engine.sync_seconds[-1] < 5.0
    again = engine.rollout(new, prompts, seed=123)
    assert torch.equal(again.batch.sequences, batch.sequences)
    engine.sync(model)
