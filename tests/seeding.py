"""Replayable random inputs: every test runs with a seed derived from its own id, the same in every run and in
every process (xdist workers included), printed when the test fails, and overridable to replay or vary it.

    seed = zlib.crc32(nodeid) & 0x7FFFFFFF          e.g. tests/test_kernels_mlp.py::test_x[torch.float16-3]
    FUSEDSERVE_TEST_SEED=N pytest NODEID            runs with seed N instead (every test of that run)

torch (CPU and CUDA), numpy's global generator and python's `random` are seeded before the test's function-scoped
fixtures run. A module- or session-scoped fixture is seeded from its own id (scope node + fixture name + param) and
leaves the global generators as it found them, so what a test draws does not depend on which test happened to
create a shared fixture first (that changes with -k, -x and how xdist hands out tests).

Python salts `hash(str)` per process (PYTHONHASHSEED), so the old `abs(hash(nodeid))` seed changed every run.

A plugin module: tests/conftest.py imports its hooks and fixture; `pytest -p tests.seeding` loads it alone
(tests/test_seeding.py does, on a tiny test file in a temporary directory).
"""

from __future__ import annotations

import os
import random
import shlex
import zlib

import numpy as np
import pytest
import torch

SEED_ENV = "FUSEDSERVE_TEST_SEED"
_current: int | None = None  # the seed the running test was given: a shared fixture's setup restores to it
_seed_key = pytest.StashKey[int]()


def seed_for(key: str) -> int:
    """The seed of a test id (or a shared fixture's key): FUSEDSERVE_TEST_SEED when set, else crc32 of the id."""
    override = os.environ.get(SEED_ENV, "").strip()
    if override:
        try:
            return int(override, 0) & 0x7FFFFFFF
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV}={override!r}: expected an integer") from None
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # CPU and every CUDA device (lazily where CUDA is not initialised yet)


def rerun_hint(nodeid: str, seed: int) -> str:
    return f"seed: {seed}; rerun with {SEED_ENV}={seed} python -m pytest {shlex.quote(nodeid)}"


def pytest_report_header(config) -> str:
    override = os.environ.get(SEED_ENV, "").strip()
    if override:
        return f"test seeds: {SEED_ENV}={override} for every test"
    return f"test seeds: crc32 of each test's id ({SEED_ENV}=N overrides; printed on failure)"


@pytest.fixture(autouse=True)
def _test_seed(request):
    """Seeds the generators for this test; autouse, so it runs before the test's other function-scoped fixtures."""
    global _current
    _current = seed_for(request.node.nodeid)
    request.node.stash[_seed_key] = _current
    seed_everything(_current)
    yield
    _current = None


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope == "function":
        return (yield)
    # A shared fixture: its own seed, and the global generators put back afterwards.
    key = f"{request.node.nodeid}::{fixturedef.argname}[{getattr(request, 'param_index', 0)}]"
    cuda_was_on = torch.cuda.is_initialized()
    saved = (
        random.getstate(),
        np.random.get_state(),
        torch.get_rng_state(),
        torch.cuda.get_rng_state_all() if cuda_was_on else None,
    )
    seed_everything(seed_for(key))
    try:
        return (yield)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if cuda_was_on:
            torch.cuda.set_rng_state_all(saved[3])
        elif _current is not None:
            # CUDA came up inside the fixture (or its lazy seed is still queued): no test drew from it yet, so it
            # goes back to the test's seed.
            torch.cuda.manual_seed_all(_current)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        seed = item.stash.get(_seed_key, None)
        if seed is None:  # failed before the seed fixture ran (a shared fixture's setup): the seed it would have had
            seed = seed_for(item.nodeid)
        report.sections.append(("test seed", rerun_hint(item.nodeid, seed)))
    return report
