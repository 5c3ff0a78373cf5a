"""One CUDA graph per batch bucket: a forward is one replay instead of one Python launch per kernel.

A Triton launch from Python costs 40-65 us, while the digits MLP's GPU work is a few us, so a forward
launched step by step is launch-bound; a graph replays every kernel of the forward for ~2-3 us of host time
(docs/performance.md).

Batches are padded up to the bucket (powers of two up to max_batch_size, and max_batch_size itself):
rows of an MLP are independent, and so are the images of a CNN (conv and pool never mix them), so pad
rows (left over from earlier batches, always finite) change no real row. Capture happens at warm-up for
every bucket; the first forward of a bucket not yet captured captures it then. Kernel tuning runs before
capture, outside the graph, on a side stream as torch.cuda.graph requires.

With `host_io`, each bucket's graph also holds the batch's copies: pinned host input -> graph input, the
kernels, graph output -> pinned host output. A batch is then one host cast into `host_in`, one replay and
one synchronisation, where copies issued from Python are two more torch calls and two more submissions
to the GPU, each waited on in turn. Those copies move whole buckets (at most twice the batch's rows).
With `copy_in=False` the graph holds only the kernels and the copy out: the caller fills the bucket's input
(`input_of`) itself, with copies straight from the front ends' registered arenas or rows decoded on the GPU
(service/model/runner.py), where staging a batch of images in `host_in` first cost milliseconds of host memcpy.

With `timed` (host_io only), each bucket also gets a second graph whose steps are bracketed by CUDA event-record
nodes (StepTimer with external events): a batch whose kernels are timed replays it instead, for about the host
cost of any other batch, where launching its steps from Python cost 112-775 us (docs/performance.md).
"""

from __future__ import annotations

import torch

from kernels import tuning_background
from kernels.graph_capture import capture

from .executors import Executor, StepTimer


def graph_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below max_batch_size, then max_batch_size itself."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch_size]


