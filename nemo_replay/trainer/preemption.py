"""Stop signals: finish the step, checkpoint, write the plot and summary, exit; twice: exit now.

Slurm sends SIGTERM at the time limit and on preemption (and the signal ``--signal`` asks
for, SIGUSR1 in ``recipes/slurm.py``), a terminal sends SIGINT. While :class:`StopSignals`
is installed, the first of SIGTERM, SIGUSR1 or SIGINT only sets a flag: the step in flight
runs to its end, then every rank learns of it through one all-reduce (a signal may reach
only some ranks, or reach them at different steps), all write the checkpoint together and
the run ends with :data:`PREEMPTED_EXIT` and a message saying how to resume.

A second signal exits at once (status ``128 + signal``), without a checkpoint: the last
complete checkpoint stays the one a resume starts from, and the metrics rows already
written stay. Copies of one request are not a second signal: a signal arriving within
:data:`REPEAT_WINDOW_S` of the first is ignored, because one Ctrl-C under torchrun reaches a
worker twice (from the terminal, then torchrun's SIGTERM), and Slurm signals every process
of a job step, launchers included.

Once a stop's checkpoint is complete, the process leaves with :func:`stopped_exit`: it
ignores further stop signals while it exits, so the launcher's own SIGTERM (torchrun sends
one to the other workers as soon as the first exits 75) cannot turn a checkpointed stop
into a death by signal.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["StopSignals", "STOP_SIGNALS", "PREEMPTED_EXIT", "REPEAT_WINDOW_S", "start_writer_helpers", "stopped_exit"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# EX_TEMPFAIL (sysexits.h): "a temporary failure; the user is invited to retry".
PREEMPTED_EXIT = 75
REPEAT_WINDOW_S = 1.0


def stopped_exit() -> int:
    """:data:`PREEMPTED_EXIT`, after setting every stop signal to be ignored for the rest of the exit.

    Call it only once the stop checkpoint is complete on every rank (the run returned
    ``stopped_by``): nothing is left that a signal could save or lose.
    """
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    return PREEMPTED_EXIT


class StopSignals:
    """Turns the first stop signal into a request honoured between steps (see the module doc).

    Args:
        announce: print a line when a signal arrives (rank 0).
    """

    def __init__(self, announce: bool = True):
        self.announce = announce
        self.received: Optional[int] = None
        self._first_at = 0.0
        self._previous: dict = {}

    def install(self) -> bool:
        """Install the handlers; False (and nothing changed) off the main thread, where Python cannot."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> "StopSignals":
        if not self.install():
            warnings.warn(
                "the run is not on the main thread, where Python handles signals: SIGTERM, SIGUSR1 and Ctrl-C "
                "end it without a checkpoint (run fit() on the main thread to stop between steps)"
            )
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _say(self, text: str) -> None:
        if self.announce:
            os.write(2, f"\nnemo-replay: {text}\n".encode())

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_at = signum, now
            self._say(f"{name} received: finishing this step, then writing a checkpoint and stopping "
                      f"(send it again to stop at once, without a checkpoint)")
            return
        if now - self._first_at < REPEAT_WINDOW_S:
            return  # the same request, delivered twice
        self._say(f"second signal ({name}): stopping now without a checkpoint; the last complete checkpoint "
                  f"is where a resume starts")
        os._exit(128 + signum)

    def agreed(self, device: Optional[torch.device] = None) -> Optional[str]:
        """The stop signal's name if any rank received one, else None; collective under a process group."""
        mine = int(self.received or 0)
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([mine], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mine = int(flag.item())
        return signal.Signals(mine).name if mine else None


def start_writer_helpers() -> None:
    """Start megatron-core's checkpoint-writer helpers deaf to the stop signals; idempotent.

    ``dist_checkpointing.save`` hands its write results through a ``multiprocessing``
    ``Manager()`` queue (``strategies/filesystem_async.py``, ``_get_write_results_queue``):
    a helper process it spawns at the first save, in the trainer's process group, beside
    multiprocessing's resource tracker. torchrun stops a worker by sending SIGTERM to its
    process group, and Slurm's ``scancel --signal=USR1`` reaches every process of the job:
    the helper died of the very signal the trainer turns into "checkpoint, then stop", and
    that checkpoint then failed (``BrokenPipeError``, rc 1, a ``.partial-*`` folder left).

    Started here with :data:`~nemo_replay.trainer.preemption.STOP_SIGNALS` blocked (a
    signal mask survives ``fork`` and ``exec``), the helpers never see those signals; they
    still end with the trainer (the Manager's exit finalizer shuts it down) and on SIGKILL.
    Only this thread's mask changes, for the few milliseconds of the start: a signal sent
    meanwhile stays pending and reaches the trainer's handler right after.
    """
    from multiprocessing import resource_tracker

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    # One at a time: the tracker's own start unblocks SIGINT and SIGTERM when it is done.
    for start in (resource_tracker.ensure_running, filesystem_async._get_write_results_queue):
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
