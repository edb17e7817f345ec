"""Launcher arguments, each checked where it is parsed: one-line errors, exit status 2.

Everything the launchers put into a batch script or a submission is checked before
anything is written: counts are positive integers, the port is a TCP port, the time limit
is one of Slurm's formats, names and paths carry no shell syntax, each mount is
``SRC:DST[:FLAGS]`` with an absolute ``DST``. A failed check prints one line naming the
flag, what came and the fix, and exits 2 (:class:`LauncherParser`); no traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

__all__ = [
    "LauncherParser",
    "positive_int",
    "count",
    "port",
    "slurm_time",
    "parse_slurm_time",
    "name",
    "partition",
    "image",
    "abs_path",
    "mounts",
    "signal_lead",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_PARTITION = re.compile(r"^[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*$")
_IMAGE = re.compile(r"^[A-Za-z0-9._/:@#+~-]+$")
_PATH = re.compile(r"^[A-Za-z0-9._/@%+=~-]+$")
_FLAGS = re.compile(r"^[a-z+]+$")


class LauncherParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``prog: message``) and exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _count_at_least(text: str, low: int, example: str) -> int:
    fix = f"give a count >= {low}, e.g. {example}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; {fix}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} must be >= {low}; {fix}")
    return value


def positive_int(text: str) -> int:
    return _count_at_least(text, 1, "2")


def count(text: str) -> int:
    """A count that may be 0 (``--gpus-per-node 0``: a CPU job)."""
    return _count_at_least(text, 0, "8 (0 for a CPU job)")


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port; give an integer in [1024, 65535], e.g. 29500") from None
    if not 1024 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a usable TCP port; give an integer in [1024, 65535], e.g. 29500")
    return value


_TIME_FORMS = "MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES or DAYS-HOURS:MINUTES:SECONDS"


def parse_slurm_time(text: str) -> int:
    """Seconds in a Slurm time limit (``sbatch --time`` formats); ValueError otherwise.

    Worked examples: ``90`` -> 5400 (minutes), ``90:30`` -> 5430 (minutes:seconds),
    ``04:00:00`` -> 14400, ``1-12`` -> 129600 (days-hours), ``2-00:30:00`` -> 174600.
    """
    m = re.fullmatch(r"(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?", text)
    if m:
        days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
        sub = (minutes, seconds)
    else:
        parts = text.split(":")
        if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"{text!r} is not a Slurm time limit; write {_TIME_FORMS} (e.g. 04:00:00)")
        values = [int(p) for p in parts]
        days = 0
        if len(values) == 1:
            hours, minutes, seconds = 0, values[0], 0
            sub = ()
        elif len(values) == 2:
            hours, (minutes, seconds) = 0, values
            sub = (seconds,)
        else:
            hours, minutes, seconds = values
            sub = (minutes, seconds)
    if any(v >= 60 for v in sub):
        raise ValueError(f"{text!r}: minutes and seconds after a colon must be < 60; e.g. 04:30:00")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise ValueError(f"{text!r} is a zero time limit; give the run some time, e.g. 04:00:00")
    return total


def slurm_time(text: str) -> str:
    try:
        parse_slurm_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def signal_lead(text: str) -> int:
    """Seconds before the time limit the run is signalled (Slurm takes 0..65535)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds; e.g. 300") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} must be in [1, 65535] seconds (Slurm's range); e.g. 300")
    return value


def name(text: str) -> str:
    if not _NAME.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} may hold only letters, digits and . _ + - (starting with a letter or digit); e.g. nemo-replay"
        )
    return text


def partition(text: str) -> str:
    if not _PARTITION.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Slurm name (letters, digits, . _ -; comma-separated list)")
    return text


def image(text: str) -> str:
    if not _IMAGE.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a container image reference (e.g. nvcr.io/nvidia/pytorch:25.01-py3, nvcr.io#nvidia/pytorch:25.01-py3 "
            f"or /path/image.sqsh); no spaces or shell syntax"
        )
    return text


def abs_path(text: str) -> str:
    if not (text.startswith("/") and _PATH.match(text)):
        raise argparse.ArgumentTypeError(
            f"{text!r} must be an absolute path without spaces or shell syntax, e.g. /workspace/nemo_replay"
        )
    return text


def mounts(text: str) -> list[str]:
    """``SRC:DST[:FLAGS],...`` (pyxis ``--container-mounts``) -> the list of mounts."""
    out = []
    for item in (m for m in text.split(",") if m):
        fields = item.split(":")
        example = "e.g. /lustre/data:/data or $PWD:/workspace/nemo_replay"
        if len(fields) not in (2, 3):
            raise argparse.ArgumentTypeError(f"mount {item!r} is not SRC:DST or SRC:DST:FLAGS; {example}")
        src, dst = fields[0], fields[1]
        if not src or not _PATH.match(src):
            raise argparse.ArgumentTypeError(
                f"mount {item!r}: source {src!r} must be a path without spaces or shell syntax (expand variables first); {example}"
            )
        if not (dst.startswith("/") and _PATH.match(dst)):
            raise argparse.ArgumentTypeError(f"mount {item!r}: destination {dst!r} must be an absolute path; {example}")
        if len(fields) == 3 and not _FLAGS.match(fields[2]):
            raise argparse.ArgumentTypeError(f"mount {item!r}: flags {fields[2]!r} must be pyxis mount flags such as ro or rw")
        out.append(item)
    return out
