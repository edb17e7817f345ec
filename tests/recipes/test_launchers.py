"""Slurm and NeMo-Run launchers: dry runs print what would be submitted, checked line by line."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
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
    srun_text = script[script.index("\nsrun") + 1 : script.index(" &\nSTEP_PID=$!\nwait \"${STEP_PID}\"\n")]
    srun = shlex.split(srun_text.replace("\\\n", " "))
    assert srun[:3] == ["srun", "--nodes=2", "--ntasks-per-node=1"]
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in srun
    assert "--container-mounts=/lustre/repo:/workspace/nemo_replay,/lustre/data:/data" in srun
    assert "--container-workdir=/workspace/nemo_replay" in srun
    bash_c = srun[srun.index("-c") + 1]
    assert bash_c.startswith('trap "" USR1; ')  # the step's bash and torchrun leave USR1 to the trainer ranks
    argv = _torchrun_argv(bash_c)
    assert argv[:3] == ["python", "-m", "nemo_replay.trainer.torchrun"]  # torchrun, exit 75 after a stop checkpoint
    assert {"--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--node-rank=$SLURM_NODEID"} <= set(argv)
    assert "--shutdown-timeout=300" in argv  # torchrun's 30 s would SIGKILL a long step before its stop checkpoint
    assert "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT" in argv
    module = len(argv) - 1 - argv[::-1].index("-m")  # the workload module, after the launcher's own -m
    assert argv[module + 1 : module + 4] == ["nemo_replay", "train", MEGATRON]
    assert argv[-5:-2] == ["trainer.devices=8", "trainer.num_nodes=2", "trainer.accelerator=gpu"]
    # A pinned run folder: a requeued job runs the same line and resumes there.
    assert re.fullmatch(r"trainer\.output_dir=runs/nemo-replay-\d{8}-\d{6}-[0-9a-f]{6}", argv[-2])
    assert argv[-1] == "trainer.steps=200"
    # Time limit: USR1 to the batch shell 300 s ahead, requeue, logs appended.
    for directive in ("--time=01:00:00", "--signal=B:USR1@300", "--requeue", "--open-mode=append"):
        assert f"#SBATCH {directive}\n" in script
    assert "trap on_usr1 USR1" in script and 'scontrol requeue "${SLURM_JOB_ID}"' in script
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
    assert "bash -c 'trap \"\" USR1; python -m nemo_replay.trainer.torchrun --nnodes=1 --nproc-per-node=2" in proc.stdout
    assert "pip install" not in proc.stdout


def test_slurm_cpu_job_without_a_container(capsys, tmp_path, monkeypatch):
    """``--gpus-per-node 0 --no-container``: no GRES, no pyxis flags, CPU ranks, no setup, the recipe checked for them."""
    monkeypatch.chdir(tmp_path)
    rc = slurm.main(["--gpus-per-node", "0", "--procs-per-node", "2", "--no-container", "--time", "00:20:00",
                     "--signal-lead", "60", "--dry-run", "--", "trainer.steps=3"])
    out = capsys.readouterr().out
    assert rc == 0
    script = out.split("\n", 1)[1]
    assert "--gpus-per-node" not in script and "container" not in script.replace("without a container", "")
    assert "# One task per node; torchrun starts 2 CPU processes." in script
    srun = shlex.split(script[script.index("\nsrun") + 1 : script.index(" &\nSTEP_PID")].replace("\\\n", " "))
    assert srun[:3] == ["srun", "--nodes=1", "--ntasks-per-node=1"] and srun[3] == "bash"  # no --chdir: where sbatch runs
    argv = _torchrun_argv(srun[-1])
    assert "pip install" not in srun[-1] and "--nproc-per-node=2" in argv
    assert argv[argv.index("train") + 1 : argv.index("train") + 4] == [
        "trainer.devices=2", "trainer.num_nodes=1", "trainer.accelerator=cpu"]
    # --workdir is where the task runs; the recipe is looked up there, before anything is written.
    assert slurm.main(["--gpus-per-node", "0", "--procs-per-node", "2", "--no-container", "--workdir", str(REPO),
                       "--dry-run", "--", "configs/fsdp_gpu.yaml"]) == 0
    assert f"--chdir={REPO}" in capsys.readouterr().out
    assert slurm.main(["--gpus-per-node", "0", "--procs-per-node", "3", "--no-container", "--workdir", str(REPO),
                       "--dry-run", "--", "configs/megatron_moe_gpu.yaml"]) == 2
    assert "does not divide world size 3" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_nemo_run_dry_runs_without_nemo_run(capsys, tmp_path, monkeypatch):
    rc = nemo_run_recipe.main([
        "--executor", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--account", "proj", "--partition", "batch",
        "--container-mounts", "/lustre/repo:/workspace/nemo_replay", "--signal-lead", "120", "--dry-run", "--", MEGATRON,
    ])
    out = capsys.readouterr().out
    assert rc == 0
    plan = json.loads(out.split("\n", 1)[1])
    ex = plan["executor_args"]
    assert plan["executor"] == "slurm" and plan["world_size"] == 16
    assert (ex["nodes"], ex["ntasks_per_node"], ex["gpus_per_node"], ex["packager"]) == (2, 1, 8, "plain")
    assert ex["container_image"].startswith("nvcr.io/nvidia/") and ex["container_mounts"] == ["/lustre/repo:/workspace/nemo_replay"]
    # Preemption through NeMo-Run's own script: USR1 to the step, requeue on a non-zero exit.
    assert (ex["signal"], ex["retries"], ex["additional_parameters"]) == ("USR1@120", 3, {"requeue": True})
    assert ex["srun_args"] == ["--kill-on-bad-exit=0"]  # every node's 75 is a bad exit to srun: none ends the others
    assert ex["tunnel"] == {"kind": "local", "job_dir": os.path.join(os.path.expanduser("~/.nemo_run"), "experiments")}
    script = plan["task"]["inline"].splitlines()
    assert script[0].startswith('trap "" USR1') and script[1] == "cd /workspace/nemo_replay"
    assert script[2] == 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
    setup, command = script[4].split(" && ")
    assert setup == 'pip install --quiet -e ".[all]"'
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "nemo_replay.trainer.torchrun"]
    assert {"--nnodes=2", "--nproc-per-node=8", "--node-rank=$SLURM_NODEID", "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT",
            "--shutdown-timeout=120"} <= set(argv)
    train = argv.index("train")
    assert argv[train - 2 :] [:2] == ["-m", "nemo_replay"] and argv[train + 1 : train + 5] == [
        MEGATRON, "trainer.devices=8", "trainer.num_nodes=2", "trainer.accelerator=gpu"]
    assert argv[-1].startswith("trainer.output_dir=runs/nemo-replay-")

    # Local: this machine, no container, the run in the folder the recipe is run from.
    monkeypatch.chdir(tmp_path)
    rc = nemo_run_recipe.main(["--executor", "local", "--gpus-per-node", "0", "--procs-per-node", "2", "--dry-run"])
    plan = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert rc == 0 and plan["executor_args"]["ntasks_per_node"] == 1
    script = plan["task"]["inline"].splitlines()
    assert script[1] == f"cd {tmp_path}" and "pip install" not in plan["task"]["inline"]
    assert script[2].startswith("python -m nemo_replay.trainer.torchrun --nnodes=1 --nproc-per-node=2 --node-rank=0")
    assert "--rdzv-endpoint=localhost:29500" in script[2] and "trainer.accelerator=cpu" in script[2]
    assert "nemo_run" not in sys.modules
    assert os.listdir(tmp_path) == []


def test_nemo_run_errors_name_the_fix():
    with pytest.raises(ValueError, match="--nodes must be 1"):
        nemo_run_recipe.plan(nemo_run_recipe.Job(nodes=2), "local")
    if importlib.util.find_spec("nemo_run") is None:  # submitting needs it; the dry run does not
        with pytest.raises(ValueError, match=r"pip install -e \"\.\[nemo-run\]\""):
            nemo_run_recipe.build(nemo_run_recipe.plan(nemo_run_recipe.Job(), "local"))


BAD_ARGUMENTS = [
    (["--nodes", "0"], "argument --nodes: 0 must be >= 1"),
    (["--gpus-per-node", "two"], "argument --gpus-per-node: 'two' is not an integer"),
    (["--time", "banana"], "argument --time: 'banana' is not a Slurm time limit"),
    (["--time", "04:75:00"], "minutes and seconds after a colon must be < 60"),
    (["--master-port", "99999"], "argument --master-port: 99999 is not a usable TCP port"),
    (["--job-name", "x;rm -rf ~"], "argument --job-name: 'x;rm -rf ~' may hold only letters"),
    (["--container-mounts", "/lustre/data"], "argument --container-mounts: mount '/lustre/data' is not SRC:DST"),
    (["--container-mounts", "/a:data"], "destination 'data' must be an absolute path"),
    (["--container-mounts", "/a b:/data"], "source '/a b' must be a path without spaces"),
    (["--partition", "batch queue"], "argument --partition: 'batch queue' is not a Slurm name"),
    (["--workdir", "relative/dir"], "argument --workdir: 'relative/dir' must be an absolute path"),
    (["--container-image", "img; reboot"], "argument --container-image: 'img; reboot' is not a container image"),
    (["--gpus-per-node", "-1"], "argument --gpus-per-node: -1 must be >= 0"),
    (["--gpus-per-node", "8", "--procs-per-node", "2"], "--procs-per-node: torchrun starts one process per GPU, so it must be --gpus-per-node (8), got 2"),
    (["--no-container", "--container-image", "nvcr.io/nvidia/pytorch:25.01-py3"], "--no-container runs without a container; drop --container-image"),
    (["--no-container", "--container-mounts", "/a:/b"], "drop --container-mounts or --no-container"),
]


@pytest.mark.parametrize("launcher", ["slurm", "nemo_run"])
def test_every_bad_argument_is_one_line_exit_2_and_nothing_is_written(launcher, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = slurm if launcher == "slurm" else nemo_run_recipe
    cases = list(BAD_ARGUMENTS)
    if launcher == "slurm":
        cases += [
            (["--time", "00:04:00"], "argument --signal-lead: 300 s is not before the end of --time=00:04:00 (240 s)"),
            (["--signal-lead", "70000"], "argument --signal-lead: 70000 must be in [1, 65535]"),
        ]
    else:
        cases += [
            (["--executor", "local", "--nodes", "2"], "the local executor runs on this machine, so --nodes must be 1"),
            (["--executor", "local", "--container-image", "nvcr.io/nvidia/pytorch:25.01-py3"],
             "the local executor runs on this machine without a container; drop --container-image"),
            (["--executor", "slurm", "--job-dir", "/x"], "argument --job-dir: it names the folder on the login node of --ssh-host"),
            (["--executor", "slurm", "--time", "00:04:00"], "argument --signal-lead: 300 s is not before the end of --time"),
            (["--executor", "slurm", "--gpus-per-node", "0", "--no-container", "--base-dir", "/tmp/nemo_run", "--dry-run"],
             "'/tmp/nemo_run' holds '/nemo_run', which NeMo-Run's Slurm executor without a container rewrites"),
        ]
    for argv, expected in cases:
        # Not a dry run: a check that came after writing would leave a script behind.
        assert module.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert expected in err, err
    assert os.listdir(tmp_path) == []


LATE = [  # (argv, the flag named): launcher flags after the workload, which REMAINDER swallowed
    (["configs/fsdp_gpu.yaml", "trainer.steps=3", "--dry-run"], "--dry-run"),
    (["--no-validate", "configs/fsdp_gpu.yaml", "--dry-run"], "--dry-run"),  # was submitted
    (["--no-validate", "trainer.steps=3", "--time=00:10:00"], "--time"),
    (["--no-validate", "--", "trainer.steps=3", "--nodes", "2"], "--nodes"),
    (["--no-validate", "configs/fsdp_gpu.yaml", "-h"], "-h"),
]


@pytest.mark.parametrize("launcher", ["slurm", "nemo_run"])
def test_launcher_flags_after_the_workload_are_refused_and_nothing_is_submitted(launcher, tmp_path, capsys, monkeypatch):
    bin_dir, submitted = tmp_path / "bin", tmp_path / "submitted"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" >> {submitted}\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    module = slurm if launcher == "slurm" else nemo_run_recipe
    lead = ["--gpus-per-node", "1"] if launcher == "slurm" else ["--executor", "slurm"]
    for argv, flag in LATE:
        assert module.main([*lead, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert f"argument {flag}: written after the workload (" in err and "before CONFIG and the key=value overrides" in err, err
    assert not submitted.exists() and os.listdir(work) == []
    # Before the workload the same flags are the launcher's.
    assert module.main([*lead, "--dry-run", "--no-validate", "trainer.steps=3"]) == 0
    assert "trainer.steps=3" in capsys.readouterr().out


def test_an_ssh_job_dir_holding_nemo_run_is_refused_like_the_base_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--executor", "slurm", "--ssh-host", "login1", "--gpus-per-node", "0", "--no-container", "--dry-run"]
    assert nemo_run_recipe.main([*argv, "--job-dir", "/home/me/nemo_run/jobs"]) == 2
    err = capsys.readouterr().err
    assert "'/home/me/nemo_run/jobs' holds '/nemo_run', which NeMo-Run's Slurm executor without a container rewrites" in err
    assert nemo_run_recipe.main([*argv, "--job-dir", "/home/me/jobs"]) == 0
    assert os.listdir(tmp_path) == []


def test_submitting_without_the_tools_says_what_to_do(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    assert slurm.main(["--nodes", "1", "--gpus-per-node", "1"]) == 2
    assert "sbatch is not on PATH: submit from a Slurm login node, or pass --dry-run" in capsys.readouterr().err
    if importlib.util.find_spec("nemo_run") is None:
        assert nemo_run_recipe.main(["--executor", "slurm", "--nodes", "2"]) == 2
        err = capsys.readouterr().err
        assert 'NeMo-Run is not installed: `pip install -e ".[nemo-run]"`' in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_slurm_time_formats():
    from recipes.arguments import parse_slurm_time

    assert [parse_slurm_time(t) for t in ("90", "90:30", "04:00:00", "1-12", "1-12:30", "2-00:30:00")] == [
        5400, 5430, 14400, 129600, 131400, 174600,
    ]
    for bad in ("", "banana", "1:2:3:4", "0", "-1", "1-", "01:60"):
        with pytest.raises(ValueError):
            parse_slurm_time(bad)


def test_the_usr1_trap_checkpoints_then_requeues(tmp_path):
    """Run the rendered batch script under bash with srun/scancel/scontrol standing in for Slurm's.

    The stand-ins record their arguments; ``srun`` sleeps like a running step and exits on the
    USR1 that ``scancel --signal=USR1`` passes to the step (as the trainer does after its
    checkpoint). The script must forward the signal, wait for the step, then requeue.
    """
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    from recipes.job import Job

    script = slurm.render_sbatch(Job(nodes=1, gpus_per_node=1, setup=""), signal_lead=60)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    stubs = {
        "srun": f'echo $$ > {tmp_path}/srun.pid; echo "srun started" >> {log}; '
                f'trap \'echo "step got USR1" >> {log}; exit 75\' USR1; while true; do sleep 0.05; done',
        "scancel": f'echo "scancel $*" >> {log}; kill -USR1 "$(cat {tmp_path}/srun.pid)"',
        "scontrol": f'if [ "$1" = show ]; then echo node0; else echo "scontrol $*" >> {log}; fi',
    }
    for name, body in stubs.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node0")
    proc = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (log.exists() and "srun started" in log.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@60 delivers to the batch shell
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    calls = log.read_text().splitlines()
    assert calls[1:] == ["scancel --signal=USR1 4242", "step got USR1", "scontrol requeue 4242"], calls
    assert "asking the run to checkpoint and stop (job 4242)" in out
