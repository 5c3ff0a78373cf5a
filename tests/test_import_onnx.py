"""The ONNX importer (service/model/onnx_import.py) against onnxruntime on the same file: models written here as
torch modules (residual blocks with a strided 1x1 downsample, BatchNorm, ReLU6, SiLU, GELU, hard swish, a
depthwise conv, a concat, an MLP with BatchNorm1d and softmax), exported by torch's two ONNX exporters (dynamo,
which folds BatchNorm into the convs, and TorchScript without constant folding, which keeps the BatchNormalization
nodes), imported, and run by both executors. fp32: within 1e-4 relative norm error of onnxruntime, the same top-1
on at least 99.5% of the inputs (512 random inputs; the fused mode on the CPU runs Triton's interpreter, so it
gets FUSED_CPU_ROWS). Then what is refused, and how: the node's name and op type, files that are not ONNX,
several inputs, sizes other than the batch that are not fixed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from service.cli import main
from service.model.executors import Executor
from service.model.loader import load_model, load_onnx
from service.model.onnx_import import import_onnx
from service.model.planner import fused_steps, kernel_names
from service.model.spec import ModelFormatError
from tests.torch_models import MODELS, make

ort = pytest.importorskip("onnxruntime")

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("onnx_registry_once")]

ROWS = 512
FUSED_CPU_ROWS = 24
NORMWISE = 1e-4
TOP1 = 0.995
HAS_CUDA = torch.cuda.is_available()


EXPORTERS = ("dynamo", "torchscript")
# torch.onnx's dynamo exporter needs onnxscript (a test dependency); where it is missing those cases skip.
NO_ONNXSCRIPT = importlib.util.find_spec("onnxscript") is None


def export(module: nn.Module, shape, path: Path, exporter: str, opset: int | None = None) -> Path:
    """`module` as an ONNX file with a dynamic batch: by the dynamo exporter (at `opset`, default its own), or by
    TorchScript (at `opset`, default 17) without constant folding, so BatchNormalization nodes stay."""
    x = torch.randn(2, *shape)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the dynamo exporter's progress
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(module, (x,), str(path), dynamo=True, dynamic_shapes=({0: torch.export.Dim("batch")},),
                              **({"opset_version": opset} if opset else {}))  # fmt: skip
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, do_constant_folding=False, input_names=["input"],
                              opset_version=opset or 17, dynamic_axes={"input": {0: "batch"}})  # fmt: skip
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """{(model, exporter): path of its .onnx file}, made once per module."""
    out = {}
    d = tmp_path_factory.mktemp("onnx")
    for name, (_, shape) in MODELS.items():
        module = make(name)
        for exporter in EXPORTERS:
            if exporter == "dynamo" and NO_ONNXSCRIPT:
                continue
            out[name, exporter] = export(module, shape, d / f"{name}-{exporter}.onnx", exporter)
    return out


def run_ort(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def check_against_ort(got: np.ndarray, want: np.ndarray, normwise: float, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: {got.shape} != {want.shape}"
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    agree = float(np.mean(got.argmax(1) == want.argmax(1)))
    assert err <= normwise, f"{what}: relative norm error {err:.3g} > {normwise}"
    assert agree >= TOP1, f"{what}: top-1 agrees on {agree:.4f} of {len(got)} inputs < {TOP1}"


def run_fp32(model, mode: str, x: np.ndarray) -> np.ndarray:
    """The model's output for x in fp32 (no TF32 on a GPU, as onnxruntime computes), on CUDA where there is one."""
    device = torch.device("cuda" if HAS_CUDA else "cpu")
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.inference_mode():
            return Executor(model, mode, device, torch.float32).forward(torch.from_numpy(x).to(device)).cpu().numpy()
    finally:
        torch.backends.cudnn.allow_tf32 = before


# ---- imported models match onnxruntime ----


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", ["unfused", "fused"])
def test_imported_model_matches_onnxruntime(exported, name, exporter, mode):
    if (name, exporter) not in exported:
        pytest.skip("onnxscript is not installed: torch.onnx's dynamo exporter needs it")
    path = exported[name, exporter]
    model = load_onnx(path)
    rows = ROWS if (mode == "unfused" or HAS_CUDA) else FUSED_CPU_ROWS
    x = np.random.default_rng(7).standard_normal((rows, *MODELS[name][1]), dtype=np.float32)
    check_against_ort(run_fp32(model, mode, x), run_ort(path, x), NORMWISE, f"{name} ({exporter}, {mode})")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", ["unfused", "fused"])
