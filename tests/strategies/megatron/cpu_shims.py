"""Test-only shims that let megatron-core's GPTModel run on CPU under gloo.

Megatron-core touches CUDA in four places the CPU tests reach:

- ``torch.cuda.current_device()`` names the device of megatron's global memory buffer and
  of a few scratch tensors; on CPU it must name the CPU device.
- the CUDA RNG tracker's ``fork()`` swaps CUDA generator states around dropout and weight
  initialisation; on CPU it becomes a no-op context (the tests use dropout 0 and load
  their weights explicitly).
- the pipeline schedules create their token counter with a literal ``device="cuda"``
  (``schedules.py``: ``torch.zeros([], dtype=torch.int, device="cuda")``); a torch-function
  mode maps an explicit CUDA device argument of tensor factories to the CPU.
- ``dist_checkpointing.save`` calls ``torch.cuda.synchronize()`` unconditionally after
  staging tensors on the host (``strategies/filesystem_async.py``, ``preload_tensors``);
  on CPU there is nothing to wait for, so it returns at once.

Nothing else is replaced: process groups, layers and schedules are megatron-core's own.
Call :func:`install_cpu_shims` at the top of every spawned worker before building a model.

MoE without Transformer Engine. megatron-core 0.16.1 binds ``te_general_gemm`` in
``transformer/moe/moe_utils.py`` only inside its ``try: import transformer_engine`` block,
yet ``RouterGatingLinearFunction.forward`` (moe_utils.py line 1192) reads it
unconditionally (``if te_general_gemm is not None and ...``). Without Transformer Engine
every MoE router forward therefore raises ``NameError: name 'te_general_gemm' is not
defined`` -- on CPU and GPU alike. :func:`install_moe_without_te_shim` binds the name to
``None``, the value that very check expects, so the router takes its plain
``torch.mm`` path. (The ``alltoall`` token dispatcher also needs ``torch.cuda.Stream``;
the tests use the ``allgather`` dispatcher.)
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` keyword arguments to the CPU; everything else passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device=torch.device("cpu"))
        return func(*args, **kwargs)


def install_cpu_shims() -> None:
    """Apply the four shims in this process (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = lambda: torch.device("cpu")

    def _fork(self, name=None):
        return contextlib.nullcontext()

    mp_random.CudaRNGStatesTracker.fork = _fork
    torch.cuda.synchronize = lambda device=None: None
    # Entered for the life of the (spawned, single-purpose) worker process.
    _CudaFactoriesOnCpu().__enter__()
    _INSTALLED = True


def install_moe_without_te_shim() -> None:
    """Bind megatron's missing ``moe_utils.te_general_gemm`` to None when TE is absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
