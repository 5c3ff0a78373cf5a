"""ResNet-18 and ResNet-50 for the benchmarks: torchvision's architecture, random weights, exported to ONNX.

No pretrained weights can be downloaded here, so the weights are random, but not trivially so: every BatchNorm
gets running statistics measured on random images (as training would leave them, not the 0 and 1 of a fresh
layer, which the folding would turn into a no-op) and a random affine weight and bias, so that folding BN into
the convs is exercised with real numbers and activations stay O(1) through all 50 layers.

The architecture follows torchvision's `resnet.py` (ResNet v1.5): a 7x7/2 stem conv with BN and ReLU, a 3x3/2
max pool, four stages of blocks with 64, 128, 256, 512 planes, the first block of stages 2-4 striding by 2 (in
the bottleneck, on its 3x3 conv) with a 1x1/2 conv + BN on the shortcut; global average pooling and a linear
layer to 1000 classes. BasicBlock (ResNet-18: two 3x3 convs, [2, 2, 2, 2] blocks) and Bottleneck (ResNet-50:
1x1 down to the planes, 3x3, 1x1 up to 4x the planes, [3, 4, 6, 3] blocks).

The ONNX file is what a user would export: torch's TorchScript exporter without constant folding, so the
BatchNormalization nodes stay in the file and fusedserve's importer does the folding, opset 17, a dynamic batch.

    python tools/build_resnet.py resnet50 --out /tmp/resnet50     # writes /tmp/resnet50/resnet50.onnx
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

NAMES = ("resnet18", "resnet50", "resnet-stem")
# (block, blocks per stage): torchvision's resnet18 and resnet50; resnet-stem: the stem (7x7/2 conv, BN, ReLU, max
# pool), the global average pool and the classifier with no stage between them. It takes the same 224x224 images
# for well under a ms of GPU time per 256 of them, so `bench serve` on it measures what bytes in cost: the client,
# the front ends, the arena and the copies to the GPU, with no network to hide behind.
LAYOUTS = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet-stem": ("basic", ()),
}
IMAGE = (3, 224, 224)
CLASSES = 1000
OPSET = 17
# ImageNet's per-channel mean and std of 0-255 pixels (torchvision's transforms, times 255): what a user
# declares for a model that takes uint8 images.
PIXEL_MEAN = (123.675, 116.28, 103.53)
PIXEL_STD = (58.395, 57.12, 57.375)


def _bn(c: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c)


def _conv(cin: int, cout: int, k: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = _conv(cin, planes, 3, stride), _bn(planes)
        self.conv2, self.bn2 = _conv(planes, planes, 3), _bn(planes)
        self.relu = nn.ReLU()
        self.downsample = _shortcut(cin, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = _conv(cin, planes, 1), _bn(planes)
        self.conv2, self.bn2 = _conv(planes, planes, 3, stride), _bn(planes)  # v1.5: the stride on the 3x3
        self.conv3, self.bn3 = _conv(planes, planes * self.expansion, 1), _bn(planes * self.expansion)
        self.relu = nn.ReLU()
        self.downsample = _shortcut(cin, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(_conv(cin, cout, 1, stride), _bn(cout))


class ResNet(nn.Module):
    def __init__(self, block: str, blocks: tuple[int, ...], classes: int = CLASSES):
        super().__init__()
        kind = BasicBlock if block == "basic" else Bottleneck
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), _bn(64), nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, cin = [], 64
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512)[: len(blocks)], blocks, strict=True)):
            layer = []
            for j in range(n):
                layer.append(kind(cin, planes, 2 if (i > 0 and j == 0) else 1))
                cin = planes * kind.expansion
            stages.append(nn.Sequential(*layer))
        stages += [nn.Identity()] * (4 - len(stages))  # resnet-stem: no stages
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build(name: str, seed: int = 0, calibration_images: int = 16, image: tuple[int, int, int] = IMAGE) -> ResNet:
    """The named ResNet in eval mode, with He-initialised convs (fan_out, as torchvision), BatchNorm running
    statistics measured on `calibration_images` random N(0, 1) images of shape `image`, random BN weights in
    [0.5, 1.5] (a block's last BN: [0.1, 0.5], as training leaves them, so the residual sums stay O(1) through 16
    blocks rather than doubling the scale every few) and biases N(0, 0.1)."""
    if name not in LAYOUTS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(NAMES)}")
    g = torch.Generator().manual_seed(seed)
    model = ResNet(*LAYOUTS[name])
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                fan_out = m.out_channels * m.kernel_size[0] * m.kernel_size[1]
                m.weight.normal_(0.0, (2.0 / fan_out) ** 0.5, generator=g)
            elif isinstance(m, nn.BatchNorm2d):
                m.momentum = None  # a cumulative average over the calibration batches
            elif isinstance(m, nn.Linear):
                bound = 1.0 / m.in_features**0.5
                m.weight.uniform_(-bound, bound, generator=g)
                m.bias.uniform_(-bound, bound, generator=g)
        model.train()
        for _ in range(max(1, calibration_images // 8)):
            model(torch.randn(8, *image, generator=g))
        last = {id(b.bn2 if isinstance(b, BasicBlock) else b.bn3) for b in model.modules() if hasattr(b, "bn2")}
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(*((0.1, 0.5) if id(m) in last else (0.5, 1.5)), generator=g)
                m.bias.normal_(0.0, 0.1, generator=g)
    return model.eval()


def export_onnx(model: nn.Module, path: Path, name: str, image: tuple[int, int, int] = IMAGE) -> Path:
    """The model as an ONNX file at `path`: BatchNormalization nodes kept, a dynamic batch dimension."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice: chosen on purpose (above)
        torch.onnx.export(
            model, (torch.randn(1, *image),), str(path), dynamo=False, do_constant_folding=False,
            opset_version=OPSET, input_names=["input"], output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        )  # fmt: skip
    proto = onnx.load(str(path))
    meta = proto.metadata_props.add()
    meta.key, meta.value = "description", f"{name}: torchvision's architecture, random weights (bench/resnets.py)"
    onnx.save(proto, str(path))
    return path


def write(
    name: str, out_dir: Path | str, seed: int = 0, image: tuple[int, int, int] | None = None
) -> tuple[Path, ResNet]:
    """Build the named ResNet and write `out_dir/<name>.onnx`, a model directory `fusedserve serve` loads. A
    smaller `image` (tests: 3x32x32) gives the same layers on smaller feature maps; default IMAGE."""
    image = image or IMAGE
    model = build(name, seed, image=image)
    return export_onnx(model, Path(out_dir) / f"{name}.onnx", name, image), model
