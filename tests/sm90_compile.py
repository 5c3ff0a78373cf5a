"""Compile a Triton kernel for Hopper (sm_90) without a GPU and read ptxas's resource use: the helper of
test_kernels_compile.py's subprocess scripts (run with TRITON_INTERPRET=0; see that file for why)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Without a GPU (CI's 2-core machine) a sweep compiles every SAMPLE_EVERY-th candidate of each layer, a different
# third layer by layer (`offset`), and each layer's last: the conv and TMA conv sweeps took 186 and 209 s of the CPU
# suite compiling all of them (issue 51). On a GPU host (tests/gpu_suite.sh's kernels-a part), or with
# FUSEDSERVE_SM90_EVERY=1, every candidate is compiled.
SAMPLE_EVERY = 3


def every_candidate() -> bool:
    """Whether the sweeps compile every candidate (a GPU host, or FUSEDSERVE_SM90_EVERY=1), or a sample."""
    import torch

    return os.environ.get("FUSEDSERVE_SM90_EVERY") == "1" or torch.cuda.is_available()


def sample(configs, offset: int = 0) -> list:
    """The candidates of one layer that a compile sweep compiles here (see SAMPLE_EVERY)."""
    configs = list(configs)
    if os.environ.get("FUSEDSERVE_SM90_EVERY") == "1" or len(configs) <= 2:
        return configs
    picked = configs[offset % SAMPLE_EVERY :: SAMPLE_EVERY]
    return picked if picked and picked[-1] is configs[-1] else [*picked, configs[-1]]


def sampled(configs, offset: int = 0) -> list[tuple]:
    """Each of one layer's candidates with whether the sweep compiles it here (`sample`): for a sweep that checks
    every config offered and compiles the sample. Picked by position, so an equal config offered twice is compiled
    once."""
    configs = list(configs)
    picked = {id(c) for c in sample(configs, offset)}
    return [(c, id(c) in picked) for c in configs]


def compile_sm90(
    kernel,
    runtime: dict[str, str],
    meta: dict,
    pointers: int,
    num_warps: int,
    num_stages: int,
    divisible=(),
    sass: bool = False,
):
    """(PTX text, {REG, STACK, SHARED, LOCAL}, and LOOPS with `sass`) of `kernel` compiled with `runtime` argument
    types (the rest are constexprs taken from `meta`), its first `pointers` arguments 16-byte aligned as the
    service's are, and the integers named in `divisible` multiples of 16, as Triton specializes them at a launch
    (a stride of 1 it makes a constant: pass it in `meta`). STACK > 0 means registers spilled; LOOPS: the
    machine instructions in each loop (sass_loops), only when asked: disassembling a cubin (cuobjdump -sass) takes
    ~0.9 CPU-s whatever its size, most of a sweep's time where Triton's cache holds the compiled kernels."""
    names = kernel.arg_names
    signature = {n: runtime.get(n, "constexpr") for n in names}
    defaults = {n: v.default for n, v in inspect.signature(kernel.fn).parameters.items()
                if v.default is not inspect.Parameter.empty}  # fmt: skip
    constexprs = {(names.index(n),): meta[n] if n in meta else defaults[n] for n in names if n not in runtime}
    aligned = {(i,): [["tt.divisibility", 16]] for i in [*range(pointers), *(names.index(n) for n in divisible)]}
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"  # ships beside ptxas
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
        loops = {}
        if sass:
            listing = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
            loops["LOOPS"] = sass_loops(listing)
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage.stdout))
    return compiled.asm["ptx"], {**{k: int(v) for k, v in fields.items()}, **loops}


def compile_gemm(kernel, ptr: str, meta: dict, num_warps: int, num_stages: int, sass: bool = False):
    """compile_sm90 for linear.py's MMA kernel or the GEMV (they share one signature) with `ptr` operands
    ("*fp16", ...), as a launch with contiguous operands specializes them: unit strides constant, the 7 pointers
    aligned (the residual's too, which is y itself where there is none), and sizes and row strides multiples of
    16, or, where meta gives K_ALIGN or N_ALIGN below 16, of that only (K = 1000: K_ALIGN 8)."""
    runtime = dict(x_ptr=ptr, w_ptr=ptr, b_ptr=ptr, y_ptr=ptr, r_ptr=ptr, ws_ptr="*fp32", cnt_ptr="*i32", M="i32",
                   N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_ym="i32", negative_slope="fp32",
                   M_BUCKET="i32")  # fmt: skip
    meta = {"stride_xk": 1, "stride_wk": 1, "stride_yn": 1, "K_ALIGN": 16, "N_ALIGN": 16, **meta}
    hinted_by = {"K": "K_ALIGN", "stride_xm": "K_ALIGN", "stride_wn": "K_ALIGN", "N": "N_ALIGN", "stride_ym": "N_ALIGN"}
    divisible = [name for name, align in hinted_by.items() if meta[align] == 16]
    return compile_sm90(kernel, runtime, meta, 7, num_warps, num_stages, divisible=divisible, sass=sass)


def sass_loops(sass: str) -> list[int]:
    """Machine instructions in each loop of a cuobjdump -sass listing (a branch back to an earlier address:
    the loop's first instruction up to that branch), in address order."""
    loops = []
    for at, target in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)", sass):
        if int(target, 16) < int(at, 16):
            loops.append((int(at, 16) - int(target, 16)) // 16 + 1)  # sm_90 instructions are 16 bytes
    return loops


def pdl_order(ptx: str) -> dict:
    """Where a PDL kernel's grid-dependency instructions sit in its PTX (line numbers; program order for the
    straight-line code before the main loop): waits and launch_dependents counted, the first wait, the first
    global load and the first write to global memory (store, atomic, or tensor-map write); the first
    launch_dependents."""
    lines = ptx.splitlines()

    def first(pattern: str) -> int:
        return next((i for i, line in enumerate(lines) if re.search(pattern, line)), len(lines))

    return {
        "waits": ptx.count("griddepcontrol.wait"),
        "launches": ptx.count("griddepcontrol.launch_dependents"),
        "wait_at": first(r"griddepcontrol\.wait"),
        "launch_at": first(r"griddepcontrol\.launch_dependents"),
        "first_load": first(r"\bld\.global"),
        "first_store": first(r"\b(st\.global|atom\.global|red\.global|tensormap\.replace)"),
    }


@triton.jit
def bare_tile_loop(x_ptr, w_ptr, y_ptr, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """The least a K loop of y = x @ W^T tiles can be: no masks, no split, no epilogue; the yardstick for
    linear.py's loop (test_kernels_compile.py)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_tile = w_ptr + offs_k[:, None] + offs_n[None, :] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K // BLOCK_K):
        acc = tl.dot(tl.load(x_tile + k * BLOCK_K), tl.load(w_tile + k * BLOCK_K), acc, input_precision=INPUT_PRECISION)
    tl.store(y_ptr + offs_m[:, None] * K + offs_n[None, :], acc)
