"""Import an ONNX file (opset 13 and later) into the model format, fusedserve-model/2, with the `onnx` package.

    fusedserve import model.onnx model_weights/my-model [--name N] [--labels labels.txt]
    fusedserve serve --model model.onnx            # imported on the fly, as check-model does

What it takes, node by node (every node on the way from the input to the output), each family in a module of
service/model/onnx_ops/ that registers its handlers by ONNX op type:

    Conv (2-D; any groups)                -> conv2d (uneven padding: a `pad` op before it)
    MaxPool, AveragePool (ceil_mode, count_include_pad), GlobalAveragePool, GlobalMaxPool, ReduceMean /
    ReduceMax over (H, W)                 -> maxpool2d, avgpool2d
    Gemm, MatMul by a constant            -> linear; on a channels-last view (N, H, W, C): a 1x1 conv2d
    Add, Sub, Mul, Div                    -> add, sub, mul, div: two tensors with broadcasting (a residual; an SE
                                             block's image * gate), or a tensor and a constant (`constant`, `reverse`);
                                             a constant Add right after a Conv or linear -> its bias
    BatchNormalization (inference)        -> batchnorm (folded into the conv or linear before it when fused)
    LayerNormalization over the channels  -> layernorm (also LayerNorm's decomposed form, TorchScript before opset 17)
    Relu, LeakyRelu, Sigmoid, Tanh, HardSigmoid, HardSwish, Gelu, Clip -> the activation; Clip(0, 6) -> relu6
    x * Sigmoid(x) -> silu; x * HardSigmoid(x) (1/6, 1/2) -> hardswish; x * 0.5 * (1 + Erf(x / sqrt 2)) -> gelu
    Flatten, Reshape, Squeeze, Unsqueeze to (batch, features) -> flatten (or nothing when the shape stays)
    Transpose (0, 2, 3, 1) and back       -> nothing: a channels-last view of the channel-first tensor (ConvNeXt)
    Reshape, Transpose(0, 2, 1, 3, 4), Reshape (ShuffleNet) -> channel_shuffle
    Concat along channels                 -> concat (one input: nothing); Split, Slice of channels -> slice
    Pad (constant)                        -> the next conv's or pool's padding where it can be, else pad
    Identity, Dropout, Cast to a float    -> nothing
    Softmax over the output's features    -> softmax (only as the last node)

Nodes whose inputs are all constants (initializers, Constant nodes, shapes of tensors whose per-row size is
fixed) are evaluated at import with onnx's reference evaluator: an exporter's shape arithmetic before a Reshape,
or a bias made by Expand, become constants. Anything else is refused with every node that cannot be served (the
first few, and a count): its name, op type, why, what would be accepted, and the shapes involved; never run
wrongly. So is a file that is not ONNX, a graph with several inputs or outputs, and an input whose sizes other than
the batch are not fixed (a dynamic batch dimension is normal).

Weights become float32 safetensors named after their node (`/layer1/conv1/Conv.weight`); tensor names in the
graph are the ONNX names, so a plan can be traced back to the file. The config's `source` names the file and a
sha256 of every file the model reads: the .onnx and its external data (the dynamo exporter's model.onnx.data).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .onnx_ops import GraphBuilder, Importer
from .spec import FORMAT_V2, ModelFormatError, input_fields

MIN_OPSET = 13
HASH_CHUNK = 1 << 20

__all__ = ["GraphBuilder", "import_onnx", "read_labels", "safe_name"]


def _onnx():
    try:
        import onnx
    except ImportError as e:  # a runtime dependency; say how to get it rather than a bare traceback
        raise ModelFormatError(f"importing ONNX files needs the `onnx` package ({e}); pip install onnx") from None
    return onnx


def import_onnx(
    path: Path | str,
    *,
    name: str | None = None,
    labels: list[str] | None = None,
    description: str | None = None,
    input_dtype: str = "float32",
    mean: list[float] | None = None,
    std: list[float] | None = None,
    image: dict | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of the model format for the ONNX file at `path`; ModelFormatError saying what is wrong.

    name: the model's name (default: the file's stem); labels: one per output (default: the file's metadata
    `labels`, a JSON list, if it has one); input_dtype, mean, std: what clients send ("uint8" pixels) and the
    input's per-channel normalization, which the ONNX graph does not hold, and `image` the preprocessing of encoded
    images (spec.input_fields)."""
    declared = input_fields(input_dtype, mean, std, image)
    path = Path(path)
    onnx = _onnx()
    model, external = _read(onnx, path)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < MIN_OPSET:
        raise ModelFormatError(
            f"{path}: opset {opset}; fusedserve imports ONNX opset {MIN_OPSET} and later (export again with "
            f"opset_version={MIN_OPSET} or more)"
        )
    graph = model.graph
    meta = {p.key: p.value for p in model.metadata_props}
    importer = Importer(onnx, graph, opset, path)
    g = importer.run()
    if labels is None and "labels" in meta:
        try:
            labels = [str(v) for v in json.loads(meta["labels"])]
        except (ValueError, TypeError):
            raise ModelFormatError(f"{path}: metadata 'labels' is not a JSON list of strings") from None
    sha = source_hash(path, external)[:16]
    files = f"{path.name} with external data {', '.join(external)}" if external else path.name
    config = {
        "format": FORMAT_V2,
        "name": name or meta.get("name") or safe_name(path.stem),
        "description": description if description is not None else meta.get("description", graph.doc_string or ""),
        "source": f"onnx: {files} (opset {opset}, sha256 {sha}...), {model.producer_name or 'unknown'} "
        f"{model.producer_version}".strip(),
        "input": {"name": importer.input_name, "shape": list(importer.input_shape), **declared},
        "output": g.ops[-1]["output"],
        **({"labels": labels} if labels is not None else {}),
        "ops": g.ops,
    }
    return config, g.tensors


