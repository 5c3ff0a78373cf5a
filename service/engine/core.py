"""The engine: one process per device. It owns the model, its CUDA graphs, the tuner and one batch queue, and
answers requests from every front end over a Unix domain socket (service/link/stream.py, service/link/wire.py).

The loop is single-threaded and synchronous, since a process of its own needs no event loop: read what the
front ends sent, take the next batch (service/engine/batching.py), run its forward, answer each front end with
one message, repeat. While a forward runs, the kernel's socket buffers keep what arrives, so the
requests that come meanwhile make up the next batch.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import mmap
import os
import selectors
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np

from ..config import Settings
from ..link import stream, wire
from ..link.live import read_live
from ..processes import child_setup, configure_logging, set_log_level
from . import faults
from .ab import Configs, LiveMode, Modes, Shadow, captures_ignore_other_threads, needed_modes
from .background_tuning import BackgroundTuning
from .batching import BatchQueue, Pending

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.1  # how often an idle engine looks at its stop flag
SHADOW_GRACE_S = 0.0002  # how long the queue must stay empty before a shadow forward runs (serve says why)
EXIT_DEVICE_BROKEN = 4  # the engine's exit code after a sticky device error (3: it failed to start)


class Engine:
    """The loop of one engine process: read requests from every front end, batch them, run the model, reply."""

    def __init__(
        self,
        runner,
        listener: socket.socket,
        settings: Settings,
        input_shape: tuple[int, ...],
        metrics,
        dtype: str = "float32",
        configs: Configs | None = None,
    ):
        # `runner`: the runner of settings.mode, or {label: runner} with every executor the settings need, A first
        # (engine/ab.py); `configs`: their labels (default: fused and unfused in `dtype`).
        runners = runner if isinstance(runner, dict) else {settings.mode: runner}
        # A's: the front ends send rows in its wire dtype and take answers in it; a B of another wire dtype (float32
        # against float16) takes those rows with a cast (ModelRunner._stage) and its answers are cast (_forward).
        self.runner = next(iter(runners.values()))
        shadow = Shadow(settings.shadow_every, metrics, dtype, settings.allow_tf32)
        config = LiveMode(settings.mode, settings.ab_unfused_percent, settings.shadow_every)
        self.modes = Modes(runners, config, metrics, shadow, make=None, configs=configs)
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self._conns: dict[int, _Conn] = {}
        self._next_owner = 0
        self.metrics = metrics
        self.input_shape = tuple(input_shape)
        self.features = math.prod(input_shape)
        self.queue = BatchQueue(
            max_batch_size=settings.max_batch_size,
            max_queue_requests=settings.max_queue_requests,
            max_delay_s=settings.max_delay_ms / 1e3,
        )
        self.stopping = False
        # After its last batch a CUDA engine polls without sleeping this long (settings.engine_spin_ms) before it
        # blocks: a request that comes meanwhile finds a running thread, not a sleeping core. Set for CUDA engines
        # (engine_main); a CPU engine shares its cores with the front ends.
        self.spin_s = 0.0
        self.device_type = "cpu"  # set by engine_main; decides how a failed forward is diagnosed (engine/faults.py)
        self.on_broken = None  # called once the device is found broken, before any request is answered 503
        self._replies: dict[int, tuple[list[bytes], list]] = {}
        # SIGHUP reloads (service/link/live.py): the supervisor's shared generation, the one applied here, and where
        # the live settings are. None: no reloads (tests).
        self.config_generation = None
        self.config_seen = 0
        self.run_dir: Path | None = None
        # FUSEDSERVE_TUNING_BACKGROUND: the tuning keys start-up left untimed, timed while no request waits.
        self.tuning: BackgroundTuning | None = None
        # FUSEDSERVE_IMAGE_DECODE: the JPEG decoder of image requests (service/images/gpu_decode.py's BatchDecoder),
        # None where the front ends decode every image; FUSEDSERVE_PINNED_ARENAS: the arenas registered with CUDA
        # (engine/pinned.py), None where they are not. Both set by engine_main.
        self.jpeg = None
        self.pinned = None
        # A batch of image requests taken from the queue and decoded while the batch before it ran on the GPU
        # (_take_ahead), with the time it was taken: the next batch to run.
        self._ahead: tuple[list[Pending], float] | None = None

    # ------------------------------------------------------------------ loop

    def serve(self) -> None:
        """Until `stopping` is set and every queued request is answered."""
        modes = self.modes
        shadow = modes.shadow
        while True:
            generation = self.config_generation
            if generation is not None and generation.value != self.config_seen:
                self._reload()
            if modes.loading:
                modes.poll()
            if self._ahead is not None:  # decoded while the last batch ran: it goes first, whatever the queue holds
                self._run_batch()
                continue
            if not len(self.queue):
                if self.stopping:
                    self._receive(0)
                    if not len(self.queue):
                        break
                elif shadow.pending:
                    # Answers are out (each batch flushes its own); a request that comes within SHADOW_GRACE_S goes
                    # first. At single rows and 256 connections the queue is empty for moments between requests
                    # ~12 us apart, and a shadow run in each such moment cost 6-7% of the throughput (H200); under
                    # that load the pending copies age out (MAX_PENDING) rather than delay requests. The grace is
                    # spent polling, as _idle's spin: a select with its timeout (epoll's, rounded up to 1 ms) put
                    # the engine to sleep each time the queue emptied, and waking it cost 5% (H200, 1 row, 256).
                    if self._quiet_for(SHADOW_GRACE_S):
                        shadow.run_one(modes.runners)
                    continue
                elif self.tuning is not None and self.tuning.pending:
                    # One slice (one candidate timed, or one graph captured again) only while nobody waits: a
                    # request that comes meanwhile waits for that slice at most.
                    self._receive(0)
                    if not len(self.queue):
                        self.metrics.write_answered()  # as _idle does: an idle engine's counts are exact
                        self.tuning.run_one()
                    continue
                else:
                    self._idle()
                    continue
            self._receive(0)
            hold = self.queue.hold_for(time.monotonic())
            if hold > 0 and not self.stopping:
                self._receive(hold)  # max_delay_ms: wait for company, then look again
                if self.queue.hold_for(time.monotonic()) > 0:
                    continue
            self._run_batch()
        self._flush()
        self._finish_writes()
        if self.pinned is not None:
            self.pinned.release_all()  # the front ends' arenas are unmapped after this: none may stay registered
        self.metrics.write_answered()

    def _finish_writes(self, timeout_s: float = 5.0) -> None:
        """At stop: push out answers the sockets did not take yet (a front end that reads nothing is left)."""
        end = time.monotonic() + timeout_s
        while any(c.pending for c in self._conns.values()) and time.monotonic() < end:
            self._receive(0.05)

    def _idle(self) -> None:
        """Wait for work: spin for `spin_s` (selector polls with no timeout), then block. The answered-request counts
        kept since the last write go out first, so that an idle engine's are exact."""
        if self.pinned is not None:
            self.pinned.release_retired()  # no batch in flight: no copy reads a gone front end's arena
        self.metrics.write_answered()
        if self.spin_s and not self._quiet_for(self.spin_s):
            return
        self._receive(IDLE_POLL_S)

    def _quiet_for(self, seconds: float) -> bool:
        """Poll the front ends without sleeping until a request is queued (False) or `seconds` pass with none (True)."""
        end = time.perf_counter() + seconds
        while True:
            self._receive(0)
            if len(self.queue):
                return False
            if time.perf_counter() >= end:
                return True

    def _receive(self, timeout_s: float) -> None:
        got = False
        for key, mask in self.selector.select(timeout_s):
            conn = key.data
            if conn is None:
                self._accept()
                continue
            if mask & selectors.EVENT_WRITE and not stream.send_some(conn.sock, conn.pending, b""):
                self._drop(conn)
                continue
            if mask & selectors.EVENT_READ:
                fds = [] if conn.fresh else None  # a front end's first bytes bring its arena (service/link/arena.py)
                messages, closed = stream.read_available(conn.sock, conn.reader, fds)
                if fds:
                    conn.map_arena(fds, self.pinned)
                if messages:
                    conn.fresh = False
                for message in messages:
                    self._handle(conn, message)
                got = got or bool(messages)
                if closed:
                    self._drop(conn)
            self._watch_writes(conn)
        if got:
            self.metrics.queue_depth(len(self.queue))
            self._flush()  # refusals go out at once, not after the next forward

    def _handle(self, conn: _Conn, message: bytes) -> None:
        records, view, at = wire.unpack(message, wire.REQUEST)
        features = self.features
        owner = conn.owner
        for kind, code, rid, n, offset, deadline, arrival in records:
            if kind == wire.CANCEL:
                if self.queue.cancel(owner, rid):  # dropped unrun: say so, the front end frees its rows then
                    self._reply(owner, rid, wire.CANCELLED, 0, b"")
                continue
            if at < 0:  # after a malformed images block: where this message's payloads are is unknown
                self._reply(owner, rid, wire.FAILED, 0, b"an earlier request of its message was malformed")
                continue
            if kind in (wire.SUBMIT_IMAGES, wire.SUBMIT_IMAGES_SHARED):
                at = self._handle_images(conn, kind, rid, n, offset, deadline, arrival, view, at)
                continue
            dtype = wire.DTYPES[code]
            size = n * features * dtype.itemsize
            # A view of the message or of the front end's arena: the rows are copied once, into the graph's pinned
            # input, when their batch runs.
            if kind == wire.SUBMIT_SHARED:
                if conn.arena is None or offset + size > len(conn.arena):  # a front end's bug: fail it, not us
                    log.warning("request %s: its rows are outside its front end's arena", wire.request_name(rid))
                    self._reply(owner, rid, wire.FAILED, 0, b"the request's rows are outside its front end's arena")
                    continue
                rows = np.frombuffer(conn.arena, dtype=dtype, count=n * features, offset=offset)
            else:
                rows = np.frombuffer(view[at : at + size], dtype=dtype)
                at += size
            rows = rows.reshape(n, *self.input_shape)
            # The arrival is the front end's: so the queue wait counts the link.
            req = Pending(owner, rid, rows, arrival, deadline)
            if not self.queue.push(req):
                self._reply_error(req, wire.OVERLOADED, f"queue full: {len(self.queue)} requests waiting")

    def _handle_images(self, conn: _Conn, kind: int, rid: int, n: int, offset: int, deadline: float, arrival: float,
                       view, at: int) -> int:  # fmt: skip
        """Queue an image request (its IMAGES block inside the message at `at`, or in the arena at `offset`); where
        the block ends in the message (-1: it does not parse)."""
        owner = conn.owner
        shared = kind == wire.SUBMIT_IMAGES_SHARED
        try:
            if shared:
                if conn.arena is None:
                    raise ValueError("no arena")
                images, _ = wire.unpack_images(conn.arena, offset, n, len(conn.arena))
            else:
                images, at = wire.unpack_images(view, at, n, len(view))
        except ValueError as e:  # a front end's bug: fail the request, not the engine
            log.warning("request %s: its images block is malformed (%s)", wire.request_name(rid), e)
            self._reply(owner, rid, wire.FAILED, 0, f"the request's images block is malformed: {e}".encode())
            return at if shared else -1  # inline: the rest of this message cannot be found
        if self.jpeg is None:  # this engine does not decode (a front end that had not heard its HELLO)
            self._reply(owner, rid, wire.DECODE_ON_CPU, 0, b"this engine does not decode images")
            return at
        if any(k == wire.PREPARED_ROW and len(data) != self.features for k, data, _, _ in images):
            self._reply(owner, rid, wire.FAILED, 0, b"a prepared image row is not one row of the model's input")
            return at
        req = Pending(owner, rid, np.empty((n, 0), np.uint8), arrival, deadline, images=images)
        if not self.queue.push(req):
            self._reply_error(req, wire.OVERLOADED, f"queue full: {len(self.queue)} requests waiting")
        return at

    def _decode_images(self, batch: list[Pending]) -> list[Pending]:
        """Decode the batch's image requests (every JPEG of the batch in one GPU call) into their rows; a request whose
        file the GPU does not take is answered DECODE_ON_CPU (its front end decodes it) and leaves the batch."""
        image_reqs = [r for r in batch if r.images is not None]
        try:
            rows = self.jpeg([r.images for r in image_reqs])
        except Exception as err:  # noqa: BLE001 - the decoder itself failed: every image request to the CPU path
            log.warning("GPU image decoding failed on a batch of %d image requests (%s: %s); their front ends decode "
                        "them", len(image_reqs), type(err).__name__, err)  # fmt: skip
            rows = [None] * len(image_reqs)
        failed = set()
        for req, got in zip(image_reqs, rows, strict=True):
            req.images = None  # the files' bytes are no longer needed (their slot goes with the answer)
            if got is None:
                failed.add(id(req))
                self._reply(req.owner, req.id, wire.DECODE_ON_CPU, 0, b"the GPU decoder did not take a file")
            else:
                req.rows = got
        return [r for r in batch if id(r) not in failed] if failed else batch

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            self._next_owner += 1
            conn = _Conn(self._next_owner, sock)
            self._conns[conn.owner] = conn
            self.selector.register(sock, selectors.EVENT_READ, conn)
            # The dtype this engine wants rows in and answers in (service/link/wire.py); a new socket takes 6 bytes.
            flags = wire.DECODES_JPEG if self.jpeg is not None else 0
            if not stream.send_some(sock, conn.pending, stream.frame(wire.hello(self.runner.wire_dtype, flags))):
                self._drop(conn)
            else:
                self._watch_writes(conn)

    def _drop(self, conn: _Conn) -> None:
        """A front end went away: its queued requests are dropped, its answers have nowhere to go."""
        if self._conns.pop(conn.owner, None) is None:
            return
        n = self.queue.drop_owner(conn.owner)
        if self._ahead is not None:  # its requests taken ahead go too (their rows may be views of its arena)
            ahead, taken = self._ahead
            kept = [r for r in ahead if r.owner != conn.owner]
            n += len(ahead) - len(kept)
            self._ahead = (kept, taken) if kept else None
        self._replies.pop(conn.owner, None)
        if conn.arena is not None and self.pinned is not None:
            self.pinned.retire(conn.arena)  # unregistered between batches: one in flight may still read it
        self.selector.unregister(conn.sock)
        conn.sock.close()
        # A front end that stops cleanly (SIGTERM, a restart) leaves nothing queued: not a warning, one per front end
        # at every stop. One that leaves requests behind is.
        level = logging.WARNING if n else logging.INFO
        log.log(level, "a front end disconnected; %d of its queued requests dropped", n)

    def _watch_writes(self, conn: _Conn) -> None:
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.pending else 0)
        if want != conn.events and conn.owner in self._conns:
            conn.events = want
            self.selector.modify(conn.sock, want, conn)

    def _take(self) -> tuple[list[Pending], float]:
        """The next batch out of the queue, its JPEGs decoded, and when it was taken; the requests whose deadline
        passed while queued are answered."""
        now = time.monotonic()
        batch, expired = self.queue.take(now)
        for req in expired:
            self._reply_error(req, wire.TIMEOUT, f"deadline passed {now - req.deadline:.3f} s before its batch ran")
        if batch and self.jpeg is not None:
            try:
                batch = self._decode_images(batch)
            except Exception as err:  # noqa: BLE001 - this engine's bug: these requests fail, the engine serves on
                log.exception("preparing a batch of %d requests' images failed; they are answered as failed: %s",
                              len(batch), _names(batch))  # fmt: skip
                why = f"the engine failed preparing the batch's images: {type(err).__name__}: {err}"
                for req in batch:
                    self._reply_error(req, wire.FAILED, why)
                batch = []
        return batch, now

    def _take_ahead(self) -> None:
        """While a batch's forward runs on the GPU: take the next batch now and decode its JPEGs, where the queue
        starts with an image request. nvJPEG's decode waits on the host for the GPU's hardware decoder (7.2 ms for
        256 photos of ~500x375 on an H200) and the forward runs on the SMs: one after the other, a batch of JPEG
        requests took their sum (bench/probes/jpeg_decode.py)."""
        head = self.queue.peek()
        if head is None or head.images is None:
            return  # tensors only: nothing to do ahead, and a batch taken later may be fuller
        batch, now = self._take()
        if batch:
            self._ahead = (batch, now)

    def _run_batch(self) -> None:
        if self._ahead is not None:
            (batch, now), self._ahead = self._ahead, None
        else:
            batch, now = self._take()
        if batch:
            rows = 0
            waits = []
            for req in batch:
                waits.append(now - req.enqueued_at)
                rows += req.rows.shape[0]
            mode = self.modes.pick(rows)
            if self.tuning is not None and self.tuning.pending:
                self.tuning.used(rows)
            self.metrics.queue_waits(waits, mode)
            self.metrics.batch(rows, mode)
            self.metrics.queue_depth(len(self.queue))
            self._forward(batch, rows, mode, now)
        if self.pinned is not None:
            self.pinned.release_retired()
        self._flush()

    def _forward(self, batch: list[Pending], rows: int, mode: str, taken: float) -> None:
        """Run `batch` (taken from the queue at `taken`, time.monotonic()) with `mode`'s runner and answer each of its
        requests."""
        runner = self.modes.runners[mode]
        parts = [r.rows for r in batch]
        shadow = self.modes.shadow
        keep = shadow.due()
        launching = time.monotonic()
        try:
            inflight = runner.launch(parts)
        except Exception as err:
            self._forward_failed(batch, rows, err, mode, taken)
            return
        launched = time.monotonic()
        # While the GPU runs the batch (a graphed forward returns once queued), take in what the front ends sent:
        # those requests are the next batch, and their bytes leave the sockets' buffers sooner; a next batch of
        # JPEGs is decoded now.
        self._receive(0)
        if self.jpeg is not None and self._ahead is None and not ran_in_launch(inflight):
            self._take_ahead()
        try:
            out = runner.collect(inflight)
        except Exception as err:
            self._forward_failed(batch, rows, err, mode, taken)
            return
        collected = time.monotonic()
        if keep:  # before the answers go: then the front ends may reuse the rows' memory
            shadow.keep(mode, parts, out)
        if out.dtype != self.runner.wire_dtype:  # B in another wire dtype (FUSEDSERVE_AB_OTHER) answering in ab mode
            out = out.astype(self.runner.wire_dtype)
        code = wire.MODES.index(mode)
        start = 0
        for req in batch:
            n = req.rows.shape[0]
            self._reply(req.owner, req.id, wire.OK, n, out[start : start + n], code)
            start += n
        replied = time.monotonic()
        self._flush()
        self._answered(batch, taken, launching if ran_in_launch(inflight) else launched, collected, replied)

    def _answered(self, batch: list[Pending], taken: float, started: float, collected: float, replied: float) -> None:
        """Count a batch answered with outputs in Triton's statistics (service/metrics.py: EngineMetrics.answered;
        service/v2/extensions.py shapes them). Each request's time in the engine is cut into four phases, back to
        back, each counted once per request (a batch's compute time once for each request in it, as Triton does):

        - queue: its front end's `arrival` (time.monotonic() once its body was read and its tensors decoded and
          checked, just before it went to the link) to `taken`, its batch leaving the queue: the link to the engine,
          the wait behind the forward under way, and any MAX_DELAY_MS hold; fusedserve_queue_wait_seconds's interval.
        - compute_input: `taken` to `started`, the forward started: the batch's bookkeeping, then, for a CUDA graph
          replay, its rows copied from the link's buffers into the pinned input of its bucket's graph and the replay
          queued. Where the forward is not a graph replay (CPU, or a batch beyond the graphs' buckets) the runner's
          launch runs it whole, rows in and outputs out: `started` is then when the launch began.
        - compute_infer: `started` to `collected`: the forward (a graph's copy in, kernels and copy out) until its
          outputs are in host memory of their own; the engine takes in new requests meanwhile, while the GPU works.
        - compute_output: `collected` to `replied`: the outputs split into one answer per request, packed for their
          front ends.

        So each phase ends before the request's answer is sent back, and the four lie inside the front end's timing
        of the request (success), whatever the scheduler does: the rest of success is the front end's own part
        (reading and decoding the request before `arrival`; encoding the answer after) and the link back."""
        n = len(batch)
        queue_s = n * taken - sum(r.enqueued_at for r in batch)
        phases = (queue_s, n * (started - taken), n * (collected - started), n * (replied - collected))
        self.metrics.answered(n, phases, replied)

    def _reload(self) -> None:
        """The supervisor published new live settings (SIGHUP): take them between two batches. Executors the new mode
        needs and this engine lacks load in the background (engine/ab.py); the mode changes once they are warm."""
        try:
            generation, live = read_live(self.run_dir)
        except (OSError, ValueError, KeyError) as e:  # the supervisor's bug, not a reason to stop serving
            self.config_seen = self.config_generation.value
            log.error("could not read the new configuration (%s: %s); keeping this one", type(e).__name__, e)
            return
        self.config_seen = generation
        q = self.queue
        q.max_delay_s = live["max_delay_ms"] / 1e3
        q.max_queue_requests = live["max_queue_requests"]
        if self.device_type == "cuda":
            self.spin_s = live["engine_spin_ms"] / 1e3
        set_log_level(live["log_level"])
        try:
            self.modes.configure(LiveMode(live["mode"], live["ab_unfused_percent"], live["shadow_every"]))
        except ValueError as e:  # a mode whose A would be FUSEDSERVE_AB_OTHER itself (engine/ab.py, Configs.pair)
            log.error("configuration %d not taken: %s; keeping mode %s", generation, e, self.modes.mode)
            return
        log.info("configuration %d taken: %s", generation, ", ".join(f"{k}={v}" for k, v in live.items()))

    def _forward_failed(self, batch: list[Pending], rows: int, err: Exception, mode: str, taken: float) -> None:
        """Out of memory: retry in halves, down to one request, which alone gets 503. A sticky device error:
        DeviceBroken (engine/faults.py). Anything else: the batch fails alone with 500; the engine keeps serving."""
        kind = faults.classify(err, self.device_type)
        if kind == faults.OOM:
            self.metrics.gpu_fault(kind, mode)
            faults.release_memory(self.device_type)
            if len(batch) == 1:
                log.warning("GPU out of memory on one request (%s) of %d rows: answered 503", _names(batch), rows)
                msg = f"GPU out of memory on this request's {rows} rows alone; retry later or send fewer rows"
                self._reply_error(batch[0], wire.OVERLOADED, msg)
                return
            log.warning("GPU out of memory on a batch of %d rows (%d requests); retrying in halves", rows, len(batch))
            half = len(batch) // 2
            for part in (batch[:half], batch[half:]):
                self._forward(part, sum(r.rows.shape[0] for r in part), mode, taken)
            return
        if kind == faults.STICKY:
            self.metrics.gpu_fault(kind, mode)
            self._device_broken(batch, err)
        log.error("forward failed on a batch of %d rows (%d requests: %s)", rows, len(batch), _names(batch),
                  exc_info=err)  # fmt: skip
        msg = f"forward failed on a batch of {rows} rows in {mode} mode: {type(err).__name__}: {err}"
        code = wire.MODES.index(mode)
        for req in batch:
            self._reply_error(req, wire.FAILED, msg, code)

    def _device_broken(self, batch: list[Pending], err: Exception) -> None:
        """The device is unusable (a sticky CUDA error): mark it broken, answer this batch and every queued request
        503 now, push the answers out, and raise DeviceBroken for engine_main to exit."""
        log.critical("the device is broken (%s: %s); answering what is held with 503 and exiting",
                     type(err).__name__, err, exc_info=err)  # fmt: skip
        if self.on_broken is not None:
            self.on_broken()  # before the answers: a client told 503 then finds /health/live false
        msg = f"the GPU failed ({type(err).__name__}: {err}); the service is restarting"
        ahead, self._ahead = (self._ahead[0] if self._ahead is not None else []), None
        for req in batch + ahead + self.queue.drain():
            self._reply_error(req, wire.SHUTTING_DOWN, msg)
        self.metrics.queue_depth(0)
        self._flush()
        self._finish_writes(1.0)
        raise faults.DeviceBroken(msg) from err

    # ------------------------------------------------------------------ replies

    def _reply(self, owner: int, rid: int, status: int, rows: int, payload, mode: int = wire.NO_MODE) -> None:
        entry = self._replies.get(owner)
        if entry is None:
            entry = self._replies[owner] = ([], [])
        size = payload.nbytes if status == wire.OK else len(payload)
        entry[0].append(wire.REPLY.pack(rid, status, mode, rows, size))
        entry[1].append(payload)

    def _reply_error(self, req: Pending, status: int, message: str, mode: int = wire.NO_MODE) -> None:
        self._reply(req.owner, req.id, status, 0, message.encode(), mode)

    def _flush(self) -> None:
        replies, self._replies = self._replies, {}
        for owner, (headers, payloads) in replies.items():
            conn = self._conns.get(owner)
            if conn is None:  # its front end is gone: only that front end's requests are lost
                continue
            # Never blocks: what the socket does not take now goes out when it is writable (select above).
            if not stream.send_some(conn.sock, conn.pending, stream.frame(wire.pack(headers, payloads))):
                self._drop(conn)
            else:
                self._watch_writes(conn)


