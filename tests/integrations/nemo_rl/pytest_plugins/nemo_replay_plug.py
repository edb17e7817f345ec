"""A pytest plugin: replay's driver plug installed for the whole test process, then removed.

Loaded into NeMo-RL's own unit tests by scripts/nemo_rl_unit_tests.py (``-p nemo_replay_plug``
after ``-p nemo_rl_cpu_shims``). ``install_data_path()`` runs at configure time, before any test
module imports NeMo-RL's ``grpo`` -- where the launcher runs it in NeMo-RL's driver
(run_grpo.wire_driver) -- and outside any ``replay_run``: NeMo-RL's tests are runs that did not ask
for replay, so each of their batches must pass the plug untouched.

Beneath the plug each wrapped NeMo-RL function gets a counter (a pass-through that counts its
calls), so the report says how often the tests went through the plug; a selection that never
reaches it proves nothing. At unconfigure the plug is removed (``DataPath.remove()``) and must
leave the counters -- what was there before it -- in place; NeMo-RL's own functions are then put
back. The report is JSON at ``$NEMO_REPLAY_PLUG_REPORT``: ``wrapped``, ``calls``,
``not_restored`` (what the removal left wrapped, empty when it restored everything), ``package``
(the folder of the ``nemo_replay`` the plug came from).
"""

from __future__ import annotations

import functools
import importlib
import json
import os

_GRPO = "nemo_rl.algorithms.grpo"
_BATCHED_DATA_DICT = "nemo_rl.distributed.batched_data_dict"
#: (module, owner inside it or None for the module, attribute): the four places the plug wraps.
_PLACES = (
    (_BATCHED_DATA_DICT, "BatchedDataDict", "from_batches"),
    (_GRPO, None, "batched_message_log_to_flat_message"),
    (_GRPO, None, "add_grpo_token_loss_masks_and_generation_logprobs"),
    (_GRPO, None, "_preserve_router_replay_routed_experts"),
)

_state: dict = {}


def _owner(module: str, owner):
    mod = importlib.import_module(module)
    return getattr(mod, owner) if owner else mod


def _counted(fn, name: str, calls: dict):
    @functools.wraps(fn)
    def counting(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return counting


def _install_counters(calls: dict) -> list:
    """A counter in each of the plug's places; returns (owner, attribute, NeMo-RL's own, the counter)."""
    placed = []
    for module, owner_name, name in _PLACES:
        owner = _owner(module, owner_name)
        own = vars(owner)[name]
        label = f"{owner_name}.{name}" if owner_name else name
        calls[label] = 0
        if isinstance(own, classmethod):
            counter = classmethod(_counted(own.__func__, label, calls))
        else:
            counter = _counted(own, label, calls)
        setattr(owner, name, counter)
        placed.append((owner, name, own, counter))
    return placed


def pytest_configure(config):
    from nemo_replay.integrations.nemo_rl import install_data_path

    calls: dict = {}
    placed = _install_counters(calls)
    _state.update(calls=calls, placed=placed, plug=install_data_path())


def pytest_unconfigure(config):
    plug = _state.pop("plug", None)
    if plug is None:
        return
    wrapped = list(plug.wrapped)
    plug.remove()
    left = [name for owner, name, _, counter in _state["placed"] if vars(owner)[name] is not counter]
    for owner, name, own, _ in _state.pop("placed"):
        setattr(owner, name, own)
    import nemo_replay

    report = {"wrapped": wrapped, "calls": _state.pop("calls"), "not_restored": left,
              "package": os.path.dirname(os.path.abspath(nemo_replay.__file__))}
    path = os.environ.get("NEMO_REPLAY_PLUG_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
