"""Device time of one call with nothing it reads in L2: how the tuner and `fusedserve bench kernels` time cold.

The loop is `triton.testing.do_bench`'s (estimate from 5 calls, warm up, then per rep: clear L2, event,
call, event; the median), with one change: L2 is cleared by *reading* a 256 MB buffer, not by zeroing it.
Zeroing leaves L2 full of dirty lines, so a timed call that reads from memory first writes them back, a
cost no serving loop has (between two forwards L2 holds the last one's weights and a few KB of
activations): a cold read of 48 MB takes 24.6 us after zeroing against 19.2 after reading
(docs/performance.md, "Cold, but clean").
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

FLUSH_BYTES = 256 << 20  # over 4x a Hopper GPU's L2 (50-60 MB): no line of the timed call's inputs survives it


class L2Flush:
    """Reads a FLUSH_BYTES buffer (one sum, 8 bytes written): L2 ends up holding it, clean. The buffer is
    left uninitialized: filling it would be a write, and its values do not matter."""

    def __init__(self, device: torch.device, nbytes: int = FLUSH_BYTES):
        self.buffer = torch.empty(nbytes // 4, dtype=torch.int32, device=device)
        self.sink = torch.empty((), dtype=torch.int64, device=device)

    def __call__(self) -> None:
        torch.sum(self.buffer, dim=0, dtype=torch.int64, out=self.sink)  # torch 2.11: out= needs dim


def cold_us(
    fn: Callable[[], object], warmup_ms: float = 10, rep_ms: float = 50, flush: Callable[[], object] | None = None
) -> float:
    """Median device time of one call of fn (us), L2 cleared by reads before each (CUDA only).
    `flush`: another way to clear L2 (bench/probes/l2_flush.py compares zeroing). The 256 MB buffer lives for
    this call only, as do_bench's does: a service that tunes at start does not keep it allocated."""
    flush = flush or L2Flush(torch.device("cuda", torch.cuda.current_device()))
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = start.elapsed_time(end) / 5  # flush included, as do_bench's estimate
    n_warmup = max(1, int(warmup_ms / estimate_ms))
    n_rep = max(1, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for _ in range(n_warmup):
        fn()
    for i in range(n_rep):
        flush()  # the read (~63 us at 4.25 TB/s) keeps the device busy, so the host's launch gaps stay hidden
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) * 1e3
