"""Run a function in real spawned processes joined by a gloo process group.

    results = run_workers(fn, world_size, *args)   # list of fn's return values, by rank

``fn(rank, world_size, *args)`` must be a module-level function (it is pickled by name).
Its return value is saved with ``torch.save`` and loaded back, so return tensors or plain
containers of them. A free TCP port on loopback is picked at run time.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, world_size, port, out_dir, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_workers(fn, world_size: int, *args):
    """Spawn ``world_size`` gloo ranks running ``fn``; return their results by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.spawn(_worker, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size, join=True)
        except Exception as exc:
            errs = [
                open(os.path.join(out_dir, name)).read()
                for name in sorted(os.listdir(out_dir))
                if name.endswith(".err")
            ]
            raise RuntimeError("distributed worker failed:\n" + "\n".join(errs)) from exc
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
