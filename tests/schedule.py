"""How the suite is spread over pytest-xdist's workers (`-n auto`, the README's test command): modules that share
an expensive fixture run whole on one worker, and the costliest work starts first.

pytest-xdist's default (`--dist load`) hands out chunks of consecutive tests, smaller and smaller as the run goes.
A module near the end of the collection then has its tests on both workers, and each worker sets up the module's
module-scoped fixtures: the real servers of tests/test_service_e2e*.py and test_v2_*.py (10-20 CPU-s a server on
the 2-core CI machine), test_zoo's exporter registry, the exports of test_import_onnx. Here:

- a module that defines a module- or session-scoped fixture (`@pytest.fixture(scope="module")`, found in its
  source) is one unit of work, run on one worker; every other test is a unit of its own;
- the collection is ordered (`order`, from conftest's collection hook, so every worker agrees on it): the
  every-candidate sweeps first as tests/sweeps.py orders them, then whole modules, costliest first by
  MODULE_CPU_S (longest-processing-time first: what is left at the end is short, so both workers finish
  together), each module's tests in their own order;
- the units are handed out in that order, a worker getting its next unit when it is down to its last two tests.

Only with xdist's default distribution (`-n N` without `--dist`, or `--dist load`) and no `--maxschedchunk`:
tests/gpu_suite.sh's kernel parts (`--maxschedchunk 1`) keep xdist's own scheduling.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SHARED_FIXTURE = re.compile(r"@pytest\.fixture\(\s*scope\s*=\s*[\"'](module|session)[\"']")

# CPU seconds of each module's tests on the 2-core CI machine without a GPU (one process, servers' processes
# included, Triton's cache warm; measured at 87a5783, scaled by what issue 51's changes since took off, each module
# measured alone before and after). Only the order depends on them: a module not listed counts as DEFAULT_S.
MODULE_CPU_S = {
    "test_fuzz_openapi": 91, "test_zoo": 229, "test_kernels_pool": 152, "test_kernels_conv": 106,
    "test_v2_protocol": 100, "test_bench_kernels": 89, "test_kernels_linear": 52, "test_load_balancer": 97,
    "test_kernels_conv_norm": 49, "test_kernels_conv_tma": 68, "test_executors": 80, "test_kernels_compile": 80,
    "test_service_e2e": 75, "test_fuzz_inputs": 32, "test_kernels_conv_xscale": 45, "test_multiprocess": 59,
    "test_attacks": 62, "test_keys_restart": 41, "test_import_onnx_blocks": 57, "test_docs": 50, "test_bench_serve": 44,
    "test_kernels_mlp": 31, "test_service_e2e_resnet": 41, "test_import_torch_blocks": 40, "test_service_e2e_cnn": 36,
    "test_security": 37, "test_import_onnx": 37, "test_hostile_http": 37, "test_kernels_conv_grouped": 32,
    "test_kernels_conv_grouped_fp8": 36, "test_kernels_conv_e4m3_out": 15, "test_kernels_conv_vectors": 8,
    "test_service_e2e_images": 27, "test_gpu_faults": 27, "test_service_e2e_uint8": 25, "test_bench_perf_analyzer": 14,
    "test_reload": 21, "test_kernels_conv_matrix": 20, "test_v2_extensions": 19, "test_import_torch": 19,
    "test_seeding": 17, "test_startup_progress": 12, "test_drain_delay": 15, "test_bench_serve_images": 15,
    "test_model_format": 14, "test_bench_soak": 14, "test_prometheus_scrape": 13, "test_bench_serve_files": 13,
    "test_v2_arena_body": 12, "test_model_input_norm": 12, "test_supervisor_ports": 11, "test_import_onnx_source": 10,
    "test_ab": 9, "test_images_preprocess": 8, "test_deploy_k8s": 8, "test_ab_dashboard": 8,
}  # fmt: skip
DEFAULT_S = 5.0


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@cache
def shares_fixtures(module: str) -> bool:
    """Whether the test module at `module` (a path relative to the root) defines a module- or session-scoped
    fixture."""
    try:
        return bool(_SHARED_FIXTURE.search((ROOT / module).read_text()))
    except OSError:
        return False


def order(items: list[pytest.Item], first: int = 0) -> None:
    """Sort items[first:] (in place, stably, deterministically) by their module's cost, costliest first; a module's
    tests stay together and in their order."""
    rest = items[first:]
    rank = {}
    for item in rest:
        module = module_of(item.nodeid)
        rank.setdefault(module, (-MODULE_CPU_S.get(Path(module).stem, DEFAULT_S), len(rank)))
    items[first:] = sorted(rest, key=lambda item: rank[module_of(item.nodeid)])


def make_scheduler(config: pytest.Config, log):
    """The scheduler for this run: ModuleUnits with xdist's default distribution, else None (xdist's own)."""
    if config.getoption("dist") != "load" or config.getoption("maxschedchunk") is not None:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):
        """A module that shares fixtures is one unit, any other test a unit of its own; units in collection order."""

        def _split_scope(self, nodeid: str) -> str:
            module = module_of(nodeid)
            return module if shares_fixtures(module) else nodeid

        def schedule(self) -> None:
            # LoadScopeScheduling sorts units by their number of tests; the collection's order is by cost.
            self.config.option.loadscopereorder = False
            super().schedule()

    return ModuleUnits(config, log)
