"""TRL's per-completion records keep their rows compact while they wait in TRL's buffer
(``KeptRows``, support/codec/) and give the scorer the same channels as plain rows, the rows
still compact (codec ``CompactRows``: the scorer decodes them on its device).
TRL-independent, like the module it tests."""

from __future__ import annotations

import torch

from nemo_replay.integrations.trl.records import KeptRows, completion_channels, records_from_capture
from nemo_replay.support.codec import CompactRows
from nemo_replay.rollout.capture.hf import CapturedSupport
from nemo_replay.rollout.capture.sampler import sample
from nemo_replay.support.packed import PackedTensor


def _capture(top_k, lengths, V=2000, seed=0):
    """Rows as the sampler records them (rank order, -1 padded to top_k), completion-major."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    r = sample(torch.randn(n, V, generator=g) * 3, temperature=1.0, top_k=top_k, top_p=0.9, generator=g)
    support = PackedTensor(r.support.to_padded().values, [0, *torch.tensor(lengths).cumsum(0).tolist()])
    return CapturedSupport(support, r.logprobs, torch.tensor(lengths)), r.ids, V


def test_compact_records_give_the_scorer_the_rows_plain_records_give():
    lengths = [60, 40, 80]  # each buffer has a 92-byte header (76 + its offsets): a few tokens gain little
    captured, ids, V = _capture(16, lengths)
    completions = [c.tolist() for c in ids.split(lengths)]
    plain = records_from_capture(completions, captured)
    compact = records_from_capture(completions, captured, vocab_size=V)
    assert all(isinstance(r.support, KeptRows) for r in compact)
    assert all(isinstance(r.support, PackedTensor) for r in plain)
    held = sum(r.support.data.numel() for r in compact)
    assert held < sum(r.support.to_padded().values.numel() * 4 for r in plain) / 3  # int32 rows of 16 against the buffer
    C = max(lengths)
    completion_ids = torch.zeros(3, C, dtype=torch.int64)
    mask = torch.zeros(3, C, dtype=torch.bool)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c)] = torch.tensor(c)
        mask[i, : len(c)] = True
    a, b = completion_channels(plain, completion_ids, mask), completion_channels(compact, completion_ids, mask)
    assert isinstance(b.support, CompactRows)  # handed to the scorer compact
    decoded = b.support.decode("cpu")
    assert decoded.values.shape == a.support.to_padded().values.shape  # the captured width kept
    as_sets = lambda s: [sorted(t for t in row.tolist() if t >= 0) for row in s.values]  # noqa: E731
    assert as_sets(a.support) == as_sets(decoded)  # the same sets (compact rows come back ids ascending)
    for x, y in zip([*a.channels[:4], a.rollout_logprobs], [*b.channels[:4], b.rollout_logprobs]):
        assert torch.equal(x, y)
    # The scorer decodes the compact rows at its entry: the same scores, bit for bit, as from the rows they decode to.
    from nemo_replay.scoring.entry import score_positions

    logits = torch.randn(3, C, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = score_positions(logits, b.channels, b.support)
    want = score_positions(logits, b.channels, decoded)
    assert got.valid_mask.any() and torch.equal(got.logprobs, want.logprobs)
