"""Content-Type as HTTP means it: what each inference route takes, and 415 naming it for anything else.

A request without Content-Type is read as the route's JSON (clients that send none meant that), but a type that names
something else (text/plain, form fields) is refused rather than parsed as what it is not. The check reads one header
and needs no body, so it runs before the body is read; the 415 closes the connection, so that body is never read.
"""

from __future__ import annotations

from .asgi import header
from .serving import Refused

JSON = b"application/json"
MULTIPART = b"multipart/form-data"
OCTETS = b"application/octet-stream"
# What libcurl (Triton's C++ client, perf_analyzer) and Python's urllib send for a POST body they were given no type
# for. Triton reads its infer bodies whatever they are labelled, so its clients never say otherwise.
FORM = b"application/x-www-form-urlencoded"
# The encoded images /predict takes, by media type (service/images/decode.py sniffs the bytes too).
IMAGES = {b"image/jpeg": "jpeg", b"image/png": "png", b"image/webp": "webp"}


def media_type(scope: dict) -> tuple[bytes | None, bytes]:
    """(the media type, lower case without parameters, or None when the request has no Content-Type; the whole
    header value)."""
    value = header(scope, b"content-type")
    if value is None:
        return None, b""
    return value.split(b";", 1)[0].strip().lower(), value


def _is_json(kind: bytes | None) -> bool:
    # application/json, and the structured-syntax types built on it (application/vnd.x+json, RFC 6839)
    return kind is None or kind == JSON or (kind.startswith(b"application/") and kind.endswith(b"+json"))


def predict_form(scope: dict, takes_images: bool) -> str:
    """What a POST /predict body is: "json" (rows, or an image model's base64 `instances`), "image" (one encoded
    file), or "multipart" (files in multipart/form-data); Refused 415 for any other Content-Type."""
    kind, value = media_type(scope)
    if _is_json(kind):
        return "json"
    if takes_images and kind in IMAGES:
        return "image"
    if takes_images and kind == MULTIPART:
        return "multipart"
    accepted = "application/json"
    if takes_images:
        accepted += ", image/jpeg, image/png, image/webp or multipart/form-data (image files)"
    elif kind in IMAGES or kind == MULTIPART:
        accepted += " (this model takes no encoded images: send its input as rows of numbers)"
    raise Refused(415, "invalid", f"Content-Type {_shown(value)} is not accepted here; send {accepted}", close=True)


def check_v2(scope: dict) -> None:
    """The Open Inference Protocol's REST infer takes JSON, or JSON followed by binary tensors (Triton's binary
    extension, which tritonclient sends without a Content-Type or as application/octet-stream, and libcurl-based
    clients such as perf_analyzer as application/x-www-form-urlencoded, libcurl's default for a POST)."""
    kind, value = media_type(scope)
    if _is_json(kind) or kind in (OCTETS, FORM):
        return
    raise Refused(415, "invalid", f"Content-Type {_shown(value)} is not accepted here; send application/json (with "
                  "binary tensors after its JSON header, Inference-Header-Content-Length) or "
                  "application/octet-stream", close=True)  # fmt: skip


def _shown(value: bytes) -> str:
    return repr(value[:80].decode("latin-1"))
