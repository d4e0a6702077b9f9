"""Shared pytest set-up: the `gpu` marker skips cleanly without CUDA; under pytest-xdist each
worker's torch takes its share of the cores."""

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported, so the switch to its CPU interpreter
# must happen before any test module imports triton (or emulation/).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # the lowprec references are CPU tensor code: N workers each running torch on every core
    # oversubscribe the machine several times over (scripts/gpu.sh test runs 8 workers)
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
