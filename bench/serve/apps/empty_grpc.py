"""The gRPC ceiling: grpcio's asyncio server with the Open Inference Protocol's GRPCInferenceService and no model.
ModelInfer answers with a constant ModelInferResponse shaped like fusedserve's (`logits` FP32 [n, 10] of zeros and
`label` BYTES [n] of "0", in raw_output_contents), built once per row count (the single row's at start): no engine,
no batching, no checks. Nothing fusedserve's gRPC front ends add to a call can cost less than this in grpc.aio, as
nothing its HTTP front ends add can cost less than bench/serve/apps/empty.py in FastAPI.

    python -m bench.serve.apps.empty_grpc --port P --workers W     # serve: W processes on one port
    python -m bench.serve.apps.empty_grpc --port P --wait-ready S  # exit 0 once ServerReady is true (S s at most)

What it shares with fusedserve's front ends, so that the two compare: the generated stubs of service/v2 (grpcio
parses each request and serializes each answer as it does there), the server's options
(service/v2/grpc_server.new_server: SO_REUSEPORT, the message limit, the cap on calls in flight, from the same
FUSEDSERVE_* settings), one server per process with every process bound to the same port (the kernel spreads
connections over them), and the event loop (uvloop where installed: uvicorn's `auto` loop, on which the front ends
run their gRPC server). ServerReady and ModelReady say ready once every worker is serving, so that no worker
misses the connections of a phase. SIGTERM (or SIGINT) to the parent stops every worker (calls under way get
GRACE_S) and the parent exits 0 once each has exited 0.

The parent imports no grpc: it forks the workers, and a child forked from a process that has used grpcio cannot
use it (`bench serve`, which forks its client processes, checks readiness through `--wait-ready` in a process of
its own for the same reason).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time

from ..loadgen import FEATURES
from ..v2 import MODEL

OUTPUTS = 10  # the digits model's classes, as bench/serve/apps/empty.py answers
GRACE_S = 5.0  # calls under way when a worker stops (each is answered at once: this is never waited out)
STOP_WAIT_S = GRACE_S + 5.0  # then the parent kills a worker still running
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def response(pb, rows: int):
    """What fusedserve answers to a `rows`-row ModelInfer of the digits model whose logits are all 0."""
    from service.v2 import tensors as t

    tensor = pb.ModelInferResponse.InferOutputTensor
    label = t.bytes_element("0")
    return pb.ModelInferResponse(
        model_name=MODEL,
        model_version=t.VERSION,
        outputs=[
            tensor(name=t.LOGITS, datatype="FP32", shape=[rows, OUTPUTS]),
            tensor(name=t.LABEL, datatype="BYTES", shape=[rows]),
        ],
        raw_output_contents=[bytes(4 * OUTPUTS * rows), label * rows],
    )


async def _serve(host: str, port: int, workers: int, serving) -> None:
    import grpc

    from service.config import Settings
    from service.frontend.state import body_limit
    from service.v2 import grpc_predict_v2_pb2 as pb
    from service.v2 import grpc_predict_v2_pb2_grpc as pb_grpc
    from service.v2.grpc_server import address, new_server

    settings = Settings()  # FUSEDSERVE_* from the environment, as a fusedserve front end reads them
    max_rows = settings.max_rows_per_request
    answers = {1: response(pb, 1)}

    class Empty(pb_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=serving.value == workers)

        async def ModelReady(self, request, context):
            if request.name != MODEL:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}; this is {MODEL!r}")
            return pb.ModelReadyResponse(ready=serving.value == workers)

        async def ModelInfer(self, request, context):
            shape = request.inputs[0].shape if request.inputs else ()
            rows = shape[0] if shape else 1
            answer = answers.get(rows)
            if answer is None:
                if not 1 <= rows <= max_rows:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{rows} rows; 1 to {max_rows} a request")
                answer = answers[rows] = response(pb, rows)
            return answer

    server = new_server(body_limit(max_rows, FEATURES), settings.max_connections)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Empty(), server)
    server.add_insecure_port(address(host, port))
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    with serving.get_lock():
        serving.value += 1
    print(f"empty_grpc: worker pid {os.getpid()} serving on {host}:{port}", flush=True)
    await stop.wait()
    await server.stop(GRACE_S)


def _worker(host: str, port: int, workers: int, serving) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers, once each
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # stopped before it serves: nothing to answer
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the parent across the fork
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the parent
    if os.getppid() == 1:
        os._exit(1)
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = asyncio.new_event_loop
    import gc

    gc.freeze()  # as a fusedserve front end does once its app is built
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(host, port, workers, serving))


def serve(host: str, port: int, workers: int) -> int:
    """Run `workers` worker processes until SIGTERM or SIGINT; 0 when every one exited 0, else 1."""
    # fork, not spawn: this process has not imported grpc, and spawn would start multiprocessing's resource tracker,
    # a child that outlives this process (a zombie of its group until init reaps it: up to 2 s on the test host).
    ctx = mp.get_context("fork")
    serving = ctx.Value("i", 0)
    stopping = []
    for s in STOP_SIGNALS:
        signal.signal(s, lambda signum, frame: stopping.append(signum))
    procs = [ctx.Process(target=_worker, args=(host, port, workers, serving), name=f"empty-grpc-{i}")
             for i in range(workers)]  # fmt: skip
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # a worker takes a stop only once its own handler is set
    try:
        for p in procs:
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    while not stopping and all(p.is_alive() for p in procs):
        time.sleep(0.1)
    died = [p for p in procs if not p.is_alive()]
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)
    codes = [p.exitcode for p in procs]
    if died and not stopping:
        print(f"empty_grpc: a worker exited on its own (exit codes {codes})", flush=True)
        return 1
    print(f"empty_grpc: {workers} worker(s) stopped (exit codes {codes})", flush=True)
    return 0 if all(c == 0 for c in codes) else 1


def wait_ready(host: str, port: int, timeout_s: float) -> bool:
    """Poll ServerReady (a fresh channel each try, so that no reconnect back-off delays it) until it says ready."""
    import grpc

    from service.v2 import grpc_predict_v2_pb2 as pb
    from service.v2 import grpc_predict_v2_pb2_grpc as pb_grpc
    from service.v2.grpc_server import address

    deadline = time.monotonic() + timeout_s
    target = address(host, port)
    while True:
        left = deadline - time.monotonic()
        with grpc.insecure_channel(target) as channel, contextlib.suppress(grpc.RpcError):
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            if stub.ServerReady(pb.ServerReadyRequest(), timeout=max(0.05, min(1.0, left))).ready:
                return True
        if time.monotonic() + 0.1 > deadline:
            return False
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve.apps.empty_grpc", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on [127.0.0.1]")
    p.add_argument("--port", type=int, required=True, help="port of every worker (SO_REUSEPORT)")
    p.add_argument("--workers", type=int, default=1, help="worker processes [1]")
    p.add_argument("--wait-ready", type=float, metavar="S", help="do not serve: wait up to S s for ServerReady")
    args = p.parse_args(argv)
    if args.wait_ready is not None:
        if wait_ready(args.host, args.port, args.wait_ready):
            return 0
        print(f"empty_grpc: {args.host}:{args.port} not ready after {args.wait_ready:g} s", flush=True)
        return 1
    if args.workers < 1:
        p.error("--workers must be at least 1")
    return serve(args.host, args.port, args.workers)


if __name__ == "__main__":
    sys.exit(main())
