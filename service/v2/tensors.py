"""Open Inference Protocol tensors: what the model takes and gives, and the checks every input passes before it can
join a batch, for REST (JSON or binary) and gRPC alike.

The model has one input, `input`, of shape [-1, *input_shape] (or any layout /predict accepts for a row: for an
image model of shape (1, 8, 8), [-1, 1, 8, 8], [-1, 8, 8] or [-1, 64]), in FP32, FP16, FP64 or UINT8 (image pixels
as stored; converted to the engine's float32 in one numpy call), and two outputs: `logits` [-1, output_features]
FP32, and `label` [-1] BYTES (the label of the highest logit, or its index when the model names no labels).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..frontend.inputs import FLOAT32_MAX, InputError, row_layouts
from ..frontend.state import ModelInfo

INPUT = "input"
LOGITS = "logits"
LABEL = "label"
OUTPUTS = (LOGITS, LABEL)
VERSION = "1"  # one model per server, one version
PLATFORM = "fusedserve"
# Little-endian, as the protocol's raw and binary tensors are.
DTYPES = {"FP32": np.dtype("<f4"), "FP16": np.dtype("<f2"), "FP64": np.dtype("<f8"), "UINT8": np.dtype("u1")}


def input_datatype(model: ModelInfo) -> str:
    """The input's datatype as the protocol names it: UINT8 for a model of uint8 pixels (which takes only that: its
    rows travel to the GPU as uint8), else FP32 (which also takes FP16, FP64 and UINT8, converted)."""
    return "UINT8" if model.input_dtype == "uint8" else "FP32"


def model_metadata(model: ModelInfo) -> dict:
    return {
        "name": model.name,
        "versions": [VERSION],
        "platform": PLATFORM,
        "inputs": [{"name": INPUT, "datatype": input_datatype(model), "shape": [-1, *model.input_shape]}],
        "outputs": [
            {"name": LOGITS, "datatype": "FP32", "shape": [-1, model.output_features]},
            {"name": LABEL, "datatype": "BYTES", "shape": [-1]},
        ],
    }


def check_model(model: ModelInfo, name: str, version: str | None) -> None:
    """404 unless `name` (and `version`, when given) is what this server serves."""
    if name != model.name:
        raise InputError(404, f"unknown model {name!r}; this server serves {model.name!r}")
    if version not in (None, "", VERSION):
        raise InputError(404, f"unknown version {version!r} of model {name!r}; it has version {VERSION!r}")


def check_input(model: ModelInfo, name: str, datatype: str, shape: object, max_rows: int) -> tuple[np.dtype, int]:
    """The input's numpy dtype and its row count, or InputError naming what is wrong with its declaration."""
    if name != INPUT:
        raise InputError(400, f"unknown input {name!r}; the model takes one input, {INPUT!r}")
    dtype = DTYPES.get(datatype) if isinstance(datatype, str) else None  # a JSON object is not hashable: 400, not 500
    if dtype is None:
        takes = "UINT8 pixels (0..255)" if model.input_dtype == "uint8" else "FP32, FP16 or FP64"
        raise InputError(400, f"input {name!r} has datatype {datatype!r}; this model takes {takes}")
    if model.input_dtype == "uint8" and datatype != "UINT8":
        raise InputError(400, f"input {name!r} has datatype {datatype!r}; this model takes UINT8 pixels (0..255)")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise InputError(400, f"input {name!r} has shape {shape!r}; a shape is a list of integers")
    layouts = row_layouts(tuple(model.input_shape))
    if len(shape) < 2 or tuple(shape[1:]) not in layouts:
        want = " or ".join(str([-1, *s]) for s in layouts)
        raise InputError(400, f"input {name!r} has shape {list(shape)}; the model takes {want}")
    rows = shape[0]
    if rows < 1:
        raise InputError(400, f"input {name!r} has {rows} rows; send at least one")
    if rows > max_rows:
        raise InputError(
            413, f"input {name!r} has {rows} rows; at most {max_rows} per request (split it)", outcome="too_large"
        )
    return dtype, rows


def rows_from_buffer(model: ModelInfo, buffer, dtype: np.dtype, shape: list[int], name: str = INPUT) -> np.ndarray:
    """Raw little-endian tensor bytes -> (rows, *input_shape) rows (finite_rows' dtype), checked: no float parsing,
    no Python loop."""
    count = math.prod(shape)
    if len(buffer) != count * dtype.itemsize:
        raise InputError(
            400,
            f"input {name!r} has {len(buffer)} bytes of data; shape {list(shape)} in {dtype_name(dtype)} takes "
            f"{count * dtype.itemsize}",
        )
    values = np.frombuffer(buffer, dtype=dtype)
    return finite_rows(model, values, shape[0], name)