def ran_in_launch(inflight) -> bool:
    """A forward that is not a graph replay (CPU, or beyond the graphs' buckets) ran whole inside launch()."""
    return getattr(inflight, "done", None) is not None


def _names(batch: list[Pending], most: int = 8) -> str:
    """The requests of a batch as warnings name them (wire.request_name; a front end's failure line gives the
    request id of each), the first `most` of them."""
    names = ", ".join(wire.request_name(r.id) for r in batch[:most])
    return names + (f" and {len(batch) - most} more" if len(batch) > most else "")


class _Conn:
    __slots__ = ("owner", "sock", "reader", "pending", "events", "fresh", "arena")

    def __init__(self, owner: int, sock: socket.socket):
        self.owner = owner
        self.sock = sock
        self.reader = stream.Reader()
        self.pending = bytearray()
        self.events = selectors.EVENT_READ
        self.fresh = True  # nothing read yet: the first read looks for the arena's file descriptor
        self.arena: mmap.mmap | None = None  # the front end's rows (service/link/arena.py), read-only here

    def map_arena(self, fds: list[int], pinned=None) -> None:
        """Map the front end's arena (the first descriptor; any other is closed). Requests whose rows are in it
        keep views of the mapping, so it lives as long as they do, past the connection if need be. With `pinned`
        (engine/pinned.py) it is registered with CUDA, for which it is mapped writable (CUDA pins writable pages);
        the engine still only reads it."""
        try:
            size = os.fstat(fds[0]).st_size
            if pinned is not None and pinned.enabled:
                self.arena = mmap.mmap(fds[0], size)
                pinned.register(self.arena)
            else:
                self.arena = mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
        finally:
            for fd in fds:
                os.close(fd)


