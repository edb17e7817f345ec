"""CUDA paths beyond the scorer's values (tests/scoring/test_scorer_devices.py holds those): host
synchronisations per call on a real stream, and hidden mode's LM-head rows into a kept ``.grad``
and into megatron-core's ``main_grad``, against the float64 CPU reference.

``gpu``-marked: skipped without CUDA; ``bash scripts/gpu_check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from nemo_replay import score_aligned_support
from tests.scoring.batches import make_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _case():
    return make_case(B=4, T=64, V=4096, k=16, H=64, seed=3, eos=(2,))


def _channels(case, device):
    return [t.to(device) for t in (case.sampled_ids, case.row_ids, case.loss_mask)] + [case.support.to(device)]


def _synchronisations(fn):
    """(result, how many synchronising CUDA calls ``fn`` made), by torch's sync debug mode. Only its
    per-call warning counts: torch 2.11 also warns once a process, on the first switch to the mode,
    that the mode "is a prototype feature" ("Synchronization" matched that too)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


@pytest.mark.parametrize("source", ["logits", "hidden"])
def test_one_host_read_in_the_forward_and_none_in_the_hidden_backward(source):
    case, device = _case(), "cuda"
    channels = _channels(case, device)
    if source == "hidden":
        h = case.hidden.to(device, torch.float32).requires_grad_()
        w = case.weight.to(device, torch.float32).requires_grad_()
        call = lambda: score_aligned_support(h, *channels, lm_head_weight=w).logprobs.sum()  # noqa: E731
    else:
        z = case.logits.to(device, torch.float32).requires_grad_()
        call = lambda: score_aligned_support(z, *channels).logprobs.sum()  # noqa: E731
    call().backward()  # warm-up: caches, the support's check record
    loss, forward = _synchronisations(call)
    _, backward = _synchronisations(loss.backward)
    assert forward == 1, forward
    if source == "hidden":
        assert backward == 0, backward


