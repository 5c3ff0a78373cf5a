"""torchvision's classification families, defined here as compact torch modules (torchvision itself cannot be
installed beside this CPU torch), each at two sizes:

    full    torchvision's configuration and input (224x224; Inception v3 299x299): the GPU timing's models
    tiny    the same block types and op patterns in every stage, with few blocks, narrow widths and a small input
            (every pool still has pixels to pool, no adaptive pool upsamples): the CPU checks and CI

Each module follows its torchvision file block by block (torchvision/models/<file>.py, named per family), so that
torch's exporters emit the nodes they emit for torchvision's model: squeeze-and-excitation (global average pool,
two 1x1 convs, a sigmoid or hard sigmoid gate, a per-channel multiply), hard swish, ConvNeXt's LayerNorm2d
(permute, layer_norm, permute) and layer scale, ShuffleNet's channel shuffle (view, transpose, view) and chunk,
concats (DenseNet's first layer concatenates one tensor), grouped and depthwise convs, max pools with ceil_mode,
average pools with padding, dropout and stochastic depth (identities in eval). The auxiliary classifiers of
GoogLeNet and Inception v3 are left out: torchvision runs them only in training, so an eval export has none.

Weights are random but not trivial (`build`): He-initialised convs and linears (activations stay O(1) through the
networks without BatchNorm), random BatchNorm / LayerNorm affines and layer scales, then BatchNorm running
statistics measured on random images (train mode, momentum None: a cumulative average), so that folding them
into the convs is exercised with real numbers. The ResNets' blocks are bench/resnets.py's (ResNeXt's and Wide
ResNet's grouped or wider bottleneck is a subclass of its Bottleneck).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from bench import resnets

SIZES = ("full", "tiny")
CLASSES = {"full": 1000, "tiny": 10}  # tiny: fewer classes keep top-1 decisions away from near-ties
# Batches of 8 random images that BatchNorm's running statistics are measured on (module docstring); tiny: one, its
# train-mode forward costs ~1 s of CPU against 0.1 s in eval (CI builds 21 of them).
CALIBRATION_BATCHES = {"full": 2, "tiny": 1}


def make_divisible(v: float, divisor: int = 8, min_value: int | None = None) -> int:
    """torchvision's _make_divisible: the nearest multiple of divisor, never below 90% of v."""
    min_value = min_value or divisor
    new = max(min_value, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def conv_bn(cin, cout, k, stride=1, groups=1, act=nn.ReLU, eps=1e-5, padding=None) -> nn.Sequential:
    """torchvision's Conv2dNormActivation: conv (no bias) + BatchNorm + activation (None: none)."""
    if padding is None:
        padding = tuple((n - 1) // 2 for n in k) if isinstance(k, tuple) else (k - 1) // 2
    layers = [nn.Conv2d(cin, cout, k, stride, padding, groups=groups, bias=False), nn.BatchNorm2d(cout, eps=eps)]
    return nn.Sequential(*layers, *([act(inplace=True)] if act is not None else []))


class SqueezeExcite(nn.Module):
    """torchvision.ops.SqueezeExcitation: x * gate(fc2(act(fc1(avgpool(x))))), fc1 and fc2 1x1 convs with bias."""

    def __init__(self, c: int, squeeze: int, act=nn.ReLU, gate=nn.Sigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(c, squeeze, 1), nn.Conv2d(squeeze, c, 1)
        self.act, self.gate = act(), gate()

    def forward(self, x):
        return self.gate(self.fc2(self.act(self.fc1(self.avgpool(x))))) * x


class StochasticDepth(nn.Module):
    """torchvision.ops.StochasticDepth(p, "row"): drops whole residual branches in training; identity in eval."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty(x.shape[0], 1, 1, 1).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


# ---- AlexNet (alexnet.py), VGG (vgg.py) ----


class AlexNet(nn.Module):
    def __init__(self, widths=(64, 192, 384, 256, 256), hidden=4096, pool=6, classes=1000):
        super().__init__()
        c1, c2, c3, c4, c5 = widths
        relu = partial(nn.ReLU, inplace=True)
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, 11, 4, 2), relu(), nn.MaxPool2d(3, 2),
            nn.Conv2d(c1, c2, 5, padding=2), relu(), nn.MaxPool2d(3, 2),
            nn.Conv2d(c2, c3, 3, padding=1), relu(), nn.Conv2d(c3, c4, 3, padding=1), relu(),
            nn.Conv2d(c4, c5, 3, padding=1), relu(), nn.MaxPool2d(3, 2),
        )  # fmt: skip
        self.avgpool = nn.AdaptiveAvgPool2d(pool)  # the identity at 224x224 (6x6 in, 6x6 out), and tiny's likewise
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Linear(c5 * pool * pool, hidden), relu(),
            nn.Dropout(0.5), nn.Linear(hidden, hidden), relu(), nn.Linear(hidden, classes),
        )  # fmt: skip

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG(nn.Module):
    def __init__(self, cfg=VGG11, bn=False, hidden=4096, pool=7, classes=1000):
        super().__init__()
        layers, c = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), *([nn.BatchNorm2d(v)] if bn else []), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(pool)  # the identity at 224x224 (7x7), and tiny's likewise (1x1)
        self.classifier = nn.Sequential(
            nn.Linear(c * pool * pool, hidden), nn.ReLU(True), nn.Dropout(0.5),
            nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(0.5), nn.Linear(hidden, classes),
        )  # fmt: skip

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ---- ResNet, ResNeXt, Wide ResNet (resnet.py): bench/resnets.py's blocks ----


class GroupedBottleneck(resnets.Bottleneck):
    """torchvision's Bottleneck with groups and width_per_group: its 1x1 -> 3x3 -> 1x1 path is `width` =
    int(planes * width_per_group / 64) * groups wide, the 3x3 grouped (ResNeXt-50 32x4d: 32 groups, 128 wide in
    the first stage; Wide ResNet-50-2: groups 1, twice resnets.Bottleneck's width). Shortcut and forward are
    resnets.Bottleneck's."""

    def __init__(self, cin: int, planes: int, stride: int, groups: int = 1, width_per_group: int = 64):
        super().__init__(cin, planes, stride)
        width = int(planes * width_per_group / 64) * groups
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)


class ResNet(nn.Module):
    """resnets.ResNet with the stem's and stages' widths as arguments (tiny narrows them) and any block."""

    def __init__(self, block, layers, planes=(64, 128, 256, 512), stem=64, classes=1000, **block_kw):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem)
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        stages, cin = [], stem
        for i, (p, n) in enumerate(zip(planes, layers, strict=True)):
            blocks = []
            for j in range(n):
                blocks.append(block(cin, p, 2 if (i > 0 and j == 0) else 1, **block_kw))
                cin = p * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ---- SqueezeNet 1.1 (squeezenet.py) ----


class Fire(nn.Module):
    def __init__(self, cin: int, squeeze: int, e1: int, e3: int):
        super().__init__()
        self.squeeze, self.squeeze_activation = nn.Conv2d(cin, squeeze, 1), nn.ReLU(inplace=True)
        self.expand1x1, self.expand1x1_activation = nn.Conv2d(squeeze, e1, 1), nn.ReLU(inplace=True)
        self.expand3x3, self.expand3x3_activation = nn.Conv2d(squeeze, e3, 3, padding=1), nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.squeeze_activation(self.squeeze(x))
        e1, e3 = self.expand1x1_activation(self.expand1x1(x)), self.expand3x3_activation(self.expand3x3(x))
        return torch.cat([e1, e3], 1)


SQUEEZENET_1_1 = ((16, 64), (16, 64), "M", (32, 128), (32, 128), "M", (48, 192), (48, 192), (64, 256), (64, 256))


class SqueezeNet(nn.Module):
    """Version 1.1: a 3x3/2 stem, Fire modules (squeeze, expand 1x1 and 3x3 of the same width) between max pools
    3/2 with ceil_mode, a 1x1 conv classifier with ReLU and a global average pool."""

    def __init__(self, stem=64, fires=SQUEEZENET_1_1, classes=1000):
        super().__init__()
        layers, c = [nn.Conv2d(3, stem, 3, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True)], stem
        for f in fires:
            if f == "M":
                layers.append(nn.MaxPool2d(3, 2, ceil_mode=True))
            else:
                layers.append(Fire(c, f[0], f[1], f[1]))
                c = 2 * f[1]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Conv2d(c, classes, 1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1)
        )

    def forward(self, x):
        return torch.flatten(self.classifier(self.features(x)), 1)


# ---- DenseNet-121 (densenet.py) ----


class DenseLayer(nn.Module):
    """BN-ReLU-conv1x1-BN-ReLU-conv3x3 on the concatenation of every earlier feature map of its block (the first
    layer's concat has one input)."""

    def __init__(self, cin: int, growth: int, bn_size: int):
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(bn_size * growth), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = self.conv1(self.relu1(self.norm1(torch.cat(features, 1))))
        return self.conv2(self.relu2(self.norm2(x)))


class DenseBlock(nn.ModuleDict):
    def __init__(self, n: int, cin: int, growth: int, bn_size: int):
        super().__init__({f"denselayer{i + 1}": DenseLayer(cin + i * growth, growth, bn_size) for i in range(n)})

    def forward(self, x):
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    def __init__(self, growth=32, blocks=(6, 12, 24, 16), init=64, bn_size=4, classes=1000):
        super().__init__()
        layers = [nn.Conv2d(3, init, 7, 2, 3, bias=False), nn.BatchNorm2d(init), nn.ReLU(inplace=True),
                  nn.MaxPool2d(3, 2, 1)]  # fmt: skip
        c = init
        for i, n in enumerate(blocks):
            layers.append(DenseBlock(n, c, growth, bn_size))
            c += n * growth
            if i != len(blocks) - 1:  # transition: BN-ReLU-conv1x1 halving the channels, avg pool 2/2
                layers += [nn.BatchNorm2d(c), nn.ReLU(inplace=True), nn.Conv2d(c, c // 2, 1, bias=False),
                           nn.AvgPool2d(2, 2)]  # fmt: skip
                c //= 2
        self.features = nn.Sequential(*layers, nn.BatchNorm2d(c))
        self.classifier = nn.Linear(c, classes)

    def forward(self, x):
        x = F.adaptive_avg_pool2d(F.relu(self.features(x), inplace=True), (1, 1))
        return self.classifier(torch.flatten(x, 1))


# ---- GoogLeNet (googlenet.py) ----


def basic_conv(cin, cout, k, stride=1, padding=0) -> nn.Sequential:
    """GoogLeNet's and Inception v3's BasicConv2d: conv (no bias), BatchNorm (eps 0.001), ReLU."""
    return conv_bn(cin, cout, k, stride, eps=1e-3, padding=padding)


class Inception(nn.Module):
    """Four branches concatenated: 1x1; 1x1 -> 3x3; 1x1 -> 3x3 (torchvision's "5x5" branch, 3x3 since its
    issue 906); max pool 3/1/1 with ceil_mode -> 1x1."""

    def __init__(self, cin, ch1, ch3red, ch3, ch5red, ch5, pool_proj):
        super().__init__()
        self.branch1 = basic_conv(cin, ch1, 1)
        self.branch2 = nn.Sequential(basic_conv(cin, ch3red, 1), basic_conv(ch3red, ch3, 3, padding=1))
        self.branch3 = nn.Sequential(basic_conv(cin, ch5red, 1), basic_conv(ch5red, ch5, 3, padding=1))
        self.branch4 = nn.Sequential(nn.MaxPool2d(3, 1, 1, ceil_mode=True), basic_conv(cin, pool_proj, 1))
        self.out_channels = ch1 + ch3 + ch5 + pool_proj

    def forward(self, x):
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


# (ch1x1, ch3x3red, ch3x3, ch5x5red, ch5x5, pool_proj) per Inception block; "M": max pool 3/2, "M2": 2/2, ceil_mode
GOOGLENET = (
    (64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64), "M",
    (192, 96, 208, 16, 48, 64), (160, 112, 224, 24, 64, 64), (128, 128, 256, 24, 64, 64),
    (112, 144, 288, 32, 64, 64), (256, 160, 320, 32, 128, 128), "M2",
    (256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128),
)  # fmt: skip


class GoogLeNet(nn.Module):
    def __init__(self, stem=(64, 64, 192), blocks=GOOGLENET, classes=1000):
        super().__init__()
        s1, s2, s3 = stem
        layers = [basic_conv(3, s1, 7, 2, 3), nn.MaxPool2d(3, 2, ceil_mode=True), basic_conv(s1, s2, 1),
                  basic_conv(s2, s3, 3, padding=1), nn.MaxPool2d(3, 2, ceil_mode=True)]  # fmt: skip
        c = s3
        for b in blocks:
            if isinstance(b, str):
                layers.append(nn.MaxPool2d(3, 2, ceil_mode=True) if b == "M" else nn.MaxPool2d(2, 2, ceil_mode=True))
            else:
                layers.append(Inception(c, *b))
                c = layers[-1].out_channels
        self.features = nn.Sequential(*layers)
        self.avgpool, self.dropout, self.fc = nn.AdaptiveAvgPool2d(1), nn.Dropout(0.2), nn.Linear(c, classes)

    def forward(self, x):
        return self.fc(self.dropout(torch.flatten(self.avgpool(self.features(x)), 1)))


# ---- Inception v3 (inception.py): `w` scales every width (tiny: 1/8) ----


class InceptionA(nn.Module):
    def __init__(self, cin, pool_features, w):
        super().__init__()
        self.branch1x1 = basic_conv(cin, w(64), 1)
        self.branch5x5 = nn.Sequential(basic_conv(cin, w(48), 1), basic_conv(w(48), w(64), 5, padding=2))
        self.branch3x3dbl = nn.Sequential(basic_conv(cin, w(64), 1), basic_conv(w(64), w(96), 3, padding=1),
                                          basic_conv(w(96), w(96), 3, padding=1))  # fmt: skip
        self.branch_pool = basic_conv(cin, pool_features, 1)
        self.out_channels = w(64) + w(64) + w(96) + pool_features

    def forward(self, x):
        pool = self.branch_pool(F.avg_pool2d(x, 3, 1, 1))  # count_include_pad: torch's default, as torchvision
        return torch.cat([self.branch1x1(x), self.branch5x5(x), self.branch3x3dbl(x), pool], 1)


class InceptionB(nn.Module):
    def __init__(self, cin, w):
        super().__init__()
        self.branch3x3 = basic_conv(cin, w(384), 3, 2)
        self.branch3x3dbl = nn.Sequential(basic_conv(cin, w(64), 1), basic_conv(w(64), w(96), 3, padding=1),
                                          basic_conv(w(96), w(96), 3, 2))  # fmt: skip
        self.out_channels = w(384) + w(96) + cin

    def forward(self, x):
        return torch.cat([self.branch3x3(x), self.branch3x3dbl(x), F.max_pool2d(x, 3, 2)], 1)


class InceptionC(nn.Module):
    """Factorised 7x7s: 1x7 and 7x1 convs (padding (0, 3) and (3, 0))."""

    def __init__(self, cin, c7, w):
        super().__init__()
        row, col = partial(basic_conv, k=(1, 7), padding=(0, 3)), partial(basic_conv, k=(7, 1), padding=(3, 0))
        self.branch1x1 = basic_conv(cin, w(192), 1)
        self.branch7x7 = nn.Sequential(basic_conv(cin, c7, 1), row(c7, c7), col(c7, w(192)))
        self.branch7x7dbl = nn.Sequential(basic_conv(cin, c7, 1), col(c7, c7), row(c7, c7), col(c7, c7),
                                          row(c7, w(192)))  # fmt: skip
        self.branch_pool = basic_conv(cin, w(192), 1)
        self.out_channels = 4 * w(192)

    def forward(self, x):
        pool = self.branch_pool(F.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.branch1x1(x), self.branch7x7(x), self.branch7x7dbl(x), pool], 1)


class InceptionD(nn.Module):
    def __init__(self, cin, w):
        super().__init__()
        self.branch3x3 = nn.Sequential(basic_conv(cin, w(192), 1), basic_conv(w(192), w(320), 3, 2))
        self.branch7x7x3 = nn.Sequential(
            basic_conv(cin, w(192), 1), basic_conv(w(192), w(192), (1, 7), padding=(0, 3)),
            basic_conv(w(192), w(192), (7, 1), padding=(3, 0)), basic_conv(w(192), w(192), 3, 2),
        )  # fmt: skip
        self.out_channels = w(320) + w(192) + cin

    def forward(self, x):
        return torch.cat([self.branch3x3(x), self.branch7x7x3(x), F.max_pool2d(x, 3, 2)], 1)


class InceptionE(nn.Module):
    """Expanded filter banks: 1x3 and 3x1 convs side by side, concatenated inside the branch and again outside."""

    def __init__(self, cin, w):
        super().__init__()
        self.branch1x1 = basic_conv(cin, w(320), 1)
        self.branch3x3_1 = basic_conv(cin, w(384), 1)
        self.branch3x3_2a = basic_conv(w(384), w(384), (1, 3), padding=(0, 1))
        self.branch3x3_2b = basic_conv(w(384), w(384), (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = basic_conv(cin, w(448), 1)
        self.branch3x3dbl_2 = basic_conv(w(448), w(384), 3, padding=1)
        self.branch3x3dbl_3a = basic_conv(w(384), w(384), (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = basic_conv(w(384), w(384), (3, 1), padding=(1, 0))
        self.branch_pool = basic_conv(cin, w(192), 1)
        self.out_channels = w(320) + 4 * w(384) + w(192)

    def forward(self, x):
        a = self.branch3x3_1(x)
        a = torch.cat([self.branch3x3_2a(a), self.branch3x3_2b(a)], 1)
        b = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        b = torch.cat([self.branch3x3dbl_3a(b), self.branch3x3dbl_3b(b)], 1)
        pool = self.branch_pool(F.avg_pool2d(x, 3, 1, 1))
        return torch.cat([self.branch1x1(x), a, b, pool], 1)


class InceptionV3(nn.Module):
    """Stem, 3 InceptionA (pool features 32, 64, 64), InceptionB, 4 InceptionC (7x7 widths 128, 160, 160, 192),
    InceptionD, 2 InceptionE; `blocks` picks fewer (tiny: one of each kind)."""

    def __init__(self, w=lambda c: c, blocks=("A32", "A64", "A64", "B", "C128", "C160", "C160", "C192", "D", "E", "E"),
                 classes=1000):  # fmt: skip
        super().__init__()
        layers = [
            basic_conv(3, w(32), 3, 2),
            basic_conv(w(32), w(32), 3),
            basic_conv(w(32), w(64), 3, padding=1),
            nn.MaxPool2d(3, 2),
            basic_conv(w(64), w(80), 1),
            basic_conv(w(80), w(192), 3),
            nn.MaxPool2d(3, 2),
        ]
        c = w(192)
        for b in blocks:
            kind, arg = b[0], w(int(b[1:])) if len(b) > 1 else None
            block = {"A": partial(InceptionA, pool_features=arg), "B": InceptionB, "C": partial(InceptionC, c7=arg),
                     "D": InceptionD, "E": InceptionE}[kind](c, w=w)  # fmt: skip
            layers.append(block)
            c = block.out_channels
        self.features = nn.Sequential(*layers)
        self.avgpool, self.dropout, self.fc = nn.AdaptiveAvgPool2d(1), nn.Dropout(0.5), nn.Linear(c, classes)

    def forward(self, x):
        return self.fc(self.dropout(torch.flatten(self.avgpool(self.features(x)), 1)))


# ---- MobileNetV2 (mobilenetv2.py) ----


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand (ReLU6; none when t = 1), depthwise 3x3 (ReLU6), 1x1 project (no
    activation), the input added when stride 1 keeps the width."""

    def __init__(self, cin: int, cout: int, stride: int, t: int):
        super().__init__()
        hidden = int(round(cin * t))
        self.use_res_connect = stride == 1 and cin == cout
        expand = [conv_bn(cin, hidden, 1, act=nn.ReLU6)] if t != 1 else []
        self.conv = nn.Sequential(*expand, conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6),
                                  nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))  # fmt: skip

    def forward(self, x):
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


# (t: expansion, c: width, n: blocks, s: first block's stride)
MOBILENET_V2 = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))  # fmt: skip


class MobileNetV2(nn.Module):
    def __init__(self, settings=MOBILENET_V2, width=1.0, first=32, last=1280, classes=1000):
        super().__init__()
        c = make_divisible(first * width)
        layers = [conv_bn(3, c, 3, 2, act=nn.ReLU6)]
        for t, ch, n, s in settings:
            out = make_divisible(ch * width)
            for i in range(n):
                layers.append(InvertedResidual(c, out, s if i == 0 else 1, t))
                c = out
        layers.append(conv_bn(c, last, 1, act=nn.ReLU6))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), (1, 1)), 1))


# ---- MobileNetV3 (mobilenetv3.py) ----


class InvertedResidualV3(nn.Module):
    """1x1 expand (skipped when the width stays), depthwise kxk, squeeze-and-excitation (ReLU, hard sigmoid gate,
    squeeze to make_divisible(expanded / 4)), 1x1 project; ReLU or hard swish; BatchNorm eps 0.001."""

    def __init__(self, cin, k, exp, cout, se, hs, stride):
        super().__init__()
        act = nn.Hardswish if hs else nn.ReLU
        bn = partial(conv_bn, eps=1e-3)
        layers = [bn(cin, exp, 1, act=act)] if exp != cin else []
        layers.append(bn(exp, exp, k, stride, groups=exp, act=act))
        if se:
            layers.append(SqueezeExcite(exp, make_divisible(exp // 4), act=nn.ReLU, gate=nn.Hardsigmoid))
        layers.append(bn(exp, cout, 1, act=None))
        self.block = nn.Sequential(*layers)
        self.use_res_connect = stride == 1 and cin == cout

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result += x
        return result


# (input, kernel, expanded, output, squeeze-excite, hard swish, stride) per block, at width 1.0
MOBILENET_V3_LARGE = (
    (16, 3, 16, 16, False, False, 1), (16, 3, 64, 24, False, False, 2), (24, 3, 72, 24, False, False, 1),
    (24, 5, 72, 40, True, False, 2), (40, 5, 120, 40, True, False, 1), (40, 5, 120, 40, True, False, 1),
    (40, 3, 240, 80, False, True, 2), (80, 3, 200, 80, False, True, 1), (80, 3, 184, 80, False, True, 1),
    (80, 3, 184, 80, False, True, 1), (80, 3, 480, 112, True, True, 1), (112, 3, 672, 112, True, True, 1),
    (112, 5, 672, 160, True, True, 2), (160, 5, 960, 160, True, True, 1), (160, 5, 960, 160, True, True, 1),
)  # fmt: skip
MOBILENET_V3_SMALL = (
    (16, 3, 16, 16, True, False, 2), (16, 3, 72, 24, False, False, 2), (24, 3, 88, 24, False, False, 1),
    (24, 5, 96, 40, True, True, 2), (40, 5, 240, 40, True, True, 1), (40, 5, 240, 40, True, True, 1),
    (40, 5, 120, 48, True, True, 1), (48, 5, 144, 48, True, True, 1), (48, 5, 288, 96, True, True, 2),
    (96, 5, 576, 96, True, True, 1), (96, 5, 576, 96, True, True, 1),
)  # fmt: skip


class MobileNetV3(nn.Module):
    def __init__(self, settings, last_channel, width=1.0, classes=1000):
        super().__init__()
        adjust = lambda c: make_divisible(c * width)  # noqa: E731
        blocks = [InvertedResidualV3(adjust(i), k, adjust(e), adjust(o), *rest) for i, k, e, o, *rest in settings]
        lastconv = 6 * adjust(settings[-1][3])
        self.features = nn.Sequential(
            conv_bn(3, adjust(settings[0][0]), 3, 2, act=nn.Hardswish, eps=1e-3),
            *blocks,
            conv_bn(adjust(settings[-1][3]), lastconv, 1, act=nn.Hardswish, eps=1e-3),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(lastconv, last_channel), nn.Hardswish(inplace=True),
                                        nn.Dropout(0.2, inplace=True), nn.Linear(last_channel, classes))  # fmt: skip

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ---- MNASNet 1.0 (mnasnet.py) ----


class MNASBlock(nn.Module):
    """MNASNet's _InvertedResidual: 1x1 expand, depthwise kxk, 1x1 project, ReLU; residual when the shape stays."""

    def __init__(self, cin, cout, k, stride, t):
        super().__init__()
        mid = cin * t
        self.apply_residual = cin == cout and stride == 1
        self.layers = nn.Sequential(conv_bn(cin, mid, 1), conv_bn(mid, mid, k, stride, groups=mid),
                                    conv_bn(mid, cout, 1, act=None))  # fmt: skip

    def forward(self, x):
        return self.layers(x) + x if self.apply_residual else self.layers(x)


# (kernel, first stride, expansion, repeats) per stack; the widths are the depths after the stem's
MNASNET_STACKS = ((3, 2, 3, 3), (5, 2, 3, 3), (5, 2, 6, 3), (3, 1, 6, 2), (5, 2, 6, 4), (3, 1, 6, 1))
MNASNET_DEPTHS = (32, 16, 24, 40, 80, 96, 192, 320)


class MNASNet(nn.Module):
    def __init__(self, depths=MNASNET_DEPTHS, stacks=MNASNET_STACKS, last=1280, classes=1000):
        super().__init__()
        d = depths
        layers = [conv_bn(3, d[0], 3, 2), conv_bn(d[0], d[0], 3, groups=d[0]),
                  conv_bn(d[0], d[1], 1, act=None)]  # fmt: skip
        for (k, s, t, n), cin, cout in zip(stacks, d[1:-1], d[2:], strict=True):
            layers.append(nn.Sequential(*[MNASBlock(cin if i == 0 else cout, cout, k, s if i == 0 else 1, t)
                                          for i in range(n)]))  # fmt: skip
        layers.append(conv_bn(d[-1], last, 1))
        self.layers = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(last, classes))

    def forward(self, x):
        return self.classifier(self.layers(x).mean([2, 3]))  # global average pool as a mean over H and W


# ---- ShuffleNetV2 x1.0 (shufflenetv2.py) ----


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, c, h, w = x.size()
    x = x.view(b, groups, c // groups, h, w).transpose(1, 2).contiguous()
    return x.view(b, -1, h, w)


class ShuffleBlock(nn.Module):
    """Stride 1: half the channels (chunk) through 1x1-dw3x3-1x1, concatenated with the other half; stride 2: both
    branches see the whole input. Then the channels shuffled between the two halves."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.stride = stride
        half = cout // 2
        if stride > 1:
            self.branch1 = nn.Sequential(conv_bn(cin, cin, 3, stride, groups=cin, act=None), conv_bn(cin, half, 1))
        self.branch2 = nn.Sequential(
            conv_bn(cin if stride > 1 else half, half, 1),
            conv_bn(half, half, 3, stride, groups=half, act=None),
            conv_bn(half, half, 1),
        )

    def forward(self, x):
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    def __init__(self, repeats=(4, 8, 4), widths=(24, 116, 232, 464, 1024), classes=1000):
        super().__init__()
        self.conv1, self.maxpool = conv_bn(3, widths[0], 3, 2), nn.MaxPool2d(3, 2, 1)
        stages, c = [], widths[0]
        for n, out in zip(repeats, widths[1:-1], strict=True):
            blocks = [ShuffleBlock(c if i == 0 else out, out, 2 if i == 0 else 1) for i in range(n)]
            stages.append(nn.Sequential(*blocks))
            c = out
        self.stage2, self.stage3, self.stage4 = stages
        self.conv5 = conv_bn(c, widths[-1], 1)
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x):
        x = self.stage4(self.stage3(self.stage2(self.maxpool(self.conv1(x)))))
        return self.fc(self.conv5(x).mean([2, 3]))


# ---- EfficientNet-B0 and EfficientNetV2-S (efficientnet.py) ----


class MBConv(nn.Module):
    """1x1 expand (when the expansion is not 1), depthwise kxk, squeeze-and-excitation (SiLU, sigmoid gate, squeeze
    to a quarter of the block's input width), 1x1 project; SiLU; stochastic depth on the residual branch."""

    def __init__(self, cin, cout, k, stride, t, sd, eps):
        super().__init__()
        exp = make_divisible(cin * t)
        bn = partial(conv_bn, act=nn.SiLU, eps=eps)
        layers = [bn(cin, exp, 1)] if exp != cin else []
        layers += [bn(exp, exp, k, stride, groups=exp), SqueezeExcite(exp, max(1, cin // 4), act=nn.SiLU),
                   bn(exp, cout, 1, act=None)]  # fmt: skip
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(sd)
        self.use_res_connect = stride == 1 and cin == cout

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += x
        return result


class FusedMBConv(nn.Module):
    """EfficientNetV2's early blocks: one kxk conv in place of expand + depthwise (then a 1x1 project when it
    expands), no squeeze-and-excitation."""

    def __init__(self, cin, cout, k, stride, t, sd, eps):
        super().__init__()
        exp = make_divisible(cin * t)
        bn = partial(conv_bn, act=nn.SiLU, eps=eps)
        if exp != cin:
            self.block = nn.Sequential(bn(cin, exp, k, stride), bn(exp, cout, 1, act=None))
        else:
            self.block = nn.Sequential(bn(cin, cout, k, stride))
        self.stochastic_depth = StochasticDepth(sd)
        self.use_res_connect = stride == 1 and cin == cout

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += x
        return result


# (block, expansion, kernel, stride, input, output, layers) per stage
EFFICIENTNET_B0 = (
    ("M", 1, 3, 1, 32, 16, 1), ("M", 6, 3, 2, 16, 24, 2), ("M", 6, 5, 2, 24, 40, 2), ("M", 6, 3, 2, 40, 80, 3),
    ("M", 6, 5, 1, 80, 112, 3), ("M", 6, 5, 2, 112, 192, 4), ("M", 6, 3, 1, 192, 320, 1),
)  # fmt: skip
EFFICIENTNET_V2_S = (
    ("F", 1, 3, 1, 24, 24, 2), ("F", 4, 3, 2, 24, 48, 4), ("F", 4, 3, 2, 48, 64, 4), ("M", 4, 3, 2, 64, 128, 6),
    ("M", 6, 3, 1, 128, 160, 9), ("M", 6, 3, 2, 160, 256, 15),
)  # fmt: skip


class EfficientNet(nn.Module):
    """Stem 3x3/2 (SiLU), the stages, a 1x1 conv to `last` (B0: 4 x 320), global average pool, dropout, linear.
    Stochastic depth rises linearly with the block's index to 0.2."""

    def __init__(self, stages, last=None, eps=1e-5, dropout=0.2, classes=1000):
        super().__init__()
        layers = [conv_bn(3, stages[0][4], 3, 2, act=nn.SiLU, eps=eps)]
        total, idx = sum(s[-1] for s in stages), 0
        for kind, t, k, s, cin, cout, n in stages:
            block = MBConv if kind == "M" else FusedMBConv
            stage = []
            for i in range(n):
                stage.append(block(cin if i == 0 else cout, cout, k, s if i == 0 else 1, t, 0.2 * idx / total, eps))
                idx += 1
            layers.append(nn.Sequential(*stage))
        last = last or 4 * stages[-1][5]
        layers.append(conv_bn(stages[-1][5], last, 1, act=nn.SiLU, eps=eps))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout, inplace=True), nn.Linear(last, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ---- RegNetX and RegNetY, 400MF (regnet.py) ----


class RegNetBlock(nn.Module):
    """ResBottleneckBlock: 1x1, grouped 3x3 (groups of `group_width` channels) [+ squeeze-and-excitation to
    se_ratio x the block's input width, ReLU and sigmoid], 1x1; a 1x1 conv + BN projects the shortcut when the
    shape changes; ReLU after the sum."""

    def __init__(self, w_in, w_out, stride, group_width, se_ratio=None):
        super().__init__()
        self.proj = conv_bn(w_in, w_out, 1, stride, act=None) if (w_in != w_out or stride != 1) else None
        layers = [conv_bn(w_in, w_out, 1), conv_bn(w_out, w_out, 3, stride, groups=w_out // group_width)]
        if se_ratio:
            layers.append(SqueezeExcite(w_out, int(round(se_ratio * w_in))))
        self.f = nn.Sequential(*layers, conv_bn(w_out, w_out, 1, act=None))
        self.activation = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.proj(x) + self.f(x) if self.proj is not None else x + self.f(x)
        return self.activation(x)


def regnet_stages(depth, w_0, w_a, w_m, group_width) -> list[tuple[int, int, int]]:
    """(width, blocks, group width) per stage from RegNet's design-space parameters (the paper's quantised linear
    widths; torchvision's BlockParams.from_init_params, bottleneck multiplier 1): block j's width is w_0 * w_m^q_j
    rounded to a multiple of 8, q_j = round(log((w_0 + j w_a) / w_0) / log w_m); runs of equal widths are stages;
    each stage's width then rounded to a multiple of its group width (itself at most the stage's width)."""
    cont = torch.arange(depth, device="cpu") * w_a + w_0  # float32, as torchvision computes it: the rounding follows
    q = torch.round(torch.log(cont / w_0) / math.log(w_m))
    widths = (torch.round(torch.divide(w_0 * torch.pow(w_m, q), 8)) * 8).int().tolist()
    stages: list[list[int]] = []
    for w in widths:
        if stages and stages[-1][0] == w:
            stages[-1][1] += 1
        else:
            stages.append([w, 1])
    out = []
    for w, n in stages:
        g = min(group_width, w)
        out.append((make_divisible(w, g), n, g))
    return out


REGNET_X_400MF = {"depth": 22, "w_0": 24, "w_a": 24.48, "w_m": 2.54, "group_width": 16}
REGNET_Y_400MF = {"depth": 16, "w_0": 48, "w_a": 27.89, "w_m": 2.09, "group_width": 8}


class RegNet(nn.Module):
    def __init__(self, stages, se_ratio=None, stem=32, classes=1000):
        super().__init__()
        self.stem = conv_bn(3, stem, 3, 2)
        blocks, c = [], stem
        for w, n, g in stages:
            blocks.append(nn.Sequential(*[RegNetBlock(c if i == 0 else w, w, 2 if i == 0 else 1, g, se_ratio)
                                          for i in range(n)]))  # fmt: skip
            c = w
        self.trunk_output = nn.Sequential(*blocks)
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(c, classes)

    def forward(self, x):
        return self.fc(self.avgpool(self.trunk_output(self.stem(x))).flatten(start_dim=1))


# ---- ConvNeXt-T (convnext.py) ----


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW map: permute to NHWC, layer_norm, permute back."""

    def forward(self, x):
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Permute(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)


class CNBlock(nn.Module):
    """Depthwise 7x7 (bias), then in NHWC: LayerNorm, linear to 4x, GELU, linear back; times a per-channel layer
    scale, stochastic depth, plus the input."""

    def __init__(self, dim: int, layer_scale: float, sd: float):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, 7, padding=3, groups=dim), Permute([0, 2, 3, 1]), nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), Permute([0, 3, 1, 2]),
        )  # fmt: skip
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(sd)

    def forward(self, x):
        result = self.stochastic_depth(self.layer_scale * self.block(x))
        result += x
        return result


class ConvNeXt(nn.Module):
    """Patchify stem (4x4/4 conv + LayerNorm2d), stages of CNBlocks with LayerNorm2d + 2x2/2 conv between them,
    global average pool, LayerNorm2d, flatten, linear. Stochastic depth rises linearly to 0.1 (ConvNeXt-T)."""

    def __init__(self, dims=(96, 192, 384, 768), depths=(3, 3, 9, 3), classes=1000):
        super().__init__()
        norm = partial(LayerNorm2d, eps=1e-6)
        layers = [nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), norm(dims[0]))]
        total, idx = sum(depths), 0
        for i, (d, n) in enumerate(zip(dims, depths, strict=True)):
            stage = []
            for _ in range(n):
                stage.append(CNBlock(d, 1e-6, 0.1 * idx / max(total - 1, 1)))
                idx += 1
            layers.append(nn.Sequential(*stage))
            if i < len(dims) - 1:
                layers.append(nn.Sequential(norm(d), nn.Conv2d(d, dims[i + 1], 2, 2)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(norm(dims[-1]), nn.Flatten(1), nn.Linear(dims[-1], classes))

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)))


# ---- the table ----


@dataclass(frozen=True)
class Family:
    """One family: its builders at each size and the input side each takes."""

    name: str
    title: str
    full: Callable[[int], nn.Module]  # classes -> module
    tiny: Callable[[int], nn.Module]
    image: int  # full's input side
    tiny_image: int
    tiny_note: str  # what tiny keeps of full

    def side(self, size: str) -> int:
        return self.image if size == "full" else self.tiny_image


def _eighth(c: int) -> int:
    return max(2, c // 8)


# Each kind of block once: with and without expansion, SE, hard swish, stride 2, residual.
_V3_LARGE_TINY = tuple(MOBILENET_V3_LARGE[i] for i in (0, 1, 3, 4, 6, 10, 11))
_V3_SMALL_TINY = tuple(MOBILENET_V3_SMALL[i] for i in (0, 1, 2, 3, 4))

_FAMILIES = (
    Family("alexnet", "AlexNet", lambda k: AlexNet(classes=k),
           lambda k: AlexNet((8, 16, 24, 16, 16), hidden=32, pool=2, classes=k), 224, 95,
           "all 5 convs and 3 pools at 1/8 width; 95x95 in leaves 2x2 maps for a 2x2 adaptive pool (full: 6 on 6)"),
    Family("vgg11", "VGG-11", lambda k: VGG(classes=k),
           lambda k: VGG(tuple(_eighth(v) if v != "M" else v for v in VGG11), hidden=32, pool=1, classes=k), 224, 32,
           "all 8 convs and 5 pools at 1/8 width; 32x32 in leaves 1x1 for a 1x1 adaptive pool (full: 7 on 7)"),
    Family("vgg11_bn", "VGG-11 BN", lambda k: VGG(bn=True, classes=k),
           lambda k: VGG(tuple(_eighth(v) if v != "M" else v for v in VGG11), bn=True, hidden=32, pool=1, classes=k),
           224, 32, "as vgg11, with BatchNorm after each conv"),
    Family("resnet18", "ResNet-18", lambda k: ResNet(resnets.BasicBlock, (2, 2, 2, 2), classes=k),
           lambda k: ResNet(resnets.BasicBlock, (1, 1, 1, 1), (8, 16, 32, 64), 8, classes=k), 224, 32,
           "one basic block per stage (the first an identity block, the others strided, 1x1 shortcut), 1/8 width"),
    Family("resnet50", "ResNet-50", lambda k: ResNet(resnets.Bottleneck, (3, 4, 6, 3), classes=k),
           lambda k: ResNet(resnets.Bottleneck, (2, 1, 1, 1), (8, 16, 32, 64), 8, classes=k), 224, 32,
           "bottlenecks (2, 1, 1, 1): a projected and an identity one in stage 1, strided ones after; 1/8 width"),
    Family("resnext50_32x4d", "ResNeXt-50 32x4d",
           lambda k: ResNet(GroupedBottleneck, (3, 4, 6, 3), classes=k, groups=32, width_per_group=4),
           lambda k: ResNet(GroupedBottleneck, (2, 1, 1, 1), (8, 16, 32, 64), 8, classes=k, groups=4,
                            width_per_group=32), 224, 32,
           "as resnet50's tiny; 4 groups of width 2x planes / 4 (full: 32 groups of 4 per 64 planes)"),
    Family("wide_resnet50_2", "Wide ResNet-50-2",
           lambda k: ResNet(GroupedBottleneck, (3, 4, 6, 3), classes=k, width_per_group=128),
           lambda k: ResNet(GroupedBottleneck, (2, 1, 1, 1), (8, 16, 32, 64), 8, classes=k, width_per_group=128),
           224, 32, "as resnet50's tiny, bottlenecks twice as wide"),
    Family("squeezenet1_1", "SqueezeNet 1.1", lambda k: SqueezeNet(classes=k),
           lambda k: SqueezeNet(8, ((4, 8), "M", (4, 16), "M", (6, 24), (8, 32)), classes=k), 224, 34,
           "4 Fire modules (full: 8) between the same 3 ceil_mode pools; 34x34 in: each pool rounds up"),
    Family("densenet121", "DenseNet-121", lambda k: DenseNet(classes=k),
           lambda k: DenseNet(4, (2, 2, 2, 2), 8, classes=k), 224, 32,
           "2 dense layers per block (full: 6, 12, 24, 16), growth 4 (full: 32), 3 transitions"),
    Family("googlenet", "GoogLeNet", lambda k: GoogLeNet(classes=k),
           lambda k: GoogLeNet((8, 8, 24), tuple(b if isinstance(b, str) else tuple(map(_eighth, b))
                                                  for b in GOOGLENET[:1] + GOOGLENET[2:4] + GOOGLENET[8:10]),
                               classes=k), 224, 32,
           "one Inception block per stage (3a, 4a, 5a) at 1/8 width, every ceil_mode pool; 32x32 in: pools round up"),
    Family("inception_v3", "Inception v3", lambda k: InceptionV3(classes=k),
           lambda k: InceptionV3(_eighth, ("A32", "B", "C128", "D", "E"), classes=k), 299, 75,
           "one block of each kind (A, B, C, D, E) at 1/8 width; 75x75 in, torchvision's smallest"),
    Family("mobilenet_v2", "MobileNetV2", lambda k: MobileNetV2(classes=k),
           lambda k: MobileNetV2(tuple((t, c, 2 if i == 1 else 1, s) for i, (t, c, n, s) in enumerate(MOBILENET_V2)),
                                 width=0.25, last=64, classes=k), 224, 32,
           "one block per stage (two in the second: a residual one), width 0.25, last conv 64 wide"),
    Family("mobilenet_v3_small", "MobileNetV3 Small", lambda k: MobileNetV3(MOBILENET_V3_SMALL, 1024, classes=k),
           lambda k: MobileNetV3(_V3_SMALL_TINY, 64, width=0.25, classes=k), 224, 32,
           "5 of its 11 blocks (ReLU and hard swish, with and without SE, residual and strided), width 0.25"),
    Family("mobilenet_v3_large", "MobileNetV3 Large", lambda k: MobileNetV3(MOBILENET_V3_LARGE, 1280, classes=k),
           lambda k: MobileNetV3(_V3_LARGE_TINY, 64, width=0.25, classes=k), 224, 32,
           "7 of its 15 blocks (ReLU and hard swish, with and without SE, residual and strided), width 0.25"),
    Family("mnasnet1_0", "MNASNet 1.0", lambda k: MNASNet(classes=k),
           lambda k: MNASNet((8, 8, 8, 16, 24, 24, 48, 80), tuple((kk, s, t, 2 if i == 0 else 1)
                                                                 for i, (kk, s, t, _) in enumerate(MNASNET_STACKS)),
                             last=64, classes=k), 224, 32,
           "one block per stack (two in the first: a residual one), depths of alpha 0.25, last conv 64 wide"),
    Family("shufflenet_v2_x1_0", "ShuffleNetV2 x1.0", lambda k: ShuffleNetV2(classes=k),
           lambda k: ShuffleNetV2((2, 2, 2), (8, 16, 32, 64, 64), classes=k), 224, 32,
           "two blocks per stage (a strided one, a chunk one), 1/8 width"),
    Family("efficientnet_b0", "EfficientNet-B0", lambda k: EfficientNet(EFFICIENTNET_B0, classes=k),
           lambda k: EfficientNet(tuple((kind, t, kk, s, make_divisible(i * 0.25), make_divisible(o * 0.25),
                                         2 if j == 1 else 1)
                                        for j, (kind, t, kk, s, i, o, _) in enumerate(EFFICIENTNET_B0)),
                                  last=64, classes=k), 224, 32,
           "one MBConv per stage (two in the second: a residual one), width 0.25, last conv 64 wide"),
    Family("efficientnet_v2_s", "EfficientNetV2-S",
           lambda k: EfficientNet(EFFICIENTNET_V2_S, last=1280, eps=1e-3, classes=k),
           lambda k: EfficientNet((("F", 1, 3, 1, 8, 8, 2), ("F", 4, 3, 2, 8, 16, 1), ("F", 4, 3, 2, 16, 24, 1),
                                   ("M", 4, 3, 2, 24, 32, 2), ("M", 6, 3, 1, 32, 40, 1), ("M", 6, 3, 2, 40, 64, 1)),
                                  last=64, eps=1e-3, classes=k), 224, 32,
           "fused and plain MBConvs (one or two per stage: residual ones of each), about 1/3 width"),
    Family("regnet_x_400mf", "RegNetX-400MF", lambda k: RegNet(regnet_stages(**REGNET_X_400MF), classes=k),
           lambda k: RegNet(((8, 1, 4), (16, 2, 4), (32, 1, 4), (64, 1, 4)), stem=8, classes=k), 224, 32,
           "stages of 1, 2, 1, 1 blocks (an identity one in stage 2), 8-64 wide, groups of 4 channels"),
    Family("regnet_y_400mf", "RegNetY-400MF",
           lambda k: RegNet(regnet_stages(**REGNET_Y_400MF), se_ratio=0.25, classes=k),
           lambda k: RegNet(((8, 1, 4), (16, 2, 4), (32, 1, 4), (64, 1, 4)), se_ratio=0.25, stem=8, classes=k),
           224, 32, "as regnet_x_400mf's tiny, with squeeze-and-excitation"),
    Family("convnext_tiny", "ConvNeXt-T", lambda k: ConvNeXt(classes=k),
           lambda k: ConvNeXt((8, 16, 32, 64), (1, 1, 2, 1), classes=k), 224, 32,
           "stages of 1, 1, 2, 1 blocks (full: 3, 3, 9, 3), 8-64 wide (full: 96-768)"),
)  # fmt: skip
FAMILIES = {f.name: f for f in _FAMILIES}


def image_shape(name: str, size: str) -> tuple[int, int, int]:
    side = FAMILIES[name].side(size)
    return (3, side, side)


def build(name: str, size: str = "tiny", seed: int = 0) -> nn.Module:
    """The family's module at `size`, in eval mode with random weights and calibrated BatchNorm (module
    docstring), float32 on the CPU. The same name, size and seed give the same weights."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; expected one of {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")
    family = FAMILIES[name]
    torch.manual_seed(seed)
    module = (family.full if size == "full" else family.tiny)(CLASSES[size])
    randomise(module, torch.Generator().manual_seed(seed + 1), image_shape(name, size), CALIBRATION_BATCHES[size])
    return module.eval()


@torch.no_grad()
def randomise(module: nn.Module, g: torch.Generator, image: tuple[int, int, int], batches: int = 2) -> None:
    """He-normal weights (fan in, so ReLU activations keep their scale without BatchNorm), biases N(0, 0.05),
    norm affines weight U(0.5, 1.5) and bias N(0, 0.1), layer scales U(0.2, 1); then BatchNorm's running statistics
    measured on `batches` batches of 8 N(0, 1) images with only the BatchNorms in train mode (dropout and
    stochastic depth stay identities), momentum None: the plain average over the batches."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            fan_in = m.weight[0].numel()
            m.weight.normal_(0.0, math.sqrt(2.0 / fan_in), generator=g)
            if m.bias is not None:
                m.bias.normal_(0.0, 0.05, generator=g)
        elif isinstance(m, nn.BatchNorm2d | nn.LayerNorm):
            m.weight.uniform_(0.5, 1.5, generator=g)
            m.bias.normal_(0.0, 0.1, generator=g)
        if isinstance(m, CNBlock):
            m.layer_scale.uniform_(0.2, 1.0, generator=g)
    norms = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]
    if not norms:
        return
    module.eval()
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    for _ in range(batches):
        module(torch.randn(8, *image, generator=g))
    for m in norms:
        m.momentum = 0.1
    module.eval()
