"""The one carrier of recorded rows (support/rows.py): encoded once, windowed and joined without a
decode, placed by batch_rows, decoded by the scorer. Every check is against the rows as they were
recorded, on ragged rows with distinct ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_replay.support.codec import CodecError, CompactRows
from nemo_replay.support.ragged import RaggedSupport
from nemo_replay.support.rows import SampleRows, batch_rows


def _rows(g, n, V, empty=()):
    """n ragged rows of distinct ids below V, each holding its sampled token; rows in ``empty`` unrecorded."""
    rows, tokens = [], []
    for j in range(n):
        k = int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randperm(V, generator=g)[:k]
        tokens.append(int(ids[int(torch.randint(0, k, (1,), generator=g))]))
        rows.append([] if j in empty else ids.tolist())
    return RaggedSupport.from_rows([rows]), torch.tensor(tokens), rows


def _decoded_at(support: CompactRows, row_ids: torch.Tensor, i: int, t: int):
    rows = support.decode("cpu", check=True).values
    r = int(row_ids[i, t])
    return None if r < 0 else sorted(int(x) for x in rows[r] if x >= 0)


@pytest.mark.parametrize("drop", [False, True])
def test_encoded_rows_come_back_at_their_columns(drop):
    g = torch.Generator().manual_seed(0)
    V = 97
    empty = () if drop else (2, 5)  # rows that drop their sampled ids are all recorded (next test)
    rows, tokens, plain = _rows(g, 7, V, empty=empty)
    s = SampleRows.encode(rows, tokens, start=3, vocab_size=V if drop else None)
    assert s.length == 10 and s.num_rows == 7 - len(empty)
    assert s.recorded().tolist() == [False] * 3 + [j not in empty for j in range(7)]
    ids = torch.full((1, 12), -1)
    ids[0, 3:10] = tokens
    support, row_ids = batch_rows([s], ids, torch.tensor([10]), name="rows")
    for t in range(12):
        want = None if not 3 <= t < 10 or t - 3 in empty else sorted(plain[t - 3])
        assert _decoded_at(support, row_ids, 0, t) == want


def test_windows_and_joins_keep_each_row_at_its_token():
    """A generation sliced into two messages and joined with a prompt and a tool turn: the rows land at
    the flattened columns, the shared buffer held once, nothing decoded on the way."""
    g = torch.Generator().manual_seed(1)
    V = 64
    rows, tokens, plain = _rows(g, 6, V, empty=(4,))
    generated = SampleRows.encode(rows, tokens, start=2)  # the worker's columns: a 2-token prompt first
    first, second = generated[2:5], generated[5:8]
    joined = SampleRows.cat([SampleRows.none(4), first, SampleRows.none(2), second])
    assert len(joined.buffers) == 1 and joined.buffers[0] is generated.buffers[0]
    assert joined.length == 4 + 3 + 2 + 3
    columns = {4 + j: j for j in range(3)} | {9 + j: 3 + j for j in range(3)}  # flattened column -> generated token
    assert set(joined.columns().tolist()) == {c for c, j in columns.items() if j != 4}
    ids = torch.zeros(1, 12, dtype=torch.int64)
    for c, j in columns.items():
        ids[0, c] = tokens[j]
    support, row_ids = batch_rows([joined], ids, torch.tensor([12]), name="rows")
    for t in range(12):
        j = columns.get(t)
        want = None if j is None or j == 4 else sorted(plain[j])
        assert _decoded_at(support, row_ids, 0, t) == want


def test_a_batch_places_each_samples_rows_after_the_ones_before():
    g = torch.Generator().manual_seed(2)
    V, samples, ids, plain = 50, [], torch.full((3, 9), -1), []
    for i, n in enumerate([4, 0, 9]):
        rows, tokens, p = _rows(g, n, V)
        samples.append(SampleRows.encode(rows, tokens, vocab_size=V, width=8) if n else SampleRows.none(0))
        ids[i, :n] = tokens
        plain.append(p)
    support, row_ids = batch_rows(samples, ids, torch.tensor([4, 0, 9]), name="rows")
    assert support.decode("cpu").values.shape == (13, 8)  # fixed-width rows come back as wide
    assert row_ids[0, :4].tolist() == [0, 1, 2, 3] and bool((row_ids[1] == -1).all())
    assert row_ids[2].tolist() == list(range(4, 13))
    for i, n in enumerate([4, 0, 9]):
        for t in range(n):
            assert _decoded_at(support, row_ids, i, t) == sorted(plain[i][t])


def test_rows_that_drifted_from_their_tokens_fail_where_they_are_scored():
    g = torch.Generator().manual_seed(3)
    rows, tokens, _ = _rows(g, 5, 40)
    s = SampleRows.encode(rows, tokens)  # sampled ids kept: the rows travel apart from the tokens
    ids = tokens.roll(1)[None]
    support, row_ids = batch_rows([s], ids, torch.tensor([5]), name="rows")
    from nemo_replay.layout.channels import ScorerChannels
    from nemo_replay.scoring.entry import score_positions

    channels = ScorerChannels(ids, row_ids, torch.ones(1, 5, dtype=torch.bool), torch.zeros(1, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="not a member of its support row"):
        score_positions(torch.randn(1, 5, 40, dtype=torch.float64), channels, support)


def _one():
    rows, tokens, _ = _rows(torch.Generator().manual_seed(4), 3, 20)
    return SampleRows.encode(rows, tokens), tokens


@pytest.mark.parametrize(
    "case, match",
    [
        ("list", r"data\['k'\] must be a list of 1 SampleRows, one a data row"),
        ("type", r"data\['k'\]\[0\] \(data row 0\) is a Tensor, expected SampleRows"),
        ("runs", r"runs of dtype float64.*expected \(n, 3\) integer"),
        ("count", r"count >= 1"),
        ("limit", r"must increase and lie below the sample's 2 token columns"),
        ("order", r"must increase"),
        ("past", r"runs name rows up to 3 of buffers holding 3"),
        ("crc", r"data\['k'\]\[0\] \(data row 0\).*CRC"),
        ("dropped", r"a row coded without its sampled token belongs to no column"),
    ],
)
def test_bad_entries_are_named(case, match):
    s, tokens = _one()
    ids, limits, entries = tokens[None], torch.tensor([3]), [s]
    runs = np.asarray(s.runs)
    if case == "list":
        entries = [s, s]
    elif case == "type":
        entries = [torch.zeros(3)]
    elif case == "runs":
        entries = [SampleRows(s.buffers, runs.astype(np.float64), 3)]
    elif case == "count":
        entries = [SampleRows(s.buffers, np.array([[0, 0, 0]], np.int32), 3)]
    elif case == "limit":
        limits = torch.tensor([2])
    elif case == "order":
        entries = [SampleRows(s.buffers, np.array([[1, 0, 1], [0, 1, 1]], np.int32), 3)]
    elif case == "past":
        entries = [SampleRows(s.buffers, np.array([[0, 1, 3]], np.int32), 3)]
    elif case == "crc":
        buf = s.buffers[0].copy()
        buf[-1] ^= 1
        entries = [SampleRows((buf,), runs, 3)]
    elif case == "dropped":
        d = SampleRows.encode(RaggedSupport.from_rows([[[1, 2], [3]]]), torch.tensor([2, 3]), vocab_size=20)
        entries = [d[0:1]]  # its second row left without a column
    with pytest.raises((ValueError, CodecError), match=match):
        batch_rows(entries, ids, limits, name="data['k']", unit="data row")


def test_slices_are_column_ranges_from_zero():
    s, _ = _one()
    with pytest.raises(ValueError, match="sliced by a column range"):
        s[0:3:2]
    with pytest.raises(ValueError, match="no negative index"):
        s[-2:]
    assert s[5:9].length == 4 and s[5:9].num_rows == 0  # past the rows: columns without one


def test_a_row_without_its_token_is_refused_where_it_is_encoded():
    with pytest.raises(ValueError, match="request 3"):
        SampleRows.encode(RaggedSupport.from_rows([[[1, 2]]]), torch.tensor([5]), where="request 3")


def test_two_generations_joined_keep_their_own_rows():
    """A multi-turn sample: each turn's generation its own buffer; the second's rows follow the first's."""
    g = torch.Generator().manual_seed(5)
    a_rows, a_tok, a_plain = _rows(g, 3, 30)
    b_rows, b_tok, b_plain = _rows(g, 4, 30)
    joined = SampleRows.cat([SampleRows.encode(a_rows, a_tok), SampleRows.none(2), SampleRows.encode(b_rows, b_tok)])
    assert len(joined.buffers) == 2 and joined.length == 9
    ids = torch.cat([a_tok, torch.zeros(2, dtype=torch.int64), b_tok])[None]
    support, row_ids = batch_rows([joined], ids, torch.tensor([9]), name="rows")
    want = [sorted(r) for r in a_plain] + [None, None] + [sorted(r) for r in b_plain]
    assert [_decoded_at(support, row_ids, 0, t) for t in range(9)] == want


