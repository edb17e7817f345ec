"""``ReplayGRPOTrainer``: TRL 1.16's ``GRPOTrainer`` with support-conditioned replay (docs/design.md §9).

Where TRL makes log-probs (trl/trainer/grpo_trainer.py): ``_get_per_token_logps_and_entropies``
scores the old policy and the reference (in ``_generate_and_score_completions``) and the
policy (in ``_compute_loss``) through a fused full-vocabulary LM head
(``add_fused_lm_head`` in trl/trainer/utils.py). This subclass changes four methods and
nothing else:

- ``_generate_single_turn``: records each token's support while TRL's own code samples --
  around ``model.generate`` with the capture hooks of :mod:`nemo_replay.rollout.capture.hf` (after
  the temperature / top-k / top-p / min-p warpers), or from vLLM's processed log-probs
  (``logprobs = top_k + 17`` within the engine's ``max_logprobs``, so a support tied at the
  k-th value shows whole) through the vLLM adapter. It returns the processed log-prob of
  every sampled token, which TRL keeps as ``sampling_per_token_logps``.
- ``_generate_and_score_completions``: puts one record per completion into the batch dict
  (``replay_records``), where TRL's shuffle and split carry it with its row.
- ``_compute_loss``: makes the batch's records the ones the policy pass scores over.
- ``_get_per_token_logps_and_entropies``: runs the model forward as TRL does (same inputs,
  same autocast) and hands the completion positions to
  :func:`nemo_replay.scoring.entry.score_positions`: logits ``(B, C, V)`` in logits mode, or the
  backbone's hidden states ``(B, C, H)`` with the LM-head weight in hidden mode, which never
  builds ``(B, C, V)`` logits.

Metrics (in TRL's logs, per logging step, over every process): ``replay/mismatch_mean`` and
``replay/mismatch_max`` -- ``|rollout - trainer|`` log-prob over the recorded supports with
the weights that sampled (the engine's numeric gap: kernels, KV cache, precision); in logits
mode also ``replay/support_mass_mean`` (probability the truncation kept),
``replay/normalisation_gap_mean`` (``-log`` of it: what scoring over the full vocabulary adds)
and ``replay/full_vocab_mismatch_mean`` / ``_max`` (``|rollout - trainer|`` had the trainer
scored over the full vocabulary, as TRL does), and ``replay/full_vocab_entropy`` (TRL's own
``entropy`` metric, which ``entropy`` no longer is: see the class doc).

Precision: on CPU ``GRPOConfig`` turns bf16 autocast on by default; inside ``train()``
accelerate wraps the model's forward in it, so ``generate``'s KV-cached steps and the
trainer's full forward both run under bf16 and round differently. That numeric gap shows in
``replay/mismatch_*``; pin ``bf16=False`` for an exact comparison. ``cast_lm_head_to_fp32``
is honoured as TRL's fused head does it: the trainer's LM head projects float32 hidden
states outside autocast (logits mode: :meth:`ReplayGRPOTrainer._float32_lm_head`; hidden
mode always projects in float32). ``generate`` still runs TRL's cast head under autocast, so
with bf16 the flag moves the trainer's scores, not the sampler's.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context

from nemo_replay.diagnostics import StepStats, record_mismatch
from nemo_replay.integrations.trl.records import (
    RECORDS_KEY,
    completion_channels,
    records_from_capture,
    records_from_vllm,
)
from nemo_replay.integrations.trl.settings import ReplaySettings, as_settings
from nemo_replay.rollout.capture.hf import SupportRecorder, check_generation_config, record_support
from nemo_replay.rollout.capture.sampler import check_capture_settings
from nemo_replay.rollout.engines.vllm import VLLM_TIE_MARGIN, vllm_row_width
from nemo_replay.scoring.entry import score_positions
from nemo_replay.strategies.fsdp.head import hidden_mode_problems

__all__ = ["ReplayGRPOTrainer"]

#: vLLM 0.33's default ``max_logprobs`` (vllm/config/model.py); colocate mode does not raise it.
_VLLM_MAX_LOGPROBS = 20
#: Per-process statistics of one measured pass, gathered over processes as one row.
class ReplayGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose log-probs are scored over the supports the sampler drew from.

    Args:
        *args, **kwargs: exactly ``GRPOTrainer``'s.
        replay: :class:`ReplaySettings` (or a dict of its fields); default on, logits mode.

    Sampling settings are read where they take effect: ``GRPOConfig``'s fields with
    ``generation_kwargs`` over them, as TRL builds its ``GenerationConfig`` (or vLLM's
    sampling parameters), so truncation set only in ``generation_kwargs`` is replayed.

    Entropy: with replay on, the per-token entropies TRL receives are the entropies of the
    distribution the policy is scored with, **renormalised over each token's recorded
    support**, not over the full vocabulary. Everything TRL builds on them changes meaning
    with it: the logged ``entropy`` metric (support entropy, lower than the full-vocabulary
    one: 1.10 vs 2.04 nats on the first step of ``tests/integrations/trl/test_trainer.py``),
    ``entropy_coef`` (the entropy bonus rewards spreading mass inside the support; tokens
    outside it get none) and ``top_entropy_quantile`` (the high-entropy token mask ranks
    tokens by support entropy; a token whose support has one member has entropy 0). In
    logits mode TRL's own full-vocabulary entropy is logged beside it as
    ``replay/full_vocab_entropy``, reduced exactly as TRL reduces ``entropy``; it reuses the
    logits the policy pass already holds (no extra forward, one row of ``(C, V)``
    temporaries at a time, no gradient). Hidden mode never builds those logits and does not
    log it.

    Raises:
        ValueError listing every setting replay cannot serve (tools, environments,
        ``rollout_func``, vision inputs, continuous batching, greedy or unbounded sampling,
        penalties, a ``generation_kwargs`` temperature other than ``GRPOConfig``'s, hidden
        mode on a model whose logits are not ``hidden @ W.T``), each once.
    """

    def __init__(self, *args, replay: Optional[ReplaySettings] = None, **kwargs):
        settings = as_settings(replay)
        super().__init__(*args, **kwargs)
        self.replay_settings = settings
        self._replay_active: Optional[list] = None  # records of the batch being scored
        self._replay_generated_at: Optional[int] = None  # global step of the last generation
        self._replay_measure = False
        self._replay_full_entropy: Optional[list] = None  # policy-pass full-vocabulary entropies (logits mode)
        self._replay_sampling: Optional[dict] = None  # effective temperature / top_k / top_p / min_p (_effective_sampling)
        self._replay_max_logprobs = _VLLM_MAX_LOGPROBS  # the engine's cap; a server reports its own (_vllm_problems)
        self._replay_stats = {"train": StepStats(), "eval": StepStats()}
        if not settings.enabled:
            return
        problems = self._replay_problems()
        if problems:
            raise ValueError("ReplayGRPOTrainer cannot replay this setup:\n  - " + "\n  - ".join(problems))
        if self.use_vllm:
            self._replay_vllm_request()

    def _replay_vllm_request(self) -> None:
        """What each vLLM request asks: the tie-margin log-prob count (:meth:`_vllm_logprobs`) and, colocated
        on a vLLM whose ``SamplingParams`` has it (0.24+), ``flat_logprobs=True``: one flat list a response
        instead of a dict and a ``Logprob`` a entry, half the memory held until ``generate`` returns. TRL
        passes ``generation_kwargs`` into ``SamplingParams`` (trl/generation/vllm_generation.py:662-683) and
        its ``extract_logprobs`` iterates a ``FlatLogprobs`` as it iterates the dicts (vllm/logprobs.py
        ``FlatLogprobs.__getitem__``). TRL's server mode sends the request to ``trl vllm-serve``, whose
        request fields replay does not extend: there the dicts stay."""
        self.vllm_generation.logprobs = self._vllm_logprobs(self._replay_sampling["top_k"])
        if self.vllm_mode == "colocate" and _vllm_sampling_field("flat_logprobs"):
            kwargs = dict(self.vllm_generation.generation_kwargs or {})
            kwargs.setdefault("flat_logprobs", True)
            self.vllm_generation.generation_kwargs = kwargs

    # ------------------------------------------------------------------ checks
    def _replay_problems(self) -> list[str]:
        """Every reason the recorded supports could not be replayed (one line each, with the fix)."""
        out = []
        unsupported = (
            (self.tools, "tools: tool results are appended to completions between sampled turns"),
            (self.environment_factories, "environment_factory: environments append tokens the sampler did not draw"),
            (self.rollout_func, "rollout_func: a custom rollout returns no supports"),
            (self._is_vlm, "a vision-language processor: vision inputs are not replayed"),
            (self.use_transformers_continuous_batching, "use_transformers_continuous_batching: generate_batch builds no logits processors to record from"),
        )
        out.extend(f"{why}; use GRPOTrainer (or ReplaySettings(enabled=False)) for this setup" for flag, why in unsupported if flag)
        sampling, problems = self._effective_sampling()
        out.extend(problems)
        top_k = sampling["top_k"]
        if top_k is None and sampling["top_p"] >= 1.0 and not sampling["min_p"]:
            out.append(
                "GRPOConfig (with its generation_kwargs) samples from the whole vocabulary (top_k=0, top_p=1.0, no "
                "min_p): there is no truncation to replay; set top_k, top_p or min_p (e.g. top_k=50, top_p=0.95), or "
                "use GRPOTrainer"
            )
        self._replay_sampling = sampling
        if self.use_vllm:
            out.extend(self._vllm_problems(top_k))
        if self.replay_settings.source == "hidden":
            out.extend(self._hidden_mode_problems())
        return out

    def _effective_sampling(self) -> tuple[dict, list[str]]:
        """The settings the sampler really uses, and every reason they cannot be captured (one line each).

        TRL builds them from ``GRPOConfig``'s fields with ``generation_kwargs`` over them: the
        ``GenerationConfig`` of ``generate`` (trl/trainer/grpo_trainer.py:1155-1173,
        ``generation_kwargs.update(args.generation_kwargs)``) or vLLM's sampling parameters
        (trl/generation/vllm_generation.py:662-672). So ``top_k=0`` with
        ``generation_kwargs={"top_k": 20}`` samples top-20. Each setting is checked once, where
        it takes effect; the scorer divides by ``GRPOConfig.temperature``, so an override of
        the temperature alone is refused.

        Returns:
            ``(dict(temperature, top_k, top_p, min_p), problems)``, ``top_k=None`` for no bound.
        """
        problems = []
        if self.use_vllm:
            params = dict(
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p or 0.0,
                repetition_penalty=self.repetition_penalty,
            )
            params.update((k, v) for k, v in (self.args.generation_kwargs or {}).items()
                          if k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty"))
            params["top_k"] = None if params["top_k"] in (None, 0) else params["top_k"]
            params["min_p"] = params["min_p"] or 0.0
            try:
                check_capture_settings(**params, where="GRPOConfig with its generation_kwargs")
            except ValueError as exc:
                problems.extend(line.strip()[2:] for line in str(exc).splitlines()[1:])
            sampling = {k: params[k] for k in ("temperature", "top_k", "top_p", "min_p")}
        else:
            gc = self.generation_config
            try:
                check_generation_config(gc, where="GRPOTrainer.generation_config")
            except ValueError as exc:
                problems.extend(line.strip()[2:] for line in str(exc).splitlines()[1:])
            sampling = dict(
                temperature=gc.temperature, top_k=None if gc.top_k in (None, 0) else gc.top_k,
                top_p=1.0 if gc.top_p is None else gc.top_p, min_p=gc.min_p or 0.0,
            )
        T = sampling["temperature"]
        if isinstance(T, (int, float)) and isinstance(self.temperature, (int, float)) and T > 0 and T != self.temperature:
            problems.append(
                f"generation_kwargs temperature={T} samples at another temperature than GRPOConfig.temperature="
                f"{self.temperature}, which TRL's scoring divides by; set GRPOConfig(temperature={T}) and drop it from "
                f"generation_kwargs"
            )
        return sampling, problems

    def _vllm_logprobs(self, top_k: int) -> int:
        """Log-probs each request asks vLLM for: ``ReplaySettings(vllm_logprobs=...)``, else the tie-margin
        width of :func:`~nemo_replay.rollout.engines.vllm.vllm_row_width` plus one, within the engine's
        ``max_logprobs``. vLLM < 0.33 keeps every token tied with the k-th value in a step of fewer than 8
        rows, so ``top_k + 1`` would not show such a support whole (docs/engines.md)."""
        if self.replay_settings.vllm_logprobs:
            return self.replay_settings.vllm_logprobs
        return vllm_row_width(top_k, self._replay_max_logprobs) + 1

    def _vllm_problems(self, top_k: Optional[int]) -> list[str]:
        if top_k is None or top_k < 2:
            return ["use_vllm=True: vLLM's log-prob lists show a whole support only when top_k > 1 bounds it; set GRPOConfig(top_k=...)"]
        out = []
        if self.vllm_mode == "server" and self.accelerator.is_main_process:
            config = self.vllm_generation.vllm_client.get_server_info()["model_config"]
            mode = config["logprobs_mode"]
            if mode != "processed_logprobs":
                out.append(f"the vLLM server runs with --logprobs-mode {mode}; restart it with --logprobs-mode processed_logprobs")
            self._replay_max_logprobs = config.get("max_logprobs", _VLLM_MAX_LOGPROBS)
        cap = self._replay_max_logprobs
        if cap not in (None, -1) and cap < top_k + 1:
            where = "colocated vLLM (TRL starts it with vLLM's default)" if self.vllm_mode == "colocate" else "the vLLM server"
            out.append(f"{where} returns at most {cap} log-probs per token (max_logprobs); a whole support needs top_k + 1 = "
                       f"{top_k + 1}: lower top_k" + ("" if self.vllm_mode == "colocate" else f" or restart it with --max-logprobs {top_k + 1 + VLLM_TIE_MARGIN}"))
            return out
        wanted = self._vllm_logprobs(top_k)
        if wanted < top_k + 1:
            out.append(f"ReplaySettings(vllm_logprobs={wanted}) must be >= top_k + 1 = {top_k + 1} to show each whole support")
        elif cap not in (None, -1) and wanted > cap:
            out.append(f"ReplaySettings(vllm_logprobs={wanted}) is more than the {cap} log-probs per token vLLM returns "
                       f"(max_logprobs); ask for at most {cap}")
        return out

    def _hidden_mode_problems(self) -> list[str]:
        problems = hidden_mode_problems(self._hf_model(self.model))
        return [f"source='hidden': {p}; use source='logits'" for p in problems]

    def _hf_model(self, model):
        """The transformers model inside accelerate / PEFT wrappers."""
        model = self.accelerator.unwrap_model(model)
        return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model

    # ------------------------------------------------------------------ generation
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not self.replay_settings.enabled:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if self.use_vllm:
            return self._vllm_single_turn(prompt_ids, images, num_generations)
        recorder = SupportRecorder(self.temperature)
        with record_support(self.accelerator.unwrap_model(self.model_wrapped), recorder):
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        width = self.replay_settings.row_width or self._replay_sampling["top_k"]
        vocab = self._hf_model(self.model).config.get_text_config().vocab_size
        captured = recorder.finish(completion_ids, row_width=width, vocab_size=vocab)
        self._replay_active = records_from_capture(completion_ids, captured, vocab_size=vocab)
        return completion_ids, captured.logprob_lists()

    def _vllm_single_turn(self, prompt_ids, images, num_generations):
        """TRL's vLLM turn with ``logprobs`` of :meth:`_vllm_logprobs`, read into supports by the vLLM adapter."""
        if self.state.global_step != self._last_loaded_step:
            with profiling_context(self, "sync_weights"):
                self.vllm_generation.sync_weights()
            self._last_loaded_step = self.state.global_step
        _, completion_ids, logprobs, token_ids = self.vllm_generation.generate(
            prompts=prompt_ids, images=images, num_generations=num_generations,
            profiler=profiling_context(self, "vLLM.generate"),
        )
        params = dict(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty, logprobs=self.vllm_generation.logprobs,
        )
        params.update(self.args.generation_kwargs or {})
        vocab = self._hf_model(self.model).config.get_text_config().vocab_size
        records = records_from_vllm(completion_ids, logprobs, token_ids, width=None, vocab_size=vocab, sampling_params=params)
        self._replay_active = records
        return completion_ids, [r.logprobs.tolist() for r in records]

    def _generate_and_score_completions(self, inputs):
        if not self.replay_settings.enabled:
            return super()._generate_and_score_completions(inputs)
        self._replay_active = None
        try:
            # _generate_single_turn records the batch; TRL's old-policy and reference passes score over it.
            output = super()._generate_and_score_completions(inputs)
            records = self._replay_active
        finally:
            self._replay_active = None
        if records is None:
            raise ValueError("ReplayGRPOTrainer: generation recorded no supports (was _generate_single_turn bypassed?)")
        output[RECORDS_KEY] = records
        self._replay_generated_at = self.state.global_step
        return output

    # ------------------------------------------------------------------ scoring
    @contextlib.contextmanager
    def _scoring(self, records: list, measure: bool, full_entropy: Optional[list] = None):
        """Make ``records`` the supports of the scoring passes inside; ``full_entropy`` collects, in
        logits mode, each policy pass's full-vocabulary entropy ``(b, C)`` (:meth:`_score_chunk`)."""
        self._replay_active, self._replay_measure, self._replay_full_entropy = records, measure, full_entropy
        try:
            yield
        finally:
            self._replay_active, self._replay_measure, self._replay_full_entropy = None, False, None

    def _compute_loss(self, model, inputs):
        if not self.replay_settings.enabled:
            return super()._compute_loss(model, inputs)
        records = inputs.get(RECORDS_KEY)
        if records is None:
            raise ValueError(
                f"ReplayGRPOTrainer: the batch has no {RECORDS_KEY!r}; batches must come from this trainer's "
                f"_generate_and_score_completions (TRL's shuffle and split keep them)"
            )
        # With the weights that sampled (no optimizer step since generation): measure the mismatch.
        measure = self.state.global_step == self._replay_generated_at
        full_entropy = [] if self.replay_settings.source == "logits" else None
        with self._scoring(records, measure, full_entropy):
            loss = super()._compute_loss(model, inputs)
        if full_entropy:
            self._log_full_vocab_entropy(torch.cat(full_entropy), inputs["completion_mask"])
        return loss

    def _log_full_vocab_entropy(self, entropy: torch.Tensor, completion_mask: torch.Tensor) -> None:
        """``replay/full_vocab_entropy``: TRL's own ``entropy`` metric, beside the support entropy it now logs.

        The same reduction as TRL's ``entropy`` (``global_masked_mean`` over the completion
        mask, summed over processes, in trl/trainer/grpo_trainer.py ``_compute_loss``), so the
        two read side by side in every log.
        """
        mask = completion_mask.to(entropy.device, torch.float32)
        totals = self.accelerator.reduce(torch.stack([(entropy * mask).sum(), mask.sum()]), reduction="sum")
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["replay/full_vocab_entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **vision,
    ):
        if not self.replay_settings.enabled:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **vision
            )
        if any(v is not None for v in vision.values()):
            raise ValueError("ReplayGRPOTrainer: vision inputs reached the scorer; replay serves text-only models")
        if self._replay_active is None:
            raise ValueError("ReplayGRPOTrainer: a scoring pass ran outside generation or the loss; no supports are active")
        C = logits_to_keep
        batch_size = batch_size or input_ids.size(0)
        logps, entropies, aux = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            lp, ent, a = self._score_chunk(
                model, input_ids[start:end], attention_mask[start:end], C, self._replay_active[start:end],
                compute_entropy, compute_aux_loss,
            )
            logps.append(lp)
            entropies.append(ent)
            aux.append(a)
        return (
            torch.cat(logps),
            torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux).mean() if compute_aux_loss else None,
        )

    def _score_chunk(self, model, input_ids, attention_mask, C, records, compute_entropy, compute_aux_loss):
        """(log-probs (b, C) float32, entropy (b, C) or None, aux loss or None) of one chunk."""
        done = completion_channels(records, input_ids[:, -C:], attention_mask[:, -C:])
        with self.accelerator.autocast():
            source, weight, aux = self._replay_forward(model, input_ids, attention_mask, C, compute_aux_loss)
        mass = self._replay_measure and self.replay_settings.source == "logits"
        with torch.autocast(source.device.type, enabled=False):  # the scorer's math runs in float32
            scores = score_positions(
                source, done.channels, done.support, temperature=float(self.temperature), lm_head_weight=weight,
                compute_entropy=compute_entropy, compute_support_mass=mass, chunk_size=self.replay_settings.chunk_size,
            )
        logps = scores.logprobs.float()
        if self._replay_measure:
            self._record_mismatch(done, logps.detach(), scores.support_logmass)
        if compute_entropy and self._replay_full_entropy is not None:  # logits mode: the full logits are here
            self._replay_full_entropy.append(_full_vocab_entropy(source, float(self.temperature)))
        return logps, (scores.entropy.float() if compute_entropy else None), aux

    def _replay_forward(self, model, input_ids, attention_mask, C, compute_aux_loss):
        """The model forward on TRL's inputs: (source, lm_head_weight or None, aux loss or None).

        Logits mode keeps ``C + 1`` logit columns and drops the last (it predicts past the
        end): column ``j`` is the logit at ``P - 1 + j``. Hidden mode keeps one logit column
        and reads the backbone's last hidden states at the same positions through a forward
        hook, so the pass still runs through ``model`` (DDP / FSDP wrappers see it).
        """
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if compute_aux_loss:
            kwargs["output_router_logits"] = True
        if self.replay_settings.source == "logits":
            with self._float32_lm_head(model):
                out = model(**kwargs, logits_to_keep=C + 1)
            return out.logits[:, :C], None, getattr(out, "aux_loss", None)
        hf = self._hf_model(model)
        kept = {}

        def keep(_module, _args, output):
            kept["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

        handle = hf.base_model.register_forward_hook(keep)
        try:
            out = model(**kwargs, logits_to_keep=1)
        finally:
            handle.remove()
        weight = hf.get_output_embeddings().weight
        if hasattr(weight, "full_tensor"):  # FSDP2 shards the head as a DTensor
            weight = weight.full_tensor()
        return kept["hidden"][:, -C - 1 : -1], weight, getattr(out, "aux_loss", None)

    @contextlib.contextmanager
    def _float32_lm_head(self, model):
        """Honour ``GRPOConfig.cast_lm_head_to_fp32`` in logits mode: the LM head as TRL's fused head runs it.

        TRL casts the head's weight to float32 (trl/trainer/grpo_trainer.py:1011-1047) and its
        fused head projects float32 hidden states outside autocast (trl/trainer/utils.py,
        ``add_fused_lm_head``, ``hidden_states.float()`` under ``torch.autocast(..., enabled=False)``).
        The model's own forward calls the head inside TRL's autocast, which would project in
        bf16 whatever the weight's dtype; for the duration of one forward the head's input is
        cast to float32 and autocast is off around it, so the scorer gets float32 logits. The
        model's post-head steps (soft-capping, logit scales) run as they are. Hidden mode needs
        nothing: the scorer projects in float32 whatever the flag.
        """
        if not getattr(self.args, "cast_lm_head_to_fp32", False):
            yield
            return
        head = self._hf_model(model).get_output_embeddings()
        own = "forward" in vars(head)  # TRL's cast replaces the head's forward on the instance
        inner = head.forward

        def forward(hidden_states, *args, **kwargs):
            with torch.autocast(hidden_states.device.type, enabled=False):
                return inner(hidden_states.float(), *args, **kwargs)

        head.forward = forward
        try:
            yield
        finally:
            if own:
                head.forward = inner
            else:
                del head.forward

    # ------------------------------------------------------------------ metrics
    def _record_mismatch(self, done, logps: torch.Tensor, logmass: Optional[torch.Tensor]) -> None:
        """Add this pass's mismatch (:func:`nemo_replay.diagnostics.record_mismatch`) to the mode's sums; no host read."""
        mode = "train" if self.model.training else "eval"
        record_mismatch(self._replay_stats[mode], done.rollout_logprobs, logps, done.channels.loss_mask, log_mass=logmass)

    def log(self, logs: dict, start_time: Optional[float] = None) -> None:
        """TRL's log, with the replay metrics since the last one (``replay/`` + the diagnostics' names),
        over every process: one all-reduce pair and one host read per logging step."""
        mode = "train" if self.model.training else "eval"
        stats = self._replay_stats[mode]
        if self.replay_settings.enabled and stats.sums:
            values = stats.reduce(across_ranks=self.accelerator.num_processes > 1)
            if math.isfinite(values["mismatch_mean"]):  # some token was scored since the last log
                metrics = self._metrics[mode]
                for name, value in values.items():
                    if math.isfinite(value):
                        metrics[f"replay/{name}"] = [value]
            self._replay_stats[mode] = StepStats()
        super().log(logs, start_time)


def _vllm_sampling_field(name: str) -> bool:
    """Whether the installed vLLM's ``SamplingParams`` declares ``name`` (False without vLLM)."""
    try:
        from vllm import SamplingParams
    except ImportError:
        return False
    fields = getattr(SamplingParams, "__struct_fields__", None) or getattr(SamplingParams, "__dataclass_fields__", ())
    return name in fields


@torch.no_grad()
def _full_vocab_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of ``softmax(logits / T)`` over the whole vocabulary: what TRL logs as ``entropy``.

    Args:
        logits: (b, C, V), any float dtype, the logits the scorer received (no copy kept).

    Returns:
        (b, C), float32. One row of ``(C, V)`` float32 temporaries at a time, no gradient.
    """
    out = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
    for i in range(logits.shape[0]):
        logp = torch.log_softmax(logits[i].float() / temperature, dim=-1)
        out[i] = -(logp.exp() * logp).sum(-1)
    return out
