"""Small torch models written as a user writes them, for the importers' tests (tests/test_import_*.py): residual
blocks with a strided 1x1 downsample and BatchNorm, the activations of issue 33 with a depthwise conv and a
concat, an MLP with BatchNorm1d and softmax. 8x8 images and a few channels: the fused mode runs Triton's
interpreter on the CPU."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c: int, oc: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, oc, 3, stride, 1, bias=False), nn.BatchNorm2d(oc)
        self.conv2, self.bn2 = nn.Conv2d(oc, oc, 3, 1, 1, bias=False), nn.BatchNorm2d(oc)
        self.down = None
        if stride != 1 or c != oc:
            self.down = nn.Sequential(nn.Conv2d(c, oc, 1, stride, bias=False), nn.BatchNorm2d(oc))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    """stem, an identity block, a strided block with a 1x1 downsample, global average pool, linear."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.blocks = nn.Sequential(Block(4, 4, 1), Block(4, 8, 2))
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class Activations(nn.Module):
    """ReLU6, a depthwise conv + BN + hard swish, a 1x1 conv + SiLU, their concat, a conv + GELU, pools, a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU6())
        self.depthwise = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False), nn.BatchNorm2d(4),
                                       nn.Hardswish())  # fmt: skip
        self.pointwise = nn.Sequential(nn.Conv2d(4, 4, 1), nn.SiLU())
        self.mix = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.GELU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.AvgPool2d(2), nn.Flatten(), nn.Linear(32, 16), nn.LeakyReLU(0.1),
                                  nn.Linear(16, 7), nn.Tanh())  # fmt: skip

    def forward(self, x):
        x = self.stem(x)
        x = torch.cat([self.depthwise(x), self.pointwise(x)], 1)
        return self.head(self.mix(x))


class MLPWithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(20, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3),
            nn.Linear(32, 32), nn.BatchNorm1d(32), nn.GELU(),
            nn.Linear(32, 5), nn.Softmax(dim=1),
        )  # fmt: skip

    def forward(self, x):
        return self.net(x)


MODELS = {
    "resnet": (TinyResNet, (3, 8, 8)),
    "activations": (Activations, (3, 8, 8)),
    "mlp-bn": (MLPWithBatchNorm, (20,)),
}


def randomise_batchnorm(module: nn.Module, gen: torch.Generator) -> None:
    """Running statistics and affine parameters away from their defaults, so that folding them matters."""
    for m in module.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            c = m.num_features
            m.running_mean.copy_(torch.randn(c, generator=gen) * 0.3)
            m.running_var.copy_(torch.rand(c, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(c, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(c, generator=gen) * 0.2)


def make(name: str) -> nn.Module:
    """MODELS[name] with seeded weights and BatchNorm statistics, in eval mode."""
    torch.manual_seed(0)
    module = MODELS[name][0]()
    randomise_batchnorm(module, torch.Generator().manual_seed(1))
    return module.eval()
