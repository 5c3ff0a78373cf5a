"""bench/serve/issue52.py (float8 served against float16, and the live A/B of the two) and bench serve's --dtype float8:
the speed-up per form only from phases that answered every request, the shadow's counters read from a metrics page,
the paced load against a real HTTP server on loopback, and float8 refused where it cannot run, naming why."""

from __future__ import annotations

import argparse
import http.server
import threading

import pytest

from bench.serve import cli as serve_cli
from bench.serve import issue52


def _row(dtype: str, form: str, images_per_s: float, ok: bool = True) -> dict:
    return {"model": "resnet50", "dtype": dtype, "form": form, "images_per_s": images_per_s, "ok": ok,
            "p50_ms": 90.0, "p99_ms": 140.0, "gpu_busy": 80.0, "forward_us": 8000.0, "images_per_batch": 250.0,
            "lost": 0}  # fmt: skip


def test_speedups_pair_each_float8_row_with_its_float16_row():
    rows = [_row("float16", "UINT8", 19_000.0), _row("float8", "UINT8", 26_600.0),
            _row("float16", "JPEG", 15_000.0), _row("float8", "JPEG", 16_500.0)]  # fmt: skip
    got = {s["form"]: s for s in issue52.speedups(rows)}
    assert got["UINT8"]["ratio"] == pytest.approx(1.4) and got["UINT8"]["met"] is True
    assert got["JPEG"]["ratio"] == pytest.approx(1.1) and got["JPEG"]["met"] is False


def test_a_phase_answered_with_refusals_gives_no_ratio():
    rows = [_row("float16", "UINT8", 19_000.0), _row("float8", "UINT8", 400_000.0, ok=False)]
    (only,) = issue52.speedups(rows)
    assert only["ratio"] is None and only["met"] is False
    text = issue52.markdown({"gpu": "NVIDIA H200", "when": "now", "commit": "abc1234", "command": "x", "wall_s": 1.0,
                             "missing": []}, rows, [only], [])  # fmt: skip
    assert "| ResNet-50 | UINT8 | 19,000 | 400,000 | - | no |" in text


def test_the_shadows_counters_are_summed_over_label_sets():
    page = "\n".join([
        "# HELP fusedserve_shadow_rows_total Rows of the shadow's compared batches",
        'fusedserve_shadow_rows_total{model="resnet50",engine="0",a="fused:float8",b="fused:float16"} 96.0',
        'fusedserve_shadow_rows_total{model="resnet50",engine="1",a="fused:float8",b="fused:float16"} 64.0',
        'fusedserve_shadow_rows_total_created{model="resnet50"} 1.7e9',
        "fusedserve_shadow_argmax_mismatch_total 1.0",
    ])  # fmt: skip
    assert issue52._metric_sum(page, "fusedserve_shadow_rows_total") == 160.0
    assert issue52._metric_sum(page, "fusedserve_shadow_argmax_mismatch_total") == 1.0
    assert issue52._metric_sum(page, "fusedserve_shadow_batches_total") == 0.0


def _page(batches: float, rows: float, mismatched: float, buckets: dict[str, float]) -> str:
    labels = 'model="resnet50",engine="0",a="fused:float8",b="fused:float16"'
    lines = [f"fusedserve_shadow_batches_total{{{labels}}} {batches}",
             f"fusedserve_shadow_rows_total{{{labels}}} {rows}",
             f"fusedserve_shadow_argmax_mismatch_total{{{labels}}} {mismatched}"]  # fmt: skip
    lines += [f'fusedserve_shadow_error_bucket{{{labels},le="{le}"}} {n}' for le, n in buckets.items()]
    return "\n".join(lines)


