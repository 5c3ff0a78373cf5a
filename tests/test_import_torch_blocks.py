"""export_module on the blocks of torchvision's classification families (issue 49), each a tiny module written the
way torchvision/models/<family>.py writes it (torchvision is not installed here): exported through torch.export,
loaded, and run by both executors (fp32 on the CPU; the fused mode through Triton's interpreter) against the
module's own eager forward in float64, within 1e-5 relative norm error. Each also checks the ops its graph must
(and must not) hold; `Odds` gathers what ports and hand-written variants add (TF-style padding, nn.ChannelShuffle,
unequal splits, clamps, arithmetic with numbers and parameters). Then what stays refused, by node name and ATen op:
attention (a matmul of two activations, scaled_dot_product_attention, a vision transformer's patch reshape), and
the other refusals' messages.

Tiny on purpose: a few channels, 8x8 to 16x16 images, two rows in the fused mode.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from filelock import FileLock
from torch import nn

from service.model.export import export_module
from service.model.loader import load_model
from service.model.spec import ModelFormatError
from tests.test_import_torch import HAS_CUDA, relative_error, run_exported
from tests.torch_models import randomise_batchnorm

pytestmark = pytest.mark.timeout(600)

BOUND = 1e-5


def conv_bn(cin, cout, k=3, stride=1, groups=1, act=nn.ReLU, eps=1e-5, padding=None) -> nn.Sequential:
    """torchvision's Conv2dNormActivation: conv (no bias), BatchNorm, activation (in place where it takes that)."""
    if padding is None:
        padding = tuple((n - 1) // 2 for n in k) if isinstance(k, tuple) else (k - 1) // 2
    layers = [nn.Conv2d(cin, cout, k, stride, padding, groups=groups, bias=False), nn.BatchNorm2d(cout, eps=eps)]
    if act is not None:
        layers.append(act(inplace=True) if act in (nn.ReLU, nn.ReLU6, nn.Hardswish, nn.SiLU) else act())
    return nn.Sequential(*layers)


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation: input * gate(fc2(act(fc1(avgpool(input))))), fc1 and fc2 1x1 convs."""

    def __init__(self, c, squeeze, act=nn.ReLU, gate=nn.Sigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(c, squeeze, 1), nn.Conv2d(squeeze, c, 1)
        self.activation, self.scale_activation = act(), gate()

    def forward(self, x):
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class StochasticDepth(nn.Module):
    """torchvision.ops.StochasticDepth: the identity in eval mode."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty([x.shape[0], 1, 1, 1]).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


# ---- AlexNet, VGG ----


class AlexNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, 1, 1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        )  # fmt: skip
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))  # the input's own size: nothing
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Linear(8 * 4, 16), nn.ReLU(inplace=True),
                                        nn.Dropout(0.5), nn.Linear(16, 10))  # fmt: skip

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class VGG(nn.Module):
    """vgg11_bn's pattern: conv + BN + ReLU, max pools, an adaptive pool to a size dividing the features'."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
            nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        )  # fmt: skip
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))  # from 4x4: windows of 2x2
        self.classifier = nn.Sequential(nn.Linear(8 * 4, 16), nn.ReLU(True), nn.Dropout(), nn.Linear(16, 10))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ---- ResNeXt / Wide ResNet ----


class Bottleneck(nn.Module):
    """torchvision.models.resnet.Bottleneck: groups and width_per_group make ResNeXt and Wide ResNet."""

    def __init__(self, cin, planes, stride=1, groups=1, base_width=64):
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, planes * 4, 1, bias=False), nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != planes * 4:
            self.downsample = nn.Sequential(nn.Conv2d(cin, planes * 4, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes * 4))  # fmt: skip

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNeXt(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))  # fmt: skip
        self.layer = nn.Sequential(
            Bottleneck(8, 2, 2, groups=4, base_width=32),  # ResNeXt: 4 groups of 1 channel
            Bottleneck(8, 2, 1, groups=1, base_width=128),
        )  # Wide ResNet: twice the width
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.layer(self.stem(x)), (1, 1))
        return self.fc(torch.flatten(x, 1))


# ---- SqueezeNet ----


class Fire(nn.Module):
    def __init__(self, cin, squeeze, e1, e3):
        super().__init__()
        self.squeeze, self.squeeze_activation = nn.Conv2d(cin, squeeze, 1), nn.ReLU(inplace=True)
        self.expand1x1, self.expand1x1_activation = nn.Conv2d(squeeze, e1, 1), nn.ReLU(inplace=True)
        self.expand3x3, self.expand3x3_activation = nn.Conv2d(squeeze, e3, 3, padding=1), nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat([self.expand1x1_activation(self.expand1x1(x)),
                          self.expand3x3_activation(self.expand3x3(x))], 1)  # fmt: skip


class SqueezeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
            Fire(8, 4, 4, 4), nn.MaxPool2d(3, 2, ceil_mode=True), Fire(8, 4, 6, 6),
        )  # fmt: skip
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Conv2d(12, 10, 1), nn.ReLU(inplace=True),
                                        nn.AdaptiveAvgPool2d((1, 1)))  # fmt: skip

    def forward(self, x):
        return torch.flatten(self.classifier(self.features(x)), 1)


# ---- DenseNet ----


class DenseLayer(nn.Module):
    def __init__(self, cin, growth, bn_size=2):
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(bn_size * growth), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, inputs: list[torch.Tensor]):
        concated = torch.cat(inputs, 1)  # the block's first layer concatenates one tensor
        bottleneck = self.conv1(self.relu1(self.norm1(concated)))
        return self.conv2(self.relu2(self.norm2(bottleneck)))


class DenseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, 1, 1, bias=False), nn.BatchNorm2d(6), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))  # fmt: skip
        self.layers = nn.ModuleList([DenseLayer(6, 3), DenseLayer(9, 3)])
        self.transition = nn.Sequential(nn.BatchNorm2d(12), nn.ReLU(inplace=True), nn.Conv2d(12, 6, 1, bias=False),
                                        nn.AvgPool2d(2, 2))  # fmt: skip
        self.layer3 = DenseLayer(6, 3)
        self.norm5 = nn.BatchNorm2d(9)  # after a concat: a batch norm with no conv before it
        self.classifier = nn.Linear(9, 10)

    def forward(self, x):
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(features))
        x = self.transition(torch.cat(features, 1))
        x = self.norm5(torch.cat([x, self.layer3([x])], 1))
        out = F.adaptive_avg_pool2d(F.relu(x, inplace=True), (1, 1))
        return self.classifier(torch.flatten(out, 1))


# ---- GoogLeNet, Inception v3 ----


def basic_conv(cin, cout, k, stride=1, padding=0):
    return conv_bn(cin, cout, k, stride, eps=0.001, padding=padding)


class GoogLeNetInception(nn.Module):
    def __init__(self, cin, ch1, ch3red, ch3, ch5red, ch5, pool_proj):
        super().__init__()
        self.branch1 = basic_conv(cin, ch1, 1)
        self.branch2 = nn.Sequential(basic_conv(cin, ch3red, 1), basic_conv(ch3red, ch3, 3, padding=1))
        self.branch3 = nn.Sequential(basic_conv(cin, ch5red, 1), basic_conv(ch5red, ch5, 3, padding=1))
        self.branch4 = nn.Sequential(nn.MaxPool2d(3, 1, 1, ceil_mode=True), basic_conv(cin, pool_proj, 1))

    def forward(self, x):
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class GoogLeNet(nn.Module):
    """With transform_input (on with torchvision's pretrained weights): x[:, c] rescaled per channel, concatenated."""

    def __init__(self):
        super().__init__()
        self.transform_input = True
        self.conv1 = basic_conv(3, 8, 3, 2, 1)
        self.maxpool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.inception = GoogLeNetInception(8, 2, 2, 4, 2, 2, 2)
        self.dropout, self.fc = nn.Dropout(0.2), nn.Linear(10, 10)

    def forward(self, x):
        if self.transform_input:
            x_ch0 = torch.unsqueeze(x[:, 0], 1) * (0.229 / 0.5) + (0.485 - 0.5) / 0.5
            x_ch1 = torch.unsqueeze(x[:, 1], 1) * (0.224 / 0.5) + (0.456 - 0.5) / 0.5
            x_ch2 = torch.unsqueeze(x[:, 2], 1) * (0.225 / 0.5) + (0.406 - 0.5) / 0.5
            x = torch.cat((x_ch0, x_ch1, x_ch2), 1)
        x = self.inception(self.maxpool1(self.conv1(x)))
        return self.fc(self.dropout(torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1)))


