"""TRL's per-completion records keep their rows compact while they wait in TRL's buffer
(``SampleRows``, support/rows.py, the sampled ids dropped) and give the scorer the captured rows,
still compact (codec ``CompactRows``: the scorer decodes them on its device).
TRL-independent, like the module it tests."""

from __future__ import annotations

import pytest
import torch

from nemo_replay.integrations.trl.records import completion_channels, records_from_capture
from nemo_replay.support.codec import CompactRows
from nemo_replay.rollout.capture.hf import CapturedSupport
from nemo_replay.rollout.capture.sampler import sample
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.rows import SampleRows


def _capture(top_k, lengths, V=2000, seed=0):
    """Rows as the sampler records them (rank order, -1 padded to top_k), completion-major."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    r = sample(torch.randn(n, V, generator=g) * 3, temperature=1.0, top_k=top_k, top_p=0.9, generator=g)
    support = PackedTensor(r.support.to_padded().values, [0, *torch.tensor(lengths).cumsum(0).tolist()])
    return CapturedSupport(support, r.logprobs, torch.tensor(lengths)), r.ids, V


def test_compact_records_give_the_scorer_the_captured_rows():
    lengths = [60, 40, 80]  # each buffer has a 92-byte header (76 + its offsets): a few tokens gain little
    captured, ids, V = _capture(16, lengths)
    completions = [c.tolist() for c in ids.split(lengths)]
    compact = records_from_capture(completions, captured, vocab_size=V)
    assert all(isinstance(r.support, SampleRows) and r.support.width == 16 for r in compact)
    held = sum(r.support.nbytes for r in compact)
    assert held < captured.support.values.numel() * 4 / 3  # int32 rows of 16 against the buffers
    C = max(lengths)
    completion_ids = torch.zeros(3, C, dtype=torch.int64)
    mask = torch.zeros(3, C, dtype=torch.bool)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c)] = torch.tensor(c)
        mask[i, : len(c)] = True
    b = completion_channels(compact, completion_ids, mask)
    assert isinstance(b.support, CompactRows)  # handed to the scorer compact
    decoded = b.support.decode("cpu", check=True)
    assert decoded.values.shape[1] == 16  # the captured width kept
    # Reference: the captured row of token j of completion i, as a set, at the channel's row id.
    start = torch.tensor([0, *lengths]).cumsum(0)
    for i, n in enumerate(lengths):
        for j in range(n):
            want = sorted(t for t in captured.support.values[int(start[i]) + j].tolist() if t >= 0)
            got = decoded.values[int(b.channels.row_ids[i, j])]
            assert sorted(t for t in got.tolist() if t >= 0) == want
        assert bool((b.channels.row_ids[i, n:] == -1).all())
    assert torch.equal(b.channels.sampled_ids, completion_ids) and torch.equal(b.channels.loss_mask, mask)
    # The scorer decodes the compact rows at its entry: the same scores, bit for bit, as from the rows they decode to.
    from nemo_replay.scoring.entry import score_positions

    logits = torch.randn(3, C, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = score_positions(logits, b.channels, b.support)
    want = score_positions(logits, b.channels, decoded)
    assert got.valid_mask.any() and torch.equal(got.logprobs, want.logprobs)


def test_records_need_the_vocabulary():
    captured, ids, V = _capture(8, [5])
    with pytest.raises(ValueError, match="vocab_size must be the model's vocabulary size"):
        records_from_capture([ids.tolist()], captured, vocab_size=None)
