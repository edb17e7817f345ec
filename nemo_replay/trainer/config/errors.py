"""The one error a recipe raises: every problem at once (docs/design.md §8)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """Every problem of a recipe at once.

    Attributes:
        problems: one line per problem, each naming the flag and the fix.
    """

    def __init__(self, problems: Sequence[str], source: str = "recipe"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s) in the configuration:\n{lines}")
