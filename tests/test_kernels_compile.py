"""The kernels compile for Hopper (sm_90) here, without a GPU: what the interpreter cannot check (inline
PTX, shared memory, the compiled pipeline) fails in CI instead of first on the lent GPU.

Triton compiles to PTX and runs ptxas (shipped in its wheel) with no device present. In another process, because
kernels are defined interpreted or compiled once per process (kernels/runtime.py): a forked child of one compile
host per test process (_compiled), which imported torch, Triton and the kernels, compiled, once.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# The compile host: imports once what every compile script imports (torch is ~4 of the 5 CPU-s a fresh
# `python -c script` took on the 2-core machine, for each of the 24 scripts of the CPU suite), then runs each script
# it is sent in a child forked for it, as `python -c script arg` would: its own sys.argv, environment, stdout and
# stderr (files), module state (a script's monkeypatch dies with its child) and exit status.
_HOST = r"""
import json, os, sys, traceback
import torch, triton, kernels, tests.sm90_compile
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            os.environ.clear()
            os.environ.update(req["env"])
            sys.argv = ["-c", *req["argv"]]
            exec(compile(req["script"], "<string>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""
_host: list[subprocess.Popen] = []  # this process's compile host, started at the first script


def _compile_env() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    if torch.cuda.is_available():  # the GPU suite compiles every candidate (tests/sm90_compile.py, sample)
        env.setdefault("FUSEDSERVE_SM90_EVERY", "1")
    return env


def _stop_host(host: subprocess.Popen, log: Path) -> None:
    host.stdin.close()  # its loop ends at the end of its input
    try:
        host.wait(10)
    except subprocess.TimeoutExpired:
        host.kill()
    log.unlink(missing_ok=True)


def _compiled(script: str, arg: str) -> list[dict]:
    """Run a compile script in compiled mode, as `python -c script arg` would (in a child of the compile host), with
    `arg` as its sys.argv[1] (the dtype, for the scripts below); one JSON line per config it printed."""
    env = _compile_env()
    log = Path(tempfile.gettempdir()) / f"fusedserve-compile-host-{os.getpid()}.log"
    if not _host or _host[0].poll() is not None:
        with open(log, "w") as stderr:
            _host[:] = [subprocess.Popen([sys.executable, "-c", _HOST], env=env, cwd=REPO, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr, text=True)]  # fmt: skip
        atexit.register(_stop_host, _host[0], log)
    host = _host[0]
    with tempfile.TemporaryDirectory(prefix="fusedserve-compile-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        host.stdin.write(json.dumps({"script": script, "argv": [arg], "env": env, "stdout": str(out),
                                     "stderr": str(err)}) + "\n")  # fmt: skip
        host.stdin.flush()
        reply = host.stdout.readline()
        assert reply, f"the compile host exited ({host.poll()}):\n{log.read_text()[-3000:]}"
        assert json.loads(reply)["rc"] == 0, err.read_text()[-3000:]
        return [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]


