"""Triton Inference Server's model-configuration and statistics extensions, so that the tools built on them
(perf_analyzer, Model Analyzer, tritonclient's get_model_config and get_inference_statistics) work unchanged.

Each answer is built once here as the JSON Triton's REST endpoints give (its ModelConfig and ModelStatistics messages
in protobuf's JSON with the field names kept, 64-bit integers as numbers); REST sends it as it is, and gRPC parses it
into the same messages (service/v2/grpc_server.py), so the two protocols cannot disagree.
"""

from __future__ import annotations

import orjson

from ..frontend.state import FrontendState
from ..metrics import PHASES, inference_totals
from . import tensors as t

# What GET /v2 and ServerMetadata list: the Triton extensions this server has, and no other.
EXTENSIONS = ("binary_tensor_data", "model_configuration", "statistics")
BACKEND = "fusedserve"


def model_config(state: FrontendState) -> dict:
    """Triton's model configuration of the served model.

    max_batch_size is MAX_ROWS_PER_REQUEST. Triton has one number where fusedserve has two: the most rows one
    request may carry (MAX_ROWS_PER_REQUEST), and the most rows the engine merges into one forward (MAX_BATCH_SIZE,
    at least as many). Clients read Triton's as the largest batch they may send (perf_analyzer refuses a -b above
    it; tritonclient-based tools size their requests by it), so it must be the per-request limit: every batch size
    up to it is accepted, where the engine's limit would let a client send requests that are refused with 413. The
    engine's limit is in parameters, as engine_max_batch_size.

    dims leave out the batch dimension, as Triton's do; the label output, one string per row, is Triton's per-row
    scalar: dims [1] reshaped to [].
    """
    s = state.settings
    model = state.model
    plan = state.plan()
    parameters = {"mode": s.mode, "engine_max_batch_size": str(s.max_batch_size)}
    if plan.get("dtype"):
        parameters["dtype"] = plan["dtype"]
    if model.image is not None:  # `input` also takes BYTES tensors of encoded images, prepared so (JSON)
        parameters["image_preprocess"] = orjson.dumps(model.image).decode()
    return {
        "name": model.name,
        "platform": t.PLATFORM,
        "backend": BACKEND,
        "max_batch_size": s.max_rows_per_request,
        "input": [{
            "name": t.INPUT, "data_type": f"TYPE_{t.input_datatype(model)}", "format": "FORMAT_NONE",
            "dims": list(model.input_shape),
            "is_shape_tensor": False, "allow_ragged_batch": False, "optional": False,
        }],
        "output": [
            {"name": t.LOGITS, "data_type": "TYPE_FP32", "dims": [model.output_features], "label_filename": "",
             "is_shape_tensor": False},
            {"name": t.LABEL, "data_type": "TYPE_STRING", "dims": [1], "reshape": {"shape": []}, "label_filename": "",
             "is_shape_tensor": False},
        ],
        # Requests are answered each on its own, in no promised order; MAX_DELAY_MS is the longest an idle engine
        # holds a partial batch (service/engine/batching.py).
        "dynamic_batching": {
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": round(s.max_delay_ms * 1000),
            "preserve_ordering": False,
        },
        "instance_group": instance_groups(model.name, _engine_devices(state)),
        "parameters": {k: {"string_value": v} for k, v in parameters.items()},
    }  # fmt: skip


def _engine_devices(state: FrontendState) -> list[str]:
    """Each engine's device ("cuda:3", "cpu"), as the engines label fusedserve_model_info; without those (a front end
    whose metrics are its own, in tests) engine 0's device for every engine."""
    devices = inference_totals(state.metrics.registry, state.model.name).devices
    if devices:
        return [devices[k] for k in sorted(devices, key=int)]
    return [str(state.plan().get("device") or "cpu")] * len(state.engines.states())


