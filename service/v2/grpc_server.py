"""The Open Inference Protocol over gRPC: GRPCInferenceService on FUSEDSERVE_GRPC_PORT, in every front end.

grpcio's asyncio server runs on the front end's own event loop, beside uvicorn, and serves requests through the
same checks (service/v2/tensors.py), engine link (`run_rows`) and metrics (protocol "v2_grpc") as REST. Every front
end binds the same port: grpcio sets SO_REUSEPORT on Linux, so the kernel spreads connections over them as it
does uvicorn's. A message larger than the front end's body limit is refused by grpcio with RESOURCE_EXHAUSTED
before it is read in full (in grpcio's core, before any handler: so it is not counted in fusedserve_requests_total),
metadata past MAX_METADATA_BYTES likewise, and with API keys on a call without a valid key is refused at its metadata,
before its message is read (service/v2/grpc_guard.py);
the client's deadline, when it has one, shortens the request's timeout in the queue. On shutdown the server stops
after uvicorn's drain, giving RPCs under way half the grace to finish. ModelConfig and ModelStatistics (Triton's
extensions) answer the documents REST's /config and /stats do (service/v2/extensions.py).

The generated modules register `inference.*` in protobuf's default descriptor pool, as tritonclient.grpc's own
copy of the protocol does: one process cannot import both (a duplicate-symbol TypeError). The server never imports
tritonclient; tests and clients that use tritonclient never import these modules (bench/serve/v2.py builds its
requests with them in a process that has no tritonclient).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import numpy as np
from google.protobuf import json_format

from ..frontend import requestid
from ..frontend.access_log import grpc_call
from ..frontend.auth import grpc_credentials, grpc_interceptor
from ..frontend.inputs import InputError
from ..frontend.serving import Refused, run_rows
from ..frontend.state import FrontendState
from . import extensions
from . import grpc_predict_v2_pb2 as pb
from . import grpc_predict_v2_pb2_grpc as pb_grpc
from . import tensors as t
from .grpc_guard import keys_interceptor
from .rest import SERVER_METADATA

log = logging.getLogger(__name__)

PROTOCOL = "v2_grpc"
# A client's deadline cancels its call from the client's side at the deadline; the server's copy of that deadline
# lies later by the request's transit time, so the cancellation arrives with a little time still "remaining" here
# (99.3 ms into a 100 ms deadline on a loaded 2-core machine). A cancellation this close to the deadline is the
# deadline's, counted as a timeout (504), not as a client that left (499).
DEADLINE_SLACK_S = 0.05
_CODE_OF = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: FrontendState):
        self.state = state
        model = state.model
        meta = t.model_metadata(model)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        self._metadata = pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(**x) for x in meta["inputs"]], outputs=[tensor(**x) for x in meta["outputs"]],
        )  # fmt: skip
        self._server_metadata = pb.ServerMetadataResponse(**SERVER_METADATA)

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ServerMetadata(self, request, context):
        return self._server_metadata

    async def ModelReady(self, request, context):
        try:
            t.check_model(self.state.model, request.name, request.version)
        except InputError as e:
            await context.abort(_CODE_OF[e.status], e.message)
        return pb.ModelReadyResponse(ready=self.state.ready)

    async def ModelMetadata(self, request, context):
        try:
            t.check_model(self.state.model, request.name, request.version)
        except InputError as e:
            await context.abort(_CODE_OF[e.status], e.message)
        return self._metadata

    async def ModelConfig(self, request, context):
        """Triton's model configuration extension: the document REST's /config answers, as its message."""
        try:
            t.check_model(self.state.model, request.name, request.version)
        except InputError as e:
            await context.abort(_CODE_OF[e.status], e.message)
        return json_format.ParseDict({"config": extensions.model_config(self.state)}, pb.ModelConfigResponse())

    async def ModelStatistics(self, request, context):
        """Triton's statistics extension: an empty name asks for every model's, as REST's /v2/models/stats."""
        if request.name:
            try:
                t.check_model(self.state.model, request.name, request.version)
            except InputError as e:
                await context.abort(_CODE_OF[e.status], e.message)
        return json_format.ParseDict(extensions.statistics(self.state), pb.ModelStatisticsResponse())

    async def ModelInfer(self, request, context):
        started = time.perf_counter()
        state = self.state
        metrics = state.metrics
        # The request id (service/frontend/requestid.py): metadata x-request-id, else the request's `id`, else a new
        # one; the answer's `id` where the request had none, and trailing metadata x-request-id on a failure.
        rid = None
        keys = state.api_keys
        metadata = context.invocation_metadata() or ()
        for key, value in metadata:
            if key == "x-request-id":
                rid = value if requestid.valid(value) else None
        if rid is None:
            rid = request.id if requestid.valid(request.id) else requestid.new().decode()
        if keys.digests is not None and not keys.allows(next((v for k, v in metadata if k == "authorization"), None)):
            metrics.observe_request("unauthorized", protocol=PROTOCOL)
            grpc_call(started, 401, rid, None, None, "a valid API key is needed")
            context.set_trailing_metadata((("x-request-id", rid),))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is needed: metadata authorization: "
                                "Bearer <key>")  # fmt: skip
        rows = None
        try:
            if not state.engines.ready():
                raise Refused(503, "overloaded", f"model is not ready ({state.status}); retry shortly")
            rows, wanted = _parse(state, request)
            if isinstance(rows, list):  # encoded images (an image model's BYTES input)
                from ..frontend.images import pipeline  # imports torch: only a front end of an image model does

                rows = await pipeline(state).rows(rows)
            timeout_s = state.settings.request_timeout_ms / 1e3
            remaining = context.time_remaining()
            if remaining is not None:
                timeout_s = min(timeout_s, remaining)
            arrival = time.monotonic()
            outputs, mode = await run_rows(state, rows, arrival, arrival + timeout_s, request_id=rid)
        except (InputError, Refused) as e:
            outcome, failed_mode = e.outcome, getattr(e, "mode", None)
            code, message = _CODE_OF.get(e.status, grpc.StatusCode.INTERNAL), e.message
            status = e.status
        except asyncio.CancelledError:
            # The client left, or its deadline passed (grpcio cancels the handler either way).
            remaining = context.time_remaining()
            timed_out = remaining is not None and remaining <= DEADLINE_SLACK_S
            metrics.observe_request("timeout" if timed_out else "cancelled", time.perf_counter() - started,
                                    protocol=PROTOCOL)  # fmt: skip
            grpc_call(started, 504 if timed_out else 499, rid, _count(rows), None, "deadline passed" if timed_out
                      else "the client left")  # fmt: skip
            raise
        except Exception as e:  # a bug, not a bad request: count it and say so, never an uncounted failure
            log.exception("unexpected error serving ModelInfer")
            outcome, code, message = "error", grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"
            failed_mode, status = None, 500
        else:
            response = _response(state, request, outputs, wanted, mode)
            if not request.id:
                response.id = rid
            metrics.observe_request("ok", time.perf_counter() - started, protocol=PROTOCOL, mode=mode)
            grpc_call(started, 200, rid, _count(rows), mode)
            return response
        metrics.observe_request(outcome, time.perf_counter() - started, protocol=PROTOCOL, mode=failed_mode)
        grpc_call(started, status, rid, _count(rows), failed_mode, message)
        context.set_trailing_metadata((("x-request-id", rid),))
        await context.abort(code, message)


