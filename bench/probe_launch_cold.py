"""Development probe (issue 3): what does the CUDA graph itself cost in a cold forward? A kernel that
stores one float takes about 4 us as a cold graph replay (L2 flushed) and 0.8 us back to back in one
graph, and the digits MLP (one fused kernel) about 9 us cold, against a 6 us goal. The fused executor
replays a graph per batch bucket even where the plan is one kernel, and a graph replay may cost device
time a plain launch does not.

Times, cold (do_bench, L2 flushed before every rep) and each way in the same run: the one-store kernel,
the digits FusedMLP at batches 1 and 256, and the `linear` anchor (F.linear + activation per layer,
6 kernels), each as a plain launch from Python and as one graph replay. The 75 us flush keeps the host
ahead of the device, so a plain launch's host cost is hidden in both.

    python -m bench.probe_hopper --only launch-cold --out $OUT

What it found (H200; bench/results/probe_launch_cold*_h200.txt): the graph costs a one-kernel forward
0.3-1.2 us cold (one-store 3.3 against 4.2 us; digits FusedMLP 7.9-9.0 against 9.0-9.2) and saves the
6-kernel anchor 1-6 us. Not acted on: the executor still replays a graph for one-kernel plans, and a
plain launch would not bring the digits MLP near 6 us either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.mlp import FusedMLP

from .kernel_timing import Timing, device_us
from .probe_hopper import _one_store, digits_layers, graph_us


def sweep() -> dict:
    rows = []

    def both(name, fn):
        fn()
        torch.cuda.synchronize()
        plain = device_us(fn, Timing())
        graph = graph_us(fn)
        rows.append({"case": name, "plain": plain, "graph": graph})
        print(f"   {name:34s} plain launch {plain:6.2f} us   graph replay {graph:6.2f} us", flush=True)

    y = torch.empty(1, device="cuda")
    both("one-store kernel", lambda: _one_store[(1,)](y))
    layers = digits_layers()
    mlp = FusedMLP(layers)
    for batch in (1, 256):
        x = torch.randn(batch, layers[0].weight.shape[1], device="cuda").to(torch.float16)
        mlp(x)  # tune this bucket first

        def anchor(x=x):
            h = x
            for layer in layers:
                h = F.linear(h, layer.weight, layer.bias)
                h = torch.relu(h) if layer.activation == "relu" else h
            return h

        both(f"digits FusedMLP batch {batch}", lambda x=x: mlp(x))
        both(f"digits F.linear chain batch {batch}", anchor)
    return {"rows": rows}
