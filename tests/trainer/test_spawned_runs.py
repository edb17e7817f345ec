"""The trainer on gloo ranks: every test here reads the same two groups of ranks.

``tests/trainer/distributed_runs.py`` runs them: one rank of megatron-core (TP = 1, and an
MoE model with route replay) beside two ranks whose phases run FSDP2 data parallel 2,
Ulysses SP 2, megatron-core TP 2, and a stopped-then-resumed run of each backend. The tests
that read them live in this one file, so that a parallel run (``-n 2 --dist loadfile``, one
file per worker) starts the ranks once; spread over files, each worker started them again.

Megatron ranks install the test-only shims of tests/strategies/megatron/cpu_shims.py (CPU
device for megatron's CUDA calls; the missing ``te_general_gemm`` name for MoE without
Transformer Engine); process groups, layers, schedules and ``dist_checkpointing`` are
megatron-core's own. FSDP2 checkpoints go through Lightning Fabric's
``ModelParallelStrategy.save`` (torch distributed checkpoint, one shard file per rank).
"""

from __future__ import annotations

import pytest

from nemo_replay.trainer.config import load_config
from nemo_replay.trainer.grpo import GRPOTrainer
from tests.spawn import start_workers
from tests.trainer.distributed_runs import one_rank_megatron, phase, two_rank_phases
from tests.trainer.tiny import tiny


@pytest.fixture(scope="module")
def spawned_runs(tmp_path_factory):
    """``{"two": [rank 0, rank 1] phase results, "one": [tp1, moe]}``; the two spawns run side by side."""
    out = tmp_path_factory.mktemp("spawned_runs")
    one = start_workers(one_rank_megatron, 1, str(out / "one"))
    two = start_workers(two_rank_phases, 2, str(out / "two"))
    return {"two": two.results(), "one": one.results()[0]}


def test_fsdp2_data_parallel_and_ulysses_sp(spawned_runs, tmp_path):
    # FSDP2 data parallel 2 and Ulysses SP 2: phases of the shared two-rank spawn (tests/trainer/distributed_runs.py).
    ranks = [{name: phase(rank, name) for name in ("dp2", "sp2")} for rank in spawned_runs["two"]]
    for name in ("dp2", "sp2"):
        h0, h1 = ranks[0][name], ranks[1][name]
        assert h0 == h1  # every metric is reduced over the ranks
        assert h0[0]["ratio_max_dev"] < 1e-5 and h0[0]["mismatch_max"] < 1e-5
        assert h0[1]["ratio_max_dev"] < 1e-5
    # SP = 2 holds one data-parallel replica: the rollouts of a single process with the same seed.
    cfg = load_config(overrides=tiny(tmp_path / "sp1", "trainer.prompts_per_step=2", steps=2))
    single = GRPOTrainer(cfg).fit().history
    sp2 = ranks[0]["sp2"]
    for a, b in zip(single, sp2):
        assert a["reward"] == b["reward"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-6)


def test_megatron_steps_tp1_tp2_and_moe_route_replay(spawned_runs):
    # TP = 1 and MoE on one rank; TP = 2 a phase of the shared two-rank spawn (tests/trainer/distributed_runs.py).
    tp1, moe = spawned_runs["one"]
    tp2 = [phase(rank, "megatron_tp2") for rank in spawned_runs["two"]]
    assert tp2[0]["history"] == tp2[1]["history"]
    tp2 = tp2[0]
    for run in (tp1, tp2, moe):
        first, second = run["history"]
        assert abs(first["ratio_mean"] - 1) < 1e-5 and first["ratio_max_dev"] < 1e-5
        assert first["mismatch_max"] < 1e-5 and second["ratio_max_dev"] < 1e-5
    # TP = 2 splits the same weights: same rollouts, same update.
    for a, b in zip(tp1["history"], tp2["history"]):
        assert a["reward"] == b["reward"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-6)
    # R3: one recorded route row per real token, expert ids in range.
    probe = moe["probe"]
    assert probe["route_rows"] == probe["tokens"]
    assert 0 <= probe["route_range"][0] and probe["route_range"][1] < 4


def test_sharded_checkpoints_resume_bit_for_bit_fsdp2_and_megatron_tp2(spawned_runs):
    # Phases of the shared two-rank spawn (tests/trainer/distributed_runs.py, ``stop_and_resume``).
    ranks = [{"fsdp": phase(rank, "fsdp_resume"), "megatron": phase(rank, "megatron_resume")}
             for rank in spawned_runs["two"]]
    for name in ("fsdp", "megatron"):
        r0, r1 = ranks[0][name], ranks[1][name]
        assert r0["first_step"] == 2 and r0["resumed"] == r1["resumed"]
        assert [row["step"] for row in r0["resumed"]] == [0, 1, 2]
        assert r0["resumed"] == r0["straight"], name  # every metric of every step
    # One shard file per rank, written by torch distributed checkpoint; the rest in metadata.
    fsdp_files = ranks[0]["fsdp"]["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= set(fsdp_files), fsdp_files
    megatron_files = ranks[0]["megatron"]["files"]
    assert {"common.pt", "metadata.json", ".metadata"} <= set(megatron_files), megatron_files
    assert sum(f.endswith(".distcp") for f in megatron_files) >= 2, megatron_files


def test_a_damaged_sharded_checkpoint_is_set_aside_on_every_rank_and_the_one_before_resumes(spawned_runs):
    """The newest checkpoint of each sharded format damaged after the run (``damage`` in
    tests/trainer/distributed_runs.py): FSDP2 (torch DCP through Fabric) with one bit of rank 1's
    shard flipped, caught by its recorded digest; megatron-core TP 2 with a shard cut in half
    under digests recomputed over what is left, so that megatron's own loader fails. Either way the
    same command sets it aside and resumes from step 1, every rank alike, to the same rows."""
    for name, why in (("fsdp", "does not hold the bytes written (SHA-256"), ("megatron", "does not load: ")):
        r0, r1 = (phase(rank, f"{name}_resume") for rank in spawned_runs["two"])
        assert r0["healed_first_step"] == 2 and r0["healed"] == r1["healed"], name
        assert r0["healed"] == r0["straight"], name  # step 2 again, bit for bit
        assert r0["aside"] == [".unloadable-step-0000002"], (name, r0["aside"])
        assert "checkpoint" in r0["log"] and why in r0["log"] and "resuming from step-0000001" in r0["log"], r0["log"]
    assert "__1_0.distcp" in phase(spawned_runs["two"][0], "fsdp_resume")["log"]