def test_a_row_left_unrecorded_names_its_own_index():
    """Errors count every row, recorded or not; rows without their sampled ids must all be recorded."""
    rows = RaggedSupport.from_rows([[[], [21, 1], [5]]])
    with pytest.raises(ValueError, match=r"row 2: sampled token 6 is not a member of its support row \[5\]"):
        SampleRows.encode(rows, torch.tensor([7, 21, 6]))
    with pytest.raises(ValueError, match="row 0 is empty .not recorded.; rows coded without their sampled ids"):
        SampleRows.encode(rows, torch.tensor([7, 21, 5]), vocab_size=30)


def test_runs_are_checked_before_a_column_is_made():
    """A count of 2**31 - 1 over a 3-row buffer is refused from the runs alone (no 16 GiB of columns)."""
    s, tokens = _one()
    huge = SampleRows(s.buffers, np.array([[0, 0, 2**31 - 1]], np.int64), 3)
    with pytest.raises(ValueError, match="must increase and lie below"):
        batch_rows([huge], tokens[None], torch.tensor([3]), name="rows")
    wide = SampleRows(s.buffers, np.array([[0, 0, 2**31 - 1]], np.int64), 2**31)
    with pytest.raises(ValueError, match="must increase and lie below"):
        batch_rows([wide], torch.zeros(1, 2**20, dtype=torch.int64), torch.tensor([2**31]), name="rows")


