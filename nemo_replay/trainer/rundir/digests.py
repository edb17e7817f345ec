"""What a checkpoint's files must be: size and digest of each, recorded on save, checked on load.

A checkpoint's ``complete.json`` says the save finished; it cannot say the bytes are still
the ones written. A flipped bit in a weight file loads without an error and trains on wrong
weights. So every file of the folder (each shard, ``.metadata`` and the rest; not
``complete.json`` itself) is listed in ``complete.json`` with its size and digest when the
checkpoint is written, and checked before a resume reads it (docs/design.md §10).

A file's digest is the SHA-256 of the SHA-256 digests of its :data:`BLOCK`-byte blocks, in
order (an empty file: of nothing), so that one large file is hashed in parallel too: the
blocks of every file are split across the ranks of the run (:func:`share`, the same split on
every rank) and across threads within a rank (``hashlib`` releases the GIL while it hashes a
large buffer), and the block digests are gathered. Each byte is read once for its digest;
the loader reads it again, from the page cache as a rule.

Worked example: a 150 MiB file is three blocks, ``(name, 0, 64 MiB)``, ``(name, 64 MiB,
64 MiB)``, ``(name, 128 MiB, 22 MiB)``; on two ranks rank 0 hashes the first and the third,
rank 1 the second; the file's digest is ``sha256(d0 + d1 + d2)``.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

__all__ = ["BLOCK", "list_files", "blocks", "share", "block_digests", "combine", "resized", "unlisted", "differs"]

#: Bytes per hashed block.
BLOCK = 64 << 20
_READ = 4 << 20


def list_files(folder: Path, *, skip: str) -> list[tuple[str, int]]:
    """Every file under ``folder`` but ``skip`` (a name at its top), as (relative path, size), sorted."""
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and path.relative_to(folder).as_posix() != skip:
            found.append((path.relative_to(folder).as_posix(), path.stat().st_size))
    return sorted(found)


def blocks(files: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """The (name, offset, length) blocks of ``files``; an empty file is one block of length 0."""
    return [(name, at, min(BLOCK, size - at)) for name, size in files for at in (range(0, size, BLOCK) if size else (0,))]


def share(items: list[tuple[str, int, int]], rank: int, world: int) -> list[tuple[str, int, int]]:
    """The blocks rank ``rank`` of ``world`` hashes: longest first, each to the rank with the fewest
    bytes so far (the lowest rank on a tie). Every rank computes the same split."""
    load = [0] * world
    mine = []
    for item in sorted(items, key=lambda b: (-b[2], b[0], b[1])):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += item[2]
        if r == rank:
            mine.append(item)
    return mine


def _block_digest(folder: Path, item: tuple[str, int, int]) -> str:
    name, at, length = item
    h = hashlib.sha256()
    buf = bytearray(min(_READ, max(length, 1)))
    view = memoryview(buf)
    with open(folder / name, "rb", buffering=0) as f:
        f.seek(at)
        left = length
        while left:
            n = f.readinto(view[: min(left, len(buf))])
            if not n:
                raise OSError(f"{name} ended {left} bytes before its block at {at} + {length} (truncated while read)")
            h.update(view[:n])
            left -= n
    return h.hexdigest()


def block_digests(folder: Path, items: list[tuple[str, int, int]], threads: Optional[int] = None) -> dict:
    """``{(name, offset): sha256 hex}`` of the blocks ``items`` under ``folder``, on ``threads`` threads."""
    if not items:
        return {}
    threads = threads or min(8, os.cpu_count() or 1, len(items))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return {(name, at): hexd for (name, at, _), hexd in zip(items, pool.map(lambda b: _block_digest(folder, b), items))}


def combine(files: list[tuple[str, int]], digests: dict) -> dict[str, list]:
    """``{name: [size, digest]}`` from every block's digest (module doc)."""
    out = {}
    for name, size in files:
        h = hashlib.sha256()
        for _, at, _ in blocks([(name, size)]):
            h.update(bytes.fromhex(digests[(name, at)]))
        out[name] = [size, h.hexdigest()]
    return out


def resized(folder: Path, expected: dict) -> Optional[str]:
    """The first file of ``expected`` (``{name: [size, digest]}``) missing or of another size under ``folder``."""
    for name, (size, _) in sorted(expected.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing (written with {size} bytes)"
        have = path.stat().st_size
        if have != size:
            return f"{name} has {have} bytes where {size} were written ({'truncated' if have < size else 'grown'})"
    return None


def unlisted(folder: Path, expected: dict, *, skip: str) -> Optional[str]:
    """The first file under ``folder`` (but ``skip``) that ``expected`` does not list, or the first
    listed one that is reached through a link out of ``folder``; None when there is neither."""
    for name, _ in list_files(folder, skip=skip):
        if name not in expected:
            return f"{name} is not listed in {skip} (a file the checkpoint was not written with)"
    root = folder.resolve()
    for name in sorted(expected):
        if not (folder / name).resolve().is_relative_to(root):
            return f"{name} leads out of the checkpoint's folder (a link): only the folder's own files are read"
    return None


def differs(expected: dict, got: dict) -> Optional[str]:
    """The first file whose digest in ``got`` is not the one ``expected`` records, or None."""
    for name in sorted(expected):
        if got[name][1] != expected[name][1]:
            return (f"{name} does not hold the bytes written (SHA-256 {got[name][1][:16]}... where "
                    f"{expected[name][1][:16]}... was recorded)")
    return None
