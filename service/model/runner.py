"""Runs batches for the engine: numpy rows in, numpy outputs out, metrics observed on the way.

Called only from the engine's one thread, which owns the device (and its CUDA stream).
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kernels import tuning_background

from .executors import Executor, Mode, StepTimer
from .graphs import GraphedExecutor, graph_buckets
from .loader import Model

log = logging.getLogger(__name__)

# float8 computes its fp16 steps in float16 and takes rows and gives outputs in it (service/model/float8.py)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float8": torch.float16}
NUMPY_DTYPES = {
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.uint8: np.dtype(np.uint8),
}
WIRE_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}
# A batch of images is tens of MB (256 ResNet images: 38 MB in uint8, 77 MB in fp16), and one thread's copy of it
# into the pinned input takes milliseconds in which the GPU waits (ResNet-50 on an H100 served uint8 images with
# the GPU 61% busy). numpy releases the GIL while it copies, so past PARALLEL_COPY_BYTES the rows are copied in
# COPY_PIECE_BYTES pieces by COPY_THREADS threads at once.
PARALLEL_COPY_BYTES = 4 << 20
COPY_PIECE_BYTES = 1 << 20
COPY_THREADS = 4


@dataclass(slots=True)
class InFlight:
    """A launched batch (ModelRunner.launch), for ModelRunner.collect."""

    started: float
    launch_s: float  # host seconds launch took
    rows: int
    timer: StepTimer | None
    host_out: torch.Tensor | None  # graphed: the pinned outputs, valid once the stream is synchronised
    done: np.ndarray | None  # launched step by step: the outputs, already there
    observe: bool = True  # False: a shadow forward (service/engine/ab.py), kept out of the forward and kernel metrics


# Under Triton's interpreter (fused, no GPU) nothing compiles and nothing is cached per launch config: a batch of 1
# runs every kernel of the plan once (the interpreter rewrites each kernel's source on its first call), and a larger
# batch would only cost time, the interpreter's programs running one by one in Python (64 rows were 8.8 s of a 15 s
# digits-cnn start and 20.7 of 27 for digits-resnet on a 2-core machine; a ResNet-18 at 224x224 would take most of an
# hour). So the fused CPU warm-up runs batch 1 alone.
# Unfused on the CPU (torch's ops) the largest batch is left out where batch 1's time scaled to its rows passes this:
# a ResNet-18's 1,024 images at 224x224 were minutes of a start and gigabytes of activations; the digits models'
# take well under a second and still run.
CPU_WARM_S = 10.0


def warmup_sizes(max_batch_size: int, device: torch.device, mode: str = "unfused") -> list[int]:
    """Batch sizes to run before ready. On CUDA every power-of-two bucket up to max_batch_size (the
    autotuner keys on the bucket) plus the max itself; on the CPU nothing compiles, so the smallest and
    largest batches only check the path, and in the fused mode (Triton's interpreter) batch 1 alone."""
    if device.type != "cuda":
        return [1] if mode == "fused" else sorted({1, max_batch_size})
    return graph_buckets(max_batch_size)


def events_in_graphs() -> bool:
    """Whether this torch's CUDA events can be recorded inside a graph capture (`torch.cuda.Event(external=True)`,
    newer than the oldest torch fusedserve runs on): without it, kernel-timed batches launch step by step."""
    return "external" in inspect.signature(torch.cuda.Event.__new__).parameters


def _host(part):
    """A batch part as a numpy array on the host (rows decoded on the device come back: a path only a runner without
    direct input takes, which an engine that decodes on its GPU never is)."""
    return part.cpu().numpy() if isinstance(part, torch.Tensor) else part


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
        direct_input: bool = False,
        fp16_steps: tuple[str, ...] | None = None,
    ):
        self.model = model
        self.device = device
        precision = "float8" if dtype == "float8" else None
        self.executor = Executor(model, mode, device, DTYPES[dtype], precision=precision, fp16_steps=fp16_steps)
        # On CUDA a forward replays one captured graph per batch bucket, the batch's copies in and out inside
        # it (graphs.py, host_io); batches whose kernels are timed replay the bucket's timed graph, whose steps
        # record CUDA events. `direct_input`: the graphs leave their input to `_stage_direct`, which copies each batch
        # from the front ends' registered arenas (service/engine/pinned.py) and from rows decoded on the GPU
        # (service/images/gpu_decode.py) straight into it.
        timing = bool(kernel_timing_every and observe_kernel) and events_in_graphs()
        self.graphs = (
            GraphedExecutor(self.executor, max_batch_size, host_io=True, timed=timing, copy_in=not direct_input)
            if (cuda_graphs and device.type == "cuda")
            else None
        )
        self.direct_input = self.graphs is not None and direct_input
        self.pinned = None  # the engine's PinnedArenas (service/engine/pinned.py), where direct_input
        self.direct_copies = 0  # copies from registered memory queued (tests read it)
        self._stream = torch.cuda.current_stream(device) if self.graphs is not None else None
        self.kernel_timing_every = kernel_timing_every
        self._observe_kernel = observe_kernel
        self._observe_forward = observe_forward
        self._timer = StepTimer(device)
        self._batches = 0
        self.warm_seconds: dict[int, float] = {}  # batch size -> its warm-up forward's seconds
        self.warm_left_out: list[int] = []  # sizes the unfused CPU warm-up left out (CPU_WARM_S)
        # numpy views of the graphs' pinned staging, where numpy has their dtype (not bfloat16).
        graphs = self.graphs
        self._host_in_np = graphs.host_in.numpy() if graphs and self.executor.input_dtype in NUMPY_DTYPES else None
        self._host_out_np = graphs.host_out.numpy() if graphs and self.executor.dtype in NUMPY_DTYPES else None
        self._staging: np.ndarray | None = None  # float32 rows on their way to a float16/bfloat16 input
        self._copier: ThreadPoolExecutor | None = None  # threads of _copy_in_pieces, made for the first large batch

    @property
    def wire_dtype(self) -> np.dtype:
        """The dtype `launch` takes rows in without a cast and `collect` gives outputs in: the serving dtype where
        numpy has one (float16), else float32 (float32, and bfloat16, which numpy lacks). A uint8 model takes its rows
        as uint8 instead (`Executor.input_dtype`: front ends send them so, service/link/wire.py)."""
        return NUMPY_DTYPES.get(self.executor.dtype, NUMPY_DTYPES[torch.float32])

    def run(self, batch: np.ndarray) -> np.ndarray:
        """batch: (rows, *input_shape), any float dtype -> (rows, output_features) float32."""
        return self.collect(self.launch([np.asarray(batch)])).astype(np.float32, copy=False)

    def launch(self, parts: list[np.ndarray], observe: bool = True) -> InFlight:
        """Start the forward of one batch made of `parts` ((n, *input_shape) arrays, in the wire dtype or float32,
        read-only views of a message's bytes are fine); `collect` waits for it and gives its outputs. On CUDA with
        graphs the rows are copied once, straight into the bucket's pinned input, and the replay is queued: the
        caller has the host while the GPU works. Elsewhere the forward is done when this returns.

        `observe=False` (a shadow forward, run while the engine is idle): no forward or kernel metric, and the
        kernel-timing count is left alone, so that the metrics of a mode hold only the batches that answered."""
        started = time.perf_counter()
        timer = None
        if observe:
            self._batches += 1
            every = self.kernel_timing_every
            if every and self._observe_kernel and self._batches % every == 0:
                timer = self._timer
        rows = sum(p.shape[0] for p in parts)
        # A batch larger than the biggest graph bucket (a direct caller; the engine never forms one) runs
        # launch by launch rather than failing.
        graphs = self.graphs
        if graphs is not None and rows <= graphs.max_batch_size and (timer is None or graphs.timed):
            if self.direct_input:
                self._stage_direct(parts, rows)
            else:
                self._stage([_host(p) for p in parts], rows)
            if timer is not None:
                host_out, timer = graphs.replay_host_timed(rows)
            else:
                host_out = graphs.replay_host(rows)
            done = None
        elif any(isinstance(p, torch.Tensor) for p in parts):  # rows decoded on the device, beyond the graphs
            host_out, done = None, self._run_launched(None, timer, parts)
        else:
            batch = parts[0] if len(parts) == 1 else np.concatenate(parts)
            host_out, done = None, self._run_launched(batch, timer)
        return InFlight(started, time.perf_counter() - started, rows, timer, host_out, done, observe)

    def collect(self, f: InFlight) -> np.ndarray:
        """The outputs of a launched batch, (rows, output_features) in the wire dtype, in memory of their own."""
        t = time.perf_counter()
        if f.host_out is None:
            out = f.done
        else:
            self._stream.synchronize()
            # A copy: the pinned buffer is the next batch's.
            out = self._host_out_np[: f.rows].copy() if self._host_out_np is not None else (
                f.host_out.to(torch.float32).numpy())  # fmt: skip
        if f.timer:
            for name, seconds in f.timer.results():
                self._observe_kernel(name, seconds)
        if self._observe_forward and f.observe:
            # The host's time on this forward: launching it and waiting for it, not what the caller did between.
            self._observe_forward(f.launch_s + time.perf_counter() - t)
        return out

    def _stage(self, parts: list[np.ndarray], rows: int) -> None:
        """Copy the batch's rows into the graphs' pinned input. Rows in its dtype: one numpy copy. Others (float32
        rows for a float16 or bfloat16 model): one numpy copy into a float32 staging buffer, then torch's cast
        into the pinned input, vectorised where numpy's float16 cast is not (256x64 rows: 1.4 us against 27 on
        the 2-core CI machine)."""
        host = self._host_in_np
        if host is not None and all(p.dtype == host.dtype for p in parts):
            if rows * host[0].nbytes >= PARALLEL_COPY_BYTES:
                self._copy_in_pieces(parts, host)
            elif len(parts) == 1:
                np.copyto(host[:rows], parts[0])
            else:
                np.concatenate(parts, out=host[:rows])
            return
        if self._staging is None:
            self._staging = np.empty(self.graphs.host_in.shape, dtype=np.float32)
        staging = self._staging[:rows]
        if len(parts) == 1:
            np.copyto(staging, parts[0], casting="same_kind")
        else:
            np.concatenate(parts, out=staging, casting="same_kind")
        self.graphs.host_in[:rows].copy_(torch.from_numpy(staging))

    @torch.inference_mode()  # the graphs' inputs are inference tensors
    def _stage_direct(self, parts: list, rows: int) -> None:
        """Fill the bucket's graph input with the batch, every copy queued on the stream (none waited for): rows on the
        device (decoded there) by a device copy; rows in a registered arena by one asynchronous H2D copy per run of
        requests adjacent in that arena (a front end's ring puts consecutive requests next to each other: a batch
        from 8 front ends is ~8 copies); any other rows (inside their message, or no registration) copied into the
        pinned `host_in` first, as `_stage` does, then one H2D copy per run of them."""
        graphs = self.graphs
        dst = graphs.input_of(rows)
        dtype = self._host_in_np.dtype if self._host_in_np is not None else None
        pinned = self.pinned
        runs: list[list] = []  # [kind, at, rows, payload]: "dev" tensor, "reg" [ptr, nbytes], "host" [parts]
        at = 0
        for p in parts:
            n = p.shape[0]
            last = runs[-1] if runs else None
            if isinstance(p, torch.Tensor):
                runs.append(["dev", at, n, p])
            elif (pinned is not None and p.dtype == dtype and p.flags.c_contiguous
                  and pinned.contains(p.ctypes.data, p.nbytes)):  # fmt: skip
                ptr = p.ctypes.data
                if last is not None and last[0] == "reg" and last[3][0] + last[3][1] == ptr:
                    last[2] += n
                    last[3][1] += p.nbytes
                else:
                    runs.append(["reg", at, n, [ptr, p.nbytes]])
            elif last is not None and last[0] == "host":
                last[2] += n
                last[3].append(p)
            else:
                runs.append(["host", at, n, [p]])
            at += n
        shape = tuple(dst.shape[1:])
        for kind, a, n, payload in runs:
            if kind == "dev":
                dst[a : a + n].copy_(payload, non_blocking=True)
            elif kind == "reg":
                ptr, nbytes = payload
                src = np.frombuffer((ctypes.c_ubyte * nbytes).from_address(ptr), dtype=dtype).reshape(n, *shape)
                dst[a : a + n].copy_(torch.from_numpy(src), non_blocking=True)
                self.direct_copies += 1
            else:
                self._stage_host(payload, a, n)
                dst[a : a + n].copy_(graphs.host_in[a : a + n], non_blocking=True)

    def _stage_host(self, parts: list[np.ndarray], at: int, n: int) -> None:
        """Rows `at`..`at + n` of the batch into the pinned host_in, cast to its dtype where they are not in it."""
        host = self._host_in_np
        if host is not None and all(p.dtype == host.dtype for p in parts):
            if n * host[0].nbytes >= PARALLEL_COPY_BYTES:
                self._copy_in_pieces(parts, host[at : at + n])
            elif len(parts) == 1:
                np.copyto(host[at : at + n], parts[0])
            else:
                np.concatenate(parts, out=host[at : at + n])
            return
        rows = parts[0] if len(parts) == 1 else np.concatenate([p.astype(np.float32, copy=False) for p in parts])
        self.graphs.host_in[at : at + n].copy_(torch.from_numpy(np.ascontiguousarray(rows)))

    def _copy_in_pieces(self, parts: list[np.ndarray], host: np.ndarray) -> None:
        """Copy the parts one after the other into host, in pieces of about COPY_PIECE_BYTES (whole rows), by
        COPY_THREADS threads."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="stage")
        per_piece = max(1, COPY_PIECE_BYTES // host[0].nbytes)  # rows
        pieces, at = [], 0
        for p in parts:
            for a in range(0, len(p), per_piece):
                piece = p[a : a + per_piece]
                pieces.append((host[at + a : at + a + len(piece)], piece))
            at += len(p)
        for f in [self._copier.submit(np.copyto, dst, src) for dst, src in pieces]:
            f.result()

    @torch.inference_mode()  # no autograd bookkeeping in either mode: the baseline is served as fast as it can be
    def _run_launched(self, batch: np.ndarray | None, timer: StepTimer | None, parts: list | None = None) -> np.ndarray:
        if parts is not None:  # some rows already on the device (decoded there): joined there
            x = torch.cat([p.to(self.device) if isinstance(p, torch.Tensor) else torch.from_numpy(np.array(p))
                           .to(self.device) for p in parts]).to(self.executor.input_dtype)  # fmt: skip
        else:
            if not batch.flags.writeable:
                batch = batch.copy()  # torch wants writable memory; a message's bytes are not
            x = torch.from_numpy(batch).to(self.executor.input_dtype)
        y = self.executor.forward(x.to(self.device), timer)
        # .cpu() synchronises with the stream: the batch's one sync, after which the events are ready.
        return y.cpu().to(WIRE_TORCH[self.wire_dtype]).numpy()

    def warmup_step_buckets(self, max_batch_size: int) -> int:
        """The warm-up's work in step-buckets (steps times batch sizes), for its progress."""
        return len(warmup_sizes(max_batch_size, self.device, self.executor.mode)) * len(self.executor.layers)

    @torch.inference_mode()
    def warmup(self, max_batch_size: int, progress=None) -> list[int]:
        """Compile, tune and (on CUDA) capture every batch bucket so no request pays for it; returns the sizes run.
        A step whose kernel cannot compile within the deadline runs unfused from then on (Executor.warm_forward).
        progress: a service.engine.startup.StartupProgress told of each bucket and step, or None."""
        sizes = warmup_sizes(max_batch_size, self.device, self.executor.mode)
        gen = torch.Generator(device=self.device).manual_seed(0)
        ex = self.executor
        for k, n in enumerate(sizes):
            t = time.perf_counter()
            if progress is not None:
                progress.bucket(ex.mode, n, k, len(sizes), len(ex.layers))
            with tuning_background.queue().for_bucket(n):  # keys left for later belong to this bucket's graph
                y = ex.warm_forward(ex.example_input(n, gen), progress.step if progress is not None else None)
            if progress is not None:
                progress.capturing()
            if self.graphs is not None:
                self.graphs.capture(self.graphs.bucket_for(n))
            if not torch.isfinite(y).all():
                raise RuntimeError(f"warm-up forward at batch {n} produced NaN/Inf")
            self.warm_seconds[n] = took = time.perf_counter() - t
            log.info("warm-up: batch %d in %.1f ms", n, took * 1e3)
            if self.device.type != "cuda" and k + 1 < len(sizes) and took * sizes[k + 1] / n > CPU_WARM_S:
                self.warm_left_out = sizes[k + 1 :]
                return sizes[: k + 1]
        return sizes
