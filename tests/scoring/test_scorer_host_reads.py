"""One host read per scorer call for its guards (docs/design.md §4).

Every tensor operation of a call is watched (benchmarks/syncs.py: a TorchFunctionMode for
the forward, a profiler hook for the backward); explicit reads (``bool``, ``int``,
``.item``, ``.tolist``) and operations whose output size depends on the data (``nonzero``,
``unique``, boolean-mask indexing, ...) are what a GPU run would wait for. Before the
guards were combined a logits call made 16 of them (12 with ``validate=False``).
"""

from __future__ import annotations

import pytest

from benchmarks.syncs import count_reads, scenarios


@pytest.fixture(scope="module")
def calls():
    return scenarios(T=64, V=512, H=16, k=8)


@pytest.mark.parametrize("name", ["logits, validate=True", "logits, validate=False", "hidden", "hidden, ragged rows",
                                  "logits, compact rows decoded at the entry",
                                  "full vocabulary (replay off)"])
def test_one_host_read_per_forward(calls, name):
    fwd, bwd = count_reads(calls[name])
    assert fwd.total == 1, dict(fwd.where)
    assert all("scoring/plan.py" in where for where in fwd.where), dict(fwd.where)
    # Backward: none in logits mode; the hidden-mode weight gradient groups pairs by id (one).
    assert bwd.total <= (1 if name.startswith("hidden") else 0), dict(bwd.where)


def test_the_counter_sees_reads():
    """The counter is not blind: a call that reads the device is counted, with its place."""
    import torch

    from benchmarks.syncs import HostReads

    x = torch.arange(10)
    with HostReads() as reads:
        bool(x.any()), x[x > 3], torch.nonzero(x), x.tolist(), torch.nonzero_static(x, size=9)
    assert reads.total == 4, dict(reads.where)
