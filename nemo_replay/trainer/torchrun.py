"""torchrun for long runs: a stop that checkpointed exits 75, with time to write the checkpoint.

    python -m nemo_replay.trainer.torchrun --nproc-per-node 8 -m nemo_replay train CONFIG [key=value ...]

It is torchrun (``torch.distributed.run``, same arguments) with two differences:

- **Exit status.** torchrun answers the SIGTERM it is sent (Slurm's time limit and
  preemption, ``kill``) by passing it to each worker's process group, waiting for them, and
  exiting 1 with a ``SignalException`` traceback, whatever the workers did; a worker that
  exits 75 on its own (a USR1 sent to the ranks) is a ``ChildFailedError``, also 1. Here,
  when every local worker exited with :data:`~nemo_replay.trainer.preemption.PREEMPTED_EXIT`
  (the run checkpointed and stopped), the launcher exits 75 too, so a scheduler or a
  script can tell "stopped, resume me" from "failed".
- **SIGUSR1.** Slurm's ``--signal=USR1@<lead>`` (and ``scancel --signal=USR1``) reaches every
  process of a job step, this launcher included, and USR1's default action ends a process:
  torchrun would die and its workers be killed with it, mid-checkpoint. Here the launcher
  ignores USR1 (its workers install their own handler and act on it).
- **Shutdown timeout.** torchrun kills its workers (SIGKILL) 30 s after passing a SIGTERM
  on (``--shutdown-timeout``, or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``): a step longer than
  that never reaches its stop checkpoint. Unless given, it is :data:`SHUTDOWN_TIMEOUT_S`.

The workers' exit statuses are read from torchrun's own process context when it closes
(``SubprocessContext._close``, torch 2.x); where that is not there the launcher keeps
torchrun's status.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional, Sequence

from nemo_replay.trainer.preemption import PREEMPTED_EXIT

__all__ = ["main", "SHUTDOWN_TIMEOUT_S", "with_shutdown_timeout"]

# Long enough for a step plus a checkpoint of a large model; Slurm's own SIGKILL comes
# KillWait (default 30 s) after its SIGTERM, so the batch script asks for USR1 earlier.
SHUTDOWN_TIMEOUT_S = 600


def with_shutdown_timeout(argv: Sequence[str], seconds: int = SHUTDOWN_TIMEOUT_S) -> list[str]:
    """``argv`` with ``--shutdown-timeout seconds`` first unless the user chose one (flag or env)."""
    argv = list(argv)
    chosen = any(a.split("=")[0] in ("--shutdown-timeout", "--shutdown_timeout") for a in argv)
    if chosen or os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        return argv
    return [f"--shutdown-timeout={seconds}", *argv]


def _record_worker_statuses(codes: dict) -> None:
    """Keep each local worker's exit status when torchrun closes them (after a signal)."""
    try:
        from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    except ImportError:
        return
    close = getattr(SubprocessContext, "_close", None)
    if close is None or getattr(close, "_nemo_replay", False):
        return

    def _close(self, *args, **kwargs):
        try:
            return close(self, *args, **kwargs)
        finally:
            for rank, handler in getattr(self, "subprocess_handlers", {}).items():
                codes[rank] = handler.proc.poll()

    _close._nemo_replay = True
    SubprocessContext._close = _close


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run torchrun with ``argv``; 75 when every local worker stopped after its checkpoint."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    argv = with_shutdown_timeout(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # for the workers only (see the module doc)
    codes: dict = {}
    _record_worker_statuses(codes)
    try:
        torchrun.main(argv)
    except SignalException as exc:
        if codes and all(c == PREEMPTED_EXIT for c in codes.values()):
            return PREEMPTED_EXIT
        print(
            f"nemo-replay torchrun: stopped by signal {exc.sigval.name}; the workers exited with {sorted(codes.items())} "
            f"(75: checkpointed), so the last complete checkpoint is where the same command resumes",
            file=sys.stderr,
        )
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        if exc.failures and all(f.exitcode == PREEMPTED_EXIT for f in exc.failures.values()):
            return PREEMPTED_EXIT
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
