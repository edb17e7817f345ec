"""The main job's rollout engine: transformers' ``generate`` on its own copy of the weights.

``generation.engine: hf`` (docs/design.md §7). The engine stands where vLLM or SGLang stand
in a real RL system: its own weights (cast to ``generation.dtype``), synced from the policy
before every rollout, its own code path (a KV cache, one new token per forward after the
prompt), and :func:`nemo_replay.rollout.capture.hf.generate_with_support` recording each token's
support after transformers' warpers. The trainer then scores with its own forward; what
remains between the two with replay on is the engine's numeric gap (KV cache, kernels,
precision), and with replay off the normalisation gap comes on top.

Randomness: ``generate`` draws from the global torch RNG, so each rollout runs inside
``torch.random.fork_rng`` seeded from the trainer's sampling generator. Runs are repeatable
and the global RNG does not move.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch

from nemo_replay.rollout.capture.hf import generate_with_support
from nemo_replay.trainer.generation import Rollout, SamplingSettings, left_pad, rollout_batch

__all__ = ["HFEngine"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine:
    """transformers' ``generate`` with support capture on an engine copy of a policy.

    Args:
        policy: the trainer's Hugging Face causal LM (plain or FSDP2-sharded); its config
            builds the engine model, its weights fill it at every :meth:`rollout`.
        settings: the sampler settings (``generation.*``).
        dtype: the engine's parameter dtype name (``float32``, ``bfloat16``, ``float16``).
        device: where the engine runs.
        pad_id: the token finished rows continue with.
    """

    def __init__(self, policy, settings: SamplingSettings, *, dtype: str, device: torch.device, pad_id: int = 0):
        from transformers import AutoModelForCausalLM, GenerationConfig

        if dtype not in _DTYPES:
            raise ValueError(f"HFEngine: dtype={dtype!r}; expected one of {', '.join(_DTYPES)} (generation.dtype)")
        self.settings = settings
        self.device = torch.device(device)
        self.pad_id = pad_id
        forked = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked):  # random init of the copy must not move the run's RNG
            model = AutoModelForCausalLM.from_config(copy.deepcopy(policy.config))
        self.model = model.to(device=self.device, dtype=_DTYPES[dtype]).eval().requires_grad_(False)
        self.generation_config = GenerationConfig(
            do_sample=True,
            temperature=settings.temperature,
            top_k=settings.top_k or 0,  # 0: no top-k (None would take transformers' default of 50)
            top_p=settings.top_p,
            min_p=settings.min_p or None,
            max_new_tokens=settings.max_new_tokens,
            eos_token_id=settings.stop_token_id,
            pad_token_id=pad_id,
            use_cache=True,
        )
        # The engine's own config: no default of the policy's (an eos id from LlamaConfig) applies.
        self.model.generation_config = self.generation_config
        self._names = [name for name, _ in self.model.named_parameters()]

    @torch.no_grad()
    def sync(self, policy) -> None:
        """Copy the policy's weights into the engine (cast to its dtype).

        Collective under FSDP2 (each sharded parameter is gathered with ``full_tensor``): every
        rank calls it, in the same parameter order.
        """
        source = dict(policy.named_parameters())
        missing = [n for n in self._names if n not in source]
        if missing or len(source) != len(self._names):
            extra = sorted(set(source) - set(self._names))
            raise ValueError(
                f"HFEngine.sync: the policy's parameters do not match the engine's (missing {missing[:4]}, extra "
                f"{extra[:4]}); the engine is built from the policy's config -- pass the same model"
            )
        for name, param in self.model.named_parameters():
            value = source[name]
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            param.copy_(value.detach())

    def rollout(self, policy, prompts: Sequence[torch.Tensor], *, seed: int, row_width: Optional[int] = None) -> Rollout:
        """Sync from ``policy``, sample one response per prompt, return the canonical batch.

        Args:
            policy: the trainer's model (weights to sync).
            prompts: B prompts, each (P_i,) int, P_i >= 1.
            seed: seeds ``generate``'s draws (a forked RNG).
            row_width: fixed support width (``replay.sample_support.top_k``); None: ragged rows.

        Returns:
            a :class:`~nemo_replay.trainer.generation.Rollout` on the engine's device; a
            response ends after a sampled ``stop_token_id`` (kept, with its row).
        """
        self.sync(policy)
        input_ids, attention_mask = left_pad(prompts, self.pad_id, self.device)
        forked = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked):
            torch.manual_seed(seed)
            out = generate_with_support(
                self.model, input_ids, attention_mask, self.generation_config,
                row_width=row_width or self.settings.row_width, vocab_size=self.model.config.vocab_size,
            )
        captured = out.captured
        return rollout_batch(
            prompts, out.completions, captured.logprobs, captured.support,
            row_width=row_width or self.settings.row_width, pad_id=self.pad_id, device=self.device,
        )
