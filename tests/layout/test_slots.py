"""The slot <-> canonical column mapping against a loop over the slots (docs/design.md §3)."""

import pytest
import torch

from nemo_replay.layout.canonical import real_runs
from nemo_replay.layout.channels import ScorerChannels
from nemo_replay.layout.slots import Slots


def _mask(rng, B, S):
    """One contiguous run per row at a random offset: left-, right- and both-side padding."""
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        L = int(torch.randint(1, S + 1, (), generator=rng))
        s = int(torch.randint(0, S - L + 1, (), generator=rng))
        mask[b, s : s + L] = True
    return mask


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("logit", [True, False], ids=["logit", "token"])
def test_take_and_index_match_the_loop(seed, logit):
    rng = torch.Generator().manual_seed(seed)
    B, S = 4, 9
    mask = _mask(rng, B, S)
    starts, ends = real_runs(mask)
    lengths = ends - starts
    n = 23
    trajectory = torch.randint(-1, B, (n,), generator=rng)
    position = torch.randint(-1, S + 1, (n,), generator=rng)  # some past the run, some padding
    width = S - 1 if logit else S
    x = torch.arange(B * width * 2, dtype=torch.float64).view(B, width, 2) + 0.5  # distinct values, an extra dim
    slots = Slots.of(trajectory, position, starts, lengths, seq_len=S, shape=(1, n), logit=logit)
    got = slots.take(x, -7.0)
    index = slots.canonical_index()
    assert got.shape == (1, n, 2)
    for i in range(n):
        b, q = int(trajectory[i]), int(position[i])
        holds = b >= 0 and 0 <= q < int(lengths[b]) - (1 if logit else 0)
        want = x[b, int(starts[b]) + q] if holds else torch.full((2,), -7.0, dtype=torch.float64)
        assert torch.equal(got[0, i], want), (i, b, q)
        assert int(index[i]) == (b * width + int(starts[b]) + q if holds else -1)


def test_channels_fill_where_no_logit_and_name_token_columns():
    # One left-padded trajectory _ p0 p1 r0 (s = 1, L = 3) in slots q = 0 1 2 and a padding slot.
    sampled = torch.tensor([[11, 12, 13]])
    ch = ScorerChannels(sampled_ids=sampled, row_ids=torch.tensor([[-1, -1, 5]]),
                        loss_mask=torch.tensor([[False, False, True]]), trajectory_ids=torch.tensor([[-1, 0, 0]]),
                        token_positions=torch.tensor([[1, 2, 3]]))
    slots = Slots.of(torch.tensor([0, 0, 0, -1]), torch.tensor([0, 1, 2, -1]), torch.tensor([1]), torch.tensor([3]),
                     seq_len=4, shape=(4,), logit=True)
    out = slots.channels(ch)
    assert out.sampled_ids.tolist() == [12, 13, 0, 0]
    assert out.row_ids.tolist() == [-1, 5, -1, -1]
    assert out.loss_mask.tolist() == [False, True, False, False]
    assert out.trajectory_ids.tolist() == [0, 0, -1, -1]
    assert out.token_positions.tolist() == [2, 3, -1, -1]  # the column of the token each logit predicts
    with pytest.raises(ValueError, match=r"canonical channel must be \(B, 3, \.\.\.\), got shape \(1, 4\)"):
        slots.take(torch.zeros(1, 4), 0)
