"""The marks of every test against a live vLLM: ``vllm``, and skipped where vLLM does not import,
the reason naming the install command; with ``NEMO_REPLAY_REQUIRE_VLLM=1`` (.ci/run's vLLM phase)
a missing vLLM fails the collection instead, so that nothing there is skipped."""

from __future__ import annotations

import os

import pytest

from nemo_replay.trainer.backends.vllm_engine import INSTALL, vllm_missing


def vllm_marks() -> list:
    missing = vllm_missing()
    if missing and os.environ.get("NEMO_REPLAY_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"NEMO_REPLAY_REQUIRE_VLLM=1 but {missing}")
    return [pytest.mark.vllm, pytest.mark.skipif(missing is not None, reason=f"needs vLLM: {INSTALL}")]
