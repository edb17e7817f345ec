"""Multi-turn traces: one row per response token, routes requested suffix by suffix."""

import re

import pytest
import torch

import nemo_replay
from nemo_replay import capture
from nemo_replay.batch import ReplayBatch
from nemo_replay.layout.canonical import canonical_channels
from nemo_replay.rollout.capture.trace import RouteTrace, SupportTrace, TokenAlignedAccumulator
from nemo_replay.support.ragged import RaggedSupport

EOS, V, K, TEMP = 2, 64, 5, 0.9


def turn(gen, n, *, end_with_eos=False, top_k=K):
    """Sample n tokens from random logits; the last one is forced to EOS when asked."""
    logits = torch.randn(n, V, generator=gen) * 2
    logits[:, EOS] = -30.0  # EOS only where it should end a turn
    if end_with_eos:
        logits[-1, EOS] = 30.0
    res = capture.sample(logits, temperature=TEMP, top_k=top_k, generator=gen)
    assert (res.ids[-1] == EOS) == end_with_eos
    return logits, res


def test_accumulator_grows_and_keeps_its_schema():
    acc = TokenAlignedAccumulator((3,), torch.int32, fill=-1, capacity=2)
    chunks = [torch.arange(3 * n, dtype=torch.int32).view(n, 3) + 100 * n for n in (1, 4, 0, 7)]
    for c in chunks:
        acc.append(c)
    acc.append_fill(2)
    want = torch.cat(chunks + [torch.full((2, 3), -1, dtype=torch.int32)])
    assert len(acc) == 14 and torch.equal(acc.values(), want)
    with pytest.raises(ValueError, match=r"expected \(n, 3\)"):
        acc.append(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="int64"):
        acc.append(torch.zeros(2, 3, dtype=torch.int64))


@pytest.mark.parametrize("top_k", [K, None], ids=["fixed", "ragged"])
def test_three_turn_conversation_one_row_per_response_token(top_k):
    gen = torch.Generator().manual_seed(0)
    trace = SupportTrace(top_k=top_k, eos_id=EOS, vocab_size=V)
    l1, t1 = turn(gen, 3, end_with_eos=True, top_k=top_k)
    trace.add_turn(t1.ids, t1.support, response_ids=t1.ids[:-1])  # the generator strips the EOS
    trace.add_observation([EOS, 40, 41])  # the template closes the turn with the EOS again
    l2, t2 = turn(gen, 3, end_with_eos=True, top_k=top_k)
    trace.add_turn(t2.ids, t2.support)
    trace.add_observation([42, 43, 44])
    l3, t3 = turn(gen, 2, top_k=top_k)  # truncated: no EOS sampled
    trace.add_turn(t3.ids, t3.support)
    trace.add_synthetic_eos()

    response = torch.cat([t1.ids, torch.tensor([40, 41]), t2.ids, torch.tensor([42, 43, 44]), t3.ids, torch.tensor([EOS])])
    trace.check_response(response)
    assert trace.num_rows == len(trace) == response.numel() == 14
    sampled_at = [0, 1, 2, 5, 6, 7, 11, 12]
    padding_at = [3, 4, 8, 9, 10, 13]
    assert trace.loss_mask.tolist() == [True] * 3 + [False] * 2 + [True] * 3 + [False] * 3 + [True] * 3
    sup = trace.support()  # CSR, each row its members: observation and EOS rows are empty
    assert isinstance(sup, RaggedSupport) and sup.row_lengths[padding_at].eq(0).all()
    assert sup.member_ids.numel() == int(sup.row_lengths.sum()) and bool((sup.member_ids >= 0).all())
    if top_k is not None:
        assert sup.width_bound == top_k  # padded copies have the engine's width
    padded = sup.to_padded(top_k or V).values
    assert (padded[padding_at] == -1).all()
    engine_rows = [t.support.to_padded().values if top_k is not None else t.support.to_padded(V).values for t in (t1, t2, t3)]
    assert torch.equal(padded[sampled_at], torch.cat(engine_rows))

    # The trainer scores this response over the traced rows: sampled tokens reproduce the
    # sampler's log-probs, the synthetic EOS falls back to the full vocabulary.
    prompt = torch.tensor([7, 8, 9])
    seq = torch.cat([prompt, response])[None]
    S, R = seq.shape[1], response.numel()
    batch = ReplayBatch(
        sequences=seq,
        attention_mask=torch.ones_like(seq, dtype=torch.bool),
        response_lengths=torch.tensor([R]),
        loss_mask=trace.loss_mask[None],
        support=sup,
    )
    ch = canonical_channels(batch)
    source = torch.randn(1, S - 1, V)
    step_logits = torch.cat([l1, l2, l3])
    source[0, torch.tensor(sampled_at) + len(prompt) - 1] = step_logits
    scores = nemo_replay.score_aligned_support(
        source, ch.sampled_ids, ch.row_ids, ch.loss_mask, batch.support, temperature=TEMP, trajectory_ids=ch.trajectory_ids
    )
    cols = torch.tensor(sampled_at) + len(prompt) - 1
    torch.testing.assert_close(scores.logprobs[0, cols], torch.cat([t1.logprobs, t2.logprobs, t3.logprobs]), rtol=0, atol=1e-6)
    assert scores.valid_mask[0, cols].all()
    assert scores.fallback_mask[0, S - 2] and int(scores.fallback_mask.sum()) == 1


