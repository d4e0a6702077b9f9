"""Shared pytest set-up: the `gpu` marker skips cleanly without CUDA."""

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported, so the switch to its CPU interpreter
# must happen before any test module imports triton (or emulation/).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
