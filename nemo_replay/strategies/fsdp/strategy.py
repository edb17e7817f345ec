"""The fsdp strategy: Hugging Face causal LMs under FSDP2, with optional Ulysses SP.

Each role runs the model forward on the layout of :mod:`nemo_replay.strategies.fsdp.rolled_layout`,
calls the shared scorer on this rank's positions with explicit trajectory ids, and brings
the results back to canonical ``(B, S-1)`` columns (docs/design.md §5, §6).

Sources (``RoleSettings.source``):

- ``logits``: the model's full forward; logits ``(R, T, V)`` go to the scorer.
- ``hidden``: the trunk runs and the full LM head is skipped (``logits_to_keep`` selects
  no position); the scorer projects only the support against the LM-head weight. Under
  FSDP2 that weight is a sharded DTensor: the LM head must be its own ``fully_shard``
  unit, which is unsharded for the scorer. Its gradient reaches the unsharded parameter
  and FSDP's end-of-backward callback reduce-scatters it and reshards; forward-only roles
  reshard right after scoring.

Sequence parallelism: ranks of ``sp_group`` pass the same micro-batches. Every rank scores
its slice, and the log-probs are all-gathered before the objective, so each rank computes
the same loss. FSDP then averages gradients over all ranks, the SP ranks of one batch
included; the gather's backward multiplies this rank's gradient by ``sp_grad_scale``
(default: the SP size) so that average is the gradient of the batch's loss.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from nemo_replay.batch import ReplayBatch
from nemo_replay.distributed.compat import dtensor_names, fsdp2_names
from nemo_replay.distributed.groups import group_size_rank
from nemo_replay.layout.checks import check_canonical
from nemo_replay.objectives import PolicyLoss
from nemo_replay.scoring.entry import score_positions
from nemo_replay.scoring.scorer import SupportScores
from nemo_replay.strategies.base import (
    ReplayStrategy,
    RoleOutput,
    RoleSettings,
    check_role,
    check_settings,
    role_replays,
    start_role,
)
from nemo_replay.strategies.fsdp.attention import use_ulysses_attention
from nemo_replay.strategies.fsdp.head import hidden_mode_problems
from nemo_replay.strategies.fsdp.rolled_layout import FSDPLayout, build_layout

__all__ = ["FSDPStrategy", "lm_head_weight", "run_trunk"]


def run_trunk(model, inputs: dict) -> torch.Tensor:
    """The model's final hidden states without the full LM-head projection.

    Runs the whole forward (so FSDP's root hooks run as usual) with ``logits_to_keep``
    selecting no position, and takes the decoder's ``last_hidden_state``.

    Returns:
        (R, T, H), the normalised hidden states the LM head would project.
    """
    decoder = model.get_decoder()
    captured = []

    def keep(_module, _args, out):
        captured.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

    handle = decoder.register_forward_hook(keep)
    try:
        none = torch.empty(0, dtype=torch.int64, device=inputs["input_ids"].device)
        model(**inputs, logits_to_keep=none)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise ValueError(
            f"{type(model).__name__}.get_decoder() ran {len(captured)} times in one forward; hidden mode needs a "
            f"causal LM whose decoder produces the hidden states of the LM head once"
        )
    return captured[0]


def lm_head_weight(model):
    """The full LM-head weight ``(V, H)`` and a function that releases it.

    Under FSDP2 with the LM head as its own unit, the unit is unsharded: the returned
    tensor is the unsharded parameter, so gradients flow to the sharded one through
    FSDP's reduce-scatter. ``release()`` reshards (forward-only use). A plain module's
    weight comes back as is.
    """
    _, FSDPModule = fsdp2_names()
    DTensor, _, _ = dtensor_names()

    problems = hidden_mode_problems(model)
    if problems:
        raise ValueError(f"source='hidden' cannot reproduce {type(model).__name__}'s logits: {'; '.join(problems)}. "
                         f"Use source='logits'")
    head = model.get_output_embeddings()
    if isinstance(head, FSDPModule):
        head.unshard()
        return head.weight, head.reshard
    if isinstance(head.weight, DTensor):
        raise ValueError(
            "the LM-head weight is a sharded DTensor outside its own FSDP unit; for hidden mode apply "
            "fully_shard(model.lm_head) before fully_shard(model), or use source='logits'"
        )
    return head.weight, lambda: None


class FSDPStrategy(ReplayStrategy):
    """Replay for Hugging Face causal LMs wrapped in FSDP2 (or unwrapped).

    Args:
        sp_group: the Ulysses SP process group (ranks holding the same micro-batches), or
            None. With more than one rank the model's attention is switched to Ulysses
            attention; the number of attention heads must divide by the SP size.
        remove_padding: pack real tokens into one row (varlen) before the forward.
        sp_grad_scale: multiplies the gradient of this rank's log-prob slice; default the
            SP size, which undoes FSDP's average over the SP ranks of one batch.
        backward: ``backward(loss)`` back-propagates one micro-batch's scaled loss (a 0-dim
            tensor with a graph) in the ``policy`` role; default ``loss.backward()``. A trainer
            whose own backward does more passes it here: ``LightningModule.manual_backward``
            prepares DDP's reducer (the gradient all-reduce) and applies the precision
            plugin's scaling (``ReplayCallback`` sets it). Also settable as ``.backward``.

    The ``policy`` role runs ``loss_fn`` (default: the clipped token-ratio objective of
    the settings, which reads ``batch.advantages``, ``batch.old_logprobs`` -- None is
    on-policy, ratio 1 -- and ``batch.ref_logprobs`` when ``kl_coef > 0``) on log-probs in
    the caller's columns, then runs backward. :meth:`score` hands out the differentiable
    log-probs instead, for a trainer that runs its own loss and backward.
    """

    name = "fsdp"

    def __init__(
        self,
        *,
        sp_group=None,
        remove_padding: bool = True,
        sp_grad_scale: Optional[float] = None,
        backward: Optional[Callable[[torch.Tensor], None]] = None,
    ):
        if backward is not None and not callable(backward):
            raise ValueError(
                f"backward must be callable as backward(loss) or None (loss.backward()), got {type(backward).__name__}"
            )
        self.backward = backward
        self.sp_group = sp_group
        self.remove_padding = bool(remove_padding)
        self.sp_size, self.sp_rank = group_size_rank(sp_group)
        self.sp_grad_scale = float(self.sp_size if sp_grad_scale is None else sp_grad_scale)

    # ------------------------------------------------------------------ roles
    def run_role(
        self, role, model, batches: Sequence[ReplayBatch], settings: RoleSettings, *, loss_fn: Optional[PolicyLoss] = None
    ) -> list[RoleOutput]:
        loss_fn = start_role(role, batches, settings, loss_fn)
        # Every micro-batch is refused before the first forward runs.
        replays = [role_replays(b, role, settings, where=f"micro-batch {i}") for i, b in enumerate(batches)]
        if self.sp_size > 1:
            use_ulysses_attention(model)
        outputs = []
        for batch, replay in zip(batches, replays):
            if role == "policy":
                outputs.append(self._policy(model, batch, settings, replay, 1.0 / len(batches), loss_fn))
            else:
                with torch.no_grad():
                    outputs.append(self._forward(model, batch, settings, replay, grad=False)[0])
        return outputs

    def score(self, model, batch: ReplayBatch, settings: RoleSettings, *, role="policy") -> RoleOutput:
        """One micro-batch, ``(B, S - 1)`` logit columns; differentiable for ``role="policy"``.

        Under SP every rank returns the whole micro-batch; the gradient of this rank's
        slice is scaled by ``sp_grad_scale`` as in :meth:`run_role`. Forward-only roles run
        under ``torch.no_grad``.
        """
        check_role(role)
        check_settings(settings)
        if self.sp_size > 1:
            use_ulysses_attention(model)
        replay = role_replays(batch, role, settings)
        if role == "policy":
            return self._forward(model, batch, settings, replay, grad=True)[0]
        with torch.no_grad():
            return self._forward(model, batch, settings, replay, grad=False)[0]

    def _policy(
        self, model, batch: ReplayBatch, settings: RoleSettings, replay: bool, scale: float, loss_fn: PolicyLoss
    ) -> RoleOutput:
        out, _ = self._forward(model, batch, settings, replay, grad=True)
        view = out.response(batch.response_width)
        mask = batch.loss_mask.to(view.logprobs.device) != 0
        loss, metrics = loss_fn(view.logprobs, batch, mask)
        if self.backward is None:
            (loss * scale).backward()
        else:
            self.backward(loss * scale)
        detach = lambda t: None if t is None else t.detach()  # noqa: E731
        return RoleOutput(
            out.logprobs.detach(), out.valid_mask, out.fallback_mask, detach(out.entropy),
            detach(out.support_logmass), loss.detach(), dict(metrics),
        )

    # ------------------------------------------------------------------ one forward
    def _forward(self, model, batch: ReplayBatch, settings: RoleSettings, replay: bool, *, grad: bool):
        layout = build_layout(batch, remove_padding=self.remove_padding, sp_group=self.sp_group)
        if replay and self.sp_size > 1:  # a slice cannot see its trajectory's other slices
            check_canonical(layout.canonical, batch.support)
        inputs = layout.model_inputs()
        hidden = settings.source == "hidden"
        if hidden:
            source = run_trunk(model, inputs)
            weight, release = lm_head_weight(model)
        else:
            source, weight, release = model(**inputs).logits, None, (lambda: None)
        if layout.ulysses_plan is not None and layout.ulysses_plan.calls == 0:
            raise ValueError(
                f"{type(model).__name__} ran without calling Ulysses attention, so each rank attended within its own "
                f"slice; use a model whose attention goes through transformers' AttentionInterface"
            )
        try:
            scores = score_positions(source, layout.channels, batch.support, replay=replay, lm_head_weight=weight,
                           group=self.sp_group, group_name="SP", **settings.scorer_options())
        finally:
            if not grad:
                release()
        return self._to_canonical(scores, layout, grad), layout

    def _to_canonical(self, s: SupportScores, layout: FSDPLayout, grad: bool) -> RoleOutput:
        scale = self.sp_grad_scale if grad else 1.0
        back = lambda t, fill=0: None if t is None else layout.to_canonical(t, fill=fill, grad_scale=scale)  # noqa: E731
        return RoleOutput(
            logprobs=back(s.logprobs),
            valid_mask=back(s.valid_mask, False),
            fallback_mask=back(s.fallback_mask, False),
            entropy=back(s.entropy),
            support_logmass=back(s.support_logmass),
        )

    # ------------------------------------------------------------------ SP safety