def _warm_note(runner, sizes: list[int], max_batch_size: int) -> str:
    """Why a CPU warm-up ran no batch of max_batch_size (runner.warmup's rules), for its log line."""
    if runner.warm_left_out:
        took, left = runner.warm_seconds[sizes[-1]], runner.warm_left_out[-1]
        return (f" (torch on the CPU: batch {sizes[-1]} took {took:.2f} s, and its time grows with the rows, so "
                f"batch {left} was not run before ready)")  # fmt: skip
    if sizes[-1] >= max_batch_size:
        return ""
    return (" (Triton's interpreter on the CPU: nothing compiles, and batch 1 ran every kernel, so no larger batch is "
            "run before ready)")  # fmt: skip


def build_runner(settings: Settings, device, dtype: str, model, metrics, mode: str | None = None,
                 direct_input: bool = False, label: str | None = None):  # fmt: skip
    """The model runner of `mode` (default: settings.mode) in `dtype` for this engine, with the kernel switches set
    from the settings; its metrics carry `label` (default: `mode`; MODE:DTYPE where the A/B compares precisions,
    engine/ab.py). `direct_input`: its graphs leave their input to the runner's direct copies (registered arenas, rows
    decoded on the GPU: service/model/runner.py)."""
    import functools

    import torch

    from kernels import compile_deadline, pdl, precompile, tuning

    from ..model.float8 import fp16_steps_of
    from ..model.runner import ModelRunner

    # One setting for both modes: torch turns TF32 on for convolutions by default, and the fused conv follows
    # the same flag, so float32 stays IEEE float32 in both unless ALLOW_TF32 says otherwise.
    torch.backends.cuda.matmul.allow_tf32 = settings.allow_tf32
    torch.backends.cudnn.allow_tf32 = settings.allow_tf32
    tuning.use_cache(settings.tuning_cache or tuning.default_cache_path())
    tuning.set_enabled(settings.tuning)
    tuning.set_background(settings.tuning_background)
    tuning.timing_budget.set(None if math.isinf(settings.tuning_startup_s) else settings.tuning_startup_s)
    tuning.set_timing_policy(settings.tuning_timing)
    precompile.set_threads(settings.compile_threads)
    compile_deadline.set_deadline(settings.compile_deadline_s)
    pdl.set_enabled(settings.pdl)
    mode = mode or settings.mode
    label = label or mode

    def labelled(observe):
        return None if observe is None else functools.partial(observe, mode=label)

    return ModelRunner(
        model,
        mode,
        device,
        dtype,
        kernel_timing_every=settings.kernel_timing_every,
        cuda_graphs=settings.cuda_graphs,
        max_batch_size=settings.max_batch_size,
        observe_kernel=labelled(metrics.observe_kernel),
        observe_forward=labelled(metrics.observe_forward),
        direct_input=direct_input,
        fp16_steps=fp16_steps_of(settings.float8_fp16_steps),
    )


