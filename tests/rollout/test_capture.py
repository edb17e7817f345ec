"""capture.sample against a float64 naive reference of the documented order of operations."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import nemo_replay
from nemo_replay import capture
from nemo_replay.rollout.capture import check_capture_settings
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport


def reference_support(x_row: torch.Tensor, top_k, top_p, min_p) -> list[int]:
    """float64 loop: rank (value desc, id asc), top-k, min-p, top-p over renormalised survivors."""
    x = [float(v) for v in x_row.double()]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    cand = order[:top_k] if top_k is not None else order
    keep = [i for i in cand if math.isfinite(x[i])]
    top = x[keep[0]]
    if min_p > 0:
        keep = [i for i in keep if math.exp(x[i] - top) >= min_p]
    if top_p < 1:
        z = sum(math.exp(x[i] - top) for i in keep)
        out, above = [], 0.0
        for i in keep:
            if above < top_p:
                out.append(i)
            above += math.exp(x[i] - top) / z
        keep = out
    return keep


def reference_logprob(x_row: torch.Tensor, members: list[int], token: int) -> float:
    x = x_row.double()
    return float(x[token] - torch.logsumexp(x[members], 0))


def rows_of(support, n):
    if isinstance(support, PackedTensor):
        return [[int(t) for t in r if t >= 0] for r in support.values]
    return [support.row(r).tolist() for r in range(n)]


SETTINGS = [
    dict(temperature=1.0, top_k=16, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=32, top_p=0.9, min_p=0.0),
    dict(temperature=1.3, top_k=8, top_p=0.8, min_p=0.05),
    dict(temperature=0.6, top_k=200, top_p=1.0, min_p=0.1),
    dict(temperature=1.0, top_k=None, top_p=0.95, min_p=0.0),
    dict(temperature=0.8, top_k=None, top_p=1.0, min_p=0.02),
    dict(temperature=1.1, top_k=None, top_p=0.7, min_p=0.01),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_support_matches_reference_and_holds_the_sample(settings):
    torch.manual_seed(0)
    N, V = 37, 423
    logits = torch.randn(N, V) * 2.5
    logits[3, 100:] = -math.inf  # a masked vocabulary tail is never a member
    before = logits.clone()
    gen = torch.Generator().manual_seed(1)
    ids, lps, support = capture.sample(logits, generator=gen, **settings)
    assert torch.equal(logits, before), "the caller's logits must not be modified"
    assert ids.dtype == torch.int64 and ids.shape == (N,)
    assert lps.dtype == torch.float32 and lps.shape == (N,)
    k = settings["top_k"]
    if k is not None:
        assert isinstance(support, PackedTensor)
        assert support.values.shape == (N, k) and support.values.dtype == torch.int32
        assert support.cu_seqlens.tolist() == [0, N]
    else:
        assert isinstance(support, RaggedSupport) and support.cu_seqlens.tolist() == [0, N]
    x = logits.double() / settings["temperature"]
    rows = rows_of(support, N)
    for r in range(N):
        want = reference_support(x[r], k, settings["top_p"], settings["min_p"])
        # Same members in the same (rank) order: exactly the tokens with nonzero processed probability.
        assert rows[r] == want, f"row {r}"
        assert int(ids[r]) in want
        assert abs(float(lps[r]) - reference_logprob(x[r], want, int(ids[r]))) < 1e-5
    if k is not None:
        # Trailing -1 padding only, the row width stays exactly top_k.
        v = support.values
        assert not (v[:, 1:] >= 0)[v[:, :-1] < 0].any()
    assert len(rows[3]) <= 100


@pytest.mark.parametrize("top_k", [12, None])
def test_scorer_reproduces_the_sampler_logprob(top_k):
    torch.manual_seed(2)
    N, V, T = 64, 1000, 0.75
    logits = torch.randn(N, V, dtype=torch.float32) * 3
    ids, lps, support = capture.sample(
        logits, temperature=T, top_k=top_k, top_p=0.9, min_p=0.01, generator=torch.Generator().manual_seed(3)
    )
    scores = nemo_replay.score_aligned_support(
        logits, ids, torch.arange(N), torch.ones(N, dtype=torch.bool), support, temperature=T
    )
    assert scores.valid_mask.all()
    torch.testing.assert_close(scores.logprobs, lps, rtol=0, atol=1e-6)


def test_draws_follow_the_processed_distribution():
    V, N = 10, 200_000
    row = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.2, 0.1, -0.5, -1.0, -2.0, -3.0])
    logits = row.expand(N, V)
    settings = dict(temperature=0.9, top_k=6, top_p=0.85, min_p=0.0)
    ids, lps, support = capture.sample(logits, generator=torch.Generator().manual_seed(4), **settings)
    want = reference_support(row / 0.9, 6, 0.85, 0.0)
    q = torch.softmax(row.double()[want] / 0.9, 0)
    freq = torch.bincount(ids, minlength=V).double() / N
    sigma = torch.sqrt(q * (1 - q) / N)
    assert ((freq[want] - q).abs() < 5 * sigma).all(), (freq[want], q)
    assert freq.sum() == pytest.approx(freq[want].sum())


def test_ties_rank_by_smaller_id_and_draws_are_reproducible():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0, 1.0]])
    _, _, sup = capture.sample(logits, temperature=1.0, top_k=4)
    assert sup.values.tolist() == [[1, 3, 4, 2]]
    _, _, rag = capture.sample(logits, temperature=1.0)
    assert rag.row(0).tolist() == [1, 3, 4, 2, 5, 0]
    logits = torch.randn(50, 300)
    a = capture.sample(logits, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(9))
    b = capture.sample(logits, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.support.values, b.support.values)


def test_width_is_top_k_even_beyond_the_vocabulary():
    ids, _, sup = capture.sample(torch.randn(3, 5), temperature=1.0, top_k=8)
    assert sup.values.shape == (3, 8)
    assert (sup.values[:, 5:] == -1).all() and (sup.values[:, :5] >= 0).all()


def test_bf16_and_float64_logits():
    torch.manual_seed(5)
    logits = torch.randn(8, 64)
    _, lp32, s32 = capture.sample(logits.bfloat16(), temperature=1.0, top_k=10)
    assert lp32.dtype == torch.float32
    _, lp64, s64 = capture.sample(logits.double(), temperature=1.0, top_k=10)
    assert lp64.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(temperature=None), "temperature"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=1.0, top_k=1), "top_k"),
        (dict(temperature=1.0, top_k=0), "top_k"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, min_p=1.0), "min_p"),
    ],
)
def test_sample_refuses_settings_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        capture.sample(torch.randn(2, 10), **kwargs)


@pytest.mark.parametrize(
    "flag, value", [("repetition_penalty", 1.1), ("presence_penalty", 0.5), ("frequency_penalty", -0.2)]
)
def test_penalties_are_refused(flag, value):
    with pytest.raises(ValueError, match=flag):
        check_capture_settings(temperature=1.0, top_k=8, **{flag: value})
    check_capture_settings(temperature=1.0, top_k=8, **{flag: None})  # unset is neutral


def test_errors_are_collected():
    with pytest.raises(ValueError) as info:
        check_capture_settings(temperature=None, top_k=1, repetition_penalty=1.2)
    msg = str(info.value)
    assert "temperature" in msg and "top_k" in msg and "repetition_penalty" in msg


def test_the_fix_names_the_callers_own_field():
    # The settings come from a vLLM request, a GRPOConfig, a JSON body: no recipe's generation.* flag.
    from nemo_replay.rollout.engine import capture_settings_from_engine

    with pytest.raises(ValueError) as info:
        capture_settings_from_engine({"temperature": 0.0, "top_k": 1, "repetition_penalty": 1.2}, engine="vllm")
    msg = str(info.value)
    assert msg.startswith("vllm sampling params: sampling settings cannot be captured")
    assert "set temperature, e.g. 1.0" in msg and "set top_k > 1" in msg and "set repetition_penalty=1.0" in msg
    assert "generation." not in msg
    with pytest.raises(ValueError, match=r"set body\.temperature, e\.g\. 1\.0"):
        check_capture_settings(temperature=None, where="request", prefix="body.")


def test_broken_logits_are_refused():
    bad = torch.randn(4, 10)
    bad[2, 3] = float("nan")
    with pytest.raises(ValueError, match="row 2"):
        capture.sample(bad, temperature=1.0, top_k=4)
    with pytest.raises(ValueError, match="row 0"):
        capture.sample(torch.full((1, 5), -math.inf), temperature=1.0, top_k=4)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        capture.sample(torch.randn(10), temperature=1.0, top_k=4)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 6),
    v=st.integers(2, 60),
    scale=st.sampled_from([0.1, 1.0, 4.0]),
    temperature=st.floats(0.3, 2.0),
    top_k=st.one_of(st.none(), st.integers(2, 70)),
    top_p=st.sampled_from([1.0, 0.95, 0.7, 0.3]),
    min_p=st.sampled_from([0.0, 0.01, 0.2]),
)
def test_random_settings_match_the_reference(seed, n, v, scale, temperature, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * scale
    ids, lps, support = capture.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, generator=g)
    x = logits.double() / temperature
    for r, row in enumerate(rows_of(support, n)):
        want = reference_support(x[r], top_k, top_p, min_p)
        assert row == want and int(ids[r]) in want
        assert abs(float(lps[r]) - reference_logprob(x[r], want, int(ids[r]))) < 1e-5


# ------------------------------------------------------------------ tie rules of vLLM's two paths
# Independent numpy statements of each rule (vLLM 0.33.0, vllm/v1/sample/ops/):
#
# PyTorch path (topk_topp_sampler.py, apply_top_k_top_p_pytorch): a token survives top-k iff its
# value is >= the k-th largest value; top-p then orders the survivors ascending by value (a
# stable sort: smaller ids first among equals), renormalises, and removes tokens from the
# bottom while the running mass is <= 1 - top_p, never the last (largest) one.
#
# Triton path (topk_topp_triton.py): exactly k survive top-k, the boundary's duplicates taken in
# index order; top-p keeps the shortest prefix of (value desc, id asc) whose mass reaches top_p.


def pytorch_path_support(x, top_k, top_p):
    import numpy as np

    kth = np.partition(x, x.size - top_k)[x.size - top_k]
    cand = np.flatnonzero(x >= kth)
    order = cand[np.lexsort((cand, x[cand]))]  # ascending value, then ascending id
    w = np.exp(x[order] - x[order].max())
    running = np.cumsum(w / w.sum())
    dropped = running <= 1 - top_p
    dropped[-1] = False
    return set(order[~dropped].tolist())


def triton_path_support(x, top_k, top_p):
    import numpy as np

    order = np.lexsort((np.arange(x.size), -x))[:top_k]  # value desc, then id asc
    w = np.exp(x[order] - x[order].max())
    w = w / w.sum()
    kept, mass = [], 0.0
    for token, q in zip(order.tolist(), w.tolist()):
        if mass >= top_p:
            break
        kept.append(token)
        mass += q
    return set(kept)


def bf16_logits(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=g) * 2.5).bfloat16().double()  # bf16 values, exact in float64


@pytest.mark.parametrize("top_k, top_p", [(50, 1.0), (50, 0.9), (200, 0.95)])
def test_each_tie_rule_matches_its_engine_path_on_tied_bf16_logits(top_k, top_p):
    n, vocab = 120, 32000
    x = bf16_logits(n, vocab, seed=top_k)
    ranked = torch.sort(x, dim=1, descending=True).values
    tied_at_k = (ranked[:, top_k - 1] == ranked[:, top_k]).sum().item()
    assert tied_at_k > n // 2, "bf16 logits should tie at the top-k boundary in most rows"

    exact = capture.sample(x, temperature=1.0, top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(0))
    tied = capture.sample(x, temperature=1.0, top_k=top_k, top_p=top_p, ties="keep_tied", generator=torch.Generator().manual_seed(0))
    assert isinstance(exact.support, PackedTensor) and exact.support.values.shape == (n, top_k)
    assert isinstance(tied.support, RaggedSupport) and tied.support.cu_seqlens.tolist() == [0, n]
    differ = 0
    for r in range(n):
        xr = x[r].numpy()
        want_triton, want_pytorch = triton_path_support(xr, top_k, top_p), pytorch_path_support(xr, top_k, top_p)
        got_exact = [int(t) for t in exact.support.values[r] if t >= 0]
        got_tied = tied.support.row(r).tolist()
        assert len(got_exact) == len(set(got_exact)) and set(got_exact) == want_triton, r
        assert len(got_tied) == len(set(got_tied)) and set(got_tied) == want_pytorch, r
        differ += want_triton != want_pytorch
        for res, members in ((exact, got_exact), (tied, got_tied)):
            assert int(res.ids[r]) in members
            assert float(res.logprobs[r]) == pytest.approx(reference_logprob(x[r], members, int(res.ids[r])), abs=1e-6)
    assert differ > n // 3
    if top_p == 1.0:
        assert differ == tied_at_k  # every tie at the k-th value widens the PyTorch path's support
        assert max(tied.support.row_lengths.tolist()) > top_k  # supports wider than k are carried, not cut


def test_keep_tied_worked_example_and_unknown_rule():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    exact = capture.sample(logits, temperature=1.0, top_k=2)
    tied = capture.sample(logits, temperature=1.0, top_k=2, ties="keep_tied")
    assert exact.support.values.tolist() == [[1, 2]]
    assert tied.support.row(0).tolist() == [3, 2, 1]
    # top-p over three equal tokens with p = 0.5: the PyTorch path drops the smaller ids first.
    half = capture.sample(logits, temperature=1.0, top_k=2, top_p=0.5, ties="keep_tied")
    assert half.support.row(0).tolist() == [3, 2]
    assert capture.sample(logits, temperature=1.0, top_k=2, top_p=0.5).support.values.tolist() == [[1, -1]]
    with pytest.raises(ValueError, match="ties='vllm'.*index_order.*keep_tied"):
        capture.sample(logits, temperature=1.0, top_k=2, ties="vllm")
