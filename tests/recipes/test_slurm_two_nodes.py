"""The Slurm launcher's two-node job on a real two-node Slurm: signalled, requeued, killed, a node lost.

Needs the two-node Slurm of ``scripts/slurm_cluster.sh start --nodes 2`` (as root; ``.ci/run``
starts one): nodes nr-node1 and nr-node2, each in a network namespace of its own with its
own address, so torchrun's rendezvous, gloo's connections and Slurm's own traffic cross a
(virtual) network. Each job is the batch script ``recipes/slurm.py --nodes 2 --gpus-per-node 0
--procs-per-node 1 --no-container`` writes, unchanged: one CPU rank per node, the rendezvous
at the first node's address.

- fsdp (data parallel across the nodes) and megatron (``parallel.tensor=2``: the only tensor
  parallel that 1 rank per node allows is across the nodes, so every layer's collectives
  cross the network; megatron-core runs on CPU through the test shims of
  ``tests/recipes/cpu_shims_site``). One job's life: USR1 to the batch shell (both nodes'
  ranks write their shards of the stop checkpoint, the step exits 75, the job is requeued
  and both nodes resume), then SIGKILL to every process of the job on the second node (the
  job fails; the same script, submitted again, resumes from the last complete checkpoint).
  It ends with the metrics rows and every tensor of the final checkpoint of a job never
  interrupted, bit for bit.
- One node dying alone (``slurm_cluster.sh node-down 2``: its link goes down, then its
  slurmd and every process in it are killed, so nothing tells the other node): the rank on
  nr-node1 ends with the trainer's named collective error once ``trainer.collective_timeout_s``
  runs out, not a hang; Slurm marks the node DOWN and requeues the job, which waits for two
  nodes and, once the node is back (``node-up 2``), resumes from the last complete
  checkpoint and ends where the uninterrupted job ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.recipes.cluster import (
    JOB_RECIPE, STRATEGIES, job_env, resubmit_resumes,
    after_start, ended, final_weights, job_fields, latest_checkpoint, node_processes, node_ranks, resumed_after, rows,
    skip_without_two_nodes, wait_for,
)

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm_cluster.sh"

pytestmark = [pytest.mark.slurm, skip_without_two_nodes()]

STEPS = 12
RECIPE = [*JOB_RECIPE, f"trainer.steps={STEPS}"]
TIMEOUT_S = 30  # trainer.collective_timeout_s of the job that loses a node


def _submit(cwd: Path, strategy: str, name: str, out: str, *extra: str) -> tuple[str, Path, Path]:
    """``recipes/slurm.py`` as a user runs it for two nodes; (job id, the batch script it wrote, the job log)."""
    cmd = [sys.executable, str(REPO / "recipes" / "slurm.py"), "--nodes", "2", "--gpus-per-node", "0",
           "--procs-per-node", "1", "--no-container", "--time", "00:20:00", "--signal-lead", "60",
           "--job-name", name, "--", f"trainer.output_dir={out}", *RECIPE, *STRATEGIES[strategy], *extra]
    done = subprocess.run(cmd, cwd=cwd, env=job_env(strategy), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    job = re.search(r"Submitted batch job (\d+)", done.stdout)
    assert job, done.stdout
    (script,) = (cwd / "logs").glob(f"{name}-*.sbatch")
    return job.group(1), script, cwd / "logs" / f"{name}-{job.group(1)}.out"


def _node_states() -> list:
    """``node:state`` of every node, as sinfo shows them (``down*``: DOWN and not responding)."""
    return subprocess.run(["sinfo", "-h", "-N", "-o", "%N:%t"], capture_output=True, text=True, check=True).stdout.split()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(strategy)``: the run folder of a two-node job never interrupted, run once per strategy."""
    done: dict = {}

    def run(strategy: str) -> Path:
        if strategy not in done:
            cwd = tmp_path_factory.mktemp(f"ref-{strategy}")
            job, _, log = _submit(cwd, strategy, f"ref-{strategy}", "runs/ref")
            state = wait_for("the uninterrupted job to end", lambda: ended(job), log)
            assert state == "COMPLETED" and job_fields(job)["ExitCode"] == "0:0", log.read_text()[-4000:]
            assert re.search(r"started on nr-node1 \(SLURM_RESTART_COUNT=0\)", log.read_text())
            done[strategy] = cwd / "runs" / "ref"
        return done[strategy]

    return run


