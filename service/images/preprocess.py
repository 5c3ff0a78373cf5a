"""An image's pixels -> the model's input: resize of the shorter side, center crop, channel order, as torchvision's
Resize(size, antialias=True) + CenterCrop + PILToTensor give them, in torch: the CPU path (after Pillow decodes), and
the reference of the GPU path's one kernel for a batch (kernels/resize.py, after nvJPEG decodes: gpu_decode.py), which
computes the same sums.

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
        """As __call__, for pixels already (3 or 1, height, width): what GPU decoders give; also a stack of images of
        one size, (n, channels, height, width), each prepared as alone (the resize treats them one by one)."""
        if self.channels == "BGR":
            x = x.flip(-3)
        if self.resize is not None:
            x = resize_shorter(x, self.resize, self.interpolation)
        return center_crop(x, self.height, self.width).contiguous()

    def many(self, images: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """A list of (channels, height, width) images of any sizes -> (n, channels, self.height, self.width) uint8, in
        `out` where given. Images of one size are prepared together (one resize for all of them: a batch of 500x375
        photos is a few kernels, not a few per photo), with the same code as one image alone, so each row is what
        `chw` gives it."""
        if out is None:
            c = images[0].shape[0] if images else 0
            out = torch.empty((len(images), c, self.height, self.width), dtype=torch.uint8,
                              device=images[0].device if images else "cpu")  # fmt: skip
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, im in enumerate(images):
            by_size.setdefault(tuple(im.shape), []).append(i)
        for idx in by_size.values():
            stack = images[idx[0]][None] if len(idx) == 1 else torch.stack([images[i] for i in idx])
            rows = self.chw(stack)
            if idx == list(range(idx[0], idx[0] + len(idx))):
                out[idx[0] : idx[0] + len(idx)] = rows
            else:
                out[torch.tensor(idx, device=out.device)] = rows
        return out


def resized_size(height: int, width: int, shorter: int) -> tuple[int, int]:
    """torchvision's Resize(int): the shorter side to `shorter`, the longer to int(shorter * long / short)
    (truncated, as torchvision truncates)."""
    if height <= width:
        return shorter, int(shorter * width / height)
    return int(shorter * height / width), shorter


def resize_shorter(x: torch.Tensor, shorter: int, interpolation: str = "bilinear") -> torch.Tensor:
    """(C, H, W) uint8 -> (C, H', W') uint8 with min(H', W') == shorter, antialiased, rounded to the nearest
    integer (torch.round, as torchvision rounds a uint8 tensor it resized in float). (N, C, H, W): each image alike."""
    size = resized_size(x.shape[-2], x.shape[-1], shorter)
    if size == tuple(x.shape[-2:]):
        return x
    one = x.dim() == 3
    y = F.interpolate((x[None] if one else x).float(), size=size, mode=interpolation, antialias=True,
                      align_corners=False)  # fmt: skip
    y = y[0] if one else y
    return y.round_().clamp_(0, 255).to(torch.uint8)


def center_crop(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's CenterCrop: the middle (height, width) of (C, H, W), the top-left offset rounded
    (int(round((H - height) / 2))); an image smaller than the crop is zero-padded first, its extra pixel of odd
    padding on the bottom and right. (N, C, H, W): each image alike."""
    h, w = x.shape[-2:]
    if h < height or w < width:
        left, top = max(width - w, 0) // 2, max(height - h, 0) // 2
        right, bottom = max(width - w, 0) - left, max(height - h, 0) - top
        x = F.pad(x, (left, right, top, bottom))
        h, w = x.shape[-2:]
    top, left = int(round((h - height) / 2.0)), int(round((w - width) / 2.0))
    return x[..., top : top + height, left : left + width]
