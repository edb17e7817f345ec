"""The megatron strategy's rollouts from a live vLLM: a megatron-core GPTModel's weights, renamed
and re-split into the Hugging Face Llama layout, loaded into vLLM at start and after an update;
vLLM's log-probs then equal the megatron model's own, scored over the recorded rows in float64
(``tests/strategies/megatron/vllm_export_check.py``, in a process of its own: it installs the CPU
shims and starts a process group). Marked ``vllm``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.spawn import free_port
from tests.vllm_marks import vllm_marks

pytestmark = vllm_marks()

REPO = Path(__file__).resolve().parents[3]


def test_megatron_weights_reach_vllm_and_its_logprobs_are_the_models():
    cmd = [sys.executable, "-m", "tests.strategies.megatron.vllm_export_check", str(free_port())]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["before"] <= 1e-4 and got["after"] <= 1e-4, got  # at start, and after a weight update
    assert got["stale"] > 1e-2, got  # the update did reach vLLM
