"""Support capture from transformers' generate, against a float64 recomputation of its warpers.

The reference restates the order transformers 5.24 documents for sampling
(``generation/utils.py``, ``GenerationMixin._get_logits_processor``: temperature, top-k,
top-p, min-p, appended in that order after every other processor;
``generation/logits_process.py``: ``TopKLogitsWarper`` keeps every score >= the k-th,
``TopPLogitsWarper`` drops tokens from the bottom while their cumulative mass stays
<= 1 - top_p, ``MinPLogitsWarper`` keeps p >= min_p * max p) as a float64 loop over the raw
logits ``generate`` itself reports (``output_logits=True``).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessorList, TopKLogitsWarper

from nemo_replay import score_aligned_support
from nemo_replay.rollout.capture.hf import (
    SupportRecorder,
    check_generation_config,
    cut_at_stop,
    generate_with_support,
    record_support,
)
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport

V = 48


def _model(twins: bool = False, dtype=torch.float32):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # peaked distributions: every filter cuts something
        if twins:  # token V/2 + i scores exactly like token i: every top-k cutoff is a tie
            model.lm_head.weight[V // 2 :] = model.lm_head.weight[: V // 2]
    return model.to(dtype)


@pytest.fixture(scope="module")
def model():
    return _model()


def _prompts():
    """Three left-padded prompts of lengths 5, 2 and 4 (distinct ids)."""
    rows = [[3, 9, 14, 20, 7], [11, 30], [5, 6, 40, 2]]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = True
    return ids, mask


def reference_support(z: torch.Tensor, temperature, top_k, top_p, min_p) -> set:
    """float64 loop over one row of raw logits (module doc)."""
    x = [float(v) / temperature for v in z.double()]
    keep = set(range(len(x)))
    if top_k:
        kth = sorted(x, reverse=True)[top_k - 1]
        keep = {i for i in keep if x[i] >= kth}
    if top_p < 1.0:
        top = max(x[i] for i in keep)
        total = sum(math.exp(x[i] - top) for i in keep)
        ascending = sorted(keep, key=lambda i: (x[i], i))
        mass = 0.0
        for pos, i in enumerate(ascending[:-1]):  # the top token always stays
            mass += math.exp(x[i] - top) / total
            if mass <= 1.0 - top_p:
                keep.discard(i)
    if min_p:
        top = max(x[i] for i in keep)
        keep = {i for i in keep if math.exp(x[i] - top) >= min_p}
    return keep


def _rows(support, n):
    if isinstance(support, PackedTensor):
        return [[int(t) for t in r if t >= 0] for r in support.values]
    return [support.row(r).tolist() for r in range(n)]


SETTINGS = [
    dict(temperature=1.0, top_k=6, top_p=1.0, min_p=None),
    dict(temperature=0.7, top_k=10, top_p=0.8, min_p=None),
    dict(temperature=1.3, top_k=0, top_p=0.9, min_p=0.05),  # 0: no top-k (None takes transformers' 50)
    dict(temperature=0.9, top_k=12, top_p=0.95, min_p=0.02),
]


CASES = [(s, torch.float32) for s in SETTINGS] + [(dict(temperature=1.0, top_k=8, top_p=0.9, min_p=None), torch.bfloat16)]


@pytest.mark.parametrize("settings, dtype", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) if isinstance(c, dict) else str(c)[6:])
def test_capture_matches_float64_warpers_with_kv_cache(model, settings, dtype):
    """Batched, left-padded, two EOS ids: every row and log-prob against the float64 warpers.

    The bf16 engine's logits tie often: rows keep every tied token (ragged where wider than k).
    """
    model = model if dtype == torch.float32 else _model(dtype=dtype)
    ids, mask = _prompts()
    seen = []
    handle = model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    gc = GenerationConfig(
        do_sample=True, max_new_tokens=7, eos_token_id=[4, 17], pad_token_id=0,
        output_logits=True, return_dict_in_generate=True, **settings,
    )
    torch.manual_seed(3)
    try:
        out = generate_with_support(model, ids, mask, gc)
    finally:
        handle.remove()
    assert seen[0] == ids.shape[1] and set(seen[1:]) == {1}  # KV cache: one new token per forward
    raw = torch.stack(out.output.logits, 1)  # (B, steps, V): generate's own raw logits
    rows = _rows(out.captured.support, int(out.captured.lengths.sum()))
    lps = out.captured.logprobs.tolist()
    k = 0
    for i, completion in enumerate(out.completions):
        assert completion.numel() == int(out.captured.lengths[i]) >= 1
        stops = [j for j, t in enumerate(completion.tolist()) if t in (4, 17)]
        assert stops in ([], [completion.numel() - 1])  # cut after the first EOS, which is kept
        for j, token in enumerate(completion.tolist()):
            want = reference_support(raw[i, j], settings["temperature"], settings["top_k"], settings["top_p"], settings["min_p"] or 0)
            assert set(rows[k]) == want and token in want
            x = raw[i, j].double() / settings["temperature"]
            ref = float(x[token] - torch.logsumexp(x[sorted(want)], 0))
            assert lps[k] == pytest.approx(ref, abs=2e-6)
            k += 1
    widest = max(len(r) for r in rows)
    # CSR rows, each its members; padded copies are the resolved top-k wide when every row fits.
    assert isinstance(out.captured.support, RaggedSupport)
    if settings["top_k"] and widest <= settings["top_k"]:
        assert out.captured.support.width_bound == settings["top_k"]


def test_trainer_forward_replays_the_cached_samples(model):
    """The trainer's full forward (no cache) scored over the captured rows gives the sampler's log-probs."""
    ids, mask = _prompts()
    gc = GenerationConfig(do_sample=True, temperature=0.8, top_k=8, top_p=0.9, max_new_tokens=6, eos_token_id=4, pad_token_id=0)
    torch.manual_seed(5)
    out = generate_with_support(model, ids, mask, gc)
    P, C = ids.shape[1], max(c.numel() for c in out.completions)
    seq = out.sequences[:, : P + C]
    attn = torch.cat([mask, torch.arange(C)[None, :] < out.captured.lengths[:, None]], 1)
    pos = (attn.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=attn.long(), position_ids=pos, use_cache=False).logits
    # Completion token j sits at column P + j and is predicted by the logit at P - 1 + j.
    source = logits[:, P - 1 : P - 1 + C]
    cols = torch.arange(C)[None, :]
    inside = cols < out.captured.lengths[:, None]
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), out.captured.lengths.cumsum(0)[:-1]])
    row_ids = torch.where(inside, starts[:, None] + cols, -1)
    scores = score_aligned_support(source, seq[:, P:], row_ids, inside, out.captured.support, temperature=0.8)
    assert torch.allclose(scores.logprobs[inside], out.captured.logprobs, atol=2e-5)


def test_ties_give_ragged_rows_wider_than_top_k():
    """Twin LM-head rows tie at every top-k cutoff: transformers keeps both, rows are k + 1 wide, never cut."""
    model = _model(twins=True)
    ids, mask = _prompts()
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=3, max_new_tokens=5, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    torch.manual_seed(0)
    out = generate_with_support(model, ids, mask, gc)
    support = out.captured.support
    assert isinstance(support, RaggedSupport)
    widths = support.row_lengths
    assert int(widths.min()) == 4 and int(widths.max()) == 4  # 3rd value tied: both twins kept
    raw = torch.stack(out.output.logits, 1)
    rows = _rows(support, support.num_rows)
    for i, completion in enumerate(out.completions):
        for j in range(completion.numel()):
            r = rows[int(out.captured.lengths[:i].sum()) + j]
            assert set(r) == reference_support(raw[i, j], 1.0, 3, 1.0, 0.0)
            twins = [t % (V // 2) for t in r]
            assert sorted(twins.count(t) for t in set(twins)) == [2, 2]  # two tied pairs: twins travel together


def test_worked_example_of_the_module_doc():
    """z = [0.1, 2.0, 2.0, 1.5, -1.0, 0.3], top_k = 2 (transformers' own warper): row [1, 2], log-prob log 0.5."""
    recorder = SupportRecorder(1.0)
    z = torch.tensor([[0.1, 2.0, 2.0, 1.5, -1.0, 0.3]])
    ids = torch.tensor([[5]])
    x = TopKLogitsWarper(2)(ids, recorder.first(ids, z))
    recorder.last(ids, x)
    captured = recorder.finish([[2]], row_width=2)
    assert captured.support.values.tolist() == [[1, 2]]
    assert captured.logprobs.tolist() == pytest.approx([math.log(0.5)])


def test_masking_processors_are_captured_rewriting_ones_refused(model):
    """suppress_tokens only removes tokens: fine. A processor that rewrites scores: refused at its step."""
    ids, mask = _prompts()
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=8, max_new_tokens=4, pad_token_id=0, suppress_tokens=[7, 21])
    torch.manual_seed(1)
    out = generate_with_support(model, ids, mask, gc)
    assert not {7, 21} & set(out.captured.support.all_ids.tolist())

    class Boost:  # a custom processor that adds 0.5 to token 9's score
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, 9] += 0.5
            return scores

    boosted = LlamaForCausalLM(model.config).eval()
    with torch.no_grad():
        boosted.lm_head.weight.zero_()  # flat logits: token 9 always leads, so it is a member
    recorder = SupportRecorder(1.0)
    with record_support(boosted, recorder), pytest.raises(ValueError, match=r"step 0, row 0: .* by 0.5 for the top token 9 .* rewrote the scores"):
        boosted.generate(
            input_ids=ids, attention_mask=mask.long(), logits_processor=LogitsProcessorList([Boost()]),
            generation_config=GenerationConfig(do_sample=True, temperature=1.0, top_k=4, max_new_tokens=2, pad_token_id=0),
        )
    assert "_get_logits_processor" not in vars(boosted)  # the wrap is gone after the call

    class Broken:  # at step `at`, a NaN score in row 1 or no finite score in row 2
        def __init__(self, at, row):
            self.at, self.row, self.step = at, row, 0

        def __call__(self, input_ids, scores):
            scores = scores.clone()
            if self.step == self.at:
                scores[self.row] = -math.inf
                if self.row == 1:
                    scores[1, 3] = math.nan
            self.step += 1
            return scores

    for step, row in ((1, 1), (2, 2)):
        with record_support(model, SupportRecorder(1.0)), pytest.raises(
            ValueError, match=rf"support capture, step {step}, row {row}: the processed scores hold NaN or \+inf, or no finite value"
        ):
            model.generate(
                input_ids=ids, attention_mask=mask.long(), logits_processor=LogitsProcessorList([Broken(step, row)]),
                generation_config=GenerationConfig(do_sample=True, temperature=1.0, top_k=4, max_new_tokens=4, pad_token_id=0),
            )


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(do_sample=False), "do_sample=False is greedy"),
        (dict(do_sample=True, num_beams=2), "num_beams=2"),
        (dict(do_sample=True, repetition_penalty=1.2), "repetition_penalty=1.2"),
        (dict(do_sample=True, sequence_bias={(5,): 1.0}), "sequence_bias"),
    ],
)
def test_settings_that_cannot_be_replayed_are_refused(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        check_generation_config(GenerationConfig(temperature=1.0, top_k=8, **kwargs))


def test_top_k_zero_is_unbounded_and_temperature_must_be_positive():
    assert check_generation_config(GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=0.9))["top_k"] is None
    with pytest.raises(ValueError, match="temperature"):
        check_generation_config(GenerationConfig(do_sample=True, temperature=-1.0, top_k=8))


