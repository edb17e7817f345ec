"""score_aligned_support against the float64 dense-loop reference (tests/scoring/reference.py).

Odd, ragged batches (B=3, T=37, V=423, k=7, rows of 1..7 distinct ids, observation rows,
a synthetic EOS), both source modes, both support forms, forward and backward.
"""

from __future__ import annotations

import pytest
import torch

from nemo_replay import PackedTensor, RaggedSupport, score_aligned_support, score_full_vocabulary
from tests.scoring.batches import make_case
from tests.scoring.reference import reference_scores

ATOL = 1e-10  # float64 scorer vs float64 loop: both exact up to a few ulps of O(10) numbers


def _weights(shape, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g, dtype=torch.float64) + 0.5, torch.rand(shape, generator=g, dtype=torch.float64) - 0.5


def _loss(lp, ent, shape):
    w1, w2 = _weights(shape)
    return (lp.double() * w1).sum() + (ent.double() * w2).sum()


def _support_form(case, form):
    if form == "packed":
        return case.support
    if form == "tensor":
        return case.support.values
    if form == "ragged":
        # Same sets, members in a different order per row: the scores must not change.
        g = torch.Generator().manual_seed(3)
        shuffled = [[row[i] for i in torch.randperm(len(row), generator=g).tolist()] for row in case.sets]
        segs, start = [], 0
        for n in case.support.lengths.tolist():
            segs.append(shuffled[start : start + n])
            start += n
        return RaggedSupport.from_rows(segs)
    raise AssertionError(form)


def _reference(case, logits, temperature):
    return reference_scores(logits, case.sampled_ids, case.row_ids, case.loss_mask, case.sets, temperature=temperature)


