"""ReplayBatch: one trainer micro-batch, the type every strategy, role and integration takes.

Its coordinates (token columns, logit columns, the right-aligned ``(B, A)`` response window,
left, right or mixed padding) are those of :mod:`nemo_replay.layout.canonical` and
docs/design.md §3; the support rows follow docs/design.md §2.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Union

import torch

from nemo_replay.layout.canonical import real_runs
from nemo_replay.support.dtypes import is_integer
from nemo_replay.support.packed import PackedTensor, Segmented
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["ReplayBatch", "Support"]

Support = Union[PackedTensor, RaggedSupport]


@dataclass
class ReplayBatch:
    """One trainer micro-batch (module doc for the coordinates).

    Attributes:
        sequences: (B, S), int64. Prompt + response tokens, padded on either side.
        attention_mask: (B, S), bool. True on real tokens: one contiguous run per row
            (left-, right- or both-side padding).
        response_lengths: (B,), int64. ``R_i``: response tokens of trajectory i (the last
            ``R_i`` real tokens), including observation tokens and any synthetic EOS.
        loss_mask: (B, A), bool or float. Token-position mask over the last A token columns
            ``[S - A, S)`` of ``sequences`` (1 <= A <= S; A = S is token-aligned). Every
            (B, A) field below uses the same columns.
        support: ``R_i`` rows per trajectory (all -1 / empty rows where nothing was
            sampled), or None when replay is off.
        routes: optional MoE routes, ``L_i`` rows ``[layers, topk]`` per trajectory (R3).
        rollout_logprobs: optional (B, A) float, the engine's log-probs (diagnostics).
        advantages: optional (B,) or (B, A) float.
        old_logprobs: optional (B, A) float, the old policy's log-probs (``recompute`` role).
        ref_logprobs: optional (B, A) float, the reference model's log-probs (``reference`` role).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_lengths: torch.Tensor
    loss_mask: torch.Tensor
    support: Optional[Support] = None
    routes: Optional[PackedTensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    @property
    def seq_len(self) -> int:
        return self.sequences.shape[1]

    @property
    def response_width(self) -> int:
        return self.loss_mask.shape[1]

    def validate(self) -> None:
        """Check every field against the others (runs at construction; strategies run it again before a
        policy forward, for fields set after the batch was built)."""
        for name in ("sequences", "attention_mask", "loss_mask", "rollout_logprobs", "advantages", "old_logprobs",
                     "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"ReplayBatch.{name} must be a torch.Tensor, got {type(value).__module__}.{type(value).__name__}; "
                    f"wrap it with torch.as_tensor(...)"
                )
        seq, am = self.sequences, self.attention_mask
        if seq.dim() != 2 or not is_integer(seq):
            raise ValueError(f"sequences must be an integer (B, S) tensor, got {seq.dtype} {tuple(seq.shape)}")
        B, S = seq.shape
        if am.shape != (B, S):
            raise ValueError(f"attention_mask has shape {tuple(am.shape)}, expected {(B, S)} like sequences")
        starts, ends = real_runs(am)
        lengths = ends - starts
        R = torch.as_tensor(self.response_lengths)
        if R.shape != (B,):
            raise ValueError(f"response_lengths has shape {tuple(R.shape)}, expected ({B},)")
        # 0 is an empty response (the engine returned no token: a prompt at the length limit, an
        # aborted request): no rows, nothing scored, the trajectory contributes nothing.
        bad = torch.nonzero((R < 0) | (R >= lengths.to(R.device)))
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"trajectory {i}: response_length {int(R[i])} must be in [0, L_i - 1] with L_i={int(lengths[i])} "
                f"real tokens (a response needs at least one prompt token before it; 0: the engine returned none)"
            )
        lm = self.loss_mask
        if lm.dim() != 2 or lm.shape[0] != B or not 1 <= lm.shape[1] <= S:
            raise ValueError(
                f"loss_mask has shape {tuple(lm.shape)}, expected (B={B}, A) over the last A token columns with "
                f"1 <= A <= S={S} (A = S: token-aligned)"
            )
        A = lm.shape[1]
        # A loss-active token needs a logit that predicts it: token column t with t - 1 and t
        # both real, s_i < t < e_i. Example, S = 6, row ``_ p0 p1 r0 r1 _`` (s = 1, e = 5):
        # columns 2..4 may be loss-active; column 1 (the first real token) and the padding
        # columns 0 and 5 may not. The objective reads loss_mask as it is, so a flag there
        # would count a position the scorer never scores.
        cols = torch.arange(S - A, S, device=lm.device)
        s_i, e_i = starts.to(lm.device)[:, None], ends.to(lm.device)[:, None]
        unpredicted = (lm != 0) & ~((cols > s_i) & (cols < e_i))
        if unpredicted.any():
            i, a = (int(v) for v in torch.nonzero(unpredicted)[0])
            t = S - A + a
            what = "padding" if not (s_i[i, 0] <= t < e_i[i, 0]) else "the trajectory's first real token"
            raise ValueError(
                f"trajectory {i}: loss_mask is set at token column {t}, which no logit predicts ({what}; loss_mask "
                f"column {a}, real tokens in columns {int(s_i[i, 0])}..{int(e_i[i, 0]) - 1}); only real tokens after the "
                f"first can be loss-active: clear loss_mask on padding and on each row's first real token"
            )
        for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs", "advantages"):
            value = getattr(self, name)
            if value is None or (name == "advantages" and tuple(value.shape) == (B,)):
                continue
            if tuple(value.shape) != (B, A):
                want = f"({B},) or ({B}, {A})" if name == "advantages" else f"({B}, {A})"
                raise ValueError(
                    f"{name} has shape {tuple(value.shape)}, expected {want}: the columns of loss_mask (the last "
                    f"{A} token columns)"
                )
        if self.support is not None:
            if len(self.support) != B:
                raise ValueError(f"support holds {len(self.support)} trajectories, the batch {B}")
            rows = self.support.lengths.cpu()
            mismatch = torch.nonzero(rows != R.cpu())
            if mismatch.numel():
                i = int(mismatch[0])
                raise ValueError(
                    f"trajectory {i} has {int(rows[i])} support rows for {int(R[i])} response tokens; every "
                    f"response token needs exactly one row (an all -1 padding row where the engine sampled "
                    f"nothing: observation tokens, a synthetic EOS)"
                )
        if self.routes is not None:
            if len(self.routes) != B:
                raise ValueError(f"routes hold {len(self.routes)} trajectories, the batch {B}")
            mismatch = torch.nonzero(self.routes.lengths.cpu() != lengths.cpu())
            if mismatch.numel():
                i = int(mismatch[0])
                raise ValueError(
                    f"trajectory {i} has {int(self.routes.lengths[i])} route rows for {int(lengths[i])} real "
                    f"tokens; routes are token-aligned over the whole sequence (prompt and response)"
                )

    def select(self, index: torch.Tensor) -> "ReplayBatch":
        """Trajectories ``index`` (1-D int) as a new batch; support and routes follow."""
        index = torch.as_tensor(index, dtype=torch.int64)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                out[f.name] = None
            elif isinstance(v, Segmented):
                out[f.name] = v.gather(index)
            else:
                out[f.name] = v[index.to(v.device)]
        return ReplayBatch(**out)

    def to(self, device) -> "ReplayBatch":
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if getattr(self, f.name) is not None
            },
        )


