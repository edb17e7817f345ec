"""The reference GRPO trainer: the main job, the demo and the test bed (docs/design.md §6).

- :class:`GRPOTrainer` (:mod:`.grpo`): the main job's loop on Lightning Fabric;
- :func:`run_compare` (:mod:`.compare`): replay on vs off from the same seed.

Rooms by concern: the recipe (:mod:`.config`), the run folder and its checkpoints
(:mod:`.rundir`: the folder, :mod:`.rundir.checkpoint`, :mod:`.rundir.digests`), the rows
and their loggers (:mod:`.loggers`: :mod:`.loggers.metrics`, :mod:`.loggers.jsonl`), the
model backends (:mod:`.backends`), and the loop itself here (:mod:`.grpo`, :mod:`.compare`,
:mod:`.generation`, :mod:`.tasks`, :mod:`.guards`, :mod:`.preemption`, :mod:`.runtime`;
:mod:`.torchrun` is the launcher).

The glue for trainers that own their loop is not here: :class:`nemo_replay.roles.ReplayRoles`
for a hand-written loop, :mod:`nemo_replay.integrations` for other frameworks.
Names load on first use, so importing this package stays cheap.
"""

import importlib

__all__ = ["GRPOTrainer", "RunResult", "run_compare", "SuccessorTask"]

_WHERE = {
    "GRPOTrainer": "nemo_replay.trainer.grpo",
    "RunResult": "nemo_replay.trainer.grpo",
    "run_compare": "nemo_replay.trainer.compare",
    "SuccessorTask": "nemo_replay.trainer.tasks",
}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'nemo_replay.trainer' has no attribute {name!r}")
