"""nemo_replay/support/nonzero.py: a mask's indices at a known size, where torch has no
``nonzero_static`` for the device (CUDA before torch 2.6) as where it has.

Against a plain Python reference on masks of every kind, then the whole scorer (logits and hidden
mode, dense, ragged and compact rows, forward and backward) with torch's operation refused as
torch 2.5 refuses it on CUDA: the same log-probs and gradients bit for bit, and still one host
read per call.
"""

from __future__ import annotations

import sys

import pytest
import torch

from nemo_replay.support import nonzero as nz


def _reference(values, size, fill):
    at = [i for i, v in enumerate(values) if v != 0][:size]
    return at + [fill] * (size - len(at))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int64])
def test_both_forms_give_the_reference_s_indices(dtype):
    g = torch.Generator().manual_seed(7)
    for n in (0, 1, 5, 64, 1000):
        for density in (0.0, 0.1, 0.5, 1.0):
            raw = (torch.rand(n, generator=g) < density).to(torch.int64) * torch.randint(1, 4, (n,), generator=g)
            mask = raw.to(dtype)
            count = int((raw != 0).sum())
            for size in sorted({0, 1, count // 2, count, count + 3}):
                for fill in (-1, n, 12345):
                    want = _reference(raw.tolist(), size, fill)
                    for form in (nz.nonzero_static, nz.nonzero_static_portable):
                        got = form(mask, size, fill_value=fill)
                        assert got.dtype == torch.int64 and got.tolist() == want, (form.__name__, n, density, size, fill)


def test_a_mask_of_more_than_one_dimension_is_refused_by_name():
    with pytest.raises(ValueError, match=r"expected a 1-D mask, got shape \(2, 3\); flatten it first"):
        nz.nonzero_static(torch.ones(2, 3, dtype=torch.bool), 4)


def _refuse(monkeypatch):
    """``torch.nonzero_static`` raising as torch 2.4 and 2.5 raise on a CUDA tensor; returns the
    list of the modules whose calls the portable form served."""
    def missing(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::nonzero_static' with arguments from the 'CUDA' backend.")

    calls, portable = [], nz.nonzero_static_portable

    def counted(*args, **kwargs):
        calls.append(sys._getframe(2).f_globals["__name__"])  # who asked nonzero.nonzero_static
        return portable(*args, **kwargs)

    nz._torch_has_it.cache_clear()
    monkeypatch.setattr(torch, "nonzero_static", missing)
    monkeypatch.setattr(nz, "nonzero_static_portable", counted)
    return calls


def test_the_scorer_without_torch_s_nonzero_static_scores_bit_for_bit_with_one_read(monkeypatch):
    """Every place the package asks for a mask's indices (the scorer's plan, the hidden-mode weight
    gradient's runs, the compact decode's set bits) on a torch without the operation."""
    from benchmarks.syncs import count_reads
    from benchmarks.workloads import channels, hidden_inputs, logits_input, support_rows
    from nemo_replay.scoring.scorer import score_aligned_support
    from nemo_replay.support.codec import CompactRows, encode_support
    from nemo_replay.support.ragged import RaggedSupport

    T, V, H, k = 64, 512, 16, 8
    ch = channels(support_rows(T, V, k), vocab_size=V)
    logits = logits_input(T, V, torch.float32).requires_grad_()
    # bfloat16 weights: the weight gradient goes by runs of ids (projection._runs), not one bag a row
    hidden, weight = (t.to(torch.bfloat16).requires_grad_() for t in hidden_inputs(T, V, H, torch.float32))
    ragged = RaggedSupport.from_padded(ch.support)
    compact = CompactRows([encode_support(ragged[[i]], vocab_size=V) for i in range(ragged.batch_size)])
    loss_mask = ch.loss_mask.clone()
    loss_mask.view(-1)[::5] = False  # positions the plan leaves out: it picks the scored ones by index
    args = (ch.sampled, ch.row_ids, loss_mask)
    calls = {
        "logits": (lambda: score_aligned_support(logits, *args, ch.support), (logits,)),
        "logits, compact rows": (lambda: score_aligned_support(logits, *args, compact), (logits,)),
        "hidden": (lambda: score_aligned_support(hidden, *args, ch.support, lm_head_weight=weight), (hidden, weight)),
        "hidden, ragged rows": (lambda: score_aligned_support(hidden, *args, ragged, lm_head_weight=weight),
                                (hidden, weight)),
    }

    def run():
        out = {}
        for name, (fn, inputs) in calls.items():
            lp = fn().logprobs
            grads = torch.autograd.grad((lp * torch.linspace(0.5, 1.5, lp.numel())).sum(), inputs)
            fwd, bwd = count_reads(lambda: fn().logprobs.sum())
            out[name] = (lp.detach(), grads, dict(fwd.where), dict(bwd.where))
        return out

    assert nz._torch_has_it("cpu")  # torch 2.13 has it on the CPU: the first run is torch's form
    want = run()
    portable_calls = _refuse(monkeypatch)
    assert not nz._torch_has_it("cpu")
    got = run()
    assert set(portable_calls) == {"nemo_replay.scoring.plan", "nemo_replay.support.codec.decode",
                                   "nemo_replay.scoring.projection"}, portable_calls
    for name in calls:
        assert torch.equal(got[name][0], want[name][0]), name
        assert all(torch.equal(g, w) for g, w in zip(got[name][1], want[name][1])), name
        # No host read of its own: the scorer's one read (and, on the CPU, the bfloat16 table's unique)
        assert got[name][2:] == want[name][2:], (name, got[name][2:], want[name][2:])
        assert sum(got[name][2].values()) == 1 + (name.startswith("hidden")), got[name][2]
    assert not torch.equal(want["logits"][0], torch.roll(want["logits"][0], 1))  # distinct rows: a swap would show
    nz._torch_has_it.cache_clear()
