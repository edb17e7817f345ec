"""vLLM adapters on outputs built field for field as vLLM 0.33.0 builds them (tests/rollout/engines/engine_outputs.py)."""

import enum
import logging

import pytest
import torch

from nemo_replay import capture
from nemo_replay.rollout.engines.base import EngineSupport
from nemo_replay.rollout.engines.vllm import (
    check_vllm_engine,
    check_vllm_request,
    support_from_vllm_generate,
    support_from_vllm_logprobs,
    support_from_vllm_output,
    support_from_vllm_sampling_mask,
)
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport
from tests.rollout.engines.engine_outputs import (
    FlatLogprobs,
    Logprob,
    SamplingMask,
    vllm_chat_logprobs,
    vllm_completions_logprobs,
    vllm_generate_choice,
    vllm_offline_output,
    vllm_steps,
)

K, T, V, N = 6, 0.8, 97, 24
PARAMS = {"temperature": T, "top_k": K, "top_p": 0.9, "logprobs": K + 1, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def steps():
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(11)) * 2
    return vllm_steps(logits, T, top_k=K, top_p=0.9, num_logprobs=K + 1)


def rows_of(result: EngineSupport) -> list[set]:
    s = result.support
    if isinstance(s, PackedTensor):
        return [{int(t) for t in r if t >= 0} for r in s.values]
    return [set(s.row(j).tolist()) for j in range(s.num_rows)]


def read(form: str, steps, width=None) -> EngineSupport:
    """One output path, read by the adapter its users call."""
    ids = [s.token for s in steps]
    if form == "offline_dicts":
        return support_from_vllm_output(vllm_offline_output(steps, K + 1), width=width, vocab_size=V, sampling_params=PARAMS)
    if form == "offline_flat":
        out = vllm_offline_output(steps, K + 1, flat=True)
        assert isinstance(out.logprobs, FlatLogprobs)
        return support_from_vllm_logprobs(out.logprobs, out.token_ids, width=width, vocab_size=V, sampling_params=PARAMS)
    if form == "offline_mask":
        out = vllm_offline_output(steps, K + 1, mask=True)
        return support_from_vllm_output(out, width=width, vocab_size=V, sampling_params=PARAMS)
    if form == "completions":
        return support_from_vllm_logprobs(vllm_completions_logprobs(steps, K + 1), ids, width=width, vocab_size=V, sampling_params=PARAMS)
    if form == "chat":
        chat = vllm_chat_logprobs(steps, K + 1, top_logprobs=K + 1)
        body = {"temperature": T, "top_k": K, "top_p": 0.9, "logprobs": True, "top_logprobs": K + 1}
        return support_from_vllm_logprobs(chat, width=width, vocab_size=V, sampling_params=body)  # ids from the content
    if form == "generate_logprobs":
        return support_from_vllm_generate(vllm_generate_choice(steps, K + 1, mask=False), width=width, vocab_size=V, sampling_params=PARAMS)
    if form == "generate_mask":
        return support_from_vllm_generate(vllm_generate_choice(steps, K + 1, mask=True), width=width, vocab_size=V, sampling_params=PARAMS)
    raise AssertionError(form)


FORMS = ["offline_dicts", "offline_flat", "offline_mask", "completions", "chat", "generate_logprobs", "generate_mask"]


@pytest.mark.parametrize("width", [None, K], ids=["ragged", "fixed"])
@pytest.mark.parametrize("form", FORMS)
def test_every_output_path_gives_the_sampler_rows(steps, form, width):
    got = read(form, steps, width)
    assert got.num_flagged == 0 and got.reasons == {}
    assert rows_of(got) == [set(s.mask) for s in steps]
    assert got.support.cu_seqlens.tolist() == [0, N]
    if width is None:
        assert isinstance(got.support, RaggedSupport)
        if "mask" in form:  # vLLM's order, ids ascending
            assert [got.support.row(j).tolist() for j in range(N)] == [s.mask for s in steps]
    else:
        # CSR rows, each its members; padded copies have the requested width.
        assert isinstance(got.support, RaggedSupport) and got.support.width_bound == K
        assert got.support.to_padded().values.shape == (N, K)
    want = torch.tensor([s.logprobs[0] for s in steps])
    torch.testing.assert_close(got.logprobs, want, rtol=0, atol=1e-6)
    assert got.loss_mask.all()


