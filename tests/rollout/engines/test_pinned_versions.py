"""The adapters on the outputs of every pinned engine release (tests/rollout/engines/pinned_outputs.py).

vLLM 0.24.0 (verl 0.9.1), 0.25.1 (NeMo-RL), 0.30.0 (SkyRL 0.4.0) and 0.33.0: every output path a
release has is read by the adapter its users call, on the sampler cases where the releases
differ -- ties at the k-th value in a step of few rows (0.24 / 0.25 take the PyTorch path there
and keep every tied token), the same ties in a full step (Triton: exactly k), a rollout's tail
that mixes both, plain top-k, top-p and min-p. Each position must come back as exactly the
sampler's support or flagged with an empty row, never a wrong row. SGLang 0.5.23 is read from its
mask; SGLang 0.5.12 has none and is refused.
"""

import functools

import pytest
import torch

from nemo_replay.integrations.verl.rollout import SglangSupportRecorder
from nemo_replay.rollout.engines.sglang import support_from_sglang_meta_info, support_from_sglang_response
from nemo_replay.rollout.engines.vllm import (
    VLLM_TIE_MARGIN,
    check_vllm_engine,
    support_from_vllm_generate,
    support_from_vllm_logprobs,
    support_from_vllm_output,
    vllm_row_width,
)
from tests.rollout.engines.engine_outputs import sglang_meta_info, sglang_steps, vllm_chat_logprobs, vllm_completions_logprobs
from tests.rollout.engines.pinned_outputs import (
    SGLANG_PINS,
    VLLM_PINS,
    generate_req_input_class,
    pinned_draws,
    pinned_generate_choice,
    pinned_request_output,
    pinned_vllm_config,
    sglang_0512_meta_info,
)

