"""End to end, encoded images: digits-resnet imported with an image declaration (`fusedserve import --resize 8 --mean
0 --std 15.9375`: gray 8x8 images whose pixels are the digits' 0..16 scaled to 0..255) served by the real service under
real uvicorn on a loopback port, fed the held-out digits as PNG, JPEG and WebP files in every form a client sends
them: the file as the body, multipart/form-data, base64 `instances`, and the Open Inference Protocol's BYTES tensors
(REST JSON, binary with tritonclient.http, gRPC with tritonclient.grpc). Each form's top-1 is the tensor path's on the
same digits; an image larger than the input is resized by the server as the test's reference resize does. Bad images
are refused with a 4xx naming the problem before a batch, and leave the requests beside them unharmed.

The unfused server: the image path is the front end's, the same before either executor."""

from __future__ import annotations

import base64
import concurrent.futures
import gzip
import zlib

import httpx
import numpy as np
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.cli import main as cli_main

from .imagegen import DIGIT_SCALE, cmyk_jpeg, digit_images, encode, palette_png, png16, png_bomb, truncated
from .server import REPO, free_port, running_servers
from .test_images_preprocess import reference_resize

tgrpc = pytest.importorskip("tritonclient.grpc")
thttp = pytest.importorskip("tritonclient.http")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ONNX_FILE = REPO / "model_weights" / "digits-resnet" / "digits-resnet.onnx"
MAX_ROWS = 256  # a 256-row answer is about 29 KB of JSON: over the 16 KiB from which answers are gzipped
TIMEOUT = httpx.Timeout(120.0, connect=5.0)
GRPC_PORT = free_port()
N = 360  # every held-out digit


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:
    model = tmp_path_factory.mktemp("model") / "digits-images"
    assert cli_main(["import", str(ONNX_FILE), str(model), "--resize", "8", "--mean", "0",
                     "--std", str(DIGIT_SCALE)]) == 0  # fmt: skip
    env = {"model": str(model), "max_batch_size": MAX_ROWS, "grpc_port": GRPC_PORT, "dtype": "float32"}
    with running_servers({"s": ("unfused", env)}, tmp_path_factory.mktemp("e2e-images-logs"), timeout_s=300) as s:
        yield s["s"].url


@pytest.fixture(scope="module")
def digits(server):
    """(the held-out digits as the model now takes tensors: pixels 0..255 (N, 1, 8, 8) float, their raw 0..16 times
    255 / 16, unrounded; their 8x8 gray images (rounded to uint8); the tensor path's top-1 for the pixels), and the
    top-1 is the shipped model's on the raw digits (the normalization divides the scale back out)."""
    raw, images, _ = digit_images(N)
    rows = raw * DIGIT_SCALE
    top1 = []
    for at in range(0, N, MAX_ROWS):
        top1 += _ok(httpx.post(f"{server}/predict", json={"inputs": rows[at : at + MAX_ROWS].tolist()},
                               timeout=TIMEOUT))["predictions"]  # fmt: skip
    return rows, images, top1


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, f"{r.status_code} {r.text[:500]}"
    return r.json()


def _files(images: list[np.ndarray], fmt: str, **options) -> list[tuple[str, tuple[str, bytes, str]]]:
    mime = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}[fmt]
    return [("file", (f"{i}.{fmt.lower()}", encode(im, fmt, **options), mime)) for i, im in enumerate(images)]


def _batch_rows(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "fusedserve_batch_rows_count")  # fmt: skip


def test_model_and_metadata_say_it_takes_images(server):
    info = httpx.get(f"{server}/model", timeout=TIMEOUT).json()
    want = {"formats": ["jpeg", "png", "webp"], "resize": 8, "interpolation": "bilinear", "crop": [8, 8],
            "channels": "L", "normalize": {"mean": [0.0], "std": [DIGIT_SCALE]}}  # fmt: skip
    assert info["image"] == want
    meta = httpx.get(f"{server}/v2/models/digits-images", timeout=TIMEOUT).json()
    assert meta["parameters"]["image"]["datatype"] == "BYTES" and meta["parameters"]["image"]["resize"] == 8
    assert len(meta["inputs"]) == 1  # still one input: perf_analyzer fills every listed one
    config = tgrpc.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}").get_model_config("digits-images", as_json=True)
    assert orjson.loads(config["config"]["parameters"]["image_preprocess"]["string_value"]) == want


