"""The blocks of torchvision's families beyond ResNets (issue 49), each a tiny torch module written as torchvision
writes it, exported by torch's two ONNX exporters (dynamo at its default opset; TorchScript at opset 13, 17 or 18),
imported, and run by both executors against onnxruntime on the same file (fp32, relative norm error 1e-4, the
same top-1): squeeze-and-excitation (EfficientNet's sigmoid gate, MobileNetV3's hard sigmoid with hard swish and a
clip), ShuffleNetV2's units (chunk, channel shuffle), ConvNeXt's block (permute, LayerNorm, Linear, GELU, Linear,
layer scale, permute back, residual) with LayerNorm2d stem, downsampling and classifier, DenseNet's pre-activation
layers (a one-input concat, BatchNorm after a concat and after a pool), pools with ceil_mode and padding, and Pad
(zero, folded into a conv or not; by other values). Then what each becomes in the graph and the plan.

One test per (block, exporter) exports once and runs both modes. Tiny on purpose: the fused mode on the CPU runs
Triton's interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from service.model.loader import load_onnx
from service.model.planner import fused_steps, kernel_names

from .test_import_onnx import NO_ONNXSCRIPT, NORMWISE, check_against_ort, export, run_fp32, run_ort

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("onnx_registry_once")]

UNFUSED_ROWS = 64
FUSED_ROWS = 3  # the interpreter runs every program of the grid in Python


def _randomise(module: nn.Module) -> nn.Module:
    """Seeded weights, BatchNorm statistics and LayerNorm affines away from their defaults; eval mode."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.3)
                m.running_var.copy_(torch.rand(c, generator=g) + 0.5)
            if isinstance(m, nn.BatchNorm2d | nn.LayerNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.2)
    return module.eval()


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation: x * gate(fc2(act(fc1(avgpool(x)))))."""

    def __init__(self, c: int, squeeze: int, act, gate):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, squeeze, 1), nn.Conv2d(squeeze, c, 1)
        self.act, self.gate = act(), gate()

    def forward(self, x):
        return self.gate(self.fc2(self.act(self.fc1(F.adaptive_avg_pool2d(x, 1))))) * x


class EfficientNetSE(nn.Module):
    """A conv + BN + SiLU, an SE block with SiLU and a sigmoid gate (EfficientNet's MBConv), a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU())
        self.se = SqueezeExcitation(8, 4, nn.SiLU, nn.Sigmoid)
        self.project = nn.Sequential(nn.Conv2d(8, 6, 1, bias=False), nn.BatchNorm2d(6))
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        x = self.project(self.se(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class MobileNetV3SE(nn.Module):
    """A conv + hard swish, an SE block with ReLU and a hard sigmoid gate, a clip (ReLU6-like with other bounds),
    a residual, a head with hard swish."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Hardswish())
        self.se = SqueezeExcitation(8, 4, nn.ReLU, nn.Hardsigmoid)
        self.project = nn.Conv2d(8, 8, 1)
        self.fc = nn.Sequential(nn.Linear(8, 8), nn.Hardswish(), nn.Linear(8, 5))

    def forward(self, x):
        x = self.stem(x)
        x = x + torch.clamp(self.project(self.se(self.dw(x))), -0.5, 1.5)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """torchvision.models.shufflenetv2.channel_shuffle."""
    n, c, h, w = x.size()
    x = x.view(n, groups, c // groups, h, w)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(n, -1, h, w)


def _branch(c: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
        nn.Conv2d(c, c, 3, stride, 1, groups=c, bias=False), nn.BatchNorm2d(c),
        nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
    )  # fmt: skip


class ShuffleNetUnits(nn.Module):
    """ShuffleNetV2's two units: the strided one (two branches, concat, shuffle) and the one that chunks its input
    in halves, runs one branch on the second half, concatenates and shuffles."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.branch1 = nn.Sequential(nn.Conv2d(8, 8, 3, 2, 1, groups=8, bias=False), nn.BatchNorm2d(8),
                                     nn.Conv2d(8, 8, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())  # fmt: skip
        self.branch2 = nn.Sequential(nn.Conv2d(8, 8, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), *_branch(8, 2)[3:])
        self.unit = _branch(8, 1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = self.stem(x)
        x = channel_shuffle(torch.cat((self.branch1(x), self.branch2(x)), dim=1), 2)
        x1, x2 = x.chunk(2, dim=1)
        x = channel_shuffle(torch.cat((x1, self.unit(x2)), dim=1), 2)
        return self.fc(x.mean([2, 3]))


class LayerNorm2d(nn.LayerNorm):
    """torchvision.models.convnext.LayerNorm2d: permute to channels-last, layer_norm, permute back."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    """ConvNeXt's block: depthwise 7x7, then channels-last LayerNorm, Linear to 4x, GELU, Linear back, permute back,
    times a per-channel layer scale, plus the input (torchvision's); `channels_last_scale`: the layer scale applied
    before the permute back, as the original ConvNeXt's gamma is."""

    def __init__(self, dim: int, channels_last_scale: bool):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.channels_last_scale = channels_last_scale
        self.layer_scale = nn.Parameter(torch.rand(dim) + 0.5 if channels_last_scale else torch.rand(dim, 1, 1) + 0.5)

    def forward(self, x):
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(self.dwconv(x).permute(0, 2, 3, 1)))))
        if self.channels_last_scale:
            return x + (self.layer_scale * y).permute(0, 3, 1, 2)
        result = self.layer_scale * y.permute(0, 3, 1, 2)
        result += x
        return result


class ConvNeXt(nn.Module):
    """Patchify stem + LayerNorm2d, a block, LayerNorm2d + 2x2/2 conv downsampling, a block, global pool,
    LayerNorm2d, flatten, linear (torchvision's ConvNeXt at 8 and 16 channels)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 2, 2), LayerNorm2d(8, eps=1e-6))
        self.block1 = CNBlock(8, channels_last_scale=True)
        self.down = nn.Sequential(LayerNorm2d(8, eps=1e-6), nn.Conv2d(8, 16, 2, 2))
        self.block2 = CNBlock(16, channels_last_scale=False)
        self.classifier = nn.Sequential(LayerNorm2d(16, eps=1e-6), nn.Flatten(1), nn.Linear(16, 5))

    def forward(self, x):
        x = self.block2(self.down(self.block1(self.stem(x))))
        return self.classifier(F.adaptive_avg_pool2d(x, 1))


class DenseNet(nn.Module):
    """DenseNet's pre-activation layers: BN, ReLU, 1x1 conv, BN, ReLU, 3x3 conv on the concat of every earlier
    output (the first layer's concat has one input), then a transition (BN, ReLU, 1x1 conv, 2x2 average pool) and
    BN + ReLU before the head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))  # fmt: skip
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.BatchNorm2d(c),
                nn.ReLU(),
                nn.Conv2d(c, 8, 1, bias=False),
                nn.BatchNorm2d(8),
                nn.ReLU(),
                nn.Conv2d(8, 4, 3, padding=1, bias=False),
            )  # fmt: skip
            for c in (8, 12)
        )
        self.transition = nn.Sequential(nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 1, bias=False),
                                        nn.AvgPool2d(2, 2))  # fmt: skip
        self.norm = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        x = F.relu(self.norm(self.transition(torch.cat(features, 1))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class PoolsAndPads(nn.Module):
    """Max pool with ceil_mode, average pools with padding (counted or not, one with ceil_mode), a zero Pad the
    conv after it takes into its padding (even) and one it cannot wholly (uneven), a Pad by 0.5, a Pad by -inf
    before a max pool; each branch pooled globally, concatenated, a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.even, self.uneven = nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(28, 5)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        branches = [
            F.max_pool2d(x, 3, 2, ceil_mode=True),
            F.avg_pool2d(x, 3, 2, padding=1, ceil_mode=True, count_include_pad=True),
            F.avg_pool2d(x, 2, 2, padding=1, count_include_pad=False),
            self.even(F.pad(x, (1, 1, 1, 1))),
            self.uneven(F.pad(x, (1, 0, 2, 1))),
            F.max_pool2d(F.pad(x, (0, 1, 0, 1), value=0.5), 2),
            F.max_pool2d(F.pad(x, (0, 1, 0, 1), value=-float("inf")), 3, 2),
        ]
        return self.fc(torch.cat([torch.flatten(F.adaptive_avg_pool2d(b, 1), 1) for b in branches], 1))


BLOCKS = {
    "efficientnet-se": (EfficientNetSE, (3, 8, 8)),
    "mobilenetv3-se": (MobileNetV3SE, (3, 8, 8)),
    "shufflenet": (ShuffleNetUnits, (3, 8, 8)),
    "convnext": (ConvNeXt, (3, 16, 16)),
    "densenet": (DenseNet, (3, 8, 8)),
    "pools-pads": (PoolsAndPads, (3, 10, 10)),
}
# (block, exporter, opset): every block by both exporters; ConvNeXt also by TorchScript at opset 13, which writes
# LayerNorm as ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add (LayerNormalization is opset 17), and by
# dynamo at opset 18, which writes GELU in its erf form (Gelu is opset 20, dynamo's default).
CASES = [(b, "dynamo", None) for b in BLOCKS] + [
    ("convnext", "dynamo", 18), ("efficientnet-se", "torchscript", 13), ("mobilenetv3-se", "torchscript", 18),
    ("shufflenet", "torchscript", 17), ("convnext", "torchscript", 13), ("convnext", "torchscript", 17),
    ("densenet", "torchscript", 17), ("pools-pads", "torchscript", 18),
]  # fmt: skip


def _ops(model) -> list[str]:
    return [op.op for op in model.ops]


def _check_structure(block: str, model) -> None:
    """What each block became: the ops that say the pattern was understood, and where the plan fuses them."""
    ops = _ops(model)
    names = kernel_names(fused_steps(model.ops, model.tensors, shapes=model.shapes))
    if block in ("efficientnet-se", "mobilenetv3-se"):
        (gate_mul,) = [op for op in model.ops if op.op == "mul"]
        assert gate_mul.constant is None, ops  # the image times its (8, 1, 1) gate: two tensors, broadcast
        assert sorted(model.shapes[t] for t in gate_mul.inputs) == [(8, 1, 1), (8, 8, 8)], ops
    if block == "efficientnet-se":
        assert ops.count("silu") == 2 and "sigmoid" in ops, ops
    if block == "mobilenetv3-se":
        assert "hardsigmoid" in ops and "clip" in ops and "hardswish" in ops, ops
        assert any(n.endswith("_hardsigmoid") and n.startswith("conv2d") for n in names), names  # in the epilogue
        (clip,) = [op for op in model.ops if op.op == "clip"]
        assert (clip.min, clip.max) == (-0.5, 1.5)
    if block == "shufflenet":
        assert ops.count("channel_shuffle") == 2 and ops.count("slice") == 2, ops
        assert [op.groups for op in model.ops if op.op == "channel_shuffle"] == [2, 2]
    if block == "convnext":
        assert ops.count("layernorm") == 5 and ops.count("gelu") == 2, ops
        pointwise = [op for op in model.ops if op.op == "conv2d" and model.tensors[op.weight].shape[2:] == (1, 1)]
        assert len(pointwise) == 4 and all(op.bias is not None for op in pointwise), ops  # the Linear's Add folded
        scale = [op for op in model.ops if op.op == "mul"]
        assert len(scale) == 2 and all(model.tensors[op.constant].shape[0] in (8, 16) for op in scale), ops
        assert sum(n.endswith("_gelu") and n.startswith("conv2d") for n in names) == 2, names
    if block == "densenet":
        assert ops.count("concat") == 2 and ops.count("batchnorm") >= 4, ops  # the one-input concat is no op
    if block == "pools-pads":
        pads = [op for op in model.ops if op.op == "pad"]
        assert sorted(op.value for op in pads) == [np.finfo(np.float32).min, 0.0, 0.5], [op.pads for op in pads]
        assert any(op.op == "maxpool2d" and op.ceil_mode for op in model.ops)
        # the stem's padding; the even Pad taken by its conv; the uneven Pad (1 left, 0 right, 2 top, 1 bottom)
        # plus the conv's 1: 2 rows and 1 column on both sides, and a `pad` op of a row on top, a column on the left
        assert [op.padding for op in model.ops if op.op == "conv2d"] == [(1, 1), (1, 1), (2, 1)], ops
        assert [op.pads for op in pads if op.value == 0.0] == [(1, 1, 0, 0)]


@pytest.mark.parametrize("block,exporter,opset", CASES, ids=[f"{b}-{e}{o or ''}" for b, e, o in CASES])
def test_block_matches_onnxruntime_in_both_modes(tmp_path, block, exporter, opset):
    if exporter == "dynamo" and NO_ONNXSCRIPT:
        pytest.skip("onnxscript is not installed: torch.onnx's dynamo exporter needs it")
    cls, shape = BLOCKS[block]
    torch.manual_seed(0)
    path = export(_randomise(cls()), shape, tmp_path / f"{block}.onnx", exporter, opset)
    model = load_onnx(path)
    _check_structure(block, model)
    x = np.random.default_rng(5).standard_normal((UNFUSED_ROWS, *shape), dtype=np.float32)
    want = run_ort(path, x)
    check_against_ort(run_fp32(model, "unfused", x), want, NORMWISE, f"{block} ({exporter}, unfused)")
    got = run_fp32(model, "fused", x[:FUSED_ROWS])
    check_against_ort(got, want[:FUSED_ROWS], NORMWISE, f"{block} ({exporter}, fused)")