class GraphedExecutor:
    """Runs an Executor's forward through captured CUDA graphs, one per batch bucket."""

    def __init__(
        self, executor: Executor, max_batch_size: int, *, host_io: bool = False, timed: bool = False,
        copy_in: bool = True,
    ):  # fmt: skip
        if executor.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA executor; this one runs on {executor.device}")
        self.executor = executor
        self.max_batch_size = max_batch_size
        self.buckets = graph_buckets(max_batch_size)
        if timed and not host_io:
            raise ValueError("timed graphs copy their batch in and out themselves: they need host_io")
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._timed: dict[int, tuple[torch.cuda.CUDAGraph, StepTimer]] | None = {} if timed else None
        self._pool = torch.cuda.graph_pool_handle()  # one memory pool: buckets never run at once
        self.copy_in = copy_in  # host_io: whether the graph copies host_in into its input (else the caller fills it)
        # host_io: pinned staging that every bucket's graph copies from and to (buckets never run at once). The
        # input starts as zeros: pad rows are whatever earlier batches left, always finite.
        self.host_in: torch.Tensor | None = None
        self.host_out: torch.Tensor | None = None
        if host_io:
            model, dt = executor.model, executor.dtype
            # in the executor's input dtype: a uint8 model's pixels cross to the GPU as uint8 (a quarter of fp32's)
            self.host_in = torch.zeros((max_batch_size, *model.input_shape), dtype=executor.input_dtype,
                                       pin_memory=True)  # fmt: skip
            self.host_out = torch.empty((max_batch_size, model.output_features), dtype=dt, pin_memory=True)

    @property
    def timed(self) -> bool:
        """Whether each bucket also has a timed graph (replay_host_timed)."""
        return self._timed is not None

    def bucket_for(self, rows: int) -> int:
        for b in self.buckets:
            if rows <= b:
                return b
        raise ValueError(f"{rows} rows exceed max_batch_size {self.max_batch_size}")

    @torch.inference_mode()
    def capture(self, rows: int) -> None:
        """Tune and capture the bucket `rows` (a bucket size) unless it is already captured."""
        if rows in self._graphs:
            return
        ex = self.executor
        gen = torch.Generator(device=ex.device).manual_seed(rows)
        static_in = ex.example_input(rows, gen)
        if self.host_in is None:

            def step():
                return ex.forward(static_in)

        else:
            host_in, host_out = self.host_in[:rows], self.host_out[:rows]

            copy_in = self.copy_in

            def step(timer: StepTimer | None = None):
                if copy_in:
                    static_in.copy_(host_in, non_blocking=True)
                out = ex.forward(static_in, timer)
                host_out.copy_(out, non_blocking=True)
                return out

        # 2 warm-ups: they compile, tune (or read the tuning cache) and allocate workspaces. A key tuning leaves for
        # later (kernels/tuning_background.py) is this bucket's: a new pick for it means capturing this bucket again.
        with tuning_background.queue().for_bucket(rows):
            graph, static_out = capture(step, warmups=2, device=ex.device, pool=self._pool)
            self._graphs[rows] = (graph, static_in, static_out)
            if self._timed is not None:
                # The same steps on the same static input, each between two event-record nodes of its own timer.
                timer = StepTimer(ex.device, external=True)
                timed_graph, _ = capture(lambda: step(timer), warmups=1, device=ex.device, pool=self._pool)
                self._timed[rows] = (timed_graph, timer)

    def input_of(self, rows: int) -> torch.Tensor:
        """The graph input of the bucket of `rows` (captured first if need be), for a caller that fills it itself
        (copy_in=False): the first `rows` rows are the batch, the rest pad."""
        bucket = self.bucket_for(rows)
        if bucket not in self._graphs:
            self.capture(bucket)
        return self._graphs[bucket][1]

    def recapture(self, rows: int) -> bool:
        """Capture the bucket `rows` again, if it was captured: its kernels' launchers now pick other configs (a pick
        timed in the background). Between batches only: the old graph is dropped here. Whether it was captured."""
        if self._graphs.pop(rows, None) is None:
            return False
        if self._timed is not None:
            self._timed.pop(rows, None)
        self.capture(rows)
        return True

    def capture_all(self) -> None:
        for b in self.buckets:
            self.capture(b)

    @torch.inference_mode()  # the static buffers are inference tensors (made in capture): copy_ needs the mode
    def forward(self, x: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """x: (rows, *input_shape), on the host or the device. Returns a view of the bucket's static output:
        valid until the next forward, so copy or consume it first. `non_blocking` with a pinned `x`: the copy
        in is queued on the stream, not waited for."""
        return self.replay(self.stage(x, non_blocking))

    @torch.inference_mode()
    def stage(self, x: torch.Tensor, non_blocking: bool = False) -> int:
        """Copy x into its bucket's graph input and return its row count. One copy: from the host it is the
        batch's H2D transfer itself (x already in the executor's input dtype, cast on the host), on the device a
        copy kernel that also casts. The graph then holds only the model's kernels: for the digits MLP a
        single launch, where a copy kernel inside or before it would double the forward's device time."""
        if self.host_in is not None:
            raise RuntimeError("a host_io graph copies its input from host_in: fill that and call replay_host")
        rows = x.shape[0]
        bucket = self.bucket_for(rows)
        if bucket not in self._graphs:
            self.capture(bucket)
        self._graphs[bucket][1][:rows].copy_(x, non_blocking=non_blocking)
        return rows

    def replay(self, rows: int) -> torch.Tensor:
        """Replay the bucket of `rows` on what `stage` left in its input; a view of its first `rows` outputs."""
        graph, _, static_out = self._graphs[self.bucket_for(rows)]
        graph.replay()
        return static_out[:rows]

    def replay_host(self, rows: int) -> torch.Tensor:
        """host_io only: replay the bucket of `rows` on the first `rows` rows of `host_in`; returns the view of
        `host_out` that holds their outputs once the stream is synchronised (queued, not waited for)."""
        bucket = self.bucket_for(rows)
        if bucket not in self._graphs:
            self.capture(bucket)
        self._graphs[bucket][0].replay()
        return self.host_out[:rows]

    def replay_host_timed(self, rows: int) -> tuple[torch.Tensor, StepTimer]:
        """replay_host through the bucket's timed graph: also its StepTimer, whose results() are ready once the
        stream is synchronised (and valid until that bucket's next timed replay)."""
        if self._timed is None:
            raise RuntimeError("this GraphedExecutor was built without timed graphs")
        bucket = self.bucket_for(rows)
        if bucket not in self._timed:
            self.capture(bucket)
        graph, timer = self._timed[bucket]
        graph.replay()
        return self.host_out[:rows], timer