def test_stripped_eos_keeps_its_row_only_when_it_comes_back():
    gen = torch.Generator().manual_seed(1)
    trace = SupportTrace(top_k=K, eos_id=EOS)
    _, t1 = turn(gen, 2, end_with_eos=True)
    trace.add_turn(t1.ids, t1.support, response_ids=t1.ids[:-1])
    trace.add_observation([50, 51])  # the EOS never re-enters the conversation: its row goes
    _, t2 = turn(gen, 2, end_with_eos=True)
    trace.add_turn(t2.ids, t2.support, response_ids=t2.ids[:-1])
    trace.add_synthetic_eos()  # the trainer's final EOS is the sampled one coming back
    assert trace.response_ids.tolist() == [int(t1.ids[0]), 50, 51] + t2.ids.tolist()
    rows = trace.support().to_padded().values
    assert torch.equal(rows[0], t1.support.to_padded().values[0]) and (rows[1:3] == -1).all()
    assert torch.equal(rows[3:], t2.support.to_padded().values)
    assert trace.loss_mask.tolist() == [True, False, False, True, True]


def test_support_trace_errors():
    gen = torch.Generator().manual_seed(2)
    trace = SupportTrace(top_k=K, eos_id=EOS)
    _, t1 = turn(gen, 3)
    with pytest.raises(ValueError, match=r"expected \(2, 5\)"):
        trace.add_turn(t1.ids[:2], t1.support.to_padded())
    with pytest.raises(ValueError, match="3 support rows for 2 sampled tokens"):
        trace.add_turn(t1.ids[:2], t1.support)
    with pytest.raises(ValueError, match="may only strip a sampled EOS"):
        trace.add_turn(t1.ids, t1.support, response_ids=t1.ids[:-1])
    shifted = t1.support.to_padded().values.roll(1, 0)
    with pytest.raises(ValueError, match="turn 0: row 0: sampled token"):
        trace.add_turn(t1.ids, shifted)
    with pytest.raises(ValueError, match="turn 0: rows have dtype torch.float64, expected integer token ids"):
        trace.add_turn(t1.ids, t1.support.to_padded().values.double() + 0.5)
    trace.add_turn(t1.ids, t1.support)
    with pytest.raises(ValueError, match="response has 2 tokens but the trace holds 3"):
        trace.check_response(t1.ids[:2])
    with pytest.raises(ValueError, match="position 1 holds token"):
        trace.check_response(torch.tensor([int(t1.ids[0]), 63 if int(t1.ids[1]) != 63 else 62, int(t1.ids[2])]))
    trace.add_synthetic_eos()
    with pytest.raises(ValueError, match="synthetic EOS; nothing may follow"):
        trace.add_observation([1])
    with pytest.raises(ValueError, match="ragged"):
        SupportTrace(top_k=None).add_turn(t1.ids, t1.support.to_padded())


