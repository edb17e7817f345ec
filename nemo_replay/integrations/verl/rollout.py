"""Support rows from verl's vLLM and SGLang rollout servers (docs/design.md §9.3).

verl 0.9.1 samples through one Ray actor per replica node (``vLLMHttpServer``,
``SGLangHttpServer``) whose ``generate`` returns a ``TokenOutput`` (``token_ids``,
``log_probs``, ``routed_experts``, ``extra_fields``). Neither asks the engine for more than
the sampled token: vLLM gets ``logprobs = 0`` and keeps ``logprobs[token]`` of each position;
SGLang gets ``return_logprob`` and keeps ``output_token_logprobs``. Replay's servers are
those classes with one thing added, at the engine boundary (no verl code is copied or
patched):

- **vLLM** (processed log-probs, or sampling masks on an engine started with
  ``return_sampling_mask``): the engine handle ``self.engine`` is wrapped after
  ``launch_server``; every request that samples asks ``logprobs = top_k + 1`` on the
  ``SamplingParams`` verl built, and the final ``RequestOutput``'s ``CompletionOutput`` is read
  with :func:`~nemo_replay.rollout.engines.vllm.support_from_vllm_output`;
- **SGLang** >= 0.5.23 (sampling masks; verl 0.9.1's own SGLang server cannot run such an
  SGLang, and ``check_verl_config`` refuses it there: docs/engines.md): ``self.tokenizer_manager`` is wrapped; every
  request that samples gets ``return_sampling_mask`` with ``sampling_logprobs_mode
  "selected"``, and the response is read with
  :func:`~nemo_replay.rollout.engines.sglang.support_from_sglang_meta_info`. When verl asked
  for log-probs, ``TokenOutput.log_probs`` becomes the sampler's log-probs over its support
  (SGLang's ``output_token_logprobs`` are over the whole vocabulary), as vLLM's processed
  log-probs already are.

The rows ride in ``TokenOutput.extra_fields`` (verl's field "for dynamic addition"):
``extra_fields[SUPPORT_KEY]`` is one uint8 buffer, the rows of ``token_ids`` in the compact
codec (:func:`~.response_rows.encode_response_rows`; row j the support of ``token_ids[j]``),
so what crosses Ray from the server to the agent loop costs what the rows hold; a position
whose support could not be recorded whole has an empty row and is counted in
``extra_fields[FLAGS_KEY]`` by reason. The replay agent loops
(:mod:`.agent_loop`) take them from there.

Which requests are recorded. Every request that samples and whose settings bound the
support (temperature > 0, top_k > 1, no penalties). A request that cannot be recorded is
refused when its temperature / top_k / top_p are the rollout's training settings (a
training batch must never go unrecorded) and otherwise served unrecorded: validation with
``val_kwargs``, REMAX's greedy baselines. Reward-model and teacher replicas, and any replica
whose rollout config leaves replay off, are verl's own classes.

The server and replica classes subclass verl's, which import vLLM or SGLang at module
level: :func:`replay_vllm_replica_class` and :func:`replay_sglang_replica_class` build them
on first call, in the process that launches servers (:mod:`.plugin` registers them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping, Optional


from nemo_replay.integrations.verl.keys import SUPPORT_KEY
from nemo_replay.integrations.verl.response_rows import encode_response_rows
from nemo_replay.support.ragged import RaggedSupport
from nemo_replay.rollout.engines.base import EngineSupport, capture_settings_from_engine
from nemo_replay.rollout.engines.sglang import (
    SGLANG_DEFAULT_MASK_MAX_TOKENS,
    check_sglang_request,
    support_from_sglang_meta_info,
)
from nemo_replay.rollout.engines.vllm import (
    VLLM_DEFAULT_MAX_LOGPROBS,
    check_vllm_engine,
    check_vllm_request,
    support_from_vllm_output,
    vllm_row_width,
)

__all__ = [
    "FLAGS_KEY",
    "RolloutReplay",
    "VllmSupportRecorder",
    "RecordingVllmEngine",
    "SglangSupportRecorder",
    "attach_support",
    "replay_vllm_replica_class",
    "replay_sglang_replica_class",
]

logger = logging.getLogger(__name__)

#: ``TokenOutput.extra_fields`` key: how many positions were flagged, by reason.
FLAGS_KEY = "replay_flags"

# vLLM treats a temperature below this as greedy (vllm/sampling_params.py, _SAMPLING_EPS).
_GREEDY_EPS = 1e-5


def _plain(value: Any) -> Any:
    """An OmegaConf node as plain Python (dicts and lists), anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency of the package
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _field(config: Any, name: str, default: Any = None) -> Any:
    """``config.name`` for verl's ``RolloutConfig`` dataclass, its DictConfig, or a mapping."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)  # a DictConfig's missing key raises an AttributeError subclass


@dataclass(frozen=True)
class RolloutReplay:
    """Replay's switches, read from ``actor_rollout_ref.rollout.custom.replay``.

    Attributes:
        enabled: record supports and carry them (``custom.replay.enabled``).
        width: row width ``K`` of ``generation_support`` (``custom.replay.support_width``;
            default, on vLLM's log-prob path, ``vllm_row_width(top_k, max_logprobs)`` = ``top_k
            + 16`` within ``max_logprobs - 1``, so supports tied at the k-th show whole; else
            the rollout's ``top_k``). A wider support is flagged ``wider_than_row`` and left out.
        temperature, top_k, top_p: the rollout's training sampling settings, which decide
            whether an unrecordable request is refused (module doc).
    """

    enabled: bool
    width: int
    temperature: Any
    top_k: Any
    top_p: Any

    @classmethod
    def from_rollout_config(cls, config: Any) -> "RolloutReplay":
        """Read the switches from verl's rollout config (``RolloutConfig``, DictConfig or mapping)."""
        custom = _plain(_field(config, "custom")) or {}
        replay = custom.get("replay") if isinstance(custom, Mapping) else None
        replay = _plain(replay) or {}
        if not isinstance(replay, Mapping):
            raise ValueError(
                f"actor_rollout_ref.rollout.custom.replay={replay!r}: expected a mapping such as "
                f"{{enabled: true, support_width: null}} (configs/verl/replay_fsdp.yaml)"
            )
        top_k = _field(config, "top_k")
        width = replay.get("support_width")
        enabled = replay.get("enabled", False) is True
        if width is None:
            width = top_k
            vllm = (_plain(_field(config, "engine_kwargs")) or {}).get("vllm") or {}
            name = _field(config, "name")
            if (name in (None, "vllm") and not vllm.get("return_sampling_mask") and isinstance(top_k, int)
                    and not isinstance(top_k, bool) and top_k > 1):
                # The processed log-prob lists show ties at the k-th whole up to this width (each
                # request asks width + 1): vLLM 0.24 / 0.25 keep every tied token below 8 rows a step.
                max_logprobs = vllm.get("max_logprobs", VLLM_DEFAULT_MAX_LOGPROBS)
                if isinstance(max_logprobs, int) and not isinstance(max_logprobs, bool) and (
                        max_logprobs == -1 or max_logprobs > top_k):
                    width = vllm_row_width(top_k, max_logprobs)
        if enabled and (isinstance(width, bool) or not isinstance(width, int) or width < 2):
            raise ValueError(
                f"actor_rollout_ref.rollout.custom.replay.support_width={replay.get('support_width')!r} with "
                f"rollout.top_k={top_k!r}: the row width must be an int > 1; set rollout.top_k to an int > 1 "
                f"(replay needs a bounded support) or support_width explicitly"
            )
        return cls(enabled, width if enabled else 0, _field(config, "temperature"), top_k, _field(config, "top_p"))

    def is_training(self, temperature: Any, top_k: Any, top_p: Any) -> bool:
        """Whether a request's sampling settings are the rollout's training settings."""

        def same(a, b) -> bool:
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
                return math.isclose(float(a), float(b), rel_tol=0, abs_tol=1e-9)
            return a == b

        return same(temperature, self.temperature) and same(top_k, self.top_k) and same(top_p, self.top_p)


def _unrecordable(replay: RolloutReplay, params: Any, engine: str, reason: str) -> None:
    """Refuse an unrecordable request that carries the training settings; log the others once."""
    get = params.get if isinstance(params, Mapping) else (lambda k: getattr(params, k, None))
    if replay.is_training(get("temperature"), get("top_k"), get("top_p")):
        raise ValueError(
            f"replay ({engine} server): a request with the rollout's training settings cannot be recorded: {reason}. "
            f"Fix actor_rollout_ref.rollout.* (check_verl_config lists every setting replay needs)"
        )
    logger.debug("replay (%s server): request served without support rows (not a training request): %s", engine, reason)


def _rows(result: EngineSupport) -> tuple[RaggedSupport, dict]:
    """An adapter's support -> (its n CSR rows, one segment; flag counts)."""
    return result.support, dict(result.reasons)


# ---------------------------------------------------------------------------------- vLLM


class VllmSupportRecorder:
    """What replay's vLLM server adds to each request and reads from each output.

    Args:
        replay: the rollout's switches.
        path: ``"logprobs"`` (processed log-probs, ``top_k + 1`` per position) or ``"mask"``
            (the engine was started with ``return_sampling_mask``).
        vocab_size: ids must be below it when given (the model's logits width).
    """

    def __init__(self, replay: RolloutReplay, *, path: str = "logprobs", vocab_size: Optional[int] = None):
        if path not in ("logprobs", "mask"):
            raise ValueError(f"VllmSupportRecorder: path={path!r}, expected 'logprobs' or 'mask'")
        self.replay, self.path, self.vocab_size = replay, path, vocab_size

    def prepare(self, sampling_params: Any) -> bool:
        """Ask for the support on verl's ``SamplingParams`` (edited in place); False when the
        request is served unrecorded (module doc)."""
        temperature = getattr(sampling_params, "temperature", None)
        if temperature is None or temperature < _GREEDY_EPS:
            _unrecordable(self.replay, sampling_params, "vLLM", f"temperature={temperature!r} samples greedily")
            return False
        try:
            settings = capture_settings_from_engine(sampling_params, engine="vllm")
            if settings["top_k"] is None or settings["top_k"] < 2:
                raise ValueError(f"top_k={sampling_params.top_k!r} does not bound the support (set an int > 1)")
        except ValueError as exc:
            _unrecordable(self.replay, sampling_params, "vLLM", str(exc))
            return False
        if self.path == "logprobs":
            wanted = max(settings["top_k"], self.replay.width) + 1  # rows up to the width shown whole
            if sampling_params.logprobs is None or 0 <= sampling_params.logprobs < wanted:
                sampling_params.logprobs = wanted
            if hasattr(sampling_params, "flat_logprobs"):  # vLLM >= 0.24: flat lists, not a Logprob per entry
                sampling_params.flat_logprobs = True
        check_vllm_request(sampling_params, path=self.path)
        return True

    def read(self, completion: Any, sampling_params: Any) -> tuple[RaggedSupport, dict]:
        """(n CSR rows, flag counts) of one finished ``CompletionOutput``, read
        :data:`READ_CHUNK` positions at a time: run off the event loop (:class:`RecordingVllmEngine`),
        no single call holds the interpreter long enough to stall the loop's thread."""
        n, parts, flags = len(completion.token_ids), [], {}
        for start in range(0, max(n, 1), READ_CHUNK):
            part = _positions_of(completion, start, min(start + READ_CHUNK, n))
            rows, counts = _rows(support_from_vllm_output(
                part, width=self.replay.width, vocab_size=self.vocab_size,
                sampling_params=sampling_params if start == 0 else None,  # checked once a response
            ))
            parts.append(rows)
            for reason, count in counts.items():
                flags[reason] = flags.get(reason, 0) + count
        rows = RaggedSupport.cat(parts) if len(parts) > 1 else parts[0]
        return rows.resegment([0, rows.num_rows]), flags


#: Positions a server reads at a time (about 5 ms at k = 64 on one core).
READ_CHUNK = 256


def _positions_of(completion: Any, start: int, end: int) -> Any:
    """The fields the vLLM adapter reads of ``completion``, for positions ``start .. end - 1``."""
    lp, mask = getattr(completion, "logprobs", None), getattr(completion, "sampling_mask", None)
    if lp is not None and hasattr(lp, "start_indices"):  # FlatLogprobs: its flat lists, re-based
        first, last = lp.start_indices[start] if end > start else 0, lp.end_indices[end - 1] if end > start else 0
        lp = SimpleNamespace(start_indices=[i - first for i in lp.start_indices[start:end]],
                             end_indices=[i - first for i in lp.end_indices[start:end]],
                             token_ids=lp.token_ids[first:last], logprobs=lp.logprobs[first:last])
    elif lp is not None:
        lp = lp[start:end]
    if mask is not None:
        mask = getattr(mask, "token_ids", mask)[start:end]
    return SimpleNamespace(token_ids=list(completion.token_ids[start:end]), logprobs=lp, sampling_mask=mask)


class RecordingVllmEngine:
    """verl's ``self.engine`` (vLLM ``AsyncLLM``) with ``generate`` recording the support: what
    replay's vLLM server puts in its engine's place after ``launch_server``.

    Every other attribute is the engine's. ``generate`` takes the keywords verl passes
    (vllm_async_server.py: ``prompt``, ``sampling_params``, ``request_id``, ``lora_request``,
    ``priority``) and yields the engine's ``RequestOutput``s unchanged; when the stream ends,
    the rows of the last one's first completion are left in ``sink[request_id]``, read off the
    event loop (a long response's rows take milliseconds, and every other request waits on it).

    Args:
        engine: the vLLM ``AsyncLLM`` (anything whose ``generate`` is an async stream of ``RequestOutput``).
        recorder: what each request asks of the engine and how its rows are read.
        sink: request id -> ``(rows, flags)`` of :meth:`VllmSupportRecorder.read`; the server pops each.
    """

    def __init__(self, engine: Any, recorder: VllmSupportRecorder, sink: dict):
        self._engine, self._recorder, self._sink = engine, recorder, sink

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, sampling_params: Any, request_id: str, **kwargs: Any):
        recorded = self._recorder.prepare(sampling_params)  # before the engine reads the parameters
        stream = self._engine.generate(*args, sampling_params=sampling_params, request_id=request_id, **kwargs)
        return self._record(stream, sampling_params, request_id) if recorded else stream

    async def _record(self, stream, sampling_params: Any, request_id: str):
        final = None
        async for output in stream:
            final = output
            yield output
        if final is not None and final.outputs:
            # Off the event loop: a long response's rows take milliseconds to read, and every other
            # request of this server waits on the loop meanwhile.
            self._sink[request_id] = await asyncio.to_thread(self._recorder.read, final.outputs[0], sampling_params)


