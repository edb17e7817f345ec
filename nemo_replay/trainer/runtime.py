"""Process setup of a run: Lightning Fabric launch, the backend, the output folder.

Three ways to start, one code path:

- a plain ``nemo-replay train``: ``trainer.devices * trainer.num_nodes`` processes; with more
  than one, Fabric launches the extra local processes itself;
- ``torchrun`` (or Slurm ``srun`` + torchrun): the process count comes from ``WORLD_SIZE`` /
  ``LOCAL_WORLD_SIZE`` and Fabric joins the rendezvous torchrun set up;
- a caller that already initialised ``torch.distributed`` (spawned test workers): Fabric
  reuses that process group.

A process group (gloo on CPU, nccl on GPU) exists whenever the world has more than one
rank or the strategy's spec says it needs one (megatron-core does even for a single rank).
It is launched through Fabric's ``ModelParallelStrategy``, whose ``save`` / ``load`` write
FSDP2 (DTensor) models as sharded torch distributed checkpoints
(:mod:`nemo_replay.trainer.rundir.checkpoint`); the trainer applies its own parallelism, so the
strategy's ``parallelize_fn`` is never called.

Collective timeout. A group the run creates waits ``trainer.collective_timeout_s`` for a
collective before failing (:func:`collective_timeout`); the backends' subgroups take the
same value. A group the caller initialised keeps the timeout it was created with.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from nemo_replay.trainer.config.schema import RecipeConfig
from nemo_replay.strategies.registry import get_strategy

__all__ = ["launch_fabric", "make_backend", "process_counts", "seed_all", "collective_timeout", "SRUN_NOT_USED"]

#: The start of Lightning's warning that an ``srun`` on PATH did not start this process
#: (``SLURMEnvironment._validate_srun_used``), as a ``warnings`` filter's message pattern.
SRUN_NOT_USED = r"The `srun` command is available on your system but is not used"


def collective_timeout(cfg: RecipeConfig) -> timedelta:
    """``trainer.collective_timeout_s`` as the ``timeout`` of ``init_process_group`` / ``new_group``."""
    return timedelta(seconds=float(cfg.trainer.collective_timeout_s))


def process_counts(cfg: RecipeConfig) -> tuple[int, int]:
    """(devices per node, nodes) of this run, from torchrun's variables, an existing group, or the recipe."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    world = os.environ.get("WORLD_SIZE")
    if local and world and "TORCHELASTIC_RUN_ID" in os.environ:
        return int(local), max(1, int(world) // int(local))
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), 1
    return cfg.trainer.devices, cfg.trainer.num_nodes


def _accelerator(cfg: RecipeConfig) -> str:
    choice = cfg.trainer.accelerator
    if choice == "gpu" and not torch.cuda.is_available():
        raise ValueError("trainer.accelerator=gpu but CUDA is not available; set trainer.accelerator=cpu or auto")
    return "cuda" if choice == "gpu" or (choice == "auto" and torch.cuda.is_available()) else "cpu"


def launch_fabric(cfg: RecipeConfig):
    """A launched :class:`lightning.fabric.Fabric` for ``cfg`` (see the module doc)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    accelerator = _accelerator(cfg)
    devices, num_nodes = process_counts(cfg)
    needs_group = devices * num_nodes > 1 or get_strategy(cfg.replay.strategy).needs_process_group
    if needs_group:
        strategy = ModelParallelStrategy(
            parallelize_fn=_parallelized_by_the_backend,
            process_group_backend="nccl" if accelerator == "cuda" else "gloo",
            timeout=collective_timeout(cfg),
        )
    else:
        strategy = "auto"
    if cfg.trainer.num_threads and accelerator == "cpu":
        torch.set_num_threads(cfg.trainer.num_threads)
    with warnings.catch_warnings():
        # Fabric's Slurm detection warns whenever an `srun` is on PATH and this process was not
        # started by it. A run under the package's Slurm launcher is started by srun (no warning);
        # any other run is a local one, for which the hint to prepend srun is wrong.
        warnings.filterwarnings("ignore", message=SRUN_NOT_USED)
        fabric = Fabric(accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy, precision="32-true")
    fabric.launch()
    return fabric


def _parallelized_by_the_backend(module, device_mesh):
    """Fabric's ``parallelize_fn``: the backends shard their models themselves (never called)."""
    return module


def make_backend(cfg: RecipeConfig, fabric):
    """The model side of ``replay.strategy``: the backend class its spec names (``StrategySpec.trainer_backend``)."""
    distributed = dist.is_available() and dist.is_initialized()
    backend = get_strategy(cfg.replay.strategy).load_trainer_backend()
    return backend(cfg, fabric.device, distributed)


def seed_all(seed: int, fabric) -> None:
    """Same weights on every rank: seed torch (and Python/NumPy) identically everywhere."""
    fabric.seed_everything(seed, workers=False, verbose=False)

