"""What a checkpoint's files must be: size and SHA-256 of each, recorded on save, checked on load.

A checkpoint's ``complete.json`` says the save finished; it cannot say the bytes are still
the ones written. A flipped bit in a weight file loads without an error and trains on wrong
weights. So every file of the folder (each shard, ``.metadata`` and the rest; not
``complete.json`` itself) is listed in ``complete.json`` with its size and digest when the
checkpoint is written, and checked before a resume reads it (docs/design.md §10).

The work is split across the ranks of the run and across threads within a rank
(``hashlib`` releases the GIL while it hashes a large buffer): rank 0 lists the folder once,
each rank hashes the files :func:`share` gives it, and the results are gathered. A file is
read once for its digest; the loader then reads it again, from the page cache as a rule.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

__all__ = ["list_files", "share", "digest_files", "mismatch"]

_CHUNK = 4 << 20


def list_files(folder: Path, *, skip: str) -> list[tuple[str, int]]:
    """Every file under ``folder`` but ``skip`` (a name at its top), as (relative path, size), sorted."""
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and path.relative_to(folder).as_posix() != skip:
            found.append((path.relative_to(folder).as_posix(), path.stat().st_size))
    return sorted(found)


def share(files: list[tuple[str, int]], rank: int, world: int) -> list[str]:
    """The names of ``files`` rank ``rank`` of ``world`` hashes: largest first, each to the rank with
    the fewest bytes so far (the lowest rank on a tie). Every rank computes the same split."""
    load = [0] * world
    mine = []
    for name, size in sorted(files, key=lambda f: (-f[1], f[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += size
        if r == rank:
            mine.append(name)
    return mine


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def digest_files(folder: Path, names: list[str], threads: Optional[int] = None) -> dict[str, list]:
    """``{name: [size, sha256 hex]}`` of the files ``names`` under ``folder``, hashed on ``threads`` threads."""
    if not names:
        return {}
    threads = threads or min(8, os.cpu_count() or 1, len(names))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        results = pool.map(lambda n: _digest(folder / n), names)
        return {name: list(got) for name, got in zip(names, results)}


def mismatch(folder: Path, expected: dict, names: list[str]) -> Optional[str]:
    """Why the files ``names`` under ``folder`` are not those of ``expected`` (``{name: [size, hex]}``),
    the first failing name in order; None when they are. A missing or short file is told before
    any is hashed."""
    for name in names:
        path = folder / name
        size = expected[name][0]
        if not path.is_file():
            return f"{name} is missing (written with {size} bytes)"
        have = path.stat().st_size
        if have != size:
            return f"{name} has {have} bytes where {size} were written ({'truncated' if have < size else 'grown'})"
    got = digest_files(folder, names)
    for name in names:
        if got[name][1] != expected[name][1]:
            return f"{name} does not hold the bytes written (SHA-256 {got[name][1][:16]}... where {expected[name][1][:16]}... was recorded)"
    return None
