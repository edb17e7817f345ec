"""``nemo_replay.capture``: the support-capturing sampler (re-exported from
:mod:`nemo_replay.rollout.capture`, where the order of operations is documented).

    ids, logprobs, support = nemo_replay.capture.sample(logits, temperature=1.0, top_k=64)
"""

from nemo_replay.rollout.capture import CaptureResult, check_capture_settings, sample

__all__ = ["CaptureResult", "check_capture_settings", "sample"]