def instance_groups(name: str, devices: list[str]) -> list[dict]:
    """Triton's instance_group for one engine on each of `devices`. Triton's `count` is the instances on each GPU
    of `gpus` (KIND_GPU), or in all (KIND_CPU): so engines on GPUs make one group per number of engines a GPU has
    (one group, count 1, on the usual one engine per GPU); CPU engines one group of them all. One group is named
    after the model, several name_0, name_1, ..., as Triton names them."""
    per_gpu: dict[int, int] = {}
    for d in devices:
        if d.startswith("cuda"):
            gpu = int(d.partition(":")[2] or 0)
            per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
    by_count: dict[int, list[int]] = {}
    for gpu, n in sorted(per_gpu.items()):
        by_count.setdefault(n, []).append(gpu)
    groups = [{"kind": "KIND_GPU", "count": n, "gpus": gpus} for n, gpus in sorted(by_count.items())]
    cpus = sum(1 for d in devices if not d.startswith("cuda"))
    if cpus:
        groups.append({"kind": "KIND_CPU", "count": cpus, "gpus": []})
    for i, g in enumerate(groups):
        g["name"] = name if len(groups) == 1 else f"{name}_{i}"
    return groups


def statistics(state: FrontendState) -> dict:
    """Triton's statistics of the served model (`{"model_stats": [...]}`), summed over every front end and engine of
    the deployment from the same values as /metrics (service/metrics.py: inference_totals), at this moment.

    - inference_count: rows of the batches run; execution_count: batches run (fusedserve_batch_rows's sum and
      count, as each batch leaves its queue); last_inference: when the last batch was answered, in milliseconds since
      the epoch (0 before any).
    - success: requests answered with outputs, by every protocol (/predict, REST and gRPC v2), each timed from
      reaching its front end's handler (body not yet read) to its answer ready (fusedserve_request_seconds).
    - fail: requests answered with an error, by every protocol and for every reason (fusedserve_requests_total's
      outcomes but ok: invalid, too large, overloaded, timed out, cancelled, failed), each timed from its handler to
      its error answer (fusedserve_failed_request_seconds; no time for the refusals no handler saw, past
      MAX_CONNECTIONS, nor for those refused before any work: without a valid API key, or for an unknown model).
    - queue, compute_input, compute_infer, compute_output: the four back-to-back parts of each answered request's
      time in its engine, counted by the engine as it answers (service/engine/core.py, Engine._answered, says which
      interval each is; a batch's compute time counts once per request in it, as in Triton). One count for all four,
      so they always agree, as perf_analyzer requires. Each ends before the request's answer leaves the engine, so
      per request queue + compute_input + compute_infer + compute_output <= success, and the rest of success is the
      front end's own work (reading, decoding, answering) and the link back.
    - cache_hit, cache_miss: 0 (no response cache); batch_stats: empty (batch sizes are fusedserve_batch_rows).

    Counts lag by up to ANSWERED_WRITE_EVERY_S (service/metrics.py) under load; an idle service's are exact.
    """
    model = state.model
    state.metrics.flush()  # this front end's requests of the loop's turn so far (RequestMetrics.flush)
    totals = inference_totals(state.metrics.registry, model.name)

    def duration(count: int, seconds: float) -> dict:
        return {"count": count, "ns": max(0, round(seconds * 1e9))}

    inference_stats = {
        "success": duration(totals.ok, totals.ok_s),
        "fail": duration(totals.failed, totals.failed_s),
        **{phase: duration(totals.requests, totals.phase_s.get(phase, 0.0)) for phase in PHASES},
        "cache_hit": duration(0, 0.0),
        "cache_miss": duration(0, 0.0),
    }
    stat = {
        "name": model.name,
        "version": t.VERSION,
        "last_inference": round(totals.last_inference_s * 1000),
        "inference_count": totals.rows,
        "execution_count": totals.batches,
        "inference_stats": inference_stats,
        "batch_stats": [],
    }
    return {"model_stats": [stat]}