class InceptionV3(nn.Module):
    """InceptionA (avg_pool2d with padding, count_include_pad), InceptionC (1x7 and 7x1: here 1x5 and 5x1),
    InceptionE (a branch split into 1x3 and 3x1, concatenated), InceptionB's stride-2 max pool, and an average pool
    that leaves the padding out of its count."""

    def __init__(self):
        super().__init__()
        self.stem = basic_conv(3, 6, 3, padding=1)
        self.a_pool = basic_conv(6, 2, 1)
        self.a_5x5 = nn.Sequential(basic_conv(6, 2, 1), basic_conv(2, 3, 5, padding=2))
        self.c_7x7 = nn.Sequential(basic_conv(5, 3, (1, 5), padding=(0, 2)), basic_conv(3, 3, (5, 1), padding=(2, 0)))
        self.e_1 = basic_conv(5, 2, 1)
        self.e_2a, self.e_2b = basic_conv(2, 2, (1, 3), padding=(0, 1)), basic_conv(2, 2, (3, 1), padding=(1, 0))
        self.fc = nn.Linear(12, 10)

    def forward(self, x):
        x = self.stem(x)
        a = torch.cat([self.a_5x5(x), self.a_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))], 1)
        c = self.c_7x7(a)
        e = self.e_1(a)
        e = torch.cat([self.e_2a(e), self.e_2b(e)], 1)
        b = F.max_pool2d(torch.cat([c, e, F.avg_pool2d(a, 3, 1, 1, count_include_pad=False)], 1), 3, stride=2)
        x = F.adaptive_avg_pool2d(b, (1, 1))
        return self.fc(torch.flatten(F.dropout(x, training=self.training), 1))


