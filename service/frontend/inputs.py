"""Validate a /predict body into one float32 array (uint8 for a model of uint8 pixels) before it can join a batch.

Parsing must not dominate a microsecond-scale forward. A well-formed body takes the fast path: simdjson
parses it and hands the numbers over as one flat float64 buffer, no Python object per value, and the
body's brackets and commas (the bytes left once numbers and whitespace are deleted) must be exactly those
of n rows in one layout. Anything else takes the general path: orjson parses the body, numpy converts
the nested lists in one C call, and only a body already known to be bad is walked element by element to
say exactly where (`inputs[3][17]`). Both paths give the same array; every error message comes from the
general path. No per-float pydantic validation. The fast path parses 64 rows in 33 us against the general
path's 114, most of which is numpy converting 4,096 Python ints (docs/performance.md, "Parsing JSON rows").
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import orjson
import simdjson

FLOAT32_MAX = float(np.finfo(np.float32).max)
# Float64 rows whose sum of squares is at most this hold only values within float32's range: cast without an errstate
# and without a finiteness pass after (one BLAS dot instead); above it (or NaN, inf) the exact check below runs.
_SAFE_SQUARES = FLOAT32_MAX * FLOAT32_MAX


class InputError(Exception):
    """A request the service refuses: HTTP status + a message naming what is wrong."""

    def __init__(self, status: int, message: str, outcome: str = "invalid"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.outcome = outcome


def parse_rows(body: bytes, input_shape: tuple[int, ...], max_rows: int, dtype: str = "float32") -> np.ndarray:
    """body -> (rows, *input_shape) float32, every value finite, 1 <= rows <= max_rows. dtype "uint8" (a model of
    uint8 pixels): uint8, every value an integer 0-255 (255.0 is one; 2.5, -1 and 256 are refused).

    A row may come in any layout of `row_layouts(input_shape)`: for an image model of shape (1, 8, 8) as
    [1][8][8], [8][8] or 64 flat values; one request may mix them."""
    convert = _to_uint8 if dtype == "uint8" else _to_float32
    fast = _fast_rows(body, tuple(input_shape), max_rows)
    if fast is not None:
        return convert(fast, [fast.shape[1:]] * fast.shape[0], input_shape)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        # orjson stops at the offending token: NaN/Infinity literals, or a number beyond float64
        # ("number is infinity when parsed as double"), are bad values, not bad JSON.
        at = body[e.pos : e.pos + 9] if isinstance(getattr(e, "pos", None), int) else b""
        if at.startswith((b"NaN", b"Infinity", b"-Infinity")) or "infinity" in str(e):
            raise InputError(
                422, f"inputs hold NaN, Infinity or a number out of range; every value must be finite ({e})"
            ) from None
        raise InputError(400, f"body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise InputError(422, f'body must be a JSON object {{"inputs": [[...], ...]}}; got {_json_type(doc)}')
    unknown = sorted(set(doc) - {"inputs"})
    if unknown:
        raise InputError(422, f"unknown field(s) {', '.join(map(repr, unknown))}; the body takes only 'inputs'")
    if "inputs" not in doc:
        raise InputError(422, "missing field 'inputs': a list of rows, each a list of numbers")
    rows = doc["inputs"]
    if not isinstance(rows, list):
        raise InputError(422, f"inputs must be a list of rows; got {_json_type(rows)}")
    if not rows:
        raise InputError(422, "inputs is empty; send at least one row")
    if len(rows) > max_rows:
        raise InputError(
            413, f"inputs has {len(rows)} rows; at most {max_rows} per request (split it)", outcome="too_large"
        )

    features = math.prod(input_shape)
    layouts = row_layouts(tuple(input_shape))
    # true/false would silently become 1.0/0.0 in numpy; the bytes tell cheaply whether any is there.
    has_bool = b"true" in body or b"false" in body
    arr = None
    if not has_bool:
        try:
            arr = np.asarray(rows)
        except (ValueError, TypeError):
            arr = None  # ragged, or rows in different layouts: the walk below names the row or takes them one by one
    if arr is not None and arr.dtype.kind in "iuf" and arr.shape[1:] in layouts:
        shapes = [arr.shape[1:]] * len(rows)
    else:
        # Every row is checked (the first bad one raises); rows that are all good but in different layouts
        # (or of integers too large for int64) are converted one at a time.
        shapes = [_check_row(row, i, layouts, features) for i, row in enumerate(rows)]
        arr = np.stack([np.asarray(row, dtype=np.float64).reshape(-1) for row in rows])
    return convert(arr, shapes, input_shape)


def _to_float32(arr: np.ndarray, shapes: list[tuple[int, ...]], input_shape: tuple[int, ...]) -> np.ndarray:
    """arr (rows first, each row in the layout `shapes[i]`) as (rows, *input_shape) float32, or the InputError
    naming the first value beyond float32's range."""
    n = arr.shape[0]
    if arr.dtype == np.float64:
        flat = arr.reshape(-1)
        with np.errstate(over="ignore"):  # huge values make the sum inf: then the slow check below names them
            fits = np.dot(flat, flat) <= _SAFE_SQUARES
        if fits:
            return arr.astype(np.float32).reshape(n, *input_shape)
    with np.errstate(over="ignore"):
        out = arr.astype(np.float32, copy=False).reshape(n, *input_shape)
    if not np.isfinite(out).all():
        i, flat = np.argwhere(~np.isfinite(out.reshape(n, -1)))[0]
        place = "".join(f"[{j}]" for j in np.unravel_index(flat, shapes[i]))
        raise InputError(
            422, f"inputs[{i}]{place} is out of float32 range (|x| <= {FLOAT32_MAX:.4g}); values must be finite"
        )
    return out