@pytest.mark.parametrize("drop", [False, True])
def test_the_byte_form_carries_every_buffer_and_run_and_names_what_breaks_it(drop):
    """SampleRows.to_bytes (one uint8 buffer a sample, for frameworks that carry one): a sample of two
    generations placed at their columns comes back with the same buffers, runs, length and width, and
    scores the same rows; every truncation, a flipped bit anywhere and another magic are named."""
    g = torch.Generator().manual_seed(7)
    V = 80
    (r0, t0, p0), (r1, t1, p1) = _rows(g, 5, V), _rows(g, 4, V)
    a = SampleRows.encode(r0, t0, vocab_size=V if drop else None)
    b = SampleRows.encode(r1, t1, vocab_size=V if drop else None)
    # columns 0..3 from a's rows 0..3, a gap (a's row 4 cut: rows that keep their sampled ids may be; or
    # placed there), then b's four rows
    picked = [0, 1, 2, 3, 4, 5, 6, 7, 8] if drop else [0, 1, 2, 3, 5, 6, 7, 8]
    s = SampleRows.placed(a.buffers + b.buffers, [0, 1, 2, 3] + ([4] if drop else []) + [5, 6, 7, 8], picked, 10, width=8)
    raw = s.to_bytes()
    back = SampleRows.from_bytes(raw.tobytes())
    assert back.length == 10 and back.width == 8 and np.array_equal(back.runs, s.runs)
    assert [x.tobytes() for x in back.buffers] == [x.tobytes() for x in s.buffers]
    assert raw.nbytes == 32 + 8 * 2 + s.runs.nbytes + sum(x.nbytes for x in s.buffers)
    ids = torch.full((1, 10), -1)
    ids[0, :5], ids[0, 5:9] = t0, t1
    got, row_ids = batch_rows([back], ids, torch.tensor([10]), name="rows")
    plain = p0[:4] + [p0[4] if drop else None] + p1
    for t in range(10):
        want = None if t == 9 or plain[t] is None else sorted(plain[t])
        assert _decoded_at(got, row_ids, 0, t) == want
    for cut in range(raw.size):  # every truncation
        with pytest.raises(ValueError, match=r"^w: .*(fewer than|truncated|corrupted)"):
            SampleRows.from_bytes(raw[:cut], where="w")
    for at in range(0, raw.size, 3):  # a flipped bit anywhere (header, sizes, runs, buffers)
        bad = raw.copy()
        bad[at] ^= 1 << (at % 8)
        with pytest.raises(ValueError, match=r"^w: "):
            SampleRows.from_bytes(bad, where="w")
    with pytest.raises(ValueError, match=r"^w: magic b'NRSC' version 1, expected b'NRSR'"):
        SampleRows.from_bytes(a.buffers[0], where="w")
    with pytest.raises(ValueError, match=r"^w: compact support: expected a uint8 buffer, got list"):
        SampleRows.from_bytes([1, 2], where="w")
    assert SampleRows.from_bytes(SampleRows.none(3).to_bytes()).length == 3


def test_placed_rows_are_checked_against_their_buffers_and_columns():
    g = torch.Generator().manual_seed(8)
    rows, tokens, _ = _rows(g, 3, 40)
    bufs = SampleRows.encode(rows, tokens).buffers
    for columns, picked, match in (([0, 0], [0, 1], r"row columns must increase within \[0, 5\)"),
                                   ([1, 5], [0, 1], r"row columns must increase within \[0, 5\)"),
                                   ([0, 1], [0, 3], r"placed rows \[\d, \d\] must be distinct rows of buffers holding 3"),
                                   ([0, 1], [1, 1], r"placed rows \[\d, \d\] must be distinct rows of buffers holding 3"),
                                   ([0, 1, 2], [0, 1], r"3 columns for 2 rows")):
        with pytest.raises(ValueError, match=rf"^p: {match}"):
            SampleRows.placed(bufs, columns, picked, 5, where="p")
    assert SampleRows.placed(bufs, [1, 4], [2, 0], 5, where="p").runs.tolist() == [[1, 2, 1], [4, 0, 1]]
