"""An image's pixels -> the model's input: resize of the shorter side, center crop, channel order, as torchvision's
Resize(size, antialias=True) + CenterCrop + PILToTensor give them, in torch, so that the same code runs on the CPU
(after Pillow decodes) and on a GPU (after nvJPEG decodes, gpu_decode.py).

The resize runs in float32 (torch.nn.functional.interpolate, antialias=True: the triangle filter widened by the
scale factor, as Pillow and torchvision resize) and is rounded back to uint8, as torchvision rounds a uint8 tensor it
resized. The mean and std are not applied here: the pixels travel to the engine as uint8 (3 x 224 x 224 = 150 KB),
and the model's first conv normalizes them as it loads them (spec.Normalize), as for tensors sent as uint8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Preprocess:
    """How an image becomes the input: `resize` the shorter side (None: as decoded), center crop to (height, width),
    `channels` RGB, BGR or L. `mean` and `std`: the input's normalization, applied by the model (for describing)."""

    height: int
    width: int
    resize: int | None = None
    interpolation: str = "bilinear"
    channels: str = "RGB"
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @classmethod
    def of(cls, spec) -> Preprocess:
        """From a ModelSpec whose input declares `image` (the loader has checked it)."""
        from ..model.loader import image_channels

        image, norm = spec.input.image, spec.input.normalize
        _, height, width = spec.input.shape
        return cls(height, width, image.resize, image.interpolation, image_channels(spec),
                   None if norm is None else tuple(norm.mean), None if norm is None else tuple(norm.std))  # fmt: skip

    @classmethod
    def from_description(cls, doc: dict) -> Preprocess:
        """Back from `describe()` (what a front end holds: state.ModelInfo.image)."""
        norm = doc.get("normalize") or {}
        mean, std = norm.get("mean"), norm.get("std")
        return cls(doc["crop"][0], doc["crop"][1], doc.get("resize"), doc["interpolation"], doc["channels"],
                   None if mean is None else tuple(mean), None if std is None else tuple(std))  # fmt: skip

    def describe(self) -> dict:
        """What /model and the v2 model configuration say of it."""
        return {
            "formats": ["jpeg", "png", "webp"],
            "resize": self.resize,
            "interpolation": self.interpolation,
            "crop": [self.height, self.width],
            "channels": self.channels,
            "normalize": None if self.mean is None else {"mean": list(self.mean), "std": list(self.std)},
        }

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """(height, width, 3 or 1) uint8 (RGB, or gray for L), on any device -> (channels, self.height, self.width)
        uint8 on that device."""
        return self.chw(pixels.permute(2, 0, 1))

    def chw(self, x: torch.Tensor) -> torch.Tensor:
        """As __call__, for pixels already (3 or 1, height, width): what GPU decoders give."""
        if self.channels == "BGR":
            x = x.flip(0)
        if self.resize is not None:
            x = resize_shorter(x, self.resize, self.interpolation)
        return center_crop(x, self.height, self.width).contiguous()


def resized_size(height: int, width: int, shorter: int) -> tuple[int, int]:
    """torchvision's Resize(int): the shorter side to `shorter`, the longer to int(shorter * long / short)
    (truncated, as torchvision truncates)."""
    if height <= width:
        return shorter, int(shorter * width / height)
    return int(shorter * height / width), shorter


def resize_shorter(x: torch.Tensor, shorter: int, interpolation: str = "bilinear") -> torch.Tensor:
    """(C, H, W) uint8 -> (C, H', W') uint8 with min(H', W') == shorter, antialiased, rounded to the nearest
    integer (torch.round, as torchvision rounds a uint8 tensor it resized in float)."""
    size = resized_size(x.shape[1], x.shape[2], shorter)
    if size == tuple(x.shape[1:]):
        return x
    y = F.interpolate(x[None].float(), size=size, mode=interpolation, antialias=True, align_corners=False)[0]
    return y.round_().clamp_(0, 255).to(torch.uint8)


def center_crop(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's CenterCrop: the middle (height, width) of (C, H, W), the top-left offset rounded
    (int(round((H - height) / 2))); an image smaller than the crop is zero-padded first, its extra pixel of odd
    padding on the bottom and right."""
    _, h, w = x.shape
    if h < height or w < width:
        left, top = max(width - w, 0) // 2, max(height - h, 0) // 2
        right, bottom = max(width - w, 0) - left, max(height - h, 0) - top
        x = F.pad(x, (left, right, top, bottom))
        _, h, w = x.shape
    top, left = int(round((h - height) / 2.0)), int(round((w - width) / 2.0))
    return x[:, top : top + height, left : left + width]
