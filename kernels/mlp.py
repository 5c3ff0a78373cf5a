"""The whole MLP in one kernel: every layer's GEMM + bias + activation, activations kept on chip.

For a narrow MLP (every width <= MAX_WIDTH) a forward is a few microseconds of GPU work, less than
one kernel launch costs from Python, and per-layer kernels write each hidden activation to memory and
read it back. Here one program takes BLOCK_M rows of the batch through every layer; nothing but the
input, the weights and the output touches memory. tiny-cuda-nn's fully fused MLP is the model; this
one adds bias, every activation, any batch size and any width up to MAX_WIDTH.

Layers go in pairs, the way a fused FFN runs. For layers (A, B) with hidden width P_MID:

    for each BLOCK_N-wide chunk j of the hidden width:           (a pipelined loop: the chunk's
        mid_j = act_A(h @ W_A[j]^T + b_A[j])      (BLOCK_M, BLOCK_N)   weights are copied to shared
        acc  += mid_j @ W_B[:, j]^T               (BLOCK_M, P_OUT)     memory while the last chunk
    h = act_B(acc + b_B)                                               is multiplied)

so the hidden activation exists only a chunk at a time, in registers, and no weight tile is larger
than (P, BLOCK_N): a whole (256, 256) tile in registers spills (3.4 KB of stack per thread, measured
with ptxas for sm_90). A last unpaired layer runs the same loop with B = the identity, generated in
registers (an exact MMA: x * 1 + 0), which places each chunk at its columns of the output.

Small batches (few row blocks) leave most SMs idle while one program streams every weight through one
SM. There a config may set SPLIT: SPLIT programs per row block share the first step's hidden chunks (for
a pair, a split of the second layer's K), each streaming 1/SPLIT of those weights and storing its fp32
share; the last to arrive sums the shares in a fixed order and runs the rest of the network alone.
With LEAD as well, every program first multiplies a narrow first layer whole (`_dense`, at most
LEAD_MAX_BYTES of weights) and the split moves to the pair after it, so what is left after the programs
meet is that pair's output width: 16 columns for the digits MLP instead of 256 and its last layer.

At entry, the first row block's programs ask L2 for every weight and bias line (`prefetch.py`), each for
1/SPLIT of them, so that a layer's first weight loads and its bias load after the MMA, otherwise HBM misses
taken one layer after another, find them in L2.

mid_j is rounded to the model dtype before the second product, exactly as a per-layer kernel rounds its
stored output, so the whole-MLP kernel and the per-layer kernels compute the same function.

Weights are packed once (`FusedMLP`): each layer's W (nn.Linear layout, (N, K)) zero-padded to
(P_out, P_in), powers of two >= 16 (tl.dot's minimum), laid end to end; biases likewise (zeros where
a layer has none). Padding is exact: padded input columns meet zero weight columns, so whatever an
activation makes of a padded unit (sigmoid(0) = 0.5) adds nothing downstream, and padded outputs are
never stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .activations import DEFAULT_NEGATIVE_SLOPE, apply_activation, check_activation, round_to_bf16
from .interpreter import InterpreterSwitches
from .launch import DIRECT_LAUNCH, DirectLaunch, aligned, constexpr_tail, grid_launch, plain_rows
from .linear import MAX_FAST_BATCH_SIZES, SUPPORTED_DTYPES, m_bucket
from .prefetch import prefetch_l2, prefetch_lines
from .runtime import bf16_on_interpreter, check_device, interpreting
from .tiles import SplitKWorkspace
from .tuning import LaunchConfig, scope_for, tune
from .tuning_background import on_new_picks

MAX_LAYERS = 8
MAX_WIDTH = 256  # padded; the (BLOCK_M, P) fp32 accumulator is 32 registers per thread at 16 x 256
LEAD_MAX_BYTES = 32 * 1024  # a first layer multiplied whole (_dense): 64 registers per thread at 4 warps

SKIP, PAIR, SINGLE = 0, 1, 2  # per-layer schedule: second of a pair, first of a pair, unpaired last layer


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # bf16 under the interpreter: its bf16 tl.dot is wrong; bf16 products are exact in fp32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _bias_act(acc, b_ptr, cols, ACT: tl.constexpr, SLOPE: tl.constexpr, ROUND_BF16: tl.constexpr, dtype):
    acc = acc + tl.load(b_ptr + cols).to(tl.float32)[None, :]
    acc = apply_activation(acc, ACT, SLOPE)
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    return acc.to(dtype)


@triton.jit
def _dense(h, w_ptr, b_ptr, P_IN: tl.constexpr, P_OUT: tl.constexpr, ACT: tl.constexpr, SLOPE: tl.constexpr,
           BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND_BF16: tl.constexpr):  # fmt: skip
    """h (BLOCK_M, P_IN) -> act(h @ W^T + b) (BLOCK_M, P_OUT) in one MMA: the whole (P_IN, P_OUT) weight tile
    at once (LEAD_MAX_BYTES keeps it small enough for registers), no chunk loop and no identity product."""
    k = tl.arange(0, P_IN)
    n = tl.arange(0, P_OUT)
    w = tl.load(w_ptr + n[None, :] * P_IN + k[:, None])
    acc = _dot(h, w, tl.zeros((BLOCK_M, P_OUT), dtype=tl.float32), PRECISION, UPCAST)
    return _bias_act(acc, b_ptr, n, ACT, SLOPE, ROUND_BF16, w_ptr.dtype.element_ty)


@triton.jit
def _pair(h, wa_ptr, ba_ptr, wb_ptr, bb_ptr,
          P_IN: tl.constexpr, P_MID: tl.constexpr, P_OUT: tl.constexpr,
          ACT_A: tl.constexpr, SLOPE_A: tl.constexpr, ACT_B: tl.constexpr, SLOPE_B: tl.constexpr,
          IDENTITY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
          PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND_BF16: tl.constexpr,
          SPLIT: tl.constexpr, part):  # fmt: skip
    """h (BLOCK_M, P_IN) -> act_B(act_A(h @ W_A^T + b_A) @ W_B^T + b_B) (BLOCK_M, P_OUT), model dtype.
    IDENTITY: there is no layer B (P_OUT == P_MID); the result is act_A(h @ W_A^T + b_A).

    SPLIT > 1: this program takes only part `part` of the SPLIT equal runs of hidden chunks and returns
    its fp32 share of layer B's accumulator, before b_B and act_B (the kernel sums the SPLIT shares)."""
    dtype = wa_ptr.dtype.element_ty
    BN: tl.constexpr = BLOCK_N if BLOCK_N < P_MID else P_MID
    CHUNKS: tl.constexpr = (P_MID // BN) // SPLIT
    tl.static_assert(CHUNKS * SPLIT * BN == P_MID, "SPLIT must divide the hidden width's chunks")
    k = tl.arange(0, P_IN)
    n = tl.arange(0, BN)
    o = tl.arange(0, P_OUT)
    acc = tl.zeros((BLOCK_M, P_OUT), dtype=tl.float32)
    first = part * CHUNKS
    # Constant bounds, the part's offset added inside: Triton 3.6's interpreter fails on a loop with a runtime start.
    for chunk in tl.range(0, CHUNKS, num_stages=STAGES):
        mid_cols = (first + chunk) * BN + n
        wa = tl.load(wa_ptr + mid_cols[None, :] * P_IN + k[:, None])  # (P_IN, BN) view of W_A rows
        mid = _dot(h, wa, tl.zeros((BLOCK_M, BN), dtype=tl.float32), PRECISION, UPCAST)
        mid = _bias_act(mid, ba_ptr, mid_cols, ACT_A, SLOPE_A, ROUND_BF16, dtype)
        if IDENTITY:
            # (BN, P_OUT): puts mid's column i at output column mid_cols[i]. Built as fp32 and cast: the
            # interpreter's bool -> bf16 cast gives 0. "ieee": an fp32 mid must not be truncated to tf32.
            eye = tl.where(mid_cols[:, None] == o[None, :], 1.0, 0.0)
            acc = _dot(mid, eye.to(dtype), acc, "ieee", UPCAST)
        else:
            wb = tl.load(wb_ptr + o[None, :] * P_MID + mid_cols[:, None])  # (BN, P_OUT) view of W_B columns
            acc = _dot(mid, wb, acc, PRECISION, UPCAST)
    # One return: triton type-checks every return statement, even one after a return decided at compile time.
    if SPLIT > 1:
        res = acc  # a share: with IDENTITY exact values at this part's columns and zeros elsewhere
    elif IDENTITY:
        res = acc.to(dtype)  # already biased, activated and rounded, chunk by chunk
    else:
        res = _bias_act(acc, bb_ptr, o, ACT_B, SLOPE_B, ROUND_BF16, dtype)
    return res


@triton.jit
def _step(h, w_ptr, b_ptr, MODE: tl.constexpr, P_IN: tl.constexpr, P_MID: tl.constexpr, P_OUT: tl.constexpr,
          ACT_A: tl.constexpr, SLOPE_A: tl.constexpr, ACT_B: tl.constexpr, SLOPE_B: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
          PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND_BF16: tl.constexpr,
          SPLIT: tl.constexpr = 1, part=0):  # fmt: skip
    """Layer l of the schedule; w_ptr/b_ptr point at its packed weights. SKIP returns h unchanged.
    SPLIT > 1 (the first step only): this program's fp32 share, as _pair."""
    if MODE == 1:  # PAIR with layer l + 1, whose weights follow this layer's
        h = _pair(h, w_ptr, b_ptr, w_ptr + P_MID * P_IN, b_ptr + P_MID, P_IN, P_MID, P_OUT,
                  ACT_A, SLOPE_A, ACT_B, SLOPE_B, False, BLOCK_M, BLOCK_N, STAGES,
                  PRECISION, UPCAST, ROUND_BF16, SPLIT, part)  # fmt: skip
    elif MODE == 2:  # SINGLE
        h = _pair(h, w_ptr, b_ptr, w_ptr, b_ptr, P_IN, P_MID, P_MID,
                  ACT_A, SLOPE_A, ACT_A, SLOPE_A, True, BLOCK_M, BLOCK_N, STAGES,
                  PRECISION, UPCAST, ROUND_BF16, SPLIT, part)  # fmt: skip
    return h


@triton.jit(do_not_specialize=["M"])
def _mlp_kernel(
    # ws_ptr, cnt_ptr: the SPLIT programs' fp32 shares and per-row-block arrival counters (SPLIT > 1 only)
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, stride_xm, stride_ym,
    IN_FEATURES: tl.constexpr, OUT_FEATURES: tl.constexpr, NUM_LAYERS: tl.constexpr,
    P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr,
    P5: tl.constexpr, P6: tl.constexpr, P7: tl.constexpr, P8: tl.constexpr, P9: tl.constexpr,
    M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr, M3: tl.constexpr,
    M4: tl.constexpr, M5: tl.constexpr, M6: tl.constexpr, M7: tl.constexpr,
    A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr,
    A4: tl.constexpr, A5: tl.constexpr, A6: tl.constexpr, A7: tl.constexpr, A8: tl.constexpr,
    S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
    S4: tl.constexpr, S5: tl.constexpr, S6: tl.constexpr, S7: tl.constexpr, S8: tl.constexpr,
    P_LAST: tl.constexpr, W_BYTES: tl.constexpr, PREFETCH_LINES: tl.constexpr,
    B_BYTES: tl.constexpr, B_PREFETCH_LINES: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr, LEAD: tl.constexpr,
):  # fmt: skip
    # Layer l maps P_l -> P_l+1 with activation A_l (slope S_l) and schedule M_l; its packed weights
    # start at sum_{i<l} P_i * P_i+1. Every `if NUM_LAYERS > l` is decided at compile time, so h changes
    # width from step to step. P9, A8, S8 are padding so that layer 7 can name "the next layer".
    # every layer's weights start their trip to L2 now, not when the layer starts; the first row block's SPLIT
    # programs share the requests
    if PREFETCH_LINES > 0:
        prefetch_l2(w_ptr, W_BYTES, PREFETCH_LINES, SPLIT)
    if B_PREFETCH_LINES > 0:  # and the biases, each read only after its layer's MMA: one more trip each, cold
        prefetch_l2(b_ptr, B_BYTES, B_PREFETCH_LINES, SPLIT)
    pid_m = tl.program_id(0) // SPLIT
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, P0)
    x = tl.load(
        x_ptr + rows[:, None] * stride_xm + cols[None, :],
        mask=(rows[:, None] < M) & (cols[None, :] < IN_FEATURES),
        other=0.0,
    )
    tl.static_assert(LEAD == 0 or SPLIT > 1, "LEAD is a split schedule")
    if SPLIT == 1:
        h = _step(x, w_ptr, b_ptr, M0, P0, P1, P2, A0, S0, A1, S1, BLOCK_M, BLOCK_N, STAGES, PRECISION, UPCAST,
                  ROUND_BF16)  # fmt: skip
        go: tl.constexpr = True  # constexpr: decided at compile time, so h keeps changing width below
    elif LEAD:
        # A narrow first layer (digits MLP: 64 -> 256, 32 KB in fp16) whole in every program, then the split
        # of the pair after it: each program takes 1/SPLIT of layer 1's outputs and that slice's share of
        # layer 2's pre-activation, so what is left after the programs meet is a P3-wide sum (16 for the
        # digits MLP, against 256 without LEAD) and no more weights (the tuner's pick at every batch bucket up
        # to 256: docs/performance.md, "Narrow MLPs: one kernel").
        MODE_S: tl.constexpr = M1  # the split step: layer 1's; if a pair, layer 2's bias and act follow the sum
        P_OUT0: tl.constexpr = P3 if M1 == 1 else P2
        B_AT: tl.constexpr = P1 + P2
        ACT_S: tl.constexpr = A2
        SLOPE_S: tl.constexpr = S2
        x = _dense(x, w_ptr, b_ptr, P0, P1, A0, S0, BLOCK_M, PRECISION, UPCAST, ROUND_BF16)
        share = _step(x, w_ptr + P0 * P1, b_ptr + P1, M1, P1, P2, P3, A1, S1, A2, S2, BLOCK_M, BLOCK_N, STAGES,
                      PRECISION, UPCAST, ROUND_BF16, SPLIT, tl.program_id(0) % SPLIT)  # fmt: skip
    else:
        # Small batches: one program alone streams every weight through one SM (digits MLP: 172 KB, ~5 us
        # even from L2). Here SPLIT programs per row block share the first step (a pair's hidden
        # chunks are a split of layer B's K), each streaming 1/SPLIT of its weights; each stores its fp32
        # share, and the last to arrive sums the shares in a fixed order (deterministic) and runs the rest
        # of the network alone, as linear.py's split-K: barrier, then an acq_rel arrival on a counter that
        # the last program resets, so the next launch or graph replay needs no memset.
        MODE_S: tl.constexpr = M0  # the split step: layer 0's; if a pair, layer 1's bias and act follow the sum
        P_OUT0: tl.constexpr = P2 if M0 == 1 else P1
        B_AT: tl.constexpr = P1
        ACT_S: tl.constexpr = A1
        SLOPE_S: tl.constexpr = S1
        share = _step(x, w_ptr, b_ptr, M0, P0, P1, P2, A0, S0, A1, S1, BLOCK_M, BLOCK_N, STAGES, PRECISION, UPCAST,
                      ROUND_BF16, SPLIT, tl.program_id(0) % SPLIT)  # fmt: skip
    if SPLIT > 1:
        o = tl.arange(0, P_OUT0)
        tile = tl.arange(0, BLOCK_M)[:, None] * P_OUT0 + o[None, :]
        valid = (rows[:, None] < M) & (o[None, :] < P_OUT0)  # padding rows are neither stored nor read
        tl.store(ws_ptr + tl.program_id(0) * (BLOCK_M * P_OUT0) + tile, share, mask=valid)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel")
        go = arrived == SPLIT - 1
    if go:
        if SPLIT > 1:
            acc = tl.zeros((BLOCK_M, P_OUT0), dtype=tl.float32)
            for s in range(SPLIT):
                part = ws_ptr + (pid_m * SPLIT + s) * (BLOCK_M * P_OUT0) + tile
                acc += tl.load(part, mask=valid, other=0.0, cache_modifier=".cg")  # .cg: never a stale L1 line
            tl.atomic_xchg(cnt_ptr + pid_m, 0)
            if MODE_S == 1:  # a pair's shares: its second layer's bias and activation run on the sum
                h = _bias_act(acc, b_ptr + B_AT, o, ACT_S, SLOPE_S, ROUND_BF16, w_ptr.dtype.element_ty)
            else:
                h = acc.to(w_ptr.dtype.element_ty)  # shares of disjoint columns: the sum is exact
        w = w_ptr
        b = b_ptr
        if NUM_LAYERS > 1:
            w += P0 * P1
            b += P1
            G1: tl.constexpr = 0 if LEAD else M1  # 0 (SKIP): under LEAD, layer 1's step ran before the programs met
            h = _step(h, w, b, G1, P1, P2, P3, A1, S1, A2, S2, BLOCK_M, BLOCK_N, STAGES, PRECISION, UPCAST,
                      ROUND_BF16)  # fmt: skip
        if NUM_LAYERS > 2:
            w += P1 * P2
            b += P2
            h = _step(h, w, b, M2, P2, P3, P4, A2, S2, A3, S3, BLOCK_M, BLOCK_N, STAGES, PRECISION, UPCAST,
                      ROUND_BF16)  # fmt: skip
        if NUM_LAYERS > 3:
            w += P2 * P3
            b += P3
            h = _step(h, w, b, M3, P3, P4, P5, A3, S3, A4, S4, BLOCK_M, BLOCK_N, STAGES, PRECISION, UPCAST,
                      ROUND_BF16)  # fmt: skip
        if NUM_LAYERS > 4:
            w += P3 * P4
            b += P4
            h = _step(h, w, b, M4, P4, P5, P6, A4, S4, A5, S5, BLOCK_M, BLOCK_N, STAGES, PRECISION, UPCAST,
                      ROUND_BF16)  # fmt: skip
        if NUM_LAYERS > 5:
            w += P4 * P5
            b += P5
            h = _step(h, w, b, M5, P5, P6, P7, A5, S5, A6, S6, BLOCK_M, BLOCK_N, STAGES, PRECISION, UPCAST,
                      ROUND_BF16)  # fmt: skip
        if NUM_LAYERS > 6:
            w += P5 * P6
            b += P6
            h = _step(h, w, b, M6, P6, P7, P8, A6, S6, A7, S7, BLOCK_M, BLOCK_N, STAGES, PRECISION, UPCAST,
                      ROUND_BF16)  # fmt: skip
        if NUM_LAYERS > 7:
            w += P6 * P7
            b += P7
            h = _step(h, w, b, M7, P7, P8, P9, A7, S7, A8, S8, BLOCK_M, BLOCK_N, STAGES, PRECISION, UPCAST,
                      ROUND_BF16)  # fmt: skip
        out_cols = tl.arange(0, P_LAST)
        tl.store(
            y_ptr + rows[:, None] * stride_ym + out_cols[None, :],
            h,
            mask=(rows[:, None] < M) & (out_cols[None, :] < OUT_FEATURES),
        )


