"""Ulysses attention for Hugging Face causal LMs (Llama / Qwen family).

Registered in transformers' ``AttentionInterface`` under :data:`ULYSSES_ATTENTION`. Every
attention layer of a model switched to it (:func:`use_ulysses_attention`) receives q/k/v
of this rank's sequence slice (rotary embeddings already applied with the *global* position
ids the caller passed) and:

1. all-to-all: ``q (B, H, S/sp, D) -> (B, H/sp, S, D)`` (k and v alike), so this rank holds
   ``H/sp`` heads over the whole sequence;
2. attends over the whole sequence with the mask of :func:`segment_attention_mask`: causal,
   block-diagonal per trajectory (trajectories packed into one row restart there), never
   attending a padding key;
3. all-to-all back to ``(B, H, S/sp, D)``.

Step 2 builds a dense ``[B, 1, S, S]`` boolean mask for PyTorch's SDPA: exact and
portable (CPU, any dtype), quadratic in memory; a varlen flash-attention kernel fed the
same segments is the drop-in for long sequences.

The forward call carries a :class:`UlyssesPlan` (keyword ``ulysses_plan``), which names the
SP group and the trajectory of every position of the padded full sequence. Without a plan
the layer runs transformers' SDPA attention unchanged, so a switched model still works
outside replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nemo_replay.distributed.groups import group_size_rank
from nemo_replay.layout.ulysses import heads_to_seq, seq_to_heads

__all__ = [
    "ULYSSES_ATTENTION",
    "UlyssesPlan",
    "segment_attention_mask",
    "ulysses_attention_forward",
    "register_ulysses_attention",
    "use_ulysses_attention",
]

ULYSSES_ATTENTION = "nemo_replay_ulysses"


@dataclass
class UlyssesPlan:
    """What Ulysses attention needs beyond q/k/v for one forward.

    Attributes:
        group: the SP process group (the ranks holding slices of the same micro-batch).
        segment_ids: (B, S_pad), torch.int64. Trajectory of every position of the padded
            full sequence, -1 on padding (left padding, and the tail added to reach a
            multiple of the SP size). Identical on every rank of ``group``.
        calls: attention layers that ran with this plan (the caller checks it is > 0:
            a model whose attention bypassed the plan would attend within its slice only).
    """

    group: object
    segment_ids: torch.Tensor
    calls: int = field(default=0)


def segment_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask over a full sequence; True = may attend.

    Args:
        segment_ids: (B, S), int. Trajectory per position, -1 on padding.
    Returns:
        (B, 1, S, S), torch.bool. Query q attends key k iff k <= q, both in the same
        trajectory, and k is not padding. A padding query attends only itself, which
        keeps its softmax finite (its output is never scored).

    Example, segment_ids [[0, 0, 1, 1, -1]] (two packed trajectories and one pad):

        q\\k  0 1 2 3 4
        0    1 . . . .
        1    1 1 . . .
        2    . . 1 . .      position 2 restarts: trajectory 1
        3    . . 1 1 .
        4    . . . . 1      padding: itself only
    """
    S = segment_ids.shape[1]
    pos = torch.arange(S, device=segment_ids.device)
    q, k = segment_ids[:, :, None], segment_ids[:, None, :]
    allowed = (q == k) & (k >= 0) & (pos[None, None, :] <= pos[None, :, None])
    allowed |= torch.eye(S, dtype=torch.bool, device=segment_ids.device)[None]
    return allowed[:, None]


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    ulysses_plan: UlyssesPlan | None = None,
    sliding_window: int | None = None,
    **kwargs,
):
    """The ``AttentionInterface`` function (transformers' calling convention).

    Args:
        module: the attention layer (for ``training``).
        query: (B, H, S/sp, D). key, value: (B, H_kv, S/sp, D), rotary applied.
        attention_mask: transformers' mask for the local slice; ignored when a plan is
            given (the plan's segment ids define the full-sequence mask).
        ulysses_plan: the SP group and segment ids, or None for plain SDPA attention.

    Returns:
        ``(attn_output (B, S/sp, H, D), None)``.

    Collectives with a plan of size sp > 1: forward 3 all-to-alls in (q, k, v) and 1 out;
    backward the same 4, transposed.
    """
    if ulysses_plan is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, **kwargs,
        )
    if sliding_window is not None:
        raise ValueError(
            f"Ulysses attention implements full causal attention, but layer {getattr(module, 'layer_idx', '?')} asks "
            f"for a sliding window of {sliding_window}; disable sliding-window attention in the model config "
            f"(use_sliding_window=False) or run without sequence parallelism"
        )
    group = ulysses_plan.group
    sp, _ = group_size_rank(group)
    B, num_heads, s_local, head_dim = query.shape
    num_kv = key.shape[1]
    if num_heads % sp:
        raise ValueError(
            f"Ulysses sequence parallelism splits attention heads over the SP group: num_attention_heads="
            f"{num_heads} is not divisible by the SP size {sp}. Choose an SP size that divides the number of heads"
        )
    seg = ulysses_plan.segment_ids
    if seg.shape != (B, s_local * sp):
        raise ValueError(
            f"the Ulysses plan's segment_ids have shape {tuple(seg.shape)}, but this rank holds a slice of "
            f"{s_local} positions of batch {B} with SP size {sp}: expected {(B, s_local * sp)} (the padded full "
            f"sequence); build the plan from the same pad-and-slice as the model inputs"
        )
    if num_kv % sp:
        # Fewer key/value heads than ranks (or not divisible): give every query head its own
        # copy first (head h uses kv head h // (H / H_kv), as transformers' repeat_kv).
        key = key.repeat_interleave(num_heads // num_kv, dim=1)
        value = value.repeat_interleave(num_heads // num_kv, dim=1)
        num_kv = num_heads
    ulysses_plan.calls += 1

    q = seq_to_heads(query, group)  # (B, H/sp, S, D)
    k = seq_to_heads(key, group)  # (B, H_kv/sp, S, D)
    v = seq_to_heads(value, group)
    # Rank g holds query heads [g*H/sp, (g+1)*H/sp) and kv heads [g*H_kv/sp, ...): the same
    # groups, since query head h uses kv head h // (H / H_kv).
    rep = num_heads // num_kv
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    mask = segment_attention_mask(seg.to(query.device))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling
    )
    out = heads_to_seq(out, group)  # (B, H, S/sp, D)
    return out.transpose(1, 2).contiguous(), None


def register_ulysses_attention() -> str:
    """Register :data:`ULYSSES_ATTENTION` with transformers (idempotent); returns the name.

    The mask function is SDPA's, used only when no plan is given.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if ULYSSES_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention_forward)
    if ULYSSES_ATTENTION not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(ULYSSES_ATTENTION, sdpa_mask)
    return ULYSSES_ATTENTION


def use_ulysses_attention(model) -> None:
    """Switch a Hugging Face model's attention layers to Ulysses attention.

    Raises ValueError when the model does not dispatch attention through transformers'
    ``AttentionInterface`` (its layers would silently ignore the plan).
    """
    name = register_ulysses_attention()
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ValueError(
            f"{type(model).__name__} did not switch to {name!r} attention (it is "
            f"{model.config._attn_implementation!r}); Ulysses sequence parallelism needs a model whose attention "
            f"goes through transformers' AttentionInterface (Llama, Qwen2, Qwen3, Mistral ...)"
        )