def test_the_config_generate_resolves_is_the_one_captured():
    """Unset fields come from model.generation_config: its temperature and top-k are what is recorded."""
    model = _model()
    model.generation_config = GenerationConfig(temperature=0.7, top_k=5, pad_token_id=0)
    ids, mask = _prompts()
    torch.manual_seed(4)
    out = generate_with_support(model, ids, mask, GenerationConfig(do_sample=True, max_new_tokens=3))
    assert out.captured.support.width_bound == 5  # the model's top_k (transformers' own default is 50)
    model.generation_config = GenerationConfig(temperature=0.7, top_k=5, repetition_penalty=1.3, pad_token_id=0)
    with pytest.raises(ValueError, match=r"(?s)resolved GenerationConfig.*repetition_penalty=1.3"):
        generate_with_support(model, ids, mask, GenerationConfig(do_sample=True, max_new_tokens=3))
    recorder = SupportRecorder(1.0)  # the caller expects T = 1, generate resolves 0.7
    model.generation_config = GenerationConfig(temperature=0.7, top_k=5, pad_token_id=0)
    with record_support(model, recorder), pytest.raises(ValueError, match="resolved temperature=0.7 but the recorder was told 1.0"):
        model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=GenerationConfig(do_sample=True, max_new_tokens=2))