def image_setup(settings: Settings, device, dtype: str, model):
    """(the JPEG decoder of image requests or None, the PinnedArenas or None, whether the runners take their input
    directly) for this engine: FUSEDSERVE_IMAGE_DECODE and FUSEDSERVE_PINNED_ARENAS resolved on its device."""
    from ..images import gpu_decode
    from . import pinned

    jpeg = None
    if model.spec.input.image is not None and gpu_decode.resolve(settings.image_decode, device.type):
        from ..images.preprocess import Preprocess

        jpeg = gpu_decode.BatchDecoder(Preprocess.of(model.spec), device)
    value_bytes = 1 if model.spec.input.dtype == "uint8" else (4 if dtype != "float16" else 2)
    pin = pinned.wanted(settings.pinned_arenas, device.type, settings.cuda_graphs, model.input_features * value_bytes)
    arenas = pinned.PinnedArenas(True) if pin else None
    direct = device.type == "cuda" and settings.cuda_graphs and (jpeg is not None or pin)
    return jpeg, arenas, direct


def engine_main(
    settings: Settings,
    index: int,
    endpoint: str,
    state,
    visible_device: str | None,
    run_dir: str,
    threads: int,
    config: tuple | None = None,
    info_to=None,
) -> None:
    """Entry point of an engine process (spawned by the supervisor). `state` is a shared integer (wire.LOADING..);
    `config`: (the supervisor's shared configuration generation, the generation `settings` is) for SIGHUP reloads;
    `info_to`: engine 0's end of a pipe to the supervisor, which starts the front ends once it has the model's
    ModelInfo, sent as soon as the model is read (("info", ModelInfo), or ("refused", why) for a model the loader
    refuses, which the supervisor reports as `fusedserve serve` always has: exit 2, no traceback)."""
    child_setup(f"fs-engine-{index}")
    configure_logging(settings.log_level)
    engine: Engine | None = None

    def stop(signum, frame):  # the supervisor's SIGTERM: answer what is queued, then exit
        if engine is not None and state.value == wire.READY:
            engine.stopping = True
        else:
            # Nothing is served before ready (the model read, the warm-up: minutes of compiling on a GPU, of Triton's
            # interpreter on the CPU), so nothing is owed: exit at once, not at the warm-up's end, past the grace. Not
            # sys.exit: a SystemExit raised inside torch's C++ (the safetensors read) comes back out as a different
            # error, which the loader reported as a bad model.
            sys.stderr.flush()
            os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    if visible_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device
    progress = None
    try:
        from ..backend import prepare_backend

        device = prepare_backend(settings)  # before any kernel is defined
        import torch

        # The front ends need the host's cores: a CUDA engine's host work (casts, copies) is tiny and gets one
        # thread, so that idle OpenMP workers do not spin on cores the front ends use; a CPU engine gets its share.
        torch.set_num_threads(1 if device.type == "cuda" else threads)
        from ..metrics import EngineMetrics, config_reloaded
        from ..model.loader import load_model
        from ..model.spec import ModelFormatError
        from .startup import StartupProgress

        progress = StartupProgress(index, Path(run_dir))
        try:
            model = load_model(settings.model_path())
        except ModelFormatError as e:
            if info_to is None:
                raise
            # The supervisor says why and stops this process: no teardown for its SIGTERM to interrupt.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            progress.finish()
            state.value = wire.FAILED_START
            with contextlib.suppress(OSError):  # the supervisor is already gone (stopped meanwhile): nobody to tell
                info_to.send(("refused", str(e)))
            logging.shutdown()
            os._exit(3)
        if info_to is not None:
            from ..link.model_info import ModelInfo

            try:
                info_to.send(("info", ModelInfo.of(model)))
            except OSError:  # the supervisor stopped listening (a stop came while the model was read): its SIGTERM
                os._exit(0)  # follows, and nothing is served yet
            info_to.close()
        dtype = settings.compute_dtype(device.type)
        _, b_config = settings.ab_configs(device.type)  # ValueError: AB_OTHER is what DTYPE=auto resolves to
        configs = Configs(dtype, b_config if settings.ab_other is not None else None)
        if device.type == "cuda" and not captures_ignore_other_threads():
            log.warning("this torch cannot capture CUDA graphs thread-locally: a reload that loads an executor while "
                        "the engine serves may break its serving")  # fmt: skip
        label = str(index)
        # The device as the host names it: each engine sees only its own GPU, as cuda:0.
        where = f"cuda:{visible_device}" if device.type == "cuda" and visible_device is not None else str(device)
        metrics = EngineMetrics(model.name, settings.mode, where, dtype, engine=label)
        from kernels import compile_deadline

        compile_deadline.on_late(metrics.compile_late)

        jpeg, arenas, direct = image_setup(settings, device, dtype, model)

        def make_runner(label: str):  # an executor by its label (engine/ab.py: `fused`, or `fused:float16`)
            mode, of = configs.config(label)
            runner = build_runner(settings, device, of, model, metrics, mode, direct_input=direct, label=label)
            runner.pinned = arenas
            return faults.maybe_inject(runner)

        runners = {m: make_runner(m) for m in needed_modes(settings.mode, settings.shadow_every, configs)}
        listener = stream.new_socket()
        listener.bind(endpoint)
        listener.listen(256)
        engine = Engine(runners, listener, settings, model.input_shape, metrics, dtype, configs)
        engine.device_type = device.type
        engine.jpeg, engine.pinned = jpeg, arenas
        if jpeg is not None or arenas is not None or direct:
            log.info("engine %d: JPEGs decoded %s; front ends' arenas %s; batches copied into the graphs %s", index,
                     "on the GPU (nvJPEG)" if jpeg is not None else "in the front ends",
                     "registered with CUDA" if arenas is not None else "not registered",
                     "directly" if direct else "through pinned staging")  # fmt: skip
        engine.on_broken = lambda: setattr(state, "value", wire.BROKEN)
        if config is not None:
            engine.config_generation, engine.config_seen = config
            engine.run_dir = Path(run_dir)

        def load(mode: str):  # a mode a reload asks for, loaded on a thread of its own while the engine serves
            runner = make_runner(mode)
            if settings.warmup:
                runner.warmup(settings.max_batch_size)
            return runner

        engine.modes.make = load
        engine.modes.on_failed = lambda: config_reloaded(model.name, "failed")
        engine.modes.on_loaded = gc.freeze
        if device.type == "cuda":
            engine.spin_s = settings.engine_spin_ms / 1e3
        from ..link.plan import write_plan

        if index == 0:
            write_plan(Path(run_dir), engine.runner.executor, str(device))
        state.value = wire.WARMING
        if settings.warmup:
            progress.plan(sum(r.warmup_step_buckets(settings.max_batch_size) for r in runners.values()))
            for mode, runner in runners.items():
                t = time.perf_counter()
                sizes = runner.warmup(settings.max_batch_size, progress)
                log.info("engine %d warm: %s on %s, %s, batch sizes %s in %.1f s%s", index, mode, device, dtype, sizes,
                         time.perf_counter() - t, _warm_note(runner, sizes, settings.max_batch_size))  # fmt: skip
                one = runner.warm_seconds.get(1, 0.0)
                if device.type != "cuda" and mode == "fused" and one > 1.0 and index == 0:
                    log.warning("engine %d: fused on the CPU runs every kernel in Triton's interpreter: a batch of 1 "
                                "took %.1f s to warm up, and a request will take about as long; the unfused mode "
                                "(--mode unfused, FUSEDSERVE_MODE=unfused) runs the same model with torch's CPU ops",
                                index, one)  # fmt: skip
            fallbacks = {n: why for r in runners.values() for n, why in r.executor.fallbacks.items()}
            metrics.unfused_fallbacks(len(fallbacks))
            if fallbacks:
                log.warning("engine %d: %d fused step(s) run their unfused op, no kernel compiling within %g s: %s",
                            index, len(fallbacks), settings.compile_deadline_s, ", ".join(fallbacks))  # fmt: skip
                if index == 0:  # GET /model shows which
                    write_plan(Path(run_dir), engine.runner.executor, str(device))
        if settings.tuning and device.type == "cuda":
            from kernels import tuning_background

            from ..link.tuning_progress import write_tuning

            def publish(pending: int, done: int) -> None:
                write_tuning(Path(run_dir), index, pending, done)

            # Keys are left untimed with background tuning on, or once a start (or a mode built later, on SIGHUP)
            # has spent its timing budget (FUSEDSERVE_TUNING_STARTUP_S): either way they are timed while idle. With
            # none left the tuner costs the loop one length check when the queue empties.
            engine.tuning = BackgroundTuning(lambda: engine.modes.runners, metrics, publish)
            left = tuning_background.queue().pending()
            if settings.tuning_background or left:
                why = "background tuning" if settings.tuning_background else (
                    f"the start-up's {settings.tuning_startup_s:g} s of kernel timing spent")  # fmt: skip
                log.info("engine %d: %d tuning keys left untimed (%s), to be timed while idle", index, left, why)
        # Everything allocated so far lives as long as the process: out of the collector's view, so a full GC
        # pass (100-200 ms seen on an event loop holding the model) has less to walk.
        gc.freeze()
    except Exception:
        log.exception("engine %d failed to start", index)
        if progress is not None:
            progress.finish()
        state.value = wire.FAILED_START
        sys.exit(3)
    progress.finish()
    state.value = wire.READY
    try:
        engine.serve()
    except faults.DeviceBroken:
        # Only a new process gets a working CUDA context: exit non-zero; the supervisor stops the service with
        # exit 1 for Docker or Kubernetes to restart it.
        logging.shutdown()
        os._exit(EXIT_DEVICE_BROKEN)
    state.value = wire.STOPPED
    log.info("engine %d stopped", index)
    logging.shutdown()
    # Skip the interpreter's teardown: torch and triton take ~0.1 s over it and print binding-leak noise.
    os._exit(0)
