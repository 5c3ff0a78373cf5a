"""Shared pytest set-up: the `gpu` marker skips cleanly where CUDA is absent; what real servers logged during a
test is printed after it (pytest shows it when the test failed)."""

from __future__ import annotations

import pytest
import torch

import kernels  # noqa: F401  (chooses interpreter vs compiled before any test module defines kernels)
from tests.server import dump_new_logs

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA: run on the lent GPU (see ../shared/gpu/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs in every test, but reproducible from the test's own name.
    torch.manual_seed(abs(hash(request.node.nodeid)) % (2**31))


@pytest.fixture(autouse=True)
def _server_logs():
    yield
    dump_new_logs()  # nothing when no server runs
