"""Where does a prepared layer's host time per call go?

Each part of a direct launch (kernels/launch.py), timed interleaved (round r runs every variant once; a
variant's figure is its best and its median round), host microseconds per call over 1000 back-to-back
calls and one synchronize:
- the layer as the service calls it, and its compiled launcher called five ways: tensors and the current
  device's stream; int pointers; ints with the stream looked up by a fixed device index; ints straight
  into the C launch function (launch.c_launch_of); DirectLaunch (all three)
- the pieces: x.new_empty, torch.cuda.current_device, the raw stream lookup, the TF32 flag
- the anchors: the cuBLASLt epilogue (one op) and eager mm + bias + activation (three)
at 64x256x128 fp16 relu (launch-bound) and 1024^3 bf16 gelu_tanh, and the digits MLP's whole-MLP kernel
at batch 1.

    python -m bench.probes.host_launch --out DIR

What it finds (H200 host; bench/results/h200/probe_host_launch_h200.txt), best of 9 rounds at 64x256x128 fp16:
the launcher called with tensors, 6.27 us; int pointers save 0.9 (six driver calls), the fixed-device
stream 0.45, the C launch function 0.9; DirectLaunch takes 4.30. The layer's whole call is 9.26 us
(x.new_empty 2.3 of it), against 14.94 for the cuBLASLt epilogue and 27.74 for eager's three ops. At
1024^3 bf16 every variant reads 8.9-9.5 us: the device sets the pace there, not the host.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from triton.runtime import driver

from kernels import FusedLinear
from kernels.launch import c_launch_of
from kernels.mlp import FusedMLP

from ..kernels.timing import timed_run
from .common import digits_layers, main

CALLS = 1000
ROUNDS = 9


def per_call_us(fn) -> float:
    return timed_run(fn, CALLS, torch.device("cuda")) * 1e6  # the benchmark's wall-time run, GC off


def interleaved(variants: dict) -> dict:
    runs = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, fn in variants.items():
            runs[name].append(per_call_us(fn))
    return {name: {"best": min(r), "median": statistics.median(r)} for name, r in runs.items()}


def launcher_variants(launch, args: tuple, pointer_slots: int) -> dict:
    """A DirectLaunch's compiled launcher called the ways compared, with args (pointers first, as tensors)."""
    run, function, metadata, tail = launch._run, launch._function, launch._metadata, launch._tail
    ints = tuple(a.data_ptr() for a in args[:pointer_slots]) + args[pointer_slots:]
    device = driver.active.get_current_device()
    stream_of, current = driver.active.get_current_stream, driver.active.get_current_device
    hooks = (None, None, None)  # launch metadata, enter hook, exit hook
    out = {
        "run: tensors, current device's stream (before)": lambda g: run(
            g, 1, 1, stream_of(current()), function, metadata, *hooks, *args, *tail
        ),
        "run: ints, current device's stream": lambda g: run(
            g, 1, 1, stream_of(current()), function, metadata, *hooks, *ints, *tail
        ),  # fmt: skip
        "run: ints, fixed device's stream": lambda g: run(
            g, 1, 1, stream_of(device), function, metadata, *hooks, *ints, *tail
        ),  # fmt: skip
        "DirectLaunch (now): ints": lambda g: launch(g, *ints),
    }
    c_launch = c_launch_of(run)
    if c_launch is not None:
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
        out["C launch: ints, fixed device's stream"] = lambda g: c_launch(
            g, 1, 1, stream_of(device), function, coop, pdl, None, None, metadata, *hooks, *ints, *tail
        )
    print(f"   DirectLaunch calls the C launch function: {launch.calls_c_launcher}", flush=True)
    return out


def linear_case(M, K, N, dtype, act) -> dict:
    x = torch.randn(M, K, device="cuda").to(dtype)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(dtype)
    b = torch.randn(N, device="cuda").to(dtype)
    layer = FusedLinear(w, b, act)
    layer(x)  # tunes and compiles this bucket
    layer(x)  # records the launch of M rows
    record = layer._fast[(M, torch.backends.cuda.matmul.allow_tf32)]
    assert not record.persistent, "the probe's shapes run the pointer kernel"
    ws, cnt = layer.workspace.partials, layer.workspace.counters
    assert (ws.data_ptr(), cnt.data_ptr()) == (record.ws_ptr, record.cnt_ptr)
    out = torch.empty(M, N, device="cuda", dtype=dtype)
    args = (x, w, b, out, ws, cnt, M, N, K, K, 1, K, 1, N, 1, layer.negative_slope, record.bucket)
    want = layer(x).clone()
    variants = {"layer(x) (service path)": lambda: layer(x)}
    for name, call in launcher_variants(record.launch, args, 6).items():
        out.zero_()
        call(record.grid)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"{name} computed something else"
        variants[name] = lambda call=call: call(record.grid)
    gelu = act == "gelu_tanh"

    def activation(t):
        return F.gelu(t, approximate="tanh") if gelu else torch.relu(t)

    variants.update({
        "x.new_empty": lambda: x.new_empty((M, N)),
        "torch.cuda.current_device": torch.cuda.current_device,
        "raw stream lookup": lambda: driver.active.get_current_stream(0),
        "TF32 flag": lambda: torch.backends.cuda.matmul.allow_tf32,
        "cublaslt epilogue (1 op)": lambda: torch._addmm_activation(b, x, w.t(), use_gelu=gelu),
        "eager mm + add + act (3 ops)": lambda: activation(torch.mm(x, w.t()) + b),
    })  # fmt: skip
    return interleaved(variants)


def mlp_case(batch: int) -> dict:
    layers = digits_layers()
    mlp = FusedMLP(layers)
    x = torch.randn(batch, layers[0].weight.shape[1], device="cuda").to(torch.float16)
    mlp(x)
    mlp(x)
    launch, grid, *_ = mlp._fast[(batch, torch.backends.cuda.matmul.allow_tf32)]
    out = torch.empty(batch, mlp.widths[-1], device="cuda", dtype=torch.float16)
    ws, cnt = mlp.workspace.partials, mlp.workspace.counters
    args = (x, mlp.weights, mlp.biases, out, ws, cnt, batch, mlp.widths[0], mlp.widths[-1])
    want = mlp(x).clone()
    variants = {"mlp(x) (service path)": lambda: mlp(x)}
    for name, call in launcher_variants(launch, args, 6).items():
        out.zero_()
        call(grid)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"{name} computed something else"
        variants[name] = lambda call=call: call(grid)
    return interleaved(variants)


def sweep() -> dict:
    res = {}
    cases = [
        ("64x256x128 float16 relu", lambda: linear_case(64, 256, 128, torch.float16, "relu")),
        ("1024x1024x1024 bfloat16 gelu_tanh", lambda: linear_case(1024, 1024, 1024, torch.bfloat16, "gelu_tanh")),
        ("digits FusedMLP batch 1 float16", lambda: mlp_case(1)),
    ]
    for name, case in cases:
        rows = case()
        res[name] = rows
        print(f"{name}: host us per call, best / median of {ROUNDS} interleaved rounds of {CALLS} calls", flush=True)
        for variant, r in rows.items():
            print(f"   {variant:40s} {r['best']:7.2f} / {r['median']:7.2f}", flush=True)
    return res


if __name__ == "__main__":
    main("host_launch", sweep)
