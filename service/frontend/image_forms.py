"""The ways a request carries encoded images, each to a list of (what names it in messages, its bytes):
multipart/form-data files (a browser's or curl's -F), TF Serving's and KServe v1's base64 `instances`, and the Open
Inference Protocol's BYTES tensors (service/v2). Each one's bytes are checked and decoded by service/frontend/
images.py; here only the container is read, and its errors name the part or element."""

from __future__ import annotations

import base64
import binascii

from python_multipart.multipart import MultipartParser, parse_options_header

from .inputs import InputError

Images = list[tuple[str, bytes]]


def multipart_files(body: bytes, content_type: bytes, max_images: int) -> Images:
    """Every part of a multipart/form-data body, in order, as an image file: ("part 2 ('cat.jpg')", its bytes)."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise InputError(400, "multipart/form-data without a boundary parameter in its Content-Type")
    parts: list[dict] = []
    field: list[bytes] = []

    def begin() -> None:
        parts.append({"headers": {}, "data": []})

    def header_field(data: bytes, start: int, end: int) -> None:
        field.append(data[start:end])

    def header_value(data: bytes, start: int, end: int) -> None:
        name = b"".join(field).lower()
        field.clear()
        parts[-1]["headers"][name] = parts[-1]["headers"].get(name, b"") + data[start:end]

    def part_data(data: bytes, start: int, end: int) -> None:
        parts[-1]["data"].append(data[start:end])

    callbacks = {"on_part_begin": begin, "on_header_field": header_field, "on_header_value": header_value,
                 "on_part_data": part_data}  # fmt: skip
    try:
        parser = MultipartParser(boundary, callbacks)
        parser.write(body)
        parser.finalize()
    except Exception as e:  # noqa: BLE001 - python-multipart's MultipartParseError and its kin: a malformed body
        raise InputError(400, f"the multipart/form-data body does not parse: {e}") from None
    if not parts:
        raise InputError(422, "the multipart/form-data body holds no parts; send one image file per part")
    if len(parts) > max_images:
        raise InputError(413, f"{len(parts)} images; at most {max_images} per request (split it)", outcome="too_large")
    images = []
    for i, part in enumerate(parts, 1):
        _, disposition = parse_options_header(part["headers"].get(b"content-disposition", b""))
        name = disposition.get(b"filename") or disposition.get(b"name") or b""
        what = f"part {i}" + (f" ({name.decode('utf-8', 'replace')[:60]!r})" if name else "")
        images.append((what, b"".join(part["data"])))
    return images


def b64_instances(doc: dict, max_images: int) -> Images:
    """TF Serving's and KServe v1's {"instances": [{"b64": "..."}, ...]} (or each instance {"<input>": {"b64":
    "..."}}, naming the input as TF Serving's row format does) -> ("instances[2]", the image's bytes)."""
    unknown = sorted(set(doc) - {"instances"})
    if unknown:
        raise InputError(422, f"unknown field(s) {', '.join(map(repr, unknown))}; an image body takes only 'instances'")
    instances = doc["instances"]
    if not isinstance(instances, list) or not instances:
        raise InputError(422, 'instances must be a non-empty list of {"b64": "<base64 of a JPEG, PNG or WebP>"}')
    if len(instances) > max_images:
        raise InputError(
            413, f"instances has {len(instances)} images; at most {max_images} per request (split it)",
            outcome="too_large",
        )  # fmt: skip
    images = []
    for i, item in enumerate(instances):
        where = f"instances[{i}]"
        if isinstance(item, dict) and len(item) == 1 and "b64" not in item:  # {"image_bytes": {"b64": ...}}
            key = next(iter(item))
            where, item = f"{where}.{key}", item[key]
        if not isinstance(item, dict) or set(item) != {"b64"} or not isinstance(item["b64"], str):
            raise InputError(422, f'{where} must be {{"b64": "<base64 of a JPEG, PNG or WebP file>"}}')
        images.append((where, from_base64(item["b64"], where)))
    return images


def from_base64(text: str, where: str) -> bytes:
    """Standard base64 (RFC 4648), with or without line breaks; the URL-safe alphabet too (TF Serving's web-safe)."""
    data = text.encode("ascii", "replace")
    if b"\n" in data or b"\r" in data:
        data = data.replace(b"\r", b"").replace(b"\n", b"")
    if b"-" in data or b"_" in data:
        data = data.replace(b"-", b"+").replace(b"_", b"/")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InputError(422, f"{where} is not valid base64: {e}") from None
