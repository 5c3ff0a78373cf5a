"""The fused plan as JSON, for `GET /model` and `fusedserve check-model`: one entry per step, with its kernel name."""

from __future__ import annotations


def describe_plan(steps, tensors) -> list[dict]:
    """The fused plan as JSON: one entry per step, with its kernel name (the `kernel` metric label)."""
    from . import planner as p
    from .planner import Conv2dStep, FlattenStep, LinearStep, MLPStep, Pool2dStep

    def linear(s: LinearStep) -> dict:
        w = tensors[s.weight]
        return {"in": w.shape[1], "out": w.shape[0], "bias": s.bias is not None, "activation": s.activation,
                **p.step_extras(s)}  # fmt: skip

    def pool(s: Pool2dStep) -> dict:
        return {
            "op": f"{s.kind}pool2d", "kernel_size": list(s.kernel_size), "stride": list(s.stride),
            "padding": list(s.padding), "ceil_mode": s.ceil_mode,
            **({"count_include_pad": s.count_include_pad} if s.kind == "avg" else {}),
            "activation": s.activation,
        }  # fmt: skip

    out = []
    for s in steps:
        if not isinstance(s, (LinearStep, MLPStep, Conv2dStep, Pool2dStep, FlattenStep, p.ActivationStep)):
            out.append({"kernel": s.name, **p.describe_step(s)})  # a graph's add, batchnorm, concat, softmax
        elif isinstance(s, LinearStep):
            out.append({"kernel": s.name, "op": "linear", **linear(s)})
        elif isinstance(s, MLPStep):
            out.append({"kernel": s.name, "op": "mlp", "layers": [linear(x) for x in s.layers]})
        elif isinstance(s, Conv2dStep):
            w = tensors[s.weight]  # (out, in, kh, kw)
            out.append({
                "kernel": s.name, "op": "conv2d", "in_channels": w.shape[1], "out_channels": w.shape[0],
                "kernel_size": [w.shape[2], w.shape[3]], "stride": list(s.stride), "padding": list(s.padding),
                "dilation": list(s.dilation), "bias": s.bias is not None, "activation": s.activation,
                **p.step_extras(s),
            })  # fmt: skip
            if s.pool is not None:  # pooled in the same kernel
                out[-1]["pool"] = pool(s.pool)
        elif isinstance(s, Pool2dStep):
            out.append({"kernel": s.name, **pool(s)})
        elif isinstance(s, FlattenStep):
            out.append({"kernel": None, "op": "flatten"})
        else:
            out.append({"kernel": s.name, "op": "activation", "activation": s.activation})
    return out