# ---------------------------------------------------------------------------------- SGLang


class SglangSupportRecorder:
    """What replay's SGLang server adds to each ``GenerateReqInput`` and reads from each response.

    Args:
        replay: the rollout's switches.
        mask_max_tokens: the server's ``--sampling-mask-max-tokens``.
        vocab_size: ids must be below it when given.
    """

    def __init__(self, replay: RolloutReplay, *, mask_max_tokens: int = SGLANG_DEFAULT_MASK_MAX_TOKENS,
                 vocab_size: Optional[int] = None):
        self.replay, self.mask_max_tokens, self.vocab_size = replay, mask_max_tokens, vocab_size

    @staticmethod
    def check_engine(request_cls: type) -> None:
        """Refuse an SGLang whose ``GenerateReqInput`` has no sampling masks (before 0.5.23)."""
        names = {f.name for f in dataclasses.fields(request_cls)} if dataclasses.is_dataclass(request_cls) else set()
        missing = {"return_sampling_mask", "sampling_logprobs_mode"} - names
        if missing:
            raise ValueError(
                f"replay (SGLang server): this SGLang's GenerateReqInput has no {sorted(missing)}; SGLang returns each "
                f"token's support only from 0.5.23 on (return_sampling_mask). Install sglang>=0.5.23, or set "
                f"actor_rollout_ref.rollout.name=vllm"
            )

    def prepare(self, request: Any) -> Optional[dict]:
        """Ask for the mask on verl's ``GenerateReqInput`` (edited in place); the request body as
        the adapter checks it, or None when the request is served unrecorded."""
        params = request.sampling_params or {}
        temperature = params.get("temperature")
        if temperature is None or temperature < _GREEDY_EPS:
            _unrecordable(self.replay, params, "SGLang", f"temperature={temperature!r} samples greedily")
            return None
        body = {"return_sampling_mask": True, "sampling_logprobs_mode": "selected", "sampling_params": params}
        try:
            check_sglang_request(body, mask_max_tokens=self.mask_max_tokens)
        except ValueError as exc:
            _unrecordable(self.replay, params, "SGLang", str(exc))
            return None
        request.return_sampling_mask = True
        request.sampling_logprobs_mode = "selected"
        return body

    def read(self, response: Mapping[str, Any], body: Mapping[str, Any]) -> tuple[RaggedSupport, dict, Any]:
        """(n CSR rows, flag counts, the sampler's log-probs (n,)) of one response dict."""
        result = support_from_sglang_meta_info(
            response.get("meta_info") or {}, list(response.get("output_ids") or []), width=self.replay.width,
            vocab_size=self.vocab_size, sampling_params=body["sampling_params"],
        )
        rows, flags = _rows(result)
        return rows, flags, result.logprobs