_COMPILE_MLP = r"""
import json, sys, torch
import kernels.mlp as mlp
from tests.sm90_compile import compile_sm90, pdl_order, sampled

mlp.check_device = lambda *a: None  # the packed weights stay on the CPU: only their shapes matter here
dtype = getattr(torch, sys.argv[1])
dims = [64, 256, 256, 10]
layers = [mlp.MLPLayer(torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype), act)
          for k, n, act in zip(dims[:-1], dims[1:], ["relu", "gelu_tanh", "none"])]
model = mlp.FusedMLP(layers)
ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
runtime = dict(x_ptr=ptr, w_ptr=ptr, b_ptr=ptr, y_ptr=ptr, ws_ptr="*fp32", cnt_ptr="*i32", M="i32",
               stride_xm="i32", stride_ym="i32")
# The config the digits MLP ran before splits existed, and every split config offered to batches of 1 and 256
# (LEAD ones too: the first layer's whole weight tile in registers must not spill).
configs = [mlp.LaunchConfig.of(num_warps=4, num_stages=1, BLOCK_M=16, BLOCK_N=64, STAGES=2, SPLIT=1, LEAD=0)]
configs += [c for c in mlp.cuda_configs(1, 256, dtype.itemsize, model._lead_hidden) if c["SPLIT"] > 1]
configs += [c for c in mlp.cuda_configs(256, 256, dtype.itemsize, model._lead_hidden) if c["LEAD"]]
for config, compiled in sampled(configs):  # every config named; the sample compiled
    meta = model.meta_for(config, "ieee")
    if not compiled:
        print(json.dumps({"config": config.meta(), "compiled": False}))
        continue
    ptx, usage = compile_sm90(mlp._mlp_kernel, runtime, meta, 6, config.num_warps, config.num_stages)
    print(json.dumps({"config": config.meta(), "compiled": True, "prefetches": ptx.count("prefetch.global.L2"),
                      "lines": meta["PREFETCH_LINES"], "w_bytes": meta["W_BYTES"], "b_lines": meta["B_PREFETCH_LINES"],
                      "b_bytes": meta["B_BYTES"], **usage}))
"""


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_whole_mlp_kernel_compiles_for_sm90_with_its_l2_prefetch(dtype):
    """The configs offered (every one compiled on a GPU host, a sample without a GPU: tests/sm90_compile.py)."""
    from tests.sm90_compile import every_candidate

    offered = _compiled(_COMPILE_MLP, dtype)
    splits = sorted(r["config"]["SPLIT"] for r in offered if not r["config"]["LEAD"])
    # fp32 keeps 2+ chunks per program, so its splits stop one short of fp16's
    assert splits == ([1, 2, 2, 4, 4, 8] if dtype == "float16" else [1, 2, 2, 4]), splits
    leads = sorted((r["config"]["BLOCK_M"], r["config"]["SPLIT"]) for r in offered if r["config"]["LEAD"])
    # LEAD for fp16 only (fp32's first layer is 64 KB): batch 1 at BLOCK_M 16, batch 256 at 16, 32 and 64
    # (16 programs at 16 only)
    want = sorted([(16, 8), (16, 4), (16, 4), (16, 16)] * 2 + [(bm, s) for bm in (32, 64) for s in (8, 4, 4)])
    assert leads == (want if dtype == "float16" else []), leads
    results = [r for r in offered if r["compiled"]]
    assert len(results) == len(offered) if every_candidate() else len(results) >= 2, results
    elem = 2 if dtype == "float16" else 4
    for got in results:
        assert got["w_bytes"] == (64 * 256 + 256 * 256 + 256 * 16) * elem  # padded layers, end to end
        assert got["b_bytes"] == (256 + 256 + 16) * elem  # the biases, packed likewise
        # 4 warps = 128 threads; each of the SPLIT programs that share the requests issues lines / SPLIT
        # weight lines (2048 lines, capped, for both dtypes), so each thread lines / SPLIT / 128 of them (at
        # least one), and one for the biases (1056 or 2112 bytes: 16 or 32 lines, fewer than threads, so
        # each thread asks for one)
        assert got["lines"] == 2048 and got["b_lines"] == 8 * elem, got
        threads = 32 * got["config"]["num_warps"]
        assert got["prefetches"] == max(1, got["lines"] // got["config"]["SPLIT"] // threads) + 1, got
        assert got["STACK"] == 0 and got["LOCAL"] == 0, f"registers spill to local memory: {got}"


_COMPILE_PERSISTENT = r"""
import json, sys, torch
import kernels.linear_persistent as lp
from tests.sm90_compile import compile_sm90, pdl_order

dtype = getattr(torch, sys.argv[1])
ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
runtime = dict(x_ptr=ptr, w_ptr=ptr, b_ptr=ptr, y_ptr=ptr, M="i32", N="i32", K="i32", stride_xm="i32",
               stride_wn="i32", stride_ym="i32", negative_slope="fp32")
fixed = dict(HAS_BIAS=True, ACTIVATION="gelu_tanh", INPUT_PRECISION="tf32" if dtype == torch.float32 else "ieee",
             UPCAST_DOT=False, ROUND_BF16=False, PDL=True)  # as launched on sm_90
for config in lp.cuda_configs(dtype.itemsize):
    meta = lp.constexprs(fixed, config, 132)
    ptx, usage = compile_sm90(lp._linear_persistent_kernel, runtime, meta, 4, config.num_warps, config.num_stages)
    print(json.dumps({"config": config.meta(), "tma_loads": ptx.count("cp.async.bulk.tensor"),
                      "wgmma": ptx.count("wgmma.mma_async"), **pdl_order(ptx), **usage}))
"""


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_persistent_tma_kernel_compiles_for_sm90_without_spills(dtype):
    results = _compiled(_COMPILE_PERSISTENT, dtype)
    assert len(results) == (5 if dtype == "float16" else 4), results
    for got in results:
        # TMA copies and warpgroup MMAs, or it is not the kernel this module is for
        assert got["tma_loads"] > 0 and got["wgmma"] > 0, got
        assert got["STACK"] == 0 and got["LOCAL"] == 0, f"registers spill to local memory: {got}"
        # one wait, before anything is written (the descriptors go to scratch memory first thing)
        assert got["waits"] == 1 and got["launches"] == 1 and got["wait_at"] < got["first_store"], got


_COMPILE_LINEAR = r"""
import json, sys, torch
import kernels.linear as linear
from tests.sm90_compile import bare_tile_loop, compile_gemm, compile_sm90, pdl_order, sample

dtype = getattr(torch, sys.argv[1])
ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
precision = "tf32" if dtype == torch.float32 else "ieee"
fixed = dict(HAS_BIAS=True, HAS_RESIDUAL=False, ACTIVATION="relu", INPUT_PRECISION=precision, UPCAST_DOT=False,
             ROUND_BF16=False, PDL=True)  # PDL: as launched on sm_90
for config in sample(c for c in linear.cuda_configs(1024, 1024, 1024, 132, dtype.itemsize) if c["SPLIT_K"] == 1):
    ptx, usage = compile_gemm(linear._linear_kernel, ptr, {**fixed, **config.meta()}, config.num_warps,
                              config.num_stages, sass=True)
    tile = {k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    bare_meta = {**tile, "INPUT_PRECISION": precision}
    _, bare = compile_sm90(bare_tile_loop, dict(x_ptr=ptr, w_ptr=ptr, y_ptr="*fp32", K="i32"), bare_meta, 3,
                           config.num_warps, config.num_stages, divisible=("K",), sass=True)
    # K = 1000, N = 500 (multiples of 8 and 4, not of 16), as the launcher hints them
    ptx8, usage8 = compile_gemm(linear._linear_kernel, ptr, {**fixed, **config.meta(), "K_ALIGN": 8, "N_ALIGN": 4},
                                config.num_warps, config.num_stages, sass=True)
    print(json.dumps({"config": config.meta(), "copies": ptx.count("cp.async.cg.shared.global"),
                      "wgmma": ptx.count("wgmma.mma_async"), "bare_loops": bare["LOOPS"], **pdl_order(ptx), **usage,
                      "copies_k1000": ptx8.count("cp.async.cg.shared.global"), "loops_k1000": usage8["LOOPS"]}))
"""


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_linear_kernel_compiles_for_sm90_with_a_k_loop_as_lean_as_a_bare_one(dtype):
    """Each unsplit candidate at 1024^3 (a sample of them without a GPU: tests/sm90_compile.py)."""
    from tests.sm90_compile import every_candidate

    results = _compiled(_COMPILE_LINEAR, dtype)
    # 5 unsplit candidates for fp16, fewer for fp32 (its biggest tiles do not fit); a sample keeps 2 or more
    assert len(results) >= (3 if every_candidate() else 2), results
    for got in results:
        assert got["copies"] > 0 and got["wgmma"] > 0, got  # cp.async pipeline into Hopper's warpgroup MMA
        assert got["STACK"] == 0 and got["LOCAL"] == 0, f"registers spill to local memory: {got}"
        # PDL: the bias (a weight) is requested before the wait for the previous layer, nothing written before it
        assert got["waits"] == 1 and got["launches"] == 1, got
        assert got["first_load"] < got["wait_at"] < got["first_store"], got
        # The K loop costs what a bare tile loop (no masks, split or epilogue) costs at the same tile, within
        # 20% (the K mask: 93 instructions against 80 at 128x256x64, Triton 3.6). Pointer tiles incremented
        # every step made it 204 against 117 (64x128x128 fp16).
        assert len(got["LOOPS"]) == len(got["bare_loops"]) == 1, got
        assert got["LOOPS"][0] <= 1.2 * got["bare_loops"][0], got
        # K = 1000: the same 16-byte cp.async pipeline (for fp16 rows of 1000 elements, 2,000 bytes) and a loop
        # within 20% of the bare one; unhinted it was 2-byte loads and 385 instructions a step (64x64x64 fp16)
        assert got["copies_k1000"] > 0 and got["loops_k1000"][0] <= 1.2 * got["bare_loops"][0], got


_COMPILE_ACTIVATIONS = r"""
import json, sys, torch
import kernels.linear as linear
from tests.sm90_compile import compile_gemm

config = linear.LaunchConfig.of(8, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=1)
for act in ("gelu", "gelu_tanh", "silu", "sigmoid", "tanh"):
    fixed = dict(HAS_BIAS=True, HAS_RESIDUAL=False, ACTIVATION=act, INPUT_PRECISION="ieee", UPCAST_DOT=False,
                 ROUND_BF16=False, PDL=True)
    ptx, _ = compile_gemm(linear._linear_kernel, "*fp16", {**fixed, **config.meta()}, 8, 4)
    print(json.dumps({"act": act, "ex2": ptx.count("ex2.approx.ftz.f32"), "rcp": ptx.count("rcp.approx.ftz.f32"),
                      "other": sum(ptx.count(op) for op in ("ex2.approx.f32", "div.full", "div.rn", "div.approx"))}))
"""


def test_activations_compile_to_bare_special_function_instructions():
    """A 128x128 tile over 8 warps is 64 elements a thread: each transcendental activation takes one ex2 and one rcp
    an element, both the bare ftz forms, and no division or ex2 with subnormal fix-ups (with those, the erf GELU
    epilogue was 32 instructions an element against 20, and 4096x768 -> 3072 took 59.3 us against 48.8; H100)."""
    for got in _compiled(_COMPILE_ACTIVATIONS, "float16"):
        assert got["ex2"] == 64 and got["rcp"] == 64 and got["other"] == 0, got


_COMPILE_LINEAR_SKINNY = r"""
import json, sys, torch
import kernels.linear as linear
from tests.sm90_compile import compile_gemm, sampled

dtype = getattr(torch, sys.argv[1])
ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
fixed = dict(HAS_BIAS=True, HAS_RESIDUAL=False, ACTIVATION="relu", INPUT_PRECISION="ieee", UPCAST_DOT=False,
             ROUND_BF16=False, PDL=True)
seen = []
for N, K in ((4096, 4096), (1024, 4096)):  # the wide MLP's layers at batch 32: every split the list offers
    seen += [c for c in linear.cuda_configs(32, N, K, 132, dtype.itemsize) if c not in seen]
for config, compiled in sampled(seen):  # every candidate named; the sample compiled
    if not compiled:
        print(json.dumps({"config": config.meta(), "compiled": False}))
        continue
    ptx, usage = compile_gemm(linear._linear_kernel, ptr, {**fixed, **config.meta()}, config.num_warps,
                              config.num_stages)
    print(json.dumps({"config": config.meta(), "compiled": True,
                      "mma": ptx.count("mma.sync") + ptx.count("wgmma.mma_async"), **usage}))
"""


def test_linear_kernel_compiles_every_skinny_batch_candidate_for_sm90_without_spills():
    """Batches of 17-64 rows: 32- and 64-row tiles, 64- to 256-deep K steps, split-K. None may spill (every one
    compiled on a GPU host, a sample without a GPU: tests/sm90_compile.py)."""
    from tests.sm90_compile import every_candidate

    offered = _compiled(_COMPILE_LINEAR_SKINNY, "float16")
    assert len(offered) >= 12, offered
    assert {r["config"]["BLOCK_K"] for r in offered} == {64, 128, 256}, offered
    results = [r for r in offered if r["compiled"]]
    assert len(results) == len(offered) if every_candidate() else len(results) >= 4, results
    for got in results:
        assert got["mma"] > 0, got
        assert got["STACK"] == 0 and got["LOCAL"] == 0, f"registers spill to local memory: {got}"


_COMPILE_GEMV = r"""
import json, sys, torch
import kernels.linear_gemv as gemv
from tests.sm90_compile import compile_gemm, pdl_order

dtype = getattr(torch, sys.argv[1])
ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
fixed = dict(HAS_BIAS=True, HAS_RESIDUAL=False, ACTIVATION="gelu_tanh", INPUT_PRECISION="ieee", UPCAST_DOT=False,
             ROUND_BF16=False, PDL=True)  # PDL: as launched on sm_90
for config in gemv.cuda_configs(4096, 4096, 132):
    meta = {**fixed, **gemv.kernel_meta(config)}
    ptx, usage = compile_gemm(gemv._gemv_kernel, ptr, meta, config.num_warps, config.num_stages)
    print(json.dumps({"config": config.meta(), "wide_loads": ptx.count("ld.global.v4") + ptx.count("cp.async.cg"),
                      "narrow_loads": ptx.count("ld.global.b16"), "mma": ptx.count("mma."), **pdl_order(ptx),
                      **usage}))
"""


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gemv_kernel_compiles_for_sm90_with_wide_loads_and_without_spills(dtype):
    results = _compiled(_COMPILE_GEMV, dtype)
    assert len(results) == 4, results
    for got in results:
        # 16-byte loads of W (the one 2-byte load is the bias: an element per thread), no tensor-core MMA (the
        # point of this kernel), and nothing spilled. Unspecialized strides gave 69 2-byte loads and spills.
        assert got["wide_loads"] >= 8 and got["narrow_loads"] <= 1 and got["mma"] == 0, got
        assert got["STACK"] == 0 and got["LOCAL"] == 0, f"registers spill to local memory: {got}"
        # PDL: the first W tile is requested before the wait for the previous layer, nothing written before it
        assert got["waits"] == 1 and got["launches"] == 1, got
        assert got["first_load"] < got["wait_at"] < got["first_store"], got


_COMPILE_RESIDUAL = r"""
import json, sys, torch
import kernels.conv as conv
import kernels.conv_tma as ct
import kernels.linear as linear
from tests.sm90_compile import compile_gemm, compile_sm90

ptr = "*" + sys.argv[1].replace("float", "fp")
size = 2 if ptr == "*fp16" else 4
fixed = dict(HAS_BIAS=True, HAS_RESIDUAL=True, ACTIVATION="relu", INPUT_PRECISION="tf32" if size == 4 else "ieee",
             UPCAST_DOT=False, ROUND_BF16=False, PDL=True)


def heaviest(configs, pixels):
    return max(configs, key=lambda c: pixels(c) * c["BLOCK_N"] / c.num_warps)  # accumulator elements per thread


# linear.py's kernel at 1024^3 (the candidates offered with a residual)
configs = linear.cuda_configs(1024, 1024, 1024, 132, size, residual=True)
cfg = heaviest(configs, lambda c: c["BLOCK_M"])
_, usage = compile_gemm(linear._linear_kernel, ptr, {**fixed, **cfg.meta()}, cfg.num_warps, cfg.num_stages)
print(json.dumps({"kernel": "linear", "config": cfg.meta(), "widest_n": max(c["BLOCK_N"] for c in configs), **usage}))

# conv.py's kernel on the wider CNN's 64 -> 128 layer at 32x32, NHWC, 4096 images
strides = ["stride_xn", "stride_xh", "stride_xw", "stride_wo", "stride_wh", "stride_ww", "stride_yn", "stride_yh",
           "stride_yw"]
runtime = dict(x_ptr=ptr, w_ptr=ptr, b_ptr=ptr, y_ptr=ptr, r_ptr=ptr, ws_ptr="*fp32", cnt_ptr="*i32", xs_ptr=ptr,
               xb_ptr=ptr, NB="i32", OC="i32", negative_slope="fp32", **{s: "i32" for s in strides})
fma = size == 4 and fixed["INPUT_PRECISION"] == "ieee"
cfg = heaviest(conv.cuda_configs(conv.m_bucket(4096 * 32 * 32), 128, 64, 576, fma, element_size=size),
               lambda c: c["BLOCK_M"])
meta = dict(C=64, H=32, W=32, OH=32, OW=32, KH=3, KW=3, SH=1, SW=1, PH=1, PW=1, DH=1, DW=1, POOL="none", PKH=1, PKW=1,
            PSH=1, PSW=1, CHANNELS_LAST=True, Y_PLANES=False, HAS_INPUT_NORM=False, stride_xc=1, stride_yc=1,
            stride_wc=1, **fixed,
            **dict(cfg.kwargs))
divisible = ("OC", "stride_xn", "stride_xh", "stride_xw", "stride_yn", "stride_yh", "stride_yw", "stride_ww")
_, usage = compile_sm90(conv._conv2d_kernel, runtime, meta, 5, cfg.num_warps, cfg.num_stages, divisible)
print(json.dumps({"kernel": "conv", "config": cfg.meta(), **usage}))

# conv_tma.py's kernel on the wider CNN's last conv (128 -> 128 at 8x8, 256 images) into NCHW y
name = ptr[1:]
cfg = heaviest(ct.cuda_configs(256 * 64, 128, 128, 8, 8, (1, 1), size), lambda c: c["IMG"] * c["BH"] * c["BW"])
img, bh, bw, bn, bk = (cfg[k] for k in ("IMG", "BH", "BW", "BLOCK_N", "BLOCK_K"))
runtime = dict(x_desc=f"tensordesc<{name}[{img}, {bh}, {bw}, {bk}]>", w_desc=f"tensordesc<{name}[{bn}, {bk}]>",
               b_ptr=ptr, y=ptr, r_ptr=ptr, NB="i32", stride_yn="i32", stride_yc="i32", stride_yh="i32",
               stride_yw="i32", negative_slope="fp32")
meta = dict(C=128, H=8, W=8, KH=3, KW=3, PH=1, PW=1, DH=1, DW=1, SH=1, SW=1, OH=8, OW=8, OC=128, POOL="none", PKH=1,
            PKW=1, **fixed, Y_NHWC=False, **{k: v for k, v in cfg.meta().items() if k != "TMA"})
_, usage = compile_sm90(ct._conv2d_tma_kernel, runtime, meta, 0, cfg.num_warps, cfg.num_stages,
                        divisible=("b_ptr", "y", "r_ptr"))
print(json.dumps({"kernel": "conv_tma", "config": cfg.meta(), **usage}))
"""


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_residual_epilogues_compile_for_sm90_without_spills(dtype):
    """A residual read in the epilogue, beside the accumulator: of each GEMM kernel, the candidate with the most
    accumulator elements per thread compiles without spilling, standing for the others (one each keeps this test
    short). linear.py's 128x256 tiles spill with a residual (128 bytes a thread, fp16): not offered with one."""
    results = _compiled(_COMPILE_RESIDUAL, dtype)
    assert [r["kernel"] for r in results] == ["linear", "conv", "conv_tma"], results
    assert results[0]["widest_n"] <= 128, results[0]
    for got in results:
        assert got["STACK"] == 0 and got["LOCAL"] == 0, f"registers spill to local memory: {got}"