def _to_uint8(arr: np.ndarray, shapes: list[tuple[int, ...]], input_shape: tuple[int, ...]) -> np.ndarray:
    """arr (rows first, each row in the layout `shapes[i]`) as (rows, *input_shape) uint8, or the InputError naming
    the first value that is not an integer 0-255."""
    n = arr.shape[0]
    flat = arr.reshape(n, -1)
    with np.errstate(invalid="ignore"):
        bad = ~((flat >= 0) & (flat <= 255) & (flat == np.floor(flat))) if flat.dtype.kind == "f" else (
            (flat < 0) | (flat > 255))  # fmt: skip
    if bad.any():
        i, at = np.argwhere(bad)[0]
        place = "".join(f"[{j}]" for j in np.unravel_index(at, shapes[i]))
        value = flat[i, at]
        whole = flat.dtype.kind in "iu" or (float(value).is_integer() and abs(value) < 2**53)
        shown = int(value) if whole else float(value)
        raise InputError(422, f"inputs[{i}]{place} is {shown!r}; this model takes uint8 pixels: integers 0-255")
    return flat.astype(np.uint8).reshape(n, *input_shape)


# What the fast path deletes from a body before comparing what is left with the expected skeleton: every
# character a JSON number can hold, and whitespace. The key "inputs" holds none of them.
_NUMBER_AND_SPACE = b"0123456789+-.eE \t\r\n"
_local = threading.local()  # a simdjson parser per thread: one parser cannot parse while its last result lives


def _fast_rows(body: bytes, input_shape: tuple[int, ...], max_rows: int) -> np.ndarray | None:
    """The rows of a body that is exactly {"inputs": [n rows of numbers, all in one layout]} with 1 <= n <=
    max_rows, as float64 of shape (n, *layout); None for anything else, which the general path then parses
    (and words the error of, if there is one)."""
    parser = getattr(_local, "parser", None)
    if parser is None:
        parser = _local.parser = simdjson.Parser()
    try:
        doc = parser.parse(body)
    except Exception:  # noqa: BLE001 - ValueError (not JSON, a number beyond float64), RuntimeError (an integer
        return None  # beyond 64 bits), ...: whatever simdjson refuses, the general path parses or words the error
    try:
        if not isinstance(doc, simdjson.Object) or len(doc) != 1:
            return None
        rows = doc.get("inputs")
        if not isinstance(rows, simdjson.Array):
            return None
        n = len(rows)
        if not 1 <= n <= max_rows:
            return None
        try:
            flat = np.frombuffer(rows.as_buffer(of_type="d"), dtype=np.float64)  # TypeError: a non-number in it
        except (TypeError, ValueError):
            return None
    finally:
        rows = doc = None  # the parser is reusable only once nothing of its last document is referenced
    features = math.prod(input_shape)
    if flat.size != n * features:
        return None
    skeleton = body.translate(None, _NUMBER_AND_SPACE)
    for layout in row_layouts(input_shape):
        if skeleton == _body_skeleton(layout, n):
            return flat.reshape(n, *layout)
    return None  # rows in several layouts, or ragged ones: the general path takes each as it is