# ---- MobileNet V2 / V3, MNASNet ----


class InvertedResidualV2(nn.Module):
    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hidden = cin * expand
        self.use_res_connect = stride == 1 and cin == cout
        self.conv = nn.Sequential(conv_bn(cin, hidden, 1, act=nn.ReLU6), conv_bn(hidden, hidden, 3, stride,
                                  groups=hidden, act=nn.ReLU6), nn.Conv2d(hidden, cout, 1, bias=False),
                                  nn.BatchNorm2d(cout))  # fmt: skip

    def forward(self, x):
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(conv_bn(3, 4, 3, 2, act=nn.ReLU6), InvertedResidualV2(4, 4, 1, 2),
                                      InvertedResidualV2(4, 6, 2, 2), conv_bn(6, 12, 1, act=nn.ReLU6))  # fmt: skip
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(12, 10))

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


class InvertedResidualV3(nn.Module):
    """torchvision's MobileNetV3 block: expand, depthwise, SE (ReLU, Hardsigmoid gate), project; hard swish."""

    def __init__(self, cin, expanded, cout, stride, use_se, act):
        super().__init__()
        layers = [conv_bn(cin, expanded, 1, act=act), conv_bn(expanded, expanded, 3, stride, groups=expanded, act=act)]
        if use_se:
            layers.append(SqueezeExcitation(expanded, max(expanded // 4, 2), gate=nn.Hardsigmoid))
        layers.append(conv_bn(expanded, cout, 1, act=None))
        self.block = nn.Sequential(*layers)
        self.use_res_connect = stride == 1 and cin == cout

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result += x
        return result


class MobileNetV3(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn(3, 4, 3, 2, act=nn.Hardswish), InvertedResidualV3(4, 8, 4, 1, True, nn.ReLU),
            InvertedResidualV3(4, 8, 6, 2, True, nn.Hardswish), conv_bn(6, 12, 1, act=nn.Hardswish),
        )  # fmt: skip
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(12, 16), nn.Hardswish(inplace=True), nn.Dropout(0.2, inplace=True),
                                        nn.Linear(16, 10))  # fmt: skip

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class MNASNet(nn.Module):
    """torchvision's MNASNet: depthwise separable stem, _InvertedResidual stacks (BN momentum 0.0003), mean([2, 3])."""

    def __init__(self):
        super().__init__()

        def bn(c):
            return nn.BatchNorm2d(c, momentum=0.0003)

        self.layers = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, stride=2, bias=False), bn(4), nn.ReLU(inplace=True),
            nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False), bn(4), nn.ReLU(inplace=True),
            nn.Conv2d(4, 4, 1, bias=False), bn(4),
        )  # fmt: skip
        self.block = nn.Sequential(nn.Conv2d(4, 12, 1, bias=False), bn(12), nn.ReLU(inplace=True),
                                   nn.Conv2d(12, 12, 5, padding=2, groups=12, bias=False), bn(12),
                                   nn.ReLU(inplace=True), nn.Conv2d(12, 4, 1, bias=False), bn(4))  # fmt: skip
        self.classifier = nn.Sequential(nn.Dropout(p=0.2, inplace=True), nn.Linear(4, 10))

    def forward(self, x):
        x = self.layers(x)
        x = x + self.block(x)
        return self.classifier(x.mean([2, 3]))


