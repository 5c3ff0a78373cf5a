"""The compile deadline with real Triton compiles (kernels/compile_deadline.py): on a GPU, with an empty Triton cache
and a deadline shorter than any compile, every fused step runs its unfused op, answers as the unfused executor does,
and the real service still becomes ready, naming those steps in GET /model and counting them in its metrics."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from kernels import compile_deadline, tuning
from service.model.executors import Executor
from service.model.loader import load_model
from tests.modelgen import write_cnn_model

pytestmark = pytest.mark.gpu

# Odd widths and planes that no other test compiles, so this process's kernels meet new programs.
LAYERS = [
    {"op": "conv2d", "out": 13, "kernel": 3, "padding": 1}, {"op": "relu"},
    {"op": "conv2d", "out": 11, "kernel": 3, "stride": 2, "padding": 1}, {"op": "relu"},
    {"op": "avgpool2d", "kernel_size": 3, "stride": 2}, {"op": "flatten"}, {"op": "linear", "out": 9},
]  # fmt: skip


@pytest.fixture
def empty_triton_cache(tmp_path, monkeypatch):
    import triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    if hasattr(triton, "knobs"):
        monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "triton-cache"), raising=False)
    return tmp_path / "triton-cache"


def test_every_step_late_runs_unfused_and_matches(tmp_path, empty_triton_cache):
    model = load_model(write_cnn_model(tmp_path / "cnn", [5, 29, 31], LAYERS, seed=4))
    device = torch.device("cuda")
    x = torch.randn(3, *model.input_shape, device=device, generator=torch.Generator(device).manual_seed(2))
    expected = Executor(model, "unfused", device, torch.float16).forward(x.half()).float()
    tuning_was = tuning.enabled()
    tuning.set_enabled(False)
    compile_deadline.set_deadline(0.001)  # no real compile is that quick
    try:
        fused = Executor(model, "fused", device, torch.float16)
        y = fused.warm_forward(x.half()).float()
    finally:
        compile_deadline._deadline.clear()
        tuning.set_enabled(tuning_was)
    kernel_steps = [s.name for s in fused.steps if type(s).__name__ in ("Conv2dStep", "LinearStep", "Pool2dStep")]
    assert kernel_steps and set(kernel_steps) <= set(fused.fallbacks), (kernel_steps, fused.fallbacks)
    np.testing.assert_allclose(y.cpu().numpy(), expected.cpu().numpy(), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(fused.forward(x.half()).float().cpu().numpy(), expected.cpu().numpy(), rtol=1e-2,
                               atol=1e-2)  # fmt: skip


@pytest.mark.timeout(300)
def test_the_service_becomes_ready_with_every_compile_late(tmp_path, empty_triton_cache):
    from tests.server import Server, dump_new_logs

    model_dir = write_cnn_model(tmp_path / "cnn", [5, 23, 37], LAYERS, seed=6)
    server = Server("fused", tmp_path, {"model": str(model_dir), "engines": 1, "workers": 1, "max_batch_size": 8,
                                        "compile_deadline_s": 0.001, "tuning": "false"})  # fmt: skip
    # TRITON_CACHE_DIR (the fixture's) reaches the service through the environment it inherits.
    server.start()
    try:
        server.wait_ready(240)
        with httpx.Client(timeout=10) as client:
            plan = client.get(server.url + "/model").json()["plan"]
            fell_back = {e["kernel"]: e["unfused_fallback"] for e in plan if "unfused_fallback" in e}
            assert fell_back and all("more than 0.001 s" in why for why in fell_back.values()), plan
            x = np.random.default_rng(1).standard_normal((2, 5, 23, 37)).astype(np.float32)
            r = client.post(server.url + "/predict", json={"inputs": x.tolist()})
            assert r.status_code == 200, r.text
            metrics = client.get(server.url + "/metrics").text
        gauge = [ln for ln in metrics.splitlines() if ln.startswith("fusedserve_steps_unfused_fallback{")]
        assert gauge and float(gauge[0].split()[-1]) == len(fell_back), gauge
        late = [ln for ln in metrics.splitlines() if ln.startswith("fusedserve_kernel_compiles_late_total{")]
        assert late and float(late[0].split()[-1]) >= len(fell_back), late
    finally:
        server.stop()
        dump_new_logs()
