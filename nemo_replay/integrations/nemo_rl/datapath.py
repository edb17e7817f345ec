"""``generation_support`` through NeMo-RL's driver: message logs, padding, the batches of ``grpo.py``.

The rows leave the vLLM worker next to ``logprobs`` (:mod:`.workers`), are sliced into
each generated assistant message by the patched rollout code (:mod:`.patch`), and must then
survive every batch NeMo-RL builds on the way to its policy workers. At commit
:data:`~.layout.NEMO_RL_COMMIT` each of those steps is a function boundary in the driver
process, so :func:`install_data_path` wraps them at run time (docs/design.md §9):

==========================================================  ==========================================
NeMo-RL function (file)                                     what replay adds
==========================================================  ==========================================
``BatchedDataDict.from_batches``                            pads ``generation_support`` with -1, not 0
(``distributed/batched_data_dict.py``; the vLLM workers'    (0 is a token id: a zero row on padding
results, ``vllm_generation.py``; ``rollouts.py``)           reads as a real support)
``add_grpo_token_loss_masks_and_generation_logprobs``       all -1 rows for every message nobody
(``algorithms/grpo.py``)                                    sampled; flagged tokens leave
                                                            ``token_loss_mask`` (:func:`backfill_support`)
``batched_message_log_to_flat_message`` (as ``grpo.py``     pads ``generation_support`` with -1
calls it)
``_preserve_router_replay_routed_experts`` (``grpo.py``;    copies ``generation_support`` into the
called on ``train_data``, its async twin and               batch (:func:`carry_support`): the key
``logprob_data``, which feeds the old-policy and the        lists of those batches are fixed
reference pass)
==========================================================  ==========================================

The pure parts (:func:`with_support_pad`, :func:`backfill_support`, :func:`carry_support`)
take NeMo-RL's plain data (lists of message dicts, mappings of tensors) and import nothing
of NeMo-RL.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, MutableMapping, Optional, Sequence


from nemo_replay.integrations.nemo_rl.scoring import SUPPORT_KEY
from nemo_replay.support.rows import SampleRows

__all__ = ["SUPPORT_PAD", "with_support_pad", "backfill_support", "carry_support", "install_data_path", "DataPath",
           "replay_run", "message_log_rows"]

#: The pad value of support rows: never a token id.
SUPPORT_PAD = -1

_WRAPPED = "__nemo_replay_wraps__"
_PATCH_HINT = "python -m nemo_replay.integrations.nemo_rl.patch apply NEMO_RL_DIR"
#: Why a generated message has no rows, when nothing more is known.
_UNKNOWN_CAUSE = (
    f"the rollout code did not slice the vLLM worker's rows into it (the patch: {_PATCH_HINT}), or the generation "
    f"worker is not replay's (launch with python -m nemo_replay.integrations.nemo_rl.run_grpo)"
)
#: The keys every result of a vLLM generate call carries (NeMo-RL's GenerationOutputSpec, vllm_generation.py:681-686).
_GENERATION_KEYS = ("output_ids", "generation_lengths", "logprobs")


def with_support_pad(pad_value_dict: Optional[dict] = None, *, key: str = SUPPORT_KEY) -> dict:
    """``pad_value_dict`` with ``key: -1`` added (a copy; the caller's dict is not changed).

    Raises:
        ValueError when the caller asked another pad value for ``key``.
    """
    pads = dict(pad_value_dict or {})
    if pads.setdefault(key, SUPPORT_PAD) != SUPPORT_PAD:
        raise ValueError(
            f"pad_value_dict[{key!r}]={pads[key]!r}: support rows are padded with {SUPPORT_PAD} (any other value is a "
            f"token id, read as a recorded support); drop the entry"
        )
    return pads


def _message_rows(message: dict, key: str, where: str) -> SampleRows:
    """A generated message's rows: the worker's :class:`~nemo_replay.support.rows.SampleRows`, sliced by the
    rollout code to the message's tokens."""
    rows, num_tokens = message[key], int(message["token_ids"].shape[0])
    if not isinstance(rows, SampleRows) or rows.length != num_tokens:
        got = f"SampleRows of {rows.length} columns" if isinstance(rows, SampleRows) else type(rows).__name__
        raise ValueError(
            f"{where}: {key} must be the rows of its {num_tokens} tokens (SampleRows, one column a token_ids entry), "
            f"got {got}; slice the vLLM worker's rows as generation_logprobs is sliced ([i][input_length:total_length])"
        )
    return rows


def _sample_rows(messages: Sequence[dict], key: str, where: str) -> SampleRows:
    """One sample's rows in the columns of its flattened message log (a message's tokens after those of
    the messages before it); messages nobody sampled hold none."""
    parts = []
    for j, message in enumerate(messages):
        n = int(message["token_ids"].shape[0])
        parts.append(_message_rows(message, key, f"{where}, message {j}") if key in message else SampleRows.none(n))
    return SampleRows.cat(parts)


def message_log_rows(message_logs: Sequence[Sequence[dict]], key: str) -> Optional[list]:
    """The rows of every sample of a batch, one :class:`~nemo_replay.support.rows.SampleRows` a sample in
    the columns NeMo-RL's flattening gives its tokens; None when no message carries ``key``. No row is
    decoded or encoded again: the samples refer to the worker's buffers."""
    if not any(key in m for log in message_logs for m in log):
        return None
    return [_sample_rows(log, key, f"trajectory {i}") for i, log in enumerate(message_logs)]


def backfill_support(message_logs: Sequence[Sequence[dict]], *, key: str = SUPPORT_KEY, cause: Optional[str] = None) -> int:
    """Check every generated message's rows and take flagged tokens out of the loss, in place.

    Runs after NeMo-RL's ``add_grpo_token_loss_masks_and_generation_logprobs``, which set
    ``token_loss_mask`` to ones on generated assistant messages and zeros elsewhere. A generated
    token whose row is all -1 (the engine's support could not be recorded exactly) leaves
    ``token_loss_mask``. Messages nobody sampled (prompt, tool output, a prompt's own assistant
    turns) get no rows: the flattening wrapper keeps response positions only
    (:func:`message_log_rows`).

    Args:
        message_logs: NeMo-RL's batch of message logs; each message a dict with
            ``token_ids (n,)`` and ``token_loss_mask (n,)``, generated ones also
            ``key``, their :class:`~nemo_replay.support.rows.SampleRows` (one column a token).
        cause: why a generated message has no rows, as the caller knows it (the wrapped data
            path says what the replay run's generate calls returned, :func:`_missing_rows_cause`);
            default: the two places rows can be lost.

    Returns:
        How many generated tokens left the loss.

    Raises:
        ValueError naming the trajectory and message of a generated message without rows
        or with rows of the wrong shape.
    """
    dropped = 0
    for i, log in enumerate(message_logs):
        for j, message in enumerate(log):
            tokens, mask = message["token_ids"], message["token_loss_mask"]
            if key not in message:
                if bool(mask.any()):
                    raise ValueError(
                        f"trajectory {i}, message {j} ({message.get('role')!r}, {tokens.shape[0]} tokens) was generated "
                        f"but carries no {key}: {cause or _UNKNOWN_CAUSE}"
                    )
                continue
            recorded = _message_rows(message, key, f"trajectory {i}, message {j}").recorded()
            flagged = (mask != 0) & ~recorded.to(mask.device)
            dropped += int(flagged.sum())
            message["token_loss_mask"] = mask.masked_fill(flagged, 0)
    return dropped


def carry_support(target: MutableMapping[str, Any], flat_messages: MutableMapping[str, Any], *, key: str = SUPPORT_KEY) -> None:
    """``target[key] = flat_messages[key]``, checked against ``target``'s ``input_ids``.

    Raises:
        ValueError when the flattened batch has no rows, or not one
        :class:`~nemo_replay.support.rows.SampleRows` a sample.
    """
    if key not in flat_messages:
        raise ValueError(
            f"the flattened rollout batch has no {key!r}: no message carried support rows (launch with python -m "
            f"nemo_replay.integrations.nemo_rl.run_grpo, which installs replay's vLLM worker and this data path)"
        )
    rows, ids = flat_messages[key], target["input_ids"]
    if not isinstance(rows, list) or len(rows) != ids.shape[0] or not all(isinstance(r, SampleRows) for r in rows):
        got = f"{len(rows)} entries" if isinstance(rows, list) else type(rows).__name__
        raise ValueError(f"flattened {key} holds {got} for {ids.shape[0]} samples; expected a list of one SampleRows a "
                         f"sample (what the flattening wrapper writes)")
    target[key] = rows


# ------------------------------------------------------------------------------ run-time install


@dataclass
class DataPath:
    """What :func:`install_data_path` wrapped, by module and name; :meth:`remove` puts NeMo-RL's
    functions back."""

    wrapped: list[str]
    originals: list = field(default_factory=list)  # (owner, attribute, what was there)

    def remove(self) -> None:
        """Restore every function this install wrapped (the plug removed)."""
        for owner, name, original in reversed(self.originals):
            setattr(owner, name, original)
        self.originals.clear()


class _Run:
    """Whether this process is running replay (:func:`replay_run`), its generation worker, and what
    the run's last generate call returned: (how many data-parallel ranks answered, the ranks whose
    results carried no rows), None before the first."""

    active = False
    worker: Optional[str] = None
    last_generation: Optional[tuple[int, list[int]]] = None


@contextlib.contextmanager
def replay_run(worker: Optional[str] = None):
    """Inside, the wrapped data path insists on rows: a generate call some of whose data-parallel
    ranks returned none is an error naming those ranks, and a generated message without rows is an
    error saying which ranks of the last generate call returned none, or that they all returned rows
    and the rollout code lost them. Outside -- a run that did not ask for replay, NeMo-RL's own
    tests -- a batch that carries no rows passes through untouched; one that carries some is still
    checked and padded."""
    before = (_Run.active, _Run.worker, _Run.last_generation)
    _Run.active, _Run.worker, _Run.last_generation = True, worker, None
    try:
        yield
    finally:
        _Run.active, _Run.worker, _Run.last_generation = before


def _note_generation(batches: Sequence[Any], key: str) -> None:
    """Inside a replay run: note a join of generate results in ``_Run.last_generation``.

    ``VllmGeneration.generate`` joins one result a data-parallel rank (vllm_generation.py:676-678).
    When some ranks' results carry ``key`` and others' do not, the join is refused here naming
    those ranks (NeMo-RL's own check says only that a key is missing from some batches). Empty
    results (a rank given no prompts) are never counted as missing rows.
    """
    if not batches or not all(all(k in b for k in _GENERATION_KEYS) for b in batches):
        return
    without = [rank for rank, b in enumerate(batches) if key not in b and len(b["output_ids"])]
    carrying = [rank for rank, b in enumerate(batches) if key in b]
    _Run.last_generation = (len(batches), without)
    if without and carrying:
        ours = f"this replay run's ({_Run.worker})" if _Run.worker else "replay's"
        raise ValueError(
            f"the vLLM workers of data-parallel ranks {without} (of {len(batches)}) returned no {key} while ranks "
            f"{carrying} did: the worker of ranks {without} is not {ours}; every rank's generation worker must be "
            f"replay's (the launcher swaps it in through vllm_generation.resolve_generation_worker_cls)"
        )


def _missing_rows_cause() -> str:
    """Inside a replay run: why a generated message has no rows, from what the last generate call returned."""
    ours = f"this replay run's generation worker ({_Run.worker})" if _Run.worker else "replay's generation worker"
    if _Run.last_generation is None:
        return f"{ours} returned no rows for it, or the rollout code did not slice them in (the patch: {_PATCH_HINT})"
    num_ranks, without = _Run.last_generation
    if without:
        return (f"the last generate call's vLLM workers returned no rows (data-parallel ranks {without} of "
                f"{num_ranks}): the worker that answered there is not {ours}, or the call was greedy (greedy calls "
                f"record none)")
    return (f"the last generate call's vLLM workers all returned rows ({num_ranks} data-parallel ranks), so the "
            f"rollout code that built this message did not slice them in (the patch slices them in generate_responses, "
            f"generate_responses_async and AsyncRolloutImpl._generate_response: {_PATCH_HINT})")


def _mark(wrapper, original):
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _WRAPPED, original)
    return wrapper


