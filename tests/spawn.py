"""Run a function in real processes joined by a process group.

    results = run_workers(fn, world_size, *args)                  # gloo, CPU tensors
    results = run_workers(fn, world_size, *args, device="cuda")   # NCCL, one GPU per rank
    a, b = start_workers(f, 1), start_workers(g, 2)               # two groups side by side
    ra, rb = a.results(), b.results()

CPU ranks are forked from the test process, GPU ranks spawned (``fn(rank, world_size, *args)``
must then be a module-level function: it is pickled by name).
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
# CPU ranks are forked: they start with this process's imports (torch, transformers, megatron-core)
# instead of importing them again. CUDA cannot be initialised in a forked child, so GPU ranks spawn.
START_METHODS = {"cpu": "fork", "cuda": "spawn"}


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


class Workers:
    """Ranks started by :func:`start_workers`; :meth:`results` waits for them."""

    def __init__(self, fn, world_size: int, args: tuple, device: str):
        if device not in BACKENDS:
            raise ValueError(f"device must be one of {sorted(BACKENDS)}, got {device!r}")
        if device == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"{world_size} NCCL ranks need {world_size} CUDA devices, found {torch.cuda.device_count()}")
        self.world_size, self._dir = world_size, tempfile.TemporaryDirectory()
        self._ranks = mp.start_processes(_worker, args=(fn, world_size, free_port(), self._dir.name, args, device),
                                         nprocs=world_size, join=False, start_method=START_METHODS[device])

    def results(self) -> list:
        """Each rank's return value, by rank; a ``RuntimeError`` carrying the ranks' tracebacks if one failed."""
        out_dir = self._dir.name
        try:
            try:
                while not self._ranks.join():
                    pass
            except Exception as exc:
                errs = [open(os.path.join(out_dir, n)).read() for n in sorted(os.listdir(out_dir)) if n.endswith(".err")]
                raise RuntimeError("distributed worker failed:\n" + "\n".join(errs)) from exc
            return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(self.world_size)]
        finally:
            self._dir.cleanup()


def start_workers(fn, world_size: int, *args, device: str = "cpu") -> Workers:
    """Start ``world_size`` ranks running ``fn`` (gloo on CPU, NCCL on CUDA) without waiting for them.

    Start every group from the main thread, then wait: two groups forked at once from two
    threads made a rank exit 1 without reaching its own error handling (seen with the
    trainer's shared runs); started one after the other from one thread they run side by side.
    """
    return Workers(fn, world_size, args, device)


def run_workers(fn, world_size: int, *args, device: str = "cpu"):
    """Run ``world_size`` ranks of ``fn`` (gloo on CPU, NCCL on CUDA); return their results by rank."""
    return start_workers(fn, world_size, *args, device=device).results()
