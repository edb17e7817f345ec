"""What a CPU test process on Python 3.11 stands in for before NeMo-RL is imported (tests only).

- Below Python 3.12 pydantic refuses ``typing.TypedDict`` fields, which NeMo-RL's
  ``MasterConfig`` (grpo.py:357) has; NeMo-RL targets 3.13, where they are
  ``typing_extensions``' own, so they are that here.
- A CPU build of torch has no NVTX, which wraps the vLLM worker's ``generate``
  (nemo_rl/utils/nsys.py:118): its range markers become no-ops.

Called by tests/integrations/nemo_rl/source_checks.py, and a pytest plugin for NeMo-RL's own unit
tests (``-p nemo_rl_cpu_shims``: applied before NeMo-RL's conftest is imported).
"""

from __future__ import annotations

import sys

import pytest
import torch


def install_cpu_shims() -> None:
    """Apply both stand-ins (idempotent); on Python >= 3.12 with CUDA, nothing."""
    if sys.version_info < (3, 12):
        import typing

        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict
    if not torch.cuda.is_available():
        torch.cuda.nvtx.range_push = lambda msg: 0
        torch.cuda.nvtx.range_pop = lambda: 0


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    install_cpu_shims()
