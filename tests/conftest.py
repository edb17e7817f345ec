"""Suite-wide markers: ``gpu`` checks run only where CUDA is present (``python -m pytest -m gpu``)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu check: needs CUDA (run `python -m pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