def test_imported_model_in_half_precision_on_the_gpu(exported, name, mode, dtype):
    path = exported[name, "torchscript"]
    model = load_onnx(path)
    x = np.random.default_rng(8).standard_normal((ROWS, *MODELS[name][1]), dtype=np.float32)
    with torch.inference_mode():
        got = Executor(model, mode, torch.device("cuda"), dtype).forward(torch.from_numpy(x).cuda().to(dtype))
    got = got.float().cpu().numpy()
    want = run_ort(path, x)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err <= 1e-2, f"{name} {mode} {dtype}: relative norm error {err:.3g}"
    assert float(np.mean(got.argmax(1) == want.argmax(1))) >= 0.97, f"{name} {mode} {dtype}: top-1"


def test_batchnorm_is_kept_in_the_graph_and_folded_by_the_plan(exported):
    """TorchScript without constant folding keeps BatchNormalization nodes: the graph has batchnorm ops (the
    unfused mode runs them), and the plan folds each into the conv or linear before it."""
    model = load_onnx(exported["resnet", "torchscript"])
    assert sum(op.op == "batchnorm" for op in model.ops) == 6
    names = kernel_names(fused_steps(model.ops, model.tensors))
    assert names == [
        "conv2d_0_bn_relu", "conv2d_1_bn_relu", "conv2d_2_bn_add_relu", "conv2d_3_bn_relu", "conv2d_5_bn",
        "conv2d_4_bn_add_relu", "avgpool2d_0", "linear_0",
    ]  # fmt: skip
    mlp = load_onnx(exported["mlp-bn", "torchscript"])
    assert [op.op for op in mlp.ops] == [
        "linear", "batchnorm", "relu", "linear", "batchnorm", "gelu", "linear", "softmax",
    ]  # fmt: skip
    assert kernel_names(fused_steps(mlp.ops, mlp.tensors)) == ["mlp_0_2", "softmax_0"]


def test_patterns_become_one_activation(exported):
    """Each exporter's spelling of ReLU6 (Clip), SiLU (x * sigmoid(x)) and GELU (the erf form) is one op."""
    for exporter in [e for e in EXPORTERS if ("activations", e) in exported]:
        ops = [op.op for op in load_onnx(exported["activations", exporter]).ops]
        assert {"relu6", "silu", "gelu", "hardswish", "concat", "leaky_relu", "tanh"} <= set(ops), (exporter, ops)
        assert ops.count("conv2d") == 4, (exporter, ops)


# ---- the CLI ----


