"""Support rows through verl's agent loops into the batch, as ``routed_experts`` travels (docs/design.md §9.3).

verl 0.9.1 turns each trajectory's ``TokenOutput``s into an ``AgentLoopOutput``
(``experimental/agent_loop``), then into the batch in one of two ways:

- the V1 trainer (``trainer.use_v1: true``, the default): ``AgentLoopWorkerTQ`` puts
  ``output.as_dict()`` of each trajectory into TransferQueue, unpadded (``prompts [P]``,
  ``responses [R]``, ``routed_experts`` widened to ``P + R`` rows); the trainer reads jagged
  tensors back;
- the V0 trainer (``trainer.use_v1: false``): ``AgentLoopWorker._agent_loop_postprocess``
  pads each trajectory (prompt left-padded to ``prompt_length``, response right-padded to
  ``response_length``, ``routed_experts`` zero-padded into place) and ``_postprocess``
  concatenates them into a ``DataProto``.

Replay's loops (:class:`ReplaySingleTurnAgentLoop`, :class:`ReplayToolAgentLoop`, registered
as ``replay_single_turn_agent`` and ``replay_tool_agent``) are verl's with the rows of every
turn carried along: they take ``extra_fields[SUPPORT_KEY]`` out of each ``TokenOutput``
(:mod:`.rollout`) and move it through exactly the edits verl makes to ``response_mask`` and
``response_logprobs`` -- verl's own ``ContinuousTokenBuilder.align_response_metadata``, applied
to a channel of row numbers (worked example in :class:`SupportTrack`). They return a
:class:`ReplayAgentLoopOutput`: ``generation_support`` one uint8 buffer, the server's compact
buffer of each turn as it came with the response position of every row verl kept
(``SampleRows.to_bytes``; no row of a tool or boundary token; :mod:`.response_rows`): nothing is
decoded or encoded here, the rows' lengths are read from their length streams. ``response_mask`` 0 where a generated token's
support could not be recorded (its row is empty), the count in
``extra_fields["replay_flagged_tokens"]``. Its ``as_dict`` keeps the buffer a numpy array (the
V1 path, no worker change: TransferQueue stores it as raw bytes);
:class:`ReplayAgentLoopWorker` puts one buffer a sample into ``non_tensor_batch`` (the V0
path; :class:`ReplayAgentLoopManager` is its ``agent_loop_manager_class``). A response costs
what its rows hold, not ``response_length x K``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import numpy as np
import ray
import torch
from pydantic import ConfigDict

from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopOutput, AgentLoopWorker, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

from nemo_replay.integrations.verl.keys import SUPPORT_KEY
from nemo_replay.integrations.verl.response_rows import object_column, turn_rows
from nemo_replay.integrations.verl.rollout import FLAGS_KEY, RolloutReplay
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.rows import SampleRows

__all__ = [
    "AGENT_LOOPS",
    "FLAGGED_KEY",
    "ReplayAgentLoopManager",
    "ReplayAgentLoopOutput",
    "ReplayAgentLoopWorker",
    "ReplaySingleTurnAgentLoop",
    "ReplayToolAgentLoop",
    "SupportTrack",
    "register_agent_loops",
]

#: ``AgentLoopOutput.extra_fields`` key: generated tokens of the trajectory taken out of the loss.
FLAGGED_KEY = "replay_flagged_tokens"


class SupportTrack:
    """The rows of one trajectory, aligned with its response as verl aligns ``response_logprobs``.

    verl builds a response turn by turn: each merge (``MergeResult``) may trim the last
    ``removed_prefix_token_count`` response positions, inserts boundary tokens (mask 0), then
    appends the assistant's tokens (mask 1, their log-probs) or context tokens (mask 0).
    ``align_response_metadata`` applies those edits to the mask and log-probs. The track
    applies them to ``index``, a float channel of row numbers: ``0`` = no row, ``i + 1`` =
    ``rows[i]``. Example, a tool turn with a Qwen boundary newline::

        turn 1: assistant tokens [a0 a1 <im_end>]    index [1 2 3]
        tools:  inserted [\\n], context [t0 t1]       index [1 2 3 0 0 0]
        turn 2: assistant tokens [b0 b1]             index [1 2 3 0 0 0 4 5]

    A context merge that would reach ``response_length`` is dropped by verl's tool loop
    (tool_agent_loop.py, ``_handle_processing_tools_state``), so each merge's result is a
    *candidate*, made current when the next merge starts from a response of its length.
    """

    def __init__(self, replay: RolloutReplay, response_length: int):
        self.replay, self.response_length = replay, response_length
        self.buffers: list[np.ndarray] = []  # each merged turn's compact buffer, as the server wrote it
        self.lengths: list[torch.Tensor] = []  # the ids of each of its rows
        self.flags: Counter = Counter()
        self._turns: list[Optional[tuple]] = []  # captured (buffer, lengths), not yet merged
        self._index: list[float] = []
        self._candidate: Optional[tuple[str, list[float]]] = None

    # ------------------------------------------------------------------ capture

    def capture(self, output: Any, sampling_params: dict) -> None:
        """Take the rows out of one ``TokenOutput`` (its ``extra_fields`` lose them)."""
        rows = output.extra_fields.pop(SUPPORT_KEY, None)
        self.flags.update(output.extra_fields.pop(FLAGS_KEY, None) or {})
        if rows is None and len(output.token_ids) and self.replay.is_training(
            sampling_params.get("temperature"), sampling_params.get("top_k"), sampling_params.get("top_p")
        ):
            raise ValueError(
                "replay: the rollout server returned no support rows for a training request. The process that "
                "launches servers has verl's own replica classes: set VERL_USE_EXTERNAL_MODULES="
                "nemo_replay.integrations.verl.plugin in ray_kwargs.ray_init.runtime_env.env_vars (configs/verl/"
                "replay_fsdp.yaml does)"
            )
        if rows is not None:  # the server's compact buffer (rollout.attach_support), checked, kept compact
            rows = turn_rows(rows, output.token_ids, self.replay.width, where="replay: a TokenOutput's rows")
        self._turns.append(rows)

    # ------------------------------------------------------------------ merges

    def _sync(self, response_len: int, where: str) -> None:
        """Make the candidate current if verl kept it (the response now has its length)."""
        if self._candidate is not None and len(self._candidate[1]) == response_len:
            self._index = self._candidate[1]
        self._candidate = None
        if len(self._index) != response_len:
            raise SupportAlignmentError(
                f"replay ({where}): the response holds {response_len} positions but the support track {len(self._index)}; "
                f"a merge changed the response outside ct_merge_assistant_token / ct_merge_context_msg"
            )

    def on_assistant(self, builder: Any, merge: Any, assistant_ids: list, response_len: int) -> None:
        """After ``ct_merge_assistant_token``: the assistant tokens get the turn's rows."""
        self._sync(response_len, "assistant merge")
        turn = self._turns.pop(0) if self._turns else None
        n = len(assistant_ids)
        if turn is not None and turn[1].numel() != n:
            raise SupportAlignmentError(f"replay: {turn[1].numel()} support rows for {n} assistant tokens in one merge")
        if turn is None:
            numbers = [0.0] * n
        else:
            base = sum(int(t.numel()) for t in self.lengths)
            self.buffers.append(turn[0])
            self.lengths.append(turn[1])
            numbers = [float(base + i + 1) for i in range(n)]
        _, index = builder.align_response_metadata(merge, [0] * len(self._index), self._index, assistant_logprobs=numbers)
        self._candidate = ("assistant", index)

    def on_context(self, builder: Any, merge: Any, response_len: int) -> None:
        """After ``ct_merge_context_msg``: inserted and context tokens get no row."""
        self._sync(response_len, "context merge")
        _, index = builder.align_response_metadata(merge, [0] * len(self._index), self._index)
        self._candidate = ("context", index)

    # ------------------------------------------------------------------ finish

    def finish(self, response_ids: list, response_mask: list) -> tuple[SampleRows, list, int]:
        """The rows of the loop's (cut) response, each at its response position (none where a
        token has no recorded row), the mask with flagged tokens out, and their count.

        Raises:
            SupportAlignmentError when a row lands on a token that is not generated.
        """
        index = self._index
        if self._candidate is not None:
            kind, candidate = self._candidate
            if kind == "assistant" or len(candidate) < self.response_length:
                index = candidate  # verl kept it; a context merge reaching response_length is dropped
        num = len(response_mask)
        if len(index) < num or len(response_ids) != num:
            raise SupportAlignmentError(
                f"replay: the response holds {len(response_ids)} tokens and {num} mask entries, the support track "
                f"{len(index)} positions"
            )
        lengths = torch.cat(self.lengths) if self.lengths else torch.zeros(0, dtype=torch.int64)
        # The track's row numbers are floats (verl aligns them as log-probs): exact integers below 2**53.
        row = torch.as_tensor(index[:num], dtype=torch.float64).to(torch.int64) - 1  # -1: no row
        mask = torch.as_tensor(response_mask, dtype=torch.int64)
        stray = torch.nonzero((row >= 0) & (mask == 0)).flatten()
        if stray.numel():
            j = int(stray[0])
            raise SupportAlignmentError(f"replay: response position {j} carries support row {int(row[j])} but is not a generated token")
        sizes = torch.where(row >= 0, lengths[row.clamp(min=0)], 0) if lengths.numel() else torch.zeros_like(row)
        flagged = (row >= 0) & (sizes == 0)  # not recorded whole: out of the loss
        mask = torch.where(flagged, 0, mask)
        kept = torch.nonzero(sizes > 0).flatten()  # each row is checked against its token where it is scored
        rows = SampleRows.placed(self.buffers, kept.numpy(), row[kept].numpy(), num, where="replay: the response's rows")
        return rows, mask.tolist(), int(flagged.sum())


