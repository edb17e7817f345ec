"""capture.sample against a float64 naive reference of the documented order of operations."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import nemo_replay
from nemo_replay import capture
from nemo_replay.rollout.capture.sampler import check_capture_settings
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
    import numpy as np

    x = x_row.double().numpy()
    kept = x[np.asarray(members, dtype=np.int64)]
    top = kept.max()
    return float(x[token] - (top + np.log(np.exp(kept - top).sum())))  # float64 log-sum-exp over the members


def rows_of(support, n):
    if isinstance(support, PackedTensor):
        return [[t for t in r if t >= 0] for r in support.to_padded().values.tolist()]
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
    # Rows cost what they hold: CSR, each row its members; padded copies are top_k wide.
    assert isinstance(support, RaggedSupport) and support.cu_seqlens.tolist() == [0, N]
    assert support.member_ids.dtype == torch.int32 and bool((support.member_ids >= 0).all())
    if k is not None:
        assert support.width_bound == k and support.to_padded().values.shape == (N, k)
    x = logits.double() / settings["temperature"]
    rows = rows_of(support, N)
    for r in range(N):
        want = reference_support(x[r], k, settings["top_p"], settings["min_p"])
        # Same members in the same (rank) order: exactly the tokens with nonzero processed probability.
        assert rows[r] == want, f"row {r}"
        assert int(ids[r]) in want
        assert abs(float(lps[r]) - reference_logprob(x[r], want, int(ids[r]))) < 1e-5
    if k is not None:
        # A padded copy: trailing -1 padding only, the row width exactly top_k.
        v = support.to_padded().values
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
    assert sup.to_padded().values.tolist() == [[1, 3, 4, 2]]
    _, _, rag = capture.sample(logits, temperature=1.0)
    assert rag.row(0).tolist() == [1, 3, 4, 2, 5, 0]
    logits = torch.randn(50, 300)
    a = capture.sample(logits, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(9))
    b = capture.sample(logits, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a.ids, b.ids) and a.support == b.support


def test_width_is_top_k_even_beyond_the_vocabulary():
    ids, _, sup = capture.sample(torch.randn(3, 5), temperature=1.0, top_k=8)
    assert sup.row_lengths.tolist() == [5, 5, 5] and sup.width_bound == 8  # padded copies: top_k wide
    padded = sup.to_padded().values
    assert padded.shape == (3, 8) and (padded[:, 5:] == -1).all() and (padded[:, :5] >= 0).all()


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
    from nemo_replay.rollout.engines.base import capture_settings_from_engine

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
    with pytest.raises(ValueError, match=r"\(N, V\)"):
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
# PyTorch path (topk_topp_sampler.py, apply_top_k_top_p_pytorch), logits already float32
# (sampler.py casts them): sort the row ascending (torch's default, unstable sort); top-k masks
# every value < the k-th largest to -inf; top-p takes the softmax of that whole sorted row, its
# cumulative sum bottom-up, masks where the sum is <= 1 - top_p (top_p stored as float32, the
# subtraction in float32) and never the last (largest) entry. Which of several ids tied at a cut
# survive is the unstable sort's choice; the number that survive, and every id strictly above
# the cut, follow from the values alone.
#
# Triton path (topk_topp_triton.py): exactly k survive top-k, the boundary's duplicates taken in
# index order; top-p keeps the shortest prefix of (value desc, id asc) whose mass reaches top_p.


def pytorch_path_cut(x, top_k, top_p):
    """float64 reference of the PyTorch path for one row x (V,) float32 numpy: (size, cut) --
    the support holds every id with x > cut and ``size`` ids in all, the rest tied at ``cut``."""
    import numpy as np

    asc = np.sort(x.astype(np.float64))  # values only: the order among ties cannot matter here
    if top_k is not None:
        asc = np.where(asc < asc[asc.size - top_k], -np.inf, asc)
    kept = np.isfinite(asc)
    if top_p < 1.0:
        w = np.exp(asc - asc[-1])
        running = np.cumsum(w / w.sum())
        threshold = float(np.float32(1.0) - np.float32(top_p))
        dropped = running <= threshold
        dropped[-1] = False
        kept &= ~dropped
    size = int(kept.sum())
    return size, float(asc[asc.size - size])


def pytorch_path_ties_at_cut(x, top_k, top_p):
    """Whether ids tied at the cut of row x compete for its last places."""
    size, cut = pytorch_path_cut(x, top_k, top_p)
    return int((x > cut).sum()) + int((x == cut).sum()) > size


def pytorch_path_support(x, top_k, top_p):
    """The reference support as a set, for a row with no tie at the cut (asserted)."""
    import numpy as np

    size, cut = pytorch_path_cut(x, top_k, top_p)
    members = set(np.flatnonzero(x.astype(np.float64) >= cut).tolist())
    assert len(members) == size, "the row ties at its cut: only the support's size is determined"
    return members


def assert_pytorch_path_row(got, x, top_k, top_p):
    """got: the support's ids; the reference fixes its size and every id above the cut."""
    import numpy as np

    size, cut = pytorch_path_cut(x, top_k, top_p)
    xs = x.astype(np.float64)
    above = set(np.flatnonzero(xs > cut).tolist())
    at_cut = set(np.flatnonzero(xs == cut).tolist())
    assert len(got) == len(set(got)) == size
    assert above <= set(got) <= above | at_cut


