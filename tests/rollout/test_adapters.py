"""Engine adapters on fixtures built from each engine's documented output format.

The fixtures are derived from a real capture run: the processed distribution of each
position is known exactly, and the engine-shaped output is written from it the way the
engine documents it (vLLM ``Logprob(logprob, rank, decoded_token)`` maps with the sampled
token added, OpenAI-server JSON with ``token_id:<id>`` tokens and -inf clamped to -9999.0,
vLLM ``SamplingMask(token_ids, offsets)`` compacted in ascending id order, SGLang
``meta_info`` mask lists).
"""

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import pytest
import torch

from nemo_replay import capture
from nemo_replay.rollout.adapters import (
    capture_settings_from_engine,
    support_from_sglang_meta_info,
    support_from_vllm_logprobs,
    support_from_vllm_sampling_mask,
)


@dataclass
class Logprob:  # the fields vLLM documents for each entry of CompletionOutput.logprobs
    logprob: float
    rank: Optional[int]
    decoded_token: Optional[str]


class SamplingMask(NamedTuple):  # vLLM's CSR sampling mask (vllm-project/vllm#49577)
    token_ids: list
    offsets: list


K, T = 6, 0.8


@pytest.fixture(scope="module")
def rollout():
    torch.manual_seed(11)
    n, V = 24, 97
    logits = torch.randn(n, V) * 2
    fixed = capture.sample(logits, temperature=T, top_k=K, top_p=0.9, generator=torch.Generator().manual_seed(1))
    ragged = capture.sample(logits, temperature=T, top_p=0.8, min_p=0.02, generator=torch.Generator().manual_seed(2))
    return logits, fixed, ragged


def processed_logprobs(logits_row, members):
    x = logits_row.double() / T
    lq = torch.full_like(x, -math.inf)
    lq[members] = x[members] - torch.logsumexp(x[members], 0)
    return lq


def vllm_position(lq, sampled, k):
    """top-k by processed log-prob (ranks 1..k), plus the sampled token when outside."""
    order = sorted(range(lq.numel()), key=lambda t: (-float(lq[t]), t))
    entries = {t: Logprob(float(lq[t]), i + 1, f"<{t}>") for i, t in enumerate(order[:k])}
    if sampled not in entries:
        entries[sampled] = Logprob(float(lq[sampled]), order.index(sampled) + 1, f"<{sampled}>")
    return entries


def vllm_offline(logits, fixed):
    out = []
    for j in range(logits.shape[0]):
        members = [int(t) for t in fixed.support.values[j] if t >= 0]
        out.append(vllm_position(processed_logprobs(logits[j], members), int(fixed.ids[j]), K))
    return out


def as_completions_json(position):
    return {f"token_id:{t}": max(e.logprob, -9999.0) for t, e in position.items()}


def as_chat_json(position, sampled):
    top = [{"token": f"token_id:{t}", "logprob": max(e.logprob, -9999.0), "bytes": [60, 62]} for t, e in position.items()]
    return {"token": f"token_id:{sampled}", "logprob": position[sampled].logprob, "bytes": [60, 62], "top_logprobs": top[:K]}


PARAMS = {"temperature": T, "top_k": K, "top_p": 0.9, "logprobs": K, "repetition_penalty": 1.0}


@pytest.mark.parametrize("form", ["offline", "completions_json", "chat_json"])
def test_vllm_processed_logprobs_give_the_sampler_rows(rollout, form):
    logits, fixed, _ = rollout
    positions = vllm_offline(logits, fixed)
    if form == "completions_json":
        positions = [as_completions_json(p) for p in positions]
    elif form == "chat_json":
        positions = [as_chat_json(p, int(t)) for p, t in zip(positions, fixed.ids)]
    got = support_from_vllm_logprobs(positions, fixed.ids, top_k=K, vocab_size=97, sampling_params=PARAMS)
    assert got.num_repairs == 0
    assert torch.equal(got.support.values, fixed.support.values)
    assert got.support.cu_seqlens.tolist() == [0, logits.shape[0]]
    torch.testing.assert_close(got.logprobs, fixed.logprobs, rtol=0, atol=1e-5)