def test_finish_refuses_completions_that_generate_did_not_sample(model):
    ids, mask = _prompts()
    recorder = SupportRecorder(1.0)
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=5, max_new_tokens=3, pad_token_id=0)
    torch.manual_seed(2)
    with record_support(model, recorder):
        seq = model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=gc)
    good = [r.tolist() for r in seq[:, ids.shape[1] :]]
    assert recorder.finish(good).lengths.tolist() == [3, 3, 3]
    swapped = [good[1], good[0], good[2]]
    assert swapped[0][0] != good[0][0], "the swap must change row 0's first token, or it tests nothing"
    with pytest.raises(ValueError, match="completion 0, token 0 .* misaligned"):
        recorder.finish(swapped)
    # The last token is never fed back, so only its row can catch a wrong one: an alignment error.
    st = recorder.steps[2]
    outside = next(t for t in range(V) if t not in st.members[st.offsets[1] : st.offsets[2]].tolist())
    with pytest.raises(SupportAlignmentError, match=rf"completion 1, token 2 \({outside}\) is not a member of the support"):
        recorder.finish([good[0], good[1][:2] + [outside], good[2]])
    with pytest.raises(ValueError, match="holds 4 tokens but only 3 decoding steps"):
        recorder.finish([good[0] + [1], good[1], good[2]])
    with pytest.raises(ValueError, match="2 completions for a batch of 3"):
        recorder.finish(good[:2])


def test_cut_at_stop_worked_example():
    cut = cut_at_stop(torch.tensor([[5, 1, 0], [4, 6, 7]]), [1])
    assert [c.tolist() for c in cut] == [[5, 1], [4, 6, 7]]
    # A uint8 buffer is widened first: the stop id 300 must not wrap to 44 and cut row 1.
    cut = cut_at_stop(torch.tensor([[5, 1, 0], [4, 44, 7]], dtype=torch.uint8), [1, 300])
    assert [c.tolist() for c in cut] == [[5, 1], [4, 44, 7]] and cut[0].dtype == torch.int64


def test_generate_with_support_needs_a_generation_config(model):
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="generation_config must be a transformers.GenerationConfig, got NoneType"):
        generate_with_support(model, ids, mask, None)