def test_sampling_mask_is_the_engine_s_one_field_dataclass(steps):
    mask = SamplingMask([s.mask for s in steps])  # vllm/outputs.py: token_ids is list[list[int]], nothing else
    got = support_from_vllm_sampling_mask(mask, [s.token for s in steps], vocab_size=V)
    assert got.logprobs is None and [got.support.row(j).tolist() for j in range(N)] == [s.mask for s in steps]

    class SamplingMaskLists:  # the engine-internal CSR form (vllm/v1/outputs.py:59-67)
        token_ids = [t for s in steps for t in s.mask]
        offsets = [0]

    with pytest.raises(ValueError, match=r"internal to vLLM.*CompletionOutput\.sampling_mask"):
        support_from_vllm_sampling_mask(SamplingMaskLists(), [s.token for s in steps])
    with pytest.raises(ValueError, match=r"internal to vLLM"):
        support_from_vllm_sampling_mask(SamplingMaskLists.token_ids, [s.token for s in steps])
    with pytest.raises(ValueError, match="--return-sampling-mask"):
        support_from_vllm_sampling_mask(None, [3])
    bad = [list(s.mask) for s in steps]
    bad[3][0] = 1.0
    with pytest.raises(ValueError, match=r"position 3: mask token id must be an int, got 1.0"):
        support_from_vllm_sampling_mask(bad, [s.token for s in steps])
    bad[3][0] = True
    with pytest.raises(ValueError, match=r"position 3: mask token id must be an int, got True"):
        support_from_vllm_sampling_mask(bad, [s.token for s in steps])
    with pytest.raises(ValueError, match=r"row 7: sampled token 96"):
        support_from_vllm_sampling_mask(mask, [s.token for s in steps[:7]] + [96] + [s.token for s in steps[8:]])
    with pytest.raises(ValueError, match="24 support entries for 23 generated tokens"):
        support_from_vllm_sampling_mask(mask, [s.token for s in steps[:-1]])


def test_generate_endpoint_logprobs_are_read_by_token_id(steps):
    choice = vllm_generate_choice(steps, K + 1, mask=False)
    entry = choice["logprobs"]["content"][0]
    assert set(entry) == {"token_id", "logprob", "rank", "top_logprobs"} and "token" not in entry
    assert entry["top_logprobs"][0]["token_id"] == steps[0].token  # the sampled token first, then the rest
    assert any(e["logprob"] == -9999.0 for e in entry["top_logprobs"])  # -inf clamped on the wire
    got = support_from_vllm_logprobs(choice["logprobs"], choice["token_ids"], vocab_size=V)
    assert rows_of(got) == [set(s.mask) for s in steps]


# ------------------------------------------------------------------ ties wider than the list or the row


@pytest.fixture(scope="module")
def tied():
    """vLLM's PyTorch path on bf16 logits: every token tied with the k-th value is kept."""
    k, vocab, n = 50, 32000, 40
    logits = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(3)) * 2.5).bfloat16().float()
    steps = vllm_steps(logits, 1.0, top_k=k, num_logprobs=k + 1, ties="keep_tied", seed=5)
    sizes = [len(s.mask) for s in steps]
    assert sum(z > k for z in sizes) >= n // 4 and sum(z == k for z in sizes) >= 3, sizes
    return k, vocab, logits, sizes


def test_chat_cut_and_short_lists_flag_instead_of_losing_members(tied):
    k, vocab, logits, sizes = tied
    n = len(sizes)
    # As old docs advised: top_logprobs = top_k. A list cut at k entries cannot show a support of k or more.
    steps = vllm_steps(logits, 1.0, top_k=k, num_logprobs=k, ties="keep_tied", seed=5)
    got = support_from_vllm_logprobs(vllm_chat_logprobs(steps, k, top_logprobs=k), vocab_size=vocab)
    flagged = got.flagged.tolist()
    assert flagged == [z >= k for z in sizes] and got.reasons == {"not_fully_visible": sum(flagged)}
    assert all(rows_of(got)[j] == (set() if flagged[j] else set(steps[j].mask)) for j in range(n))
    # With a list long enough to end in a filtered entry, every support is read whole -- wider than k too.
    wide = vllm_steps(logits, 1.0, top_k=k, num_logprobs=max(sizes) + 1, ties="keep_tied", seed=5)
    chat = vllm_chat_logprobs(wide, max(sizes) + 1, top_logprobs=max(sizes) + 1)
    whole = support_from_vllm_logprobs(chat, vocab_size=vocab)
    assert whole.num_flagged == 0 and rows_of(whole) == [set(s.mask) for s in wide]
    assert max(whole.support.row_lengths.tolist()) > k