V, N, K = 512, 32, 8
TAIL = [32 >> (j // 6) for j in range(N)]  # a rollout's tail: steps of 32, 16, 8, 4, 2, 1 rows

#: name -> (logits, temperature, top_k, top_p, min_p, rows of the engine step of each position)
CASES = {
    "ties_few_rows": ("coarse", 1.0, K, 1.0, 0.0, [4] * N),
    "ties_full_step": ("coarse", 1.0, K, 1.0, 0.0, [16] * N),
    "ties_rollout_tail": ("coarse", 1.0, K, 0.9, 0.0, TAIL),
    "top_k": ("smooth", 0.8, K, 1.0, 0.0, [4] * N),
    "top_p": ("smooth", 0.8, K, 0.9, 0.0, [4] * N),
    "min_p": ("smooth", 0.8, K, 1.0, 0.1, [4] * N),
}


@functools.cache
def logits_of(kind: str) -> torch.Tensor:
    """(N, V) float32: "coarse" on a 0.5 grid, so many tokens tie at the k-th value; "smooth" without ties."""
    if kind == "coarse":
        return (torch.randn(N, V, generator=torch.Generator().manual_seed(1)) * 4).round() / 2
    return torch.randn(N, V, generator=torch.Generator().manual_seed(2)) * 2


@functools.cache
def draws_of(version: str, case: str):
    kind, temperature, top_k, top_p, min_p, rows = CASES[case]
    return pinned_draws(version, logits_of(kind), temperature, top_k=top_k, top_p=top_p, min_p=min_p, rows=rows, seed=3)


def paths_of(version: str) -> list[str]:
    paths = ["offline_dicts", "offline_flat", "completions", "chat", "generate"]
    return paths + ["offline_mask", "generate_mask"] if VLLM_PINS[version].masks else paths


def read(version: str, path: str, steps, asked: int, params: dict):
    """One output path of one release, read by the adapter its users call; rows ``asked - 1`` wide."""
    width, ids = asked - 1, [s.token for s in steps]
    if path.startswith("offline"):
        out = pinned_request_output(version, steps, asked, flat=path == "offline_flat", mask=path == "offline_mask").outputs[0]
        assert hasattr(out, "sampling_mask") == VLLM_PINS[version].masks  # the release's own class
        return support_from_vllm_output(out, width=width, vocab_size=V, sampling_params=params)
    if path == "completions":
        return support_from_vllm_logprobs(vllm_completions_logprobs(steps, asked), ids, width=width, vocab_size=V,
                                          sampling_params=params)
    if path == "chat":
        body = {**params, "logprobs": True, "top_logprobs": asked}
        return support_from_vllm_logprobs(vllm_chat_logprobs(steps, asked, top_logprobs=asked), width=width, vocab_size=V,
                                          sampling_params=body)
    choice = pinned_generate_choice(version, steps, asked, mask=path == "generate_mask")
    return support_from_vllm_generate(choice, width=width, vocab_size=V, sampling_params=params)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("version, path", [(v, p) for v in VLLM_PINS for p in paths_of(v)])
def test_every_position_is_the_sampler_support_or_flagged(version, path, case):
    """Asked ``top_k + 1`` log-probs (no margin) and, where ties can widen a support,
    ``vllm_row_width + 1`` (the margin); rows as wide. A position is flagged exactly where its
    support is wider than the row; every other row is the sampler's support, ids ascending, with
    the sampled token's processed log-prob."""
    _, temperature, top_k, top_p, min_p, _ = CASES[case]
    draws = draws_of(version, case)
    sizes = [len(d.mask) for d in draws]
    margin = vllm_row_width(top_k, top_k + 1 + VLLM_TIE_MARGIN) + 1
    assert max(sizes) < margin, sizes  # the margin's room holds every support here
    for asked in (top_k + 1, margin) if case.startswith("ties") else (top_k + 1,):
        steps = [d.step(asked) for d in draws]
        params = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "logprobs": asked}
        got = read(version, path, steps, asked, params)
        wider = [z > asked - 1 for z in sizes]
        assert got.flagged.tolist() == wider, (asked, sizes)
        reason = "wider_than_row" if path.endswith("mask") else "not_fully_visible"
        assert got.reasons == ({reason: sum(wider)} if any(wider) else {})
        for j, s in enumerate(steps):
            assert got.support.row(j).tolist() == ([] if wider[j] else s.mask), (asked, j)
        assert float((got.logprobs - torch.tensor([s.logprobs[0] for s in steps])).abs().max()) <= 1e-6


@pytest.mark.parametrize("case", ["ties_few_rows", "ties_full_step", "ties_rollout_tail"])
@pytest.mark.parametrize("version", sorted(VLLM_PINS))
def test_each_release_keeps_the_ties_its_step_keeps(version, case):
    """The supports the fixtures hand the adapters, against a count from the logits: where a
    release runs the PyTorch path (0.24 / 0.25, a step under 8 rows) a top-k support holds every
    token tied with the k-th value; under Triton (a full step, and every step on 0.30 / 0.33)
    exactly k. Top-p only ever shortens a row."""
    kind, temperature, top_k, top_p, _, rows = CASES[case]
    x = logits_of(kind) / temperature
    tied = (x >= x.topk(top_k, dim=1).values[:, -1:]).sum(1).tolist()  # every token >= the k-th value
    for j, (d, r) in enumerate(zip(draws_of(version, case), rows)):
        want = tied[j] if r < VLLM_PINS[version].triton_min_rows else top_k
        if top_p < 1.0:
            assert 1 <= len(d.mask) <= want, (j, r)
        else:
            assert len(d.mask) == want, (j, r)
    if VLLM_PINS[version].triton_min_rows > min(rows) and top_p == 1.0:
        assert max(len(d.mask) for d in draws_of(version, case)) > top_k  # ties past k were there to read


# ------------------------------------------------------------------ vLLM 0.24 / 0.25: ties at low concurrency



@functools.cache
def _low_concurrency_draws(top_k: int, top_p: float, temperature: float):
    logits = (torch.randn(64, 32000, generator=torch.Generator().manual_seed(0)) * 2.5).to(torch.bfloat16).float()
    return logits, pinned_draws("0.24.0", logits, temperature, top_k=top_k, top_p=top_p, rows=[1] * 64, seed=0)


@pytest.mark.parametrize("version", ["0.24.0", "0.25.1"])
@pytest.mark.parametrize("top_k, top_p, temperature", [(64, 1.0, 1.0), (64, 0.95, 1.0), (20, 1.0, 0.7)])
def test_positions_kept_at_low_concurrency(version, top_k, top_p, temperature):
    """64 positions, each from a step of one row (the PyTorch path), bf16 logits over 32000 ids.
    Asked ``top_k + 1`` log-probs, a support tied past k is flagged; asked ``vllm_row_width + 1``
    (max_logprobs = top_k + 17), every position is kept, its row the sampler's support. Read
    offline and from the release's /inference/v1/generate."""
    assert VLLM_PINS[version].tie_rule(1) == "keep_tied"
    logits, draws = _low_concurrency_draws(top_k, top_p, temperature)
    sizes = [len(d.mask) for d in draws]
    if top_p == 1.0:  # top-k alone: every token >= the k-th value, counted from the logits
        x = logits / temperature
        assert sizes == (x >= x.topk(top_k, dim=1).values[:, -1:]).sum(1).tolist()
    width = vllm_row_width(top_k, top_k + 1 + VLLM_TIE_MARGIN)
    kept = []
    for asked in (top_k + 1, width + 1):
        steps = [d.step(asked) for d in draws]
        params = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "logprobs": asked}
        offline = support_from_vllm_output(pinned_request_output(version, steps, asked).outputs[0], width=asked - 1,
                                           vocab_size=32000, sampling_params=params)
        served = support_from_vllm_generate(pinned_generate_choice(version, steps, asked), width=asked - 1,
                                            vocab_size=32000, sampling_params=params)
        for got in (offline, served):
            assert got.flagged.tolist() == [z > asked - 1 for z in sizes]
            assert all(got.support.row(j).tolist() == ([] if got.flagged[j] else s.mask) for j, s in enumerate(steps))
        kept.append(64 - offline.num_flagged)
    print(f"vLLM {version} top_k={top_k} top_p={top_p} T={temperature}: supports {min(sizes)}..{max(sizes)} ids; "
          f"positions kept of 64: {kept[0]} asked top_k + 1, {kept[1]} asked vllm_row_width + 1")
    assert kept[1] == 64  # the margin keeps every position
    if max(sizes) > top_k:
        assert kept[0] < 64


