"""The `sweep` marker: kernel tests that compile every candidate config the tuner may pick (or compile kernels for
sm_90 to read ptxas's report). They are most of the GPU suite's time, so tests/gpu_suite.sh runs them as a part of
their own (kernels-a), and here they are marked by name and ordered longest first.

Marked by name, not in each file, so that a new sweep is caught by its name alone: a test function of
tests/test_kernels_*.py whose name matches SWEEP_NAME (every_candidate, every_..._config, each_..._config,
..._for_sm90).

Order: pytest-xdist (--dist load --maxschedchunk 1, as gpu_suite.sh runs it) hands each worker its first two tests
in collection order, then one more each time it is down to one. So the longest sweeps come first, each followed by a
short one (two long ones back to back would run on one worker, one after the other), then the rest longest first:
the last to start are short, and no worker is left with a 200 s test when the others are done.
"""

from __future__ import annotations

import re

import pytest

SWEEP_NAME = re.compile(r"every_candidate|every_\w*config|each_\w*config|_for_sm90")
SWEEP_FILE = re.compile(r"(^|/)tests/test_kernels_\w+\.py$")

# Seconds, cold Triton cache, 16 xdist workers on a 16-core H100 / H200 host (bench/results/<gpu>/gpu_tests_*.txt);
# the first entry whose text is in a test's node id gives its estimate. Only the order depends on them.
ESTIMATED_S = [
    ("test_kernels_pool.py::test_gpu_every_candidate", 226),
    ("test_kernels_conv.py::test_gpu_every_candidate[torch.float32]", 178),
    ("test_kernels_conv.py::test_gpu_every_candidate", 122),
    ("test_kernels_conv_tma.py::test_gpu_every_candidate[torch.float32]", 95),
    ("test_kernels_conv_tma.py::test_gpu_every_candidate", 50),
    ("test_kernels_compile.py::test_whole_mlp_kernel_compiles_for_sm90", 46),
    ("test_kernels_mlp.py::test_gpu_every_config_the_tuner_may_pick[torch.float32", 25),
    ("test_kernels_linear.py::test_gpu_prepared_layer_with_each_persistent_config", 27),
    ("test_kernels_linear_persistent.py::test_gpu_every_config", 20),
    ("_for_sm90", 20),
]
LONG_S = 40  # these start first, one per worker


def is_sweep(item: pytest.Item) -> bool:
    name = getattr(item, "originalname", item.name)
    return bool(SWEEP_FILE.search(item.nodeid.split("::")[0]) and SWEEP_NAME.search(name))


def estimate_s(nodeid: str) -> float:
    return next((s for text, s in ESTIMATED_S if text in nodeid), 1.0)


def mark_and_order(items: list[pytest.Item]) -> None:
    """Marks the sweeps `sweep` and moves them to the front, longest first, each of the longest followed by a short
    one; every other test keeps its place after them. In place, deterministic (every xdist worker must agree)."""
    sweeps = []
    for item in items:
        if is_sweep(item):
            item.add_marker(pytest.mark.sweep)
            sweeps.append(item)
    if not sweeps:
        return
    rest = [i for i in items if not is_sweep(i)]
    # sorted() is stable: equal estimates keep collection order
    by_time = sorted(sweeps, key=lambda i: -estimate_s(i.nodeid))
    long = [i for i in by_time if estimate_s(i.nodeid) >= LONG_S]
    others = by_time[len(long) :]
    shortest = others[::-1][: len(long)]
    ordered = []
    for i, item in enumerate(long):
        ordered.append(item)
        if i < len(shortest):
            ordered.append(shortest[i])
    paired = set(shortest)
    ordered += [i for i in others if i not in paired]
    items[:] = ordered + rest
