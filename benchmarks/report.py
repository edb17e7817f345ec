"""Plain-text and markdown tables for the benchmark results."""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["Table", "fmt_ms", "fmt_ratio", "fmt_mib", "fmt_rate"]


def fmt_ms(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def fmt_ratio(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3f}" if v < 0.1 else f"{v:.2f}"


def fmt_mib(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return f"{v / (1 << 20):.0f}"


def fmt_rate(v: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if v >= scale:
            return f"{v / scale:.1f} {prefix}{unit}"
    return f"{v:.0f} {unit}"


class Table:
    """Rows of strings with a header; renders as markdown or aligned text."""

    def __init__(self, title: str, header: Sequence[str], note: str = ""):
        self.title, self.header, self.note = title, list(header), note
        self.rows: list[list[str]] = []

    def add(self, *cells) -> None:
        assert len(cells) == len(self.header), (cells, self.header)
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        if self.note:
            lines += [self.note, ""]
        lines.append("| " + " | ".join(self.header) + " |")
        lines.append("|" + "|".join("---" for _ in self.header) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines) + "\n"

    def text(self) -> str:
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) if self.rows else len(h) for i, h in enumerate(self.header)]
        out = [self.title, "  ".join(h.ljust(w) for h, w in zip(self.header, widths))]
        out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in self.rows]
        return "\n".join(out) + "\n"
