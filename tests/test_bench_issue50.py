"""bench/serve/issue50.py's report: a phase bench serve skipped (the pil peer past its time budget, as on the H200 on
2026-11-28) is listed as not measured, and the target it feeds reads so instead of vanishing from the table."""

from __future__ import annotations

from bench.serve import issue50


def _phase(system: str, protocol: str, images_per_s: float) -> dict:
    return {"kind": "closed", "protocol": protocol, "system": system, "rows": 32, "connections": 64,
            "rows_per_s": images_per_s, "latency_ms": {"p50": 100.0, "p99": 150.0}, "request_bytes": 1000,
            "request_mb_per_s": 1.0, "lost": 0}  # fmt: skip


RESULTS = {
    "phases": [_phase("fused@8", "v2_binary", 17_000.0), _phase("fused@8", "v2_jpeg", 9_000.0)],
    "skipped": [
        {"system": "every system", "what": "JSON /predict and open-loop phases", "why": "an image model"},
        {"system": "pil@8", "what": "closed rows=32 conns=64 v2_jpeg", "why": "time budget"},
    ],
}


def test_a_skipped_image_phase_is_listed_and_its_target_reads_not_measured():
    assert issue50.skipped_of("resnet50", RESULTS) == ["ResNet-50: pil@8 closed rows=32 conns=64 v2_jpeg skipped "
                                                       "(time budget)"]  # fmt: skip
    rows = issue50.rows_of("resnet50", RESULTS)
    by_target = {t["target"]: t for t in issue50.targets(rows)}
    pil = by_target["ResNet-50: JPEG >= 3.0x the pil peer's images/s"]
    assert pil["measured"].startswith("not measured") and pil["met"] is False
    assert by_target["ResNet-50: JPEG >= 0.8x the UINT8 tensor path's images/s"]["measured"] == "0.53x"


def test_with_the_peers_rows_the_ratio_is_reported():
    results = {"phases": [*RESULTS["phases"], _phase("pil@8", "v2_jpeg", 2_000.0)], "skipped": []}
    by_target = {t["target"]: t for t in issue50.targets(issue50.rows_of("resnet50", results))}
    pil = by_target["ResNet-50: JPEG >= 3.0x the pil peer's images/s"]
    assert pil["measured"] == "4.50x" and pil["met"] is True
    assert issue50.skipped_of("resnet50", results) == []


def test_a_phase_answered_with_refusals_meets_nothing():
    """MobileNetV2's JPEG phase on the H200 on 2026-11-29: every answer a 503 at 428,914 images/s. Its rows are
    refusals' rates: the model's targets read failed, none met."""
    jpeg = _phase("fused@8", "v2_jpeg", 428_914.0) | {
        "status": {"503": 13404},
        "ok": False,
        "accounting": {"problems": ["warm-up answers other than 200"]},
    }
    results = {"phases": [_phase("fused@8", "v2_binary", 27_000.0), jpeg, _phase("pil@8", "v2_jpeg", 2_500.0)]}
    met = issue50.targets(issue50.rows_of("mobilenet_v2", results))
    assert [t["met"] for t in met] == [False]
    assert "failed" in met[0]["measured"] and "warm-up answers other than 200" in met[0]["measured"]
