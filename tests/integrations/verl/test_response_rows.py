"""verl's compact support field (integrations/verl/response_rows.py): round trips against the rows, the object
column verl carries, and every malformed buffer named (no verl needed: numpy and torch only)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from nemo_replay.integrations.verl.response_rows import (
    buffers_of,
    compact_rows,
    encode_response_rows,
    object_column,
    turn_rows,
)
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.rows import SampleRows
from tests.integrations.verl.engine_batches import buffer_rows, dense_from_compact


def _response(seed: int, n: int, width: int = 6, vocab: int = 5000):
    """(rows (n, width) int32 -1 padded with distinct ids, ascending, holding their token; tokens (n,)); every
    fourth row empty (a flagged position, or a tool token)."""
    g = torch.Generator().manual_seed(seed)
    rows = np.full((n, width), -1, np.int32)
    tokens = []
    for j in range(n):
        ids = torch.randperm(vocab, generator=g)[: int(torch.randint(1, width + 1, (1,), generator=g))]
        tokens.append(int(ids[0]) if j % 4 != 3 else int(torch.randint(0, vocab, (1,), generator=g)))
        if j % 4 != 3:
            rows[j, : ids.numel()] = np.sort(ids.numpy())
    rows[0] = -1
    rows[0, :2] = [0, vocab - 1]  # ids 0 and V - 1
    tokens[0] = 0
    return rows, tokens


def _whole(rows, tokens) -> np.ndarray:
    """One response's rows as a batch field carries them: the server's buffer, row j at position j."""
    return SampleRows.whole(encode_response_rows(rows, tokens), len(tokens)).to_bytes()


def test_round_trip_equals_the_rows_and_costs_less_than_int32():
    rows, tokens = _response(0, 200)
    buf = encode_response_rows(rows, tokens)
    assert buf.dtype == np.uint8 and buf.ndim == 1 and buf.nbytes < rows.nbytes / 3
    assert np.array_equal(buffer_rows(buf, tokens, 6).numpy(), rows)
    same, lengths = turn_rows(buf.tobytes(), tokens, 8, where="t")  # the agent loop's check: no id decoded
    assert same.tobytes() == buf.tobytes() and lengths.tolist() == (rows >= 0).sum(1).tolist()
    from nemo_replay.support.codec import decode_support

    csr = decode_support(buf, sampled_ids=torch.tensor(tokens)).resegment([0, 200])
    assert encode_response_rows(csr, tokens).tobytes() == buf.tobytes()  # CSR rows encode as the fixed ones


def test_the_column_keeps_one_buffer_a_sample_even_at_equal_lengths():
    rows, tokens = _response(1, 8)
    bufs = [encode_response_rows(rows, tokens)] * 3
    assert np.array(bufs, dtype=object).shape == (3, bufs[0].size)  # numpy's trap object_column avoids
    column = object_column(bufs)
    assert column.shape == (3,) and all(b is bufs[0] for b in column)
    again = pickle.loads(pickle.dumps(column))  # what Ray does to it
    assert buffers_of(again)[2].tobytes() == bufs[0].tobytes() and buffers_of(list(again)) == list(again)
    # a tensor field (the retired dense [B, R, K] form) is refused with the fix
    with pytest.raises(ValueError, match=r"batch\[.generation_support.\] is a \(3, 8, 6\) tensor; replay's agent loops write one "
                                         r"uint8 buffer a sample \(SampleRows.to_bytes\).*configs/verl/"):
        buffers_of(torch.zeros(3, 8, 6, dtype=torch.int32))


def test_compact_rows_place_each_sample_and_skip_a_maskless_padding_copy():
    (r0, t0), (r1, t1) = _response(2, 5), _response(3, 3)
    tokens = torch.full((3, 5), -1, dtype=torch.int64)
    tokens[0], tokens[1, :3], tokens[2, :1] = torch.tensor(t0), torch.tensor(t1), t0[0]
    mask = tokens >= 0
    mask[2] = False  # verl's V1 padding sample: a copy of sample 0 cut to one token, out of the loss
    rows, row_ids = compact_rows([_whole(r0, t0), _whole(r1, t1), _whole(r0, t0)], tokens, torch.tensor([5, 3, 1]),
                                 mask, key="generation_support")
    assert rows.num_rows == 8 and rows.cu_seqlens.tolist() == [0, 5, 8, 8]  # one trajectory a sample
    assert row_ids.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, -1, -1], [-1] * 5]
    out = dense_from_compact(rows, row_ids)
    assert out.shape == (3, 5, 6) and out.dtype == torch.int32
    assert torch.equal(out[0], torch.from_numpy(r0)) and torch.equal(out[1, :3], torch.from_numpy(r1))
    assert (out[1, 3:] == -1).all() and (out[2] == -1).all()


def test_an_agent_loop_s_placed_turns_read_as_their_positions():
    """The agent loops' form (SampleRows.to_bytes over each turn's buffer as the server wrote it, rows at the
    positions verl kept) reads as the rows it placed, beside a single-turn sample; a bare compact buffer (the
    server's, not placed) is refused with the fix."""
    (r0, t0), (r1, t1), (r2, t2) = _response(5, 4), _response(6, 3), _response(7, 6)
    turns = [encode_response_rows(r0, t0), encode_response_rows(r1, t1)]
    # response: turn 0's tokens 0..2 (token 3 cut by a merge), a tool token, turn 1's three tokens; the empty
    # rows (every fourth, flagged: out of the loss) get no position
    response = [t0[0], t0[1], t0[2], 99, t1[0], t1[1], t1[2]]
    placed = SampleRows.placed(turns, [0, 1, 2, 4, 5, 6], [0, 1, 2, 4, 5, 6], 7, where="t")
    tokens = torch.full((2, 7), -1, dtype=torch.int64)
    tokens[0], tokens[1, :6] = torch.tensor(response), torch.tensor(t2)
    mask = tokens >= 0
    mask[0, 3] = False
    column = object_column([placed.to_bytes(), _whole(r2, t2)])
    rows, row_ids = compact_rows(buffers_of(pickle.loads(pickle.dumps(column))), tokens, torch.tensor([7, 6]), mask,
                                 key="generation_support")
    assert row_ids.tolist() == [[0, 1, 2, -1, 4, 5, 6], [7, 8, 9, 10, 11, 12, -1]]  # turn 0's row 3 held, unplaced
    out = dense_from_compact(rows, row_ids)
    want = np.concatenate([r0[:3], np.full((1, 6), -1, np.int32), r1])
    assert np.array_equal(out[0].numpy(), want) and np.array_equal(out[1, :6].numpy(), r2)
    with pytest.raises(ValueError, match=r"holds 7 rows for sample 0, whose response has 6 tokens"):
        compact_rows([placed.to_bytes()], tokens[:1, :6], torch.tensor([6]), mask[:1, :6], key="generation_support")
    flipped = placed.to_bytes()
    flipped[-1] ^= 4  # a bit inside the last turn's buffer
    with pytest.raises(ValueError, match=r"generation_support'\]\[0\] \(sample 0\): CRC-32 mismatch"):
        compact_rows([flipped], tokens[:1], torch.tensor([7]), mask[:1], key="generation_support")
    with pytest.raises(ValueError, match=r"\[1\] \(sample 1\): magic b'NRSC' version 1, expected b'NRSR'.*"
                                         r"SampleRows.whole\(buffer, length\).to_bytes\(\)"):
        compact_rows([placed.to_bytes(), encode_response_rows(r2, t2)], tokens, torch.tensor([7, 6]), mask,
                     key="generation_support")
    with pytest.raises(ValueError, match=r"t: row columns must increase within \[0, 7\)"):
        SampleRows.placed(turns, [0, 2, 1], [0, 1, 2], 7, where="t")


def test_malformed_buffers_are_named():
    rows, tokens = _response(4, 6)
    buf = encode_response_rows(rows, tokens)
    flipped = buf.copy()
    flipped[-1] ^= 1
    with pytest.raises(ValueError, match=r"where: 6 support rows for 5 generated tokens"):
        turn_rows(buf, tokens[:5], 6, where="where")
    with pytest.raises(ValueError, match=r"where: compact support: the buffer's CRC-32 does not match"):
        turn_rows(flipped, tokens, 6, where="where")
    with pytest.raises(ValueError, match=r"where: compact support: .*truncated|where: .*buffer"):
        turn_rows(buf[:-3], tokens, 6, where="where")
    with pytest.raises(ValueError, match=r"where: a support row holds \d ids, wider than the row width 2"):
        turn_rows(buf, tokens, 2, where="where")
    with pytest.raises(ValueError, match=r"where is int32 \(6, 6\); expected a 1-D uint8 buffer"):
        turn_rows(rows, tokens, 6, where="where")
    from nemo_replay.support.codec import encode_support
    from nemo_replay.support.ragged import RaggedSupport

    full = RaggedSupport.from_rows([[[int(v) for v in r if v >= 0] for r in rows[:3]]])
    with pytest.raises(ValueError, match=r"where: rows coded without their sampled ids; the server keeps them"):
        turn_rows(encode_support(full, vocab_size=5000, sampled_ids=torch.tensor(tokens[:3])), tokens[:3], 6, where="where")
    tokens_t = torch.tensor([tokens])
    with pytest.raises(ValueError, match=r"\[0\] is object \(2, 3\); expected a 1-D uint8 buffer .*object_column"):
        compact_rows([np.empty((2, 3), object)], tokens_t, torch.tensor([6]), tokens_t >= 0, key="generation_support")
    with pytest.raises(ValueError, match=r"holds 6 rows for sample 0, whose response has 4 tokens"):
        compact_rows([_whole(rows, tokens)], tokens_t, torch.tensor([4]), tokens_t >= 0, key="generation_support")
    # a turn's buffer corrupted before it was placed: its own CRC names it
    with pytest.raises(ValueError, match=r"generation_support'\]\[0\] \(sample 0\): compact support: the buffer's CRC-32"):
        compact_rows([SampleRows.whole(flipped, 6).to_bytes()], tokens_t, torch.tensor([6]), tokens_t >= 0,
                     key="generation_support")
    wrong = list(tokens)
    wrong[1] = next(t for t in range(5000) if t not in rows[1])
    # Rows that drifted from their tokens fail by name (the engine's whole-batch check), never rebuilt around the
    # wrong token.
    from nemo_replay.integrations.verl.engine import check_replay_batch

    batch = {"responses": torch.tensor([wrong]), "response_mask": torch.ones(1, 6, dtype=torch.int64),
             "prompts": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 8, dtype=torch.int64),
             "generation_support": [_whole(rows, tokens)]}
    with pytest.raises(SupportAlignmentError, match=r"sample 0, response position 1: token \d+ is not a member"):
        check_replay_batch(batch, vocab_size=5000)
    # Decoded rows skip the row invariants' sort (they hold by construction) but not a model vocabulary below their ids.
    good = {**batch, "responses": torch.tensor([tokens]),
            "response_mask": torch.from_numpy((rows >= 0).any(1)).to(torch.int64)[None]}  # unrecorded rows out
    check_replay_batch(good, vocab_size=5000)
    with pytest.raises(ValueError, match=r"generation_support.*4999.*response position"):
        check_replay_batch(good, vocab_size=100)
    with pytest.raises(SupportAlignmentError, match=r"a response's support rows"):
        encode_response_rows(rows, wrong)


