"""The rollout sampler under its short name: ``nemo_replay.capture.sample(...)``.

Everything here is :mod:`nemo_replay.rollout.capture.sampler`'s (its module doc has the order
of operations, the tie rules and the output); this module only gives it the name users type.
"""

from nemo_replay.rollout.capture.sampler import (
    TEMPERATURE_RANGE,
    TIE_RULES,
    CaptureResult,
    check_capture_settings,
    rank_candidates,
    sample,
)

__all__ = ["CaptureResult", "TIE_RULES", "TEMPERATURE_RANGE", "sample", "check_capture_settings", "rank_candidates"]
