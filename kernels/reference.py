"""Eager torch versions of every fused op, one torch kernel per step.

Used twice: by the tests, as the reference the fused kernels are checked against, and by the
unfused executor, as the baseline the service compares live. They run in the inputs' dtype, as a
user's eager model would (mm in fp16 rounds its output to fp16 before the bias add, where the fused
kernel keeps fp32 until the end), on any device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activations import DEFAULT_NEGATIVE_SLOPE, torch_activation


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(x @ weight.T + bias) as the 3 kernels of the published unfused baseline: mm, add, act. A residual
    (M, N) is one more add before the activation, as a skip connection runs eagerly."""
    y = torch.mm(x, weight.t())
    if bias is not None:
        y = y + bias
    if residual is not None:
        y = y + residual
    return torch_activation(y, activation, negative_slope)


def activation(x: torch.Tensor, name: str, *, negative_slope: float = DEFAULT_NEGATIVE_SLOPE) -> torch.Tensor:
    """One eager activation kernel."""
    return torch_activation(x, name, negative_slope)


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    residual: torch.Tensor | None = None,
    normalize: tuple | None = None,
    x_scale: torch.Tensor | None = None,
    input_norm: tuple | None = None,
    input_activation: str = "none",
    input_negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    out_scale: float | None = None,
) -> torch.Tensor:
    """act(conv2d(x, weight) + bias [+ residual]) as eager torch runs it: F.conv2d with the bias (cuDNN adds it
    in the conv kernel, or as its own add), the residual (the conv's output shape) as its own add, as a ResNet
    block's relu(bn(conv(x)) + identity) runs, then the activation as its own kernel. groups=1.

    normalize: None, or (mean, std) per input channel: x (uint8 pixels or any float dtype) becomes (x - mean) / std
    in the weight's dtype first (`normalize_input`, two more kernels), and the conv pads that with zeros, as
    conv2d((x - mean) / std, padding=p) does.

    x_scale: None, or a gate per image and channel, (N, C) or (N, C, 1, 1) (a squeeze-and-excitation block's s): x
    becomes x * x_scale[:, :, None, None] first, in x's dtype (computed in the wider of the two, rounded once: one more
    kernel writing the product, two where x_scale is wider than x), and the conv pads that with zeros. Not with
    normalize.

    input_norm, input_activation: None, or (scale, shift) per input channel (fused_conv2d's): x becomes
    input_activation(x * scale + shift) first (`affine_activation`: fp32, rounded once to the weight's dtype), and
    the conv pads that with zeros, as conv2d(relu(batch_norm(x)), padding=p) does. Not with normalize or x_scale.

    out_scale: the result (in the weight's dtype) quantized to e4m3 with it, for float8 readers (fused_conv2d's)."""
    if input_norm is not None:
        if normalize is not None or x_scale is not None:
            raise ValueError("input_norm cannot be given with normalize or x_scale")
        x = affine_activation(x, *input_norm, input_activation, dtype=weight.dtype, negative_slope=input_negative_slope)
    elif input_activation != "none":
        raise ValueError("input_activation applies to the input_norm's output: give input_norm too")
    if x_scale is not None:
        if normalize is not None:
            raise ValueError("x_scale and normalize cannot both be given")
        x = (x * x_scale.reshape(x.shape[0], x.shape[1], 1, 1)).to(x.dtype)
    if normalize is not None:
        x = normalize_input(x, *normalize, dtype=weight.dtype)
    y = F.conv2d(x, weight, bias, stride=_pair(stride), padding=_pair(padding), dilation=_pair(dilation))
    if residual is not None:
        y = y + residual
    y = torch_activation(y, activation, negative_slope)
    if out_scale is not None:
        from .fp8 import quantize

        return quantize(y.float(), out_scale)
    return y