# ---- ShuffleNet V2 ----


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    batchsize, num_channels, height, width = x.size()
    channels_per_group = num_channels // groups
    x = x.view(batchsize, groups, channels_per_group, height, width)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(batchsize, num_channels, height, width)


class ShuffleBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.stride = stride
        branch = cout // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin),
                nn.Conv2d(cin, branch, 1, bias=False), nn.BatchNorm2d(branch), nn.ReLU(inplace=True),
            )  # fmt: skip
        self.branch2 = nn.Sequential(
            nn.Conv2d(cin if stride > 1 else branch, branch, 1, bias=False), nn.BatchNorm2d(branch),
            nn.ReLU(inplace=True), nn.Conv2d(branch, branch, 3, stride, 1, groups=branch, bias=False),
            nn.BatchNorm2d(branch), nn.Conv2d(branch, branch, 1, bias=False), nn.BatchNorm2d(branch),
            nn.ReLU(inplace=True),
        )  # fmt: skip

    def forward(self, x):
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, 4, 3, 2, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.stage = nn.Sequential(ShuffleBlock(4, 8, 2), ShuffleBlock(8, 8, 1))
        self.conv5 = nn.Sequential(nn.Conv2d(8, 12, 1, bias=False), nn.BatchNorm2d(12), nn.ReLU(inplace=True))
        self.fc = nn.Linear(12, 10)

    def forward(self, x):
        x = self.conv5(self.stage(self.maxpool(self.conv1(x))))
        return self.fc(x.mean([2, 3]))


# ---- EfficientNet B0 / V2, RegNet ----


