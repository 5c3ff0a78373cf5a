"""Conv2d + bias [+ residual] + activation [+ pool] as an implicit GEMM fed by TMA (Hopper's tensor memory
accelerator).

conv.py's kernel gathers each (BLOCK_M, BLOCK_K) tile of the implicit im2col matrix with per-element pointers
and masks: address math and predicates for every element, in registers, every K step. Here an output tile is a
box of pixels, IMG images x BH rows x BW columns, and for one tap (kh, kw) its inputs are the same box of x
shifted by (kh * DH - PH, kw * DW - PW): one 4-D TMA copy of x, NHWC, [IMG, BH, BW, BLOCK_K] at
(n0, oh0 - PH + kh * DH, ow0 - PW + kw * DW, c0). Whatever falls outside x (the padding: negative or past the
edge rows and columns) the copy fills with zeros, so there is no mask at all. The box is viewed as the
(IMG * BH * BW, BLOCK_K) A tile of the GEMM, and the weights, (OC, KH, KW, C) (a channels_last weight), as
the (OC, KH * KW * C) B matrix, another TMA copy per step.

The epilogue adds the bias (and a residual, read with pointers at y's offsets: never with a pool) and applies the
activation to the fp32 accumulator; with POOL it also pools non-overlapping PKH x PKW windows of the tile in
registers (the tile's rows and columns are multiples of the window), so the conv output never goes to memory. y is
stored by TMA as an NHWC box, or with pointers into NCHW (a model's last conv before its flatten).

The descriptors are made on the host, per call, and passed as kernel parameters: made by each program instead
(tl.make_tensor_descriptor, 3 x 128 bytes written and fenced before the first copy) the 64 -> 64 conv at 32x32
over 256 images took 76.5 us against 62.5 (docs/performance.md, "CNNs"). Inside a CUDA graph (the service) the
host's part is paid once, at capture.

Strided convs (ResNet's 3x3/2 and 1x1/2): the inputs of a box of outputs at stride 2 are every other row and
column of x, not a box. So x is described as (NB, H / SH, SH, W / SW, SW * C): row ih = i * SH + ph is at (i, ph),
column iw = j * SW + pw at (j, pw * C + c), and for one tap every output of the box reads the same (ph, pw) at
(oh + dh, ow + dw): one 5-D box [IMG, BH, 1, BW, BLOCK_K]. Rows and columns outside x are still (i, j) outside
[0, H / SH) x [0, W / SW), so zero-filled. This needs H and W multiples of the stride (a last row of an odd H would
be read from the next image) and C a multiple of BLOCK_K (a box past C would read the next column's channels, not
zeros). Before this, the 3x3/2 convs ran in conv.py's gathers at 15-25% of the tensor cores' rate: ResNet-18 at 256
images, 256 -> 512 channels at 14x14 -> 7x7, 301 us against 134 for the twice as big 3x3/1 at 14x14 (H100).

C and OC must make 16-byte rows (C * element size a multiple of 16) for the descriptors; at stride 1 C need not be a
multiple of BLOCK_K: past C the x box is zero-filled, so the weights read there (the next tap's) are multiplied by
zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .activations import apply_activation, round_to_bf16
from .launch import grid_launch
from .pdl import gdc_launch_dependents, gdc_wait
from .pool import _max_propagating_nan
from .tiles import HOPPER_SHARED_MEMORY, launch_options
from .tuning import LaunchConfig


@triton.jit
def _pool_tile(acc, POOL: tl.constexpr, ROWS: tl.constexpr, BW: tl.constexpr, PKH: tl.constexpr, PKW: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """(ROWS * BW, BLOCK_N) -> (ROWS // PKH * BW // PKW, BLOCK_N): each PKH x PKW window of the tile's pixels (row
    m = row * BW + column) max-ed or averaged; NaN propagates through max, as torch's max_pool2d does."""
    t = tl.reshape(acc, (ROWS // PKH, PKH, BW // PKW, PKW, BLOCK_N))
    if POOL == "max":
        t = tl.reduce(t, 3, _max_propagating_nan)
        t = tl.reduce(t, 1, _max_propagating_nan)
    else:
        t = tl.sum(tl.sum(t, 3), 1) / (PKH * PKW)
    return tl.reshape(t, (ROWS // PKH * (BW // PKW), BLOCK_N))


@triton.jit
def _box_offsets(n0, h0, w0, NB, HB: tl.constexpr, WB: tl.constexpr, IMG: tl.constexpr, BH: tl.constexpr,
                 BW: tl.constexpr, stride_n, stride_h, stride_w):  # fmt: skip
    """Offsets of the IMG x BH x BW pixels of a box at (n0, h0, w0) in a tensor of NB images of HB x WB pixels with
    these strides, pixel m = (image * BH + row) * BW + column, and which of them lie inside it."""
    pixel = tl.arange(0, IMG * BH * BW)
    n = n0 + pixel // (BH * BW)
    h = h0 + (pixel // BW) % BH
    w = w0 + pixel % BW
    return n * stride_n + h * stride_h + w * stride_w, (n < NB) & (h < HB) & (w < WB)


@triton.jit
def _k_loop(x_desc, w_desc, n0, oh0, ow0, o0, C: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, PH: tl.constexpr,
            PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
            INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """The (BLOCK_M, BLOCK_N) fp32 accumulator of the output box at (n0, oh0, ow0), channels o0.., over every tap and
    K step: one TMA copy of x's shifted box and one of the weight's (BLOCK_N, BLOCK_K) tile a step (module doc)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    c_steps: tl.constexpr = (C + BLOCK_K - 1) // BLOCK_K
    LIFT_H: tl.constexpr = (PH + SH - 1) // SH
    LIFT_W: tl.constexpr = (PW + SW - 1) // SW
    for step in range(KH * KW * c_steps):
        tap = step // c_steps
        c0 = (step % c_steps) * BLOCK_K
        kh = tap // KW
        kw = tap % KW
        if SH * SW == 1:
            a = x_desc.load([n0, oh0 - PH + kh * DH, ow0 - PW + kw * DW, c0]).reshape(BLOCK_M, BLOCK_K)
        else:
            # Input row oh * SH + kh * DH - PH = (oh + dh) * SH + ph, 0 <= ph < SH; kept non-negative before // and %
            # (which truncate toward zero compiled and floor under the interpreter) by the whole strides LIFT_*.
            uh = kh * DH - PH + LIFT_H * SH
            uw = kw * DW - PW + LIFT_W * SW
            corner = [n0, oh0 + uh // SH - LIFT_H, uh % SH, ow0 + uw // SW - LIFT_W, (uw % SW) * C + c0]
            a = x_desc.load(corner).reshape(BLOCK_M, BLOCK_K)
        b = w_desc.load([o0, tap * C + c0])
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _box_origin(NB, OH: tl.constexpr, OW: tl.constexpr, OC: tl.constexpr, IMG: tl.constexpr, BH: tl.constexpr,
                BW: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """This program's output box (n0, oh0, ow0) and first channel o0: the channel block fastest, so the programs
    sharing an input box run side by side (L2)."""
    boxes_w: tl.constexpr = (OW + BW - 1) // BW
    boxes_h: tl.constexpr = (OH + BH - 1) // BH
    col_blocks: tl.constexpr = (OC + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    box = pid // col_blocks
    n0 = (box // (boxes_h * boxes_w)) * IMG
    oh0 = ((box // boxes_w) % boxes_h) * BH
    ow0 = (box % boxes_w) * BW
    return n0, oh0, ow0, (pid % col_blocks) * BLOCK_N


@triton.jit(do_not_specialize=["NB"])
def _conv2d_tma_kernel(
    x_desc,  # x as (NB, H, W, C), boxes [IMG, BH, BW, BLOCK_K]; strided, (NB, H / SH, SH, W / SW, SW * C) (above)
    w_desc,  # the weight as (OC, KH * KW * C), boxes [BLOCK_N, BLOCK_K]
    b_ptr,
    y,  # Y_NHWC: a descriptor of y as (NB, POH, POW, OC), boxes [IMG, BH // PKH, BW // PKW, BLOCK_N]; else y's pointer
    r_ptr,  # the residual, with y's strides (HAS_RESIDUAL only)
    NB,  # the batch: the only run-time size
    stride_yn, stride_yc, stride_yh, stride_yw,  # y's strides (the pointer store into NCHW y, the residual's reads)
    negative_slope,
    # the layer's shape; OH, OW: the conv's output (before the pool)
    C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, OC: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    SH: tl.constexpr, SW: tl.constexpr,
    POOL: tl.constexpr, PKH: tl.constexpr, PKW: tl.constexpr,  # "none" | "max" | "avg"; window = stride, floor mode
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,  # added before the activation; only with POOL "none"
    ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    PDL: tl.constexpr,
    Y_NHWC: tl.constexpr,  # y channels_last and contiguous: stored by TMA; else with pointers
    IMG: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,  # the output box: BLOCK_M = IMG * BH * BW pixels
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    BLOCK_M: tl.constexpr = IMG * BH * BW
    tl.static_assert(POOL == "none" or not HAS_RESIDUAL, "a residual is added to the conv's output, never pooled")
    if PDL:  # wait for the previous layer before the first copy of x
        gdc_wait()
    n0, oh0, ow0, o0 = _box_origin(NB, OH, OW, OC, IMG, BH, BW, BLOCK_N)
    acc = _k_loop(x_desc, w_desc, n0, oh0, ow0, o0, C, KH, KW, PH, PW, DH, DW, SH, SW, BLOCK_M, BLOCK_N, BLOCK_K,
                  UPCAST_DOT, INPUT_PRECISION)  # fmt: skip
    if PDL:
        # The next layer may start once every program is here. Not first thing, as the other kernels do: the next
        # layer's programs would take SM slots and shared memory while later waves of this grid still wait for
        # them (64 -> 64 channels at 32x32, 32 images: 19.9 us a replay back to back against 13.4 alone;
        # docs/performance.md, "CNNs").
        gdc_launch_dependents()

    cols = o0 + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < OC, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:  # no pool: the tile's pixels are the stored ones
        r_rows, r_in = _box_offsets(n0, oh0, ow0, NB, OH, OW, IMG, BH, BW, stride_yn, stride_yh, stride_yw)
        r_tile = r_ptr + r_rows[:, None] + (cols * stride_yc)[None, :]
        acc += tl.load(r_tile, mask=r_in[:, None] & (cols < OC)[None, :], other=0.0).to(tl.float32)
    acc = apply_activation(acc, ACTIVATION, negative_slope)
    # The stored box: the pooled one with POOL (the tile's conv rows beyond OH, or past the last whole window,
    # land only in pooled rows past the output, which the store drops).
    STORE_H: tl.constexpr = BH // PKH
    STORE_W: tl.constexpr = BW // PKW
    if POOL != "none":
        acc = _pool_tile(acc, POOL, IMG * BH, BW, PKH, PKW, BLOCK_N)
    POH: tl.constexpr = (OH - PKH) // PKH + 1
    POW: tl.constexpr = (OW - PKW) // PKW + 1
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    out = acc.to(x_desc.dtype)
    if Y_NHWC:
        y.store([n0, oh0 // PKH, ow0 // PKW, o0], out.reshape(IMG, STORE_H, STORE_W, BLOCK_N))
    else:
        rows, inside = _box_offsets(n0, oh0 // PKH, ow0 // PKW, NB, POH, POW, IMG, STORE_H, STORE_W, stride_yn,
                                    stride_yh, stride_yw)  # fmt: skip
        tl.store(y + rows[:, None] + (cols * stride_yc)[None, :], out, mask=inside[:, None] & (cols < OC)[None, :])


# ---- the launcher ----


def eligible(x: torch.Tensor, weight: torch.Tensor, stride, pool: tuple | None, out: torch.Tensor) -> bool:
    """Whether this kernel can run the conv: x and the weight channels_last and contiguous so, with 16-byte aligned
    bases and rows of channels; strided, H and W multiples of the stride and C of a K step (`k_steps`); a pool, if
    any, non-overlapping (stride = window) of a power-of-two size; y NHWC with 16-byte rows, or NCHW with any
    strides."""
    es = x.element_size()
    _, C, H, W = x.shape
    OC = weight.shape[0]
    sh, sw = stride
    nhwc = torch.channels_last
    ok = ((sh, sw) == (1, 1) or (H % sh == 0 and W % sw == 0 and bool(k_steps(C, es, strided=True)))) and (
        x.is_contiguous(memory_format=nhwc)
        and weight.is_contiguous(memory_format=nhwc)
        and (C * es) % 16 == 0
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
    )
    if ok and pool is not None:
        kind, (pkh, pkw), (psh, psw) = pool
        ok = (pkh, pkw) == (psh, psw) and all(k & (k - 1) == 0 for k in (pkh, pkw))
    if ok and y_nhwc(out):
        ok = (OC * out.element_size()) % 16 == 0 and out.data_ptr() % 16 == 0
    return ok


def y_nhwc(out: torch.Tensor) -> bool:
    return out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()


def weight_for(weight: torch.Tensor, stride) -> torch.Tensor:
    """The weight as a model should keep it for fused_conv2d: channels_last (OC, KH, KW, C) where this kernel
    can run the layer (16-byte rows of channels; strided, C a multiple of a K step), so that the tuner may pick it;
    else unchanged."""
    C, es = weight.shape[1], weight.element_size()
    if (C * es) % 16 == 0 and (tuple(stride) == (1, 1) or k_steps(C, es, strided=True)):
        return weight.contiguous(memory_format=torch.channels_last)
    return weight


def descriptors(x, weight, out, geometry: dict, meta: dict, window: tuple[int, int] = (1, 1)):
    """(x's descriptor, the weight's, y (its descriptor where y is NHWC, else out itself), whether y is stored by TMA,
    the grid's programs) for a launch of `meta`'s box and tile; window: the pool's (PKH, PKW)."""
    img, bh, bw, bn, bk = meta["IMG"], meta["BH"], meta["BW"], meta["BLOCK_N"], meta["BLOCK_K"]
    N, OC = x.shape[0], weight.shape[0]
    C, KH, KW = geometry["C"], geometry["KH"], geometry["KW"]
    PKH, PKW = window
    # Strides from the sizes, not the tensors': both are contiguous NHWC, and torch may give a size-1 dim any stride.
    H, W, SH, SW = geometry["H"], geometry["W"], geometry["SH"], geometry["SW"]
    if (SH, SW) == (1, 1):
        x_desc = TensorDescriptor(x, [N, H, W, C], [H * W * C, W * C, C, 1], [img, bh, bw, bk])
    else:  # rows and columns by parity (the module's doc)
        shape = [N, H // SH, SH, W // SW, SW * C]
        x_desc = TensorDescriptor(x, shape, [H * W * C, SH * W * C, W * C, SW * C, 1], [img, bh, 1, bw, bk])
    w_desc = TensorDescriptor(weight, [OC, KH * KW * C], [KH * KW * C, 1], [bn, bk])
    y, store_nhwc = out, y_nhwc(out)
    if store_nhwc:
        _, _, poh, pow_ = out.shape
        y_box = [img, bh // PKH, bw // PKW, bn]
        y = TensorDescriptor(out, [N, poh, pow_, OC], [poh * pow_ * OC, pow_ * OC, OC, 1], y_box)
    boxes = triton.cdiv(N, img) * triton.cdiv(geometry["OH"], bh) * triton.cdiv(geometry["OW"], bw)
    return x_desc, w_desc, y, store_nhwc, boxes * triton.cdiv(OC, bn)


def launch(x, weight, bias, out, negative_slope: float, geometry: dict, pool: tuple, fixed: dict,
           config: LaunchConfig, residual: torch.Tensor | None = None):  # fmt: skip
    """One launch: x (N, C, H, W) and weight (OC, C, KH, KW) channels_last (`eligible`), out the (pooled) output;
    geometry: C, H, W, KH, KW, SH, SW, PH, PW, DH, DW, OH, OW (the conv's output); pool: (POOL, PKH, PKW); residual:
    None, or out's shape and strides (tiles.residual_like), with POOL "none"."""
    meta = {k: v for k, v in config.meta().items() if k != "TMA"}
    POOL, PKH, PKW = pool
    x_desc, w_desc, y, store_nhwc, programs = descriptors(x, weight, out, geometry, meta, (PKH, PKW))
    return grid_launch(_conv2d_tma_kernel, (programs,))(
        x_desc, w_desc, bias if bias is not None else weight, y, residual if residual is not None else out,
        x.shape[0], *out.stride(),
        negative_slope,
        **geometry, OC=weight.shape[0], POOL=POOL, PKH=PKH, PKW=PKW, HAS_RESIDUAL=residual is not None, **fixed,
        Y_NHWC=store_nhwc, **meta,
        **launch_options(fixed),
    )  # fmt: skip


# ---- candidate configs (the tuner times them on CUDA) ----


def box_shape(block_m: int, OH: int, OW: int, pool: tuple[int, int] = (1, 1)) -> tuple[int, int, int]:
    """(IMG, BH, BW) of a BLOCK_M-pixel output box: whole rows where they fit (BW = OW rounded up to a power of
    two, at most BLOCK_M), then as many rows as fit, then whole images. Each at least the pool window."""
    bw = max(pool[1], min(triton.next_power_of_2(OW), block_m))
    bh = max(pool[0], min(triton.next_power_of_2(OH), block_m // bw))
    return max(1, block_m // (bh * bw)), bh, bw


def k_steps(C: int, element_size: int, strided: bool = False) -> list[int]:
    """BLOCK_K candidates: 64 or 128 bytes of channels, 32 or 64 of fp16 (at most C rounded up; 32 for fp32; 64 or 128
    for e4m3); strided, only those that divide C (or the narrowest step where none does), none if that does not
    either. The narrowest step is 16 channels, 32 for e4m3: an fp8 tl.dot takes K >= 32 (sm_90's wgmma; with 16, Triton
    refuses to compile, seen on an H200)."""
    floor = 32 if element_size == 1 else 16
    widest = 128 // element_size if element_size <= 2 else 32
    narrow = 64 // element_size if element_size <= 2 else 32
    fit = triton.next_power_of_2(C)
    ks = sorted({max(floor, min(widest, fit)), max(floor, min(narrow, fit))})
    if strided:
        ks = [k for k in ks if C % k == 0] or [floor] * (C % floor == 0)
    return ks


def cuda_configs(bucket: int, OC: int, C: int, OH: int, OW: int, pool=(1, 1), element_size: int = 2,
                 shared_memory: int = HOPPER_SHARED_MEMORY, strided: bool = False,
                 out_size: int | None = None) -> list[LaunchConfig]:  # fmt: skip
    """Candidates for one layer and M bucket (M = N * OH * OW output pixels): 64- and 128-pixel boxes (128 where M
    is over 64), BLOCK_N all of OC up to 128 and, from 128 channels, 64 (two programs per box), BLOCK_K from
    `k_steps`, 3 or 4 stages where they fit in shared memory. TMA=1 marks them as this kernel's among the tuner's
    candidates.

    128-byte K steps (fp16 BLOCK_K 64, fp32 32) get 2 stages only in tiles of 128 pixels or 128 channels
    (`racy_stages`): with 3 or 4, under triton 3.6, such tiles give wrong outputs in some runs (up to all 100 of 100)
    once the grid runs more than one wave, on every Hopper GPU tried; every config offered here was right in 100 of
    100 on the same layers (docs/performance.md, "CNNs"; probe conv_tma_race)."""
    full = max(16, min(128, triton.next_power_of_2(OC)))
    bns = sorted({full, 64} if full >= 128 else {full})
    ks = k_steps(C, element_size, strided)
    out = []
    for bm in (64, 128):
        if bm > 64 and bucket <= 64:
            continue
        img, bh, bw = box_shape(bm, OH, OW, pool)
        for bn in bns:
            for bk in ks:
                if element_size == 1 and bk >= 128 and bm * bn >= 128 * 128:
                    continue  # e4m3: 128-channel steps in a 128x128 tile spilled (sm_90: 255 registers, 32 B of stack)
                for stages in (2,) if racy_stages(bm, bn, bk, element_size) else (3, 4):
                    # e4m3's epilogue (scales, a residual, the quantizing store) spilled in 64x128 tiles on 4 warps
                    warps = 8 if bm * bn >= (64 if element_size == 1 else 128) * 128 else 4
                    c = LaunchConfig.of(warps, stages, IMG=img, BH=bh, BW=bw, BLOCK_N=bn, BLOCK_K=bk, TMA=1)
                    if shared_memory_bytes(c, element_size, out_size) <= shared_memory:
                        out.append(c)
    return out


def racy_stages(block_m: int, block_n: int, block_k: int, element_size: int) -> bool:
    """Whether a tile gets 2 stages only: 128-byte K steps in a tile of 128 pixels or channels (cuda_configs)."""
    return max(block_m, block_n) >= 128 and block_k * element_size >= 128


def is_tma(config: LaunchConfig) -> bool:
    return ("TMA", 1) in config.kwargs


def shared_memory_bytes(config: LaunchConfig, element_size: int, out_size: int | None = None) -> int:
    """The A and B stages plus the output box staged for the TMA store (`out_size` bytes an element: y's, where it
    is not x's, as an fp8 conv's fp16 output)."""
    bm = config["IMG"] * config["BH"] * config["BW"]
    bn, bk = config["BLOCK_N"], config["BLOCK_K"]
    return config.num_stages * (bm + bn) * bk * element_size + bm * bn * (out_size or element_size)
