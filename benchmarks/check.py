"""Correctness gate run before any timing: the scorer against a dense float64 reference.

A small ragged batch (left padding, -1-padded rows of varying length, a loss-inactive
position, a synthetic EOS scored over the whole vocabulary, temperature 0.7), and a batch
whose positions use every row once in order, are scored in logits mode and hidden mode, in
float64, float32 and bfloat16, with and without entropy. Values and gradients (w.r.t.
logits, or hidden states and LM-head weight) are compared with

    z = hidden @ weight.T  (float64, from the same rounded inputs)
    logp = z[x]/T - logsumexp over the row's members (every id for the EOS) of z/T
    entropy = -sum p log p over the same set

built with dense masks, nothing shared with the scorer. ``python -m benchmarks.check``
prints the largest errors and exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch

from nemo_replay.scoring.scorer import score_aligned_support
from nemo_replay.support.packed import PackedTensor

__all__ = ["run_checks"]

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-5}


def _batch(seed: int = 0, B: int = 3, S: int = 29, V: int = 301, H: int = 16, k: int = 9):
    """Positions [B, S]; trajectory b's response (rows) occupies its last R_b columns."""
    g = torch.Generator().manual_seed(seed)
    lengths = [11, 7, 16]  # response rows per trajectory
    row_ids = torch.full((B, S), -1, dtype=torch.int64)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    sampled = torch.randint(0, V, (B, S), generator=g)
    rows, base = [], 0
    for b, R in enumerate(lengths):
        for j in range(R):
            col = S - R + j
            width = int(torch.randint(2, k + 1, (1,), generator=g))
            members = torch.randperm(V, generator=g)[:width]
            rows.append(torch.cat([members, torch.full((k - width,), -1)]))
            row_ids[b, col] = base + j
            loss_mask[b, col] = True
            sampled[b, col] = members[int(torch.randint(0, width, (1,), generator=g))]
        base += R
    values = torch.stack(rows).to(torch.int32)
    loss_mask[0, S - 5] = False  # a loss-inactive response position
    eos_row = int(row_ids[1, S - 1])
    values[eos_row] = -1  # trajectory 1 ends with a synthetic EOS: loss-active, no row
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    hidden = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.6
    return hidden, weight, sampled, row_ids, loss_mask, PackedTensor(values, cu)


def _in_order_batch(seed: int = 4, N: int = 23, V: int = 97, H: int = 8, k: int = 6):
    """Positions [N] where position p uses row p (every row once, in order), ragged rows."""
    g = torch.Generator().manual_seed(seed)
    rows, sampled = [], []
    for _ in range(N):
        width = int(torch.randint(1, k + 1, (1,), generator=g))
        members = torch.randperm(V, generator=g)[:width]
        rows.append(torch.cat([members, torch.full((k - width,), -1)]))
        sampled.append(int(members[int(torch.randint(0, width, (1,), generator=g))]))
    values = torch.stack(rows).to(torch.int32)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    return (hidden, weight, torch.tensor(sampled), torch.arange(N), torch.ones(N, dtype=torch.bool),
            PackedTensor(values, [0, N]))


def _reference(z, sampled, row_ids, loss_mask, values, temperature):
    """Dense float64 log-probs and entropies, zero where not scored. z: (B, S, V)."""
    V = z.shape[-1]
    zf = z.reshape(-1, V) / temperature
    rows = row_ids.reshape(-1)
    member = torch.zeros(zf.shape, dtype=torch.bool)
    has_row = torch.zeros(zf.shape[0], dtype=torch.bool)
    for p in range(zf.shape[0]):
        r = int(rows[p])
        ids = values[r][values[r] >= 0].long() if r >= 0 else torch.zeros(0, dtype=torch.int64)
        if ids.numel():
            member[p, ids] = True
            has_row[p] = True
    member[~has_row] = True  # no row: the whole vocabulary (synthetic EOS)
    masked = zf.masked_fill(~member, float("-inf"))
    logp_all = masked - torch.logsumexp(masked, 1, keepdim=True)
    logp = logp_all.gather(1, sampled.reshape(-1, 1)).squeeze(1)
    p = torch.exp(logp_all)
    ent = -(p * logp_all.masked_fill(~member, 0)).sum(1)
    active = loss_mask.reshape(-1)
    shape = sampled.shape
    return torch.where(active, logp, 0).view(shape), torch.where(active, ent, 0).view(shape)


def _compare(name, got, want, tol, errors, report):
    err = float((got.detach().double() - want.detach()).abs().max()) if got.numel() else 0.0
    scale = float(want.detach().abs().max()) if want.numel() else 1.0
    report.append(f"{name:52s} max abs err {err:.2e}")
    if not err <= tol * max(1.0, scale):
        errors.append(f"{name}: max abs err {err:.3e} > {tol:.1e} x {max(1.0, scale):.2f}")


