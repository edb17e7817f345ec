"""``bash scripts/gpu_check.sh`` in its dry mode (no CUDA here): every phase runs on the CPU, the
wheel install from a local folder included, and the results land as at most 8 files, so that
the command a GPU machine gets is never one that has rotted since the last GPU run."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (one module), as pip installs it."""
    name = "gpu_check_probe"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "VALUE = 7\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{name}.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry mode runs where CUDA is absent")
def test_the_gpu_check_runs_every_phase_in_its_dry_mode(tmp_path):
    wheels, out, site = tmp_path / "wheels", tmp_path / "out", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels)
    env = dict(os.environ, OUT=str(out), WHEELS=str(wheels), SITE=str(site), OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("mode: dry")
    for phase in ("machine", "install", "tests", "train", "bench"):
        assert f"\n{phase}: rc 0, " in summary, (phase, summary)
    assert (site / "gpu_check_probe.py").is_file()  # installed from the local folder, no index
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"summary.txt", "nvidia-smi.txt", "pytest-gpu.log", "train-metrics.jsonl",
                                 "benchmarks-gpu.md"} <= set(files), files
    assert " skipped" in (out / "pytest-gpu.log").read_text()  # the gpu checks are collected, and skip here
    rows = [json.loads(line) for line in (out / "train-metrics.jsonl").read_text().splitlines()]
    assert [r["row"]["step"] for r in rows] == [0, 1] and {r["strategy"] for r in rows} == {"fsdp"}
    assert "## GPU" in (out / "benchmarks-gpu.md").read_text()
    # Without OUT it writes to a new temporary folder and says where.
    env.pop("OUT")
    env["GPU_CHECK_LIMIT_S"] = "10"  # every phase skipped for time: only the messages are checked
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    first = done.stdout.splitlines()[0]
    assert first.startswith("gpu_check: OUT is unset; writing the results to "), done.stdout
    where = Path(first.rsplit(" ", 1)[1])
    assert (where / "summary.txt").is_file() and "skipped" in (where / "summary.txt").read_text()
