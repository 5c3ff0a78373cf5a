"""Runs batches for the batcher: numpy rows in, numpy outputs out, metrics observed on the way.

Called only from the batcher's single worker thread, which owns the device (and its CUDA stream).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from .executors import Executor, Mode, StepTimer
from .graphs import GraphedExecutor, graph_buckets
from .loader import Model

log = logging.getLogger("fusedserve.runner")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda if present, else cpu; 'cuda' without a GPU is an error, not a silent fallback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("FUSEDSERVE_DEVICE=cuda but torch sees no CUDA device (torch.cuda.is_available() is False)")
    return torch.device(name)


def warmup_sizes(max_batch_size: int, device: torch.device) -> list[int]:
    """Batch sizes to run before ready. On CUDA every power-of-two bucket up to max_batch_size (the
    autotuner keys on the bucket) plus the max itself; under the CPU interpreter nothing compiles,
    so the smallest and largest batches only check the path."""
    if device.type != "cuda":
        return sorted({1, max_batch_size})
    return graph_buckets(max_batch_size)


def events_in_graphs() -> bool:
    """Whether this torch's CUDA events can be recorded inside a graph capture (`torch.cuda.Event(external=True)`,
    newer than the oldest torch fusedserve runs on): without it, kernel-timed batches launch step by step."""
    return "external" in inspect.signature(torch.cuda.Event.__new__).parameters


class ModelRunner:
    def __init__(
        self,
        model: Model,
        mode: Mode,
        device: torch.device,
        dtype: str,
        *,
        kernel_timing_every: int = 1,
        cuda_graphs: bool = True,
        max_batch_size: int = 256,
        observe_kernel: Callable[[str, float], None] | None = None,
        observe_forward: Callable[[float], None] | None = None,
    ):
        self.model = model
        self.device = device
        self.executor = Executor(model, mode, device, DTYPES[dtype])
        # On CUDA a forward replays one captured graph per batch bucket, the batch's copies in and out inside
        # it (graphs.py, host_io); batches whose kernels are timed replay the bucket's timed graph, whose steps
        # record CUDA events.
        timing = bool(kernel_timing_every and observe_kernel) and events_in_graphs()
        self.graphs = (
            GraphedExecutor(self.executor, max_batch_size, host_io=True, timed=timing)
            if (cuda_graphs and device.type == "cuda")
            else None
        )
        self._stream = torch.cuda.current_stream(device) if self.graphs is not None else None
        self.kernel_timing_every = kernel_timing_every
        self._observe_kernel = observe_kernel
        self._observe_forward = observe_forward
        self._timer = StepTimer(device)
        self._batches = 0

    def run(self, batch: np.ndarray) -> np.ndarray:
        """batch: (rows, *input_shape) float32 -> (rows, output_features) float32."""
        started = time.perf_counter()
        self._batches += 1
        every = self.kernel_timing_every
        timer = self._timer if (every and self._observe_kernel and self._batches % every == 0) else None
        # Cast on the host (a 1024 x 64 batch is 256 KB: ~5 us in one torch thread) so the device runs no cast
        # kernel: a graphed forward is one replay that copies in, runs the model's kernels and copies out.
        batch = np.ascontiguousarray(batch, dtype=np.float32)
        if not batch.flags.writeable:  # rows straight from a message buffer; torch wants writable memory
            batch = batch.copy()
        rows = batch.shape[0]
        # A batch larger than the biggest graph bucket (a direct caller; the engine never forms one) runs
        # launch by launch rather than failing.
        if self.graphs is not None and rows <= self.graphs.max_batch_size and (timer is None or self.graphs.timed):
            out, timer = self._run_graphed(batch, timed=timer is not None)
        else:
            out = self._run_launched(batch, timer)
        if timer:
            for name, seconds in timer.results():
                self._observe_kernel(name, seconds)
        if self._observe_forward:
            self._observe_forward(time.perf_counter() - started)
        return out

    def _run_graphed(self, batch: np.ndarray, timed: bool) -> tuple[np.ndarray, StepTimer | None]:
        """One host cast into the pinned input, one replay (copy in, kernels, copy out), one synchronisation;
        `timed`: the bucket's timed graph, and its timer. The replay touches no tensor from Python, so no
        inference mode is needed here."""
        rows = batch.shape[0]
        self.graphs.host_in[:rows].copy_(torch.from_numpy(batch))  # the cast to the serving dtype, on the host
        timer = None
        if timed:
            host_out, timer = self.graphs.replay_host_timed(rows)
        else:
            host_out = self.graphs.replay_host(rows)
        self._stream.synchronize()
        # A float32 copy (bfloat16 has no numpy type): the pinned buffer is the next batch's.
        return host_out.to(torch.float32, copy=True).numpy(), timer

    @torch.inference_mode()  # no autograd bookkeeping in either mode: the baseline is served as fast as it can be
    def _run_launched(self, batch: np.ndarray, timer: StepTimer | None) -> np.ndarray:
        x = torch.from_numpy(batch).to(self.executor.dtype)
        y = self.executor.forward(x.to(self.device), timer)
        # .cpu() synchronises with the stream: the batch's one sync, after which the events are ready.
        return y.cpu().float().numpy()

    @torch.inference_mode()
    def warmup(self, max_batch_size: int) -> list[int]:
        """Compile, tune and (on CUDA) capture every batch bucket so no request pays for it; returns the sizes run."""
        sizes = warmup_sizes(max_batch_size, self.device)
        gen = np.random.default_rng(0)
        for n in sizes:
            t = time.perf_counter()
            x = gen.standard_normal((n, *self.model.input_shape), dtype=np.float32)
            y = self.executor.forward(torch.from_numpy(x).to(self.device).to(self.executor.dtype))
            if self.graphs is not None:
                self.graphs.capture(self.graphs.bucket_for(n))
            if not torch.isfinite(y).all():
                raise RuntimeError(f"warm-up forward at batch {n} produced NaN/Inf")
            log.info("warm-up: batch %d in %.1f ms", n, (time.perf_counter() - t) * 1e3)
        return sizes
