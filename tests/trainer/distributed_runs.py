"""The reference trainer on gloo ranks: every multi-rank run the trainer tests read, in one group.

Starting a rank and building its models costs more than the tiny runs themselves, so every
two-rank run the trainer tests read is a phase of one group of ranks (the fixture
``spawned_runs`` of ``tests/trainer/test_spawned_runs.py``, the one file of the tests that
read them), and the one-rank megatron runs go in a group of their own started alongside it
(``tests/spawn.py``: CPU ranks are forked). A phase that raises records its traceback under
its name; the test that reads that phase fails with it, the others still get their results.

Phases run in order on every rank; the fsdp ones come first, then the megatron CPU shims
(tests/strategies/megatron/cpu_shims.py) are installed for the rest.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from tests.trainer.tiny import tiny

MOE = ["model.num_experts=4", "model.moe_top_k=2", "replay.route_replay=true"]


def rows(history):
    """History rows without ``step_time_s``, the one wall-clock metric."""
    return [{k: v for k, v in row.items() if k != "step_time_s"} for row in history]


def _fit(folder, world: int, *extra, steps: int):
    from nemo_replay.trainer.config import load_config
    from nemo_replay.trainer.grpo import GRPOTrainer

    return GRPOTrainer(load_config(overrides=tiny(folder, *extra, steps=steps), world_size=world)).fit()


def damage(folder: Path, how: str) -> str:
    """Rank 0 damages the checkpoint ``folder`` (the others wait); returns the file it touched.

    ``flip``: one bit of the largest shard of rank 1 (``__1_*``), sizes and complete.json intact;
    ``short``: the largest shard cut in half and complete.json's digests recomputed over
    what is left (as if the shard had been written short), so that the loader itself fails.
    """
    import json

    import torch.distributed as dist

    state = folder / "state"
    shards = sorted(state.glob("__1_*.distcp") if how == "flip" else state.glob("*.distcp"), key=lambda p: p.stat().st_size)
    target = shards[-1]
    if dist.get_rank() == 0:
        data = bytearray(target.read_bytes())
        if how == "flip":
            data[len(data) // 2] ^= 0x10
        else:
            data = data[: len(data) // 2]
        target.write_bytes(bytes(data))
        if how != "flip":
            from nemo_replay.trainer.rundir import digests

            manifest = json.loads((folder / "complete.json").read_text())
            listing = digests.list_files(folder, skip="complete.json")
            manifest["files"] = digests.combine(listing, digests.block_digests(folder, digests.blocks(listing)))
            (folder / "complete.json").write_text(json.dumps(manifest))
    dist.barrier()
    return target.name


def stop_and_resume(out_dir: str, world: int, extra: list, how: str) -> dict:
    """Straight through 3 steps; and 2 steps (checkpoint after step 1), then a new trainer on that folder to 3.
    Then the newest checkpoint (step 2) is damaged (:func:`damage`) and the same command resumes again."""
    extra = ["trainer.checkpoint_every=2", *extra]
    straight = _fit(f"{out_dir}/straight", world, *extra, steps=3)
    first = _fit(f"{out_dir}/stopped", world, *extra, steps=2)  # ends after step 1 with its checkpoint
    resumed = _fit(f"{out_dir}/stopped", world, *extra, steps=3)  # continues at step 2
    state = Path(first.last_checkpoint) / "state"
    touched = damage(Path(resumed.last_checkpoint), how)
    healed = _fit(f"{out_dir}/stopped", world, *extra, steps=3)  # step 2 set aside: from step 1 again
    ckpts = Path(out_dir) / "stopped" / "checkpoints"
    return {
        "straight": rows(straight.history), "resumed": rows(resumed.history), "first_step": resumed.first_step,
        "files": sorted(p.name for p in state.iterdir()) if state.is_dir() else None,
        "touched": touched, "healed": rows(healed.history), "healed_first_step": healed.first_step,
        "aside": sorted(p.name.rsplit("-", 1)[0] for p in ckpts.glob(".unloadable-*")),
        "log": (Path(out_dir) / "stopped" / "resume.log").read_text(),
    }


def _megatron_shims() -> None:
    from tests.strategies.megatron.cpu_shims import install_cpu_shims, install_moe_without_te_shim

    install_cpu_shims()
    install_moe_without_te_shim()


def megatron_runs(out_dir: str, world: int, runs: list) -> list:
    """GRPO steps with the megatron strategy, one run per entry of ``runs`` (extra overrides)."""
    from nemo_replay.trainer.config import load_config
    from nemo_replay.trainer.grpo import GRPOTrainer

    results = []
    for i, extra in enumerate(runs):
        overrides = tiny(f"{out_dir}/{i}", "replay.strategy=megatron", *extra, steps=2)
        trainer = GRPOTrainer(load_config(overrides=overrides, world_size=world))
        probe = None
        if "replay.route_replay=true" in extra:
            batch, _ = trainer.rollout()  # one extra rollout to look at the recorded routes
            probe = {
                "route_rows": batch.routes.lengths.tolist(),
                "tokens": batch.attention_mask.sum(1).tolist(),
                "route_range": (int(batch.routes.values.min()), int(batch.routes.values.max())),
            }
        results.append({"history": trainer.fit().history, "probe": probe})
    return results


def _phases(out_dir: str, world: int):
    yield "dp2", lambda: _fit(f"{out_dir}/dp2", world, steps=2).history  # FSDP2 data parallel 2
    yield "sp2", lambda: _fit(f"{out_dir}/sp2", world, "parallel.sequence=2", "trainer.prompts_per_step=2",
                              steps=2).history  # Ulysses SP 2
    yield "fsdp_resume", lambda: stop_and_resume(f"{out_dir}/fsdp", world, [], "flip")
    _megatron_shims()
    tp2 = ["replay.strategy=megatron", "parallel.tensor=2"]
    yield "megatron_resume", lambda: stop_and_resume(f"{out_dir}/megatron", world, tp2, "short")
    yield "megatron_tp2", lambda: megatron_runs(f"{out_dir}/tp2", world, [["parallel.tensor=2"]])[0]


def two_rank_phases(rank: int, world: int, out_dir: str) -> dict:
    results = {}
    for name, run in _phases(out_dir, world):
        try:
            results[name] = run()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


def one_rank_megatron(rank: int, world: int, out_dir: str) -> list:
    """TP = 1 and MoE with route replay on a single rank: ``[tp1, moe]``."""
    _megatron_shims()
    return megatron_runs(out_dir, world, [[], MOE])


def phase(results: dict, name: str):
    """The result of phase ``name``; its traceback as the failure when it raised."""
    got = results[name]
    if isinstance(got, dict) and set(got) == {"error"}:
        raise AssertionError(f"phase {name} raised:\n{got['error']}")
    return got