def conv2d_grouped(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    groups: int,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(conv2d(x, weight, groups=groups) + bias [+ residual]) as eager torch runs a grouped or depthwise conv:
    F.conv2d with groups and the bias (cuDNN's grouped kernel), the residual (the conv's output shape) as its own add,
    then the activation as its own kernel. weight (OC, C / groups, KH, KW)."""
    y = F.conv2d(x, weight, bias, stride=_pair(stride), padding=_pair(padding), dilation=_pair(dilation), groups=groups)
    if residual is not None:
        y = y + residual
    return torch_activation(y, activation, negative_slope)


def normalize_input(x: torch.Tensor, mean, std, *, dtype: torch.dtype) -> torch.Tensor:
    """(x - mean[c]) / std[c] per channel (dim 1) in dtype: computed in fp32 (float64 for a float64 dtype) from x
    as given (uint8 pixels or floats), then rounded once to dtype, as the fused conv rounds its normalized operand."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    shape = (1, -1) + (1,) * (x.dim() - 2)
    mean = torch.as_tensor(mean, dtype=work, device=x.device).reshape(shape)
    std = torch.as_tensor(std, dtype=work, device=x.device).reshape(shape)
    return ((x.to(work) - mean) / std).to(dtype)


def affine_activation(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    activation: str = "none",
    *,
    dtype: torch.dtype,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
) -> torch.Tensor:
    """activation(x * scale[c] + shift[c]) per channel (dim 1) in dtype: computed in fp32 (float64 for a float64 dtype),
    rounded once to dtype, as fused_conv2d's input_norm prologue makes its operand (a batch norm folded into scale and
    shift, then its ReLU)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    shape = (1, -1) + (1,) * (x.dim() - 2)
    y = x.to(work) * scale.to(work).reshape(shape) + shift.to(work).reshape(shape)
    return torch_activation(y, activation, negative_slope).to(dtype)


def pool2d(
    x: torch.Tensor,
    kind: str,
    kernel_size,
    stride=None,
    padding=(0, 0),
    *,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    activation: str = "none",
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    out_scale: float | None = None,
) -> torch.Tensor:
    """act(avg_pool2d or max_pool2d of x): the pooling kernel, then the activation kernel. kind "avg" | "max";
    stride None means kernel_size, as in torch. `out_scale`: the result quantized to e4m3 with it (fp32 first)."""
    k = _pair(kernel_size)
    s = k if stride is None else _pair(stride)
    p = _pair(padding)
    if kind == "avg":
        y = F.avg_pool2d(x, k, s, p, ceil_mode=ceil_mode, count_include_pad=count_include_pad)
    elif kind == "max":
        y = F.max_pool2d(x, k, s, p, ceil_mode=ceil_mode)
    else:
        raise ValueError(f"unknown pooling kind {kind!r}; expected 'avg' or 'max'")
    y = torch_activation(y, activation, negative_slope)
    if out_scale is not None:
        from .fp8 import quantize

        return quantize(y.float(), out_scale)
    return y


def layernorm_channels(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    activation: str = "none",
    *,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
) -> torch.Tensor:
    """act(layer norm over dim 1) of x (N, C, H, W) or (N, C), as eager torch runs ConvNeXt's LayerNorm2d: permute to
    channels last, F.layer_norm over C (biased variance, + eps), permute back (a channels_last-strided view), then the
    activation as its own kernel. weight, bias (C,) are cast to x's dtype where they differ, as a model held in x's
    dtype stores them."""
    weight = None if weight is None else weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    if x.dim() == 2:
        y = F.layer_norm(x, (x.shape[1],), weight, bias, eps)
    else:
        y = F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), weight, bias, eps).permute(0, 3, 1, 2)
    return torch_activation(y, activation, negative_slope)


# ---- float8 (kernels/conv_fp8.py, kernels/linear_fp8.py): dequantize, compute in fp32, quantize ----


def _fp8_operand(x: torch.Tensor, x_scale: float) -> torch.Tensor:
    """x as the fp8 kernels multiply it: e4m3 as given, or fp16/fp32 quantized with x_scale (fp8.quantize)."""
    from .fp8 import E4M3, quantize

    return x if x.dtype == E4M3 else quantize(x, x_scale)


def _fp8_output(acc, scale, bias, residual, residual_scale, activation, negative_slope, out_scale, out_dtype, channel):
    """The fp8 epilogue in fp32 (fp8.fp8_epilogue): acc * scale[o] + bias + residual (e4m3 times its scale), the
    activation, then e4m3 with out_scale, or out_dtype."""
    from .fp8 import E4M3, quantize

    shape = [1] * acc.dim()
    shape[channel] = -1
    y = acc * scale.float().reshape(shape)
    if bias is not None:
        y = y + bias.float().reshape(shape)
    if residual is not None:
        y = y + (residual.float() * residual_scale if residual.dtype == E4M3 else residual.float())
    y = torch_activation(y, activation, negative_slope)
    return quantize(y, out_scale) if out_scale is not None else y.to(out_dtype)


def conv2d_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    groups: int = 1,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    x_scale: float = 1.0,
    residual: torch.Tensor | None = None,
    residual_scale: float = 1.0,
    out_scale: float | None = None,
    out_dtype: torch.dtype = torch.float16,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_conv2d_fp8 in torch: the e4m3 operands (x quantized with x_scale unless it is e4m3) widened to fp32,
    F.conv2d in fp32 (each e4m3 product is exact in fp32; only the order of the sums differs from the kernel's), then
    the epilogue in fp32 and one rounding: e4m3 with out_scale (saturating at +-448, nearest even), or out_dtype. The
    unfused mode's float8 steps run this. groups: as F.conv2d takes it, weight (OC, C / groups, KH, KW): the reference
    of fused_conv2d_grouped_fp8 too. gate: x * gate (per image and channel, in fp32) is what is quantized."""
    if gate is not None:
        x = x.float() * gate.float().reshape(x.shape[0], x.shape[1], 1, 1)
    xq = _fp8_operand(x, x_scale).float()
    acc = F.conv2d(
        xq, weight.float(), None, stride=_pair(stride), padding=_pair(padding), dilation=_pair(dilation), groups=groups
    )
    return _fp8_output(acc, scale, bias, residual, residual_scale, activation, negative_slope, out_scale, out_dtype, 1)


def linear_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    x_scale: float = 1.0,
    residual: torch.Tensor | None = None,
    residual_scale: float = 1.0,
    out_scale: float | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """fused_linear_fp8 in torch, as conv2d_fp8: act(e4m3(x) @ W^T * scale + bias [+ residual]) in fp32, then one
    rounding."""
    xq = _fp8_operand(x, x_scale).float()
    acc = torch.mm(xq, weight.float().t())
    return _fp8_output(acc, scale, bias, residual, residual_scale, activation, negative_slope, out_scale, out_dtype, 1)


def resize_crop(
    image: torch.Tensor,
    height: int,
    width: int,
    resize: int | None,
    *,
    interpolation: str = "bilinear",
    flip_channels: bool = False,
) -> torch.Tensor:
    """kernels/resize.py's resize_crop for one (C, H, W) uint8 image, in torch ops as the service's CPU path runs them
    (service/images/preprocess.py): the channels reversed where asked, the shorter side resized to `resize` by an
    antialiased interpolate in float32 (skipped where the size does not change), rounded half to even and clamped,
    then torchvision's CenterCrop (zero padding where the image is smaller than the crop). -> (C, height, width)."""
    from .resize import crop_offsets, resized_size

    x = image.flip(0) if flip_channels else image
    h, w = x.shape[1:]
    size = (h, w) if resize is None else resized_size(h, w, resize)
    if size != (h, w):
        y = F.interpolate(x[None].float(), size=size, mode=interpolation, antialias=True, align_corners=False)[0]
        x = y.round_().clamp_(0, 255).to(torch.uint8)
    top, left = crop_offsets(size[0], size[1], height, width)
    out = torch.zeros((x.shape[0], height, width), dtype=torch.uint8, device=x.device)
    # the part of the crop window inside the image: rows top..top+height of x, clipped to 0..size
    y0, y1 = max(top, 0), min(top + height, size[0])
    x0, x1 = max(left, 0), min(left + width, size[1])
    out[:, y0 - top : y1 - top, x0 - left : x1 - left] = x[:, y0:y1, x0:x1]
    return out
