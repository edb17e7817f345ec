"""What every strategy provides to a trainer (docs/design.md §5, §6).

A strategy turns canonical micro-batches (:class:`~nemo_replay.layout.canonical.ReplayBatch`)
into backend-aligned channels, calls the one shared scorer, and returns results in
canonical ``[B, S - 1]`` logit coordinates. Trainers call :meth:`ReplayStrategy.run_role`
for each of the three roles:

- ``policy``: the trained forward. Scores, computes the clipped objective from the
  batch's ``old_logprobs``/``advantages`` (and ``ref_logprobs`` when ``kl_coef > 0``),
  and runs backward. The caller steps the optimizer.
- ``recompute``: old-policy log-probs, forward only, no grad.
- ``reference``: reference-model log-probs, forward only, policy temperature, the same
  support (or the full vocabulary when ``RoleSettings.reference_full_vocab``).

With ``RoleSettings.replay`` off, the full-vocabulary path runs instead.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import torch

from nemo_replay.layout.canonical import ReplayBatch

__all__ = ["Role", "ROLES", "RoleSettings", "RoleOutput", "ReplayStrategy", "check_role"]

Role = Literal["policy", "recompute", "reference"]
ROLES: tuple[str, ...] = ("policy", "recompute", "reference")


def check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")


@dataclass(frozen=True)
class RoleSettings:
    """How a role scores.

    Attributes:
        replay: score over the recorded support (True) or the full vocabulary (False).
        temperature: the policy's sampling temperature; divides logits in every role.
        source: ``logits`` (score vocab-parallel logits) or ``hidden`` (score hidden states
            against the LM-head weight, never materialising full logits).
        chunk_size: (position, id) pairs projected per chunk in hidden mode.
        compute_entropy: also return the entropy over the support.
        compute_support_mass: also return log of the kept probability mass (logits mode).
        reference_full_vocab: the reference role scores the full vocabulary even with replay on.
        clip_eps: PPO clip range (``policy`` role).
        kl_coef: weight of the KL-to-reference term (``policy`` role; needs ``ref_logprobs``).
    """

    replay: bool = True
    temperature: float = 1.0
    source: Literal["logits", "hidden"] = "logits"
    chunk_size: int = 8192
    compute_entropy: bool = False
    compute_support_mass: bool = False
    reference_full_vocab: bool = False
    clip_eps: float = 0.2
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        if not self.temperature > 0:
            problems.append(f"temperature must be > 0, got {self.temperature}")
        if self.source not in ("logits", "hidden"):
            problems.append(f"source must be 'logits' or 'hidden', got {self.source!r}")
        if not (isinstance(self.chunk_size, int) and self.chunk_size > 0):
            problems.append(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        if not self.clip_eps > 0:
            problems.append(f"clip_eps must be > 0, got {self.clip_eps}")
        if self.kl_coef < 0:
            problems.append(f"kl_coef must be >= 0, got {self.kl_coef}")
        if problems:
            raise ValueError("invalid RoleSettings: " + "; ".join(problems))


@dataclass
class RoleOutput:
    """Results of one role on one micro-batch, in canonical ``[B, S - 1]`` logit coordinates.

    Attributes:
        logprobs: (B, S-1) float32, 0 where not scored. Detached for forward-only roles.
        valid_mask: (B, S-1) bool, scored over a recorded support row.
        fallback_mask: (B, S-1) bool, scored over the full vocabulary (synthetic EOS, or
            everything with replay off).
        entropy: (B, S-1) float32 or None.
        support_logmass: (B, S-1) float32 or None.
        loss: the policy objective (``policy`` role), detached, or None.
        metrics: scalar diagnostics (``clip_fraction``, ``ratio_mean``, ``kl``...).
    """

    logprobs: torch.Tensor
    valid_mask: torch.Tensor
    fallback_mask: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    support_logmass: Optional[torch.Tensor] = None
    loss: Optional[torch.Tensor] = None
    metrics: dict = field(default_factory=dict)

    def response(self, width: int) -> "RoleOutput":
        """The last ``width`` logit columns: the right-aligned ``[B, A]`` response view."""
        cut = lambda t: None if t is None else t[:, -width:]  # noqa: E731
        return RoleOutput(
            cut(self.logprobs), cut(self.valid_mask), cut(self.fallback_mask), cut(self.entropy),
            cut(self.support_logmass), self.loss, dict(self.metrics),
        )


class ReplayStrategy(abc.ABC):
    """A backend adapter around the shared scorer. Built by ``StrategySpec.factory``."""

    name: str = ""

    @abc.abstractmethod
    def run_role(
        self,
        role: Role,
        model,
        batches: Sequence[ReplayBatch],
        settings: RoleSettings,
    ) -> list[RoleOutput]:
        """Run ``role`` over micro-batches and return one output per micro-batch.

        The ``policy`` role also runs backward (gradients accumulate over micro-batches,
        the objective of each is scaled by ``1 / len(batches)``); the caller steps the
        optimizer. Forward-only roles run under ``torch.no_grad``.
        """
