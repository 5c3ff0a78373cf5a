"""What the ONNX importer refuses, and how: every node that cannot be served is named (its name or place, its op
type), with why, what would be accepted and the shapes involved; the first few and a count, not only the first
blocker; nodes that read a refused node's result are counted as not checked. Vision transformers stay refused at
their first node that cannot be served (an attention MatMul of two tensors, a patchify reshape to tokens), from
both exporters.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import nn

from .test_import_onnx import NO_ONNXSCRIPT, _const, _conv_file, _refused, export

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("onnx_registry_once")]


class AttentionCore(nn.Module):
    """softmax(q @ k) @ v of three 1x1 convs of an image (square, so the MatMuls are valid without a transpose):
    the product of two tensors computed from the input, which no op of the format computes."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        attn = torch.softmax(self.q(x) @ self.k(x) / 2.0, dim=-1)
        return self.fc((attn @ self.v(x)).mean((2, 3)))


class PatchTokens(nn.Module):
    """A ViT's start: a patchify conv, then (N, C, H, W) -> (N, H * W, C) tokens, a LayerNorm, a linear, mean."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, 4)
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 5)

    def forward(self, x):
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        return self.fc(self.norm(tokens).mean(1))


class SwinWindows(nn.Module):
    """A Swin transformer's start: a patchify conv, channels-last LayerNorm (both served), then the partition of
    the (N, H, W, C) map into 2x2 windows of tokens, which is not."""

    def __init__(self):
        super().__init__()
        self.patch, self.norm, self.fc = nn.Conv2d(3, 8, 2, 2), nn.LayerNorm(8), nn.Linear(8, 5)

    def forward(self, x):
        x = self.norm(self.patch(x).permute(0, 2, 3, 1))
        n, h, w, c = x.shape
        windows = x.view(n, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, c)
        return self.fc(windows.mean(1))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_attention_is_refused_at_its_matmul(tmp_path, exporter):
    if exporter == "dynamo" and NO_ONNXSCRIPT:
        pytest.skip("onnxscript is not installed: torch.onnx's dynamo exporter needs it")
    torch.manual_seed(0)
    path = export(AttentionCore().eval(), (3, 4, 4), tmp_path / "attention.onnx", exporter)
    message = _refused(path, " (MatMul): multiplies two tensors computed from the input, ", " (N, 4, 4, 4) by ",
                       "(as attention does); fusedserve takes a MatMul of a tensor by a constant weight",
                       "reading their results not checked")  # fmt: skip
    assert message.count("(MatMul)") == 1, message  # the second MatMul reads the first's result: not checked
    for unrelated in ("GELU", "SiLU", "pattern"):
        assert unrelated not in message, message


def test_vit_tokens_are_refused_at_the_patchify_reshape(tmp_path):
    torch.manual_seed(0)
    path = export(PatchTokens().eval(), (3, 8, 8), tmp_path / "vit.onnx", "torchscript")
    _refused(path, "node '/Reshape' (Reshape): reshapes '/patch/Conv_output_0' (N, 8, 2, 2) to (N, 8, 4); "
             "fusedserve reshapes only to (N, features)", "the format has no general reshape")  # fmt: skip


def test_every_refused_node_is_listed_with_a_count(tmp_path):
    """Ten unknown ops in a chain, and beside them a MatMul of two tensors: the first eight unknown ones and a count,
    the MatMul with its reason, the node that joins the branches counted as not checked."""
    chain = [helper.make_node("Sin", ["c" if i == 0 else f"s{i - 1}"], [f"s{i}"], name=f"sin{i}") for i in range(10)]
    matmul = helper.make_node("MatMul", ["c", "c"], ["m"], name="scores")
    join = helper.make_node("Add", ["s9", "m"], ["j"], name="join")
    flat = helper.make_node("Flatten", ["j"], ["y"])
    path = _conv_file(tmp_path / "many.onnx", [*chain, matmul, join, flat], ["N", 256])
    message = _refused(path, "11 nodes cannot be served (2 nodes reading their results not checked):",
                       "node 'scores' (MatMul): multiplies two tensors computed from the input, 'c' (N, 4, 8, 8) by "
                       "'c' (N, 4, 8, 8)", "node 'sin0' (Sin); node 'sin1' (Sin);",
                       "node 'sin7' (Sin) and 2 more: these ops are not supported.")  # fmt: skip
    assert "sin8" not in message and "join" not in message


def test_a_gate_of_the_wrong_shape_is_told_in_shapes_not_patterns(tmp_path):
    """A squeeze-and-excitation Mul whose gate does not broadcast against the image: both shapes, no talk of GELU
    or SiLU patterns."""
    w = _const("w2", np.ones((2, 4, 1, 1)))
    nodes = [helper.make_node("GlobalAveragePool", ["c"], ["p"]), helper.make_node("Conv", ["p", "w2"], ["g"]),
             helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["c", "s"], ["se"], name="scale"),
             helper.make_node("Flatten", ["se"], ["y"])]  # fmt: skip
    path = _conv_file(tmp_path / "se.onnx", nodes, ["N", 256])
    proto = onnx.load(str(path))
    proto.graph.initializer.append(w)
    onnx.save(proto, str(path))
    message = _refused(path, "node 'scale' (Mul): multiplies 'c' (N, 4, 8, 8) by 's' (N, 2, 1, 1): fusedserve takes "
                       "tensors of one shape, or shapes of which one broadcasts to the other")  # fmt: skip
    for unrelated in ("GELU", "SiLU", "pattern"):
        assert unrelated not in message, message


@pytest.mark.parametrize(
    "after,needle",
    [
        ([helper.make_node("Erf", ["c"], ["e"], name="lone_erf"), helper.make_node("Flatten", ["e"], ["y"])],
         "node 'lone_erf' (Erf): Erf is supported only as part of a pattern (GELU's erf form x * 0.5 * (1 + Erf(x / "
         "sqrt(2))) -> gelu); this one, reading 'c' (N, 4, 8, 8), is not"),
        ([helper.make_node("Flatten", ["c"], ["f"]), helper.make_node("Softmax", ["f"], ["s"], name="middle"),
          helper.make_node("Relu", ["s"], ["y"])],
         "node 'middle' (Softmax): softmax is supported only as the node that gives the model's output"),
        ([helper.make_node("Pad", ["c", "pads", "ninf"], ["p"], name="by_ninf"),
          helper.make_node("Relu", ["p"], ["r"], name="after"), helper.make_node("Flatten", ["r"], ["y"])],
         "node 'after' (Relu): reads 'p', a Pad by -inf; fusedserve pads by finite values"),
        ([helper.make_node("Transpose", ["c"], ["t"], name="hw", perm=[0, 1, 3, 2]),
          helper.make_node("Flatten", ["t"], ["y"])],
         "node 'hw' (Transpose): perm [0, 1, 3, 2] of 'c' (N, 4, 8, 8); fusedserve transposes an image"),
        ([helper.make_node("Reshape", ["c", "tokens"], ["t"], name="to_tokens"),
          helper.make_node("Flatten", ["t"], ["y"])],
         "node 'to_tokens' (Reshape): reshapes 'c' (N, 4, 8, 8) to (N, 4, 64); fusedserve reshapes only to "
         "(N, features)"),
    ],
    ids=["lone-erf", "softmax-inside", "pad-by-inf", "transpose-hw", "reshape-to-tokens"],
)  # fmt: skip
def test_single_refusals_say_why_with_shapes(tmp_path, after, needle):
    import onnx

    path = _conv_file(tmp_path / "r.onnx", after, ["N", 256])
    proto = onnx.load(str(path))
    proto.graph.initializer.extend([
        onnx.numpy_helper.from_array(np.array([0, 0, 0, 1, 0, 0, 0, 1], dtype=np.int64), "pads"),
        _const("ninf", -np.inf),
        onnx.numpy_helper.from_array(np.array([0, 4, 64], dtype=np.int64), "tokens"),
    ])  # fmt: skip
    onnx.save(proto, str(path))
    _refused(path, needle)


def test_swin_windows_are_refused_at_the_partition(tmp_path):
    torch.manual_seed(0)
    path = export(SwinWindows().eval(), (3, 8, 8), tmp_path / "swin.onnx", "torchscript")
    message = _refused(path, "(Reshape): reshapes ", " (N, 4, 4, 8) (channels-last) to (N, 2, 2, 2, 2, 8); a "
                       "channels-last view flattens only when it is (N, 1, 1, C)")  # fmt: skip
    assert "(LayerNormalization)" not in message, message  # the norm before it is served
