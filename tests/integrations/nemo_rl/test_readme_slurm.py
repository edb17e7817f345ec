"""The README's NeMo-RL-on-Slurm command, checked against what it names.

What can be checked without a cluster: the command's launcher and recipe exist and parse as
the launcher parses them, ``COMMAND`` is single-quoted (``$PYTHONPATH`` is the container's),
and NeMo-RL's own ``ray.sub`` and ``docker/Dockerfile`` at 7ea279a (``../shared/
nemo-rl-7ea279a`` or ``NEMO_RL_SRC``) read the variables it sets, run ``COMMAND`` from the
submission folder, and make ``uv run`` use ``/opt/nemo_rl_venv``.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _slurm_block() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("On Slurm, with NeMo-RL's container")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    return block.group(1)


def test_the_slurm_command_names_what_exists_and_parses_as_the_launcher_parses_it():
    from nemo_replay.integrations.nemo_rl.run_grpo import parse_args

    block = _slurm_block()
    command = re.search(r"COMMAND='([^']*)'", block)
    assert command, block  # single quotes: nothing expands at submission
    words = shlex.split(command.group(1))
    assert words[0].startswith("PYTHONPATH=/path/to/nemo_replay:") and words[1:4] == ["uv", "run", "python"]
    assert words[4:6] == ["-m", "nemo_replay.integrations.nemo_rl.run_grpo"]
    __import__(words[5])
    config, overrides, check = parse_args(words[6:])
    assert Path(config).parent == Path("examples/configs") and not overrides and not check
    assert (ROOT / "configs" / "nemo_rl" / Path(config).name).is_file()  # the cp line copies it there
    assert f"cp /path/to/nemo_replay/configs/nemo_rl/{Path(config).name} examples/configs/" in block
    assert parse_args(words[6:] + ["--check"])[2] is True  # "add --check to the same command"
    assert 'MOUNTS="$PWD:$PWD,/path/to/nemo_replay:/path/to/nemo_replay"' in block


def test_nemo_rls_own_ray_sub_and_container_read_it_as_the_readme_says():
    src = Path(os.environ.get("NEMO_RL_SRC") or ROOT.parent / "shared" / "nemo-rl-7ea279a")
    if not (src / "ray.sub").is_file():
        pytest.skip(f"needs NeMo-RL's tree at 7ea279a: set NEMO_RL_SRC (looked in {src})")
    ray_sub = (src / "ray.sub").read_text()
    for line in ("CONTAINER=$CONTAINER", "MOUNTS=$MOUNTS", "COMMAND=${COMMAND:-}"):
        assert line in ray_sub
    assert "--container-workdir=$SLURM_SUBMIT_DIR" in ray_sub  # COMMAND runs from the checkout's root
    assert "BASE_LOG_DIR=${BASE_LOG_DIR:-$SLURM_SUBMIT_DIR}" in ray_sub  # logs beside the submission
    assert '"$LOG_DIR/ray-driver.log"' in ray_sub
    dockerfile = (src / "docker" / "Dockerfile").read_text()
    assert "ENV UV_PROJECT_ENVIRONMENT=/opt/nemo_rl_venv" in dockerfile
