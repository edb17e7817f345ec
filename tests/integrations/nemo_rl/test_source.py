"""Against a NeMo-RL source tree: the patch applies, and NeMo-RL's own data path carries the rows.

Runs when ``NEMO_RL_SRC`` names a NeMo-RL checkout at commit 7ea279a (``git clone
https://github.com/NVIDIA-NeMo/RL && git -C RL checkout 7ea279a``); ``NEMO_RL_PYTHON`` names
a Python that imports NeMo-RL's data-path modules (default: this one): the environment
scripts/nemo_rl_env.sh builds (Ray, Hydra and the rest of NeMo-RL's driver packages; on Python
3.11 the check stands typing_extensions' TypedDict in for pydantic, pytest_plugins/
nemo_rl_cpu_shims.py). ``PYTHONPATH`` entries are kept after the patched copy and this
repository. The tree itself is never modified: its ``nemo_rl`` package is copied and patched
with the package's command.
"""

from __future__ import annotations

import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_replay.integrations.nemo_rl.patch import PATCHED_FILES, patch_state

NEMO_RL_SRC = os.environ.get("NEMO_RL_SRC")
REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(
    not NEMO_RL_SRC,
    reason="NEMO_RL_SRC is unset: point it at a NeMo-RL checkout at 7ea279a (and NEMO_RL_PYTHON at a Python that "
    "imports it) to run the checks against NeMo-RL's own code",
)


def _patch_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nemo_replay.integrations.nemo_rl.patch", *args], capture_output=True,
                          text=True, cwd=REPO)


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nemo_rl_tree")
    shutil.copytree(Path(NEMO_RL_SRC) / "nemo_rl", root / "nemo_rl", ignore=shutil.ignore_patterns("__pycache__"))
    assert _patch_cli("apply", str(root)).returncode == 0
    return root


def test_the_patch_applies_once_and_the_patched_modules_compile(patched_tree):
    assert patch_state(NEMO_RL_SRC) in ("pinned", "patched")  # the named tree is at the pinned commit
    check = _patch_cli("check", str(patched_tree))
    assert check.returncode == 0 and "replay patch applied" in check.stdout, check.stderr
    again = _patch_cli("apply", str(patched_tree))
    assert again.returncode == 0 and "already applied" in again.stdout, again.stderr
    for name in PATCHED_FILES:
        py_compile.compile(str(patched_tree / name), doraise=True)


def test_generation_support_through_nemo_rls_own_data_path(patched_tree):
    python = os.environ.get("NEMO_RL_PYTHON", sys.executable)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(patched_tree), str(REPO), *extra])}
    done = subprocess.run([python, "-m", "tests.integrations.nemo_rl.source_checks", str(patched_tree)], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1].startswith("ok"), done.stdout + done.stderr
