"""Host reads per scorer call, counted (docs/design.md §4: one host read for a call's guards).

A host read makes the CPU wait for the device: an explicit read of a tensor's value
(``bool()``, ``int()``, ``float()``, ``.item()``, ``.tolist()``, ``.cpu()``), or an operation
whose output size depends on the data (``nonzero``, ``unique``, boolean-mask indexing,
``masked_select``, ``bincount``, ``repeat_interleave`` without ``output_size``). They are
counted with a ``TorchFunctionMode`` that sees every tensor operation the call makes, on any
device, so the CPU run counts what a GPU run would wait for. ``nonzero_static`` (size given)
is not a read. Each read is attributed to the file and line that made it.

The autograd engine runs backward functions outside the mode, so the backward is counted
with a profiler hook instead (``sys.setprofile``, the C calls of the same names: explicit
reads and data-dependent sizes; boolean-mask indexing is not visible there).

    python -m benchmarks.syncs            # the table, current code
    python -m benchmarks.syncs --json     # machine-readable

``BEFORE`` holds the same count for the scorer at commit c409b38 (the last before the guards
were combined), measured with this module on that tree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostReads", "count_reads", "scenarios", "BEFORE"]

_READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "nonzero", "argwhere", "unique",
          "unique_consecutive", "masked_select", "bincount"}

# Host reads per call at commit c409b38 (forward, backward), same scenarios and counter.
BEFORE = {
    "logits, validate=True": (16, 0),
    "logits, validate=False": (12, 0),
    "hidden": (12, 3),
    "hidden, ragged rows": (12, 3),
    "full vocabulary (replay off)": (1, 0),
}


def _is_read(func, args, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    if name in _READS:
        return True
    if name == "repeat_interleave":
        return isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) and kwargs.get("output_size") is None
    if name in ("__getitem__", "index_put", "index_put_", "__setitem__") and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    if name == "to" and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
        return any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values()))
    return False


class HostReads(TorchFunctionMode):
    """Counts host reads made inside the ``with`` block; ``where`` maps 'file:line op' -> count."""

    def __init__(self):
        super().__init__()
        self.where: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.where.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_read(func, args, kwargs):
            frame = next((f for f in reversed(traceback.extract_stack()[:-1]) if "benchmarks/syncs.py" not in f.filename), None)
            place = "?" if frame is None else f"{frame.filename.split('/nemo_replay/')[-1]}:{frame.lineno}"
            self.where[f"{place} {getattr(func, '__name__', func)}"] += 1
        return func(*args, **kwargs)


class ProfiledReads:
    """Counts C calls named like host reads made inside the ``with`` block (any Python frame)."""

    NAMES = _READS | {"_unique2", "_unique"}

    def __init__(self):
        self.where: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.where.values())

    def _hook(self, frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") in self.NAMES:
            while frame.f_back is not None and os.sep + "torch" + os.sep in frame.f_code.co_filename:
                frame = frame.f_back  # a read inside torch's Python wrappers: name its caller
            place = f"{frame.f_code.co_filename.split('/nemo_replay/')[-1]}:{frame.f_lineno}"
            self.where[f"{place} {arg.__name__}"] += 1

    def __enter__(self):
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def count_reads(fn, backward: bool = True) -> tuple[HostReads, ProfiledReads]:
    """(forward reads, backward reads) of ``fn() -> scalar loss``; one warm-up call first."""
    loss = fn()
    if backward and loss.requires_grad:
        loss.backward()
    fwd, bwd = HostReads(), ProfiledReads()
    with fwd:
        loss = fn()
    if backward and loss.requires_grad:
        with bwd:
            loss.backward()
    return fwd, bwd


def scenarios(T: int = 256, V: int = 4096, H: int = 64, k: int = 16) -> dict:
    """name -> zero-argument function returning the loss of one scorer call (inputs built once)."""
    from benchmarks.workloads import channels, hidden_inputs, logits_input, support_rows
    from nemo_replay.scoring.scorer import score_aligned_support, score_full_vocabulary
    from nemo_replay.support.codec import CompactRows, encode_support
    from nemo_replay.support.ragged import RaggedSupport

    ch = channels(support_rows(T, V, k), vocab_size=V)
    logits = logits_input(T, V, torch.float32).requires_grad_()
    hidden, weight = hidden_inputs(T, V, H, torch.float32)
    hidden.requires_grad_(), weight.requires_grad_()
    ragged = RaggedSupport.from_padded(ch.support)
    # Rows as one compact buffer a trajectory, kept compact until the scorer decodes them.
    compact = CompactRows([encode_support(ragged[[i]], vocab_size=V) for i in range(ragged.batch_size)])
    args = (ch.sampled, ch.row_ids, ch.loss_mask)
    return {
        "logits, validate=True": lambda: score_aligned_support(logits, *args, ch.support).logprobs.sum(),
        "logits, validate=False": lambda: score_aligned_support(logits, *args, ch.support, validate=False).logprobs.sum(),
        "hidden": lambda: score_aligned_support(hidden, *args, ch.support, lm_head_weight=weight).logprobs.sum(),
        "logits, compact rows decoded at the entry": lambda: score_aligned_support(logits, *args, compact).logprobs.sum(),
        "hidden, ragged rows": lambda: score_aligned_support(hidden, *args, ragged, lm_head_weight=weight).logprobs.sum(),
        "full vocabulary (replay off)": lambda: score_full_vocabulary(logits, ch.sampled).logprobs.sum(),
    }


def measure() -> dict:
    """name -> {"forward": n, "backward": n, "where": {...}} for the current code."""
    out = {}
    for name, fn in scenarios().items():
        fwd, bwd = count_reads(fn)
        out[name] = {"forward": fwd.total, "backward": bwd.total, "where": dict(fwd.where), "where_backward": dict(bwd.where)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.syncs", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = measure()
    if args.json:
        print(json.dumps(res))
        return 0
    for name, r in res.items():
        before = BEFORE.get(name, ("-", "-"))
        print(f"{name:32s} forward {r['forward']:3d} (before {before[0]})  backward {r['backward']:3d} (before {before[1]})")
        for where, n in sorted(r["where"].items()):
            print(f"    fwd {n:3d}  {where}")
        for where, n in sorted(r["where_backward"].items()):
            print(f"    bwd {n:3d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