def test_vllm_pivot_drop_is_repaired_counted_and_logged(rollout, caplog):
    logits, fixed, _ = rollout
    positions = vllm_offline(logits, fixed)
    # Position 3: the engine kept K tokens that do not include the sampled one (it reports
    # the sampled token with rank K + 1). Position 5: a row with padding lost its sample.
    full = [9, 8, 7, 6, 5, 4]
    positions[3] = {t: Logprob(-1.0 - 0.1 * i, i + 1, None) for i, t in enumerate(full)}
    positions[3][40] = Logprob(-2.5, K + 1, None)
    positions[5] = {9: Logprob(-0.2, 1, None), 8: Logprob(-0.9, 2, None), 7: Logprob(-1.5, 3, None)}
    positions[5].update({t: Logprob(-math.inf, 4 + i, None) for i, t in enumerate([1, 2, 3])})
    positions[5][41] = Logprob(-math.inf, 7, None)  # the mask filtered the token it sampled
    ids = fixed.ids.clone()
    ids[3], ids[5] = 40, 41
    with caplog.at_level(logging.WARNING, logger="nemo_replay.rollout.adapters"):
        got = support_from_vllm_logprobs(positions, ids, top_k=K)
    assert got.num_repairs == 2 and torch.nonzero(got.repaired).flatten().tolist() == [3, 5]
    assert float(got.logprobs[3]) == -2.5 and float(got.logprobs[5]) == -math.inf
    assert got.support.values[3].tolist() == [9, 8, 7, 6, 5, 40]
    assert got.support.values[5].tolist() == [9, 8, 41, -1, -1, -1]
    assert "repaired 2 of 24 rows" in caplog.text and "[3, 5]" in caplog.text
    others = [j for j in range(24) if j not in (3, 5)]
    assert torch.equal(got.support.values[others], fixed.support.values[others])


def test_vllm_logprobs_errors(rollout):
    logits, fixed, _ = rollout
    positions = vllm_offline(logits, fixed)
    with pytest.raises(ValueError, match="23 log-prob entries for 24"):
        support_from_vllm_logprobs(positions[:-1], fixed.ids, top_k=K)
    with pytest.raises(ValueError, match="top_k"):
        support_from_vllm_logprobs(positions, fixed.ids, top_k=K, sampling_params={**PARAMS, "top_k": -1})
    with pytest.raises(ValueError, match="logprobs=2"):
        support_from_vllm_logprobs(positions, fixed.ids, top_k=K, sampling_params={**PARAMS, "logprobs": 2})
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        support_from_vllm_logprobs([{"hello": -0.1}], [5], top_k=K)
    bad = dict(positions[0])
    del bad[int(fixed.ids[0])]
    with pytest.raises(ValueError, match="position 0: no log-prob entry for the sampled token"):
        support_from_vllm_logprobs([bad], fixed.ids[:1], top_k=K)
    with pytest.raises(ValueError, match="vocab_size=50"):
        support_from_vllm_logprobs(positions, fixed.ids, top_k=K, vocab_size=50)


@pytest.mark.parametrize(
    "params, flag",
    [
        ({"top_k": 8}, "temperature"),
        ({"temperature": 0.0, "top_k": 8}, "temperature"),
        ({"temperature": 1.0, "top_k": 8, "repetition_penalty": 1.05}, "repetition_penalty"),
        ({"temperature": 1.0, "top_k": 8, "presence_penalty": 0.3}, "presence_penalty"),
        ({"temperature": 1.0, "top_k": 8, "frequency_penalty": 0.3}, "frequency_penalty"),
        ({"temperature": 1.0, "top_k": 1}, "top_k"),
    ],
)
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_settings_are_refused_naming_the_flag(params, flag, engine):
    with pytest.raises(ValueError, match=flag):
        capture_settings_from_engine(params, engine=engine)


