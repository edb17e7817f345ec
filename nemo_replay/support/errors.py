"""The error a misaligned batch raises (docs/design.md §2, §3, §4)."""

from __future__ import annotations

__all__ = ["SupportAlignmentError"]


class SupportAlignmentError(ValueError):
    """Support rows and tokens do not line up.

    Raised when a sampled token is not a member of its own support row, or when the
    loss-active positions without a row break the synthetic-EOS rule (at most one per
    trajectory, its last loss-active position). The message names the trajectory and the
    position. A ``ValueError`` subclass, so callers that catch configuration and input
    errors together keep working, while an integration can tell a misaligned batch (an
    off-by-one between token and logit coordinates, rows from another rollout) apart from
    a configuration mistake.
    """
