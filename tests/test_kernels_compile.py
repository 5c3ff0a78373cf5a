"""The kernels compile for Hopper (sm_90) here, without a GPU: what the interpreter cannot check (inline
PTX, shared memory, the compiled pipeline) fails in CI instead of first on the lent GPU.

Triton compiles to PTX and runs ptxas (shipped in its wheel) with no device present. A subprocess, because
kernels are defined interpreted or compiled once per process (kernels/runtime.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_COMPILE_MLP = r"""
import json, re, subprocess, sys, tempfile, torch, triton
from pathlib import Path
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.mlp as mlp

mlp.check_device = lambda *a: None  # the packed weights stay on the CPU: only their shapes matter here
dtype = getattr(torch, sys.argv[1])
dims = [64, 256, 256, 10]
layers = [mlp.MLPLayer(torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype), act)
          for k, n, act in zip(dims[:-1], dims[1:], ["relu", "gelu_tanh", "none"])]
meta = {**mlp.FusedMLP(layers)._meta_fixed, "PRECISION": "ieee", "BLOCK_M": 16, "BLOCK_N": 64, "STAGES": 2}
ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
runtime = dict(x_ptr=ptr, w_ptr=ptr, b_ptr=ptr, y_ptr=ptr, M="i32", stride_xm="i32", stride_ym="i32")
names = mlp._mlp_kernel.arg_names
signature = {n: runtime.get(n, "constexpr") for n in names}
constexprs = {(names.index(n),): meta[n] for n in names if n not in runtime}
aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # the four pointers, 16-byte aligned as in service
src = ASTSource(mlp._mlp_kernel, signature, constexprs=constexprs, attrs=aligned)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))
ptx = compiled.asm["ptx"]
# ptxas's resource use, from the cubin (cuobjdump ships beside ptxas): STACK > 0 means registers spilled.
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(compiled.asm["cubin"])
    f.flush()
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage.stdout))
print(json.dumps({"prefetches": ptx.count("prefetch.global.L2"), "lines": meta["PREFETCH_LINES"],
                  "w_bytes": meta["W_BYTES"], **{k: int(v) for k, v in fields.items()}}))
"""


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_whole_mlp_kernel_compiles_for_sm90_with_its_l2_prefetch(dtype):
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", _COMPILE_MLP, dtype], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    elem = 2 if dtype == "float16" else 4
    assert got["w_bytes"] == (64 * 256 + 256 * 256 + 256 * 16) * elem  # padded layers, end to end
    # 4 warps = 128 threads; each thread issues lines / 128 prefetches (2048 lines, capped, for both dtypes)
    assert got["lines"] == 2048 and got["prefetches"] == got["lines"] // 128, got
    assert got["STACK"] == 0 and got["LOCAL"] == 0, f"registers spill to local memory: {got}"