class ReplayAgentLoopOutput(AgentLoopOutput):
    """verl's ``AgentLoopOutput`` with the trajectory's support rows.

    ``generation_support``: one uint8 buffer, the rows of ``response_ids`` at their positions
    (:meth:`~nemo_replay.support.rows.SampleRows.to_bytes`; None for a loop run with replay off). ``as_dict`` (the V1 path) keeps it a numpy buffer, which TransferQueue
    stores as raw bytes and hands the engines as a ``NonTensorStack``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    generation_support: Optional[Any] = None

    def as_dict(self) -> dict[str, Any]:
        output = super().as_dict()
        rows = output.pop(SUPPORT_KEY, None)
        if rows is not None:
            output[SUPPORT_KEY] = np.asarray(rows, dtype=np.uint8)
        return output


class _CapturingClient:
    """The loop's ``server_manager`` (verl's ``LLMServerClient``) handing each output to the track."""

    def __init__(self, client: Any, track: SupportTrack):
        self._client, self._track = client, track

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def generate(self, request_id, *, sampling_params: dict, **kwargs: Any):
        output = await self._client.generate(request_id, sampling_params=sampling_params, **kwargs)
        self._track.capture(output, sampling_params)
        return output


class _SupportRows:
    """Mixed in before a verl agent loop: the rows of every turn follow its response edits."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        replay = RolloutReplay.from_rollout_config(self.rollout_config)
        self._support = SupportTrack(replay, self.rollout_config.response_length) if replay.enabled else None
        if self._support is not None:
            self.server_manager = _CapturingClient(self.server_manager, self._support)

    async def ct_merge_assistant_token(self, runtime_token_ids, assistant_token_ids, response_mask,
                                       response_logprobs=None, assistant_logprobs=None):
        result = await super().ct_merge_assistant_token(
            runtime_token_ids, assistant_token_ids, response_mask, response_logprobs, assistant_logprobs=assistant_logprobs
        )
        if self._support is not None:
            self._support.on_assistant(self.continuous_token_builder, result[0], list(assistant_token_ids), len(response_mask))
        return result

    async def ct_merge_context_msg(self, previous_messages, updated_messages, runtime_token_ids, response_mask,
                                   response_logprobs=None, tools=None):
        result = await super().ct_merge_context_msg(
            previous_messages, updated_messages, runtime_token_ids, response_mask, response_logprobs, tools=tools
        )
        if self._support is not None:
            self._support.on_context(self.continuous_token_builder, result[0], len(response_mask))
        return result

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        output = await super().run(sampling_params, **kwargs)
        if self._support is None:
            return output
        rows, mask, flagged = self._support.finish(output.response_ids, output.response_mask)
        fields = {name: getattr(output, name) for name in output.model_fields_set}
        fields.update(response_mask=mask, generation_support=rows.to_bytes())
        result = ReplayAgentLoopOutput(**fields)
        result.extra_fields[FLAGGED_KEY] = flagged
        if self._support.flags:
            result.extra_fields[FLAGS_KEY] = dict(self._support.flags)
        return result