@pytest.mark.parametrize(("fmt", "options"), [("PNG", {}), ("JPEG", {"quality": 95})], ids=["png", "jpeg"])
def test_every_digit_as_multipart_files_keeps_its_top1(server, digits, fmt, options):
    _, images, top1 = digits
    got = []
    for at in range(0, N, MAX_ROWS):
        files = _files(images[at : at + MAX_ROWS], fmt, **options)
        got += _ok(httpx.post(f"{server}/predict", files=files, timeout=TIMEOUT))["predictions"]
    assert got == top1


def test_base64_instances_and_image_bodies_keep_their_top1(server, digits):
    _, images, top1 = digits
    instances = [{"b64": base64.b64encode(encode(im, "JPEG", quality=95)).decode()} for im in images[:MAX_ROWS]]
    assert _ok(httpx.post(f"{server}/predict", json={"instances": instances}, timeout=TIMEOUT))["predictions"] == (
        top1[:MAX_ROWS])  # fmt: skip
    named = [{"image_bytes": {"b64": base64.urlsafe_b64encode(encode(im, "PNG")).decode()}} for im in images[:5]]
    assert _ok(httpx.post(f"{server}/predict", json={"instances": named}, timeout=TIMEOUT))["predictions"] == top1[:5]
    for i, (fmt, mime, options) in enumerate([("PNG", "image/png", {}), ("JPEG", "image/jpeg", {"quality": 95}),
                                              ("WEBP", "image/webp", {"lossless": True})]):  # fmt: skip
        r = httpx.post(f"{server}/predict", content=encode(images[i], fmt, **options),
                       headers={"content-type": mime}, timeout=TIMEOUT)  # fmt: skip
        assert _ok(r)["predictions"] == [top1[i]], fmt


def test_a_larger_image_is_resized_as_the_reference_resizes(server, digits):
    """32x32 digits (each pixel repeated 4x4): the server resizes them to 8x8 itself; the tensor path fed the test's
    reference resize of the same images (float64, rounded) gives the same top-1, and logits within what one pixel
    rounded one level the other way moves them (under 1% of pixels may: test_images_preprocess; 0.003 seen)."""
    _, big, _ = digit_images(64, upscale=4)
    got = _ok(httpx.post(f"{server}/predict", files=_files(big, "PNG"), timeout=TIMEOUT))
    small = np.stack([reference_resize(im[None], 8) for im in big]).astype(np.float64)
    want = _ok(httpx.post(f"{server}/predict", json={"inputs": small.tolist()}, timeout=TIMEOUT))
    assert got["predictions"] == want["predictions"]
    np.testing.assert_allclose(got["outputs"], want["outputs"], rtol=0, atol=0.02)


def test_open_inference_protocol_bytes_tensors(server, digits):
    """As Triton's image clients send them: one BYTES tensor, an encoded file per element, shape [N] or [N, 1]."""
    _, images, top1 = digits
    n = 40
    files = np.array([encode(im, "PNG") for im in images[:n]], dtype=np.object_)
    client = thttp.InferenceServerClient(server.removeprefix("http://"))
    inp = thttp.InferInput("image", [n], "BYTES")
    inp.set_data_from_numpy(files, binary_data=True)
    result = client.infer("digits-images", [inp], outputs=[thttp.InferRequestedOutput("label", binary_data=True)])
    assert [v.decode() for v in result.as_numpy("label")] == top1[:n]
    ginp = tgrpc.InferInput("input", [n, 1], "BYTES")
    ginp.set_data_from_numpy(files.reshape(n, 1))
    gresult = tgrpc.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}").infer("digits-images", [ginp])
    assert [v.decode() for v in gresult.as_numpy("label")] == top1[:n]
    doc = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [n],
                       "data": [base64.b64encode(f).decode() for f in files]}]}  # fmt: skip
    r = httpx.post(f"{server}/v2/models/digits-images/infer", json=doc, timeout=TIMEOUT)
    assert next(o for o in _ok(r)["outputs"] if o["name"] == "label")["data"] == top1[:n]


