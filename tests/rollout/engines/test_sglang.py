"""SGLang adapters on /generate outputs built field for field as SGLang 0.5.23 builds them."""

import math

import pytest
import torch

from nemo_replay.rollout.engines.sglang import (
    SGLangAbortError,
    check_sglang_request,
    support_from_sglang_meta_info,
    support_from_sglang_response,
)
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.ragged import RaggedSupport
from tests.rollout.engines.engine_outputs import (
    sglang_abort_finish_reason,
    sglang_error_body,
    sglang_meta_info,
    sglang_overflow_message,
    sglang_steps,
)

K, T, V, N = 8, 0.9, 120, 30
PARAMS = {"temperature": T, "top_k": K, "top_p": 0.95}


@pytest.fixture(scope="module")
def steps():
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(7)) * 1.5
    steps = sglang_steps(logits, T, top_k=K, top_p=0.95, seed=1)
    # The point of the support mode: most sampled tokens are not their row's most probable one.
    assert sum(s.token != s.row[0] for s in steps) >= N // 3
    return logits, steps


def reference_logprob(logits_row, members, token):
    """float64: the sampled token's probability renormalised over its support."""
    p = torch.softmax(logits_row.double() / T, 0)
    return math.log(float(p[token] / p[members].sum()))


@pytest.mark.parametrize("mode", ["selected", "support"])
def test_both_logprob_modes_give_the_sampled_token_s_logprob(steps, mode):
    logits, steps = steps
    meta = sglang_meta_info(steps, mode)
    ids = [s.token for s in steps]
    got = support_from_sglang_meta_info(meta, ids, vocab_size=V, sampling_params=PARAMS)
    assert got.num_flagged == 0
    assert [got.support.row(j).tolist() for j in range(N)] == [s.row for s in steps]  # SGLang's order kept
    want = torch.tensor([reference_logprob(logits[j], s.row, s.token) for j, s in enumerate(steps)], dtype=torch.float32)
    torch.testing.assert_close(got.logprobs, want, rtol=0, atol=2e-5)
    if mode == "support":  # not the row's first (most probable) entry
        first = torch.tensor([s.support_logprobs[0] for s in steps])
        assert (got.logprobs - first).abs().max() > 0.1


def test_whole_response_and_fixed_width(steps):
    _, steps = steps
    response = {"text": "", "output_ids": [s.token for s in steps], "meta_info": sglang_meta_info(steps, "support")}
    got = support_from_sglang_response(response, width=K, vocab_size=V)
    assert isinstance(got.support, RaggedSupport) and got.support.to_padded().values.shape == (N, K)
    assert [set(got.support.row(j).tolist()) for j in range(N)] == [set(s.row) for s in steps]
    narrow = support_from_sglang_response(response, width=3, vocab_size=V)  # rows wider than 3 are flagged, not cut
    wider = [len(s.row) > 3 for s in steps]
    assert narrow.flagged.tolist() == wider and narrow.reasons == {"wider_than_row": sum(wider)}


def test_overflow_abort_is_refused_naming_the_fix(steps):
    _, steps = steps
    meta = sglang_meta_info(steps[:5], "selected")
    meta["finish_reason"] = sglang_abort_finish_reason(sglang_overflow_message(4096))
    with pytest.raises(SGLangAbortError, match=r"--sampling-mask-max-tokens.*lower sampling_params\.top_k"):
        support_from_sglang_meta_info(meta, [s.token for s in steps[:5]])
    with pytest.raises(SGLangAbortError, match=r"--sampling-mask-max-tokens=4096"):
        support_from_sglang_response(sglang_error_body(sglang_overflow_message(4096)))
    meta["finish_reason"] = sglang_abort_finish_reason("Client disconnected")
    with pytest.raises(SGLangAbortError, match="output is incomplete"):
        support_from_sglang_meta_info(meta, [s.token for s in steps[:5]])


