"""CPU stand-ins for the two things verl 0.9.1's FSDP engine needs an accelerator for. Tests only.

- :func:`install`: verl resolves its device through a platform registry
  (``verl/plugin/platform``) that knows CUDA, NPU and ROCm and falls back to CUDA when none is
  present; this registers the CPU through that same extension point
  (``PlatformRegistry.register``, ``set_platform``). It must run before any verl module asks
  for the platform (verl's engine modules read it at import).
- :func:`register_ulysses_attention`: verl's Ulysses sequence parallelism lives inside its
  flash-attention wrapper (``models/transformers/monkey_patch.py``
  ``_ulysses_flash_attention_forward``), and flash-attention does not run on the CPU. This
  registers a transformers attention function that does the same exchange with verl's own
  all-to-all helpers (``verl.utils.ulysses.gather_seq_scatter_heads`` /
  ``gather_heads_scatter_seq``, verl's KV-head repeat rule, position ids all-gathered over
  the SP group) around an exact causal attention over the packed sequences.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch


def install() -> None:
    """Make verl's platform the CPU (gloo, ``torch.cpu``), once per process."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase

    if platform_manager._current_platform is not None and platform_manager._current_platform.device_name == "cpu":
        return

    @platform_manager.PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self) -> bool:
            return True

        def current_device(self):
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            with nullcontext():
                yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    platform_manager.set_platform(PlatformCPU())


ULYSSES_ATTENTION = "ulysses_sdpa_cpu"


def _ulysses_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                  position_ids=None, **kwargs):
    """Attention over packed sequences, Ulysses-exchanged like verl's flash-attention wrapper.

    query/key/value: (1, heads, seq / sp, head_dim) as transformers hands them; returns
    (1, seq / sp, heads, head_dim). Sequences are told apart by their position ids restarting
    at 0 (verl's remove-padding layout); ``attention_mask`` (built from the local slice) is unused.
    """
    import torch.distributed as dist
    import torch.nn.functional as F
    from verl.utils.ulysses import (
        gather_heads_scatter_seq,
        gather_seq_scatter_heads,
        get_ulysses_sequence_parallel_group,
        get_ulysses_sequence_parallel_world_size,
    )

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (1, s, h, d)
    sp = get_ulysses_sequence_parallel_world_size()
    if sp > 1:
        repeats = max(sp // k.size(2), 1)  # verl's rule: repeat KV heads up to the SP size
        k, v = (t.repeat_interleave(repeats, dim=2) for t in (k, v))
        q, k, v = (gather_seq_scatter_heads(t, seq_dim=1, head_dim=2) for t in (q, k, v))
        parts = [torch.empty_like(position_ids) for _ in range(sp)]
        dist.all_gather(parts, position_ids.contiguous(), group=get_ulysses_sequence_parallel_group())
        position_ids = torch.cat(parts, dim=-1)
    pos = position_ids.reshape(-1)
    segment = torch.cumsum((pos == 0).to(torch.int64), 0)
    n = pos.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    allowed = causal & (segment[:, None] == segment[None, :])
    group = q.size(2) // k.size(2)
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed, scale=scaling
    ).transpose(1, 2)  # (1, s, h / sp, d)
    if sp > 1:
        out = gather_heads_scatter_seq(out, seq_dim=1, head_dim=2)
    return out.contiguous(), None


def register_ulysses_attention() -> str:
    """Register :data:`ULYSSES_ATTENTION` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ULYSSES_ATTENTION, _ulysses_sdpa)
    AttentionMaskInterface.register(ULYSSES_ATTENTION, sdpa_mask)
    return ULYSSES_ATTENTION