class ReplaySingleTurnAgentLoop(_SupportRows, SingleTurnAgentLoop):
    """verl's ``single_turn_agent`` carrying support rows (registered as ``replay_single_turn_agent``)."""


class ReplayToolAgentLoop(_SupportRows, ToolAgentLoop):
    """verl's ``tool_agent`` carrying support rows (registered as ``replay_tool_agent``)."""


#: Replay's agent loops by the name ``rollout.agent.default_agent_loop`` (or a dataset's ``agent_name``) gives.
AGENT_LOOPS = {"replay_single_turn_agent": ReplaySingleTurnAgentLoop, "replay_tool_agent": ReplayToolAgentLoop}


def register_agent_loops() -> None:
    """Register :data:`AGENT_LOOPS` in verl's agent loop registry of this process (idempotent)."""
    for name, cls in AGENT_LOOPS.items():
        register(name)(cls)


class ReplayAgentLoopWorker(AgentLoopWorker):
    """verl's ``AgentLoopWorker`` (V0 path) putting ``generation_support`` into the batch: one compact buffer a
    sample in ``non_tensor_batch``, which verl reorders, repeats, chunks and ships with its sample."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        register_agent_loops()
        self._replay = RolloutReplay.from_rollout_config(self.rollout_config)

    async def _agent_loop_postprocess(self, output, validate, **kwargs):
        rows = getattr(output, SUPPORT_KEY, None)
        internal = await super()._agent_loop_postprocess(output, validate, **kwargs)
        if self._replay.enabled:
            if rows is None and not validate:
                raise ValueError(
                    f"replay: agent loop output {type(output).__name__} carries no {SUPPORT_KEY}; run a replay agent loop "
                    f"({', '.join(AGENT_LOOPS)}) through actor_rollout_ref.rollout.agent.default_agent_loop or the "
                    f"dataset's agent_name"
                )
            if rows is None:  # a validation loop without rows: none recorded, for every response position
                rows = SampleRows.none(len(output.response_ids)).to_bytes()
            internal.extra_fields[SUPPORT_KEY] = rows
        return internal

    def _postprocess(self, inputs, input_non_tensor_batch=None, validate=False):
        rows = [inp.extra_fields.pop(SUPPORT_KEY, None) for inp in inputs]
        output = super()._postprocess(inputs, input_non_tensor_batch=input_non_tensor_batch, validate=validate)
        if self._replay.enabled:
            output.non_tensor_batch[SUPPORT_KEY] = object_column(rows)  # one buffer a sample, never a 2-D array
        return output


class ReplayAgentLoopManager(AgentLoopManager):
    """verl's ``AgentLoopManager`` (V0 path) running :class:`ReplayAgentLoopWorker`s.

    Set ``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` to
    ``nemo_replay.integrations.verl.agent_loop.ReplayAgentLoopManager`` with ``trainer.use_v1: false``.
    """

    def __init__(self, *args, **kwargs):
        self.agent_loop_workers_class = ray.remote(ReplayAgentLoopWorker)
        super().__init__(*args, **kwargs)
