"""The request bodies of `bench serve`'s Open Inference Protocol phases: binary REST and gRPC.

Each body carries `rows` rows of 64 pixel values 0..16 (as make_bodies' JSON ones) as little-endian float32 bytes,
built once per phase group, so the client sends bytes and parses nothing. Binary REST: a JSON header naming the
input and asking for binary outputs, then the rows' bytes (the header's length goes in
Inference-Header-Content-Length, the same for every body of one row count). gRPC: a serialized ModelInferRequest
with the rows in raw_input_contents (built with protobuf alone: no grpc import in the parent, which forks the
client processes).
"""

from __future__ import annotations

import orjson

from .loadgen import FEATURES

MODEL = "digits-mlp"  # what the benchmark's fusedserve servers serve (the default model)
REST_PATH = f"/v2/models/{MODEL}/infer"
GRPC_METHOD = "/inference.GRPCInferenceService/ModelInfer"
PROTOCOLS = ("v2_binary", "v2_grpc")


def _rows(rows: int, count: int, seed: int) -> list[bytes]:
    import numpy as np

    rng = np.random.default_rng(seed * 1000 + rows + 7)
    return [rng.integers(0, 17, size=(rows, FEATURES)).astype("<f4").tobytes() for _ in range(count)]


def binary_header(rows: int) -> bytes:
    doc = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, FEATURES],
                    "parameters": {"binary_data_size": rows * FEATURES * 4}}],
        "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in ("logits", "label")],
    }  # fmt: skip
    return orjson.dumps(doc)


def binary_bodies(rows: int, count: int = 16, seed: int = 0) -> tuple[list[bytes], bytes]:
    """(bodies, the extra HTTP header line they need)."""
    head = binary_header(rows)
    header = f"Inference-Header-Content-Length: {len(head)}\r\n".encode()
    return [head + data for data in _rows(rows, count, seed)], header


def grpc_bodies(rows: int, count: int = 16, seed: int = 0) -> list[bytes]:
    from service.v2 import grpc_predict_v2_pb2 as pb

    out = []
    for data in _rows(rows, count, seed):
        request = pb.ModelInferRequest(
            model_name=MODEL,
            inputs=[pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=[rows, FEATURES])],
            raw_input_contents=[data],
        )
        out.append(request.SerializeToString())
    return out
