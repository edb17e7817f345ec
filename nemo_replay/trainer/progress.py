"""A run's progress on rank 0: a tqdm bar on a terminal, plain lines anywhere else.

A bar redraws itself in place with carriage returns. Written to a file or a pipe (``nemo-replay
train > log 2>&1``, a Slurm job's output) it becomes one line that grows by a whole frame per
step, about 80 KB for the default 150 steps. So when the stream is not a terminal the run
prints one line at round step numbers (about twenty a run) and at the last step, with the
figures the bar shows::

    GRPO fsdp replay-on: step 10/150 (4.1 s, 2.44 step/s) reward=0.041 mismatch=4.8e-07 kl=1.2e-03
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Optional, TextIO, Union

__all__ = ["Bar", "Lines", "figures", "line_every", "progress"]


def figures(metrics: dict) -> dict[str, str]:
    """The step's figures as both forms print them: reward, worst mismatch, KL."""
    return {
        "reward": f"{metrics['reward']:.3f}",
        "mismatch": f"{metrics['mismatch_max']:.1e}",
        "kl": f"{metrics.get('kl', float('nan')):.1e}",
    }


def line_every(total: int) -> int:
    """The step interval of the plain lines: the smallest of 1, 2, 5, 10, 20, 50, ... giving at most 20 lines."""
    return next(m * 10**e for e in itertools.count() for m in (1, 2, 5) if total <= 20 * m * 10**e)


class Bar:
    """A tqdm bar (on a terminal)."""

    def __init__(self, desc: str, total: int, initial: int, stream: TextIO):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=stream)

    def advance(self, metrics: dict) -> None:
        """One step done, with its metrics."""
        self.bar.update(1)
        self.bar.set_postfix(**figures(metrics))

    def close(self) -> None:
        self.bar.close()


class Lines:
    """One plain line every ``every`` steps and at the last (on a file or a pipe)."""

    def __init__(self, desc: str, total: int, initial: int, stream: TextIO, every: Optional[int] = None):
        self.desc, self.total, self.stream = desc, total, stream
        self.every = every or line_every(total)
        self.first = self.done = self.shown = initial
        self.start = time.monotonic()
        self.last: dict[str, str] = {}

    def advance(self, metrics: dict) -> None:
        """One step done, with its metrics; a line when the step is a round one or the last."""
        self.done += 1
        self.last = figures(metrics)
        if self.done % self.every == 0 or self.done == self.total:
            self._line()

    def close(self) -> None:
        """A last line when the run stopped between two round steps (a stop signal)."""
        if self.done > self.shown:
            self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self.start
        rate = (self.done - self.first) / elapsed if elapsed > 0 else float("nan")
        shown = " ".join(f"{k}={v}" for k, v in self.last.items())
        print(f"{self.desc}: step {self.done}/{self.total} ({elapsed:.1f} s, {rate:.3g} step/s) {shown}",
              file=self.stream, flush=True)
        self.shown = self.done


def progress(desc: str, total: int, initial: int = 0, stream: Optional[TextIO] = None) -> Union[Bar, Lines]:
    """A :class:`Bar` when ``stream`` (default: the current ``sys.stderr``) is a terminal, else :class:`Lines`."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    terminal = bool(isatty and isatty())
    return (Bar if terminal else Lines)(desc, total, initial, stream)