class _RecordingTokenizerManager:
    """verl's ``self.tokenizer_manager`` with ``generate_request`` recording the support.

    verl awaits one item of ``generate_request(request, None)`` (a non-streaming request:
    one dict, ``output_ids`` and ``meta_info``); the rows of that item are left in
    ``sink[request.rid]``.
    """

    def __init__(self, manager: Any, recorder: SglangSupportRecorder, sink: dict):
        self._manager, self._recorder, self._sink = manager, recorder, sink

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def generate_request(self, request: Any, *args: Any, **kwargs: Any):
        body = self._recorder.prepare(request)
        stream = self._manager.generate_request(request, *args, **kwargs)
        if body is None:
            return stream
        return self._record(stream, body, request.rid)

    async def _record(self, stream, body: Mapping[str, Any], rid: str):
        async for output in stream:
            self._sink[rid] = await asyncio.to_thread(self._recorder.read, output, body)  # off the event loop
            yield output


# ---------------------------------------------------------------------------------- TokenOutput


def attach_support(output: Any, recorded: Optional[tuple], *, replace_logprobs: bool = False) -> Any:
    """Put recorded rows into ``TokenOutput.extra_fields`` (edited in place and returned).

    Args:
        output: verl's ``TokenOutput`` as its server returned it.
        recorded: ``(rows, flags)`` or ``(rows, flags, logprobs)`` from a recorder, or None
            when the request was not recorded (the output is returned unchanged).
        replace_logprobs: set ``log_probs`` to the recorded log-probs when verl asked for
            log-probs (SGLang: verl's are over the whole vocabulary).

    Raises:
        ValueError when the rows do not match the output's tokens. verl empties
        ``token_ids`` of an SGLang response whose log-prob count is off, and of an aborted
        request; its rows are then dropped with it.
    """
    if recorded is None:
        return output
    rows, flags = recorded[0], recorded[1]
    n = len(output.token_ids)
    if n == 0:
        return output
    if rows.num_rows != n:
        raise ValueError(
            f"replay: {rows.num_rows} support rows for {n} generated tokens in one TokenOutput; the engine's output "
            f"and verl's token_ids are misaligned"
        )
    output.extra_fields[SUPPORT_KEY] = encode_response_rows(rows, output.token_ids)  # what crosses Ray: the compact rows
    if flags:
        output.extra_fields[FLAGS_KEY] = dict(flags)
    if replace_logprobs and output.log_probs is not None and len(recorded) > 2 and recorded[2] is not None:
        output.log_probs = [float(v) for v in recorded[2].tolist()]
    return output


