"""Slurm and NeMo-Run launchers: dry runs print what would be submitted, checked line by line."""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import nemo_run_recipe, slurm

REPO = Path(__file__).resolve().parents[2]
MEGATRON = "configs/megatron_moe_gpu.yaml"


def _torchrun_argv(command: str) -> list[str]:
    """The torchrun argv inside ``setup && torchrun ...`` as the node's shell would split it."""
    tail = command.split("&&", 1)[-1]
    return shlex.split(tail)


def test_slurm_dry_run_script(capsys):
    rc = slurm.main([
        "--nodes", "2", "--gpus-per-node", "8", "--partition", "batch", "--account", "proj",
        "--container-mounts", "/lustre/repo:/workspace/nemo_replay,/lustre/data:/data",
        "--dry-run", "--", MEGATRON, "trainer.steps=200",
    ])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("# dry run: would write logs/nemo-replay-") and "sbatch logs/" in out
    script = out.split("\n", 1)[1]
    for directive in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=batch", "--account=proj"):
        assert f"#SBATCH {directive}\n" in script
    assert 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert "export MASTER_PORT=29500" in script
    # The srun command, joined across its continuation lines, split like bash would.
    srun_text = script[script.index("srun") :].replace("\\\n", " ")
    srun = shlex.split(srun_text)
    assert srun[:3] == ["srun", "--nodes=2", "--ntasks-per-node=1"]
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in srun
    assert "--container-mounts=/lustre/repo:/workspace/nemo_replay,/lustre/data:/data" in srun
    assert "--container-workdir=/workspace/nemo_replay" in srun
    bash_c = srun[srun.index("-c") + 1]
    argv = _torchrun_argv(bash_c)
    assert argv[0] == "torchrun"
    assert {"--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--node-rank=$SLURM_NODEID"} <= set(argv)
    assert "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT" in argv
    module = argv.index("-m")
    assert argv[module + 1 : module + 4] == ["nemo_replay", "train", MEGATRON]
    assert argv[-4:] == ["trainer.devices=8", "trainer.num_nodes=2", "trainer.accelerator=gpu", "trainer.steps=200"]
    if shutil.which("bash"):
        check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
        assert check.returncode == 0, check.stderr


def test_slurm_refuses_a_recipe_that_does_not_fit_the_allocation(capsys):
    rc = slurm.main(["--nodes", "3", "--gpus-per-node", "1", "--dry-run", "--", MEGATRON])
    err = capsys.readouterr().err
    assert rc == 2
    assert "not submitted" in err and "does not divide world size 3" in err and "parallel.expert=2" in err


def test_slurm_dry_run_as_a_script_without_setup():
    proc = subprocess.run(
        [sys.executable, "recipes/slurm.py", "--nodes", "1", "--gpus-per-node", "2", "--setup", "", "--dry-run", "--",
         "configs/fsdp_gpu.yaml", "parallel.sequence=2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "bash -c 'torchrun --nnodes=1 --nproc-per-node=2" in proc.stdout
    assert "pip install" not in proc.stdout


def test_nemo_run_dry_runs_without_nemo_run(capsys):
    rc = nemo_run_recipe.main([
        "--executor", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--account", "proj", "--partition", "batch",
        "--container-mounts", "/lustre/repo:/workspace/nemo_replay", "--dry-run", "--", MEGATRON,
    ])
    out = capsys.readouterr().out
    assert rc == 0
    plan = json.loads(out.split("\n", 1)[1])
    ex = plan["executor_args"]
    assert plan["executor"] == "slurm" and plan["world_size"] == 16
    assert (ex["nodes"], ex["ntasks_per_node"], ex["gpus_per_node"], ex["launcher"]) == (2, 8, 8, "torchrun")
    assert ex["container_image"].startswith("nvcr.io/nvidia/") and ex["container_mounts"] == ["/lustre/repo:/workspace/nemo_replay"]
    assert plan["task"] == {
        "path": "nemo_replay", "entrypoint": "python", "m": True,
        "args": ["train", MEGATRON, "trainer.devices=8", "trainer.num_nodes=2", "trainer.accelerator=gpu"],
    }
    argv = _torchrun_argv(plan["per_node_command"])
    assert "--nnodes=2" in argv and "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT" in argv

    rc = nemo_run_recipe.main(["--executor", "local", "--gpus-per-node", "2", "--setup", "", "--dry-run"])
    plan = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert rc == 0
    assert plan["executor_args"]["ntasks_per_node"] == 2 and plan["executor_args"]["launcher"] == "torchrun"
    assert plan["per_node_command"].startswith("torchrun --nnodes=1 --nproc-per-node=2 --node-rank=0")
    assert "--rdzv-endpoint=localhost:29500" in plan["per_node_command"]
    assert "nemo_run" not in sys.modules


def test_nemo_run_errors_name_the_fix():
    with pytest.raises(ValueError, match="--nodes must be 1"):
        nemo_run_recipe.plan(nemo_run_recipe.Job(nodes=2), "local")
    if importlib.util.find_spec("nemo_run") is None:  # submitting needs it; the dry run does not
        with pytest.raises(ValueError, match="pip install nemo-run"):
            nemo_run_recipe.build(nemo_run_recipe.plan(nemo_run_recipe.Job(), "local"))