def _count(rows) -> int | None:
    """A request's rows, for the access log: an array's length, None before the request was parsed."""
    return len(rows) if rows is not None else None


def _parse(state: FrontendState, request) -> tuple[np.ndarray | list[tuple[str, bytes]], list[str]]:
    model = state.model
    t.check_model(model, request.model_name, request.model_version)
    if len(request.inputs) != 1:
        raise InputError(400, f"the request has {len(request.inputs)} inputs; the model takes one, {t.INPUT!r}")
    inp = request.inputs[0]
    shape = list(inp.shape)
    raw = request.raw_input_contents
    if t.is_image_input(model, inp.name, inp.datatype):  # encoded images: decoded by the caller, in the image pool
        count = t.image_count(inp.name, shape, state.settings.max_rows_per_request)
        if len(raw) > 1:
            raise InputError(400, f"raw_input_contents has {len(raw)} entries; one per input (1)")
        if raw:
            rows = t.bytes_elements(raw[0], count, inp.name)
        elif len(inp.contents.bytes_contents) == count:
            rows = [(f"input {inp.name!r} element {i}", e) for i, e in enumerate(inp.contents.bytes_contents)]
        else:
            raise InputError(400, f"input {inp.name!r} has {len(inp.contents.bytes_contents)} bytes_contents; its "
                             f"shape takes {count}")  # fmt: skip
        return rows, _wanted(request)
    dtype, _ = t.check_input(model, inp.name, inp.datatype, shape, state.settings.max_rows_per_request)
    if raw:
        if len(raw) != 1:
            raise InputError(400, f"raw_input_contents has {len(raw)} entries; one per input (1)")
        if inp.HasField("contents"):
            raise InputError(400, f"input {t.INPUT!r} has both contents and raw_input_contents; send one")
        rows = t.rows_from_buffer(model, raw[0], dtype, shape)
    else:
        contents = inp.contents
        name = t.dtype_name(dtype)
        if name == "FP16":
            raise InputError(400, f"input {t.INPUT!r} is FP16: FP16 travels only in raw_input_contents")
        values = {"FP32": contents.fp32_contents, "FP64": contents.fp64_contents, "UINT8": contents.uint_contents}[name]
        if name == "UINT8" and values and max(values) > 255:
            raise InputError(400, f"input {t.INPUT!r} is UINT8: its uint_contents must be 0..255")
        if not values:
            raise InputError(400, f"input {t.INPUT!r} has no {name.lower()}_contents and no raw_input_contents")
        rows = t.rows_from_buffer(model, np.asarray(values, dtype=dtype).tobytes(), dtype, shape)
    return rows, _wanted(request)