def _vocab_size(model_config: Any) -> Optional[int]:
    hf = getattr(model_config, "hf_config", None)
    size = getattr(getattr(hf, "text_config", hf), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


class _VllmServerReplay:
    """Mixed in before verl's ``vLLMHttpServer``."""

    async def launch_server(self, *args, **kwargs):
        await super().launch_server(*args, **kwargs)
        replay = RolloutReplay.from_rollout_config(self.config)
        engine = getattr(self, "engine", None)
        self._replay_sink: dict = {}
        if not replay.enabled or engine is None:  # run_headless nodes serve no requests
            return
        engine_kwargs = (_plain(_field(self.config, "engine_kwargs")) or {}).get("vllm") or {}
        path = "mask" if engine_kwargs.get("return_sampling_mask") else "logprobs"
        check_vllm_engine(engine.vllm_config, path=path, top_k=replay.top_k)
        recorder = VllmSupportRecorder(replay, path=path, vocab_size=_vocab_size(self.model_config))
        self.engine = RecordingVllmEngine(engine, recorder, self._replay_sink)

    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        try:
            output = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
            return attach_support(output, getattr(self, "_replay_sink", {}).get(request_id))
        finally:
            getattr(self, "_replay_sink", {}).pop(request_id, None)


class _SglangServerReplay:
    """Mixed in before verl's ``SGLangHttpServer``."""

    async def launch_server(self, *args, **kwargs):
        await super().launch_server(*args, **kwargs)
        replay = RolloutReplay.from_rollout_config(self.config)
        manager = getattr(self, "tokenizer_manager", None)
        self._replay_sink: dict = {}
        if not replay.enabled or manager is None:
            return
        from sglang.srt.managers.io_struct import GenerateReqInput

        SglangSupportRecorder.check_engine(GenerateReqInput)
        limit = getattr(getattr(manager, "server_args", None), "sampling_mask_max_tokens", SGLANG_DEFAULT_MASK_MAX_TOKENS)
        recorder = SglangSupportRecorder(replay, mask_max_tokens=limit, vocab_size=_vocab_size(self.model_config))
        self.tokenizer_manager = _RecordingTokenizerManager(manager, recorder, self._replay_sink)

    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        try:
            output = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
            recorded = getattr(self, "_replay_sink", {}).get(request_id)
            return attach_support(output, recorded, replace_logprobs=True)
        finally:
            getattr(self, "_replay_sink", {}).pop(request_id, None)


_CLASSES: dict = {}


def _replica_class(engine: str) -> type:
    if engine in _CLASSES:
        return _CLASSES[engine]
    import ray

    # verl's own loaders (workers/rollout/replica.py) do the environment set-up its server
    # modules need at import (SGLang's CPU-engine variable, a stand-in for an absent vLLM).
    from verl.workers.rollout.replica import _load_sglang, _load_vllm

    replica_base = _load_vllm() if engine == "vllm" else _load_sglang()
    server_base = importlib.import_module(replica_base.__module__)
    if engine == "vllm":
        server = type("ReplayvLLMHttpServer", (_VllmServerReplay, server_base.vLLMHttpServer), {"__module__": __name__})
    else:
        server = type("ReplaySGLangHttpServer", (_SglangServerReplay, server_base.SGLangHttpServer), {"__module__": __name__})

    def __init__(self, *args, **kwargs):
        replica_base.__init__(self, *args, **kwargs)
        if RolloutReplay.from_rollout_config(self.config).enabled and not (self.is_reward_model or self.is_teacher_model):
            self.server_class = ray.remote(server)

    name = "ReplayvLLMReplica" if engine == "vllm" else "ReplaySGLangReplica"
    _CLASSES[engine] = type(name, (replica_base,), {"__init__": __init__, "__module__": __name__, "server": server})
    return _CLASSES[engine]


def replay_vllm_replica_class() -> type:
    """verl's ``vLLMReplica`` whose servers record supports when its rollout config has replay on."""
    return _replica_class("vllm")


def replay_sglang_replica_class() -> type:
    """verl's ``SGLangReplica`` whose servers record supports when its rollout config has replay on."""
    return _replica_class("sglang")
