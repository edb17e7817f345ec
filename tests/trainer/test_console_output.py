"""What `nemo-replay train` prints around its steps: plain progress lines off a terminal, no srun hint."""

from __future__ import annotations

import io
import os
import re
import warnings

from nemo_replay.cli import main
from nemo_replay.trainer.progress import Bar, Lines, line_every, progress
from tests.trainer.tiny import tiny

METRICS = {"reward": 0.25, "mismatch_max": 4.8e-7, "kl": 1.2e-3}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_the_run_prints_plain_lines_not_a_bar(tmp_path, capsys):
    """capsys's stderr is no terminal, as a file or a pipe is not."""
    assert main(["train", *tiny(tmp_path, "trainer.progress_bar=true", steps=3)]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("GRPO fsdp replay-on:")]
    assert [re.search(r"step (\d+/\d+)", line).group(1) for line in lines] == ["1/3", "2/3", "3/3"]
    assert all(re.search(r"step/s\) reward=\S+ mismatch=\S+ kl=\S+$", line) for line in lines), lines


def test_plain_lines_come_at_round_steps_the_last_and_where_a_run_stopped():
    assert [line_every(n) for n in (3, 20, 21, 150, 1000, 1001)] == [1, 1, 2, 10, 50, 100]
    out = io.StringIO()
    lines = progress("GRPO fsdp replay-on", 150, stream=out)
    assert isinstance(lines, Lines)
    for _ in range(150):
        lines.advance(METRICS)
    lines.close()
    steps = re.findall(r"step (\d+)/150", out.getvalue())
    assert steps == [str(n) for n in range(10, 151, 10)]
    # A resumed run counts from its checkpoint; a stop between round steps still gets its line.
    out = io.StringIO()
    lines = progress("GRPO fsdp replay-on", 150, initial=100, stream=out)
    for _ in range(17):
        lines.advance(METRICS)
    lines.close()
    assert re.findall(r"step (\d+)/150", out.getvalue()) == ["110", "117"]
    assert "reward=0.250 mismatch=4.8e-07 kl=1.2e-03" in out.getvalue()


def test_on_a_terminal_the_run_keeps_its_bar():
    out = Terminal()
    bar = progress("GRPO fsdp replay-on", 3, stream=out)
    assert isinstance(bar, Bar)
    bar.advance(METRICS)
    bar.close()
    assert "\r" in out.getvalue() and "1/3" in out.getvalue() and "reward=0.250" in out.getvalue()


def test_an_srun_on_path_prints_no_srun_hint_for_a_run_srun_did_not_start(tmp_path, monkeypatch, capsys):
    """Lightning warns on every Fabric it builds while an `srun` is on PATH and did not start the process."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name in ("SLURM_NTASKS", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        SLURMEnvironment._validate_srun_used()
    assert any("`srun` command is available" in str(w.message) for w in seen)  # the fake srun is seen

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["train", *tiny(tmp_path / "run", steps=1)]) == 0
    assert not [str(w.message) for w in seen if "srun" in str(w.message)]
    assert "srun" not in capsys.readouterr().err
