"""The CPU-preprocessing peer: images decoded and prepared on the CPU with Pillow in a Python front end, then sent to
the model as uint8 tensors, as a TorchServe handler (PIL + torchvision transforms) or a hand-written FastAPI front end
in front of Triton does it. `fusedserve bench serve --systems pil@N --v2 jpeg` times it beside fusedserve taking
the same files itself.

    python -m bench.serve.apps.pil --port P --workers N --model DIR [--mode fused --device cuda --dtype float16]

starts fusedserve (--mode, fused by default; N front ends; the model DIR, which declares its preprocessing in
config.json's input.image) on a free loopback port as its upstream, waits until it is ready, then serves N uvicorn
workers of `app` on P:

- POST /v2/models/{name}/infer with Triton's binary extension and a BYTES tensor of encoded files (what
  bench/serve/images.py sends): each file opened with Pillow, converted to RGB (or L), its shorter side resized
  (Image.resize, the model's declared filter, as torchvision's Resize runs on PIL images) and center-cropped, on
  the worker's thread pool; the stacked uint8 batch sent upstream as one UINT8 binary tensor; upstream's answer
  returned as it came.
- anything else (a tensor request, /predict, /health/*): passed to upstream as it came.

Its answers equal fusedserve's own image path to within the two resizes' rounding (Pillow's filter against torch's
antialiased interpolate: at most 1 level at most pixels; tests/test_bench_serve_pil.py).
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import orjson
from fastapi import FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

UPSTREAM_ENV, MODEL_ENV = "BENCH_PIL_UPSTREAM", "BENCH_PIL_MODEL"
HEADER = "inference-header-content-length"
FILTERS = {"bilinear": "BILINEAR", "bicubic": "BICUBIC", "nearest": "NEAREST"}


class Prepare:
    """The model's declared preprocessing, done with Pillow: file bytes -> (channels, height, width) uint8."""

    def __init__(self, model_dir: Path):
        from PIL import Image

        from service.images.preprocess import Preprocess
        from service.model.spec import read_spec

        p = Preprocess.of(read_spec(model_dir)[0])
        self.height, self.width, self.resize, self.channels = p.height, p.width, p.resize, p.channels
        self.filter = getattr(Image.Resampling, FILTERS.get(p.interpolation, "BILINEAR"))

    def __call__(self, data: bytes) -> np.ndarray:
        from PIL import Image

        img = Image.open(io.BytesIO(data))
        img = img.convert("L" if self.channels == "L" else "RGB")
        if self.resize is not None:
            w, h = img.size
            size = (self.resize, int(self.resize * h / w)) if w <= h else (int(self.resize * w / h), self.resize)
            img = img.resize(size, self.filter)
        w, h = img.size
        top, left = int(round((h - self.height) / 2.0)), int(round((w - self.width) / 2.0))
        img = img.crop((left, top, left + self.width, top + self.height))
        a = np.asarray(img, dtype=np.uint8)
        a = a[:, :, None] if a.ndim == 2 else a
        if self.channels == "BGR":
            a = a[:, :, ::-1]
        return a.transpose(2, 0, 1)


def _files(data: bytes) -> list[bytes]:
    """A BYTES tensor's elements: each a 4-byte little-endian length, then that many bytes."""
    out, at = [], 0
    while at < len(data):
        n = int.from_bytes(data[at : at + 4], "little")
        out.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    return out


def _prepare_all(prepare: Prepare, files: list[bytes]) -> np.ndarray:
    return np.stack([prepare(f) for f in files])


def _passed(request: Request) -> dict[str, str]:
    """The request's headers upstream needs: its body's type and header length, and its key."""
    return {k: v for k, v in request.headers.items() if k.lower() in ("content-type", HEADER, "authorization")}


def make_app() -> FastAPI:
    upstream = os.environ.get(UPSTREAM_ENV, "http://127.0.0.1:8000")
    prepare = Prepare(Path(os.environ[MODEL_ENV])) if os.environ.get(MODEL_ENV) else None
    client = httpx.AsyncClient(base_url=upstream, timeout=60.0, limits=httpx.Limits(max_connections=512))
    app = FastAPI(title="bench-pil")

    async def forward(method: str, path: str, body: bytes, headers: dict) -> Response:
        r = await client.request(method, path, content=body, headers=headers)
        keep = {k: v for k, v in r.headers.items() if k.lower() in ("content-type", HEADER)}
        return Response(r.content, status_code=r.status_code, headers=keep)

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request) -> Response:
        body = await request.body()
        head_len = request.headers.get(HEADER)
        passed = _passed(request)
        if head_len is None or prepare is None:
            return await forward("POST", request.url.path, body, passed)
        head = orjson.loads(body[: int(head_len)])
        tensor = head["inputs"][0]
        if tensor.get("datatype") != "BYTES":
            return await forward("POST", request.url.path, body, passed)
        try:
            batch = await run_in_threadpool(_prepare_all, prepare, _files(body[int(head_len) :]))
        except Exception as e:  # noqa: BLE001 - a file Pillow cannot read: the client's error
            return Response(orjson.dumps({"error": f"cannot prepare the images: {e}"}), status_code=422)
        data = batch.tobytes()
        doc = orjson.dumps({
            "inputs": [{"name": "input", "datatype": "UINT8", "shape": list(batch.shape),
                        "parameters": {"binary_data_size": len(data)}}],
            "outputs": head.get("outputs", []),
        })  # fmt: skip
        headers = {HEADER: str(len(doc)), "content-type": "application/octet-stream"}
        return await forward("POST", request.url.path, doc + data, headers)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def other(path: str, request: Request) -> Response:
        passed = _passed(request)
        return await forward(request.method, "/" + path, await request.body(), passed)

    return app


app = make_app() if os.environ.get(UPSTREAM_ENV) else FastAPI(title="bench-pil (no upstream)")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m bench.serve.apps.pil", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--model", required=True, help="the image model's directory (its config.json declares input.image)")
    p.add_argument("--mode", default="fused", help="the upstream fusedserve's mode [fused]")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tuning-cache")
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    from bench.local_server import free_port

    up_port = free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(up_port), "--mode",
           args.mode, "--workers", str(args.workers), "--model", args.model, "--device", args.device, "--dtype",
           args.dtype, "--log-level", "warning"]  # fmt: skip
    if args.tuning_cache:
        cmd += ["--tuning-cache", args.tuning_cache]
    upstream = subprocess.Popen(cmd)  # same process group: the benchmark's kill of the group ends it too
    url = f"http://127.0.0.1:{up_port}"
    try:
        deadline = time.monotonic() + args.ready_timeout_s
        while not _ready(url):
            if upstream.poll() is not None:
                print(f"bench pil: its upstream fusedserve exited with {upstream.returncode}", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print(f"bench pil: upstream not ready after {args.ready_timeout_s:g} s", file=sys.stderr)
                return 1
            time.sleep(0.2)
        os.environ[UPSTREAM_ENV], os.environ[MODEL_ENV] = url, str(Path(args.model).resolve())
        # uvicorn re-raises the SIGTERM it stopped on once its shutdown is done, under the handler it found: with
        # the default one this process died there, before `finally`, and the upstream fusedserve ran on orphaned.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        uvicorn.run("bench.serve.apps.pil:app", host=args.host, port=args.port, workers=args.workers,
                    log_level="info", access_log=False)  # fmt: skip
    finally:
        if upstream.poll() is None:
            upstream.send_signal(signal.SIGTERM)
            try:
                upstream.wait(30)
            except subprocess.TimeoutExpired:
                upstream.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
