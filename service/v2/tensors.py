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
    """The model's metadata. An image model's says, in `parameters.image`, that `input` (or `image`) also takes
    BYTES tensors of encoded images, and how they are prepared: a parameter, not a second input, so that clients that
    fill every listed input (perf_analyzer) still send one tensor (gRPC's metadata message has no parameters: its
    clients read the same in the model configuration's `image_preprocess`)."""
    meta = {
        "name": model.name,
        "versions": [VERSION],
        "platform": PLATFORM,
        "inputs": [{"name": INPUT, "datatype": input_datatype(model), "shape": [-1, *model.input_shape]}],
        "outputs": [
            {"name": LOGITS, "datatype": "FP32", "shape": [-1, model.output_features]},
            {"name": LABEL, "datatype": "BYTES", "shape": [-1]},
        ],
    }
    if model.image is not None:
        meta["parameters"] = {"image": {"inputs": [INPUT, IMAGE_INPUT], "datatype": "BYTES", "shape": [-1],
                                        **model.image}}  # fmt: skip
    return meta


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


# An image model (service/images) also takes encoded images: a BYTES tensor of shape [N] or [N, 1], each element one
# JPEG, PNG or WebP file, as Triton's image clients send them, under the input's name or IMAGE_INPUT.
IMAGE_INPUT = "image"


def is_image_input(model: ModelInfo, name: object, datatype: object) -> bool:
    """Whether an input is encoded images: a BYTES tensor named `input` or `image`, to a model that takes images."""
    return model.image is not None and datatype == "BYTES" and name in (INPUT, IMAGE_INPUT)


def image_count(name: str, shape: object, max_rows: int) -> int:
    """The images a BYTES input of `shape` holds ([N] or [N, 1]), or InputError."""
    if not (isinstance(shape, (list, tuple)) and len(shape) in (1, 2) and all(type(d) is int for d in shape)
            and (len(shape) == 1 or shape[1] == 1)):  # fmt: skip
        raise InputError(400, f"input {name!r} (BYTES, encoded images) has shape {shape!r}; send [N] or [N, 1]")
    n = shape[0]
    if n < 1:
        raise InputError(400, f"input {name!r} has {n} images; send at least one")
    if n > max_rows:
        raise InputError(413, f"input {name!r} has {n} images; at most {max_rows} per request (split it)",
                         outcome="too_large")  # fmt: skip
    return n


def bytes_elements(buffer, count: int, name: str) -> list[tuple[str, bytes]]:
    """A BYTES tensor in raw form (each element a 4-byte little-endian length, then its bytes) -> its `count`
    elements as (what names it in messages, its bytes), or InputError."""
    view = memoryview(buffer)
    out, at = [], 0
    while at < len(view):
        if at + 4 > len(view):
            raise InputError(400, f"input {name!r} ends inside element {len(out)}'s 4-byte length")
        size = int.from_bytes(view[at : at + 4], "little")
        at += 4
        if at + size > len(view):
            raise InputError(
                400, f"input {name!r} element {len(out)} declares {size} bytes; {len(view) - at} remain in the tensor"
            )
        out.append((f"input {name!r} element {len(out)}", bytes(view[at : at + size])))
        at += size
    if len(out) != count:
        raise InputError(400, f"input {name!r} holds {len(out)} elements; its shape takes {count}")
    return out


def base64_elements(data: object, count: int, name: str) -> list[tuple[str, bytes]]:
    """A BYTES tensor's JSON `data` (flat or nested [[...]]), each element an image in base64 -> (what, bytes)."""
    from ..frontend.image_forms import from_base64

    flat = data
    if isinstance(flat, list) and all(isinstance(e, list) and len(e) == 1 for e in flat):
        flat = [e[0] for e in flat]
    if not isinstance(flat, list) or not all(isinstance(e, str) for e in flat):
        raise InputError(400, f"input {name!r} (BYTES, encoded images) data must be a list of base64 strings")
    if len(flat) != count:
        raise InputError(400, f"input {name!r} has {len(flat)} elements; its shape takes {count}")
    return [(f"input {name!r} element {i}", from_base64(e, f"input {name!r} element {i}")) for i, e in enumerate(flat)]
