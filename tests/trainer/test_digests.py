"""Checkpoint digests (nemo_replay/trainer/rundir/digests.py): blocks, the split across ranks, the
combined digest against a naive reference, and what a check reports."""

from __future__ import annotations

import hashlib

import pytest

from nemo_replay.trainer.rundir import digests


def naive(data: bytes, block: int) -> str:
    parts = [data[i:i + block] for i in range(0, len(data), block)] or [b""]
    return hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in parts)).hexdigest()


def test_the_worked_example_of_the_module_doc():
    mib = 1 << 20
    items = digests.blocks([("a", 150 * mib)])
    assert items == [("a", 0, 64 * mib), ("a", 64 * mib, 64 * mib), ("a", 128 * mib, 22 * mib)]
    assert digests.share(items, 0, 2) == [("a", 0, 64 * mib), ("a", 128 * mib, 22 * mib)]
    assert digests.share(items, 1, 2) == [("a", 64 * mib, 64 * mib)]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_block_is_hashed_once_across_ranks_and_combines_to_the_naive_digest(tmp_path, monkeypatch, world):
    monkeypatch.setattr(digests, "BLOCK", 8)
    sizes = {"empty": 0, "one": 1, "seven": 7, "eight": 8, "nine": 9, "sub/forty": 40, ".metadata": 17}
    for i, (name, size) in enumerate(sizes.items()):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(bytes((i * 31 + j * 7) % 256 for j in range(size)))
    (tmp_path / "complete.json").write_text("{}")
    files = digests.list_files(tmp_path, skip="complete.json")
    assert [n for n, _ in files] == sorted(sizes) and dict(files) == sizes
    items = digests.blocks(files)
    shares = [digests.share(items, r, world) for r in range(world)]
    assert sorted(b for s in shares for b in s) == sorted(items)  # each block on exactly one rank
    loads = [sum(b[2] for b in s) for s in shares]
    assert max(loads) - min(loads) <= 8  # balanced to within one block
    got = {}
    for s in shares:
        got.update(digests.block_digests(tmp_path, s, threads=2))
    combined = digests.combine(files, got)
    assert combined == {n: [size, naive((tmp_path / n).read_bytes(), 8)] for n, size in sizes.items()}
    assert digests.resized(tmp_path, combined) is None and digests.differs(combined, combined) is None


def test_a_check_names_the_missing_resized_or_altered_file(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100)
    (tmp_path / "b").write_bytes(b"y" * 10)
    files = digests.list_files(tmp_path, skip="complete.json")
    recorded = digests.combine(files, digests.block_digests(tmp_path, digests.blocks(files)))
    (tmp_path / "b").write_bytes(b"y" * 9)
    assert digests.resized(tmp_path, recorded) == "b has 9 bytes where 10 were written (truncated)"
    (tmp_path / "b").unlink()
    assert digests.resized(tmp_path, recorded) == "b is missing (written with 10 bytes)"
    (tmp_path / "b").write_bytes(b"y" * 10)
    (tmp_path / "a").write_bytes(b"x" * 50 + b"z" + b"x" * 49)
    now = digests.combine(files, digests.block_digests(tmp_path, digests.blocks(files)))
    assert digests.differs(recorded, now).startswith("a does not hold the bytes written (SHA-256 ")
