"""The README's Quick start: its two commands, the one CI runs, and the counts it states."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def _quick_start_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", _section("Quick start"), re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_quick_start_is_two_commands_and_ci_runs_the_second():
    main_job, tests = _quick_start_commands()
    assert main_job.endswith("&& nemo-replay train")
    assert main_job.split(" && ")[0] == tests.split(" && ")[0]  # one install for both
    ci = (ROOT / ".ci" / "run").read_text()
    start = ci.index("start=$SECONDS")
    first_phase = ci[start:ci.index('phase "', start)]
    assert tests in first_phase.splitlines(), "the README's test command is .ci/run's first phase"


def test_stated_counts_add_up_and_the_measurements_page_exists():
    section = _section("Quick start")
    skipped = int(re.search(r"Skipped \((\d+);", section).group(1))
    assert f"passed, {skipped} skipped`" in section
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith(("| tests", "| ---"))]
    assert sum(int(re.match(r"\| (\d+)", row).group(1)) for row in rows) == skipped
    deselected = int(re.search(r"Deselected \((\d+)\)", section).group(1))
    bullets = re.findall(r"^- (\d+) marked", section, re.M)
    assert sum(map(int, bullets)) == deselected and f"{deselected} more are deselected" in section
    assert "docs/measurements.md" in section and (ROOT / "docs" / "measurements.md").is_file()
