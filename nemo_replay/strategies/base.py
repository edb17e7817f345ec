"""What every strategy provides to a trainer (docs/design.md §5, §6).

A strategy turns micro-batches (:class:`~nemo_replay.batch.ReplayBatch`, any
padding) into backend-aligned channels, calls the one shared scorer, and returns results in
the batch's ``(B, S - 1)`` logit coordinates. Trainers call :meth:`ReplayStrategy.run_role`
for each of the three roles:

- ``policy``: the trained forward. Scores with gradients, hands the log-probs in the
  caller's ``(B, A)`` columns to the loss (``loss_fn``, a
  :class:`~nemo_replay.objectives.PolicyLoss`; default ``TokenRatioObjective()``, the clipped
  token-ratio objective without a KL term) and runs backward. The caller steps
  the optimizer. The strategy owns the scoring, the coordinates and the CP/SP
  normalisation; the loss owns only the objective.
- ``recompute``: old-policy log-probs, forward only, no grad.
- ``reference``: reference-model log-probs, forward only, policy temperature, the same
  support (or the full vocabulary when ``RoleSettings.reference_full_vocab``).

Strategies whose backward the trainer may run itself also implement
:meth:`ReplayStrategy.score`: one micro-batch, differentiable log-probs, no loss.

With ``RoleSettings.replay`` off, the full-vocabulary path runs instead.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import torch

from nemo_replay.batch import ReplayBatch
from nemo_replay.layout.canonical import to_caller_columns
from nemo_replay.objectives import PolicyLoss, TokenRatioObjective
from nemo_replay.scoring.plan import MAX_CHUNK_SIZE

__all__ = [
    "Role",
    "ROLES",
    "RoleSettings",
    "RoleOutput",
    "ReplayStrategy",
    "check_role",
    "check_settings",
    "start_role",
    "role_replays",
    "policy_objective",
    "check_policy_batches",
]

Role = Literal["policy", "recompute", "reference"]
ROLES: tuple[str, ...] = ("policy", "recompute", "reference")


def check_role(role: str, loss_fn=None) -> None:
    """Refuse an unknown role, and a ``loss_fn`` given to a forward-only role (it would be ignored)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    if loss_fn is not None and role != "policy":
        raise ValueError(f"loss_fn applies to the policy role only; the {role} role runs forward only, drop loss_fn")


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

    The objective is not a scoring setting: it is the ``loss_fn`` of the policy role
    (:mod:`nemo_replay.objectives`, e.g. ``TokenRatioObjective(clip_eps=0.2, kl_coef=0.01)``).
    """

    replay: bool = True
    temperature: float = 1.0
    source: Literal["logits", "hidden"] = "logits"
    chunk_size: int = 8192
    compute_entropy: bool = False
    compute_support_mass: bool = False
    reference_full_vocab: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not self.temperature > 0:
            problems.append(f"temperature must be > 0, got {self.temperature}")
        if self.source not in ("logits", "hidden"):
            problems.append(f"source must be 'logits' or 'hidden', got {self.source!r}")
        if not (isinstance(self.chunk_size, int) and 0 < self.chunk_size <= MAX_CHUNK_SIZE):
            problems.append(f"chunk_size must be an int in [1, {MAX_CHUNK_SIZE}], got {self.chunk_size!r}")
        if problems:
            raise ValueError("invalid RoleSettings: " + "; ".join(problems))

    def scorer_options(self) -> dict:
        """The keyword arguments of :func:`~nemo_replay.scoring.entry.score_positions` these settings decide."""
        return dict(temperature=self.temperature, compute_entropy=self.compute_entropy,
                    compute_support_mass=self.compute_support_mass, chunk_size=self.chunk_size)


def role_replays(batch: ReplayBatch, role: str, settings: RoleSettings, *, where: str = "the micro-batch") -> bool:
    """Whether ``role`` scores ``batch`` over its recorded support; refuses a replaying role whose batch
    carries none (every strategy asks here, so the rule and the message are the same everywhere).

    The reference role scores over the full vocabulary with ``reference_full_vocab``; every role
    does with ``replay=False``.
    """
    replay = settings.replay and not (role == "reference" and settings.reference_full_vocab)
    if replay and batch.support is None:
        hint = " or RoleSettings(reference_full_vocab=True)" if role == "reference" else ""
        raise ValueError(
            f"{where}: role {role!r} replays the recorded support but the batch carries none (support=None). "
            f"Record supports at rollout (replay.sample_support.enabled) or run with RoleSettings(replay=False){hint}"
        )
    return replay


@dataclass
class RoleOutput:
    """Results of one role on one micro-batch, in canonical ``(B, S - 1)`` logit coordinates.

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
        """The caller's ``(B, A=width)`` token columns ``[S - A, S)`` (the columns of ``batch.loss_mask``).

        Token column t holds the result of the logit that predicts it (logit column t - 1);
        with ``width == S`` (token-aligned) column 0 is 0 / False.
        """
        cut = lambda t: None if t is None else to_caller_columns(t, width, fill=0)  # noqa: E731
        return RoleOutput(
            cut(self.logprobs), cut(self.valid_mask), cut(self.fallback_mask), cut(self.entropy),
            cut(self.support_logmass), self.loss, dict(self.metrics),
        )