def test_each_loads_shadow_numbers_are_the_counters_difference():
    before = issue52.shadow_counters(_page(10, 320, 32, {"0.01": 2, "0.1": 9, "0.316": 10, "+Inf": 10}))
    after = issue52.shadow_counters(_page(30, 960, 32 + 64, {"0.01": 2, "0.1": 12, "0.316": 30, "+Inf": 30}))
    phase = issue52.shadow_phase(before, after)
    assert phase["shadow_batches"] == 20 and phase["shadow_rows"] == 640 and phase["shadow_mismatched_rows"] == 64
    assert phase["top1_agreement"] == pytest.approx(0.9)
    assert phase["error_median_below"] == pytest.approx(0.316)  # 3 of the 20 new batches below 0.1, 20 below 0.316
    idle = issue52.shadow_phase(after, after)
    assert idle["top1_agreement"] is None and idle["error_median_below"] is None
    row = {"model": "resnet50", "rate": 100.0, "seconds": 20.0, "report": "ab.md",
           "loads": [{"load": "photos", "statuses": {200: 2000}, **phase}]}  # fmt: skip
    text = issue52.markdown({"gpu": "NVIDIA H200", "when": "now", "commit": "abc1234", "command": "x", "wall_s": 1.0,
                             "missing": []}, [], [], [row])  # fmt: skip
    assert "| ResNet-50 | photos | 100.0 x 20.0 | {200: 2000} | 20 | 640 | 90.00% | <= 0.316 | ab.md |" in text


def test_the_photos_load_sends_jpeg_files_as_bytes_tensors():
    bodies, header = issue52.load_bodies("photos")
    head_len = int(header.decode().split(": ")[1])
    head = bodies[0][:head_len].decode()
    assert '"datatype":"BYTES"' in head and f'"shape":[{issue52.IMAGES}]' in head
    assert bodies[0][head_len + 4 : head_len + 7] == b"\xff\xd8\xff"  # each file after its 4-byte length: a JPEG
    with pytest.raises(ValueError, match="one of photos, noise"):
        issue52.load_bodies("cats")


def test_the_digits_load_sends_every_held_out_digit_as_fp32_rows():
    import numpy as np

    from tests.digits import held_out_split

    bodies, header = issue52.load_bodies("held-out digits")
    head_len = int(header.decode().split(": ")[1])
    head = bodies[0][:head_len].decode()
    assert '"datatype":"FP32"' in head and f'"shape":[{issue52.IMAGES},1,8,8]' in head
    rows = np.concatenate([np.frombuffer(b[head_len:], dtype=np.float32).reshape(-1, 64) for b in bodies])
    X, _ = held_out_split()
    assert len(bodies) == -(-len(X) // issue52.IMAGES) and len(rows) == len(bodies) * issue52.IMAGES
    np.testing.assert_array_equal(rows[: len(X)], X.astype(np.float32))  # all 360, in order, then the first again
    np.testing.assert_array_equal(rows[len(X) :], X[: len(rows) - len(X)].astype(np.float32))


def test_the_paced_load_sends_binary_v2_requests_at_its_rate():
    seen: list[tuple[str, str, int]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            n = int(self.headers["Content-Length"])
            body = self.rfile.read(n)
            seen.append((self.path, self.headers["Inference-Header-Content-Length"], len(body)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        counts = issue52.paced_load(server.server_address[1], "resnet50", rate=40.0, seconds=1.0, threads=4)
    finally:
        server.shutdown()
    assert counts == {200: len(seen)} and 32 <= len(seen) <= 44, (counts, len(seen))
    path, head_len, size = seen[0]
    assert path == "/v2/models/resnet50/infer" and size == int(head_len) + 32 * 3 * 224 * 224


def _args(tmp_path, *more: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return parser.parse_args(["--model", "digits-mlp", "--out", str(tmp_path), *more])


def test_bench_serve_refuses_float8_for_systems_without_it(tmp_path):
    with pytest.raises(SystemExit, match="float8 runs fusedserve's systems only; eager cannot"):
        serve_cli.resolve(_args(tmp_path, "--dtype", "float8", "--systems", "fused@1,eager@1"))


def test_bench_serve_refuses_float8_for_a_model_without_calibration(tmp_path):
    with pytest.raises(SystemExit, match=r"has no calibration.json; run `fusedserve calibrate .* --samples DIR` first"):
        serve_cli.resolve(_args(tmp_path, "--dtype", "float8", "--systems", "fused@1"))