# ------------------------------------------------------------------ vLLM engine checks per release


@pytest.mark.parametrize("version", sorted(VLLM_PINS))
def test_engine_check_per_release(version):
    """0.24 / 0.25 have no ``return_sampling_mask``: the mask path is refused, the log-prob path
    stands with room for ``top_k + 1`` log-probs. 0.30 / 0.33 take either."""
    check_vllm_engine(pinned_vllm_config(version, max_logprobs=81), path="logprobs", top_k=64)
    with pytest.raises(ValueError, match="--max-logprobs 65"):
        check_vllm_engine(pinned_vllm_config(version), path="logprobs", top_k=64)
    if VLLM_PINS[version].masks:
        check_vllm_engine(pinned_vllm_config(version, return_sampling_mask=True, use_v2_model_runner=True), path="mask")
        with pytest.raises(ValueError, match="--return-sampling-mask"):
            check_vllm_engine(pinned_vllm_config(version, use_v2_model_runner=True), path="mask")
    else:
        with pytest.raises(ValueError, match="this vLLM has no sampling masks"):
            check_vllm_engine(pinned_vllm_config(version, use_v2_model_runner=True), path="mask")


@pytest.mark.parametrize("version", ["0.24.0", "0.25.1"])
def test_the_mask_refusal_names_the_first_release_with_masks(version):
    with pytest.raises(ValueError) as err:
        check_vllm_engine(pinned_vllm_config(version, use_v2_model_runner=True), path="mask")
    assert "0.33 added" not in str(err.value) and "0.30" in str(err.value)


