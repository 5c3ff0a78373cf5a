"""A model whose input is uint8 (or float) pixels with a per-channel mean and std: where the planner puts the
normalization (in the stem conv, or a `normalize_0` step first), what /model's plan says of it, and both executors
against a float64 reference of the normalized model.

The reference normalizes in float64, rounds that once to the compute dtype (what the fused conv multiplies, and what
the unfused mode's (x.float() - mean) / std gives in it) and runs the model in float64 from there
(test_executors.reference_forward), so a normalization lost, applied twice, or applied to the padding shows up.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.model.describe import describe_plan
from service.model.executors import Executor, torch_parts
from service.model.loader import load_model
from service.model.planner import Conv2dStep, NormalizeStep, fused_steps, kernel_names
from tests.modelgen import IMAGENET_MEAN, IMAGENET_STD, STEM_CNN, write_pixel_model
from tests.test_executors import _exact_float32_convs, reference_forward  # noqa: F401  (an autouse fixture)
from tests.tolerances import RTOL, RTOL_VS_UNFUSED, assert_close_to

pytestmark = pytest.mark.timeout(300)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the first op is not a conv: a relu reads the pixels, so the normalization runs as its own step first
RELU_FIRST = [{"op": "relu"}, *STEM_CNN]


def _pixels(batch: int, shape=(3, 16, 16), dtype=torch.uint8) -> torch.Tensor:
    x = torch.randint(0, 256, (batch, *shape), dtype=torch.uint8)
    return x if dtype == torch.uint8 else x.to(dtype) + torch.rand(batch, *shape, dtype=dtype)


def _reference(model_dir, x: torch.Tensor, dtype: torch.dtype, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    shape = (1, -1, 1, 1)
    normalized = (x.double() - torch.tensor(mean, dtype=torch.float64).reshape(shape)) / torch.tensor(
        std, dtype=torch.float64
    ).reshape(shape)
    return reference_forward(model_dir, normalized, dtype)


def _forward(model, mode: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    ex = Executor(model, mode, DEVICE, dtype)
    assert ex.input_dtype == (torch.uint8 if model.input_dtype == torch.uint8 else dtype)
    return ex.forward(x.to(DEVICE, ex.input_dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", [1, 5])
def test_uint8_stem_fused_and_unfused_against_float64(tmp_path, dtype, batch):
    model = load_model(write_pixel_model(tmp_path / "m", seed=batch))
    x = _pixels(batch)
    want = _reference(tmp_path / "m", x, dtype)
    fused, unfused = (_forward(model, mode, x, dtype) for mode in ("fused", "unfused"))
    # three kernels each round once to dtype (conv, pool, linear)
    assert_close_to(fused, want, 3 * RTOL[dtype], f"fused {dtype}")
    assert_close_to(unfused, want, 3 * RTOL_VS_UNFUSED[dtype], f"unfused {dtype}")
    assert_close_to(fused, unfused.double(), RTOL_VS_UNFUSED[dtype], f"fused vs unfused {dtype}")


@pytest.mark.parametrize("mode", ["fused", "unfused"])
@pytest.mark.parametrize("first", ["relu", "depthwise"])
def test_normalization_as_its_own_step(tmp_path, mode, first):
    """No conv kernel to normalize in (a relu reads the pixels, or a depthwise conv: torch's in both modes): a
    `normalize_0` step runs first, torch ops in both modes."""
    if first == "relu":
        d = write_pixel_model(tmp_path / "m", RELU_FIRST, seed=3)
    else:
        d = write_pixel_model(tmp_path / "m", [{"op": "conv2d", "out": 3, "kernel": 1}, *STEM_CNN], seed=3)
        _make_depthwise(d)
    model = load_model(d)
    steps = fused_steps(model.ops, model.tensors, normalize=model.normalize)
    assert isinstance(steps[0], NormalizeStep) and steps[0].name == "normalize_0"
    assert torch_parts(steps[0]) == ["normalize"]
    x = _pixels(3)
    got = _forward(model, mode, x, torch.float32)
    if first == "relu":
        assert_close_to(got, _reference(d, x, torch.float32), 4 * RTOL[torch.float32], mode)
    else:  # reference_forward has no groups: against the other mode (torch's own grouped conv in both)
        other = _forward(model, "unfused" if mode == "fused" else "fused", x, torch.float32)
        assert_close_to(got, other.double(), RTOL_VS_UNFUSED[torch.float32], mode)


def _make_depthwise(d) -> None:
    """The first conv (3 -> 3, 1x1) made depthwise: groups 3, weight (3, 1, 1, 1), in format 2."""
    config = json.loads((d / "config.json").read_text())
    config["format"] = "fusedserve-model/2"
    config["ops"][0]["groups"] = 3
    (d / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(d / "model.safetensors"))
    tensors["conv2d0.weight"] = torch.randn(3, 1, 1, 1) + 1.0
    save_file(tensors, str(d / "model.safetensors"))


def test_float_pixels_normalized_in_the_stem(tmp_path):
    """A float32 input with a normalization: the pixels arrive in the compute dtype and the conv normalizes them."""
    d = write_pixel_model(tmp_path / "m", dtype="float32", seed=5)
    model = load_model(d)
    x = _pixels(2, dtype=torch.float32)
    for mode in ("fused", "unfused"):
        got = _forward(model, mode, x, torch.float16)
        assert_close_to(got, _reference(d, x, torch.float16), 3 * RTOL_VS_UNFUSED[torch.float16], mode)


def test_uint8_without_normalization_is_cast_first(tmp_path):
    d = write_pixel_model(tmp_path / "m", mean=None, std=None, seed=6)
    model = load_model(d)
    x = _pixels(2)
    want = reference_forward(d, x.double(), torch.float32)
    for mode in ("fused", "unfused"):
        assert_close_to(_forward(model, mode, x, torch.float32), want, 3 * RTOL[torch.float32], mode)


def test_plan_names_and_description(tmp_path):
    """The stem keeps its name (the `kernel` label) and says it normalizes; a normalize step is described."""
    model = load_model(write_pixel_model(tmp_path / "m"))
    plain = load_model(write_pixel_model(tmp_path / "p", mean=None, std=None))
    steps = fused_steps(model.ops, model.tensors, normalize=model.normalize)
    # the 8x8 global pool stays its own step: the conv kernel folds windows of at most 9 elements (kernels/conv.py)
    names = ["conv2d_0_relu", "avgpool2d_0", "linear_0"]
    assert kernel_names(steps) == kernel_names(fused_steps(plain.ops, plain.tensors)) == names
    assert isinstance(steps[0], Conv2dStep) and torch_parts(steps[0]) == []
    doc = describe_plan(steps, model.tensors)
    assert doc[0]["kernel"] == "conv2d_0_relu"
    assert doc[0]["normalize"] == {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    assert "normalize" not in doc[1]

    relu_first = load_model(write_pixel_model(tmp_path / "r", RELU_FIRST))
    steps = fused_steps(relu_first.ops, relu_first.tensors, normalize=relu_first.normalize)
    doc = describe_plan(steps, relu_first.tensors)
    assert doc[0] == {"kernel": "normalize_0", "op": "normalize", "inputs": ["input"], "mean": IMAGENET_MEAN,
                      "std": IMAGENET_STD}  # fmt: skip
    assert steps[1].inputs == ("input:normalized",) and kernel_names(steps)[1:] == [
        "activation_0_relu", "conv2d_0_relu", "avgpool2d_0", "linear_0"
    ]  # fmt: skip


def test_input_read_by_two_ops_is_normalized_once(tmp_path):
    """A graph whose input feeds two convs (then added): one normalize step, both convs read its output."""
    d = write_pixel_model(tmp_path / "m", seed=8)
    config = json.loads((d / "config.json").read_text())
    conv, relu, pool, flatten, linear = config["ops"]
    config["format"] = "fusedserve-model/2"
    config["ops"] = [
        {**conv, "name": "a", "inputs": ["input"], "output": "a"},
        {**conv, "name": "b", "inputs": ["input"], "output": "b"},
        {"op": "add", "name": "s", "inputs": ["a", "b"], "output": "s"},
        {**relu, "inputs": ["s"]}, pool, flatten, linear,
    ]  # fmt: skip
    (d / "config.json").write_text(json.dumps(config))
    model = load_model(d)
    steps = fused_steps(model.ops, model.tensors, normalize=model.normalize)
    assert isinstance(steps[0], NormalizeStep)
    assert [s.inputs for s in steps[1:3]] == [("input:normalized",), ("input:normalized",)]
    x = _pixels(2)
    fused, unfused = (_forward(model, mode, x, torch.float32) for mode in ("fused", "unfused"))
    assert_close_to(fused, unfused.double(), RTOL_VS_UNFUSED[torch.float32], "fused vs unfused")


# ---- the runner: uint8 rows in, copied to the device as uint8 ----


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_runner_takes_uint8_rows(tmp_path, mode):
    from service.model.runner import ModelRunner

    d = write_pixel_model(tmp_path / "m", seed=9)
    runner = ModelRunner(load_model(d), mode, DEVICE, "float32", max_batch_size=4)
    assert runner.executor.input_dtype == torch.uint8
    x = _pixels(3)
    got = runner.run(x.numpy())
    assert_close_to(torch.from_numpy(got), _reference(d, x, torch.float32), 3 * RTOL[torch.float32], mode)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_gpu_graphs_stage_uint8_pixels(tmp_path, mode, dtype):
    """On CUDA the graphs' pinned input and static input are uint8 (a quarter of fp32's bytes cross to the GPU), and
    a replayed batch answers as the float64 reference does."""
    from service.model.runner import DTYPES as RUNNER_DTYPES
    from service.model.runner import ModelRunner

    d = write_pixel_model(tmp_path / "m", seed=10)
    runner = ModelRunner(load_model(d), mode, torch.device("cuda"), dtype, max_batch_size=8)
    runner.warmup(8)
    assert runner.graphs.host_in.dtype == torch.uint8
    x = _pixels(5)
    got = torch.from_numpy(runner.run(x.numpy()))
    rtol = 3 * (RTOL if mode == "fused" else RTOL_VS_UNFUSED)[RUNNER_DTYPES[dtype]]
    rtol = max(rtol, 5e-3) if dtype == "float32" else rtol  # TF32 convs on the GPU by torch's default
    assert_close_to(got, _reference(d, x, RUNNER_DTYPES[dtype]), rtol, f"{mode} {dtype}")