class MBConv(nn.Module):
    def __init__(self, cin, cout, expand, stride, sd_prob):
        super().__init__()
        hidden = cin * expand
        self.block = nn.Sequential(
            conv_bn(cin, hidden, 1, act=nn.SiLU), conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.SiLU),
            SqueezeExcitation(hidden, max(1, cin // 4), act=nn.SiLU), conv_bn(hidden, cout, 1, act=None),
        )  # fmt: skip
        self.stochastic_depth = StochasticDepth(sd_prob)
        self.use_res_connect = stride == 1 and cin == cout

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += x
        return result


class FusedMBConv(nn.Module):
    def __init__(self, cin, cout, expand, stride, sd_prob):
        super().__init__()
        hidden = cin * expand
        self.block = nn.Sequential(conv_bn(cin, hidden, 3, stride, act=nn.SiLU), conv_bn(hidden, cout, 1, act=None))
        self.stochastic_depth = StochasticDepth(sd_prob)
        self.use_res_connect = stride == 1 and cin == cout

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += x
        return result


class EfficientNet(nn.Module):
    """B0's MBConv (SiLU, SE with SiLU and sigmoid) after V2's FusedMBConv; stochastic depth (eval: nothing)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(conv_bn(3, 4, 3, 2, act=nn.SiLU), FusedMBConv(4, 4, 2, 1, 0.1),
                                      MBConv(4, 4, 2, 1, 0.2), MBConv(4, 6, 2, 2, 0.2),
                                      conv_bn(6, 12, 1, act=nn.SiLU))  # fmt: skip
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p=0.2, inplace=True), nn.Linear(12, 10))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class ResBottleneckBlock(nn.Module):
    """torchvision's RegNet block: 1x1, grouped 3x3 (group width 2), optional SE (ReLU, sigmoid), 1x1; projection."""

    def __init__(self, cin, cout, stride, group_width, se_ratio):
        super().__init__()
        self.proj = conv_bn(cin, cout, 1, stride, act=None) if (cin != cout or stride != 1) else None
        layers = [conv_bn(cin, cout, 1), conv_bn(cout, cout, 3, stride, groups=cout // group_width)]
        if se_ratio:
            layers.append(SqueezeExcitation(cout, max(1, int(round(se_ratio * cin)))))
        layers.append(conv_bn(cout, cout, 1, act=None))
        self.f = nn.Sequential(*layers)
        self.activation = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.activation((self.proj(x) if self.proj is not None else x) + self.f(x))


class RegNet(nn.Module):
    """RegNetX's block then RegNetY's (with SE)."""

    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 4, 3, 2)
        self.trunk = nn.Sequential(ResBottleneckBlock(4, 8, 2, 2, None), ResBottleneckBlock(8, 8, 1, 2, 0.25))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.avgpool(self.trunk(self.stem(x))).flatten(start_dim=1))


# ---- ConvNeXt ----


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Permute(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)


class CNBlock(nn.Module):
    """torchvision's: depthwise 7x7, permute, LayerNorm, Linear, GELU, Linear, permute back, layer scale (C, 1, 1),
    stochastic depth, residual add."""

    def __init__(self, dim, layer_scale=0.5):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, 7, padding=3, groups=dim), Permute([0, 2, 3, 1]), nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), Permute([0, 3, 1, 2]),
        )  # fmt: skip
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(0.1)

    def forward(self, x):
        result = self.stochastic_depth(self.layer_scale * self.block(x))
        result += x
        return result


class ConvNeXtBlockOriginal(nn.Module):
    """The ConvNeXt paper's block (facebookresearch/ConvNeXt): gamma of shape (C,) on the channels-last tensor."""

    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1, self.act, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 2, 2), LayerNorm2d(4, eps=1e-6))
        self.stage1 = CNBlock(4)
        self.down = nn.Sequential(LayerNorm2d(4, eps=1e-6), nn.Conv2d(4, 8, 2, 2))
        self.stage2 = ConvNeXtBlockOriginal(8)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(LayerNorm2d(8, eps=1e-6), nn.Flatten(1), nn.Linear(8, 10))

    def forward(self, x):
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.classifier(self.avgpool(x))


# ---- what the families' ports and hand-written variants add ----


