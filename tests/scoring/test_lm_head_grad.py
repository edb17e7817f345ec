"""Hidden mode's sparse LM-head weight gradient (nemo_replay/scoring/projection.py).

When the trainer keeps a persistent gradient buffer, the backward adds the support's rows
into it and hands autograd no dense ``[V, H]`` gradient:

- single process: an existing ``.grad`` (micro-batch 2 on of gradient accumulation), in
  float64 and bfloat16, with synthetic-EOS rows (which touch every row), a tied
  embedding, and the cases that must stay dense (``torch.autograd.grad``, also with
  ``create_graph``, no buffer yet, ``backward(inputs=...)``);
- megatron-core: a real GPTModel under megatron's DistributedDataParallel (``main_grad``
  and its backward hooks, with and without overlapped gradient reduction), TP 1 and 2,
  tied and untied embeddings, two micro-batches through megatron's schedule: every
  ``main_grad`` equals the one of the same step in logits mode (megatron's own output
  layer backward);
- FSDP2 through the fsdp strategy: the default mode keeps the dense gradient (FSDP
  reduce-scatters and frees the unsharded gradient after every backward, so nothing
  persists); under ``set_requires_gradient_sync(False)`` the second micro-batch is
  accumulated in place; both equal logits mode.

Which path ran is observed through a wrapper that calls the real row accumulation.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nemo_replay.scoring.projection as projection
from nemo_replay import score_aligned_support
from nemo_replay.objectives import TokenRatioObjective
from nemo_replay.strategies.base import RoleSettings
from tests.scoring.batches import make_case
from tests.spawn import run_workers


class _SparseUses:
    """Counts the backward calls that accumulated rows into a persistent buffer."""

    def __init__(self, monkeypatch=None):
        self.n = 0
        real = projection._accumulate_rows

        def observed(*args, **kwargs):
            self.n += 1
            return real(*args, **kwargs)

        if monkeypatch is not None:
            monkeypatch.setattr(projection, "_accumulate_rows", observed)
        else:
            projection._accumulate_rows = observed


class _LargestNewTensor(TorchDispatchMode):
    """The element count of the largest tensor an operation creates (views and in-place results excluded)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if all(r.alias_info is None for r in func._schema.returns):
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor) and o.layout == torch.strided:  # a sparse pattern allocates nnz only
                    self.numel = max(self.numel, o.numel())
        return out


def _loss(case, h, w, **kw):
    g = torch.Generator().manual_seed(3)
    coeff = torch.rand(case.loss_mask.shape, generator=g, dtype=torch.float64) + 0.5
    out = score_aligned_support(h, *case.channels(), lm_head_weight=w, temperature=0.8, compute_entropy=True, **kw)
    return (out.logprobs.double() * coeff).sum() + out.entropy.double().sum()