@functools.lru_cache(maxsize=256)  # the row counts a deployment sees repeat: 1, its clients' batch sizes
def _body_skeleton(layout: tuple[int, ...], n: int) -> bytes:
    """What is left of a body of n rows in `layout` once numbers and whitespace are deleted."""
    return b'{"inputs":[' + b",".join([_row_skeleton(layout)] * n) + b"]}"


@functools.cache
def _row_skeleton(layout: tuple[int, ...]) -> bytes:
    """(64,) -> b"[" + 63 commas + b"]"; (8, 8) -> b"[" + 8 of those, comma-separated + b"]"."""
    if len(layout) == 1:
        return b"[" + b"," * (layout[0] - 1) + b"]"
    return b"[" + b",".join([_row_skeleton(layout[1:])] * layout[0]) + b"]"


@functools.cache  # one model per process: computed once, not per request
def row_layouts(input_shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The shapes a row may have: the input shape, that shape without leading 1s (an image of one channel
    as [8][8]), and flat. (1, 8, 8) -> [(1, 8, 8), (8, 8), (64,)]; (64,) -> [(64,)]."""
    shape = tuple(input_shape)
    out = [shape]
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
        out.append(shape)
    flat = (math.prod(input_shape),)
    return tuple(out) if flat in out else (*out, flat)


def _describe_layouts(layouts: tuple[tuple[int, ...], ...], features: int) -> str:
    nested = ["".join(f"[{n}]" for n in s) for s in layouts if len(s) > 1]
    return f"{features} numbers" + (f" or nested as {' or '.join(nested)}" if nested else "")


def _check_row(row: object, i: int, layouts: tuple[tuple[int, ...], ...], features: int) -> tuple[int, ...]:
    """Raise for the first problem in row i (error path only); return the layout it has."""
    what = _describe_layouts(layouts, features)
    if not isinstance(row, list):
        raise InputError(422, f"inputs[{i}] is {_kind(row)}; each row must be a list of {what}")
    depth, node = 1, row  # how deep the lists go along the first elements
    while node and isinstance(node[0], list):
        node, depth = node[0], depth + 1
    # The layout of that depth; else the deepest shallower one (the walk then names the list too many)
    shape = next((s for s in layouts if len(s) == depth), None) or max(
        (s for s in layouts if len(s) < depth), key=len, default=layouts[-1]
    )
    _walk(row, f"inputs[{i}]", shape, what, len(shape) == 1 and len(layouts) == 1)
    return shape


def _walk(node: list, where: str, shape: tuple[int, ...], what: str, flat_model: bool) -> None:
    if len(shape) == 1:
        for j, v in enumerate(node):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InputError(422, f"{where}[{j}] is {_kind(v)}; every value must be a number")
        if len(node) != shape[0]:
            takes = f"the model takes {shape[0]}" if flat_model else f"expected {shape[0]} (a row is {what})"
            raise InputError(422, f"{where} has {len(node)} values; {takes}")
        return
    if len(node) != shape[0]:
        raise InputError(422, f"{where} has {len(node)} items; expected {shape[0]} (a row is {what})")
    for j, child in enumerate(node):
        if not isinstance(child, list):
            raise InputError(422, f"{where}[{j}] is {_kind(child)}; expected a list (a row is {what})")
        _walk(child, f"{where}[{j}]", shape[1:], what, flat_model)


def _kind(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"{str(v).lower()} (a boolean)"
    if isinstance(v, str):
        return f"{v[:20]!r} (a string)"
    if isinstance(v, (list, dict)):
        return "a list" if isinstance(v, list) else "an object"
    return repr(v)


def _json_type(v: object) -> str:
    """The JSON name of a parsed value's type, for messages (not Python's: NoneType, dict)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    return "a list" if isinstance(v, list) else "an object"
