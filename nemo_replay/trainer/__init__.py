"""The reference GRPO trainer and the glue for existing trainers (DESIGN.md §6).

- :class:`GRPOTrainer` (:mod:`.grpo`): the main job's loop on Lightning Fabric;
- :func:`run_compare` (:mod:`.compare`): replay on vs off from the same seed;
- :class:`ReplayRoles` (:mod:`.roles`): the three role callbacks for a hand-written loop;
- :class:`ReplayCallback` (:mod:`.lightning_hook`): switches replay on for a LightningModule.

Names load on first use, so importing this package stays cheap.
"""

import importlib

__all__ = ["GRPOTrainer", "RunResult", "run_compare", "ReplayRoles", "ReplayCallback", "SuccessorTask"]

_WHERE = {
    "GRPOTrainer": "nemo_replay.trainer.grpo",
    "RunResult": "nemo_replay.trainer.grpo",
    "run_compare": "nemo_replay.trainer.compare",
    "ReplayRoles": "nemo_replay.trainer.roles",
    "ReplayCallback": "nemo_replay.trainer.lightning_hook",
    "SuccessorTask": "nemo_replay.trainer.task",
}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'nemo_replay.trainer' has no attribute {name!r}")