# ---- the launcher ----


def padded_width(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def schedule(num_layers: int, lead: int = 0) -> list[int]:
    """Layers in pairs; an odd last layer runs alone. 3 layers -> [PAIR, SKIP, SINGLE].
    lead=1: the first layer alone (LEAD configs), then pairs: 3 layers -> [SINGLE, PAIR, SKIP]."""
    modes = [SINGLE] * lead
    while len(modes) + 2 <= num_layers:
        modes += [PAIR, SKIP]
    if len(modes) < num_layers:
        modes.append(SINGLE)
    return modes


@dataclass(frozen=True)
class MLPLayer:
    weight: torch.Tensor  # (N, K), nn.Linear layout
    bias: torch.Tensor | None
    activation: str = "none"
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE


def mlp_fits(widths: Sequence[int]) -> bool:
    """Whether an MLP with these feature widths (input, hidden..., output) runs as one kernel."""
    return 2 <= len(widths) <= MAX_LAYERS + 1 and all(padded_width(w) <= MAX_WIDTH for w in widths)


class FusedMLP:
    """A chain of linear layers (each with bias or not, any activation) run as one kernel per forward.

    The weights are checked and packed once; a call checks x, picks the tuned config for its batch
    bucket (tuned on first use, or read from the tuning cache) and launches once.
    """

    def __init__(self, layers: Sequence[MLPLayer], *, allow_tf32: bool | None = None):
        if not layers:
            raise ValueError("FusedMLP needs at least one layer")
        if len(layers) > MAX_LAYERS:
            raise ValueError(f"FusedMLP runs at most {MAX_LAYERS} layers in one kernel; got {len(layers)}")
        first = layers[0].weight
        widths = [first.shape[1] if first.dim() == 2 else -1]
        for i, layer in enumerate(layers):
            w, b = layer.weight, layer.bias
            if w.dim() != 2:
                raise ValueError(f"layers[{i}].weight must be 2-D (N, K); got shape {tuple(w.shape)}")
            if w.shape[1] != widths[-1]:
                raise ValueError(
                    f"layers[{i}].weight has K={w.shape[1]} but the previous layer outputs {widths[-1]} features"
                )
            if w.dtype not in SUPPORTED_DTYPES or w.dtype != first.dtype or w.device != first.device:
                raise TypeError(
                    f"layers[{i}].weight is {w.dtype} on {w.device}; every layer must be {first.dtype} on "
                    f"{first.device} (float32, float16 or bfloat16)"
                )
            if b is not None and (tuple(b.shape) != (w.shape[0],) or b.dtype != w.dtype or b.device != w.device):
                raise ValueError(f"layers[{i}].bias must be a ({w.shape[0]},) {w.dtype} tensor on {w.device}")
            check_activation(layer.activation)
            widths.append(w.shape[0])
        if not mlp_fits(widths):
            raise ValueError(f"widths {widths} do not fit one kernel (each at most {MAX_WIDTH} after padding)")
        check_device(first, "layers[0].weight")
        self.widths = widths
        self.padded = [padded_width(n) for n in widths]
        self.dtype, self.device = first.dtype, first.device
        self.layers = list(layers)
        self.allow_tf32 = allow_tf32
        self.weights, self.biases = self._pack()
        self._configs: dict[tuple[int, str], LaunchConfig] = {}  # (M bucket, precision) -> tuned config
        self._direct: dict[tuple[int, str], DirectLaunch] = {}  # the same key -> its compiled kernel
        # (rows, TF32 on) -> (launch, grid, weights, biases, shares, counters addresses): __call__'s fast path
        self._fast: dict[tuple[int, bool], tuple] = {}
        self._meta_fixed = self._fixed_meta()
        self.workspace = SplitKWorkspace(self.device)
        # LEAD configs need a first layer small enough to multiply whole (_dense) and a layer after it
        lead_bytes = self.padded[0] * self.padded[1] * first.element_size()
        self._lead_hidden = self.padded[2] if len(layers) >= 2 and lead_bytes <= LEAD_MAX_BYTES else 0
        on_new_picks(self.forget_picks)

    def forget_picks(self) -> None:
        """Drop the remembered configs and their compiled kernels: the next call of each bucket asks the tuner again
        (a pick timed in the background replaced an untimed one, kernels/tuning_background.py)."""
        self._configs.clear()
        self._direct.clear()
        self._fast.clear()

    def _pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        P = self.padded
        w_all = torch.zeros(sum(P[i] * P[i + 1] for i in range(len(self.layers))), dtype=self.dtype, device=self.device)
        b_all = torch.zeros(sum(P[1:]), dtype=self.dtype, device=self.device)
        w_off = b_off = 0
        for i, layer in enumerate(self.layers):
            n, k = layer.weight.shape
            w_all[w_off : w_off + P[i + 1] * P[i]].view(P[i + 1], P[i])[:n, :k] = layer.weight
            if layer.bias is not None:
                b_all[b_off : b_off + n] = layer.bias
            w_off += P[i + 1] * P[i]
            b_off += P[i + 1]
        return w_all, b_all

    def meta_for(self, config: LaunchConfig, precision: str) -> dict:
        """Every constexpr of _mlp_kernel for this config: the layer schedule depends on its LEAD."""
        L = len(self.layers)
        modes = schedule(L, config["LEAD"]) + [SKIP] * (MAX_LAYERS - L)
        return {**self._meta_fixed, **{f"M{i}": modes[i] for i in range(MAX_LAYERS)}, "PRECISION": precision,
                **config.meta()}  # fmt: skip

    def _share_width(self, lead: int) -> int:
        """The split step's output width: a pair's second layer's, or an unpaired layer's own."""
        step = lead  # LEAD: the split starts at layer 1
        return self.padded[step + 2] if schedule(len(self.layers), lead)[step] == PAIR else self.padded[step + 1]

    def _fixed_meta(self) -> dict:
        L = len(self.layers)
        P = self.padded + [16] * (10 - len(self.padded))
        acts = [layer.activation for layer in self.layers] + ["none"] * (MAX_LAYERS + 1 - L)
        slopes = [float(layer.negative_slope) for layer in self.layers] + [0.0] * (MAX_LAYERS + 1 - L)
        meta = dict(IN_FEATURES=self.widths[0], OUT_FEATURES=self.widths[-1], NUM_LAYERS=L, P_LAST=self.padded[-1])
        w_bytes = self.weights.numel() * self.weights.element_size()
        no_ptx = interpreting() or torch.version.hip is not None  # the prefetch is inline PTX
        meta.update(W_BYTES=w_bytes, PREFETCH_LINES=0 if no_ptx else prefetch_lines(w_bytes))
        b_bytes = self.biases.numel() * self.biases.element_size()
        meta.update(B_BYTES=b_bytes, B_PREFETCH_LINES=0 if no_ptx else prefetch_lines(b_bytes))
        meta.update({f"P{i}": P[i] for i in range(10)})
        meta.update({f"A{i}": acts[i] for i in range(MAX_LAYERS + 1)})
        meta.update({f"S{i}": slopes[i] for i in range(MAX_LAYERS + 1)})
        upcast = bf16_on_interpreter(self.dtype)
        meta.update(UPCAST=upcast, ROUND_BF16=upcast)
        return meta

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        tf32 = torch.backends.cuda.matmul.allow_tf32 if self.allow_tf32 is None else self.allow_tf32
        # Direct path once this bucket's kernel is compiled (as FusedLinear's): a cheap test of everything
        # checked below, one lookup of the batch size's launch record, the output, the launch.
        if (
            self._direct
            and plain_rows(x, self.dtype, self.device, self.widths[0])
            and (x_ptr := x.data_ptr()) % 16 == 0
        ):
            M = x.shape[0]
            fast = (self._fast.get((M, tf32)) or self._record(M, tf32)) if M > 0 else None
            if fast is not None:
                if out is None:
                    out = x.new_empty((M, self.widths[-1]))  # x is the MLP's dtype and device, as checked
                else:
                    self._check_out(out, M)
                if out.is_contiguous() and (out_ptr := out.data_ptr()) % 16 == 0:
                    launch, grid, w_ptr, b_ptr, ws_ptr, cnt_ptr = fast  # addresses as ints (launch.py)
                    launch(grid, x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, self.widths[0], self.widths[-1])
                    return out
        if x.dim() != 2 or x.shape[1] != self.widths[0]:
            raise ValueError(f"x must be (M, {self.widths[0]}); got shape {tuple(x.shape)}")
        if x.dtype != self.dtype or x.device != self.device:
            raise TypeError(f"x is {x.dtype} on {x.device}; the MLP is {self.dtype} on {self.device}")
        if x.stride(1) != 1:
            raise ValueError(f"x rows must be contiguous (stride 1 along features); got strides {x.stride()}")
        M = x.shape[0]
        if out is None:
            out = torch.empty((M, self.widths[-1]), dtype=self.dtype, device=self.device)
        else:
            self._check_out(out, M)
        if M == 0:
            return out
        precision = "tf32" if (tf32 and self.dtype == torch.float32) else "ieee"
        config = self._config(x, out, precision)
        compiled = self._launch(x, out, precision, config)
        if not interpreting() and DIRECT_LAUNCH and aligned(x, out):
            values = self.meta_for(config, precision)
            self._direct[(m_bucket(M), precision)] = DirectLaunch(compiled, constexpr_tail(_mlp_kernel, values))
        return out

    def _check_out(self, out: torch.Tensor, M: int) -> None:
        if out.shape != (M, self.widths[-1]) or out.dtype != self.dtype or out.stride(1) != 1:
            raise ValueError(f"out must be a ({M}, {self.widths[-1]}) {self.dtype} tensor with contiguous rows")

    def _record(self, M: int, tf32: bool) -> tuple | None:
        """The launch record of M rows, (launch, grid, and the addresses of the packed weights, biases, shares
        and counters), kept for the next call of that size; None while the bucket has no compiled kernel."""
        key = (m_bucket(M), "tf32" if (tf32 and self.dtype == torch.float32) else "ieee")
        launch = self._direct.get(key)
        if launch is None:
            return None
        grid, ws, cnt = self._grid_and_workspace(M, self._configs[key])
        record = (launch, grid, self.weights.data_ptr(), self.biases.data_ptr(), ws.data_ptr(), cnt.data_ptr())
        if len(self._fast) < MAX_FAST_BATCH_SIZES:
            self._fast[(M, tf32)] = record
        return record

    def _grid_and_workspace(self, M: int, config: LaunchConfig) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Programs to launch, and the shares/counters buffers (SplitKWorkspace: 1 element each when SPLIT
        is 1; outgrown buffers are kept, so older records stay valid)."""
        row_blocks, split = triton.cdiv(M, config["BLOCK_M"]), config["SPLIT"]
        ws, cnt = self.workspace.get(row_blocks, config["BLOCK_M"] * self._share_width(config["LEAD"]), split)
        return row_blocks * split, ws, cnt

    def _launch(self, x, out, precision, config: LaunchConfig):
        grid, ws, cnt = self._grid_and_workspace(x.shape[0], config)
        return grid_launch(_mlp_kernel, (grid,))(
            x, self.weights, self.biases, out, ws, cnt, x.shape[0], x.stride(0), out.stride(0),
            **self.meta_for(config, precision),
        )  # fmt: skip

    def _config(self, x, out, precision) -> LaunchConfig:
        if interpreting():
            choice = INTERPRETER.choice
            lead = choice.lead if self._lead_hidden else 0
            return LaunchConfig.of(num_warps=4, num_stages=1, BLOCK_M=16, BLOCK_N=choice.block_n, STAGES=1,
                                   SPLIT=choice.split, LEAD=lead)  # fmt: skip
        bucket = m_bucket(x.shape[0])
        hit = self._configs.get((bucket, precision))
        if hit is None:
            key = f"{self.widths}|{[layer.activation for layer in self.layers]}|{self.dtype}|{precision}|m{bucket}"
            scope = scope_for("mlp", _mlp_kernel)  # with every helper it calls (tuning.source_hash)
            candidates = cuda_configs(bucket, self.padded[1], x.element_size(), self._lead_hidden)
            hit = tune(scope, key, candidates, lambda c: self._launch(x, out, precision, c))
            self._configs[(bucket, precision)] = hit
        return hit


# ---- candidate configs (the tuner times them on CUDA) ----


def cuda_configs(
    bucket: int, hidden: int = MAX_WIDTH, element_size: int = 2, lead_hidden: int = 0
) -> list[LaunchConfig]:
    """BLOCK_M from 16 (batch 1-16 fills one MMA tile) to 64. BLOCK_N sets the hidden chunk: each chunk
    is a dependent step (wait for its weights, two MMAs, an epilogue), so wide chunks mean fewer steps
    (digits MLP at BLOCK_N 32: 8 + 1 steps). 8 warps split the
    second MMA's 256 output columns further. Configs over the shared-memory limit fail and are skipped.

    `hidden`: the padded output width of the first layer. Up to 64 row blocks (bucket <= 1024 at BLOCK_M
    16) also get SPLIT = 2, 4, 8 programs per row block sharing the first step's hidden chunks, where the
    split divides them; the first step holds most of the weights (digits MLP: 80 of 84 k). fp32 programs
    keep 2+ chunks each: with one, ptxas for sm_90 spills (255 registers and 40-64 B of stack per thread
    at 32 and 64 wide; 16-bit ones use 112-180 registers and no stack).

    `lead_hidden` (0: none): the padded output width of the second layer, given when the first layer may
    run whole in every program (LEAD, see _mlp_kernel); LEAD configs split the pair after it, 1-2 hidden
    chunks per program (fewer, more weight per program: 2 programs are 1.4 us slower than 8), up to
    16 programs of one 16-wide chunk."""
    configs = []
    for bm in (16, 32, 64):
        if bm > max(16, 2 * bucket):  # a tile more than half padding is never the fastest
            continue
        for bn in (32, 64, 128):
            for warps in (4, 8):
                stages = 3 if bn == 32 else 2
                configs.append(
                    LaunchConfig.of(
                        num_warps=warps, num_stages=1, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, SPLIT=1, LEAD=0
                    )
                )
    if bucket <= 1024:
        for bn in (32, 64):
            chunks = hidden // min(bn, hidden)
            for split in (2, 4, 8):
                if chunks % split == 0 and (element_size < 4 or chunks // split >= 2):
                    configs.append(
                        LaunchConfig.of(
                            num_warps=4, num_stages=1, BLOCK_M=16, BLOCK_N=bn, STAGES=2, SPLIT=split, LEAD=0
                        )
                    )
        for bm in (16, 32, 64) if lead_hidden else ():
            if bm > max(16, 2 * bucket):
                continue
            # 16 programs of one 16-wide chunk each, at 16-row tiles only: they beat 8 programs by 0.1-0.35 us at
            # batches 1-32 and lose at 256; 8 warps lose everywhere (docs/performance.md, "Narrow MLPs")
            for bn, split in ((32, 8), (32, 4), (64, 4), (16, 16)):
                chunks = lead_hidden // min(bn, lead_hidden)
                if chunks % split == 0 and (split < 16 or bm == 16):
                    configs.append(
                        LaunchConfig.of(
                            num_warps=4, num_stages=1, BLOCK_M=bm, BLOCK_N=bn, STAGES=2, SPLIT=split, LEAD=1
                        )
                    )
    return configs


# ---- under the interpreter: one config, from choices that tests change (interpreter.py) ----


@dataclass(frozen=True)
class InterpreterChoice:
    """What FusedMLP runs under the interpreter: one 16-row tile. Its cost is per program and per chunk."""

    block_n: int = 32  # the hidden chunk; tests take 16, so that every width over 16 takes several chunks
    split: int = 1  # 2 or 4 (dividing the first step's chunks): the shared first step runs
    lead: int = 0  # 1 (with a split): LEAD runs, where the MLP allows it


INTERPRETER = InterpreterSwitches(InterpreterChoice())