def policy_objective(loss_fn: Optional[PolicyLoss] = None) -> PolicyLoss:
    """``loss_fn``, or the default objective: ``TokenRatioObjective()`` (clip 0.2, no KL term)."""
    if loss_fn is None:
        return TokenRatioObjective()
    if not callable(loss_fn):
        raise ValueError(
            f"loss_fn must be callable as loss_fn(logprobs (B, A), batch, mask (B, A)) -> (loss, metrics), got "
            f"{type(loss_fn).__name__}; see nemo_replay.objectives"
        )
    return loss_fn


def check_settings(settings) -> None:
    """Refuse settings that are not a :class:`RoleSettings` (a dict or the recipe's section, say)."""
    if not isinstance(settings, RoleSettings):
        raise ValueError(
            f"settings must be a RoleSettings, got {type(settings).__name__}; build one with "
            f"nemo_replay.strategies.base.RoleSettings(...)"
        )


def start_role(role: str, batches: Sequence[ReplayBatch], settings, loss_fn: Optional[PolicyLoss] = None):
    """Every strategy's checks before a role's first forward; the policy role's objective, else None.

    Refuses an unknown role, a ``loss_fn`` given to a forward-only role, settings that are not a
    :class:`RoleSettings`, and (policy role) a micro-batch the objective cannot read
    (:func:`check_policy_batches`).
    """
    check_role(role, loss_fn)
    check_settings(settings)
    if role != "policy":
        return None
    objective = policy_objective(loss_fn)
    check_policy_batches(batches, objective)
    return objective


def check_policy_batches(batches: Sequence[ReplayBatch], loss_fn: PolicyLoss) -> None:
    """Refuse, before any forward, a micro-batch that lacks a field the objective reads or holds one
    of the wrong shape.

    Re-runs the batch's own checks (``batch.validate()``) and asks ``loss_fn.check(batch)``
    (the missing field names) when the objective defines it.
    """
    check = getattr(loss_fn, "check", None)
    for i, batch in enumerate(batches):
        validate = getattr(batch, "validate", None)
        if validate is not None:  # fields set after the batch was built (old_logprobs, advantages...): shapes
            try:
                validate()
            except ValueError as exc:
                raise ValueError(f"micro-batch {i}: {exc}") from None
        missing = [] if check is None else check(batch)
        if missing:
            raise ValueError(
                f"micro-batch {i}: the policy objective {type(loss_fn).__name__} needs {', '.join(missing)} on the "
                f"batch; run the recompute (and reference) roles first and store their log-probs, set the "
                f"advantages, or choose an objective that does not read them (kl_coef=0 drops ref_logprobs)"
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
        *,
        loss_fn: Optional[PolicyLoss] = None,
    ) -> list[RoleOutput]:
        """Run ``role`` over micro-batches and return one output per micro-batch.

        The ``policy`` role also runs backward of ``loss_fn`` (default :func:`policy_objective`):
        gradients accumulate over micro-batches, the loss of each is scaled by
        ``1 / len(batches)``; the caller steps the optimizer. Its outputs carry
        the loss and the objective's metrics. Forward-only roles run under
        ``torch.no_grad`` and refuse a ``loss_fn``.
        """

    def score(self, model, batch: ReplayBatch, settings: RoleSettings, *, role: Role = "policy") -> RoleOutput:
        """One micro-batch's scores, differentiable for the ``policy`` role, in ``(B, S - 1)`` logit columns.

        For trainers that compute their own loss and run backward themselves
        (``out.response(batch.response_width).logprobs`` is the ``(B, A)`` view). A
        strategy whose backward runs inside its own schedule (megatron) does not offer it.
        """
        raise ValueError(
            f"the {self.name or type(self).__name__} strategy runs backward inside its own schedule and cannot hand "
            f"out differentiable log-probs; pass the loss instead: run_role('policy', model, batches, settings, "
            f"loss_fn=...)"
        )
