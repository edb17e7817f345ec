"""The Hugging Face side of the reference trainer: model, FSDP2 sharding, generation forward.

Used with the ``fsdp`` strategy. Ranks are laid out as ``[dp, sp]``: the ``sp`` consecutive
ranks of one Ulysses group hold the same rollouts, and FSDP2 shards every parameter over
all ranks (the strategy rescales the gradient of each SP slice so FSDP's average over the
world is the data-parallel average; see :mod:`nemo_replay.strategies.fsdp.strategy`).

Rollouts come from transformers' ``generate`` on an engine copy of the weights
(``generation.engine: hf``, :meth:`HFBackend.build_engine`), or from the module the trainer
scores with (``generation.engine: trainer``): the left-padded buffer, with
``position_ids = cumsum(attention_mask) - 1`` (the positions the strategy gives every
trajectory), under ``torch.no_grad``.
"""

from __future__ import annotations

import copy
import torch
import torch.distributed as dist

from nemo_replay.trainer.config.schema import RecipeConfig
from nemo_replay.layout.canonical import position_ids
from nemo_replay.distributed.compat import fsdp2_names
from nemo_replay.trainer.runtime import collective_timeout

__all__ = ["HFBackend", "build_hf_model"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_hf_model(cfg: RecipeConfig):
    """A causal LM from ``cfg.model``: ``pretrained`` from a local path, else built from the sizes.

    ``num_experts > 0`` builds a Mixtral-style MoE, otherwise a Llama. Weights come from the
    global torch RNG: seed it identically on every rank before calling.
    """
    import transformers

    m = cfg.model
    dtype = _DTYPES[m.dtype]
    if m.pretrained:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            m.pretrained, dtype=dtype, attn_implementation=m.attn_implementation
        )
        if model.config.vocab_size != m.vocab_size:
            raise ValueError(
                f"model.vocab_size={m.vocab_size} but {m.pretrained} has a vocabulary of {model.config.vocab_size}; "
                f"set model.vocab_size={model.config.vocab_size} (and task.num_symbols for the task's token range)"
            )
        return model
    common = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=False,
        attn_implementation=m.attn_implementation,
    )
    if m.num_experts > 0:
        config = transformers.MixtralConfig(num_local_experts=m.num_experts, num_experts_per_tok=m.moe_top_k, **common)
        model = transformers.MixtralForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.to(dtype)


class HFBackend:
    """Model, groups and generation forward for the ``fsdp`` strategy.

    Args:
        cfg: the validated recipe.
        device: this rank's device.
        distributed: whether a default process group is initialised (FSDP2 shards over it).
    """

    #: Rollout engines this backend serves (``generation.engine``), preferred first.
    rollout_engines = ("hf", "trainer", "vllm", "vllm-server")

    def __init__(self, cfg: RecipeConfig, device: torch.device, distributed: bool):
        self.cfg = cfg
        self.device = device
        self.distributed = distributed
        world = dist.get_world_size() if distributed else 1
        rank = dist.get_rank() if distributed else 0
        sp = cfg.parallel.sequence
        self.sp_group = None
        if sp > 1:
            # Every rank creates every group (new_group is collective), keeps its own.
            for start in range(0, world, sp):
                group = dist.new_group(list(range(start, start + sp)), timeout=collective_timeout(cfg))
                if start <= rank < start + sp:
                    self.sp_group = group
        self.dp_size = world // sp
        self.dp_rank = rank // sp
        self.vocab_size = cfg.model.vocab_size

    # ------------------------------------------------------------------ models
    def build_models(self):
        """(policy, reference): equal weights, the reference frozen; both sharded when distributed."""
        policy = build_hf_model(self.cfg)
        reference = copy.deepcopy(policy).requires_grad_(False).eval()
        # Eval mode for the policy too: with dropout the scored distribution would not be the
        # sampled one. Gradients do not depend on the mode.
        policy.eval()
        return self._shard(policy), self._shard(reference)

    def _shard(self, model):
        model = model.to(self.device)
        if not self.distributed:
            return model
        from torch.distributed.device_mesh import init_device_mesh
        fully_shard, _ = fsdp2_names()

        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        for layer in model.get_decoder().layers:
            fully_shard(layer, mesh=mesh)
        head = model.get_output_embeddings()
        if head is not None and head.weight is not model.get_input_embeddings().weight:
            fully_shard(head, mesh=mesh)  # its own unit: hidden mode unshards only the head
        fully_shard(model, mesh=mesh)
        return model

    def build_engine(self, policy, settings, engine: str = "hf"):
        """The rollout engine holding its own copy of ``policy``'s weights, in ``generation.dtype``
        (null: ``model.dtype``): ``hf`` (:class:`~nemo_replay.trainer.backends.hf_engine.HFEngine`),
        ``vllm`` (:class:`~nemo_replay.trainer.backends.vllm_engine.VLLMEngine`) or ``vllm-server``
        (:class:`~nemo_replay.trainer.backends.vllm_server.VLLMServerEngine`)."""
        dtype, v = self.cfg.generation.dtype or self.cfg.model.dtype, self.cfg.generation.vllm
        if engine == "vllm":
            from nemo_replay.trainer.backends.vllm_engine import VLLMEngine

            return VLLMEngine(policy, settings, dtype=dtype, device=self.device, memory_share=v.memory_share)
        if engine == "vllm-server":
            from nemo_replay.trainer.backends.vllm_server import VLLMServerEngine

            return VLLMServerEngine(policy, settings, dtype=dtype, device=self.device, memory_share=v.memory_share,
                                    url=v.url, start_timeout=v.start_timeout)
        from nemo_replay.trainer.backends.hf_engine import HFEngine

        return HFEngine(policy, settings, dtype=dtype, device=self.device)

    def make_strategy(self):
        from nemo_replay.strategies.registry import get_strategy

        return get_strategy(self.cfg.replay.strategy).factory(sp_group=self.sp_group)

    # ------------------------------------------------------------------ loop hooks
    @torch.no_grad()
    def next_token_logits(self, model, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, S) int64 left-padded tokens, (B, S) bool mask -> (B, V) float32 logits of the last column."""
        out = model(
            input_ids=sequences,
            attention_mask=attention_mask.long(),
            position_ids=position_ids(attention_mask),
            use_cache=False,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    def finish_gradients(self, model) -> None:
        """FSDP2 reduce-scatters gradients during backward: nothing left to do."""

    def clip_gradients(self, model, max_norm: float) -> float:
        """Clip the global gradient norm; returns the norm before clipping."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)