def test_supports_wider_than_a_fixed_row_are_flagged_never_cut(tied, caplog):
    k, vocab, logits, sizes = tied
    steps = vllm_steps(logits, 1.0, top_k=k, num_logprobs=max(sizes) + 1, ties="keep_tied", seed=5)
    with caplog.at_level(logging.WARNING, logger="nemo_replay.rollout.engines.base"):
        got = support_from_vllm_output(vllm_offline_output(steps, max(sizes) + 1), width=k, vocab_size=vocab)
    wider = [z > k for z in sizes]
    assert got.flagged.tolist() == wider and got.reasons == {"wider_than_row": sum(wider)}
    assert isinstance(got.support, RaggedSupport) and got.support.to_padded().values.shape == (len(sizes), k)
    for j, s in enumerate(steps):
        assert rows_of(got)[j] == (set() if wider[j] else set(s.mask))
    assert f"{sum(wider)} of {len(sizes)} positions flagged" in caplog.text and "wider_than_row" in caplog.text
    # The engine's mask carries the same supports: whole when ragged, flagged when fixed.
    masked = support_from_vllm_output(vllm_offline_output(steps, max(sizes) + 1, mask=True), width=k, vocab_size=vocab)
    assert masked.flagged.tolist() == wider


def test_logprob_errors_name_the_cause(steps, caplog):
    out = vllm_offline_output(steps, K + 1)
    positions, ids = out.logprobs, out.token_ids
    with pytest.raises(ValueError, match="pass sampled_ids"):
        support_from_vllm_logprobs(positions)
    with pytest.raises(ValueError, match="24 support entries for 23 generated tokens"):
        support_from_vllm_logprobs(positions, ids[:-1])
    swapped = list(ids)
    swapped[4] = next(t for t in positions[4] if t != ids[4])
    with pytest.raises(ValueError, match=r"position 4: the first entry is token \d+ but the response sampled"):
        support_from_vllm_logprobs(positions, swapped)
    filtered = [dict(p) for p in positions]
    filtered[2][ids[2]] = Logprob(float("-inf"), 90, None)
    with pytest.raises(ValueError, match=r"position 2: the sampled token \d+ has log-prob -inf.*--logprobs-mode processed_logprobs"):
        support_from_vllm_logprobs(filtered, ids)
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        support_from_vllm_logprobs({"content": [{"token": " the", "logprob": -0.1, "top_logprobs": []}]})
    with pytest.raises(ValueError, match=r"position 0: token id must be an int, got 1.5"):
        support_from_vllm_logprobs([{1.5: Logprob(-0.1)}], [1])
    with pytest.raises(ValueError, match=r"generated token 0 must be an int, got True"):
        support_from_vllm_logprobs(positions[:1], [True])
    # Raw log-probs are never -inf: every list holds members only, all positions flagged, and the hint says why.
    raw = [{t: Logprob(-1.0 - 0.1 * i, i + 1) for i, t in enumerate(p)} for p in positions]
    with caplog.at_level(logging.WARNING, logger="nemo_replay.rollout.engines.base"):
        got = support_from_vllm_logprobs(raw, ids)
    assert got.num_flagged == N and "--logprobs-mode processed_logprobs" in caplog.text


# ------------------------------------------------------------------ prerequisites


@pytest.mark.parametrize(
    "params, path, match",
    [
        ({"temperature": 1.0, "top_k": -1}, "mask", "top_k=-1 is unbounded"),
        ({"temperature": 1.0, "top_k": 0}, "mask", "top_k=0 is unbounded"),
        ({"temperature": 0.0, "top_k": 8}, "mask", "temperature"),
        ({"temperature": 1.0, "top_k": 8, "logprobs": 8}, "logprobs", r"logprobs=8; request logprobs=25 \(vllm_row_width"),
        ({"temperature": 1.0, "top_k": 8, "logprobs": True, "top_logprobs": 8}, "logprobs", "top_logprobs=25"),
        ({"temperature": 1.0, "top_k": 8}, "logprobs", "logprobs=None"),
        ({"temperature": 1.0, "top_k": 8, "logprobs": 9, "presence_penalty": 0.5}, "logprobs", "presence_penalty"),
    ],
)
def test_request_prerequisites_name_the_field(params, path, match):
    with pytest.raises(ValueError, match=match):
        check_vllm_request(params, path=path)


def test_request_prerequisites_accept_what_vllm_needs():
    assert check_vllm_request({"temperature": 1.0, "top_k": 8}, path="mask")["top_k"] == 8
    assert check_vllm_request({"temperature": 1.0, "top_k": 8, "logprobs": 9}, path="logprobs")["top_k"] == 8
    with pytest.raises(ValueError, match=r"logprobs=-1 asks for the whole vocabulary.*request logprobs=25"):
        check_vllm_request({"temperature": 1.0, "top_k": 8, "logprobs": -1}, path="logprobs")
    assert check_vllm_request({"temperature": 0.7, "top_k": 8, "logprobs": True, "top_logprobs": 9}, path="logprobs")["temperature"] == 0.7