class Odds(nn.Module):
    """TF-style 'same' padding before a stride-2 conv (F.pad, one more pixel right and bottom: a pad op), a symmetric
    ZeroPad2d before a conv (folded into its padding), nn.ChannelShuffle, a split into unequal runs, narrow and a
    channel slice, clamp and hardtanh to other bounds (clip), 1 - x, x / 2, 2 / x, x - c, -x."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, 2)
        self.zero = nn.ZeroPad2d(1)
        self.conv2 = nn.Conv2d(6, 6, 3)
        self.shuffle = nn.ChannelShuffle(3)
        self.offset = nn.Parameter(torch.randn(1, 6, 1, 1) * 0.1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.conv1(F.pad(x, (0, 1, 0, 1)))
        x = self.shuffle(torch.clamp(self.conv2(self.zero(x)), min=-1.5, max=2.0))
        a, b = torch.split(x, [2, 4], dim=1)
        a = 1 - F.hardtanh(a, -0.5, 0.5)
        b = torch.narrow(b, 1, 1, 3) / 2 + 2 / (torch.sigmoid(b[:, :3]) + 1)
        x = torch.cat([a, b, -(x - self.offset)[:, 2:5]], 1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 2), 1))


BLOCKS = {
    # name: (module class, image shape, ops the graph must hold, ops it must not)
    "alexnet": (AlexNet, (3, 12, 12), {"conv2d", "maxpool2d", "linear"}, {"avgpool2d"}),
    "vgg": (VGG, (3, 8, 8), {"batchnorm", "avgpool2d"}, set()),
    "resnext": (ResNeXt, (3, 8, 8), {"add", "batchnorm"}, set()),
    "squeezenet": (SqueezeNet, (3, 16, 16), {"concat", "maxpool2d"}, set()),
    "densenet": (DenseNet, (3, 8, 8), {"concat", "batchnorm", "avgpool2d"}, set()),
    "googlenet": (GoogLeNet, (3, 12, 12), {"concat", "maxpool2d", "slice"}, set()),
    "inception_v3": (InceptionV3, (3, 8, 8), {"concat", "avgpool2d", "maxpool2d"}, set()),
    "mobilenet_v2": (MobileNetV2, (3, 8, 8), {"relu6", "add"}, set()),
    "mobilenet_v3": (MobileNetV3, (3, 8, 8), {"hardswish", "hardsigmoid", "mul"}, set()),
    "mnasnet": (MNASNet, (3, 8, 8), {"add", "flatten"}, set()),
    "shufflenet_v2": (ShuffleNetV2, (3, 16, 16), {"slice", "channel_shuffle", "concat"}, set()),
    "efficientnet": (EfficientNet, (3, 8, 8), {"silu", "sigmoid", "mul"}, set()),
    "regnet": (RegNet, (3, 8, 8), {"sigmoid", "mul", "add"}, set()),
    "convnext": (ConvNeXt, (3, 16, 16), {"layernorm", "gelu", "mul"}, set()),
    "odds": (Odds, (3, 9, 9), {"pad", "channel_shuffle", "clip", "slice", "sub", "div", "mul"}, set()),
}


def make_block(name: str) -> nn.Module:
    """BLOCKS[name] seeded, with BatchNorm statistics and LayerNorm affines away from their defaults, in eval mode."""
    torch.manual_seed(0)
    module = BLOCKS[name][0]()
    gen = torch.Generator().manual_seed(1)
    randomise_batchnorm(module, gen)
    for m in module.modules():
        if isinstance(m, nn.LayerNorm):
            m.weight.data.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(m.bias.shape, generator=gen) * 0.2)
    return module.eval()


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    """name -> (module, model directory), exported the first time a test asks; the xdist workers of one run share
    the directories (an export each, under a file lock: torch.export takes about a second a block)."""
    base = tmp_path_factory.getbasetemp()
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "torch-blocks"
    d.mkdir(exist_ok=True)
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            module, path = make_block(name), d / name
            with FileLock(str(d / f"{name}.lock")):
                if not (path / "config.json").exists():
                    export_module(module, torch.randn(2, *BLOCKS[name][1]), path)
            cache[name] = (module, path)
        return cache[name]

    return get


@pytest.mark.parametrize("mode", ["unfused", "fused"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_matches_the_module(exports, name, mode):
    module, path = exports(name)
    rows = 2 if mode == "fused" and not HAS_CUDA else 8
    x = torch.randn(rows, *BLOCKS[name][1], generator=torch.Generator().manual_seed(5))
    got, want = run_exported(module, path, x, mode)
    err = relative_error(got, want)
    assert err <= BOUND, f"{name} {mode}: relative norm error {err:.3g} > {BOUND}"


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_graph_holds_its_ops(exports, name):
    _, path = exports(name)
    ops = [op["op"] for op in json.loads((path / "config.json").read_text())["ops"]]
    must, must_not = BLOCKS[name][2], BLOCKS[name][3]
    assert must <= set(ops) and not (must_not & set(ops)), f"{name}: {ops}"


def test_convnext_maps_channels_last_onto_the_channel_first_graph(exports):
    """The permutes emit nothing; LayerNorm on the channels-last view is `layernorm`, nn.Linear a 1x1 conv, the (C,)
    layer scale a (C, 1, 1) constant; only the classifier's linear stays a linear."""
    _, path = exports("convnext")
    ops = json.loads((path / "config.json").read_text())["ops"]
    kinds = [op["op"] for op in ops]
    assert kinds.count("layernorm") == 5 and kinds.count("conv2d") == 8 and kinds.count("linear") == 1
    tensors = load_model(path).tensors
    scales = [tuple(tensors[op["constant"]].shape) for op in ops if op["op"] == "mul"]
    assert scales == [(4, 1, 1), (8, 1, 1)]
    pointwise = [op for op in ops if op["op"] == "conv2d" and op["name"].startswith("linear")]
    assert [tuple(tensors[op["weight"]].shape) for op in pointwise] == [(16, 4, 1, 1), (4, 16, 1, 1),
                                                                        (32, 8, 1, 1), (8, 32, 1, 1)]  # fmt: skip