def test_engine_spellings_of_no_top_k():
    for engine, value in [("vllm", 0), ("vllm", -1), ("sglang", -1), ("sglang", 1 << 30)]:
        assert capture_settings_from_engine({"temperature": 1.0, "top_k": value}, engine=engine)["top_k"] is None
    with pytest.raises(ValueError, match="engine="):
        capture_settings_from_engine({"temperature": 1.0}, engine="tgi")


def engine_mask_rows(ragged):
    """The engine compacts kept ids in ascending id order."""
    return [sorted(ragged.support.row(r).tolist()) for r in range(ragged.support.num_rows)]


@pytest.mark.parametrize("form", ["csr_object", "csr_mapping", "http_lists"])
def test_vllm_sampling_mask(rollout, form):
    _, _, ragged = rollout
    rows = engine_mask_rows(ragged)
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + len(r))
    flat = [t for r in rows for t in r]
    mask = {
        "csr_object": SamplingMask(flat, offsets),
        "csr_mapping": {"token_ids": flat, "offsets": offsets},
        "http_lists": rows,
    }[form]
    params = {"temperature": T, "top_k": -1, "top_p": 0.8, "min_p": 0.02}
    got = support_from_vllm_sampling_mask(mask, ragged.ids, vocab_size=97, sampling_params=params)
    assert got.logprobs is None and got.num_repairs == 0
    assert [got.support.row(r).tolist() for r in range(len(rows))] == rows
    assert got.support.cu_seqlens.tolist() == [0, len(rows)]


def test_vllm_sampling_mask_errors(rollout):
    _, _, ragged = rollout
    rows = engine_mask_rows(ragged)
    bad = [list(r) for r in rows]
    bad[7] = [t for t in bad[7] if t != int(ragged.ids[7])] or [96 if int(ragged.ids[7]) != 96 else 95]
    with pytest.raises(ValueError, match=r"row 7: sampled token"):
        support_from_vllm_sampling_mask(bad, ragged.ids)
    with pytest.raises(ValueError, match="rows for 23 generated tokens"):
        support_from_vllm_sampling_mask(rows, ragged.ids[:-1])
    with pytest.raises(ValueError, match="offsets"):
        support_from_vllm_sampling_mask(SamplingMask([1, 2, 3], [0, 2]), [1])
    with pytest.raises(ValueError, match="duplicate"):
        support_from_vllm_sampling_mask([[3, 3, 4]], [3])
    with pytest.raises(ValueError, match="--return-sampling-mask"):
        support_from_vllm_sampling_mask(None, [3])


def test_sglang_meta_info(rollout):
    _, _, ragged = rollout
    rows = engine_mask_rows(ragged)
    meta = {
        "output_token_sampling_mask": rows,
        "output_token_sampling_logprobs": [float(v) for v in ragged.logprobs],
        "finish_reason": {"type": "length"},
    }
    params = {"temperature": T, "top_k": -1, "top_p": 0.8, "min_p": 0.02}
    got = support_from_sglang_meta_info(meta, ragged.ids.tolist(), vocab_size=97, sampling_params=params)
    assert [got.support.row(r).tolist() for r in range(len(rows))] == rows
    torch.testing.assert_close(got.logprobs, ragged.logprobs)
    with pytest.raises(ValueError, match="return_sampling_mask"):
        support_from_sglang_meta_info({"output_token_logprobs": []}, [])
    with pytest.raises(ValueError, match="2 sampling log-probs for 24"):
        support_from_sglang_meta_info({**meta, "output_token_sampling_logprobs": [0.0, 0.0]}, ragged.ids)
    with pytest.raises(ValueError, match="repetition_penalty"):
        support_from_sglang_meta_info(meta, ragged.ids, sampling_params={**params, "repetition_penalty": 1.2})
