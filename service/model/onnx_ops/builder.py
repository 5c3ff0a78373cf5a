"""What an importer has built so far: format-2 ops, their tensors and every data tensor's per-row shape (the ONNX
importer's and torch_import.py's; service.model.onnx_import re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class GraphBuilder:
    """What an importer has built so far: ops (format-2 dicts), tensors, per-row shapes of data tensors (this one's
    and torch_import.py's)."""

    ops: list[dict] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    producer: dict[str, dict] = field(default_factory=dict)  # data tensor -> the op that writes it
    names: set[str] = field(default_factory=set)

    def op_name(self, base: str) -> str:
        name, i = base, 1
        while name in self.names:
            i += 1
            name = f"{base}#{i}"
        self.names.add(name)
        return name

    def add(self, op: dict, shape: tuple[int, ...]) -> dict:
        self.ops.append(op)
        self.shapes[op["output"]] = shape
        self.producer[op["output"]] = op
        return op

    def weight(self, op_name: str, role: str, value: np.ndarray) -> str:
        key = f"{op_name}.{role}"
        # np.array, not np.ascontiguousarray, which makes a scalar (a constant's ()) a (1,) array
        self.tensors[key] = torch.from_numpy(np.array(value, dtype=np.float32, order="C"))
        return key