# ------------------------------------------------------------------ SGLang


def _sglang_reference(logits_row, temperature, row, token) -> float:
    """float64: the sampled token's probability renormalised over its support."""
    p = torch.softmax(logits_row.double() / temperature, 0)
    return float(torch.log(p[token] / p[row].sum()))


@pytest.mark.parametrize("mode", ["selected", "support"])
@pytest.mark.parametrize("case", ["ties_few_rows", "top_k", "top_p", "min_p"])
def test_sglang_0523_rows_are_the_engine_mask(case, mode):
    """SGLang 0.5.23's rows are read as the engine sends them (most probable first), top-k ties,
    top-p and min-p included; the sampled log-prob is over the row, in either log-prob mode."""
    kind, temperature, top_k, top_p, min_p, _ = CASES[case]
    logits = logits_of(kind)
    steps = sglang_steps(logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=4)
    if min_p > 0.0:
        assert any(len(s.row) < top_k for s in steps)  # min-p cut rows short of k
    ids = [s.token for s in steps]
    params = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    got = support_from_sglang_meta_info(sglang_meta_info(steps, mode), ids, vocab_size=V, sampling_params=params)
    assert got.num_flagged == 0
    assert [got.support.row(j).tolist() for j in range(N)] == [s.row for s in steps]
    want = torch.tensor([_sglang_reference(logits[j], temperature, s.row, s.token) for j, s in enumerate(steps)])
    torch.testing.assert_close(got.logprobs, want.float(), rtol=0, atol=2e-5)


def test_sglang_0512_is_refused_at_launch():
    """verl's SGLang server checks the engine's ``GenerateReqInput`` before any request: 0.5.12
    has no ``return_sampling_mask``, and the refusal names the release that has it."""
    with pytest.raises(ValueError, match=r"no \['return_sampling_mask', 'sampling_logprobs_mode'\].* from 0\.5\.23 on.*"
                                         r"Install sglang>=0\.5\.23, or set actor_rollout_ref\.rollout\.name=vllm"):
        SglangSupportRecorder.check_engine(generate_req_input_class("0.5.12"))
    SglangSupportRecorder.check_engine(generate_req_input_class("0.5.23"))
    assert not SGLANG_PINS["0.5.12"].masks and SGLANG_PINS["0.5.23"].masks


@functools.cache
def _sglang_0512_response():
    logits = logits_of("smooth")
    ids = [s.token for s in sglang_steps(logits, 0.8, top_k=K, seed=4)]
    return ids, sglang_0512_meta_info(logits, 0.8, ids, top_logprobs_num=K + 1)


def test_sglang_0512_response_is_refused():
    """A 0.5.12 response carries log-probs of the whole tempered distribution (none filtered, so
    no support to read) and no mask: both adapters refuse it rather than read a row from it."""
    ids, meta = _sglang_0512_response()
    assert min(v for top in meta["output_top_logprobs"] for v, _, _ in top) > -9999.0
    with pytest.raises(ValueError, match="meta_info has no 'output_token_sampling_mask'"):
        support_from_sglang_meta_info(meta, ids, sampling_params={"temperature": 0.8, "top_k": K})
    with pytest.raises(ValueError, match="meta_info has no 'output_token_sampling_mask'"):
        support_from_sglang_response({"text": "", "output_ids": ids, "meta_info": meta})


def test_sglang_0512_response_refusal_names_the_release():
    ids, meta = _sglang_0512_response()
    with pytest.raises(ValueError, match="0.5.23"):
        support_from_sglang_meta_info(meta, ids)
