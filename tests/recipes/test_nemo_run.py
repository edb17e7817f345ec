"""The NeMo-Run recipe for real: a ``run.Experiment`` built, launched and waited on.

Needs NeMo-Run (``pip install -e ".[nemo-run]"``, in an environment of its own: it pins
urllib3 < 2; ``.ci/run`` builds it). The local executor runs the main job with 2 CPU ranks
under the package's torchrun; the Slurm executor (marked ``slurm``: a running Slurm, see
``scripts/slurm_cluster.sh``) submits the same recipe through ``run.LocalTunnel``, where
the job gets the USR1 that ``--signal=USR1@<lead>`` sends every process of the step
(``scancel --signal=USR1``: the same delivery, now), checkpoints, exits 75, is requeued by
NeMo-Run's own batch script (``retries``) and resumes, then ends with the rows of the local
run, which was never interrupted; with ``--nodes 2`` on the two-node Slurm of
``scripts/slurm_cluster.sh start --nodes 2`` too, one rank per node. Each test runs the
README's command line.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.recipes.cluster import node_processes, node_ranks, rows, skip_without_slurm, skip_without_two_nodes

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("nemo_run") is None,
    reason='needs NeMo-Run: pip install torch==2.13.0 -e ".[nemo-run,launch,fsdp,dev]" in an environment of its own '
    "(README, NeMo-Run); .ci/run builds one",
)
RECIPE = [
    "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.micro_batch_size=8", "trainer.minibatches_per_step=2",
    "trainer.progress_bar=false", "trainer.plot=false", "generation.max_new_tokens=4", "model.hidden_size=32",
    "model.intermediate_size=64", "trainer.num_threads=1", "trainer.steps=10", "trainer.checkpoint_every=3",
]


def _recipe(cwd: Path, *args: str) -> subprocess.Popen:
    # The environment's own bin first, as when it is activated: the job runs `python` from PATH.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.Popen([sys.executable, str(REPO / "recipes" / "nemo_run_recipe.py"), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _task_line(out: str) -> str:
    line = re.search(r"nemo-run: task nemo-replay \(job (\S+)\): (\S+); logs under (\S+)", out)
    assert line, out[-4000:]
    return line


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """``--executor local``: the main job, 2 CPU ranks, to the end; (its folder, the recipe's output)."""
    cwd = tmp_path_factory.mktemp("nemo_run_local")
    proc = _recipe(cwd, "--executor", "local", "--gpus-per-node", "0", "--procs-per-node", "2",
                   "--base-dir", str(cwd / "nemo_run"), "--", "trainer.output_dir=runs/local", *RECIPE)
    out, _ = proc.communicate(timeout=600)
    return cwd, proc.returncode, out


def test_the_local_executor_runs_the_main_job(local_run):
    cwd, rc, out = local_run
    assert rc == 0, out[-4000:]
    line = _task_line(out)
    assert line.group(2) == "SUCCEEDED"
    logs = Path(line.group(3))
    assert logs.is_relative_to(cwd / "nemo_run" / "experiments" / "nemo-replay"), logs
    assert len(rows(cwd / "runs" / "local")) == 10  # the run folder is where the recipe was run from
    assert (cwd / "runs" / "local" / "summary.json").exists()


def _usr1_requeue_resume(local_run, tmp_path: Path, nodes: int, procs: int) -> None:
    """The Slurm executor's job on ``nodes`` x ``procs`` CPU ranks: USR1, exit 75, NeMo-Run's requeue, resume,
    and the local run's rows at the end."""
    cwd, rc, _ = local_run
    assert rc == 0
    proc = _recipe(tmp_path, "--executor", "slurm", "--nodes", str(nodes), "--gpus-per-node", "0", "--procs-per-node",
                   str(procs), "--no-container", "--time", "00:20:00", "--signal-lead", "60", "--retries", "2",
                   "--base-dir", str(tmp_path / "nr-home"), "--", "trainer.output_dir=runs/slurm", *RECIPE)
    collected: list[str] = []
    reader = threading.Thread(target=lambda: collected.extend(proc.stdout), daemon=True)
    reader.start()
    out = tmp_path / "runs" / "slurm"
    deadline = time.monotonic() + 300
    while len(rows(out)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "".join(collected)[-4000:]
        time.sleep(0.2)
    jobs = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, check=True).stdout.split("\n")
    (job,) = [j.split()[0] for j in jobs if j.strip().endswith("nemo-replay")]
    if nodes == 2:
        assert node_ranks(1) and node_ranks(2), (node_processes(1), node_processes(2))  # a rank on each node
    subprocess.run(["scancel", "--signal=USR1", job], check=True)  # to every process of the job step
    proc.wait(timeout=600)
    reader.join(timeout=10)
    text = "".join(collected)
    assert proc.returncode == 0, text[-4000:]
    line = _task_line(text)
    assert line.group(1) == job and line.group(2) == "SUCCEEDED"
    if subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True).returncode != 0:  # accounting off
        assert "waiting on the job through scontrol" in text, text[-4000:]  # NeMo-Run's wait would cancel it
    logs = Path(line.group(3))
    first, second = (logs / f"log--.nemo-replay_{job}_{n}.out" for n in (0, 1))  # one per SLURM_RESTART_COUNT
    stopped = re.search(r"stopped by SIGUSR1 after (\d+) of 10 steps", first.read_text())
    assert stopped, first.read_text()[-4000:]
    assert f"resuming runs/slurm after step {int(stopped.group(1)) - 1}" in second.read_text(), second.read_text()[-4000:]
    batch = next(logs.glob(f"sbatch_*_{job}.out")).read_text()
    assert "job exited with code 75" in batch and f"scontrol requeue {job}" in batch and "job exited with code 0" in batch
    assert rows(out) == rows(cwd / "runs" / "local")  # where the uninterrupted run ended, bit for bit


@pytest.mark.slurm
@skip_without_slurm()
def test_the_slurm_executor_checkpoints_on_usr1_requeues_and_resumes(local_run, tmp_path):
    _usr1_requeue_resume(local_run, tmp_path, nodes=1, procs=2)


@pytest.mark.slurm
@skip_without_two_nodes()
def test_two_nodes_the_slurm_executor_checkpoints_on_usr1_requeues_and_resumes(local_run, tmp_path):
    """``--nodes 2``, one rank per node, on ``scripts/slurm_cluster.sh start --nodes 2``: the same world of 2 ranks
    as the local run, so the same rows."""
    _usr1_requeue_resume(local_run, tmp_path, nodes=2, procs=1)
