"""How `fusedserve bench kernels` measures: device time, wall time, graph capture, ceilings, error.

- device time: `triton.testing.do_bench(fn, return_mode="median")`. It zeroes a 256 MB buffer before
  every rep, which flushes L2 (so no input is timed from cache: it also answers "rotate the inputs")
  and keeps the GPU busy ~75 us at 3.5 TB/s, so host launch gaps shorter than that stay hidden: for a
  plain call this is the time the kernels take on the device, not the time Python takes to launch them.
- wall time: the callable run N times back-to-back from Python, one synchronize at the end, divided by
  N; the best of 5 such runs. Small cases are launch-bound, so this is the host cost per call, and the
  lent GPU's host is a VM whose launch cost wanders (the same fused call read 13.8-22.8 us across one
  run): the best run is the least disturbed one, the same rule for every provider.
- graph: the callable captured once into a CUDA graph on its static inputs (after 3 warm-up calls on
  a side stream, as torch.cuda.graphs documents); timed as `graph.replay`.
- error: ||y - ref|| / ||ref|| against a float64 reference of the same dtype-cast inputs.
- ceilings: a 1 GiB device-to-device copy (bytes read + written over time) and an 8192^3 matmul per
  dtype; floor(case) = max(bytes / bandwidth, flops / matmul rate).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Normwise error above which a result is flagged (loose: they catch wrong results, not rounding).
# Rounding of the stored output alone is 2^-11 = 4.9e-4 in fp16, 2^-8 = 3.9e-3 in bf16; TF32 operands
# give 5.4-5.7e-4 measured on an H200 (tests/tolerances.py); fp32 proper lands near 1e-7.
ERROR_BOUND = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-4}
ERROR_BOUND_TF32 = 2e-3

ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def error_bound(dtype: str, tf32: bool) -> float:
    return ERROR_BOUND_TF32 if (dtype == "float32" and tf32) else ERROR_BOUND[dtype]


@dataclass(frozen=True)
class Timing:
    """How long and how often to time; `--quick` shortens both (do_bench's arguments are milliseconds)."""

    warmup_ms: int = 10
    rep_ms: int = 50
    wall_target_s: float = 0.01  # each of the 5 wall-time runs lasts about this long (>= 3 calls)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_us(fn: Callable[[], object], timing: Timing) -> float:
    """Median device time of one call, in microseconds (CUDA only)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=timing.warmup_ms, rep=timing.rep_ms, return_mode="median")) * 1e3


def wall_us(fn: Callable[[], object], device: torch.device, timing: Timing) -> float:
    """Host time per call when calls run back-to-back and the device is waited for once, in microseconds."""
    for _ in range(3):
        fn()
    synchronize(device)
    t = time.perf_counter()
    fn()
    synchronize(device)
    one = max(time.perf_counter() - t, 1e-6)
    n = int(min(2000, max(3, timing.wall_target_s / one)))
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        synchronize(device)
        runs.append((time.perf_counter() - t) / n)
    return min(runs) * 1e6


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture one call of fn into a CUDA graph; returns the graph and its static output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # first-call work (autotuning, module loads, handles) must not happen in capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def normwise_error(y: torch.Tensor, ref: torch.Tensor) -> tuple[float | None, bool]:
    """(||y - ref|| / ||ref||, all finite). The error is None when y has NaN/Inf (never a pass)."""
    if tuple(y.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(y.shape)} != reference shape {tuple(ref.shape)}")
    y64 = y.detach().to(ref.device, torch.float64)
    finite = bool(torch.isfinite(y64).all())
    if not finite:
        return None, False
    denom = float(torch.linalg.vector_norm(ref))
    num = float(torch.linalg.vector_norm(y64 - ref))
    return (num / denom if denom > 0 else num), True


def floor_us(nbytes: float, flops: float, bandwidth: float, rate: float) -> float:
    """The physical floor: the larger of moving the bytes and doing the arithmetic, in microseconds."""
    return max(nbytes / bandwidth, flops / rate) * 1e6


def measure_ceilings(device: torch.device, dtypes: list[str], timing: Timing) -> dict:
    """Copy bandwidth (bytes/s, read + write) and matmul rate per dtype (flop/s), measured here, now.

    On CUDA: a 1 GiB copy (far past the 50-60 MB L2) and 8192^3 products on random data (zeros can run
    faster: METHOD.md saw 13% on bf16); fp32 runs with the TF32 setting already in force. On the CPU
    (smoke runs only) 64 MB and 1024^3, timed by the wall clock.
    """
    cuda = device.type == "cuda"
    n_copy = (1 << 28) if cuda else (1 << 24)  # floats: 1 GiB on the GPU, 64 MB on the CPU
    side = 8192 if cuda else 1024
    ceil_timing = Timing(warmup_ms=timing.warmup_ms, rep_ms=max(timing.rep_ms, 200))

    def seconds(fn):
        return (device_us(fn, ceil_timing) if cuda else _cpu_best_us(fn)) / 1e6

    def copy_rate() -> float:
        src = torch.randn(n_copy, device=device)
        dst = torch.empty_like(src)
        return 2 * src.numel() * src.element_size() / seconds(lambda: dst.copy_(src))

    def matmul_rate(dtype: torch.dtype) -> float:
        a = torch.randn(side, side, device=device).to(dtype)
        b = torch.randn(side, side, device=device).to(dtype)
        c = torch.empty_like(a)
        return 2 * side**3 / seconds(lambda: torch.mm(a, b, out=c))

    out = {"copy_bytes": 2 * n_copy * 4, "bandwidth": copy_rate(), "matmul_side": side}
    out["matmul_rate"] = {name: matmul_rate(DTYPES[name]) for name in dtypes}
    if cuda:
        torch.cuda.empty_cache()
    return out


def _cpu_best_us(fn) -> float:
    fn()
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


@dataclass
class Prepared:
    """A provider made ready for one case: `fn()` computes the case's output on static inputs.

    graphed: fn already replays a CUDA graph of its own (the service's GraphedExecutor), so its one
    variant is "graph" and nothing is captured around it. plain_only: measured as launched from
    Python only (ours-eager: the executor without graphs, by definition).
    """

    fn: Callable[[], torch.Tensor]
    compile_s: float | None = None  # first call: torch.compile, or our autotuning
    graphed: bool = False
    plain_only: bool = False


def describe(e: BaseException) -> str:
    """One line for a note and the JSON: the type and the message, lines joined, at most 300 characters
    (inductor's errors start with a line like "backend='inductor' raised:" and give the cause below it)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {' / '.join(lines)}"[:300]


def measure(prep: Prepared, ref: torch.Tensor, device: torch.device, timing: Timing, bound: float) -> dict:
    """{variant: cell} for "plain" and (on CUDA) "graph"; a variant that fails gets {"error": ...}."""
    cells = {}
    if not prep.graphed:
        cells["plain"] = _guarded(lambda: _cell(prep.fn, prep.fn, ref, device, timing, bound), device)
    if device.type != "cuda":
        return cells
    if prep.graphed:
        cells["graph"] = _guarded(lambda: _cell(prep.fn, prep.fn, ref, device, timing, bound), device)
    elif not prep.plain_only:
        cells["graph"] = _guarded(lambda: _graph_cell(prep.fn, ref, device, timing, bound), device)
    return cells


def _guarded(make: Callable[[], dict], device: torch.device) -> dict:
    try:
        return make()
    except Exception as e:  # a failing variant is a result (its cell says why), never the end of the run
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": describe(e)}


def _cell(call, timed, ref, device, timing, bound) -> dict:
    y = call()
    err, finite = normwise_error(y, ref)  # before the next call: a graphed executor's output is a view
    del y
    cell = {"err": err, "finite": finite, "bad": (not finite) or err > bound}
    cell["device_us"] = device_us(timed, timing) if device.type == "cuda" else None
    cell["wall_us"] = wall_us(timed, device, timing)
    return cell


def _graph_cell(fn, ref, device, timing, bound) -> dict:
    graph, out = capture(fn)
    out.fill_(float("nan"))  # every element must be written by the replay itself

    def replay_then_output():
        graph.replay()
        return out

    return _cell(replay_then_output, graph.replay, ref, device, timing, bound)
