"""The request bodies of `bench serve`'s Open Inference Protocol phases: binary REST and gRPC.

Each body carries `rows` rows of the served model's input shape (64 values for the digits MLP, C x H x W for an image
model) in one datatype, as little-endian bytes, built once per run, so the client sends bytes and parses nothing.
Values, seeded: integers 0..16 for the digits models (pixels as they were trained on), 0..255 in UINT8, else standard
normal floats (normalized pixels: a random ResNet's activations stay inside float16). Binary REST: a JSON header
naming the input and asking for binary outputs, then the rows' bytes (the header's length goes in
Inference-Header-Content-Length, the same for every body of one row count). gRPC: a serialized ModelInferRequest
with the rows in raw_input_contents (built with protobuf alone: no grpc import in the parent, which forks the
client processes).
"""

from __future__ import annotations

import orjson

from .loadgen import FEATURES

MODEL = "digits-mlp"  # the default model
GRPC_METHOD = "/inference.GRPCInferenceService/ModelInfer"
PROTOCOLS = ("v2_binary", "v2_grpc")
NUMPY = {"FP32": "<f4", "FP16": "<f2", "UINT8": "u1"}
BIG_BODY = 1 << 20  # bodies of a MB and more: 8 different ones instead of 16 (32 FP16 224x224 images: 9.6 MB each)


def rest_path(model: str = MODEL) -> str:
    return f"/v2/models/{model}/infer"


REST_PATH = rest_path()


def body_count(rows: int, shape: tuple[int, ...] = (FEATURES,), datatype: str = "FP32", count: int = 16) -> int:
    """How many different bodies to build: `count`, or 8 where each is a MB or more (they travel to every client
    process once per phase)."""
    import math

    size = rows * math.prod(shape) * int(NUMPY[datatype][-1])
    return min(count, 8) if size >= BIG_BODY else count


def _rows(rows: int, count: int, seed: int, shape=(FEATURES,), datatype: str = "FP32") -> list[bytes]:
    import math

    import numpy as np

    rng = np.random.default_rng(seed * 1000 + rows + 7)
    n = rows * math.prod(shape)
    digits = math.prod(shape) == FEATURES  # the digits MLP and CNNs: 8x8 pixels 0..16
    out = []
    for _ in range(count):
        if datatype == "UINT8" or digits:
            data = rng.integers(0, 17 if digits else 256, size=n)
        else:
            data = rng.standard_normal(n, dtype=np.float32)
        out.append(data.astype(NUMPY[datatype]).tobytes())
    return out


def binary_header(rows: int, shape=(FEATURES,), datatype: str = "FP32") -> bytes:
    import math

    size = rows * math.prod(shape) * int(NUMPY[datatype][-1])
    doc = {
        "inputs": [{"name": "input", "datatype": datatype, "shape": [rows, *shape],
                    "parameters": {"binary_data_size": size}}],
        "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in ("logits", "label")],
    }  # fmt: skip
    return orjson.dumps(doc)


def binary_bodies(
    rows: int, count: int = 16, seed: int = 0, shape=(FEATURES,), datatype: str = "FP32"
) -> tuple[list[bytes], bytes]:
    """(bodies, the extra HTTP header line they need)."""
    head = binary_header(rows, shape, datatype)
    header = f"Inference-Header-Content-Length: {len(head)}\r\n".encode()
    return [head + data for data in _rows(rows, count, seed, shape, datatype)], header


def grpc_bodies(
    rows: int, count: int = 16, seed: int = 0, shape=(FEATURES,), datatype: str = "FP32", model: str = MODEL
) -> list[bytes]:
    from service.v2 import grpc_predict_v2_pb2 as pb

    out = []
    for data in _rows(rows, count, seed, shape, datatype):
        request = pb.ModelInferRequest(
            model_name=model,
            inputs=[pb.ModelInferRequest.InferInputTensor(name="input", datatype=datatype, shape=[rows, *shape])],
            raw_input_contents=[data],
        )
        out.append(request.SerializeToString())
    return out
