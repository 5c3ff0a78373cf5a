"""Pull a small weight buffer into L2 at the start of a kernel, so that later dependent loads hit L2.

A whole-MLP forward at serving sizes is a chain of dependent steps in one or a few programs: each
layer's weights are first touched only when that layer starts, and from HBM each first touch costs
~600-800 ns (vs ~250 ns from L2). Issuing `prefetch.global.L2` for every 128-byte line of the packed
weights at entry overlaps all those misses with the first layer's; the prefetches write
nothing and hold no registers, and a line already in L2 (the steady state of a busy server) costs one
L2 lookup. The first PARTS programs (a split kernel's first row block) issue 1/PARTS of the lines each, so
the number of requests does not grow with the grid and no one program spends its start issuing all of them
(5-7% faster back to back than program 0 issuing every line; docs/performance.md, "Who issues the
prefetch").

Compiled GPUs only: the interpreter has no inline PTX (callers pass LINES=0 there).
"""

from __future__ import annotations

import triton
import triton.language as tl

LINE_BYTES = 128
MAX_LINES = 2048  # 256 KB: 16 prefetches per thread at 4 warps; the digits MLP's fp16 weights are 172 KB


def prefetch_lines(n_bytes: int) -> int:
    """The LINES constexpr that covers n_bytes (a power of two, capped at MAX_LINES)."""
    return min(MAX_LINES, triton.next_power_of_2(triton.cdiv(n_bytes, LINE_BYTES)))


@triton.jit
def prefetch_l2(ptr, n_bytes, LINES: tl.constexpr, PARTS: tl.constexpr):
    """Programs 0 .. PARTS-1 ask L2 for the first min(n_bytes, LINES * 128) bytes from ptr, each a 1/PARTS
    run of lines (LINES and PARTS are powers of two; with fewer lines than parts, one line each)."""
    CHUNK: tl.constexpr = LINES // PARTS if LINES >= PARTS else 1
    pid = tl.program_id(0)
    if (pid < PARTS) & (pid * CHUNK < LINES):
        offset = (pid * CHUNK + tl.arange(0, CHUNK)) * 128
        address = ptr.to(tl.pointer_type(tl.uint8)) + offset
        # setp/@p skips lines past the end; the dummy output exists only because the op must return one,
        # and is_pure=False keeps the compiler from deleting an instruction whose result goes unused.
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            constraints="=r,l,r",
            args=[address, (offset < n_bytes).to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