def test_engine_prerequisites_name_the_flag():
    class ModelConfig:  # vllm/config/model.py: the fields checked
        logprobs_mode, return_sampling_mask, max_logprobs = "raw_logprobs", False, 20

    class VllmConfig:
        model_config, use_v2_model_runner = ModelConfig(), False

    with pytest.raises(ValueError) as err:
        check_vllm_engine(VllmConfig(), path="mask")
    for flag in ("--logprobs-mode processed_logprobs", "--return-sampling-mask", "VLLM_USE_V2_MODEL_RUNNER=1"):
        assert flag in str(err.value)
    with pytest.raises(ValueError, match="--max-logprobs 65"):
        check_vllm_engine({"logprobs_mode": "processed_logprobs", "max_logprobs": 20}, path="logprobs", top_k=64)
    check_vllm_engine({"logprobs_mode": "processed_logprobs", "max_logprobs": -1}, path="logprobs", top_k=64)
    check_vllm_engine({"logprobs_mode": "processed_logprobs", "return_sampling_mask": True, "use_v2_model_runner": True}, path="mask")
    # Left-out keys are vLLM's defaults, not skipped checks; nothing to check is an error, not a pass.
    with pytest.raises(ValueError, match="logprobs_mode='raw_logprobs'"):
        check_vllm_engine({"max_logprobs": 100}, path="logprobs", top_k=8)
    with pytest.raises(ValueError, match="Model Runner V2 cannot be confirmed"):
        check_vllm_engine({"logprobs_mode": "processed_logprobs", "return_sampling_mask": True}, path="mask")
    with pytest.raises(ValueError, match="expected llm.llm_engine.vllm_config or a mapping"):
        check_vllm_engine(None, path="logprobs")

    class OlderModelConfig:  # vLLM 0.24 / 0.25 (verl 0.9.1, NeMo-RL): no return_sampling_mask field
        logprobs_mode, max_logprobs = "processed_logprobs", 65

    class OlderVllmConfig:
        model_config, use_v2_model_runner = OlderModelConfig(), True

    check_vllm_engine(OlderVllmConfig(), path="logprobs", top_k=64)

    class LogprobsMode(enum.Enum):  # older releases hold logprobs_mode as an Enum, not a str
        PROCESSED = "processed_logprobs"

    OlderModelConfig.logprobs_mode = LogprobsMode.PROCESSED
    check_vllm_engine(OlderVllmConfig(), path="logprobs", top_k=64)
    OlderModelConfig.logprobs_mode = "raw_logprobs"
    with pytest.raises(ValueError, match="logprobs_mode='raw_logprobs'"):
        check_vllm_engine(OlderVllmConfig(), path="logprobs", top_k=64)
    OlderModelConfig.logprobs_mode = "processed_logprobs"
    with pytest.raises(ValueError, match=r"this vLLM has no sampling masks"):
        check_vllm_engine(OlderVllmConfig(), path="mask")