@pytest.mark.parametrize("form", ["packed", "tensor", "ragged"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("eos_without_row_id", [False, True])
def test_logits_mode_matches_reference(form, temperature, eos_without_row_id):
    case = make_case(eos=(0, 1), eos_without_row_id=eos_without_row_id, seed=1)
    shape = case.loss_mask.shape
    src = case.logits.clone().requires_grad_()
    out = score_aligned_support(
        src, case.sampled_ids, case.row_ids, case.loss_mask, _support_form(case, form),
        temperature=temperature, compute_entropy=True, compute_support_mass=True,
    )
    (g,) = torch.autograd.grad(_loss(out.logprobs, out.entropy, shape), src)

    ref_src = case.logits.clone().requires_grad_()
    ref = _reference(case, ref_src, temperature)
    (g_ref,) = torch.autograd.grad(_loss(ref["logprobs"], ref["entropy"], shape), ref_src)

    assert out.logprobs.dtype == torch.float64
    assert torch.equal(out.valid_mask, ref["valid"])
    assert torch.equal(out.fallback_mask, ref["fallback"])
    assert int(out.fallback_mask.sum()) == 2  # the two synthetic EOS positions
    torch.testing.assert_close(out.logprobs, ref["logprobs"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.entropy, ref["entropy"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.support_logmass, ref["logmass"], atol=ATOL, rtol=0)
    torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)
    # Nothing scored outside the loss mask, and the scores are real log-probs.
    assert torch.all(out.logprobs[~case.loss_mask] == 0)
    assert torch.all(out.logprobs[case.loss_mask] <= 0)  # 0 exactly on single-member rows
    assert torch.all(g[~case.loss_mask] == 0)


@pytest.mark.parametrize("chunk_size", [1, 3, None])
@pytest.mark.parametrize("every_position", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_support_mass_in_row_blocks_matches_reference(chunk_size, every_position, dtype):
    """Logits mode reads the full rows for the support mass block by block (at most ``chunk_size``
    positions each): blocks of 1 and 3 positions and the default, with unscored positions (the
    scored rows picked) and with every position scored over a row (the rows sliced), in every
    dtype, equal the float64 loop on the same rounded logits; values and gradients."""
    case = make_case(eos=(1,), seed=12, masked_vocab=30)
    if every_position:
        members = [r >= 0 and len(case.sets[r]) > 0 for r in case.row_ids.flatten().tolist()]
        keep = case.loss_mask & torch.tensor(members).view(case.row_ids.shape)
        logits, sampled, rows = case.logits[keep], case.sampled_ids[keep], case.row_ids[keep]
        lmask = torch.ones_like(sampled, dtype=torch.bool)
    else:
        logits, sampled, rows, lmask = case.logits, case.sampled_ids, case.row_ids, case.loss_mask
    src = logits.to(dtype).requires_grad_()
    out = score_aligned_support(src, sampled, rows, lmask, case.support, temperature=0.7, compute_entropy=True,
                                compute_support_mass=True, chunk_size=chunk_size)
    (g,) = torch.autograd.grad(_loss(out.logprobs, out.entropy, lmask.shape), src)
    ref_src = src.detach().double().requires_grad_()
    ref = reference_scores(ref_src, sampled, rows, lmask, case.sets, temperature=0.7)
    (g_ref,) = torch.autograd.grad(_loss(ref["logprobs"], ref["entropy"], lmask.shape), ref_src)
    tol = ATOL if dtype == torch.float64 else 1e-5  # float32 math on the rounded logits
    assert bool(out.valid_mask.all()) == every_position
    for got, want in ((out.logprobs, ref["logprobs"]), (out.entropy, ref["entropy"]), (out.support_logmass, ref["logmass"])):
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
    bf16 = dtype == torch.bfloat16  # gradients rounded to bf16: relative 2**-8
    torch.testing.assert_close(g.double(), g_ref, atol=2**-8 if bf16 else tol, rtol=2**-7 if bf16 else 0)


@pytest.mark.parametrize("form", ["packed", "ragged"])
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_hidden_mode_matches_reference(form, chunk_size):
    case = make_case(eos=(1, 2), seed=2)
    shape = case.loss_mask.shape
    temperature = 0.8
    h, w = case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_()
    out = score_aligned_support(
        h, case.sampled_ids, case.row_ids, case.loss_mask, _support_form(case, form),
        lm_head_weight=w, temperature=temperature, compute_entropy=True, chunk_size=chunk_size,
    )
    gh, gw = torch.autograd.grad(_loss(out.logprobs, out.entropy, shape), (h, w))

    h_ref, w_ref = case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_()
    ref = _reference(case, h_ref @ w_ref.T, temperature)
    gh_ref, gw_ref = torch.autograd.grad(_loss(ref["logprobs"], ref["entropy"], shape), (h_ref, w_ref))

    assert out.logprobs.dtype == torch.float64 and out.support_logmass is None
    assert torch.equal(out.valid_mask, ref["valid"]) and torch.equal(out.fallback_mask, ref["fallback"])
    assert int(out.fallback_mask.sum()) == 2
    torch.testing.assert_close(out.logprobs, ref["logprobs"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.entropy, ref["entropy"], atol=ATOL, rtol=0)
    torch.testing.assert_close(gh, gh_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(gw, gw_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("hidden", [False, True])
def test_full_rows_skip_the_padding_mask_and_still_match_reference(hidden):
    """When no scored row holds padding (each row's least id >= 0) the plan drops the presence mask
    and gathers the ids as they are; scored here: the full-width rows only, among masked positions
    whose rows are padded, so only the scored rows decide. Values and gradients, both modes."""
    case = make_case(eos=(), seed=5, k=4)
    full = torch.tensor([r >= 0 and len(case.sets[r]) == 4 for r in case.row_ids.flatten().tolist()])
    lmask = case.loss_mask & full.view(case.row_ids.shape)
    assert int(lmask.sum()) >= 5 and bool((case.loss_mask & ~lmask).any())  # padded rows stay, unscored
    shape, temperature = lmask.shape, 0.9
    if hidden:
        h, w = case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_()
        out = score_aligned_support(h, case.sampled_ids, case.row_ids, lmask, case.support, lm_head_weight=w,
                                    temperature=temperature, compute_entropy=True)
        got = torch.autograd.grad(_loss(out.logprobs, out.entropy, shape), (h, w))
        h_ref, w_ref = case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_()
        ref_inputs, ref_src = (h_ref, w_ref), h_ref @ w_ref.T
    else:
        src = case.logits.clone().requires_grad_()
        out = score_aligned_support(src, case.sampled_ids, case.row_ids, lmask, case.support,
                                    temperature=temperature, compute_entropy=True)
        got = torch.autograd.grad(_loss(out.logprobs, out.entropy, shape), src)
        ref_src = case.logits.clone().requires_grad_()
        ref_inputs = (ref_src,)
    ref = reference_scores(ref_src, case.sampled_ids, case.row_ids, lmask, case.sets, temperature=temperature)
    want = torch.autograd.grad(_loss(ref["logprobs"], ref["entropy"], shape), ref_inputs)
    assert torch.equal(out.valid_mask, lmask) and not out.fallback_mask.any()
    torch.testing.assert_close(out.logprobs, ref["logprobs"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.entropy, ref["entropy"], atol=ATOL, rtol=0)
    for g, g_ref in zip(got, want):
        torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)


def test_fixed_width_and_ragged_give_identical_scores_and_grads():
    case = make_case(eos=(2,), seed=3, k=9)
    results = []
    for support in (case.support, RaggedSupport.from_padded(case.support), _support_form(case, "ragged")):
        src = case.logits.clone().requires_grad_()
        out = score_aligned_support(src, case.sampled_ids, case.row_ids, case.loss_mask, support, compute_entropy=True)
        (g,) = torch.autograd.grad(_loss(out.logprobs, out.entropy, case.loss_mask.shape), src)
        results.append((out.logprobs, out.entropy, g))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_swapped_rows_change_the_answer():
    """Distinct ids per row: swapping two rows' contents changes exactly those positions."""
    case = make_case(eos=(), seed=4)
    base = score_aligned_support(case.logits, *case.channels()).logprobs
    # The last two loss-active positions of trajectory 0 that carry rows of >= 2 members.
    cols = [t for t in range(case.row_ids.shape[1])
            if case.loss_mask[0, t] and len(case.sets[int(case.row_ids[0, t])]) >= 2][-2:]
    a, b = (int(case.row_ids[0, t]) for t in cols)
    vals = case.support.values.clone()
    vals[[a, b]] = vals[[b, a]]
    sampled = case.sampled_ids.clone()
    sampled[0, cols[0]], sampled[0, cols[1]] = int(vals[a, 0]), int(vals[b, 0])
    swapped = score_aligned_support(case.logits, sampled, case.row_ids, case.loss_mask,
                                    PackedTensor(vals, case.support.cu_seqlens)).logprobs
    ref = reference_scores(case.logits, sampled, case.row_ids, case.loss_mask,
                           [case.sets[b] if r == a else case.sets[a] if r == b else s for r, s in enumerate(case.sets)])
    torch.testing.assert_close(swapped, ref["logprobs"], atol=ATOL, rtol=0)
    changed = (swapped - base).abs() > 1e-6
    assert changed[0, cols].all() and int(changed.sum()) == 2


def test_support_mass_is_log_of_kept_softmax_probability():
    case = make_case(eos=(0,), seed=5, masked_vocab=40)
    temperature = 1.3
    out = score_aligned_support(
        case.logits, *case.channels(), temperature=temperature, compute_support_mass=True
    )
    probs = torch.softmax(case.logits / temperature, -1)
    for b, t in torch.nonzero(out.valid_mask).tolist():
        members = case.sets[int(case.row_ids[b, t])]
        expected = torch.log(probs[b, t, members].sum())
        assert abs(float(out.support_logmass[b, t]) - float(expected)) < 1e-12
    assert torch.all(out.support_logmass[~out.valid_mask] == 0)
    assert torch.all(out.support_logmass <= 0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_neg_inf_logits_on_masked_vocab_give_no_nan(temperature):
    case = make_case(eos=(0, 2), seed=6, masked_vocab=60)
    assert torch.isinf(case.logits).any()
    src = case.logits.clone().requires_grad_()
    out = score_aligned_support(
        src, *case.channels(), temperature=temperature, compute_entropy=True, compute_support_mass=True
    )
    (g,) = torch.autograd.grad(_loss(out.logprobs, out.entropy, case.loss_mask.shape), src)
    for t in (out.logprobs, out.entropy, out.support_logmass, g):
        assert not torch.isnan(t).any()
    assert torch.all(g[..., case.masked] == 0)
    ref_src = case.logits.clone().requires_grad_()
    ref = _reference(case, ref_src, temperature)
    (g_ref,) = torch.autograd.grad(_loss(ref["logprobs"], ref["entropy"], case.loss_mask.shape), ref_src)
    torch.testing.assert_close(out.logprobs, ref["logprobs"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.entropy, ref["entropy"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.support_logmass, ref["logmass"], atol=ATOL, rtol=0)
    torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)


def test_packed_positions_with_explicit_trajectory_ids_match_batched():
    """[B, T] positions flattened to [B*T] (a packed sequence) with trajectory ids: same scores."""
    case = make_case(eos=(0, 1, 2), seed=8)
    batched = score_aligned_support(case.logits, *case.channels(), compute_entropy=True)
    V = case.logits.shape[-1]
    flat = score_aligned_support(
        case.logits.reshape(-1, V), case.sampled_ids.reshape(-1), case.row_ids.reshape(-1),
        case.loss_mask.reshape(-1), case.support, trajectory_ids=case.trajectory_ids.reshape(-1),
        compute_entropy=True,
    )
    torch.testing.assert_close(flat.logprobs, batched.logprobs.reshape(-1), atol=0, rtol=0)
    torch.testing.assert_close(flat.entropy, batched.entropy.reshape(-1), atol=0, rtol=0)
    assert int(flat.fallback_mask.sum()) == 3


def test_non_contiguous_logits_slice():
    """Logits with vocabulary padding sliced off (a strided view) score like a contiguous copy."""
    case = make_case(eos=(1,), seed=9)
    wide = torch.cat([case.logits, torch.randn(*case.logits.shape[:-1], 5, dtype=torch.float64)], -1)
    view = wide[..., : case.logits.shape[-1]].requires_grad_()
    assert not view.is_contiguous()
    out = score_aligned_support(view, *case.channels(), compute_entropy=True)
    src = case.logits.clone().requires_grad_()
    ref = score_aligned_support(src, *case.channels(), compute_entropy=True)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=0, rtol=0)
    (g,) = torch.autograd.grad(out.logprobs.sum(), view)
    (g_ref,) = torch.autograd.grad(ref.logprobs.sum(), src)
    torch.testing.assert_close(g, g_ref, atol=0, rtol=0)


@pytest.mark.parametrize("hidden", [False, True])
def test_inputs_are_not_mutated(hidden):
    case = make_case(eos=(0,), seed=10, masked_vocab=0 if hidden else 30)
    src = (case.hidden if hidden else case.logits).clone().requires_grad_()
    weight = case.weight.clone().requires_grad_() if hidden else None
    support = RaggedSupport.from_padded(case.support)
    before = [t.clone() for t in (src, case.sampled_ids, case.row_ids, case.loss_mask, case.trajectory_ids,
                                  case.support.values, support.member_ids, support.row_offsets)]
    if hidden:
        before.append(weight.detach().clone())
    for sup in (case.support, support):
        out = score_aligned_support(
            src, case.sampled_ids, case.row_ids, case.loss_mask, sup, trajectory_ids=case.trajectory_ids,
            lm_head_weight=weight, compute_entropy=True, compute_support_mass=not hidden, temperature=0.9,
        )
        (out.logprobs.sum() + out.entropy.sum()).backward()
    after = [src, case.sampled_ids, case.row_ids, case.loss_mask, case.trajectory_ids,
             case.support.values, support.member_ids, support.row_offsets]
    if hidden:
        after.append(weight)
    for a, b in zip(before, after):
        assert torch.equal(a, b.detach())


def test_output_dtypes_follow_the_compute_dtype():
    case = make_case(eos=(1,), seed=11)
    for dtype, expected in ((torch.float64, torch.float64), (torch.float32, torch.float32),
                            (torch.bfloat16, torch.float32), (torch.float16, torch.float32)):
        out = score_aligned_support(case.logits.to(dtype), *case.channels(), compute_entropy=True,
                                    compute_support_mass=True)
        assert out.logprobs.dtype == expected and out.entropy.dtype == expected
        assert out.support_logmass.dtype == expected
        hid = score_aligned_support(case.hidden.to(dtype), *case.channels(), lm_head_weight=case.weight.to(dtype))
        assert hid.logprobs.dtype == expected


def _naive_same_dtype(z_lowp, sampled, rows, lmask, sets):
    """The naive reference run in the low-precision dtype itself (gather, logsumexp)."""
    return reference_scores(z_lowp, sampled, rows, lmask, sets)["logprobs"]


@pytest.mark.parametrize("hidden", [False, True])
def test_bf16_error_within_naive_bf16_error(hidden):
    """Per position: |scorer(bf16) - truth| <= |naive bf16 loop - truth| + 1e-4.

    Truth is the float64 loop on the same bf16-rounded inputs (ml-cross-entropy's budget).
    """
    case = make_case(eos=(0, 2), seed=12)
    sampled, rows, lmask = case.sampled_ids, case.row_ids, case.loss_mask
    w1, _ = _weights(lmask.shape)
    if hidden:
        h16 = case.hidden.to(torch.bfloat16).requires_grad_()
        w16 = case.weight.to(torch.bfloat16).requires_grad_()
        out = score_aligned_support(h16, sampled, rows, lmask, case.support, lm_head_weight=w16)
        h64, w64 = h16.detach().double().requires_grad_(), w16.detach().double().requires_grad_()
        truth = reference_scores(h64 @ w64.T, sampled, rows, lmask, case.sets)["logprobs"]
        naive = _naive_same_dtype(h16.detach() @ w16.detach().T, sampled, rows, lmask, case.sets)
        grads = torch.autograd.grad((out.logprobs.double() * w1).sum(), (h16, w16))
        truth_grads = torch.autograd.grad((truth * w1).sum(), (h64, w64))
        h_n, w_n = h16.detach().clone().requires_grad_(), w16.detach().clone().requires_grad_()
        naive_grads = torch.autograd.grad(
            (_naive_same_dtype(h_n @ w_n.T, sampled, rows, lmask, case.sets) * w1.bfloat16()).sum(), (h_n, w_n)
        )
    else:
        z16 = case.logits.to(torch.bfloat16).requires_grad_()
        out = score_aligned_support(z16, sampled, rows, lmask, case.support)
        z64 = z16.detach().double().requires_grad_()
        truth = reference_scores(z64, sampled, rows, lmask, case.sets)["logprobs"]
        z_n = z16.detach().clone().requires_grad_()
        naive_lp = _naive_same_dtype(z_n, sampled, rows, lmask, case.sets)
        naive = naive_lp.detach()
        grads = torch.autograd.grad((out.logprobs.double() * w1).sum(), (z16,))
        truth_grads = torch.autograd.grad((truth * w1).sum(), (z64,))
        naive_grads = torch.autograd.grad((naive_lp * w1.bfloat16()).sum(), (z_n,))
    assert out.logprobs.dtype == torch.float32
    err = (out.logprobs.double() - truth.detach()).abs()
    naive_err = (naive.double() - truth.detach()).abs()
    assert naive_err.max() > 1e-3  # the budget is a real bf16 error, not zero
    assert torch.all(err <= naive_err + 1e-4), float((err - naive_err).max())
    for got, want, nv in zip(grads, truth_grads, naive_grads):
        assert got.dtype == torch.bfloat16
        g_err = (got.double() - want).abs()
        n_err = (nv.double() - want).abs()
        assert float(g_err.max()) <= float(n_err.max()) + 1e-3


@pytest.mark.parametrize("hidden", [False, True])
def test_score_full_vocabulary_matches_log_softmax(hidden):
    case = make_case(eos=(), seed=13)
    temperature = 0.75
    g = torch.Generator().manual_seed(0)
    lmask = torch.rand(case.loss_mask.shape, generator=g) < 0.6
    if hidden:
        h, w = case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_()
        out = score_full_vocabulary(h, case.sampled_ids, loss_mask=lmask, lm_head_weight=w, temperature=temperature,
                                    compute_entropy=True)
        leaves = (h, w)
        h2, w2 = case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_()
        z, ref_leaves = h2 @ w2.T, (h2, w2)
    else:
        src = case.logits.clone().requires_grad_()
        out = score_full_vocabulary(src, case.sampled_ids, loss_mask=lmask, temperature=temperature,
                                    compute_entropy=True)
        leaves = (src,)
        z = case.logits.clone().requires_grad_()
        ref_leaves = (z,)
    logp = torch.log_softmax(z / temperature, -1)
    ref_lp = torch.where(lmask, logp.gather(-1, case.sampled_ids[..., None]).squeeze(-1), 0.0)
    ref_ent = torch.where(lmask, -(logp.exp() * logp).sum(-1), 0.0)
    torch.testing.assert_close(out.logprobs, ref_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.entropy, ref_ent, atol=ATOL, rtol=0)
    assert torch.equal(out.fallback_mask, lmask) and not out.valid_mask.any()
    shape = lmask.shape
    for a, b in zip(torch.autograd.grad(_loss(out.logprobs, out.entropy, shape), leaves),
                    torch.autograd.grad(_loss(ref_lp, ref_ent, shape), ref_leaves)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_score_full_vocabulary_with_neg_inf_logits():
    case = make_case(eos=(), seed=14, masked_vocab=50)
    src = case.logits.clone().requires_grad_()
    out = score_full_vocabulary(src, case.sampled_ids, loss_mask=case.loss_mask, temperature=0.9, compute_entropy=True)
    (g,) = torch.autograd.grad(_loss(out.logprobs, out.entropy, case.loss_mask.shape), src)
    ref_src = case.logits.clone().requires_grad_()
    no_rows = torch.full_like(case.row_ids, -1)
    ref = reference_scores(ref_src, case.sampled_ids, no_rows, case.loss_mask, [], temperature=0.9)
    (g_ref,) = torch.autograd.grad(_loss(ref["logprobs"], ref["entropy"], case.loss_mask.shape), ref_src)
    assert not torch.isnan(g).any() and torch.all(g[..., case.masked] == 0)
    torch.testing.assert_close(out.logprobs, ref["logprobs"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.entropy, ref["entropy"], atol=ATOL, rtol=0)
    torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("trainable", ["hidden", "weight"])
def test_hidden_mode_with_one_side_frozen(trainable):
    """A frozen LM head (or frozen hidden states) still gets the other side's exact gradient."""
    case = make_case(eos=(0,), seed=15)
    h = case.hidden.clone().requires_grad_(trainable == "hidden")
    w = case.weight.clone().requires_grad_(trainable == "weight")
    out = score_aligned_support(h, *case.channels(), lm_head_weight=w, compute_entropy=True, chunk_size=16)
    leaf = h if trainable == "hidden" else w
    (g,) = torch.autograd.grad(_loss(out.logprobs, out.entropy, case.loss_mask.shape), leaf)
    h_ref, w_ref = case.hidden.clone().requires_grad_(), case.weight.clone().requires_grad_()
    ref = _reference(case, h_ref @ w_ref.T, 1.0)
    g_ref = torch.autograd.grad(_loss(ref["logprobs"], ref["entropy"], case.loss_mask.shape),
                                h_ref if trainable == "hidden" else w_ref)[0]
    torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)


def test_no_grad_roles_and_nothing_to_score():
    case = make_case(eos=(1,), seed=16)
    with_grad = score_aligned_support(case.logits.clone().requires_grad_(), *case.channels(), compute_entropy=True)
    with torch.no_grad():
        plain = score_aligned_support(case.logits, *case.channels(), compute_entropy=True)
        hidden = score_aligned_support(case.hidden, *case.channels(), lm_head_weight=case.weight, compute_entropy=True)
    assert not plain.logprobs.requires_grad
    torch.testing.assert_close(plain.logprobs, with_grad.logprobs.detach(), atol=0, rtol=0)
    torch.testing.assert_close(hidden.logprobs, plain.logprobs, atol=ATOL, rtol=0)
    torch.testing.assert_close(hidden.entropy, plain.entropy, atol=ATOL, rtol=0)
    nothing = score_aligned_support(case.logits, case.sampled_ids, case.row_ids, torch.zeros_like(case.loss_mask),
                                    case.support, compute_entropy=True, compute_support_mass=True)
    for t in (nothing.logprobs, nothing.entropy, nothing.support_logmass):
        assert t.shape == case.loss_mask.shape and torch.all(t == 0)
    assert not nothing.valid_mask.any() and not nothing.fallback_mask.any()


def test_float64_weight_sets_the_compute_dtype_on_both_paths():
    """float32 hidden states with a float64 LM head: both entry points compute in float64.

    score_full_vocabulary used to ignore the weight's dtype (its float32 product failed
    outright); both paths now follow docs/design.md §4 and match the float64 loop.
    """
    case = make_case(eos=(), seed=17)
    h32 = case.hidden.float()
    lmask = case.loss_mask
    truth = torch.log_softmax(h32.double() @ case.weight.T / 0.8, -1).gather(-1, case.sampled_ids[..., None]).squeeze(-1)
    full = score_full_vocabulary(h32, case.sampled_ids, loss_mask=lmask, lm_head_weight=case.weight, temperature=0.8)
    assert full.logprobs.dtype == torch.float64
    torch.testing.assert_close(full.logprobs, torch.where(lmask, truth, 0.0), atol=ATOL, rtol=0)
    sup = score_aligned_support(h32, *case.channels(), lm_head_weight=case.weight, temperature=0.8)
    assert sup.logprobs.dtype == torch.float64
    ref = reference_scores(h32.double() @ case.weight.T, case.sampled_ids, case.row_ids, lmask, case.sets, temperature=0.8)
    torch.testing.assert_close(sup.logprobs, ref["logprobs"], atol=ATOL, rtol=0)