def fake_routes(tokens: torch.Tensor, layers=3, topk=2, experts=8) -> torch.Tensor:
    """Causal toy router: token t's experts depend on tokens <= t only."""
    prefix = torch.cumsum(tokens * 7 + 3, 0)
    pos = torch.arange(tokens.numel())
    base = prefix[:, None, None] + pos[:, None, None] * 5 + torch.arange(layers)[None, :, None] * 11
    return ((base + torch.arange(topk)[None, None, :] * 3) % experts).to(torch.int32)


def engine_request(conversation: list, start: int, n_new: int, gen):
    """What an engine returns: n_new tokens and routes of tokens [start, T_new - 1)."""
    new = torch.randint(10, 60, (n_new,), generator=gen).tolist()
    full = torch.tensor(conversation + new)
    return new, fake_routes(full[:-1])[start:] if n_new else fake_routes(full)[start:]


def test_route_trace_asks_only_for_the_new_suffix():
    gen = torch.Generator().manual_seed(3)
    trace = RouteTrace(num_layers=3, topk=2)
    conv = [5, 6, 7, 8]
    trace.add_tokens(len(conv))
    starts = []
    for n_new, obs in [(3, [30, 31]), (4, [32]), (2, None)]:
        start = trace.request_start
        starts.append(start)
        new, routes = engine_request(conv, start, n_new, gen)
        trace.add_request(routes, start=start, num_generated=n_new)
        conv += new
        if obs:
            conv += obs
            trace.add_tokens(len(obs))
    assert starts == [0, 6, 12]  # each request starts where the routed prefix ends
    T = len(conv)
    full = fake_routes(torch.tensor(conv))
    response_mask = torch.ones(T - 4, dtype=torch.bool)
    out = trace.finish(response_mask)  # the last sampled token's routes feed no target
    assert out.shape == (T, 3, 2)
    assert torch.equal(out[:-1], full[:-1]) and (out[-1] == -1).all()

    # A synthetic EOS after it is a loss-active target that needs those routes: refused...
    trace.add_tokens(1)
    conv.append(EOS)
    with pytest.raises(ValueError, match="refusing to invent routes.*start=15"):
        trace.finish(torch.ones(T + 1 - 4, dtype=torch.bool))
    # ...unless the target is not loss-active,
    trace.finish(torch.cat([torch.ones(T - 4, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)]))
    # or a prefill-only request supplies the routes.
    start = trace.request_start
    _, routes = engine_request(conv, start, 0, gen)
    trace.add_request(routes, start=start, num_generated=0)
    assert torch.equal(trace.finish(torch.ones(T + 1 - 4, dtype=torch.bool)), fake_routes(torch.tensor(conv)))


def test_route_trace_errors():
    trace = RouteTrace(num_layers=2, topk=2)
    trace.add_tokens(4)
    with pytest.raises(ValueError, match="request routes from start=0"):
        trace.add_request(torch.zeros(6, 2, 2, dtype=torch.int32), start=1, num_generated=3)
    with pytest.raises(ValueError, match="got 4 route rows"):
        trace.add_request(torch.zeros(4, 2, 2, dtype=torch.int32), start=0, num_generated=3)
    with pytest.raises(ValueError, match=r"routes must be an int \(m, layers, topk\) tensor, got list"):
        trace.add_request([[[0, 1]]] * 6, start=0, num_generated=3)
    with pytest.raises(ValueError, match=r"expected \(n, 2, 2\)"):
        trace.add_request(torch.zeros(6, 2, 3, dtype=torch.int32), start=0, num_generated=3)


