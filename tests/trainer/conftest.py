"""Session fixture: the trainer's spawned runs, shared by the tests that read them (tests/trainer/distributed_runs.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.spawn import run_workers
from tests.trainer.distributed_runs import one_rank_megatron, two_rank_phases


@pytest.fixture(scope="session")
def spawned_runs(tmp_path_factory):
    """``{"two": [rank 0, rank 1] phase results, "one": [tp1, moe]}``; the two spawns run side by side."""
    out = tmp_path_factory.mktemp("spawned_runs")
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(run_workers, one_rank_megatron, 1, str(out / "one"))
        two = pool.submit(run_workers, two_rank_phases, 2, str(out / "two"))
        return {"two": two.result(), "one": one.result()[0]}
