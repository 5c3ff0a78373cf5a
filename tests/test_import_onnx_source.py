"""The config's `source` names the ONNX file and a sha256 of every file the model reads: the .onnx and its external
data (the dynamo exporter writes the weights beside the graph, as model.onnx.data), so two files whose weights
differ never hash the same, even where the .onnx bytes are equal. And what is refused: external data that is
missing, or outside the file's folder."""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import nn

from service.model.onnx_import import import_onnx

from .test_import_onnx import NO_ONNXSCRIPT, _const, _refused, _vi


def _save(path: Path, seed: int, *, external: bool = True) -> Path:
    """x (N, 3, 8, 8) -> Conv -> Flatten, its weights drawn from `seed`, saved with them in <name>.data beside the
    file, or inside it."""
    w = _const("w", np.random.default_rng(seed).standard_normal((2, 3, 3, 3)))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Flatten", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [_vi("x", ["N", 3, 8, 8])], [_vi("y", ["N", 72])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=f"{path.name}.data", size_threshold=0)  # fmt: skip
    return path


def _sha(config: dict) -> str:
    return re.search(r"sha256 ([0-9a-f]{16})\.\.\.", config["source"]).group(1)


def test_external_weights_are_hashed(tmp_path):
    a, b, c = (_save(tmp_path / d / "model.onnx", seed) for d, seed in (("a", 0), ("b", 1), ("c", 0)))
    assert a.read_bytes() == b.read_bytes()  # the graphs are byte for byte the same: only the weights differ
    ca, cb, cc = (import_onnx(p)[0] for p in (a, b, c))
    assert ca["source"].startswith("onnx: model.onnx with external data model.onnx.data (opset 17, sha256 ")
    assert _sha(ca) != _sha(cb) and _sha(ca) == _sha(cc)


def test_a_file_without_external_data_hashes_as_its_bytes(tmp_path):
    path = _save(tmp_path / "inline.onnx", 0, external=False)
    config, _ = import_onnx(path)
    assert config["source"].startswith("onnx: inline.onnx (opset 17, sha256 ")
    assert _sha(config) == hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_missing_or_escaping_external_data_is_refused(tmp_path):
    path = _save(tmp_path / "m" / "model.onnx", 0)
    (tmp_path / "m" / "model.onnx.data").unlink()
    _refused(path, "tensor 'w' reads its data from 'model.onnx.data', which is not in", "side by side")
    outside = _save(tmp_path / "n" / "model.onnx", 0)
    proto = onnx.load(str(outside), load_external_data=False)
    (entry,) = [e for e in proto.graph.initializer[0].external_data if e.key == "location"]
    entry.value = "../weights.data"  # onnx.save refuses to write this: written as bytes
    outside.write_bytes(proto.SerializeToString())
    _refused(outside, "tensor 'w' names external data '../weights.data' outside the file's folder")


@pytest.mark.skipif(NO_ONNXSCRIPT, reason="torch.onnx's dynamo exporter needs onnxscript")
def test_the_dynamo_exporters_data_file_is_hashed(tmp_path):
    """The dynamo exporter's model.onnx.data: other bytes there (other weights), another source."""
    torch.manual_seed(0)
    path, data = tmp_path / "model.onnx", tmp_path / "model.onnx.data"
    module = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(72, 32)).eval()  # big enough to go out
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 3, 8, 8),), str(path), dynamo=True, external_data=True,
                          dynamic_shapes=({0: torch.export.Dim("batch")},))  # fmt: skip
    assert data.stat().st_size >= 72 * 32 * 4
    before = import_onnx(path)[0]
    assert "with external data model.onnx.data" in before["source"]
    weights = bytearray(data.read_bytes())
    weights[0] ^= 1  # the lowest bit of a weight
    data.write_bytes(bytes(weights))
    assert _sha(import_onnx(path)[0]) != _sha(before)