def test_import_cli_writes_a_model_directory_that_serves_the_same(exported, tmp_path, capsys):
    src = exported["resnet", "torchscript"]
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(f"class-{i}" for i in range(10)) + "\n")
    out = tmp_path / "my-resnet"
    assert main(["import", str(src), str(out), "--labels", str(labels)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}/config.json and model.safetensors" in printed
    assert "fused plan (8 kernels): conv2d_0_bn_relu," in printed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["format"] == "fusedserve-model/2" and cfg["name"] == "my-resnet"
    assert cfg["labels"] == [f"class-{i}" for i in range(10)] and cfg["source"].startswith(f"onnx: {src.name}")
    model = load_model(out)
    x = torch.randn(3, 3, 8, 8)
    with torch.inference_mode():
        a = Executor(model, "unfused", torch.device("cpu"), torch.float32).forward(x)
        b = Executor(load_onnx(src), "unfused", torch.device("cpu"), torch.float32).forward(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_check_model_and_load_take_an_onnx_file_or_a_folder_holding_one(exported, tmp_path, capsys):
    src = exported["mlp-bn", "torchscript"]
    assert main(["check-model", str(src)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mlp-bn-torchscript: input (20,) -> 5 outputs;")
    assert "source: onnx: mlp-bn-torchscript.onnx" in out
    folder = tmp_path / "brought"
    folder.mkdir()
    onnx.save(onnx.load(str(src)), str(folder / "model.onnx"))
    assert load_model(folder).name == "brought"  # the folder's name, as `serve --model brought` says it
    (folder / "other.onnx").write_bytes((folder / "model.onnx").read_bytes())
    with pytest.raises(ModelFormatError, match="no config.json and several .onnx files"):
        load_model(folder)


def test_labels_come_from_the_files_metadata(exported, tmp_path):
    proto = onnx.load(str(exported["mlp-bn", "torchscript"]))
    entry = proto.metadata_props.add()
    entry.key, entry.value = "labels", json.dumps(list("abcde"))
    path = tmp_path / "labelled.onnx"
    onnx.save(proto, str(path))
    assert load_onnx(path).spec.labels == list("abcde")
    config, _ = import_onnx(path, labels=list("vwxyz"))
    assert config["labels"] == list("vwxyz")  # --labels wins


# ---- what is refused, and how ----


def _graph_file(path: Path, nodes, inputs, outputs, inits=(), opset: int = 17) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.save(model, str(path))
    return path


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _const(name, array):
    return onnx.numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def _conv_file(path: Path, after: list, out_shape, *, pads=(1, 1, 1, 1), opset=17, inputs=None) -> Path:
    """x [N, 3, 8, 8] -> Conv 'conv' (4 channels) -> `after` nodes (reading 'c') -> 'y'."""
    w = _const("w", np.random.default_rng(0).standard_normal((4, 3, 3, 3)))
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=list(pads))
    inputs = inputs or [_vi("x", ["N", 3, 8, 8])]
    return _graph_file(path, [conv, *after], inputs, [_vi("y", out_shape)], [w], opset)


def _refused(path: Path, *needles: str) -> str:
    with pytest.raises(ModelFormatError) as info:
        load_model(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    return message


def test_unsupported_op_is_named_with_its_node_and_what_is_supported(tmp_path):
    sin = helper.make_node("Sin", ["c"], ["s"], name="my_sin")
    flat = helper.make_node("Flatten", ["s"], ["y"], name="flat")
    path = _conv_file(tmp_path / "sin.onnx", [sin, flat], ["N", 256])
    _refused(path, "node 'my_sin' (Sin): this op is not supported", "fusedserve imports ", "convolutions (Conv)",
             "normalization (BatchNormalization, LayerNormalization)", "linear layers (Gemm, MatMul)")  # fmt: skip


def test_every_unsupported_node_is_listed(tmp_path):
    a = helper.make_node("Sin", ["c"], ["s"], name="first")
    b = helper.make_node("LpNormalization", ["s"], ["t"], name="second")
    c = helper.make_node("Flatten", ["t"], ["y"])
    path = _conv_file(tmp_path / "two.onnx", [a, b, c], ["N", 256])
    _refused(path, "node 'first' (Sin); node 'second' (LpNormalization): these ops are not supported")


def test_an_unnamed_node_is_named_by_its_place_and_output(tmp_path):
    path = _conv_file(tmp_path / "u.onnx", [helper.make_node("Sin", ["c"], ["y"])], ["N", 4, 8, 8])
    _refused(path, "node #1 (output 'y') (Sin)")


@pytest.mark.parametrize("content", [b"", b"not an onnx file\n", bytes(range(256)) * 4, b"\x08\x07\x12\x03abc"])
def test_a_file_that_is_not_onnx(tmp_path, content):
    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    _refused(path, "not a valid ONNX file")


def test_a_missing_file_and_a_file_that_is_not_a_model(tmp_path):
    with pytest.raises(ModelFormatError, match=r"missing\.onnx: no such \.onnx file$"):  # a file, not a directory
        load_model(tmp_path / "missing.onnx")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 10)
    with pytest.raises(ModelFormatError, match="not a model: give a model directory or an .onnx file"):
        load_model(other)


def test_a_graph_with_two_inputs(tmp_path):
    add = helper.make_node("Add", ["a", "b"], ["y"], name="sum")
    path = _graph_file(tmp_path / "two.onnx", [add], [_vi("a", ["N", 8]), _vi("b", ["N", 8])], [_vi("y", ["N", 8])])
    _refused(path, "the graph has 2 inputs ('a', 'b'); fusedserve serves models of one input")


def test_a_graph_with_two_outputs(tmp_path):
    relu = helper.make_node("Relu", ["c"], ["y"])
    path = _conv_file(tmp_path / "o.onnx", [relu], ["N", 4, 8, 8])
    proto = onnx.load(str(path))
    proto.graph.output.append(_vi("c", ["N", 4, 8, 8]))
    onnx.save(proto, str(path))
    _refused(path, "the graph has 2 outputs ('y', 'c'); fusedserve serves models of one output")


@pytest.mark.parametrize("dims,which", [(["N", 3, "H", 8], "height ('H')"), (["N", 3, 8, "W"], "width ('W')"),
                                        (["N", "C", 8, 8], "channels ('C')")])  # fmt: skip
def test_a_dynamic_size_other_than_the_batch(tmp_path, dims, which):
    path = _conv_file(tmp_path / "dyn.onnx", [helper.make_node("Relu", ["c"], ["y"])], ["N", 4, "H", "W"],
                      inputs=[_vi("x", dims)])  # fmt: skip
    _refused(path, f"input 'x' has shape {dims}: its {which} is not fixed", "a dynamic batch dimension is fine")


def test_a_fixed_batch_is_fine(tmp_path):
    flat = helper.make_node("Flatten", ["c"], ["y"])
    path = _conv_file(tmp_path / "b1.onnx", [flat], [1, 256], inputs=[_vi("x", [1, 3, 8, 8])])
    assert load_model(path).input_shape == (3, 8, 8)


def test_an_opset_before_13(tmp_path):
    path = _conv_file(tmp_path / "old.onnx", [helper.make_node("Flatten", ["c"], ["y"])], ["N", 256], opset=12)
    _refused(path, "opset 12; fusedserve imports ONNX opset 13 and later")


def test_an_integer_input(tmp_path):
    cast = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)
    path = _graph_file(tmp_path / "u8.onnx", [cast], [_vi("x", ["N", 64], TensorProto.UINT8)], [_vi("y", ["N", 64])])
    _refused(path, "input 'x' is uint8; fusedserve imports models whose input is floating point")


@pytest.mark.parametrize(
    "after,shape,needles",
    [
        ([helper.make_node("Clip", ["c", "lo", "lo2"], ["y"], name="clip")], ["N", 4, 8, 8],
         ["node 'clip' (Clip): its max has shape (2,); fusedserve clips by one value"]),
        ([helper.make_node("Softmax", ["c"], ["s"], name="sm", axis=1), helper.make_node("Flatten", ["s"], ["y"])],
         ["N", 256], ["node 'sm' (Softmax)"]),
        ([helper.make_node("MatMul", ["c", "c"], ["y"], name="scores")], ["N", 4, 8, 8],
         ["node 'scores' (MatMul): multiplies two tensors computed from the input, 'c' (N, 4, 8, 8) by 'c' "
          "(N, 4, 8, 8) (as attention does); fusedserve takes a MatMul of a tensor by a constant weight"]),
        ([helper.make_node("Transpose", ["c"], ["t"], perm=[0, 2, 3, 1]),
          helper.make_node("Mul", ["c", "t"], ["y"], name="mixed")], ["N", 4, 8, 8],
         ["node 'mixed' (Mul): multiplies 'c' (N, 4, 8, 8) by 't' (N, 8, 8, 4) (channels-last): one is a "
          "channels-last transpose and the other is not"]),
        ([helper.make_node("Flatten", ["c"], ["y"], name="f0", axis=2)], ["N", 4, 64],
         ["node 'f0' (Flatten): axis 2: only Flatten(axis=1)"]),
        ([helper.make_node("Concat", ["c", "c"], ["y"], name="cat", axis=2)], ["N", 4, 16, 8],
         ["node 'cat' (Concat): axis 2 of rank-4 tensors: only concat along channels"]),
    ],
    ids=["clip", "softmax-inside", "two-tensor-matmul", "mixed-layouts", "flatten-axis", "concat-axis"],
)  # fmt: skip
def test_node_attributes_that_cannot_be_served(tmp_path, after, shape, needles):
    path = _conv_file(tmp_path / "a.onnx", after, shape)
    proto = onnx.load(str(path))
    proto.graph.initializer.extend([_const("lo", -1.0), _const("lo2", [-1.0, 1.0])])
    onnx.save(proto, str(path))
    _refused(path, *needles)


def test_uneven_padding_becomes_a_pad_op(tmp_path):
    """A conv's padding that differs between the sides of an axis (TensorFlow's SAME): the even part stays the
    conv's, the rest is a `pad` op before it."""
    after = [helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Flatten", ["r"], ["y"])]
    path = _conv_file(tmp_path / "p.onnx", after, ["N", 196], pads=(0, 0, 1, 1))
    model = load_model(path)
    assert [op.op for op in model.ops] == ["pad", "conv2d", "relu", "flatten"]
    assert model.ops[0].pads == (0, 0, 1, 1) and model.ops[1].padding == (0, 0)
    x = np.random.default_rng(3).standard_normal((5, 3, 8, 8), dtype=np.float32)
    for mode in ("unfused", "fused"):
        check_against_ort(run_fp32(model, mode, x), run_ort(path, x), NORMWISE, mode)


def test_broadcasting_add_of_two_tensors(tmp_path):
    """(N, 4, 8, 8) + (N, 4, 1, 1) broadcasts (an SE block's shapes); (N, 4, 8, 1) + (N, 4, 1, 8) would grow both
    and is refused with both shapes."""
    pool = helper.make_node("GlobalAveragePool", ["c"], ["g"])
    add = helper.make_node("Add", ["c", "g"], ["s"], name="bcast")
    path = _conv_file(tmp_path / "b.onnx", [pool, add, helper.make_node("Flatten", ["s"], ["y"])], ["N", 256])
    model = load_model(path)
    assert [op.op for op in model.ops] == ["conv2d", "avgpool2d", "add", "flatten"]
    x = np.random.default_rng(4).standard_normal((5, 3, 8, 8), dtype=np.float32)
    check_against_ort(run_fp32(model, "unfused", x), run_ort(path, x), NORMWISE, "broadcast add")
    rows = helper.make_node("MaxPool", ["c"], ["h"], kernel_shape=[1, 8])
    cols = helper.make_node("MaxPool", ["c"], ["v"], kernel_shape=[8, 1])
    add = helper.make_node("Add", ["h", "v"], ["y"], name="outer")
    path = _conv_file(tmp_path / "o.onnx", [rows, cols, add], ["N", 4, 8, 8])
    _refused(path, "node 'outer' (Add): adds 'h' (N, 4, 8, 1) to 'v' (N, 4, 1, 8): fusedserve takes tensors of one "
             "shape, or shapes of which one broadcasts to the other")  # fmt: skip


def test_import_cli_declares_uint8_pixels_and_their_normalization(exported, tmp_path, capsys):
    """--input-dtype uint8 --mean --std: the config says so, and the model served on uint8 pixels is the imported
    graph on (x - mean) / std."""
    src = exported["resnet", "torchscript"]
    out = tmp_path / "pixels"
    mean, std = "123.675,116.28,103.53", "58.395,57.12,57.375"
    assert main(["import", str(src), str(out), "--input-dtype", "uint8", "--mean", mean, "--std", std]) == 0
    assert "input (3, 8, 8) uint8 -> 10 outputs" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    stats = {"mean": [123.675, 116.28, 103.53], "std": [58.395, 57.12, 57.375]}
    assert cfg["input"]["dtype"] == "uint8" and cfg["input"]["normalize"] == stats
    x = torch.randint(0, 256, (3, 3, 8, 8), dtype=torch.uint8)
    normalized = (x.float() - torch.tensor(stats["mean"]).reshape(1, 3, 1, 1)) / torch.tensor(stats["std"]).reshape(
        1, 3, 1, 1
    )
    with torch.inference_mode():
        a = Executor(load_model(out), "unfused", torch.device("cpu"), torch.float32).forward(x)
        b = Executor(load_onnx(src), "unfused", torch.device("cpu"), torch.float32).forward(normalized)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--mean", "1,2,3"], "cannot import: input.normalize: give both mean and std"),
        (["--mean", "1,2", "--std", "1,2"], "input.normalize: 2 mean and std values but the input has 3 channels"),
        (["--mean", "1,2,3", "--std", "1,0,2"], r"input.normalize: std\[1\] is 0.0; each std must be > 0"),
    ],
    ids=["mean-alone", "count", "std-zero"],
)
def test_import_cli_refuses_a_bad_normalization(exported, tmp_path, capsys, args, message):
    out = tmp_path / "bad"
    assert main(["import", str(exported["resnet", "torchscript"]), str(out), *args]) == 1
    assert re.search(message, capsys.readouterr().err) and not out.exists()


def test_import_cli_refuses_what_is_not_numbers(exported, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["import", str(exported["resnet", "torchscript"]), str(tmp_path / "o"), "--mean", "a,b,c"])
    assert "expected comma-separated numbers (123.675,116.28,103.53); got 'a,b,c'" in capsys.readouterr().err


def test_check_model_cli_refuses_with_the_node(tmp_path, capsys):
    path = _conv_file(tmp_path / "sin.onnx", [helper.make_node("Sin", ["c"], ["y"], name="odd")], ["N", 4, 8, 8])
    assert main(["check-model", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("invalid model: ") and "node 'odd' (Sin)" in err
    assert main(["import", str(path), str(tmp_path / "out")]) == 1
    assert "cannot import: " in capsys.readouterr().err and not (tmp_path / "out").exists()