def _wanted(request) -> list[str]:
    wanted = t.check_outputs([o.name for o in request.outputs])
    for o in request.outputs:
        if "classification" in o.parameters:
            raise InputError(400, f"output {o.name!r} asks for classification, an extension this server lacks")
    return wanted


def _response(state: FrontendState, request, outputs: np.ndarray, wanted: list[str], mode: str):
    model = state.model
    n = len(outputs)
    tensor = pb.ModelInferResponse.InferOutputTensor
    metas, raws = [], []
    for name in wanted:
        if name == t.LOGITS:
            metas.append(tensor(name=name, datatype="FP32", shape=[n, model.output_features]))
            raws.append(outputs.tobytes())
        else:
            metas.append(tensor(name=name, datatype="BYTES", shape=[n]))
            raws.append(t.labels_tensor(model, outputs))
    # parameters["mode"]: the executor that computed the outputs (fused or unfused).
    return pb.ModelInferResponse(
        model_name=model.name, model_version=t.VERSION, id=request.id, outputs=metas, raw_output_contents=raws,
        parameters={"mode": pb.InferParameter(string_param=mode)},
    )  # fmt: skip


def address(host: str, port: int) -> str:
    """gRPC's host:port, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# grpcio takes a message size as a C int: a larger one fails the server's construction (OverflowError), as the
# JSON-sized limit of 1,024 images of 224x224 (3.7 GB) did. gRPC messages stop at 2 GB anyway (protobuf's limit).
GRPC_MAX_MESSAGE = 2**31 - 1
# The metadata (HTTP/2 headers) of one call: as the HTTP port's request head (frontend/guard.py MAX_HEADER_BYTES).
MAX_METADATA_BYTES = 32 * 1024


def new_server(max_receive_bytes: int, max_calls: int, interceptors=()) -> grpc.aio.Server:
    """A grpc.aio server with a front end's options, not yet bound. bench/serve/apps/empty_grpc.py builds its
    no-model server (the benchmark's gRPC ceiling) with it too, so that both run grpcio with the same options."""
    return grpc.aio.server(
        interceptors=list(interceptors) or None,
        options=[
            ("grpc.so_reuseport", 1),
            # Without BDP probing a stream's window stays at HTTP/2's 64 KiB until the handler reads: with it, grpcio
            # grew the windows on loopback until the 2 MB messages of 1,000 calls refused at their metadata were
            # read anyway (200 at once: a front end from 82 to 590 MB, where without it 85 MB; issue 53).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.max_receive_message_length", min(max_receive_bytes, GRPC_MAX_MESSAGE)),
            ("grpc.max_send_message_length", -1),
            ("grpc.max_metadata_size", MAX_METADATA_BYTES),
            ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
        ],
        # The HTTP side's cap on open connections (frontend/guard.py), as calls in flight: past it grpcio answers
        # RESOURCE_EXHAUSTED at once (uncounted in the metrics, as its size refusals are).
        maximum_concurrent_rpcs=max_calls,
    )


async def start(state: FrontendState) -> grpc.aio.Server:
    """The gRPC server of this front end, listening on host:grpc_port (shared with the other front ends)."""
    s = state.settings
    # FUSEDSERVE_RESTRICTED_API's statistics and model-config rules, as metadata (service/frontend/auth.py); no
    # interceptor, so no cost per RPC, where neither is restricted.
    # API keys at the metadata (service/v2/grpc_guard.py), then the restricted RPCs' headers; none of either where
    # neither is configured (no cost per call).
    interceptors = [i for i in (keys_interceptor(state), grpc_interceptor(state.restrictions)) if i is not None]
    server = new_server(state.max_body_bytes, s.max_connections, interceptors)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(state), server)
    if s.tls:
        server.add_secure_port(address(s.host, s.grpc_port), grpc_credentials(s))
    else:
        server.add_insecure_port(address(s.host, s.grpc_port))
    await server.start()
    log.info("gRPC (Open Inference Protocol) on %s:%d%s", s.host, s.grpc_port, " over TLS" if s.tls else "")
    return server
