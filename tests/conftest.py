"""Shared pytest set-up: the `gpu` marker skips cleanly where CUDA is absent, `cpu_interpreter` where it is present;
the kernels' every-candidate sweeps are marked `sweep` and run longest first (tests/sweeps.py), then whole modules,
costliest first, and under pytest-xdist a module that shares fixtures runs on one worker (tests/schedule.py); every
test gets a seed derived from its id, printed when it fails (tests/seeding.py: replay one with
FUSEDSERVE_TEST_SEED=N); what real servers logged during a test is printed after it (pytest shows it when the test
failed)."""

from __future__ import annotations

import pytest
import torch

import kernels  # noqa: F401  (chooses interpreter vs compiled before any test module defines kernels)
from tests.schedule import make_scheduler, order
from tests.seeding import (  # noqa: F401  (hooks and an autouse fixture, registered by being in this module)
    _test_seed,
    pytest_fixture_setup,
    pytest_report_header,
    pytest_runtest_makereport,
)
from tests.server import dump_new_logs
from tests.sweeps import mark_and_order

HAS_CUDA = torch.cuda.is_available()


@pytest.hookimpl(tryfirst=True)  # before -m selects: `-m sweep` must see the marker
def pytest_collection_modifyitems(config, items):
    mark_and_order(items)  # the every-candidate sweeps: marked `sweep`, longest first (tests/sweeps.py)
    order(items, first=sum("sweep" in item.keywords for item in items))  # then modules, costliest first
    if HAS_CUDA:
        on_cpu = pytest.mark.skip(reason="runs fused kernels through Triton's interpreter on the CPU: CI's CPU runs it")
        for item in items:
            if "cpu_interpreter" in item.keywords:
                item.add_marker(on_cpu)
        return
    skip = pytest.mark.skip(reason="needs CUDA: on a GPU host, tests/gpu_suite.sh runs it (tests/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without it (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    return make_scheduler(config, log)  # None: xdist's own, for --dist other than load or with --maxschedchunk


@pytest.fixture(autouse=True)
def _no_compile_deadline_in_sweeps(request, monkeypatch):
    """A sweep compiles every candidate on purpose, beside 15 other workers' compiles: the service's 30 s compile
    deadline (kernels/compile_deadline.py) measures that load, not the kernel (pool's channels kernel passed it alone
    and missed it in a 8-worker run on an H200), so sweeps run without it. Its own tests set it themselves."""
    if "sweep" in request.keywords:
        from kernels import compile_deadline

        monkeypatch.setenv(compile_deadline.ENV, "0")
    yield


@pytest.fixture(autouse=True)
def _server_logs():
    yield
    dump_new_logs()  # nothing when no server runs


@pytest.fixture(scope="session")
def onnx_registry_once():
    """torch.onnx's dynamo exporter builds its registry of ONNX translations once in this process, not at every
    export (bench/zoo/exporters.py's onnx_registry_once, as test_zoo uses it): for the modules that export with it."""
    from bench.zoo.exporters import onnx_registry_once

    with onnx_registry_once():
        yield
