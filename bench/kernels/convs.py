"""The wider CNN's conv layers alone, y = relu(conv2d(x, W) + b) (3x3, stride 1, padding 1), as each provider
runs it: issue 20's "within 10% of cuDNN's conv + bias + activation" is judged on these rows.

    cudnn        F.conv2d(x, w, b) (cuDNN, the bias inside or as its own add), then torch.relu: 2 kernels, the
                 unfused executor's conv (kernels.reference.conv2d)
    cudnn-fused  torch.cudnn_convolution_add_relu(x, w, z, 0, b, ...): cuDNN's own fused conv + bias + ReLU
                 (it computes relu(conv + alpha * z + b); alpha 0, z a zero tensor of the output's shape, made
                 once); CUDA-only, and n/a where this cuDNN has no engine for the case
    compile      torch.compile of the cudnn function, default mode, dynamic=False, compiled per case
    ours         kernels.conv.fused_conv2d: 1 Triton kernel (implicit GEMM), bias and ReLU on the fp32
                 accumulator, tuned per layer and batch bucket on its first call

x is channels_last (NHWC) for every provider: the layout the fused executor hands from one conv or pool to the
next (service/model/executors.py, channels_last_outputs), and the faster one for cuDNN too on Hopper (64 -> 64
channels at 32x32, 256 images, H100: cuDNN 179 against 253 us NCHW; bench/results/h100/probe_conv_h100.txt). The
weights: channels_last for cuDNN and torch.compile (what `model.to(memory_format=torch.channels_last)` gives a
user), for ours as the executor keeps them (kernels.conv_tma.weight_for: channels_last where the TMA kernel can run
the layer); y: channels_last from each. The TF32 setting
(torch.backends.cudnn.allow_tf32, set by the run like the matmul one) applies to cuDNN and, through
allow_tf32=None, to ours alike.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .models import WIDE_CNN_CONVS, WIDE_CNN_INPUT
from .providers import COMPILE_MODES, NotAvailable, compiled
from .timing import ELEMENT_BYTES, Prepared, describe, synchronize, warm_ours

CONV_PROVIDERS = ("cudnn", "cudnn-fused", "compile", "ours")
NHWC = torch.channels_last
KERNEL = 3  # every conv of the wider CNN: 3x3, stride 1, padding 1 (so OH, OW = H, W)
PADDING = 1


def wide_cnn_convs() -> list[tuple[int, int, int, int]]:
    """(C, H, W, OC) of each conv of the wider CNN, in order: [(3, 32, 32, 64), (64, 32, 32, 64),
    (64, 16, 16, 128), (128, 8, 8, 128)] (a pool after the 2nd, 3rd and 4th halves the next one's input)."""
    c, side = WIDE_CNN_INPUT[0], WIDE_CNN_INPUT[1]
    out = []
    for oc, pooled in WIDE_CNN_CONVS:
        out.append((c, side, side, oc))
        c, side = oc, side // 2 if pooled else side
    return out


def conv_label(C: int, H: int, W: int, OC: int) -> str:
    return f"{C}→{OC} {H}×{W}"


def conv_bytes_and_flops(batch: int, C: int, H: int, W: int, OC: int, dtype: str) -> tuple[int, int]:
    """Fewest bytes (x, w and b read once, y written once) and flops (2 per multiply-add: batch x H x W
    output pixels x OC x C x 3 x 3)."""
    elements = batch * C * H * W + OC * C * KERNEL * KERNEL + OC + batch * OC * H * W
    return elements * ELEMENT_BYTES[dtype], 2 * batch * H * W * OC * C * KERNEL * KERNEL


def reference_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """relu(conv2d) in float64 from the same dtype-cast tensors."""
    return torch.relu(F.conv2d(x.double(), w.double(), b.double(), padding=PADDING))


def _cudnn(x, w, b):
    return torch.relu(F.conv2d(x, w, b, padding=PADDING))


def conv_provider(name: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, device: torch.device) -> Prepared:
    """The provider `name` made ready on these static inputs (compiled, tuned, warmed); torch's providers take
    the weights channels_last, ours as they come."""
    if name != "ours":
        w = w.contiguous(memory_format=NHWC)
    if name == "cudnn":
        return Prepared(lambda: _cudnn(x, w, b))
    if name == "cudnn-fused":
        return _cudnn_fused(x, w, b, device)
    if name in COMPILE_MODES:
        return compiled(_cudnn, name, (x, w, b), device)
    if name == "ours":
        from kernels.conv import fused_conv2d
        from kernels.conv_tma import weight_for

        w = weight_for(w, (1, 1))  # as the fused executor keeps it

        def fn():
            return fused_conv2d(x, w, b, padding=PADDING, activation="relu", memory_format=NHWC)

        t = time.perf_counter()
        warm_ours(fn, device)
        return Prepared(fn, compile_s=time.perf_counter() - t)
    raise ValueError(f"unknown conv provider {name!r}; expected one of {', '.join(CONV_PROVIDERS)}")


def _cudnn_fused(x, w, b, device) -> Prepared:
    if device.type != "cuda":
        raise NotAvailable("cuDNN is CUDA-only")
    fused = getattr(torch, "cudnn_convolution_add_relu", None)
    if fused is None:
        raise NotAvailable(f"torch {torch.__version__} has no torch.cudnn_convolution_add_relu")
    z = torch.zeros((x.shape[0], w.shape[0], x.shape[2], x.shape[3]), device=x.device, dtype=x.dtype)
    z = z.contiguous(memory_format=NHWC)
    stride, padding, dilation = (1, 1), (PADDING, PADDING), (1, 1)

    def fn():
        return fused(x, w, z, 0.0, b, stride, padding, dilation, 1)

    try:
        fn()
        synchronize(device)
    except RuntimeError as e:  # no engine for this dtype/layout in this cuDNN: n/a, not a failure of ours
        raise NotAvailable(describe(e)) from None
    return Prepared(fn)