def _leaf(t: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """A fresh leaf copy (the case's tensors stay untouched)."""
    return t.detach().to(dtype).clone().requires_grad_()


def _dense(case, dtype=torch.float64):
    h, w = _leaf(case.hidden, dtype), _leaf(case.weight, dtype)
    return torch.autograd.grad(_loss(case, h, w), (h, w))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("eos", [(), (0, 2)])
def test_rows_accumulate_into_an_existing_grad(monkeypatch, dtype, eos):
    case = make_case(B=3, T=37, V=20000, k=7, H=24, eos=eos, seed=30)
    uses = _SparseUses(monkeypatch)
    gh, gw = _dense(case, dtype)
    h, w = _leaf(case.hidden, dtype), _leaf(case.weight, dtype)
    start = torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(dtype)  # earlier micro-batches
    w.grad = start.clone()
    buffer = w.grad
    loss = _loss(case, h, w)
    with _LargestNewTensor() as largest:
        loss.backward()
    assert uses.n == 1 and w.grad is buffer  # in place, no dense gradient handed to autograd
    assert largest.numel < 0.1 * w.numel(), largest.numel  # no [V, H] temporary
    tol = dict(atol=1e-12, rtol=0) if dtype == torch.float64 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(w.grad.double(), (start + gw).double(), **tol)
    torch.testing.assert_close(h.grad, gh, **tol)
    # A second micro-batch adds again.
    _loss(case, h, w).backward()
    torch.testing.assert_close(w.grad.double(), (start + gw + gw).double(), **(tol if dtype == torch.float64 else dict(atol=4e-2, rtol=4e-2)))


def test_tensor_hooks_on_the_weight_see_the_gradient_they_would_without_replay(monkeypatch):
    """Rows added straight into a kept ``.grad`` skipped the weight's hooks: a hook got None (a
    TypeError in the hook) or never saw the rows, so a hook that zeroes the gradient to freeze the
    head left max|W.grad| = 1.7. With hooks present the weight gets the dense gradient."""
    case = make_case(B=3, T=37, V=2000, k=7, H=24, eos=(0,), seed=31)
    uses = _SparseUses(monkeypatch)
    _, dense = _dense(case)
    h, w = _leaf(case.hidden), _leaf(case.weight)
    seen = []
    w.register_hook(lambda g: seen.append(g.clone()) or torch.zeros_like(g))  # records, then freezes the head
    for _ in range(2):  # the second micro-batch finds .grad kept from the first
        _loss(case, h, w).backward()
    assert uses.n == 0 and len(seen) == 2
    for g in seen:
        torch.testing.assert_close(g, dense, atol=1e-12, rtol=0)
    assert w.grad.abs().max() == 0
    after = []
    w2 = _leaf(case.weight)
    w2.register_post_accumulate_grad_hook(lambda p: after.append(p.grad.clone()))
    for _ in range(2):
        _loss(case, _leaf(case.hidden), w2).backward()
    assert uses.n == 0 and len(after) == 2
    torch.testing.assert_close(after[1], 2 * dense, atol=1e-12, rtol=0)


def test_the_dense_gradient_where_the_caller_needs_it(monkeypatch):
    case = make_case(B=3, T=37, V=900, k=7, H=24, eos=(1,), seed=31)
    uses = _SparseUses(monkeypatch)
    gh, gw = _dense(case)
    h, w = _leaf(case.hidden), _leaf(case.weight)
    w.grad = torch.zeros_like(w)
    # torch.autograd.grad returns the gradient: nothing is written into .grad.
    got = torch.autograd.grad(_loss(case, h, w), w)[0]
    torch.testing.assert_close(got, gw, atol=1e-12, rtol=0)
    assert torch.all(w.grad == 0)
    # create_graph: still the first-order gradient, returned.
    got = torch.autograd.grad(_loss(case, h, w), w, create_graph=True)[0]
    torch.testing.assert_close(got.detach(), gw, atol=1e-12, rtol=0)
    # backward(inputs=[h]): the weight's gradient is not accumulated at all.
    _loss(case, h, w).backward(inputs=[h])
    assert torch.all(w.grad == 0)
    torch.testing.assert_close(h.grad, gh, atol=1e-12, rtol=0)
    # No buffer yet (zero_grad(set_to_none=True)): autograd gets the dense gradient.
    w.grad = None
    _loss(case, h, w).backward()
    torch.testing.assert_close(w.grad, gw, atol=1e-12, rtol=0)
    assert uses.n == 0


def test_tied_embedding_with_an_existing_grad(monkeypatch):
    """An embedding that shares the LM-head weight: its own gradient and the rows add up."""
    case = make_case(B=3, T=37, V=900, k=7, H=24, eos=(0,), seed=32)
    uses = _SparseUses(monkeypatch)
    tokens = torch.randint(0, 900, (3, 37), generator=torch.Generator().manual_seed(4))

    def step(weight):
        hidden = torch.tanh(torch.nn.functional.embedding(tokens, weight) + case.hidden)
        return _loss(case, hidden, weight)

    w_ref = _leaf(case.weight)
    (want,) = torch.autograd.grad(step(w_ref) + step(w_ref), w_ref)
    w = _leaf(case.weight)
    step(w).backward()  # micro-batch 1: no buffer yet, dense
    step(w).backward()  # micro-batch 2: rows into .grad
    assert uses.n == 1
    torch.testing.assert_close(w.grad, want, atol=1e-11, rtol=0)


# ---------------------------------------------------------------------------- megatron-core


def _megatron_worker(rank, world_size):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from nemo_replay import get_strategy
    from tests.strategies.megatron import harness as H
    from tests.strategies.megatron.test_strategy import ADVANTAGES, PROMPTS, RESPONSES, TEMPERATURE, TOP_K, make_batch, with_policy_inputs

    uses = _SparseUses()
    out = {}
    rolls = None
    for tp, share, overlap in ((1, False, True), (1, True, True), (2, False, False), (2, True, False)):
        H.init_parallel(tp=tp)
        config = H.make_config(tp=tp)
        model = H.build_model(config, share=share)
        H.load_full_weights(model, tp, rank if tp > 1 else 0)
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap), module=model
        )
        config.no_sync_func = ddp.no_sync  # as megatron's training loop sets it
        if rolls is None:  # sampled once, from the TP=1 model (same weights everywhere)
            prompts = [torch.randint(0, H.VOCAB - 1, (p,), generator=torch.Generator().manual_seed(i)) for i, p in enumerate(PROMPTS)]
            rolls = H.generate(model, prompts, RESPONSES, top_k=TOP_K, temperature=TEMPERATURE, seed=1)
        batches = [make_batch(rolls[:2], PROMPTS[:2], synthetic_eos=0), make_batch(rolls[2:], PROMPTS[2:])]
        strategy = get_strategy("megatron").factory()
        old = strategy.run_role("recompute", ddp, batches, RoleSettings(temperature=TEMPERATURE))
        policy = [with_policy_inputs(b, o.logprobs[:, -b.loss_mask.shape[1]:], a) for b, o, a in zip(batches, old, ADVANTAGES)]
        for source in ("logits", "hidden"):
            ddp.zero_grad_buffer()
            uses.n = 0
            strategy.run_role("policy", ddp, policy, RoleSettings(temperature=TEMPERATURE, source=source),
                              loss_fn=TokenRatioObjective(kl_coef=0.1))
            ddp.finish_grad_sync()
            out[(tp, share, source)] = {
                "main_grad": {n: p.main_grad.clone() for n, p in model.named_parameters()},
                "stray_grads": [n for n, p in model.named_parameters() if p.grad is not None],
                "sparse_uses": uses.n,
            }
    return out