def _bad_images() -> list[tuple[str, bytes, int, str]]:
    digit = digit_images(1, upscale=4)[1][0]
    return [
        ("truncated jpeg", truncated(encode(digit, "JPEG", quality=90)), 422, "not a valid JPEG file"),
        ("corrupt png", encode(digit, "PNG")[:40] + bytes(60), 422, "not a valid PNG file"),
        ("zero bytes", b"", 422, "is empty (0 bytes)"),
        ("not an image", b"hello, world", 422, "is not a JPEG, PNG or WebP file"),
        ("bomb", png_bomb(), 413, "30000x30000 (900,000,000 pixels); at most 50,000,000"),
    ]


def test_bad_images_are_refused_before_a_batch_naming_the_problem(server, digits):
    before = _batch_rows(server)
    good = encode(digits[1][0], "PNG")
    for what, data, status, message in _bad_images():
        files = [("file", ("good.png", good, "image/png")), ("file", ("bad.bin", data, "image/png"))]
        r = httpx.post(f"{server}/predict", files=files, timeout=TIMEOUT)
        assert r.status_code == status and message in r.json()["detail"], (what, r.text)
        assert "part 2 ('bad.bin')" in r.json()["detail"], (what, r.text)
        b64 = {"instances": [{"b64": base64.b64encode(data).decode()}]}
        r = httpx.post(f"{server}/predict", json=b64, timeout=TIMEOUT)
        assert r.status_code == status and "instances[0]" in r.json()["detail"], (what, r.text)
    r = httpx.post(f"{server}/predict", json={"instances": [{"b64": "not base64!"}]}, timeout=TIMEOUT)
    assert r.status_code == 422 and "instances[0] is not valid base64" in r.json()["detail"]
    assert _batch_rows(server) == before


@pytest.mark.parametrize("kind", ["cmyk jpeg", "palette png", "16-bit png", "rgb webp"])
def test_awkward_but_valid_images_are_converted(server, kind):
    rng = np.random.default_rng()
    data = {
        "cmyk jpeg": lambda: cmyk_jpeg(rng)[0],
        "palette png": lambda: palette_png(rng)[0],
        "16-bit png": lambda: png16(rng)[0],
        "rgb webp": lambda: encode(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8), "WEBP"),
    }[kind]()
    r = httpx.post(f"{server}/predict", files=[("file", ("x", data, "application/octet-stream"))], timeout=TIMEOUT)
    assert _ok(r)["predictions"][0] in [str(d) for d in range(10)]


def test_bad_images_never_harm_the_requests_beside_them(server, digits):
    rows, images, top1 = digits
    bad = [data for _, data, _, _ in _bad_images()]

    def good(i: int) -> list:
        files = _files(images[i * 8 : i * 8 + 8], "PNG")
        return _ok(httpx.post(f"{server}/predict", files=files, timeout=TIMEOUT))["predictions"]

    def hostile(i: int) -> int:
        data = bad[i % len(bad)]
        return httpx.post(f"{server}/predict", content=data, headers={"content-type": "image/png"},
                          timeout=TIMEOUT).status_code  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good, i) for i in range(12)]
        bads = [pool.submit(hostile, i) for i in range(20)]
        assert all(400 <= f.result() < 500 for f in bads)
        assert [p for f in goods for p in f.result()] == top1[: 12 * 8]


# ------------------------------------------------------------------------ HTTP content types and codings (issue 51)