def test_padding_is_folded_or_kept(exports):
    """ZeroPad2d(1) before a conv (its only reader) adds to the conv's padding; F.pad's uneven (0, 1, 0, 1) stays."""
    _, path = exports("odds")
    ops = json.loads((path / "config.json").read_text())["ops"]
    pads = [op for op in ops if op["op"] == "pad"]
    assert len(pads) == 1 and pads[0]["pads"] == [0, 0, 1, 1]
    assert [op["padding"] for op in ops if op["op"] == "conv2d"] == [[0, 0], [1, 1]]


def test_shuffle_and_split_are_slices_and_a_shuffle(exports):
    _, path = exports("shufflenet_v2")
    ops = json.loads((path / "config.json").read_text())["ops"]
    assert [(op["start"], op["end"]) for op in ops if op["op"] == "slice"] == [(0, 4), (4, 8)]
    assert [op["groups"] for op in ops if op["op"] == "channel_shuffle"] == [2, 2]
    assert not any(op["op"] in ("flatten", "linear") for op in ops[:-2])  # the views emit nothing


# ---- what stays refused ----


class QKAttention(nn.Module):
    """q @ k of two conv outputs (an attention map over 8x8 pixels)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.fc = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), nn.Linear(4 * 64, 10)

    def forward(self, x):
        return self.fc(torch.softmax(self.q(x) @ self.k(x), -1).flatten(1))


class SDPAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)
        self.fc = nn.Linear(4 * 64, 10)

    def forward(self, x):
        return self.fc(F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x)).flatten(1))


class TinyViT(nn.Module):
    """torchvision's VisionTransformer's _process_input and an encoder block: patches, reshape to tokens, attention."""

    def __init__(self):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, 8, 4, 4)
        self.ln = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, 8, -1).permute(0, 2, 1)
        y = self.ln(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return self.head(x[:, 0])


class TokenAttention(nn.Module):
    """Channels-last tokens (N, H, W, C): the linear projections map (1x1 convs); k's transpose does not."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.fc = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(512, 10)

    def forward(self, x):
        t = x.permute(0, 2, 3, 1)
        return self.fc((self.q(t) @ self.k(t).transpose(-1, -2)).flatten(1))