def run_checks(verbose: bool = False) -> list[str]:
    """Return a list of mismatches (empty when the scorer agrees with the reference)."""
    errors, report = [], []
    for name, batch in (("ragged", _batch()), ("in-order", _in_order_batch())):
        _check_batch(name, batch, errors, report)
    if verbose:
        print("\n".join(report))
    return errors


def _check_batch(batch_name, batch, errors, report) -> None:
    hidden64, weight64, sampled, row_ids, loss_mask, support = batch
    g = torch.Generator().manual_seed(1)
    c_lp = torch.randn(sampled.shape, generator=g, dtype=torch.float64)
    temperature = 0.7
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for entropy in (True, False):
            # Loss = sum(c_lp * logp) (+ sum(c_ent * entropy)): both code paths of the scorer.
            c_ent = torch.randn(sampled.shape, generator=g, dtype=torch.float64) if entropy else None
            tag = f"{batch_name} {str(dtype).replace('torch.', '')}{' +entropy' if entropy else ''}"
            _check_one(tag, dtype, hidden64, weight64, sampled, row_ids, loss_mask, support, temperature, c_lp, c_ent,
                       errors, report)


def _loss(lp, ent, c_lp, c_ent):
    loss = (lp.double() * c_lp).sum()
    return loss if c_ent is None else loss + (ent.double() * c_ent).sum()


def _check_one(tag, dtype, hidden64, weight64, sampled, row_ids, loss_mask, support, temperature, c_lp, c_ent,
               errors, report) -> None:
    tol = TOLERANCE[dtype]
    gtol = tol if dtype != torch.bfloat16 else 2**-7  # bf16 gradients: relative rounding 2**-8
    entropy = c_ent is not None
    hid, wt = hidden64.to(dtype), weight64.to(dtype)
    # The reference sees the same rounded inputs, in float64.
    h_ref = hid.double().requires_grad_()
    w_ref = wt.double().requires_grad_()
    z_ref = h_ref @ w_ref.t()
    lp_ref, ent_ref = _reference(z_ref, sampled, row_ids, loss_mask, support.values, temperature)
    gz_ref, gh_ref, gw_ref = torch.autograd.grad(_loss(lp_ref, ent_ref, c_lp, c_ent), (z_ref, h_ref, w_ref))

    # logits mode, from logits rounded to the dtype (the reference on those rounded logits)
    logits = (hid.double() @ wt.double().t()).to(dtype)
    zl = logits.double().requires_grad_()
    lp_ref_l, ent_ref_l = _reference(zl, sampled, row_ids, loss_mask, support.values, temperature)
    gz_ref = torch.autograd.grad(_loss(lp_ref_l, ent_ref_l, c_lp, c_ent), zl)[0]
    src = logits.clone().requires_grad_()
    out = score_aligned_support(src, sampled, row_ids, loss_mask, support, temperature=temperature,
                                compute_entropy=entropy)
    gsrc = torch.autograd.grad(_loss(out.logprobs, out.entropy, c_lp, c_ent), src)[0]
    _compare(f"logits {tag} logprobs", out.logprobs, lp_ref_l, tol, errors, report)
    if entropy:
        _compare(f"logits {tag} entropy", out.entropy, ent_ref_l, tol, errors, report)
    _compare(f"logits {tag} grad logits", gsrc, gz_ref, gtol, errors, report)
    if not torch.equal(src.detach(), logits):
        errors.append(f"logits {tag}: the scorer modified its input")

    # hidden mode
    h = hid.clone().requires_grad_()
    w = wt.clone().requires_grad_()
    out = score_aligned_support(
        h, sampled, row_ids, loss_mask, support, lm_head_weight=w, temperature=temperature,
        compute_entropy=entropy, chunk_size=40,  # several chunks of pairs and of vocabulary rows
    )
    gh, gw = torch.autograd.grad(_loss(out.logprobs, out.entropy, c_lp, c_ent), (h, w))
    _compare(f"hidden {tag} logprobs", out.logprobs, lp_ref, tol, errors, report)
    if entropy:
        _compare(f"hidden {tag} entropy", out.entropy, ent_ref, tol, errors, report)
    _compare(f"hidden {tag} grad hidden", gh, gh_ref, gtol, errors, report)
    _compare(f"hidden {tag} grad weight", gw, gw_ref, gtol, errors, report)
    if gw.dtype != wt.dtype or gh.dtype != hid.dtype:
        errors.append(f"hidden {tag}: gradient dtypes {gh.dtype}, {gw.dtype}")
    if not (torch.equal(h.detach(), hid) and torch.equal(w.detach(), wt)):
        errors.append(f"hidden {tag}: the scorer modified its input")


if __name__ == "__main__":
    problems = run_checks(verbose=True)
    print("\n".join(problems) if problems else "scorer matches the float64 reference")
    sys.exit(1 if problems else 0)