@pytest.mark.parametrize("buffer", [".grad", "main_grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_lm_head_rows_land_in_the_kept_buffer_as_the_float64_gradient(buffer, dtype):
    case = _case()
    # The float64 reference on the CPU: the dense gradient of the same loss.
    w64 = case.weight.clone().requires_grad_()
    score_aligned_support(case.hidden, *_channels(case, "cpu"), lm_head_weight=w64).logprobs.sum().backward()
    device = "cuda"
    h = case.hidden.to(device, dtype)
    w = torch.nn.Parameter(case.weight.to(device, dtype))
    kept = torch.ones_like(w, dtype=torch.float32 if buffer == "main_grad" else dtype)
    if buffer == ".grad":
        w.grad = kept.clone()
    else:  # megatron-core's DDP: a float32 buffer the backward adds into, .grad left None
        w.main_grad, w.grad_added_to_main_grad = kept.clone(), False
    score_aligned_support(h, *_channels(case, device), lm_head_weight=w).logprobs.sum().backward()
    got = (w.grad if buffer == ".grad" else w.main_grad).double().cpu() - 1
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, w64.grad, atol=tol, rtol=tol)


def test_an_fsdp2_policy_step_over_nccl_on_one_rank():
    """The fsdp strategy's policy pass on a FSDP2-sharded tiny Llama (float64) over one NCCL rank,
    hidden mode against logits mode, both regimes of tests/scoring/test_lm_head_grad.py."""
    from tests.scoring.test_lm_head_grad import _fsdp_worker
    from tests.spawn import run_workers
    from tests.strategies.fsdp.fixtures import BATCH_A, BATCH_B, make_batch, plain_copy, tiny_llama, with_old_and_ref

    ref = plain_copy(tiny_llama(seed=3))
    batches = [with_old_and_ref(ref, make_batch(**BATCH_A), 0.7), with_old_and_ref(ref, make_batch(**BATCH_B), 0.7)]
    (res,) = run_workers(_fsdp_worker, 1, batches, "cuda", device="cuda")
    for regime in ("default", "no_sync"):
        hidden, logits = res[(regime, "hidden")]["grads"], res[(regime, "logits")]["grads"]
        assert hidden["lm_head.weight"].abs().sum() > 0
        for name, g in hidden.items():
            torch.testing.assert_close(g, logits[name], atol=1e-10, rtol=1e-8, msg=f"{regime}, {name}")


def test_compact_rows_decode_on_the_device_with_one_host_read_and_score_as_on_the_cpu():
    """CompactRows handed to the scorer on CUDA: decoded there (the same rows as the CPU decode) with
    no synchronisation of its own, the forward's one host read unchanged, scores equal to the CPU's from the same rows; a forged buffer
    whose rows do not decode is named through that read, with no device-side assert."""
    import struct

    import numpy as np

    from nemo_replay.support.codec import CodecError, CompactRows, encode_support, fused, header
    from nemo_replay.support.ragged import RaggedSupport

    case = _case()
    ragged = RaggedSupport.from_padded(case.support)
    buffers = [encode_support(ragged[[i]], vocab_size=4096) for i in range(ragged.batch_size)]
    compact = CompactRows(buffers, labels=[f"sample {i}" for i in range(len(buffers))])
    on_cpu = compact.decode("cpu")
    # The reference's array steps and, where Triton imports, the fused kernels (the default on CUDA).
    for mode in (False, True) if fused.importable() else (False,):
        on_gpu = compact.decode("cuda", fused=mode)
        assert torch.equal(on_gpu.values.cpu(), on_cpu.values) and not bool(on_gpu.decode_flag), mode
        # The decode alone: one copy from pinned memory, no synchronisation (a pageable copy would wait
        # for the stream); host-side sampled ids take the same path.
        _, syncs = _synchronisations(lambda: compact.decode("cuda", fused=mode))
        assert syncs == 0, (mode, syncs)
        kept = CompactRows(buffers, sampled_ids=torch.zeros(compact.num_rows, dtype=torch.long))  # on the host
        kept.decode("cuda", fused=mode)  # warm-up: the pinned block is allocated once, the kernels compiled
        _, syncs = _synchronisations(lambda: kept.decode("cuda", fused=mode))
        assert syncs == 0, (mode, syncs)
    channels = [t.to("cuda") for t in (case.sampled_ids, case.row_ids, case.loss_mask)]
    z = case.logits.to("cuda", torch.float32)
    score_aligned_support(z, *channels, compact)  # warm-up
    got, reads = _synchronisations(lambda: score_aligned_support(z, *channels, compact))
    assert reads == 1, reads
    want = score_aligned_support(z.cpu(), *[t.cpu() for t in channels], on_cpu)
    torch.testing.assert_close(got.logprobs.cpu(), want.logprobs, atol=1e-5, rtol=0)
    head = list(header.HEAD.unpack(buffers[1][:header.HEAD.size].tobytes()))
    head[9], head[10] = head[9] - 1, 0  # a row width the widest row decodes past (CRC recomputed)
    bad = np.concatenate([np.frombuffer(header.HEAD.pack(*head), np.uint8), buffers[1][header.HEAD.size:]])
    bad[header.CRC_AT:header.CRC_AT + 4] = np.frombuffer(struct.pack("<I", header.crc(bad)), np.uint8)
    with pytest.raises(CodecError, match=r"sample 1: compact support: row \d+ decodes to"):
        score_aligned_support(z, *channels, CompactRows([buffers[0], bad, *buffers[2:]],
                                                         labels=[f"sample {i}" for i in range(len(buffers))]))
    torch.cuda.synchronize()  # the stream is still usable: nothing read out of bounds


def test_ids_past_the_vocabulary_in_hidden_mode_are_logits_mode_s_named_error_and_no_device_assert():
    """An id >= V in a scored row, hidden mode with a trainable LM head: the weight gradient's run histogram
    (counted before the guards' read) indexed past its V + 1 bins, a device-side assert that left the
    process's CUDA context unusable. Now the error logits mode gives, naming the row on the device the
    rows sit on, and the context serves on."""
    from nemo_replay import PackedTensor, RaggedSupport
    from nemo_replay.support.codec import CompactRows, encode_support

    device, V = "cuda", 10
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(1, 3, 4, generator=g).to(device), torch.randn(V, 4, generator=g).to(device)
    channels = [torch.tensor([[1, 2, 3]], device=device), torch.tensor([[0, 1, 2]], device=device),
                torch.ones(1, 3, dtype=torch.bool, device=device)]
    for x, validate, compact in ((12, True, False), (12, False, False), (1000, False, False), (12, True, True)):
        rows = PackedTensor(torch.tensor([[1, x, -1], [2, 4, -1], [3, -1, -1]], dtype=torch.int32), [0, 3])
        support = CompactRows([encode_support(RaggedSupport.from_padded(rows), vocab_size=x + 1)]) if compact else rows.to(device)
        with pytest.raises(ValueError) as logits:
            score_aligned_support(h @ w.T, *channels, support, validate=validate)
        with pytest.raises(ValueError) as hidden:
            score_aligned_support(h.requires_grad_(), *channels, support, lm_head_weight=w.requires_grad_(), validate=validate)
        assert (type(hidden.value), str(hidden.value)) == (type(logits.value), str(logits.value))
        assert str(x) in str(logits.value) and "row 0" in str(logits.value), str(logits.value)
    assert torch.ones(3, device=device).sum().item() == 3