def test_capture_rows_are_what_the_engine_reports(steps):
    """The simulated engine and capture agree: the fixture's supports are the sampler's."""
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(11)) * 2
    res = capture.sample(logits.double(), temperature=T, top_k=K, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert [set(res.support.row(j).tolist()) for j in range(N)] == [set(s.mask) for s in steps]


@pytest.mark.parametrize("where", [3, N - 1])
def test_an_empty_mask_row_is_corrupted_output_named_at_the_engine(steps, where):
    """A sampling-mask row always holds the token drawn from it. Empty, it was taken as no row:
    at the response's last token the synthetic EOS (scored over the whole vocabulary), elsewhere
    a misalignment far from the engine. Both the offline object and the HTTP lists are refused."""
    from nemo_replay.support.errors import SupportAlignmentError

    rows = [list(s.mask) for s in steps]
    rows[where] = []
    ids = [s.token for s in steps]
    for mask in (SamplingMask(rows), rows):
        with pytest.raises(SupportAlignmentError, match=rf"vLLM sampling-mask adapter, generated token {where} of {N}: an empty "
                           r"sampling-mask row; .* this output is corrupted"):
            support_from_vllm_sampling_mask(mask, ids, vocab_size=V)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("form", ["dicts", "flat"])
def test_the_array_reader_equals_the_entry_by_entry_reader(seed, form):
    """The offline forms are read with array operations over the whole response; the same entries
    with their values as ``{"logprob": ...}`` mappings take the entry-by-entry reader. Both must give
    the same rows (order included), flags and log-probs on ties at the cutoff, ``keep_tied`` rows
    wider than k, lists of k entries (not fully visible) and a sampled token listed twice."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(40, V, generator=g) * 2).round() / 2  # many ties
    num = K + 1 if seed % 2 else K  # K entries: some positions not fully visible
    steps = vllm_steps(logits, T, top_k=K, top_p=0.9 if seed % 3 else 1.0, num_logprobs=num,
                       ties="keep_tied" if seed % 2 else "index_order", seed=seed)
    out = vllm_offline_output(steps, num, flat=form == "flat")
    ids = out.token_ids
    fast = support_from_vllm_logprobs(out.logprobs, ids, vocab_size=V)
    positions = out.logprobs if form == "dicts" else [
        {out.logprobs.token_ids[i]: out.logprobs.logprobs[i] for i in range(s, e)}
        for s, e in zip(out.logprobs.start_indices, out.logprobs.end_indices)]
    slow = support_from_vllm_logprobs([{t: {"logprob": getattr(v, "logprob", v)} for t, v in p.items()} for p in positions],
                                      ids, vocab_size=V)
    assert [fast.support.row(j).tolist() for j in range(len(ids))] == [slow.support.row(j).tolist() for j in range(len(ids))]
    assert torch.equal(fast.flagged, slow.flagged) and fast.reasons == slow.reasons
    assert torch.equal(fast.logprobs, slow.logprobs)
    for width in (K, K - 2):
        a, b = (support_from_vllm_logprobs(x, ids, width=width, vocab_size=V) for x in
                (out.logprobs, [{t: {"logprob": getattr(v, "logprob", v)} for t, v in p.items()} for p in positions]))
        assert a.support == b.support and a.support.width_bound == b.support.width_bound
        assert torch.equal(a.flagged, b.flagged) and a.reasons == b.reasons


@pytest.mark.parametrize("top_k, top_p, temperature, n", [(64, 1.0, 1.0, 64), (20, 1.0, 0.7, 46)])
def test_the_margin_keeps_every_position_vllm_024_ties_past_k(top_k, top_p, temperature, n):
    """vLLM 0.24 / 0.25 run the PyTorch top-k/top-p path for a step of fewer than 8 rows
    (topk_topp_sampler.py:345-360), which keeps every token tied with the k-th value (:384-392;
    the sampler's ``keep_tied`` rule, call for call). On bf16 logits that widens many supports
    past k: asked for top_k + 1 log-probs, those positions were flagged and left the loss; asked
    for vllm_row_width + 1, every position is read whole, rows equal to the engine's supports."""
    from nemo_replay.rollout.engines.vllm import VLLM_TIE_MARGIN, vllm_row_width

    vocab = 32000
    logits = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 2.5).to(torch.bfloat16).float()
    width = vllm_row_width(top_k, top_k + 1 + VLLM_TIE_MARGIN)
    assert width == top_k + VLLM_TIE_MARGIN
    kept = {}
    for asked in (top_k + 1, width + 1):
        steps = vllm_steps(logits, temperature, top_k=top_k, top_p=top_p, num_logprobs=asked, ties="keep_tied")
        out = vllm_offline_output(steps, asked)
        got = support_from_vllm_logprobs(out.logprobs, out.token_ids, width=asked - 1, vocab_size=vocab)
        kept[asked] = n - int(got.flagged.sum())
        if asked == width + 1:
            assert [sorted(got.support.row(j).tolist()) for j in range(n)] == [s.mask for s in steps]
            assert max(len(s.mask) for s in steps) > top_k  # ties past k were there to lose
    assert kept[width + 1] == n and kept[top_k + 1] < n, kept


def test_a_batch_checks_each_distinct_request_setting_naming_its_first_response():
    """The live engines check every distinct sampler setting of a batch once (not every request):
    two requests that differ only in chat's ``top_logprobs`` are two settings, and the one that
    cannot show a support whole is named by its response before anything is read."""
    from nemo_replay.trainer.backends.vllm_engine import capture_rollout

    body = {"temperature": 1.0, "top_k": 8, "logprobs": True, "top_logprobs": 25}
    bodies = [body, dict(body, seed=3), dict(body, top_logprobs=3)]  # the seed alone is no other setting
    prompts, responses = [torch.tensor([1])] * 3, [torch.tensor([2])] * 3

    def read_one(i):
        raise AssertionError("nothing is read before the settings pass")

    with pytest.raises(ValueError, match=r"response 2 \(and every response of the same setting\): .*logprobs=3"):
        capture_rollout(prompts, responses, bodies, None, read_one, where="response", vocab_size=32, row_width=None,
                        pad_id=0, device="cpu")