def test_meta_info_errors(steps):
    _, steps = steps
    ids = [s.token for s in steps]
    meta = sglang_meta_info(steps, "support")
    with pytest.raises(ValueError, match="return_sampling_mask"):
        support_from_sglang_meta_info({"finish_reason": {"type": "length", "length": 3}}, ids)
    with pytest.raises(ValueError, match="29 sampling log-probs for 30 mask rows"):
        support_from_sglang_meta_info({**meta, "output_token_sampling_logprobs": meta["output_token_sampling_logprobs"][:-1]}, ids)
    with pytest.raises(ValueError, match="output_token_sampling_mask_length=31"):
        support_from_sglang_meta_info({**meta, "output_token_sampling_mask_length": 31}, ids)
    short = [list(v) for v in meta["output_token_sampling_logprobs"]]
    short[4] = short[4][:-1]
    with pytest.raises(ValueError, match="position 4: .* support log-probs for a row of"):
        support_from_sglang_meta_info({**meta, "output_token_sampling_logprobs": short}, ids)
    other = list(ids)
    other[6] = next(t for t in range(V) if t not in steps[6].row)
    with pytest.raises(ValueError, match=r"position 6: sampled token \d+ is not a member"):
        support_from_sglang_meta_info(meta, other)
    # Either log-prob mode: the alignment failure integrations tell apart from configuration errors.
    for mode in ("support", "selected"):
        with pytest.raises(SupportAlignmentError, match=r"(position|row) 6: sampled token \d+ is not a member"):
            support_from_sglang_meta_info(sglang_meta_info(steps, mode), other)
    with pytest.raises(ValueError, match="repetition_penalty"):
        support_from_sglang_meta_info(meta, ids, sampling_params={**PARAMS, "repetition_penalty": 1.2})


@pytest.mark.parametrize(
    "body, match",
    [
        ({"sampling_params": PARAMS}, "return_sampling_mask"),
        ({"return_sampling_mask": True, "sampling_params": {**PARAMS, "top_k": -1}}, r"top_k=-1.*1 < top_k <= --sampling-mask-max-tokens=4096"),
        ({"return_sampling_mask": True, "sampling_params": {**PARAMS, "top_k": 5000}}, r"top_k=5000"),
        ({"return_sampling_mask": True, "sampling_params": {**PARAMS, "temperature": 0.0}}, "temperature"),
        ({"return_sampling_mask": True, "sampling_logprobs_mode": "all", "sampling_params": PARAMS}, "sampling_logprobs_mode='all'"),
        ({"return_sampling_mask": True}, "sampling_params=None"),
    ],
)
def test_request_prerequisites_name_the_field(body, match):
    with pytest.raises(ValueError, match=match):
        check_sglang_request(body)


def test_request_prerequisites_accept_a_mask_request():
    body = {"return_sampling_mask": True, "sampling_logprobs_mode": "support", "sampling_params": PARAMS}
    assert check_sglang_request(body)["top_k"] == K
    with pytest.raises(ValueError, match="--sampling-mask-max-tokens=4"):
        check_sglang_request(body, mask_max_tokens=4)


def test_an_empty_mask_row_is_corrupted_output_named_at_the_engine(steps):
    """As for vLLM's masks (tests/rollout/engines/test_vllm.py): an empty row at a generated token
    never reaches the batch, whichever sampling log-prob mode the response used."""
    from nemo_replay.support.errors import SupportAlignmentError

    _, steps = steps
    ids = [s.token for s in steps]
    for mode in ("selected", "support"):
        meta = sglang_meta_info(steps, mode)
        meta["output_token_sampling_mask"] = [list(r) for r in meta["output_token_sampling_mask"]]
        meta["output_token_sampling_mask"][-1] = []
        if mode == "support":
            meta["output_token_sampling_logprobs"] = list(meta["output_token_sampling_logprobs"])
            meta["output_token_sampling_logprobs"][-1] = []
        with pytest.raises(SupportAlignmentError, match=rf"generated token {len(steps) - 1} of {len(steps)}: an empty sampling-mask row"):
            support_from_sglang_meta_info(meta, ids)
