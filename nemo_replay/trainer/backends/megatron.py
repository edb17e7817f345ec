"""The Megatron-Core side of the reference trainer: parallel state, GPTModel, generation forward.

Used with the ``megatron`` strategy. :class:`MegatronBackend` initialises
``megatron.core.parallel_state`` for the recipe's sizes (tensor, context, expert; the
default ``tp-cp-ep-dp-pp`` rank order) and reads the groups it needs **once**, in
:meth:`MegatronBackend._read_groups`; everything after that receives them explicitly.

Models are megatron-core ``GPTModel``s built from ``model.*`` (RoPE, RMSNorm, SwiGLU, no
biases; MoE with ``model.num_experts > 0``), with the Transformer Engine layer spec when TE
is importable on a GPU and the local spec otherwise. Packed THD sequences (and so context
parallelism) need TE. megatron-core allocates CUDA buffers, so this backend runs on GPUs.

Generation uses the strategy's own :class:`~nemo_replay.strategies.megatron.token_layout.TokenMetadataLayout`
for the model inputs, so the sampled logits come from the same token arrangement, position
ids and attention the roles use. Worked example, one trajectory ``_ a b`` (one left pad)
asking for its next token: a placeholder token ``?`` is appended, ``_ a b ?``; the layout
moves real tokens to the front, ``a b ? .`` with positions 0 1 2; the logit at ``b``
(canonical logit column 2 of the extended row) is the next-token distribution. Causal
attention keeps ``?`` out of it.

Gradients. Without megatron's DDP wrapper the policy role leaves plain ``.grad``s; the
backend averages them over the data-parallel x context-parallel group (the schedule
already scaled the loss for CP) and expert parameters over the expert-data-parallel
group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nemo_replay.trainer.config.schema import RecipeConfig

__all__ = ["MegatronBackend"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _has_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


class MegatronBackend:
    """Model, groups and generation forward for the ``megatron`` strategy.

    Args:
        cfg: the validated recipe (``parallel.pipeline`` 1: generation runs whole-model forwards).
        device: this rank's device.
        distributed: whether ``torch.distributed`` is initialised (the megatron spec asks the
            runtime for a process group, so it always is when the trainer builds this backend).
    """

    #: Rollout engines this backend serves (``generation.engine``), preferred first: vLLM loads the
    #: model's weights renamed and re-split into the Hugging Face Llama layout (:mod:`.megatron_export`).
    rollout_engines = ("trainer", "vllm", "vllm-server")

    def __init__(self, cfg: RecipeConfig, device: torch.device, distributed: bool = True):
        if not (distributed and dist.is_available() and dist.is_initialized()):
            raise ValueError("the megatron backend needs an initialised torch.distributed process group")
        if device.type == "cpu":
            try:  # megatron-core asks CUDA for its current device in layers and schedules
                torch.cuda.current_device()
            except (AssertionError, RuntimeError) as exc:
                raise ValueError(
                    "the megatron strategy runs megatron-core, which needs CUDA; run it on GPUs "
                    "(trainer.accelerator=gpu) or use replay.strategy=fsdp on the CPU"
                ) from exc
        from megatron.core import parallel_state as ps

        p = cfg.parallel
        self.cfg = cfg
        self.device = device
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=p.tensor, pipeline_model_parallel_size=p.pipeline,
                context_parallel_size=p.context, expert_model_parallel_size=p.expert,
                create_gloo_process_groups=False,
                # megatron-core builds its timedelta from minutes; fractions are kept.
                distributed_timeout_minutes=cfg.trainer.collective_timeout_s / 60,
            )
        self._read_groups()
        self.vocab_size = cfg.model.vocab_size

    def _read_groups(self) -> None:
        """The one read of ``parallel_state`` in the trainer."""
        from megatron.core import parallel_state as ps

        from nemo_replay.strategies.megatron.parallel import MegatronParallel

        self.parallel = MegatronParallel.from_parallel_state()
        self.dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.expert_dp_group = ps.get_expert_data_parallel_group()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()

    # ------------------------------------------------------------------ models
    def transformer_config(self):
        from megatron.core.transformer import TransformerConfig

        m, p = self.cfg.model, self.cfg.parallel
        dtype = _DTYPES[m.dtype]
        kwargs = dict(
            num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.intermediate_size,
            num_attention_heads=m.num_attention_heads, num_query_groups=m.num_key_value_heads,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=p.tensor, context_parallel_size=p.context,
            expert_model_parallel_size=p.expert, sequence_parallel=False,
            params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            use_cpu_initialization=self.device.type == "cpu",
        )
        if m.num_experts > 0:
            kwargs.update(
                num_moe_experts=m.num_experts, moe_router_topk=m.moe_top_k, moe_ffn_hidden_size=m.intermediate_size,
                moe_token_dispatcher_type="alltoall" if p.expert > 1 else "allgather",
                moe_router_load_balancing_type="none", moe_enable_routing_replay=self.cfg.replay.route_replay,
            )
        return TransformerConfig(**kwargs)

    def _gpt_model(self, config):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt import gpt_layer_specs as specs

        experts = self.cfg.model.num_experts or None
        if experts:
            from megatron.core.transformer.moe import moe_utils

            if not hasattr(moe_utils, "te_general_gemm"):
                # megatron-core binds this name only when Transformer Engine imports, yet every
                # MoE router forward reads it (moe_utils.RouterGatingLinearFunction).
                raise ValueError(
                    "this megatron-core build cannot run MoE routers without Transformer Engine "
                    "(megatron.core.transformer.moe.moe_utils.te_general_gemm is unbound); run in an NGC container "
                    "with Transformer Engine, or set model.num_experts=0"
                )
        if _has_te():
            spec = specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=bool(experts))
        else:
            if self.cfg.parallel.packing:
                raise ValueError(
                    "parallel.packing=true needs Transformer Engine's THD attention (a GPU with transformer_engine "
                    "installed); set parallel.packing=false"
                )
            spec = specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False)
        m = self.cfg.model
        return GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=m.vocab_size,
            max_sequence_length=m.max_position_embeddings, position_embedding_type="rope",
            share_embeddings_and_output_weights=False,
        )

    def build_models(self):
        """(policy, reference): equal weights (the reference loads the policy's), reference frozen."""
        config = self.transformer_config()
        if self.device.type == "cuda":
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(self.cfg.trainer.seed)
        policy = self._gpt_model(config).to(self.device)
        reference = self._gpt_model(config).to(self.device)
        reference.load_state_dict(policy.state_dict())
        reference.requires_grad_(False).eval()
        policy.eval()  # no dropout anywhere: the scored distribution must be the sampled one
        if config.bf16 or config.fp16:
            from megatron.core.transformer.module import Float16Module

            policy, reference = Float16Module(config, policy), Float16Module(config, reference)
        return policy, reference

    def build_engine(self, policy, settings, engine: str):
        """A vLLM rollout engine (``vllm`` or ``vllm-server``) holding the policy's weights in the
        Hugging Face Llama layout, in ``generation.dtype`` (null: ``model.dtype``); every sync
        gathers them over the tensor-parallel group (:func:`~.megatron_export.hf_weights`)."""
        from functools import partial

        from megatron.core import parallel_state as ps

        from nemo_replay.trainer.backends.megatron_export import hf_llama_config, hf_weights

        config = self.transformer_config()
        hf_config = hf_llama_config(config, vocab_size=self.vocab_size,
                                    max_position_embeddings=self.cfg.model.max_position_embeddings)
        group = ps.get_tensor_model_parallel_group() if self.cfg.parallel.tensor > 1 else None
        export = partial(hf_weights, config=config, tp_group=group)
        dtype, v = self.cfg.generation.dtype or self.cfg.model.dtype, self.cfg.generation.vllm
        if engine == "vllm":
            from nemo_replay.trainer.backends.vllm_engine import VLLMEngine

            return VLLMEngine(policy, settings, dtype=dtype, device=self.device, memory_share=v.memory_share,
                              config=hf_config, export=export)
        from nemo_replay.trainer.backends.vllm_server import VLLMServerEngine

        return VLLMServerEngine(policy, settings, dtype=dtype, device=self.device, memory_share=v.memory_share,
                                url=v.url, start_timeout=v.start_timeout, config=hf_config, export=export)

    def make_strategy(self):
        from nemo_replay.strategies.registry import get_strategy

        return get_strategy("megatron").factory(
            packed=self.cfg.parallel.packing, route_replay=self.cfg.replay.route_replay, parallel=self.parallel
        )

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def next_token_logits(self, model, sequences: torch.Tensor, attention_mask: torch.Tensor):
        """(B, S) left-padded tokens and mask -> (B, V) float32 next-token logits.

        With route replay on, returns ``(logits, routes)``: ``routes (B, S, layers, topk)``
        int64, the experts each token column was routed to in this forward (-1 on padding).
        """
        from nemo_replay.strategies.megatron.token_layout import TokenMetadataLayout
        from nemo_replay.strategies.megatron import routing

        par = self.parallel
        B = sequences.shape[0]
        seq = torch.cat([sequences, torch.zeros(B, 1, dtype=sequences.dtype, device=sequences.device)], 1)
        mask = torch.cat([attention_mask, torch.ones(B, 1, dtype=torch.bool, device=attention_mask.device)], 1)
        layout = TokenMetadataLayout.build(
            mask.cpu(), tp_size=par.tp_size, cp_size=par.cp_size, cp_rank=par.cp_rank, fp8=False,
            packed=self.cfg.parallel.packing,
        )
        routers = routing.moe_routers([model]) if self.cfg.replay.route_replay else []
        if routers:
            from megatron.core.transformer.moe.router_replay import RouterReplayAction

            for r in routers:
                r.router_replay.clear_indices()
                r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            packed = layout.packed_seq_params(self.device) if self.cfg.parallel.packing else None
            out = model(
                layout.input_ids(seq.cpu()).to(self.device), layout.position_ids(self.device), None,
                packed_seq_params=packed,
            )
            routes = self._recorded_routes(routers, layout, out.shape[:2]) if routers else None
        finally:
            routing.clear_routes(routers)
        logits = self._gather_vocab(out.float())  # (b, s, V)
        canon = layout.to_canonical(logits, 0.0, cp_group=par.cp_group)  # (B, S, V): logit column S-1 = last token
        if routes is None:
            return canon[:, -1]
        return canon[:, -1], routes

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        par = self.parallel
        if par.tp_size == 1 or logits.shape[-1] == self.vocab_size:
            return logits
        parts = [torch.empty_like(logits) for _ in range(par.tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=par.tp_group)
        return torch.cat(parts, -1)

    def _recorded_routes(self, routers, layout, local_shape) -> torch.Tensor:
        """Recorded router choices ``[s * b, topk]`` per MoE layer -> canonical ``(B, S, layers, topk)``."""
        b, s = local_shape
        layers = sorted(routers, key=lambda r: r.layer_number)
        per_layer = [r.router_replay.get_recorded_indices().view(s, b, -1).transpose(0, 1) for r in layers]
        local = torch.stack(per_layer, 2).to(torch.int64)  # (b, s, layers, topk)
        return layout.to_canonical(local, -1, cp_group=self.parallel.cp_group)

    # ------------------------------------------------------------------ gradients
    def finish_gradients(self, model) -> None:
        """Average plain ``.grad``s over data parallel (x context parallel); experts over expert-DP."""
        for p in model.parameters():
            if p.grad is None:
                continue
            group = self.expert_dp_group if not getattr(p, "allreduce", True) else self.dp_cp_group
            size = dist.get_world_size(group)
            if size > 1:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(size)

    def clip_gradients(self, model, max_norm: float) -> float:
        """Clip the global norm over TP shards (and expert-parallel ranks); returns the norm before clipping."""
        par = self.parallel
        dense = torch.zeros((), dtype=torch.float64, device=self.device)
        expert = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for p in model.parameters():
            if p.grad is None:
                continue
            grads.append(p.grad)
            # A TP-replicated parameter counts once (on TP rank 0).
            if getattr(p, "tensor_model_parallel", False) or par.tp_rank == 0:
                sq = p.grad.double().pow(2).sum()
                if getattr(p, "allreduce", True):
                    dense += sq
                else:
                    expert += sq
        if par.tp_size > 1:
            both = torch.stack([dense, expert])
            dist.all_reduce(both, group=par.tp_group)
            dense, expert = both[0], both[1]
        if dist.get_world_size(self.ep_group) > 1:
            dist.all_reduce(expert, group=self.ep_group)
        norm = math.sqrt(float(dense + expert))
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for g in grads:
                g.mul_(scale)
        return norm
