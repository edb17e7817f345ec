"""Suite-wide markers: ``gpu`` checks run only where CUDA is present (``python -m pytest -m gpu``).

Under pytest-xdist each worker computes on one thread: the workers already share the cores, and
a worker's intra-op threads on top of them only contend (processes the tests start keep torch's
default).
"""

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu check: needs CUDA (run `python -m pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