class LinearSE(nn.Module):
    """A squeeze-and-excitation block written with nn.Linear: the gate is viewed back from (N, C) to (N, C, 1, 1)."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc1, self.fc2, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 2), nn.Linear(2, 4), \
            nn.Linear(4, 10)  # fmt: skip

    def forward(self, x):
        x = self.conv(x)
        b, c, _, _ = x.shape
        y = torch.sigmoid(self.fc2(torch.relu(self.fc1(x.mean((2, 3)))))).view(b, c, 1, 1)
        return self.fc((x * y).mean((2, 3)))


class Crop(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x)[:, :, 1:-1, 1:-1].flatten(1)


class UnevenAdaptive(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return F.adaptive_avg_pool2d(self.conv(x), (4, 4)).flatten(1)


class MutatedView(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        y[:, :2].relu_()  # changes y too
        return (y + 1).flatten(1)


REFUSED = [
    (QKAttention, "node 'matmul' (aten.matmul.default, reading 'conv2d' (N, 4, 8, 8), 'conv2d_1' (N, 4, 8, 8)): "
     "multiplies two tensors computed from the input"),
    (SDPAttention, "node 'scaled_dot_product_attention' (aten.scaled_dot_product_attention.default, reading "
     "'conv2d' (N, 4, 8, 8), 'conv2d_1' (N, 4, 8, 8), 'conv2d_2' (N, 4, 8, 8)): not supported; fusedserve exports "
     "the ATen ops "),
    (TinyViT, "node 'reshape' (aten.reshape.default, reading 'conv2d' (N, 8, 2, 2)): reshapes per-row (8, 2, 2) to "
     "(8, 4); fusedserve maps reshapes to (N, features)"),
    (TokenAttention, "node 'transpose' (aten.transpose.int, reading 'linear_1' (N, 8, 8, 4)): permutes dims "
     "[0, 1, 3, 2] of per-row shape (8, 8, 4); fusedserve maps permute(0, 2, 3, 1) of an image"),
    (LinearSE, "node 'view' (aten.view.default, reading 'sigmoid' (N, 4)): reshapes per-row (4,) to (4, 1, 1): the "
     "format has no op that turns a vector back into an image"),
    (Crop, "node 'slice_2' (aten.slice.Tensor, reading 'slice_1' (N, 4, 6, 6)): crops dim 2 of 'slice_1' "
     "(N, 4, 6, 6) to [1:5]; fusedserve cuts channels only"),
    (UnevenAdaptive, "node 'adaptive_avg_pool2d' (aten.adaptive_avg_pool2d.default, reading 'conv2d' (N, 4, 6, 6)): "
     "pools (6, 6) pixels to (4, 4): windows of different sizes; fusedserve maps adaptive pools to 1x1"),
    (MutatedView, "node 'relu_' (aten.relu_.default, reading 'slice_2' (N, 2, 6, 6)): changes 'slice_2' (sharing the "
     "storage of 'conv2d') in place, and 'add' reads that tensor afterwards"),
]  # fmt: skip


@pytest.mark.parametrize("module,needle", REFUSED, ids=[m.__name__ for m, _ in REFUSED])
def test_refusals_name_the_node_its_op_and_shapes(tmp_path, module, needle):
    with pytest.raises(ModelFormatError) as info:
        export_module(module().eval(), torch.randn(2, 3, 8, 8), tmp_path / "m")
    assert needle in str(info.value), str(info.value)
    assert not (tmp_path / "m").exists()
