"""Validate a /predict body into one float32 array before it can join a batch.

Parsing must not dominate a microsecond-scale forward: orjson parses the body, numpy converts the
nested lists in one C call, and only a body already known to be bad is walked element by element
to say exactly where (`inputs[3][17]`). No per-float pydantic validation.
"""

from __future__ import annotations

import math

import numpy as np
import orjson

FLOAT32_MAX = float(np.finfo(np.float32).max)


class InputError(Exception):
    """A request the service refuses: HTTP status + a message naming what is wrong."""

    def __init__(self, status: int, message: str, outcome: str = "invalid"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.outcome = outcome


def parse_rows(body: bytes, input_shape: tuple[int, ...], max_rows: int) -> np.ndarray:
    """body -> (rows, *input_shape) float32, every value finite, 1 <= rows <= max_rows."""
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
    flat_ok = (features,)
    # true/false would silently become 1.0/0.0 in numpy; the bytes tell cheaply whether any is there.
    has_bool = b"true" in body or b"false" in body
    arr = None
    if not has_bool:
        try:
            arr = np.asarray(rows)
        except (ValueError, TypeError):
            arr = None  # ragged: the walk below names the row
    if arr is None or arr.dtype.kind not in "iuf" or arr.shape[1:] not in (tuple(input_shape), flat_ok):
        _raise_first_problem(rows, input_shape, features)
        raise InputError(422, f"inputs must have shape (rows, {features}); got {getattr(arr, 'shape', '?')}")
    with np.errstate(over="ignore"):
        out = arr.astype(np.float32, copy=False).reshape(len(rows), *input_shape)
    if not np.isfinite(out).all():
        bad = np.argwhere(~np.isfinite(out.reshape(len(rows), -1)))[0]
        raise InputError(
            422, f"inputs[{bad[0]}][{bad[1]}] is out of float32 range (|x| <= {FLOAT32_MAX:.4g}); values must be finite"
        )
    return out


def _raise_first_problem(rows: list, input_shape: tuple[int, ...], features: int) -> None:
    """Walk the rows (error path only) and raise for the first bad one."""
    nested = len(input_shape) > 1
    for i, row in enumerate(rows):
        if not isinstance(row, list):
            raise InputError(422, f"inputs[{i}] is {_kind(row)}; each row must be a list of {features} numbers")
        values = _flatten(row) if nested else row
        if values is None:
            raise InputError(422, f"inputs[{i}] must be a flat list of {features} numbers or nested as {input_shape}")
        for j, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InputError(422, f"inputs[{i}][{j}] is {_kind(v)}; every value must be a number")
        if len(values) != features:
            raise InputError(422, f"inputs[{i}] has {len(values)} values; the model takes {features}")


def _flatten(row: list) -> list | None:
    out: list = []
    stack = [row]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            out.append(item)
    return out


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