def triton_path_support(x, top_k, top_p):
    import numpy as np

    order = np.argsort(-x, kind="stable")[:top_k]  # value desc, then id asc (a stable sort keeps tied ids in order)
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


@pytest.mark.parametrize("top_k, top_p", [(50, 1.0), (50, 0.9), (200, 0.95), (None, 0.9)])
def test_each_tie_rule_matches_its_engine_path_on_tied_bf16_logits(top_k, top_p):
    n, vocab = 120, 32000  # each row is checked against three naive per-row references
    x = bf16_logits(n, vocab, seed=top_k or 7)
    if top_k is not None:
        ranked = torch.sort(x, dim=1, descending=True).values
        tied_at_k = (ranked[:, top_k - 1] == ranked[:, top_k]).sum().item()
        assert tied_at_k > n // 2, "bf16 logits should tie at the top-k boundary in most rows"

    exact = capture.sample(x, temperature=1.0, top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(0))
    # float32, as vLLM's sampler holds the logits (the bf16 values are exact in both dtypes).
    tied = capture.sample(x.float(), temperature=1.0, top_k=top_k, top_p=top_p, ties="keep_tied",
                          generator=torch.Generator().manual_seed(0))
    assert isinstance(tied.support, RaggedSupport) and tied.support.cu_seqlens.tolist() == [0, n]
    differ = tied_at_cut = 0
    exact_rows, tied_rows = rows_of(exact.support, n), rows_of(tied.support, n)
    for r in range(n):
        xr = x[r].float().numpy()
        got_exact, got_tied = exact_rows[r], tied_rows[r]
        if top_k is not None:
            assert len(got_exact) == len(set(got_exact)) and set(got_exact) == triton_path_support(xr, top_k, top_p), r
        assert_pytorch_path_row(got_tied, xr, top_k, top_p)  # the size vLLM keeps, ties or not
        tied_at_cut += pytorch_path_ties_at_cut(xr, top_k, top_p)
        differ += set(got_exact) != set(got_tied)
        for res, members in ((exact, got_exact), (tied, got_tied)):
            assert int(res.ids[r]) in members
            assert float(res.logprobs[r]) == pytest.approx(reference_logprob(x[r], members, int(res.ids[r])), abs=1e-6)
    if top_p < 1.0:
        assert tied_at_cut > n // 10, "the test needs rows where the unstable sort picks among tied ids"
    if top_k is not None:
        assert differ > n // 3
    if top_p == 1.0:
        assert differ == tied_at_k  # every tie at the k-th value widens the PyTorch path's support
        assert max(tied.support.row_lengths.tolist()) > top_k  # supports wider than k are carried, not cut


@pytest.mark.parametrize(
    "top_k, top_p, temperature",
    [(None, 0.99, 1.0), (None, 0.95, 1.0), (16000, 0.99, 1.0), (16000, 0.95, 0.8)],
)
def test_keep_tied_top_p_sums_bottom_up_as_vllm_does(top_k, top_p, temperature):
    # float32 logits without ties at the cut: the support is fixed by the values, and the
    # float64 reference of vLLM's bottom-up sum must give it in every row. Summing top-down
    # (before the fix) moved the cut in 159 of the 239 untied rows at top_p = 0.99 (18 with
    # top_k = 16000).
    import numpy as np

    n, vocab = 240, 32000
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n, vocab, generator=g) * 4
    x = (logits.numpy() / np.float32(temperature)).astype(np.float32)  # vLLM divides in float32
    got = capture.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, ties="keep_tied",
                         generator=torch.Generator().manual_seed(0))
    untied = [r for r in range(n) if not pytorch_path_ties_at_cut(x[r], top_k, top_p)]
    assert len(untied) >= 200
    mismatched = [r for r in untied if set(got.support.row(r).tolist()) != pytorch_path_support(x[r], top_k, top_p)]
    assert mismatched == []


def test_keep_tied_worked_example_and_unknown_rule():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    exact = capture.sample(logits, temperature=1.0, top_k=2)
    tied = capture.sample(logits, temperature=1.0, top_k=2, ties="keep_tied")
    assert exact.support.to_padded().values.tolist() == [[1, 2]]
    assert sorted(tied.support.row(0).tolist()) == [1, 2, 3]
    # top-p over three equal tokens with p = 0.5: the running sum [0, 0, 1/3, 2/3, 1] drops one
    # of them; which one is the engine's unstable sort's choice, only the count is fixed.
    half = capture.sample(logits, temperature=1.0, top_k=2, top_p=0.5, ties="keep_tied")
    assert len(half.support.row(0)) == 2 and set(half.support.row(0).tolist()) < {1, 2, 3}
    assert capture.sample(logits, temperature=1.0, top_k=2, top_p=0.5).support.to_padded().values.tolist() == [[1, -1]]
    with pytest.raises(ValueError, match="ties='vllm'.*index_order.*keep_tied"):
        capture.sample(logits, temperature=1.0, top_k=2, ties="vllm")


@pytest.mark.parametrize("ties", ["index_order", "keep_tied"])
@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-8])
def test_a_top_p_below_float32_keeps_the_top_token(ties, top_p):
    """top_p=1e-300 is 0 in float32: the top token's mass above (0) was not below it, the row lost
    its top token and an internal assertion made the server answer 500. The top token always stays."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3)) * 3
    ids, _, support = capture.sample(logits, temperature=1.0, top_p=top_p, ties=ties, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(1)
    assert torch.equal(ids, top)
    assert [support.row(j).tolist() for j in range(5)] == [[int(t)] for t in top]
