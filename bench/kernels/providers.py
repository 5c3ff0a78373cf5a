"""One layer, y = act(x @ W^T + b), as each provider runs it: what a user could pick instead of ours, and ours.

    eager        torch.mm, + b, act                       3 kernels (the unfused baseline)
    linear       F.linear (addmm: bias in the GEMM), act   2 kernels
    cublaslt     torch._addmm_activation                  1 kernel: cuBLASLt's bias+ReLU/GELU(tanh) epilogue
    compile      torch.compile(F.linear + act), default mode, dynamic=False, compiled per case
    compile-max  the same in mode="max-autotune-no-cudagraphs" (Triton GEMM templates, autotuned)
    ours         kernels.FusedLinear: 1 Triton kernel, bias and act applied to the fp32 accumulator

The TF32 setting is global (torch.backends.cuda.matmul.allow_tf32, set once by the run) and passed to
ours as allow_tf32, so every provider multiplies fp32 the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.activations import torch_activation

from .timing import Prepared, describe, synchronize, warm_ours

LAYER_PROVIDERS = ("eager", "linear", "cublaslt", "compile", "compile-max", "ours")
COMPILE_MODES = {"compile": "default", "compile-max": "max-autotune-no-cudagraphs"}

# torch._inductor.config for the whole run (applied where this torch has the setting; the JSON lists
# what was applied). Neither changes what the default mode generates.
INDUCTOR_SETTINGS = {
    # max-autotune prints a table per GEMM to stderr (~15 lines); 36 layer cases of those would push the
    # summary out of the last 12,000 characters that the device call returns.
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
    # max-autotune compiles and times ~20 GEMM configs per new shape (10-30 s). Timing "template + fused
    # epilogue" against "template + separate epilogue" on top costs one more compile and timing per GEMM;
    # without it inductor fuses the bias+act epilogue into the chosen template, as ours does.
    "benchmark_epilogue_fusion": False,
    "max_autotune_gemm_search_space": "DEFAULT",
}


class NotAvailable(Exception):
    """The provider does not apply to this case (a reason for an "n/a" cell, not a failure)."""


def inductor_settings() -> dict:
    import torch._inductor.config as cfg

    return {k: v for k, v in INDUCTOR_SETTINGS.items() if hasattr(cfg, k)}


def compiled(fn: Callable, provider: str, args: tuple, device: torch.device) -> Prepared:
    """torch.compile fn for exactly these input shapes; the first call (compile + run) is timed."""
    # A fresh dynamo state per case: the same code object compiled for a 13th shape/dtype/act would pass
    # dynamo's recompile limit (8) and silently run eagerly.
    torch._dynamo.reset()
    mode = COMPILE_MODES[provider]
    c = torch.compile(fn, dynamic=False) if mode == "default" else torch.compile(fn, mode=mode, dynamic=False)
    t = time.perf_counter()
    c(*args)
    synchronize(device)
    return Prepared(lambda: c(*args), compile_s=time.perf_counter() - t)


def _linear_act(act: str) -> Callable:
    def linear_act(x, w, b):
        return torch_activation(F.linear(x, w, b), act)

    return linear_act


def layer_provider(
    name: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, act: str, tf32: bool, device: torch.device
) -> Prepared:
    """The provider `name` made ready on these static inputs (compiled, tuned, warmed)."""
    if name == "eager":
        return Prepared(lambda: torch_activation(torch.mm(x, w.t()) + b, act))
    if name == "linear":
        return Prepared(lambda: torch_activation(F.linear(x, w, b), act))
    if name == "cublaslt":
        return _cublaslt(x, w, b, act, device)
    if name in COMPILE_MODES:
        return compiled(_linear_act(act), name, (x, w, b), device)
    if name == "ours":
        from kernels import FusedLinear

        layer = FusedLinear(w, b, act, allow_tf32=tf32)
        t = time.perf_counter()
        warm_ours(lambda: layer(x), device)
        return Prepared(lambda: layer(x), compile_s=time.perf_counter() - t)
    raise ValueError(f"unknown layer provider {name!r}; expected one of {', '.join(LAYER_PROVIDERS)}")


def _cublaslt(x, w, b, act, device) -> Prepared:
    if device.type != "cuda":
        # On the CPU _addmm_activation is addmm then an eager activation, and its gelu is the erf form.
        raise NotAvailable("cuBLASLt is CUDA-only")
    if act not in ("relu", "gelu_tanh"):
        raise NotAvailable(f"cuBLASLt's epilogues are relu and gelu (tanh form), not {act}")
    wt = w.t()
    use_gelu = act == "gelu_tanh"

    def fn():
        return torch._addmm_activation(b, x, wt, use_gelu=use_gelu)

    try:
        fn()
        synchronize(device)
    except RuntimeError as e:
        raise NotAvailable(describe(e)) from None
    return Prepared(fn)