@pytest.mark.parametrize("count", [-1, True, False, 1.0, 2.5, "3", None, torch.tensor(2)])
def test_accumulator_fill_counts_are_non_negative_ints(count):
    acc = TokenAlignedAccumulator((2,), torch.int32, fill=-1)
    acc.append(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    with pytest.raises(ValueError, match=re.escape(f"append_fill: n={count!r}, expected an int >= 0")):
        acc.append_fill(count)
    assert len(acc) == 2 and acc.values().tolist() == [[1, 2], [3, 4]]  # nothing shrank, nothing grew
    acc.append_fill(0)
    acc.append(torch.tensor([[5, 6]], dtype=torch.int32))
    assert acc.values().tolist() == [[1, 2], [3, 4], [5, 6]]


def test_route_trace_keeps_minus_one_representable_and_widens_engine_routes():
    # -1 ("no route") does not exist in an unsigned dtype: uint8 would pad with 255.
    with pytest.raises(ValueError, match="dtype=torch.uint8.*signed integer dtype"):
        RouteTrace(num_layers=1, topk=2, dtype=torch.uint8)
    trace = RouteTrace(num_layers=1, topk=2, dtype=torch.int16)
    trace.add_tokens(3)
    engine_routes = torch.tensor([[[0, 7]], [[255, 3]], [[1, 2]]], dtype=torch.uint8)  # an engine's byte-wide ids
    trace.add_request(engine_routes, start=0, num_generated=1)
    out = trace.finish()
    assert out.dtype == torch.int16 and out[:3].tolist() == engine_routes.tolist() and out[3].tolist() == [[-1, -1]]
    small = RouteTrace(num_layers=1, topk=1, dtype=torch.int8)
    small.add_tokens(1)
    with pytest.raises(ValueError, match=r"expert id 300 does not fit the trace's torch.int8"):
        small.add_request(torch.tensor([[[300]]]), start=0, num_generated=0)
    with pytest.raises(ValueError, match=r"expert id -2"):
        small.add_request(torch.tensor([[[-2]]]), start=0, num_generated=0)
    # Routes already in the trace's dtype (the default int32) get the same check: -7 is no expert id.
    same = RouteTrace(num_layers=1, topk=2)
    same.add_tokens(2)
    with pytest.raises(ValueError, match=r"RouteTrace request 0: routes hold expert id -7; expert ids are >= 0, or -1"):
        same.add_request(torch.tensor([[[3, -7]], [[1, 0]]], dtype=torch.int32), start=0, num_generated=0)
    assert same.request_start == 0  # nothing was stored
    same.add_request(torch.tensor([[[3, -1]], [[1, 0]]], dtype=torch.int32), start=0, num_generated=0)
    assert same.finish().tolist() == [[[3, -1]], [[1, 0]]]


def test_support_rows_are_range_checked_before_the_int32_cast():
    trace = SupportTrace(top_k=2)
    with pytest.raises(ValueError, match=r"rows hold 4294967301, outside \[-1, 2\*\*31\)"):
        trace.add_turn([5], torch.tensor([[5, 2**32 + 5]], dtype=torch.int64))
    ragged = SupportTrace(top_k=None)
    with pytest.raises(ValueError, match=r"row 0 holds 1.5, expected int token ids"):
        ragged.add_turn([5], [[5, 1.5]])
    with pytest.raises(ValueError, match=r"row 0 holds True, expected int token ids"):
        ragged.add_turn([5], [[5, True]])


def test_flagged_engine_positions_stay_in_the_response_but_leave_the_loss():
    from nemo_replay.rollout.engines.base import EngineSupport
    from nemo_replay.support.packed import PackedTensor

    rows = torch.tensor([[5, 1], [-1, -1], [9, 4], [-1, -1]], dtype=torch.int32)
    engine = EngineSupport(PackedTensor(rows, [0, 4]), None, torch.tensor([False, True, False, True]))
    trace = SupportTrace(top_k=2, eos_id=EOS)
    trace.add_turn([5, 7, 9, EOS], engine, response_ids=[5, 7, 9])  # the flagged EOS is stripped
    trace.add_observation([EOS, 11])  # ... and comes back, still flagged
    assert trace.response_ids.tolist() == [5, 7, 9, EOS, 11]
    assert trace.loss_mask.tolist() == [True, False, True, False, False]
    assert trace.support().to_padded().values.tolist() == rows.tolist() + [[-1, -1]]
    with pytest.raises(ValueError, match="position 0 is flagged but its row is not empty"):
        SupportTrace(top_k=2).add_turn([5], rows[:1], flagged=torch.tensor([True]))
    with pytest.raises(ValueError, match=r"flagged must be a bool \(1,\) mask"):
        SupportTrace(top_k=2).add_turn([5], rows[:1], flagged=[0])
    ragged = SupportTrace(top_k=None)
    ragged.add_turn([5, 8], [[5, 1], []], flagged=torch.tensor([False, True]))
    assert ragged.loss_mask.tolist() == [True, False]
