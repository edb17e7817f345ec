"""Run a function in real spawned processes joined by a process group.

    results = run_workers(fn, world_size, *args)                  # gloo, CPU tensors
    results = run_workers(fn, world_size, *args, device="cuda")   # NCCL, one GPU per rank

``fn(rank, world_size, *args)`` must be a module-level function (it is pickled by name).
Its return value is saved with ``torch.save`` and loaded back, so return tensors or plain
containers of them (CUDA tensors come back on the CPU). A free TCP port on loopback is
picked at run time.

The backend follows the device the test's tensors live on: gloo for ``"cpu"``, NCCL for
``"cuda"`` (each rank on ``cuda:rank``). :func:`devices` parametrizes a test over the CPU
and, where CUDA is present, the GPU (that case carries the ``gpu`` marker, which
``tests/conftest.py`` skips on machines without CUDA).
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def devices(min_gpus: int = 1) -> list:
    """``["cpu", "cuda"]`` as pytest params; the CUDA one is ``gpu``-marked and needs ``min_gpus`` devices."""
    need = pytest.mark.skipif(
        torch.cuda.device_count() < min_gpus, reason=f"needs {min_gpus} CUDA device(s)"
    )
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, need])]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_cpu(result):
    if isinstance(result, torch.Tensor):
        return result.cpu()
    if isinstance(result, dict):
        return {k: _to_cpu(v) for k, v in result.items()}
    if isinstance(result, (list, tuple)):
        return type(result)(_to_cpu(v) for v in result)
    return result


def _worker(rank, fn, world_size, port, out_dir, args, device):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(BACKENDS[device], rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    try:
        result = fn(rank, world_size, *args)
        torch.save(_to_cpu(result), os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_workers(fn, world_size: int, *args, device: str = "cpu"):
    """Spawn ``world_size`` ranks running ``fn`` (gloo on CPU, NCCL on CUDA); return their results by rank."""
    if device not in BACKENDS:
        raise ValueError(f"device must be one of {sorted(BACKENDS)}, got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"{world_size} NCCL ranks need {world_size} CUDA devices, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.spawn(_worker, args=(fn, world_size, free_port(), out_dir, args, device), nprocs=world_size, join=True)
        except Exception as exc:
            errs = [
                open(os.path.join(out_dir, name)).read()
                for name in sorted(os.listdir(out_dir))
                if name.endswith(".err")
            ]
            raise RuntimeError("distributed worker failed:\n" + "\n".join(errs)) from exc
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