def test_rows_and_tokens_that_would_shrink_or_be_cut_are_refused_by_name():
    """Negative entries anywhere in a dense row once read as padding: ``[5, -25536, -1]`` (token 40000
    wrapped by int16) recorded {5}, ``[5, -1, 1]`` recorded {1, 5}; float rows and tokens were cut to
    integers and int64 ids past int32 wrapped onto others. docs/design.md §2's rule instead: -1 only as
    a trailing pad, integer ids, each a named error; every row a good one stays is still encoded."""
    where = r"replay: a response's support rows: row 1"
    good = [[7, 2, -1], [3, 5, 9]]
    bad_rows = [
        (np.array([good[0], [5, -25536, -1]], np.int16), [7, 5], rf"{where} holds an id below -1 .*\[5, -25536, -1\]"),
        ([good[0], [5, -25536, -1]], [7, 5], rf"{where} holds an id below -1"),
        ([good[0], [5, -1, 1]], [7, 5], rf"{where} has a member after -1 padding .*\[5, -1, 1\]"),
        ([good[0], [-1, 5, -1]], [7, 5], rf"{where} has a member after -1 padding"),
        ([good[0], [5, -7, 3]], [7, 5], rf"{where} holds an id below -1"),
        ([good[0], [5, 2**32 + 3, -1]], [7, 5], rf"{where} holds an id >= vocab_size=2147483647"),
        (np.array([good[0], [5.0, 3.7, -1]]), [7, 5], r"support rows must be an integer tensor .* got torch.float64"),
        (np.array(good, np.float32), [7, 3], r"support rows must be an integer tensor .* got torch.float32"),
    ]
    for rows, tokens, match in bad_rows:
        with pytest.raises(ValueError, match=match):
            encode_response_rows(rows, tokens)
    for tokens in ([7.0, 3.0], [7, 3.7], np.array([7.0, 3.0])):
        with pytest.raises(ValueError, match=r"a response's support rows: sampled_ids of dtype torch.float\d+; expected "
                                             r"integer token ids"):
            encode_response_rows(good, tokens)
    got = buffer_rows(encode_response_rows(np.array(good, np.int16), [7, 3]), [7, 3], 3)
    members = lambda rows: [sorted(v for v in r if v >= 0) for r in rows]  # noqa: E731
    assert members(got.tolist()) == members(good)
