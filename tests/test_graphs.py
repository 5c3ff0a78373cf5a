"""CUDA-graph replay per batch bucket gives exactly what launching each step gives, for every batch size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from service.model.executors import Executor
from service.model.graphs import GraphedExecutor, graph_buckets
from service.model.loader import load_model
from service.model.runner import ModelRunner
from tests.modelgen import write_cnn_model, write_model

SHIPPED = Path(__file__).resolve().parents[1] / "model_weights" / "digits-mlp"
# unfused only: cuBLAS at the padded bucket vs at the batch's own row count, same math in another order
RTOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.mark.parametrize(
    "max_batch,buckets", [(1, [1]), (2, [1, 2]), (5, [1, 2, 4, 5]), (256, [1, 2, 4, 8, 16, 32, 64, 128, 256])]
)
def test_buckets(max_batch, buckets):
    assert graph_buckets(max_batch) == buckets


def test_graphs_need_cuda():
    ex = Executor(load_model(SHIPPED), "unfused", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA executor"):
        GraphedExecutor(ex, 8)


def _models(tmp_path):
    # the shipped model (one whole-MLP kernel) and one with a wide layer, a flatten and a lone activation
    wide = write_model(
        tmp_path / "wide", [300, 2, 3, 5], ["relu", None, ["tanh", "sigmoid"]], input_shape=[6, 50],
        extra_ops=[{"op": "flatten"}],
    )  # fmt: skip
    return [load_model(SHIPPED), load_model(wide)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fused", "unfused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_replay_equals_launching_each_step(tmp_path, mode, dtype):
    for model in _models(tmp_path):
        ex = Executor(model, mode, torch.device("cuda"), dtype)
        graphs = GraphedExecutor(ex, 100)
        graphs.capture_all()
        for rows in (1, 2, 3, 17, 64, 65, 100, 7, 1):  # pad rows left by bigger batches must not leak
            x = torch.randn(rows, *model.input_shape, device="cuda").to(dtype)
            want = ex.forward(x)
            # The service stages a host batch (its H2D copy lands in the graph's input); others pass device rows.
            got = graphs.forward(x.cpu() if rows % 2 else x).clone()
            assert got.shape == want.shape
            if mode == "fused":  # our kernels take a row's result from the same config at any row count
                assert torch.equal(got, want), f"{model.name} {mode} {dtype} rows={rows}: replay differs from launches"
            else:  # cuBLAS may choose another kernel for the padded bucket (H200: fp32 at 17 vs 32 rows)
                tol = RTOL[dtype]
                torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=f"{model.name} {dtype} rows={rows}")
        with pytest.raises(ValueError, match="101 rows exceed max_batch_size 100"):
            graphs.forward(torch.randn(101, *model.input_shape, device="cuda").to(dtype))


@pytest.mark.gpu
def test_gpu_runner_replays_and_times_every_nth_batch():
    model = load_model(SHIPPED)
    kernels = []
    runner = ModelRunner(
        model, "fused", torch.device("cuda"), "float16", kernel_timing_every=3, max_batch_size=64,
        observe_kernel=lambda name, s: kernels.append((name, s)),
    )  # fmt: skip
    runner.warmup(64)
    assert sorted(runner.graphs._graphs) == sorted(runner.graphs._timed) == [1, 2, 4, 8, 16, 32, 64]

    def launched(*args):
        raise AssertionError("a timed batch launched its steps from Python instead of replaying the timed graph")

    runner._run_launched = launched
    rng = np.random.default_rng(0)
    eager = Executor(model, "fused", torch.device("cuda"), torch.float16)
    for rows in (1, 5, 33, 64, 2, 9):
        x = rng.standard_normal((rows, 64), dtype=np.float32)
        want = eager.forward(torch.from_numpy(x).cuda().half()).float().cpu().numpy()
        np.testing.assert_array_equal(runner.run(x), want)
    assert [n for n, _ in kernels] == ["mlp_0_2", "mlp_0_2"]  # batches 3 and 6, from the timed graphs of 64 and 64
    # Seconds: one kernel runs ~10 us alone, but the GPU session runs 16 test workers on one GPU, and a timed
    # launch can wait for another process's time slice (8.1 ms seen on the H200). 50 ms still rejects
    # microseconds passed as seconds.
    assert all(0 < s < 0.05 for _, s in kernels), kernels


SHIPPED_CNN = Path(__file__).resolve().parents[1] / "model_weights" / "digits-cnn"
# Relative to the batch's largest output. float32 convs run in TF32 in both modes by default
# (torch.backends.cudnn.allow_tf32, which fused_conv2d follows too): one config of ours against another only
# reorders the sum, but cuDNN may pick another algorithm (Winograd, FFT) for the padded bucket, which rounds
# differently.
CNN_RTOL = {
    "fused": {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2},
    "unfused": {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2},
}


def _cnn_models(tmp_path):
    # the shipped CNN (conv, conv, max pool, whole-MLP tail) and one with a strided, dilated conv, a padded
    # ceil-mode avg pool with an activation in it, a standalone activation and a wide linear
    odd = write_cnn_model(tmp_path / "odd-cnn", [3, 11, 9], [
        {"op": "conv2d", "out": 7, "kernel": [3, 2], "stride": 2, "padding": 1, "dilation": [1, 2]}, {"op": "gelu"},
        {"op": "avgpool2d", "kernel_size": 3, "stride": 1, "padding": 1, "ceil_mode": True,
         "count_include_pad": False}, {"op": "silu"}, {"op": "tanh"},
        {"op": "flatten"}, {"op": "linear", "out": 300}, {"op": "relu"}, {"op": "linear", "out": 5},
    ])  # fmt: skip
    return [load_model(SHIPPED_CNN), load_model(odd)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fused", "unfused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_cnn_replay_matches_launching_each_step(tmp_path, mode, dtype):
    """Conv and pool never mix images, so pad rows change no real row; a conv kernel may pick another config
    for the padded bucket than for the batch's own row count, so the comparison allows the rounding."""
    for model in _cnn_models(tmp_path):
        ex = Executor(model, mode, torch.device("cuda"), dtype)
        graphs = GraphedExecutor(ex, 64)
        graphs.capture_all()
        for rows in (1, 3, 17, 64, 33, 2, 1):  # pad rows left by bigger batches must not leak
            x = (torch.rand(rows, *model.input_shape, device="cuda") * 16).to(dtype)
            want = ex.forward(x)
            got = graphs.forward(x.cpu() if rows % 2 else x).clone()
            tol = CNN_RTOL[mode][dtype]
            torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()),
                                       msg=f"{model.name} {mode} {dtype} rows={rows}")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_gpu_cnn_runner_warms_replays_and_times_steps(mode):
    from .digits import held_out_split

    x_test, y_test = held_out_split()
    model = load_model(SHIPPED_CNN)
    kernels = []
    runner = ModelRunner(
        model, mode, torch.device("cuda"), "float16", kernel_timing_every=4, max_batch_size=64,
        observe_kernel=lambda name, s: kernels.append((name, s)),
    )  # fmt: skip
    assert runner.warmup(64) == [1, 2, 4, 8, 16, 32, 64]
    assert sorted(runner.graphs._graphs) == [1, 2, 4, 8, 16, 32, 64]
    predictions = []
    for start in range(0, 360, 45):  # 8 batches of 45 rows (bucket 64), batches 4 and 8 timed step by step
        rows = x_test[start : start + 45].reshape(-1, 1, 8, 8)
        predictions.append(runner.run(rows).argmax(axis=1))
    accuracy = float((np.concatenate(predictions) == y_test).mean())
    assert accuracy >= 0.98, f"{mode} float16 on the GPU: held-out accuracy {accuracy:.4f}"
    names = ["conv2d_0_relu", "conv2d_1_relu_maxpool2d_0", "mlp_0_1"]
    assert [n for n, _ in kernels] == names * 2
    assert all(0 < s < 0.05 for _, s in kernels), kernels


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fused", "unfused"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_runner_copies_inside_the_graph_serve_every_dtype(tmp_path, mode, dtype):
    """The runner's graphs copy the batch in and out themselves (host_io): every dtype answers as launching each
    step does, pad rows left by bigger batches do not leak, and each answer is a copy of the pinned buffer
    that the next batch overwrites."""
    dt = getattr(torch, dtype)
    for model in [*_models(tmp_path), load_model(SHIPPED_CNN)]:
        runner = ModelRunner(model, mode, torch.device("cuda"), dtype, kernel_timing_every=0, max_batch_size=64)
        runner.warmup(64)
        assert runner.graphs.host_in is not None and runner.graphs.host_in.is_pinned()
        eager = runner.executor
        rng = np.random.default_rng(1)
        answers = []
        for rows in (64, 1, 33, 5, 64, 2):  # bigger batches first: their rows stay in the pad of later ones
            x = (rng.random((rows, *model.input_shape), dtype=np.float32) * 16).astype(np.float32)
            got = runner.run(x)
            want = eager.forward(torch.from_numpy(x).cuda().to(dt)).float().cpu().numpy()
            assert got.dtype == np.float32 and got.shape == (rows, model.output_features)
            tol = RTOL[dt] if mode == "unfused" else {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}[dtype]
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()),
                                       err_msg=f"{model.name} {mode} {dtype} rows={rows}")  # fmt: skip
            answers.append((got, got.copy()))
            # The engine's way in: the rows in parts, in the wire dtype (float16 for a float16 model, cast by the
            # front ends), the outputs in it too. The same answer as run(), which casts float32 rows on the host.
            wire_rows = x.astype(runner.wire_dtype)
            parts = [wire_rows[: rows // 2], wire_rows[rows // 2 :]] if rows > 1 else [wire_rows]
            out = runner.collect(runner.launch(parts))
            assert out.dtype == runner.wire_dtype == (np.float16 if dtype == "float16" else np.float32)
            np.testing.assert_array_equal(out.astype(np.float32), got, err_msg=f"{model.name} {mode} {dtype} parts")
        for got, kept in answers:  # later batches reused the pinned buffer; earlier answers are their own memory
            np.testing.assert_array_equal(got, kept)


def test_large_batches_are_staged_in_pieces_by_several_threads_and_every_row_lands_in_place():
    """ModelRunner._copy_in_pieces (the copy into the graphs' pinned input of a batch past PARALLEL_COPY_BYTES): the
    parts one after the other, split in pieces of whole rows, every element written, nothing past the batch."""
    from types import SimpleNamespace

    from service.model import runner

    gen = np.random.default_rng(11)
    row = (3, 40, 41)  # 4,920 bytes a row in uint8: 213 rows a 1 MB piece
    parts = [gen.integers(0, 256, (n, *row), dtype=np.uint8) for n in (1, 700, 213, 5)]
    host = np.zeros((1024, *row), dtype=np.uint8)
    fake = SimpleNamespace(_copier=None)
    runner.ModelRunner._copy_in_pieces(fake, parts, host)
    assert fake._copier is not None and fake._copier._max_workers == runner.COPY_THREADS
    np.testing.assert_array_equal(host[:919], np.concatenate(parts))
    assert not host[919:].any()
    fake._copier.shutdown()
