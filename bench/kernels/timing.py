"""How `fusedserve bench kernels` measures: device time, wall time, graph capture, ceilings, error.

- device time: `kernels.cold_timing.cold_us`, triton.testing.do_bench's loop (median) with L2 cleared
  by reading a 256 MB buffer before every rep, where do_bench zeroes it (the dirty lines that zeroing
  leaves cost a 48 MB read 5 us of write-back: see cold_timing). No input is timed from cache (this also
  answers "rotate the inputs"), and the read (~63 us at 4.25 TB/s) keeps the GPU busy, so host launch
  gaps shorter than that stay hidden: for a plain call this is the time the kernels take on the device,
  not the time Python takes to launch them.
- wall time: host time per call. One run: one untimed call and a synchronize (the device idle, this
  provider's code and data back in the caches), then N calls back-to-back from Python and one
  synchronize, divided by N; the garbage collector is off during the run (as in `timeit`). N is chosen
  per cell from one timed call so that a run lasts about `Timing.wall_target_s` (3 to 2000 calls). Small
  cases are launch-bound, so this is the host cost per call, and the lent GPU's host is a VM whose speed
  drifts over seconds (the same fused call can read 12.6 us in one case and 18.9 us in a nearly
  identical one). So the cells of one case take turns: after every provider of the case has been measured
  otherwise, round r runs each cell once (plain and graph, in provider order), 5 rounds, and a cell's
  wall time is its best run, the least disturbed one: every provider sees the same host, and a ratio
  of two wall times compares calls, not moments. A cell whose run raises gets the error; the rounds go
  on without it. torch.compile providers are the exception: their 5 runs are taken on the spot, one
  after the other, because their compiled code is dropped (torch._dynamo.reset) before the next provider.
- graph: the callable captured once into a CUDA graph on its static inputs (after 3 warm-up calls on
  a side stream, as torch.cuda.graphs documents); timed as `graph.replay`.
- hot (graph cells only): the same replay as a busy server runs it, back to back with the weights left in
  L2 by the replay before: `kernels.hot_timing.hot_us` (its module docstring says how), as the tuner times
  hot. If the device may have run at the host's pace, the cell says so ("hot_host_bound": true).
- error: ||y - ref|| / ||ref|| against a float64 reference of the same dtype-cast inputs.
- ceilings: a 1 GiB device-to-device copy (bytes read + written over time) and an 8192^3 matmul per
  dtype; floor(case) = max(bytes / bandwidth, flops / matmul rate).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels import graph_capture
from kernels.cold_timing import cold_us
from kernels.hot_timing import hot_us

# Normwise error above which a result is flagged (loose: they catch wrong results, not rounding).
# Rounding of the stored output alone is 2^-11 = 4.9e-4 in fp16, 2^-8 = 3.9e-3 in bf16; TF32 operands
# give 5.4-5.7e-4 measured on an H200 (tests/tolerances.py); fp32 proper lands near 1e-7.
ERROR_BOUND = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-4}
ERROR_BOUND_TF32 = 2e-3

ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Wall-time runs per cell (the best one counts). Kept at 5: with the providers interleaved, a case's
# wall phase lasts 5 x (cells x Timing.wall_target_s), about what the runs took one provider at a time.
WALL_ROUNDS = 5


def error_bound(dtype: str, tf32: bool) -> float:
    return ERROR_BOUND_TF32 if (dtype == "float32" and tf32) else ERROR_BOUND[dtype]


@dataclass(frozen=True)
class Timing:
    """How long and how often to time; `--quick` shortens both (cold_us's arguments are milliseconds)."""

    warmup_ms: int = 10
    rep_ms: int = 50
    wall_target_s: float = 0.01  # each wall-time run lasts about this long (>= 3 calls)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def warm_ours(fn: Callable[[], object], device: torch.device) -> None:
    """Ours' calls before it is timed: on CUDA three (the first autotunes the batch bucket and, for a model, captures
    its graph; later ones launch directly); without CUDA one, since Triton's interpreter has fixed configs and no
    graph (each more call was an interpreted forward for nothing: a ResNet-18 at 3x32x32, batch 2, ~15 CPU-s)."""
    for _ in range(3 if device.type == "cuda" else 1):
        fn()
    synchronize(device)


def back_to_back_us(fn: Callable[[], object], reps: int, warmups: int) -> float:
    """Device us per call of fn: `warmups` calls, then `reps` back to back between two CUDA events (the pool
    study's and the conv probes' hot time; the kernel benchmark's own is kernels.hot_timing)."""
    for _ in range(warmups):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def device_us(fn: Callable[[], object], timing: Timing) -> float:
    """Median device time of one call, in microseconds (CUDA only), L2 cleared before each."""
    return cold_us(fn, warmup_ms=timing.warmup_ms, rep_ms=timing.rep_ms)


def calls_per_run(fn: Callable[[], object], device: torch.device, timing: Timing) -> int:
    """How many calls make one wall-time run last about `timing.wall_target_s`, from one timed call."""
    for _ in range(3):
        fn()
    synchronize(device)
    t = time.perf_counter()
    fn()
    synchronize(device)
    one = max(time.perf_counter() - t, 1e-6)
    return int(min(2000, max(3, timing.wall_target_s / one)))


def timed_run(fn: Callable[[], object], n: int, device: torch.device) -> float:
    """One wall-time run: seconds per call over n back-to-back calls and one synchronize, GC off."""
    gc_was_on = gc.isenabled()
    gc.disable()  # a collection inside the run would be charged to whichever provider happened to trigger it
    try:
        fn()  # untimed: the previous run was another provider's (see the module docstring)
        synchronize(device)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        synchronize(device)
        return (time.perf_counter() - t) / n
    finally:
        if gc_was_on:
            gc.enable()


def wall_us(fn: Callable[[], object], device: torch.device, timing: Timing) -> float:
    """On the spot (torch.compile providers only): the best of WALL_ROUNDS runs, one after the other, in us."""
    n = calls_per_run(fn, device, timing)
    return min(timed_run(fn, n, device) for _ in range(WALL_ROUNDS)) * 1e6


@dataclass
class WallRun:
    """One cell's wall time, deferred to the end of its case: `interleave` fills `cell["wall_us"]`.

    fn keeps what it calls alive (the provider, or its captured graph) until the case drops its WallRuns.
    """

    fn: Callable[[], object]
    n: int  # calls per run, chosen when the cell was measured
    cell: dict
    runs: list[float] = field(default_factory=list)  # seconds per call, one per round
    spent_s: float = 0.0  # wall-clock seconds its runs took, warm-up calls included


def interleave(jobs: list[WallRun], device: torch.device, rounds: int = WALL_ROUNDS) -> None:
    """Round by round, one run of every job in turn; each cell's wall_us is its best run.

    A job whose run raises has its cell replaced by {"error": ...} (as `_guarded` does) and leaves the rounds.
    """
    live = list(jobs)
    for _ in range(rounds):
        for job in list(live):
            t = time.perf_counter()
            try:
                job.runs.append(timed_run(job.fn, job.n, device))
            except Exception as e:  # this cell's result is its error; the others still need their rounds
                live.remove(job)
                job.cell.clear()
                job.cell["error"] = describe(e)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            job.spent_s += time.perf_counter() - t
    for job in live:
        job.cell["wall_us"] = min(job.runs) * 1e6


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture one call of fn into a CUDA graph (after 3 warm-up calls); returns the graph and its static output."""
    graph, out = graph_capture.capture(fn, warmups=3)
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


def measure(
    prep: Prepared,
    ref: torch.Tensor,
    device: torch.device,
    timing: Timing,
    bound: float,
    defer: list[WallRun] | None = None,
) -> dict:
    """{variant: cell} for "plain" and (on CUDA) "graph"; a variant that fails gets {"error": ...}.

    defer=None times the wall on the spot. With a list, each cell's wall runs are appended to it as a
    WallRun (its "wall_us" stays None until `interleave` runs it with the rest of the case).
    """

    def cell(call, timed, hot=False):
        return _cell(call, timed, ref, device, timing, bound, defer, hot)

    cells = {}
    if not prep.graphed:
        cells["plain"] = _guarded(lambda: cell(prep.fn, prep.fn), device)
    if device.type != "cuda":
        return cells
    if prep.graphed:
        cells["graph"] = _guarded(lambda: cell(prep.fn, prep.fn, hot=True), device)
    elif not prep.plain_only:
        cells["graph"] = _guarded(lambda: _graph_cell(prep.fn, cell), device)
    return cells


def _guarded(make: Callable[[], dict], device: torch.device) -> dict:
    try:
        return make()
    except Exception as e:  # a failing variant is a result (its cell says why), never the end of the run
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": describe(e)}


def _cell(call, timed, ref, device, timing, bound, defer: list[WallRun] | None, hot: bool = False) -> dict:
    """One variant's cell. hot: a graph replay, also timed back to back (`hot_us`)."""
    y = call()
    err, finite = normwise_error(y, ref)  # before the next call: a graphed executor's output is a view
    del y
    cell = {"err": err, "finite": finite, "bad": (not finite) or err > bound}
    cell["device_us"] = device_us(timed, timing) if device.type == "cuda" else None
    if hot and device.type == "cuda":
        cell.update(hot_us(timed))
    if defer is None:
        cell["wall_us"] = wall_us(timed, device, timing)
    else:
        cell["wall_us"] = None  # until the case's interleaved rounds
        defer.append(WallRun(timed, calls_per_run(timed, device, timing), cell))
    return cell


def _graph_cell(fn, cell: Callable) -> dict:
    graph, out = capture(fn)
    out.fill_(float("nan"))  # every element must be written by the replay itself

    def replay_then_output():
        graph.replay()
        return out

    return cell(replay_then_output, graph.replay, hot=True)
