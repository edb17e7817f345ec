"""compare.png read back from its matplotlib figure: what each panel's legend says and where it sits."""

from __future__ import annotations

import math

import pytest

from nemo_replay.trainer.compare import compare_panels
from nemo_replay.trainer.loggers.metrics import PLOTTED, draw_runs

pytest.importorskip("matplotlib")

TITLES = {key: title for key, title, _ in PLOTTED}
GAPS = ["replay on: the hf engine's numeric gap", "replay off: normalisation + numeric gap"]


def _rows(steps: int, replay: bool) -> list[dict]:
    """Rows shaped like the two runs' metrics.jsonl: replay off has no support mass nor gap."""
    rows = []
    for i in range(steps):
        row = {
            "step": i, "reward": 0.1 + 0.01 * i, "mismatch_mean": 1e-7 if replay else 0.8 - 0.01 * i,
            "mismatch_max": 2e-6 if replay else 1.2, "ratio_max_dev": 5e-7 if replay else 0.7,
            "kl": 0.02 * i, "clip_fraction": 0.01 * (i % 3), "loss": 0.001 * math.sin(i),
        }
        if replay:
            row.update(support_mass_mean=0.3 + 0.01 * i, normalisation_gap_mean=0.8 - 0.01 * i)
        rows.append(row)
    return rows


@pytest.fixture
def figure():
    import matplotlib.pyplot as plt

    runs, legends = compare_panels({"engine": "hf"}, _rows(30, True), _rows(30, False))
    fig = draw_runs(runs, "replay on vs off", legends)
    fig.canvas.draw()
    yield fig
    plt.close(fig)


def _legends(fig) -> dict[str, list[str]]:
    """Each visible panel's title and its legend's texts."""
    return {
        ax.get_title(): [t.get_text() for t in ax.get_legend().get_texts()]
        for ax in fig.axes if ax.get_visible()
    }


def test_each_panels_legend_names_what_that_panel_shows(figure):
    legends = _legends(figure)
    assert legends[TITLES["mismatch_mean"]] == [*GAPS, "normalisation gap alone (-log support mass)"]
    assert legends[TITLES["mismatch_max"]] == GAPS
    for key in ("reward", "ratio_max_dev", "kl", "clip_fraction", "loss"):
        assert legends[TITLES[key]] == ["replay on", "replay off"], key
    assert legends[TITLES["support_mass_mean"]] == ["replay on"]  # replay off logs no support mass
    gap_panels = {TITLES["mismatch_mean"], TITLES["mismatch_max"]}
    assert not any("gap" in text for title, texts in legends.items() if title not in gap_panels for text in texts)


def test_no_legend_covers_a_panel(figure):
    """Every legend lies outside every panel's axes, and inside the figure (nothing cut off)."""
    panels = [ax for ax in figure.axes if ax.get_visible()]
    assert len(panels) == len(PLOTTED)
    for ax in panels:
        box = ax.get_legend().get_window_extent()
        assert figure.bbox.x0 <= box.x0 and box.x1 <= figure.bbox.x1 and figure.bbox.y0 <= box.y0, ax.get_title()
        for other in panels:
            assert not box.overlaps(other.get_window_extent()), (ax.get_title(), other.get_title())


def test_a_single_run_has_no_legend():
    import matplotlib.pyplot as plt

    fig = draw_runs([("replay on", _rows(5, True))], "one run")
    assert all(ax.get_legend() is None for ax in fig.axes)
    plt.close(fig)
