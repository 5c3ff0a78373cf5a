"""Two configurations of one model in one engine (A and B: fused and unfused, or two precisions, FUSEDSERVE_AB_OTHER):
which executor runs each batch, the shadow comparison, and an executor loaded while the engine serves.

Configurations (`Configs`): A is the configured mode's executor (fused in `ab` mode) in FUSEDSERVE_DTYPE; B is
FUSEDSERVE_AB_OTHER (MODE:DTYPE), else the other mode in that dtype. Each executor is known by its label, the `mode` of
its answers and metrics: `fused` or `unfused` while both share a dtype, and `MODE:DTYPE` (fused:float8,
fused:float16) for both when their dtypes differ, so that every series and answer says which precision ran it.

Which mode runs a batch (`ModeSplit`, in `ab` mode): error diffusion per batch-size bucket. The buckets are the
CUDA graphs' (1, 2, 3-4, 5-8, ..., powers of two), and each keeps an accumulator that starts at 1/2 and gains the
unfused share p (FUSEDSERVE_AB_UNFUSED_PERCENT / 100) with every batch; a batch whose addition reaches 1 runs
unfused and takes 1 off. So after n batches of a bucket exactly round(n * p) of them ran unfused: within each bucket
the two modes' counts never differ from the asked share by more than half a batch, and both see the same mix of
batch sizes, with no luck in it (a plain random draw at p = 1/2 is off by ~sqrt(n)/2 batches, and by more in the
rare buckets). At p = 1/2 a bucket alternates: unfused, fused, unfused, ... The choice depends on nothing but the
bucket's own count, not on what ran before: an unfused batch takes longer, so the batch after it is larger under
load, and that batch's mode is its bucket's next, whatever the last one was.

Shadow (`Shadow`, FUSEDSERVE_SHADOW_EVERY = N > 0): every Nth batch keeps a copy of its rows and its outputs; once
its answers are sent and no request is queued, the engine runs the same rows in the other mode and compares:
max |fused - unfused| over the batch, relative to the largest |output| of the two (`compare`), and the rows whose
argmax differs. A shadow forward is not counted in the forward or kernel metrics. Under a load that leaves the engine
no idle moment the copies wait (at most MAX_PENDING, the oldest dropped and counted): a shadow never delays a
request that is already queued, though one that arrives during a shadow forward waits for it (microseconds on a GPU).

Executors (`Modes`): an engine holds the executors its configuration needs, both in `ab` mode or with SHADOW_EVERY
above 0. A reload that needs one it lacks starts a thread that builds, tunes and captures it while the engine keeps
serving in the configuration it has; the new configuration takes effect between two batches once the thread is done.
An executor once loaded stays loaded, so switching back is immediate. CUDA graph captures in an engine are
thread-local (`captures_ignore_other_threads`): with torch's default, a capture on the loading thread forbids the
serving thread's stream synchronisation, which then fails as if the device were broken (seen on an H200).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

FUSED, UNFUSED = "fused", "unfused"
OTHER = {FUSED: UNFUSED, UNFUSED: FUSED}
PRECISIONS = ("float32", "float16", "bfloat16", "float8")
MAX_PENDING = 4  # shadow copies waiting for an idle moment; beyond this the oldest is dropped
# Largest max |fused - unfused| / max |output| over a batch that is rounding: the unfused path rounds after the
# matmul, the bias and the activation, the fused one once, so both sit within a few units in the last place of the
# dtype (float16's is 9.8e-4 at 1, bfloat16's 7.8e-3), and their difference can only be smaller than the batch's
# largest output by the same factor. float32 under TF32 rounds each operand to 10 mantissa bits (~5e-4).
# float8: both modes quantize the same e4m3 operands and differ in the order of fp32 sums, which moves a value across an
# e4m3 rounding boundary now and then: one step there is 2**-3 of it, and the next layer carries it on.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2, "float8": 1e-1}
TOLERANCE_TF32 = 5e-3
# Two precisions (FUSEDSERVE_AB_OTHER with another dtype): the difference is the coarser one's quantization, not a
# rounding order. float8 against float16: each e4m3 value is off by up to 2**-4 of itself (3 mantissa bits), per-tensor
# scales leave small activations fewer bits still, and the error of every fp8 layer reaches the output; 0.25 of the
# largest output is where a batch's worst logit is off by a quarter of the scale of the logits.
TOLERANCE_PRECISION = {"float8": 0.25, "bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-4}
WARN_EVERY_S = 10.0  # after the first, at most one warning this often; the next one says how many were not logged


def captures_ignore_other_threads() -> bool:
    """Make every CUDA graph capture of this process thread-local (cudaStreamCaptureModeThreadLocal) unless its caller
    asks otherwise; False when this torch cannot.

    torch.cuda.graph captures in the global mode by default: while one thread captures, every other thread of the
    process is forbidden "potentially unsafe" CUDA calls, a stream synchronisation among them. An engine loading an
    executor captures its graphs (and its tuner times candidates as graph replays) on a thread of its own while the
    engine's thread serves: in the global mode the serving thread's next synchronisation failed with "operation not
    permitted when stream is capturing", and the engine took it for a sticky device error and exited. In the
    thread-local mode a capture forbids those calls to its own thread only. The serving thread touches no stream of
    the capture (torch's side streams are non-blocking, so its work on the default stream never joins them), and it
    allocates nothing while it serves (each batch replays its bucket's graph), so nothing it does can break a capture;
    were a capture to fail anyway, only that load would fail (Modes.poll), and serving would go on."""
    import functools
    import inspect

    import torch

    graph = torch.cuda.graph
    init = graph.__init__
    if getattr(init, "_thread_local_captures", False):
        return True
    if "capture_error_mode" not in inspect.signature(init).parameters:
        return False

    @functools.wraps(init)
    def __init__(self, cuda_graph, *args, capture_error_mode: str = "thread_local", **kwargs):
        init(self, cuda_graph, *args, capture_error_mode=capture_error_mode, **kwargs)

    __init__._thread_local_captures = True
    graph.__init__ = __init__
    return True


class Configs:
    """The configurations an engine may build, by label: A of each live mode, and B (`other`, else the other mode in
    `dtype`). Labels are the modes while A and B share a dtype, MODE:DTYPE when they do not (the module docstring)."""

    def __init__(self, dtype: str | None = None, other: tuple[str, str] | None = None):
        self.dtype = dtype
        self.other = other
        self.qualified = other is not None and other[1] != dtype

    def label(self, mode: str, dtype: str | None = None) -> str:
        return f"{mode}:{dtype or self.dtype}" if self.qualified else mode

    def config(self, label: str) -> tuple[str, str | None]:
        """A label's (mode, dtype): `fused` -> ("fused", dtype), `fused:float16` -> ("fused", "float16")."""
        mode, _, dtype = label.partition(":")
        return mode, (dtype or self.dtype)

    def pair(self, mode: str) -> tuple[str, str]:
        """The labels (A, B) under the live `mode` (fused, unfused or ab); ValueError where B would be A."""
        a = (FUSED if mode == "ab" else mode, self.dtype)
        b = self.other or (OTHER[a[0]], self.dtype)
        if b == a:
            raise ValueError(f"FUSEDSERVE_AB_OTHER ({b[0]}:{b[1]}) is the served configuration itself (mode {mode}, "
                             f"dtype {self.dtype}): name another mode or dtype")  # fmt: skip
        return self.label(*a), self.label(*b)

    def name(self, label: str) -> str:
        """A label as MODE:DTYPE, for logs and reports."""
        mode, dtype = self.config(label)
        return f"{mode}:{dtype}" if dtype else mode


def needed_modes(mode: str, shadow_every: int, configs: Configs | None = None) -> tuple[str, ...]:
    """The executors' labels a configuration runs, A first: A and B in ab mode or with a shadow, else A alone."""
    a, b = (configs or Configs()).pair(mode)
    if mode == "ab" or shadow_every > 0:
        return (a, b)
    return (a,)


def tolerance(dtype_a: str | None, dtype_b: str | None, tf32: bool = False) -> float:
    """The largest shadow error (`compare`) that is rounding (one dtype) or quantization (two; TOLERANCE_PRECISION)."""
    if dtype_a != dtype_b and dtype_a in TOLERANCE_PRECISION and dtype_b in TOLERANCE_PRECISION:
        return max(TOLERANCE_PRECISION[dtype_a], TOLERANCE_PRECISION[dtype_b])
    return TOLERANCE_TF32 if (tf32 and dtype_a == "float32") else TOLERANCE.get(dtype_a, 1e-2)


def bucket_of(rows: int) -> int:
    """The batch-size bucket of `rows`: 0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8, ... (the CUDA graphs' buckets)."""
    return (rows - 1).bit_length()


class ModeSplit:
    """Which mode runs each batch in ab mode: error diffusion per batch-size bucket (the module docstring)."""

    def __init__(self, unfused_percent: float):
        self.share = 0.0
        self._acc: dict[int, float] = {}
        self.set_percent(unfused_percent)

    def set_percent(self, unfused_percent: float) -> None:
        """A new share starts every bucket afresh."""
        self.share = unfused_percent / 100.0
        self._acc = {}

    def pick(self, rows: int) -> str:
        b = bucket_of(rows)
        acc = self._acc.get(b, 0.5) + self.share
        if acc >= 1.0 - 1e-9:  # the tolerance: 0.3 added ten times is 2.9999999999999996
            self._acc[b] = acc - 1.0
            return UNFUSED
        self._acc[b] = acc
        return FUSED


def compare(primary_mode: str, primary: np.ndarray, other: np.ndarray) -> tuple[float, int]:
    """(max |fused - unfused| / max(|fused|, |unfused|) over the batch, rows whose argmax differs), symmetric in the
    two (A and B of any two configurations: `fused` names one side, anything else the other). Outputs that are
    both NaN, or the same infinity, agree; a non-finite value where the other mode has another value is an error of
    inf. Outputs that are all zero in both modes differ by 0.

    In torch, on the engine's thread: the outputs come in the wire dtype (float16 on a GPU), and numpy converts
    float16 one element at a time (3.4 ms for 1024 x 10 outputs on the 2-core CI machine, against 0.4 in torch)."""
    import torch

    fused, unfused = (primary, other) if primary_mode == FUSED else (other, primary)
    f = torch.from_numpy(np.ascontiguousarray(fused)).float()
    u = torch.from_numpy(np.ascontiguousarray(unfused)).float()
    mismatches = int((f.argmax(dim=1) != u.argmax(dim=1)).sum()) if f.numel() else 0
    diff = (f - u).abs_()
    worst = float(diff.max()) if diff.numel() else 0.0
    if not math.isfinite(worst):  # a NaN or an infinity somewhere: equal ones agree
        same = (f == u) | (f.isnan() & u.isnan())
        diff[same] = 0.0
        worst = float(diff.max())
        if not math.isfinite(worst):
            return float("inf"), mismatches
        f = torch.where(f.isfinite(), f, 0.0)
        u = torch.where(u.isfinite(), u, 0.0)
    if worst == 0.0:
        return 0.0, mismatches
    scale = max(float(f.abs().max()), float(u.abs().max()))
    return (worst / scale if scale > 0 else float("inf")), mismatches


@dataclass
class _Copy:
    mode: str  # the mode that answered
    rows: np.ndarray  # the batch's input, a copy of its own
    outputs: np.ndarray  # what was answered


class Shadow:
    """Every Nth batch run again in the other configuration while the engine is idle, and the two compared."""

    def __init__(self, every: int, metrics, dtype: str, tf32: bool = False):
        self.every = every
        self.metrics = metrics
        self.dtype = dtype
        self.tf32 = tf32
        self.tolerance = tolerance(dtype, dtype, tf32)
        self.pair = (FUSED, UNFUSED)  # the labels of A and B (Modes.set_pair)
        self.names = self.pair  # as MODE:DTYPE, for the warning
        self.pending: collections.deque[_Copy] = collections.deque()
        self.dropped = 0
        self._count = 0
        self._warned_at: float | None = None
        self._unwarned = 0

    def set_pair(self, a: str, b: str, configs: Configs) -> None:
        """Compare A (label `a`) with B (`b`) from now on, with the tolerance of their dtypes."""
        self.pair = (a, b)
        self.names = (configs.name(a), configs.name(b))
        dtypes = [configs.config(x)[1] or self.dtype for x in self.pair]
        self.tolerance = tolerance(dtypes[0], dtypes[1], self.tf32)

    def set_every(self, every: int) -> None:
        self.every = every
        if not every:
            self.pending.clear()

    def due(self) -> bool:
        """Whether the batch about to run is one to compare (counts every batch)."""
        if not self.every:
            return False
        self._count += 1
        return self._count % self.every == 0

    def keep(self, mode: str, parts: list[np.ndarray], outputs: np.ndarray) -> None:
        """Keep a batch for comparison: its rows copied (they are views of the front ends' memory, reused once the
        batch is answered) and its outputs (memory of their own)."""
        # rows decoded on the GPU (service/images/gpu_decode.py) are torch tensors there: brought back
        parts = [p.cpu().numpy() if not isinstance(p, np.ndarray) else p for p in parts]
        rows = parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
        if len(self.pending) >= MAX_PENDING:
            self.pending.popleft()
            self.dropped += 1
        self.pending.append(_Copy(mode, rows, outputs))

    def run_one(self, runners: dict) -> None:
        """Run the oldest kept batch in the other configuration and record the comparison."""
        copy = self.pending.popleft()
        a, b = self.pair
        if copy.mode not in self.pair:  # kept before a reload changed the pair: its other side is unknown
            return
        other_label = b if copy.mode == a else a
        runner = runners.get(other_label)
        if runner is None:  # the configuration changed and that executor is gone (it never is today)
            return
        try:
            other = runner.collect(runner.launch([copy.rows], observe=False))
        except Exception as err:
            log.warning("shadow forward of %d rows in %s failed: %s: %s",
                        len(copy.rows), other_label, type(err).__name__, err)  # fmt: skip
            return
        error, mismatches = compare(FUSED if copy.mode == a else UNFUSED, copy.outputs, other)
        self.metrics.shadow(error, mismatches, len(copy.rows), a, b)
        if error > self.tolerance:
            self._warn(len(copy.rows), error, mismatches)

    def _warn(self, rows: int, error: float, mismatches: int) -> None:
        now = time.monotonic()
        if self._warned_at is not None and now - self._warned_at < WARN_EVERY_S:
            self._unwarned += 1
            return
        more = f"; {self._unwarned} more batches over it since the last warning" if self._unwarned else ""
        a, b = self.names
        dtypes = self.dtype if a.partition(":")[2] == b.partition(":")[2] else f"{a} against {b}"
        log.warning(
            "shadow: a batch of %d rows differs between %s and %s by %.3g of its largest output, beyond "
            "%s's tolerance %g; %d of its rows predict another label%s",
            rows, a, b, error, dtypes, self.tolerance, mismatches, more,
        )  # fmt: skip
        self._warned_at = now
        self._unwarned = 0


class _Loader(threading.Thread):
    """Builds, tunes and captures one executor while the engine serves (Modes.configure)."""

    def __init__(self, mode: str, make: Callable[[str], object]):
        super().__init__(name=f"load-{mode}", daemon=True)
        self.mode = mode
        self._make = make
        self.runner = None
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        t = time.perf_counter()
        try:
            self.runner = self._make(self.mode)
        except BaseException as e:  # reported by the engine's thread (Modes.poll)
            self.error = e
        self.seconds = time.perf_counter() - t


@dataclass(frozen=True)
class LiveMode:
    """The part of the configuration that picks executors."""

    mode: str
    unfused_percent: float
    shadow_every: int


class Modes:
    """An engine's executors by mode and the configuration that picks among them for each batch."""

    def __init__(self, runners: dict, config: LiveMode, metrics, shadow: Shadow, make: Callable[[str], object] | None,
                 configs: Configs | None = None):  # fmt: skip
        self.runners = dict(runners)
        self.config = config
        self.metrics = metrics
        self.shadow = shadow
        self.configs = configs or Configs(shadow.dtype)
        self.pair = self.configs.pair(config.mode)  # the labels of A and B under the live mode
        shadow.set_pair(*self.pair, self.configs)
        self._announce_pair()
        self.split = ModeSplit(config.unfused_percent)
        self.make = make  # builds and warms the runner of a mode (engine_main); None: no loading (tests)
        self.target: LiveMode | None = None  # a configuration waiting for its executors
        self.loading: dict[str, _Loader] = {}
        self.on_failed: Callable[[], None] | None = None  # a load failed (counted as a failed reload)
        self.on_loaded: Callable[[], None] | None = None
        missing = [m for m in self._needed(config) if m not in self.runners]
        if missing:
            raise ValueError(f"mode {config.mode} (shadow every {config.shadow_every}) needs the {missing} executors")

    def _needed(self, config: LiveMode) -> tuple[str, ...]:
        return needed_modes(config.mode, config.shadow_every, self.configs)

    def _announce_pair(self) -> None:
        """fusedserve_ab_info: which two executors this engine compares, while it runs both (ab mode or a shadow)."""
        both = self.config.mode == "ab" or self.config.shadow_every > 0
        set_ab = getattr(self.metrics, "set_ab", None)
        if set_ab is not None:
            set_ab(*self.pair) if both else set_ab(None, None)

    @property
    def mode(self) -> str:
        return self.config.mode

    def pick(self, rows: int) -> str:
        """The mode that runs the next batch, of `rows` rows."""
        if self.config.mode != "ab":
            return self.pair[0]
        return self.pair[1] if self.split.pick(rows) == UNFUSED else self.pair[0]

    def configure(self, config: LiveMode) -> None:
        """Take `config` now if its executors are loaded, else load them in the background and take it then."""
        missing = [m for m in self._needed(config) if m not in self.runners]
        if not missing:
            self.target = None
            self._apply(config)
            return
        if self.make is None:
            raise RuntimeError(f"this engine cannot load the {missing} executor(s)")
        self.target = config
        for m in missing:
            if m not in self.loading:
                log.info("loading the %s executor for mode %s; serving on in %s meanwhile", m, config.mode, self.mode)
                loader = self.loading[m] = _Loader(m, self.make)
                loader.start()

    def poll(self) -> bool:
        """Between batches: adopt the executors whose loading ended, and take the waiting configuration once all are
        there. True when something changed."""
        done = [m for m, loader in self.loading.items() if not loader.is_alive()]
        if not done:
            return False
        for m in done:
            loader = self.loading.pop(m)
            loader.join()
            if loader.error is not None:
                err = loader.error
                log.error("could not load the %s executor (%s: %s); staying in mode %s",
                          m, type(err).__name__, err, self.mode, exc_info=err)  # fmt: skip
                self.target = None
                if self.on_failed is not None:
                    self.on_failed()
                continue
            self.runners[m] = loader.runner
            log.info("%s executor loaded and warm in %.1f s", m, loader.seconds)
            if self.on_loaded is not None:
                self.on_loaded()
        target = self.target
        if target is not None and all(m in self.runners for m in self._needed(target)):
            self.target = None
            self._apply(target)
        return True

    def _apply(self, config: LiveMode) -> None:
        old = self.config
        if config == old:
            return
        if config.mode != old.mode:
            log.info("mode %s -> %s", old.mode, config.mode)
            self.metrics.set_mode(config.mode)
        if config.unfused_percent != old.unfused_percent or config.mode != old.mode:
            self.split.set_percent(config.unfused_percent)
        self.shadow.set_every(config.shadow_every)
        self.config = config
        pair = self.configs.pair(config.mode)
        if pair != self.pair:
            self.pair = pair
            self.shadow.set_pair(*pair, self.configs)
            self.shadow.pending.clear()
        self._announce_pair()
