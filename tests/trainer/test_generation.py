"""Generation with capture: canonical batches whose replay log-probs match the sampler's."""

from __future__ import annotations

import pytest
import torch

from nemo_replay import score_aligned_support
from nemo_replay.layout.canonical import canonical_channels
from nemo_replay.support.checked import checked
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport
from nemo_replay.layout.canonical import position_ids
from nemo_replay.trainer.generation import SamplingSettings, generate, left_pad
from nemo_replay.trainer.tasks import SuccessorTask

V = 40


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )
    m = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # peaked distributions: truncation matters
    return m


def _logits(model, seq, mask):
    return model(input_ids=seq, attention_mask=mask.long(), position_ids=position_ids(mask), use_cache=False).logits


def test_left_pad_and_position_ids_worked_example():
    seq, mask = left_pad([torch.tensor([5, 6, 7]), torch.tensor([9])])
    assert seq.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    assert position_ids(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


@pytest.mark.parametrize(
    "top_k, top_p, stop, width",
    [(6, 0.9, None, None), (None, 0.8, None, None), (5, 1.0, 3, 8)],
    ids=["fixed-width", "ragged-top-p", "stop-token-wider-rows"],
)
def test_replay_reproduces_sampler_logprobs(model, top_k, top_p, stop, width):
    task = SuccessorTask(V, 1, 6, 5)
    g = torch.Generator().manual_seed(3)
    settings = SamplingSettings(1.3, top_k, top_p, 0.0, 5, stop, width)
    ro = generate(lambda s, m: _logits(model, s, m)[:, -1], task.prompts(16, g), settings, generator=g)
    b = ro.batch
    # Rows: one per response token, CSR (each row its support, no padding) unless a width is asked for.
    assert b.support.lengths.tolist() == b.response_lengths.tolist()
    assert isinstance(b.support, RaggedSupport if width is None else PackedTensor)
    if width is not None:
        assert b.support.values.shape[1] == width
    else:
        assert bool((b.support.member_ids >= 0).all()) and int(b.support.row_lengths.min()) >= 1
        if top_k is not None:
            assert int(b.support.row_lengths.max()) <= top_k
    # The sampler checked its rows; padding them to the run's width keeps that record.
    assert checked(b.support) is not None
    if stop is not None:
        for r in ro.responses:  # a response ends at (and keeps) the stop token
            hits = (r == stop).nonzero().flatten().tolist()
            assert hits in ([], [len(r) - 1])
    for i, (p, r) in enumerate(zip(ro.prompts, ro.responses)):
        real = b.sequences[i][b.attention_mask[i]]
        assert real.tolist() == p.tolist() + r.tolist()
    # The trainer's forward over the canonical batch, scored over the recorded support.
    ch = canonical_channels(b)
    with torch.no_grad():
        logits = _logits(model, b.sequences, b.attention_mask)[:, :-1]
    sc = score_aligned_support(logits, ch.sampled_ids, ch.row_ids, ch.loss_mask, b.support, temperature=1.3,
                               trajectory_ids=ch.trajectory_ids)
    A = b.loss_mask.shape[1]
    mask = b.loss_mask
    assert torch.equal(sc.valid_mask[:, -A:], mask)
    diff = (sc.logprobs[:, -A:] - b.rollout_logprobs)[mask].abs()
    assert diff.max() < 1e-5
    if width is None and top_k is not None:
        # The CSR rows score bit for bit as the sampler's fixed-width rows they came from.
        padded = score_aligned_support(logits, ch.sampled_ids, ch.row_ids, ch.loss_mask, b.support.to_padded(top_k),
                                       temperature=1.3, trajectory_ids=ch.trajectory_ids)
        assert torch.equal(padded.logprobs, sc.logprobs) and torch.equal(padded.valid_mask, sc.valid_mask)
    # Without replay the same tokens score differently: the truncation is real here.
    full = torch.log_softmax(logits.double() / 1.3, -1).gather(-1, ch.sampled_ids[..., None])[..., 0][:, -A:]
    assert (full - b.rollout_logprobs.double())[mask].abs().max() > 1e-2


def test_routes_keep_the_forward_that_first_processed_each_token():
    """Fake routes that name the step: token j's route must come from the step that first fed it."""
    calls = []

    def step(seq, mask):
        t = len(calls)
        calls.append(seq.shape[1])
        B, S = seq.shape
        logits = torch.zeros(B, 7)
        logits[:, 3] = 10.0  # (almost) always token 3
        routes = torch.full((B, S, 2, 1), 100 + t, dtype=torch.int64)
        return logits, routes

    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    ro = generate(step, prompts, SamplingSettings(1.0, 2, 1.0, 0.0, 3), generator=torch.Generator().manual_seed(0))
    r = ro.batch.routes
    assert r.lengths.tolist() == [6, 4]
    # trajectory 0: 3 prompt tokens (step 0), response tokens 0, 1 fed at steps 1, 2; the last never fed -> 0.
    assert r.segment(0)[:, 0, 0].tolist() == [100, 100, 100, 101, 102, 0]
    assert r.segment(1)[:, 0, 0].tolist() == [100, 101, 102, 0]


def test_rollout_batch_token_mask_keeps_flagged_tokens_out_of_the_loss_at_their_columns():
    """A flagged token (an engine adapter's position whose row is empty) leaves the loss at exactly
    its own right-aligned column: response 0 (3 tokens) loses token 1, response 1 (1 token) none."""
    from nemo_replay.trainer.generation import rollout_batch

    prompts = [torch.tensor([5, 6]), torch.tensor([7])]
    responses = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    rows = RaggedSupport(torch.tensor([1, 9, 3, 4], dtype=torch.int32), torch.tensor([0, 2, 2, 3, 4]),
                         torch.tensor([0, 3, 4], dtype=torch.int32))
    mask = torch.tensor([True, False, True, True])
    batch = rollout_batch(prompts, responses, -torch.rand(4), rows, token_mask=mask).batch
    assert batch.loss_mask.tolist() == [[True, False, True], [False, False, True]]
    with pytest.raises(ValueError, match=r"token_mask must be \(4,\) bool, one per response token, got \(3,\)"):
        rollout_batch(prompts, responses, -torch.rand(4), rows, token_mask=mask[:3])
