"""The naive app: FastAPI whose POST /predict runs the model in eager torch per request, on the event loop,
with no batching: body -> orjson -> tensor on the device -> each op of config.json (F.linear, activations)
-> .cpu(). What a quick port of a training script looks like.

    BENCH_EAGER_DEVICE=cuda BENCH_EAGER_DTYPE=float16 python -m uvicorn bench.serve.apps.eager:app --workers N

Environment: BENCH_EAGER_MODEL (a model directory; default model_weights/digits-mlp), BENCH_EAGER_DEVICE
(cuda | cpu; default cuda when present), BENCH_EAGER_DTYPE (float16 | bfloat16 | float32; default float16
on CUDA, float32 on the CPU).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import orjson
import torch
import torch.nn.functional as F
from fastapi import FastAPI, Request, Response
from safetensors.torch import load_file

MODEL_DIR = Path(os.environ.get("BENCH_EAGER_MODEL", Path(__file__).resolve().parents[3] / "model_weights/digits-mlp"))
DEVICE = torch.device(os.environ.get("BENCH_EAGER_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
DTYPE = getattr(torch, os.environ.get("BENCH_EAGER_DTYPE") or ("float16" if DEVICE.type == "cuda" else "float32"))

CONFIG = json.loads((MODEL_DIR / "config.json").read_text())
TENSORS = {k: v.to(DEVICE, DTYPE) for k, v in load_file(MODEL_DIR / "model.safetensors").items()}
LABELS = CONFIG.get("labels")
ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "tanh": torch.tanh,
}


def forward(x: torch.Tensor) -> torch.Tensor:
    for op in CONFIG["ops"]:
        kind = op["op"]
        if kind == "linear":
            x = F.linear(x, TENSORS[op["weight"]], TENSORS[op["bias"]] if op.get("bias") else None)
        elif kind == "flatten":
            x = x.flatten(1)
        elif kind == "leaky_relu":
            x = F.leaky_relu(x, op.get("negative_slope", 0.01))
        elif kind == "gelu":
            x = F.gelu(x, approximate=op.get("approximate", "none"))
        else:
            x = ACTIVATIONS[kind](x)
    return x


app = FastAPI(title="bench-eager")


def _json(doc: object, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


@app.post("/predict")
async def predict(request: Request) -> Response:
    try:
        rows = orjson.loads(await request.body())["inputs"]
        x = torch.tensor(rows, dtype=torch.float32)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        return _json({"detail": f"bad body: {e}"}, 422)
    with torch.inference_mode():
        out = forward(x.to(DEVICE, DTYPE)).float().cpu()
    index = out.argmax(1).tolist()
    preds = [LABELS[i] for i in index] if LABELS else index
    return _json({"outputs": out.tolist(), "predictions": preds, "model": CONFIG.get("name"), "mode": "eager"})


@app.get("/health/live")
async def live() -> Response:
    return _json({"status": "live"})


@app.get("/health/ready")
async def ready() -> Response:
    return _json({"status": "ready", "device": str(DEVICE), "dtype": str(DTYPE)})