def rows_from_json(model: ModelInfo, data: object, dtype: np.dtype, shape: list[int], name: str = INPUT) -> np.ndarray:
    """JSON `data` (flat, or nested as `shape`) -> (rows, *input_shape) float32, checked."""
    if not isinstance(data, list):
        raise InputError(400, f"input {name!r} data must be a list of numbers (flat or nested); got {type(data)}")
    try:
        values = np.asarray(data, dtype=np.float64 if dtype != DTYPES["FP16"] else dtype)
    except (ValueError, TypeError):
        raise InputError(
            400, f"input {name!r} data is ragged or holds something other than numbers; shape is {list(shape)}"
        ) from None
    if values.ndim > 1 and list(values.shape) != list(shape):
        raise InputError(400, f"input {name!r} data is nested as {list(values.shape)}; its shape is {list(shape)}")
    if values.size != math.prod(shape):
        raise InputError(400, f"input {name!r} has {values.size} values; shape {list(shape)} takes {math.prod(shape)}")
    if dtype == DTYPES["FP32"] and values.dtype == np.float64:
        with np.errstate(over="ignore"):  # beyond float32 turns inf, refused by finite_rows: no warning in the log
            values = values.astype(np.float32)
    elif dtype == DTYPES["UINT8"] and not ((values >= 0) & (values <= 255) & (values == np.floor(values))).all():
        raise InputError(400, f"input {name!r} is UINT8: its data must be integers 0..255")
    return finite_rows(model, values.reshape(-1), shape[0], name)


def finite_rows(model: ModelInfo, values: np.ndarray, rows: int, name: str) -> np.ndarray:
    """(rows, *input_shape) float32 (float16 where sent in FP16), or uint8 for a model of uint8 pixels (whose values
    check_input and the JSON check have held to UINT8's 0..255: kept as they are, a quarter of float32's bytes to the
    GPU)."""
    if model.input_dtype == "uint8":
        return values.astype(np.uint8, copy=False).reshape(rows, *model.input_shape)
    if values.dtype == np.float16:
        # FP16 rows stay FP16: an fp16 engine's wire takes them with one copy into the arena, where float32 rows cost
        # a cast up, a check of twice the bytes and a cast back down (a 32-image 224x224 request is 9.6 MB in FP16)
        out = values.reshape(rows, *model.input_shape)
    else:
        with np.errstate(over="ignore"):
            out = values.astype(np.float32, copy=False).reshape(rows, *model.input_shape)
    if not np.isfinite(out).all():
        i = int(np.argwhere(~np.isfinite(out.reshape(-1)))[0, 0])
        raise InputError(
            400, f"input {name!r} element {i} is NaN, infinite or beyond float32 (|x| <= {FLOAT32_MAX:.4g})"
        )
    return out


def dtype_name(dtype: np.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def check_outputs(names: list[str]) -> list[str]:
    """The requested output names in order (every output when none is asked for), or 400 for an unknown one."""
    for n in names:
        if n not in OUTPUTS:
            raise InputError(400, f"unknown output {n!r}; the model gives {', '.join(map(repr, OUTPUTS))}")
    return names or list(OUTPUTS)


def label_names(model: ModelInfo, outputs: np.ndarray) -> list[str]:
    """The label of each row's highest logit (its index when the model has no labels), for JSON."""
    idx = np.argmax(outputs, axis=1).tolist()
    labels = model.labels
    return [labels[i] for i in idx] if labels else [str(i) for i in idx]


def bytes_element(text: str) -> bytes:
    """One element of a BYTES tensor in raw form: its 4-byte little-endian length, then its UTF-8."""
    raw = text.encode()
    return len(raw).to_bytes(4, "little") + raw


@functools.cache  # one model per process
def _label_table(labels: tuple[str, ...] | None, classes: int) -> np.ndarray | None:
    """Each class's raw BYTES element (4-byte little-endian length, then UTF-8) as a row of one uint8 array, when
    every element has the same size (the digits' "0".."9": 5 bytes each); else None."""
    names = labels or tuple(str(i) for i in range(classes))
    raw = [bytes_element(n) for n in names]
    if len({len(r) for r in raw}) != 1:
        return None
    return np.frombuffer(b"".join(raw), dtype=np.uint8).reshape(len(raw), -1)


def labels_tensor(model: ModelInfo, outputs: np.ndarray) -> bytes:
    """The `label` output in raw BYTES form: one numpy gather for labels of one size (no per-row Python)."""
    labels = tuple(model.labels) if model.labels else None
    table = _label_table(labels, outputs.shape[1])
    idx = np.argmax(outputs, axis=1)
    if table is not None:
        return table[idx].tobytes()
    return b"".join(bytes_element(n) for n in label_names(model, outputs))


def parameter(params: object, key: str, default=None):
    return params.get(key, default) if isinstance(params, dict) else default
