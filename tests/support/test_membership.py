"""The one membership test (nemo_replay/support/membership.py) against a Python loop."""

from __future__ import annotations

import torch

from nemo_replay.support.membership import csr_membership, row_membership


def test_fixed_width_rows_against_a_loop():
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 50, (200, 6), generator=g, dtype=torch.int32)
    rows[torch.rand(200, 6, generator=g) < 0.3] = -1
    rows = torch.sort(rows, dim=1, descending=True).values  # trailing -1 padding
    sampled = torch.randint(-1, 50, (200,), generator=g)
    sampled[::7] = 2**32 + 5  # wraps onto 5 in int32: never a member
    member, col = row_membership(rows, sampled)
    for i in range(200):
        want = int(sampled[i]) >= 0 and int(sampled[i]) in rows[i].tolist()
        assert bool(member[i]) == want, i
        if want:
            assert int(rows[i, col[i]]) == int(sampled[i])
    assert not row_membership(torch.full((3, 4), -1, dtype=torch.int32), torch.full((3,), -1))[0].any()


def test_csr_members_against_a_loop():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 5, (100,), generator=g)
    members = torch.randint(0, 30, (int(lengths.sum()),), generator=g, dtype=torch.int32)
    row_of = torch.repeat_interleave(torch.arange(100), lengths)
    sampled = torch.randint(-1, 30, (100,), generator=g)
    found, hit = csr_membership(members, row_of, sampled)
    starts = torch.cumsum(lengths, 0) - lengths
    for r in range(100):
        row = members[starts[r] : starts[r] + lengths[r]].tolist()
        assert bool(found[r]) == (int(sampled[r]) in row), r
    assert torch.equal(hit, members.long() == sampled[row_of])