def _same_end(out: Path, ref: Path, tmp: Path) -> None:
    """Rows (all but the step time) and every tensor of the final checkpoint equal, bit for bit."""
    assert rows(out) == rows(ref)
    want, got = final_weights(ref, tmp, STEPS), final_weights(out, tmp, STEPS)
    assert want.keys() == got.keys() and len(want) > 10
    for key in want:
        assert torch.equal(want[key], got[key]), key


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_two_nodes_signal_requeue_kill_and_resume_end_where_an_uninterrupted_job_ends(strategy, reference, tmp_path):
    ref = reference(strategy)
    out = tmp_path / "runs" / "run"
    job, script, log = _submit(tmp_path, strategy, f"run-{strategy}", "runs/run")
    wait_for("step 1", lambda: len(rows(out)) >= 2, log)
    assert node_ranks(1) and node_ranks(2), (node_processes(1), node_processes(2))  # one rank on each node

    # 1. USR1 to the batch shell: both nodes' ranks checkpoint the step in flight, exit 75, requeue, resume.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    wait_for("the requeued job to resume", lambda: job_fields(job).get("Restarts") == "1" and "resuming" in after_start(log, 1), log)
    first = after_start(log, 0)
    assert "nemo-replay: the job step exited 75 (75: it checkpointed and stopped)" in first, first[-4000:]
    stopped = re.search(r"stopped by SIGUSR1 after (\d+) of", first)
    assert stopped, first[-4000:]
    step = int(stopped.group(1)) - 1
    assert resumed_after(after_start(log, 1)) == step  # the step in flight, not a periodic one
    files = json.loads((out / "checkpoints" / f"step-{step:07d}" / "complete.json").read_text())["files"]
    writers = {int(m.group(1)) for f in files for m in [re.search(r"__(\d+)_\d+\.distcp$", f)] if m}
    assert writers == {0, 1}, sorted(files)  # a shard from the rank on each node
    wait_for("a rank on each node again", lambda: node_ranks(1) and node_ranks(2), log)

    # 2. SIGKILL to the job's processes on the second node: the job fails; the same script resumes it.
    resumed = resumed_after(after_start(log, 1))
    wait_for("a checkpoint after the resume", lambda: latest_checkpoint(out) > resumed, log)
    doomed = [pid for pid, cmd in node_processes(2).items() if not cmd.startswith(("slurmd", "slurmstepd"))]
    assert any("-m nemo_replay train" in node_processes(2).get(pid, "") for pid in doomed), node_processes(2)
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for("the killed job to end", lambda: ended(job), log)
    assert job_fields(job)["JobState"] == "FAILED" and "stopped by" not in after_start(log, 1), after_start(log, 1)[-4000:]
    resubmit_resumes(script, tmp_path, strategy, out)

    _same_end(out, ref, tmp_path)


def test_two_nodes_one_node_dying_alone_ends_the_other_nodes_ranks_with_a_named_error(reference, tmp_path):
    ref = reference("fsdp")
    out = tmp_path / "runs" / "die"
    job, _, log = _submit(tmp_path, "fsdp", "die", "runs/die", f"trainer.collective_timeout_s={TIMEOUT_S}")
    wait_for("a first checkpoint", lambda: latest_checkpoint(out) >= 2, log)
    survivors = node_ranks(1)
    assert survivors and node_ranks(2), (node_processes(1), node_processes(2))
    try:
        died = time.monotonic()
        subprocess.run([str(CLUSTER), "node-down", "2"], check=True, capture_output=True, text=True)
        # A rank waits for the dead one at its next collective (within a step of a few seconds), then for the
        # process group's timeout; 30 s more covers the step and the exit.
        wait_for("nr-node1's ranks to end", lambda: not any(map(_alive, survivors)), log, timeout=TIMEOUT_S + 30)
        took = time.monotonic() - died
        text = log.read_text()
        named = re.findall(
            rf"nemo-replay train: step \d+ on rank (\d+): the collective \S+, called from nemo_replay/\S+ \(\w+\), "
            rf"waited trainer\.collective_timeout_s={TIMEOUT_S} s without every rank joining", text)
        assert named == ["0"], text[-4000:]  # the one rank of nr-node1, not a hang
        print(f"nr-node1's rank ended {took:.1f} s after nr-node2 died (trainer.collective_timeout_s={TIMEOUT_S})")
        assert not node_ranks(1)
        # Slurm finds the node silent (SlurmdTimeout), marks it DOWN and requeues the job (--requeue), which
        # waits for two nodes.
        wait_for("the job to be requeued and wait for the node",
                 lambda: (f := job_fields(job)).get("Restarts") == "1" and f.get("JobState") == "PENDING", log, timeout=120)
        assert [line.split(":")[1] for line in _node_states()] == ["idle", "down*"], _node_states()
    finally:
        subprocess.run([str(CLUSTER), "node-up", "2"], check=True, capture_output=True, text=True)
    kept = latest_checkpoint(out)
    wait_for("the requeued job to end", lambda: ended(job), log)
    assert job_fields(job)["JobState"] == "COMPLETED", log.read_text()[-4000:]
    assert resumed_after(after_start(log, 1)) == kept
    _same_end(out, ref, tmp_path)