def test_megatron_main_grad_receives_the_rows():
    pytest.importorskip("megatron.core")
    ranks = run_workers(_megatron_worker, 2)
    for rank, res in enumerate(ranks):
        for tp, share in ((1, False), (1, True), (2, False), (2, True)):
            where = f"rank {rank}, tp {tp}, tied {share}"
            hidden, logits = res[(tp, share, "hidden")], res[(tp, share, "logits")]
            assert hidden["sparse_uses"] == 2 and logits["sparse_uses"] == 0, where  # one per micro-batch
            assert hidden["stray_grads"] == [] and logits["stray_grads"] == [], where
            head = next(n for n in hidden["main_grad"] if "output_layer" in n or "word_embeddings" in n)
            assert hidden["main_grad"][head].abs().sum() > 0, where
            for name, g in hidden["main_grad"].items():
                torch.testing.assert_close(g, logits["main_grad"][name], atol=2e-6, rtol=1e-5, msg=f"{where}, {name}")


# ---------------------------------------------------------------------------- FSDP2


def _fsdp_worker(rank, world_size, batches, device="cpu"):
    """(Also the CUDA check of tests/gpu/test_cuda_paths.py: one NCCL rank, ``device="cuda"``.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from nemo_replay.strategies.fsdp import FSDPStrategy
    from tests.strategies.fsdp.fixtures import tiny_llama

    uses = _SparseUses()
    model = tiny_llama(seed=3).to(device)
    batches = [b.to(device) for b in batches]
    mesh = init_device_mesh(device, (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    strategy = FSDPStrategy()
    out = {}
    for regime in ("default", "no_sync"):
        for source in ("logits", "hidden"):
            uses.n = 0
            settings, objective = RoleSettings(temperature=0.7, source=source), TokenRatioObjective(kl_coef=0.1)
            if regime == "default":
                strategy.run_role("policy", model, batches, settings, loss_fn=objective)
            else:  # gradient accumulation without a reduce-scatter per micro-batch
                model.set_requires_gradient_sync(False)
                strategy.run_role("policy", model, batches[:1], settings, loss_fn=objective)
                model.set_requires_gradient_sync(True)
                strategy.run_role("policy", model, batches[1:], settings, loss_fn=objective)
            grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).cpu() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            out[(regime, source)] = {"grads": grads, "sparse_uses": uses.n}
    return out


def test_fsdp2_dense_by_default_rows_under_no_sync_accumulation():
    from tests.strategies.fsdp.fixtures import BATCH_A, BATCH_B, make_batch, plain_copy, tiny_llama, with_old_and_ref

    ref = plain_copy(tiny_llama(seed=3))
    batches = [with_old_and_ref(ref, make_batch(**BATCH_A), 0.7), with_old_and_ref(ref, make_batch(**BATCH_B), 0.7)]
    ranks = run_workers(_fsdp_worker, 2, batches)
    for rank, res in enumerate(ranks):
        assert res[("default", "hidden")]["sparse_uses"] == 0  # FSDP frees the unsharded gradient each backward
        assert res[("no_sync", "hidden")]["sparse_uses"] == 1  # micro-batch 2 finds micro-batch 1's .grad
        for regime in ("default", "no_sync"):
            hidden, logits = res[(regime, "hidden")]["grads"], res[(regime, "logits")]["grads"]
            assert hidden["lm_head.weight"].abs().sum() > 0
            for name, g in hidden.items():
                torch.testing.assert_close(g, logits[name], atol=1e-12, rtol=1e-10, msg=f"rank {rank}, {regime}, {name}")