def source_hash(path: Path, external: list[str]) -> str:
    """sha256 of the .onnx file's bytes, then of each external data file it names (sorted): its name, size and
    bytes. A file without external data hashes as its bytes alone."""
    h = hashlib.sha256(path.read_bytes())
    for location in external:
        f = path.parent / location
        h.update(b"\0" + location.encode() + b"\0" + f.stat().st_size.to_bytes(8, "little"))
        with f.open("rb") as stream:
            while chunk := stream.read(HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def safe_name(stem: str) -> str:
    """A model name from a file name: the characters the format allows."""
    cleaned = "".join(c if c.isalnum() or c in "_.-" else "-" for c in stem)
    return cleaned or "model"


def _tensors(onnx, graph):
    """Every TensorProto a graph holds: initializers and Constant values, subgraphs' included."""
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t
            elif a.type == onnx.AttributeProto.TENSORS:
                yield from a.tensors
            elif a.type == onnx.AttributeProto.GRAPH:
                yield from _tensors(onnx, a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    yield from _tensors(onnx, sub)


def _read(onnx, path: Path):
    """The model (external data loaded) and the external data files it reads, relative to its folder, sorted."""
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and the like
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFormatError(f"{path}: not a valid ONNX file ({first})") from None
    helper = onnx.external_data_helper
    external = set()
    for t in _tensors(onnx, model.graph):
        if helper.uses_external_data(t):
            location = next((e.value for e in t.external_data if e.key == "location"), "")
            f = (path.parent / location).resolve()
            if not location or not f.is_relative_to(path.parent.resolve()):
                raise ModelFormatError(
                    f"{path}: tensor {t.name!r} names external data {location!r} outside the file's folder"
                )
            if not f.is_file():
                raise ModelFormatError(
                    f"{path}: tensor {t.name!r} reads its data from {location!r}, which is not "
                    f"in {path.parent} (keep the .onnx file and its external data side by side)"
                )
            external.add(location)
    try:
        helper.load_external_data_for_model(model, str(path.parent))
        onnx.checker.check_model(model)
    except Exception as e:  # onnx's ValidationError, an external data file too short
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFormatError(f"{path}: not a valid ONNX file ({first})") from None
    if not model.graph.node:
        raise ModelFormatError(f"{path}: not a valid ONNX file (its graph has no nodes)")
    return model, sorted(external)


def read_labels(path: Path | str) -> list[str]:
    """Labels from a file: a JSON list, or one label per line."""
    text = Path(path).read_text()
    try:
        value = json.loads(text)
    except ValueError:
        return [line.strip() for line in text.splitlines() if line.strip()]
    if not isinstance(value, list):
        raise ModelFormatError(f"{path}: labels must be a JSON list or one label per line")
    return [str(v) for v in value]