def _is_wrapped(fn) -> bool:
    return getattr(getattr(fn, "__func__", fn), _WRAPPED, None) is not None


def _check_patched(rollouts, key: str) -> None:
    """The rollout code slices ``key`` only when the patch is applied: refuse early otherwise."""
    source = inspect.getsource(rollouts.generate_responses)
    if f'"{key}"' not in source:
        root = Path(rollouts.__file__).resolve().parents[2]
        raise ValueError(
            f"NeMo-RL at {root} does not slice {key} into the assistant messages (nemo_rl/experience/rollouts.py is "
            f"unpatched): run `python -m nemo_replay.integrations.nemo_rl.patch apply {root}` once, then launch again"
        )


def install_data_path(*, grpo=None, batched_data_dict=None, rollouts=None, key: str = SUPPORT_KEY) -> DataPath:
    """Wrap NeMo-RL's driver-side data path so ``key`` reaches every policy batch (table above).

    Call once in the driver before NeMo-RL's ``setup``; a second call changes nothing.
    The modules default to NeMo-RL's own (``nemo_rl.algorithms.grpo``,
    ``nemo_rl.distributed.batched_data_dict``, ``nemo_rl.experience.rollouts``).

    Raises:
        ValueError when the rollout patch is not applied to the NeMo-RL that is imported.
    """
    grpo = grpo or importlib.import_module("nemo_rl.algorithms.grpo")
    batched_data_dict = batched_data_dict or importlib.import_module("nemo_rl.distributed.batched_data_dict")
    rollouts = rollouts or importlib.import_module("nemo_rl.experience.rollouts")
    _check_patched(rollouts, key)
    done = DataPath([])
    wrapped = done.wrapped

    cls = batched_data_dict.BatchedDataDict
    if not _is_wrapped(cls.from_batches):
        from_batches = cls.from_batches.__func__

        def padded_from_batches(cls_, batches, pad_value_dict=None, **kwargs):
            if _Run.active:
                _note_generation(batches, key)
            return from_batches(cls_, batches, with_support_pad(pad_value_dict, key=key), **kwargs)

        done.originals.append((cls, "from_batches", cls.__dict__["from_batches"]))
        cls.from_batches = classmethod(_mark(padded_from_batches, from_batches))
        wrapped.append("BatchedDataDict.from_batches")

    flatten = grpo.batched_message_log_to_flat_message
    if not _is_wrapped(flatten):

        def compact_flatten(message_log_batch, pad_value_dict=None, *args, **kwargs):
            # The rows leave the messages before NeMo-RL flattens them: one compact entry a sample.
            rows = message_log_rows(message_log_batch, key)
            if rows is None:
                return flatten(message_log_batch, with_support_pad(pad_value_dict, key=key), *args, **kwargs)
            bare = [[{k: v for k, v in m.items() if k != key} for m in log] for log in message_log_batch]
            out = flatten(bare, pad_value_dict, *args, **kwargs)
            (out[0] if isinstance(out, tuple) else out)[key] = rows
            return out

        done.originals.append((grpo, "batched_message_log_to_flat_message", flatten))
        grpo.batched_message_log_to_flat_message = _mark(compact_flatten, flatten)
        wrapped.append("grpo.batched_message_log_to_flat_message")

    add_masks = grpo.add_grpo_token_loss_masks_and_generation_logprobs
    if not _is_wrapped(add_masks):

        def masks_and_support(message_logs, *args, **kwargs):
            out = add_masks(message_logs, *args, **kwargs)
            if _Run.active or any(key in m for log in message_logs for m in log):
                backfill_support(message_logs, key=key, cause=_missing_rows_cause() if _Run.active else None)
            return out

        done.originals.append((grpo, "add_grpo_token_loss_masks_and_generation_logprobs", add_masks))
        grpo.add_grpo_token_loss_masks_and_generation_logprobs = _mark(masks_and_support, add_masks)
        wrapped.append("grpo.add_grpo_token_loss_masks_and_generation_logprobs")

    preserve = grpo._preserve_router_replay_routed_experts
    if not _is_wrapped(preserve):

        def preserve_with_support(target, flat_messages, *args, **kwargs):
            out = preserve(target, flat_messages, *args, **kwargs)
            if _Run.active or key in flat_messages:
                carry_support(target, flat_messages, key=key)
            return out

        done.originals.append((grpo, "_preserve_router_replay_routed_experts", preserve))
        grpo._preserve_router_replay_routed_experts = _mark(preserve_with_support, preserve)
        wrapped.append("grpo._preserve_router_replay_routed_experts")
    return done
