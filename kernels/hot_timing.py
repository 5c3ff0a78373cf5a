"""Device time of one CUDA graph replay "hot": as a busy server runs it, back to back with the weights left
in L2 by the replay before. How the tuner (kernels/tuning.py) and `fusedserve bench kernels` time hot.

A window is N replays between two events, N chosen from a first estimate so that a window lasts >= 1 ms (10
to 1000 replays); the hot time is the median over 5 windows, in us per replay. A replay costs the host ~2-3
us (cudaGraphLaunch from Python), about what the digits MLP's forward costs the device, so a spin kernel
(torch.cuda._sleep) is queued before each window's start event, long enough (1.5x the host time of N
launches, measured) that all N replays are queued before the first one starts: the window then holds device
time only, as cold's 256 MB read (kernels/cold_timing.py) hides the launch gaps. If the device still started
a window before the host had queued all of it, and a replay took the device no longer than the host's launch
(within 25%), the result says so ("hot_host_bound": true): that window may have measured the host.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

HOT_WINDOW_US = 1000.0  # a window lasts at least this long: event resolution ~0.5 us is then < 0.1%
HOT_WINDOWS = 5  # median of these
HOT_MIN_REPLAYS = 10
# At most this many replays are queued at once: CUDA's launch queue holds ~1000 pending launches before
# the host blocks, and a blocked host is paced by the device (harmless, but the spin kernel would be wasted).
HOT_MAX_REPLAYS = 1000
HOT_SPIN_MARGIN = 1.5  # the spin kernel lasts this many times the host's measured launch time of a window
HOT_SPIN_EXTRA_US = 50.0  # plus this, for the start event and the host's first launch


def hot_replays(estimate_us: float) -> int:
    """Replays per hot window: enough for HOT_WINDOW_US at `estimate_us` per replay, within the bounds."""
    n = math.ceil(HOT_WINDOW_US / max(estimate_us, 1e-3))
    return int(min(HOT_MAX_REPLAYS, max(HOT_MIN_REPLAYS, n)))


def spin_cycles(host_us: float, cycles_per_us: float) -> int:
    """Cycles of the spin kernel queued before a window whose N launches take the host `host_us`."""
    return int((HOT_SPIN_MARGIN * host_us + HOT_SPIN_EXTRA_US) * cycles_per_us)


class HotTimer:
    """Times back-to-back replays on the device (module docstring). `cuda` is torch.cuda (Event,
    synchronize, _sleep) and `clock` the host clock: the tests pass fakes. The spin kernel's clock rate is
    measured once per timer (a 1M-cycle spin between two events: ~0.5 ms at 1.98 GHz)."""

    def __init__(self, cuda=torch.cuda, clock: Callable[[], float] = time.perf_counter):
        self.cuda, self.clock = cuda, clock
        self._cycles_per_us: float | None = None

    def cycles_per_us(self) -> float:
        if self._cycles_per_us is None:
            cycles = 1_000_000
            self.cuda._sleep(1000)  # the spin kernel's first launch loads its module: not in the measurement
            start, end = self._events()
            start.record()
            self.cuda._sleep(cycles)
            end.record()
            self.cuda.synchronize()
            self._cycles_per_us = cycles / max(start.elapsed_time(end) * 1e3, 1e-3)
        return self._cycles_per_us

    def _events(self):
        return self.cuda.Event(enable_timing=True), self.cuda.Event(enable_timing=True)

    def window(self, replay: Callable[[], object], n: int, spin: int) -> tuple[float, float, bool]:
        """One window: spin, start event, n replays, end event. (device us per replay, host us to launch
        the n replays, whether the host may have set the pace).

        The host set the pace when the device had started the window before the host had queued all of it
        (the spin was too short) and a replay took the device no longer than its launch took the host
        (within 25%): a device slower than the host keeps its queue full without help."""
        start, end = self._events()
        if spin > 0:
            self.cuda._sleep(spin)
        start.record()
        t = self.clock()
        for _ in range(n):
            replay()
        host_us = (self.clock() - t) * 1e6
        started_early = bool(start.query())
        end.record()
        self.cuda.synchronize()
        per_replay = start.elapsed_time(end) * 1e3 / n
        return per_replay, host_us, started_early and per_replay < 1.25 * host_us / n

    def __call__(self, replay: Callable[[], object]) -> dict:
        """{"hot_us": median us per replay, "hot_replays": N per window, "hot_host_bound": bool}."""
        for _ in range(3):  # warm: the graph's first replay uploads it, and L2 gets the weights
            replay()
        self.cuda.synchronize()
        rate = self.cycles_per_us()
        # First estimate: 10 replays behind a 2 ms spin (their host time is then measured without blocking).
        estimate_us, host_us, _ = self.window(replay, HOT_MIN_REPLAYS, int(2000 * rate))
        n = hot_replays(estimate_us)
        spin = spin_cycles(host_us / HOT_MIN_REPLAYS * n, rate)
        windows = [self.window(replay, n, spin) for _ in range(HOT_WINDOWS)]
        return {
            "hot_us": statistics.median(w[0] for w in windows),
            "hot_replays": n,
            "hot_host_bound": any(w[2] for w in windows),
        }

    def single(self, replay: Callable[[], object], reps: int = 21) -> float:
        """Median device time (us) of one replay alone: the device idle before it (a synchronize between
        reps) and the launch queued behind a spin, so neither the host's launch nor a neighbour counts; L2
        is not cleared (what the replay before left there stays). tests/test_hot_replays.py holds back-to-
        back replays against this."""
        for _ in range(3):
            replay()
        self.cuda.synchronize()
        rate = self.cycles_per_us()
        _, host_us, _ = self.window(replay, 1, int(2000 * rate))
        spin = spin_cycles(host_us, rate)
        return statistics.median(self.window(replay, 1, spin)[0] for _ in range(reps))


_hot_timer: HotTimer | None = None


def hot_us(replay: Callable[[], object]) -> dict:
    """HotTimer's result for one graph replay (CUDA only); one timer per process, so the spin kernel's clock
    rate is measured once."""
    global _hot_timer
    if _hot_timer is None:
        _hot_timer = HotTimer()
    return _hot_timer(replay)
