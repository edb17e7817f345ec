"""What checkpoint digests cost, as ratios to the save and the load they guard.

    python -m benchmarks.checkpoint                 # a 256 MiB and a 1 GiB state, one process
    python -m benchmarks.checkpoint --mib 64        # one size

The state is an AdamW optimizer over linear layers (weights plus two moments: three times the
parameters), written with Lightning Fabric's single-file save, the reference trainer's format
on one device. Timed, each the median of ``--repeats`` runs: the save, the digests of the
written folder (``trainer/rundir/digests.py``: 64 MiB blocks on the threads a save uses), the check
before a load (sizes, then digests), and the load. The files are read from the page cache, as
right after a save; a cold read would cost the save and the load alike.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.machine import median_ms

__all__ = ["main"]


def _state(mib: int):
    import torch

    params = mib * 2**20 // 4 // 3  # float32 weights and Adam's two moments
    width = 1024
    layers = max(1, params // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def _median(fn, repeats: int) -> float:
    return median_ms(fn, repeats=repeats, warmup=0) / 1e3


def measure(mib: int, repeats: int) -> dict:
    from lightning.fabric import Fabric

    from nemo_replay.trainer.rundir import digests
    from nemo_replay.trainer.rundir.checkpoint import MANIFEST, state_format

    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer = _state(mib)
    fmt = state_format(model)  # the format the trainer's Checkpointer uses for this model
    assert fmt.name == "fabric", fmt.name
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        folder.mkdir()
        save = _median(lambda: fmt.save(fabric, folder, model, optimizer, {"step": 0}), repeats)
        files = digests.list_files(folder, skip=MANIFEST)
        size = sum(n for _, n in files)
        items = digests.blocks(files)
        digest = _median(lambda: digests.combine(files, digests.block_digests(folder, items)), repeats)
        recorded = digests.combine(files, digests.block_digests(folder, items))

        def check_files():
            assert digests.resized(folder, recorded) is None
            assert digests.differs(recorded, digests.combine(files, digests.block_digests(folder, items))) is None

        check = _median(check_files, repeats)
        load = _median(lambda: fmt.load(fabric, folder, model, optimizer), repeats)
    return {"MiB": size / 2**20, "save_s": save, "digest_s": digest, "check_s": check, "load_s": load,
            "GB/s": size / digest / 1e9}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, action="append", help="state size in MiB (repeatable); default 256 and 1024")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print("| state | save | digests | digests / save | check before load | load | check / load | hash rate |")
    print("|---|---|---|---|---|---|---|---|")
    for mib in args.mib or (256, 1024):
        r = measure(mib, args.repeats)
        print(f"| {r['MiB']:.0f} MiB | {r['save_s']:.3f} s | {r['digest_s']:.3f} s | {r['digest_s'] / r['save_s']:.2f} | "
              f"{r['check_s']:.3f} s | {r['load_s']:.3f} s | {r['check_s'] / r['load_s']:.2f} | {r['GB/s']:.2f} GB/s |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