def test_content_type_is_checked(server, digits):
    rows = {"inputs": digits[0][:2].tolist()}
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "image/gif"):
        r = httpx.post(f"{server}/predict", content=orjson.dumps(rows), headers={"content-type": ctype},
                       timeout=TIMEOUT)  # fmt: skip
        assert r.status_code == 415, r.text
        assert "send application/json, image/jpeg, image/png, image/webp or multipart/form-data" in r.json()["detail"]
    for ctype in (None, "application/json; charset=utf-8"):
        headers = {"content-type": ctype} if ctype else {}
        r = httpx.post(f"{server}/predict", content=orjson.dumps(rows), headers=headers, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
    r = httpx.post(f"{server}/v2/models/digits-images/infer", content=b"{}", headers={"content-type": "text/csv"},
                   timeout=TIMEOUT)  # fmt: skip
    assert r.status_code == 415 and "application/octet-stream" in r.json()["error"]


def test_gzip_and_deflate_bodies_are_decoded(server, digits):
    rows, _, top1 = digits
    body = orjson.dumps({"inputs": rows[:MAX_ROWS].tolist()})
    # HTTP's deflate is the zlib format; some clients send raw deflate under that name, taken too
    for coding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)),
                           ("deflate", _raw_deflate(body))):  # fmt: skip
        r = httpx.post(f"{server}/predict", content=packed, timeout=TIMEOUT,
                       headers={"content-type": "application/json", "content-encoding": coding})  # fmt: skip
        assert _ok(r)["predictions"] == top1[:MAX_ROWS], coding
    r = httpx.post(f"{server}/predict", content=body, timeout=TIMEOUT, headers={"content-encoding": "br"})
    assert r.status_code == 415 and "Content-Encoding 'br' is not supported" in r.json()["detail"]
    r = httpx.post(f"{server}/predict", content=gzip.compress(body)[:-20], timeout=TIMEOUT,
                   headers={"content-encoding": "gzip"})  # fmt: skip
    assert r.status_code == 400 and "truncated" in r.json()["detail"]


def _raw_deflate(body: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    return c.compress(body) + c.flush()


def test_a_zip_bomb_stops_at_the_limit(server):
    limit = MAX_ROWS * 64 * 32 + 4096  # the body limit of this model's rows (state.body_limit)
    limit = max(limit, 32 << 20)  # an image model's is at least FUSEDSERVE_MAX_IMAGE_BODY_BYTES
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join(c.compress(bytes(1 << 20)) for _ in range(64)) + c.flush()
    assert len(bomb) < 200_000  # 64 MiB of zeros
    r = httpx.post(f"{server}/predict", content=bomb, timeout=TIMEOUT, headers={"content-encoding": "gzip"})
    assert r.status_code == 413 and f"decodes (gzip) to more than {limit} bytes" in r.json()["detail"], r.text


def test_large_answers_are_gzipped_for_clients_that_accept_it(server, digits):
    rows, _, top1 = digits
    body = {"inputs": rows[:MAX_ROWS].tolist()}
    with httpx.Client(timeout=TIMEOUT) as client:  # httpx sends Accept-Encoding: gzip, deflate and decodes
        r = client.post(f"{server}/predict", json=body)
        assert r.headers["content-encoding"] == "gzip" and r.headers["vary"] == "accept-encoding"
        assert int(r.headers["content-length"]) < len(r.content) / 2 and r.json()["predictions"] == top1[:MAX_ROWS]
        plain = client.post(f"{server}/predict", json=body, headers={"accept-encoding": "identity"})
        assert "content-encoding" not in plain.headers and plain.json() == r.json()
        small = client.post(f"{server}/predict", json={"inputs": rows[:1].tolist()})
        assert "content-encoding" not in small.headers  # under 16 KiB: one round trip either way
    client = thttp.InferenceServerClient(server.removeprefix("http://"))
    inp = thttp.InferInput("input", [MAX_ROWS, 1, 8, 8], "FP32")
    inp.set_data_from_numpy(rows[:MAX_ROWS], binary_data=False)
    result = client.infer("digits-images", [inp], request_compression_algorithm="gzip",
                          response_compression_algorithm="gzip")  # fmt: skip
    assert [v.decode() for v in result.as_numpy("label")] == top1[:MAX_ROWS]
