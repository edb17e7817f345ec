"""Process groups (``nemo_replay.distributed.groups``): a group's size and rank, and ``agree`` on
real gloo ranks: whatever one rank raises, every rank raises it, at once.

Only ``ValueError`` used to travel: a ``KeyError`` from a batch check, a ``RuntimeError``, an
``IndexError`` or torch DCP's ``CheckpointException`` (a ``BaseException``) on one rank left the
others in the next collective until the group's timeout (10-30 minutes under NCCL).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

import torch

from nemo_replay.distributed.groups import agree, check_together, flag_device, group_size_rank
from nemo_replay.scoring.entry import ScorerChannels, score_positions
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.packed import PackedTensor
from tests.spawn import run_workers


class _TwoArgs(Exception):
    def __init__(self, what, code):
        super().__init__(f"{what} ({code})")


def _raise(exc):
    raise exc


FAILURES = {
    "key": lambda: {}["response_mask"],
    "runtime": lambda: _raise(RuntimeError("step must be nonzero")),
    "index": lambda: [][3],
    "alignment": lambda: _raise(SupportAlignmentError("trajectory 2, position 5: sampled id 9 is not in its row")),
    "checkpoint": lambda: _raise(CheckpointException("load", {})),  # a BaseException, two arguments
    "two_args": lambda: _raise(_TwoArgs("shard", 3)),
}


def _each_failure(rank: int, world: int) -> dict:
    # A group of its own with a short timeout: a rank left waiting fails in 10 s instead of hanging the suite.
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=10))
    out = {"size_rank": group_size_rank(group)}
    for name, fail in FAILURES.items():
        start = time.monotonic()
        try:
            agree(fail if rank == 1 else (lambda: "fine"), group, device="cpu", name="worker")
            out[name] = ("returned", "", 0.0, None)
        except BaseException as exc:
            cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
            out[name] = (type(exc).__name__, str(exc), time.monotonic() - start, cause)
    out["ok"] = agree(lambda: rank * 10, group, device="cpu", name="worker")
    # The scorer's entry point over the same group: rank 1's slice holds a token outside its row.
    logits = torch.randn(2, 5, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    sampled = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10 if rank == 1 else 0]])
    rows = torch.arange(10).view(2, 5)
    support = PackedTensor(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 0]], dtype=torch.int32).T, [0, 5, 10])
    channels = ScorerChannels(sampled, rows, torch.ones(2, 5, dtype=torch.bool), torch.arange(2)[:, None].expand(2, 5))
    out["flag_device"] = str(flag_device(group, torch.device("meta")))
    try:
        score_positions(logits, channels, support, group=group, group_name="CP", context="test slice")
        out["score"] = ("returned", "")
    except BaseException as exc:
        out["score"] = (type(exc).__name__, str(exc))
    good = channels._replace(sampled_ids=torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]))
    out["scored"] = score_positions(logits, good, support, group=group, group_name="CP").valid_mask.all().item()
    return out


def test_every_exception_one_rank_raises_is_raised_on_every_rank_at_once():
    r0, r1 = run_workers(_each_failure, 2)
    assert (r0["size_rank"], r1["size_rank"]) == ((2, 0), (2, 1))
    expected = {
        "key": ("KeyError", "worker rank 1 of 2: 'response_mask'"),
        "runtime": ("RuntimeError", "worker rank 1 of 2: step must be nonzero"),
        "index": ("IndexError", "worker rank 1 of 2: list index out of range"),
        "alignment": ("SupportAlignmentError", "worker rank 1 of 2: trajectory 2, position 5: sampled id 9 is not in its row"),
    }
    for name, (kind, message) in expected.items():
        for got in (r0[name], r1[name]):
            assert got[0] == kind and message in got[1], (name, got)
            assert got[2] < 5, (name, got)  # no rank waited for the group's timeout
    # Types that cannot be built from one message arrive as RankError naming the type.
    for name, qualname in (("checkpoint", "torch.distributed.checkpoint.api.CheckpointException"),
                           ("two_args", "tests.distributed.test_groups._TwoArgs")):
        for got in (r0[name], r1[name]):
            assert got[0] == "RankError" and got[1].startswith("worker rank 1 of 2: ") and qualname in got[1], (name, got)
    # The failing rank chains its own error; the other has none to chain.
    assert r1["key"][3] == "KeyError" and r0["key"][3] is None
    assert (r0["ok"], r1["ok"]) == (0, 10)
    # score_positions: both ranks raise rank 1's alignment error, with its context; the flag sits on the CPU (gloo).
    for r in (r0, r1):
        assert r["score"][0] == "SupportAlignmentError", r["score"]
        assert r["score"][1].startswith("CP rank 1 of 2: test slice: trajectory 1, logit position 4"), r["score"]
        assert r["flag_device"] == "cpu" and r["scored"]


def test_without_a_group_one_rank_checks_run_once_and_the_flag_stays_with_the_tensors():
    assert group_size_rank(None) == (1, 0)
    calls = []
    assert check_together(lambda: calls.append(1) or "ok", None, name="worker", device="cpu") == "ok" and calls == [1]
    assert agree(lambda: "alone", None, device="cpu", name="worker") == "alone"
    assert flag_device(None, torch.device("meta")) == torch.device("meta")
