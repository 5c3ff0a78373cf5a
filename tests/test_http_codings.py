"""Content-Type and content codings as HTTP means them (issue 51), without a server: which media types each inference
route takes (service/frontend/media.py), gzip and deflate bodies decoded within the limit, a zip bomb stopped at it,
and answers gzipped where the client accepts gzip and the answer is large (service/frontend/encoding.py)."""

from __future__ import annotations

import gzip
import os
import zlib

import pytest

from service.frontend.encoding import GZIP_MIN_BYTES, accepts_gzip, check_encoding, decode_body, maybe_gzip
from service.frontend.inputs import InputError
from service.frontend.media import check_v2, predict_form
from service.frontend.serving import Refused


def _scope(**headers: str) -> dict:
    return {"headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


@pytest.mark.parametrize(
    ("ctype", "images", "form"),
    [(None, False, "json"), ("application/json", False, "json"), ("Application/JSON; charset=utf-8", False, "json"),
     ("application/vnd.api+json", False, "json"), ("image/png", True, "image"), ("image/jpeg", True, "image"),
     ("image/webp", True, "image"), ("multipart/form-data; boundary=x", True, "multipart")],
)  # fmt: skip
def test_predict_takes_json_and_an_image_models_files(ctype, images, form):
    scope = _scope(content_type=ctype) if ctype else _scope()
    assert predict_form(scope, images) == form


@pytest.mark.parametrize(
    ("ctype", "images", "named"),
    [("text/plain", False, "send application/json"), ("application/x-www-form-urlencoded", True, "image/webp or "
     "multipart/form-data"), ("image/png", False, "this model takes no encoded images"),
     ("multipart/form-data; boundary=x", False, "this model takes no encoded images"),
     ("image/gif", True, "image/png")],
)  # fmt: skip
def test_anything_else_is_415_naming_what_is_taken(ctype, images, named):
    with pytest.raises(Refused) as e:
        predict_form(_scope(content_type=ctype), images)
    assert e.value.status == 415 and e.value.close and named in e.value.message
    assert repr(ctype) in e.value.message


def test_v2_takes_json_and_binary():
    # perf_analyzer (libcurl) and urllib label a body they were given no type for as a form: Triton reads it anyway
    for ctype in (None, "application/json", "application/octet-stream", "application/x-www-form-urlencoded"):
        check_v2(_scope(content_type=ctype) if ctype else _scope())
    with pytest.raises(Refused, match="'text/plain' is not accepted here; send application/json"):
        check_v2(_scope(content_type="text/plain"))


def test_gzip_and_deflate_decode_and_stack():
    body = os.urandom(2000) * 3
    assert decode_body(_scope(content_encoding="gzip"), gzip.compress(body), 10**6) == body
    assert decode_body(_scope(content_encoding="deflate"), zlib.compress(body), 10**6) == body
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    assert decode_body(_scope(content_encoding="deflate"), raw.compress(body) + raw.flush(), 10**6) == body
    twice = gzip.compress(zlib.compress(body))  # deflate applied first, then gzip
    assert decode_body(_scope(content_encoding="deflate, gzip"), twice, 10**6) == body
    assert decode_body(_scope(content_encoding="identity"), body, 10**6) == body
    check_encoding(_scope(content_encoding="gzip, identity"))
    with pytest.raises(InputError, match="'br' is not supported; send the body as gzip, deflate or identity"):
        check_encoding(_scope(content_encoding="gzip, br"))


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_a_zip_bomb_stops_at_the_limit(coding):
    c = zlib.compressobj(9, zlib.DEFLATED, 31 if coding == "gzip" else 15)
    bomb = b"".join(c.compress(bytes(1 << 20)) for _ in range(256)) + c.flush()  # 256 MiB of zeros in ~250 KB
    with pytest.raises(InputError) as e:
        decode_body(_scope(content_encoding=coding), bomb, 4 << 20)
    assert e.value.status == 413 and e.value.outcome == "too_large"
    assert f"decodes ({coding}) to more than {4 << 20} bytes" in e.value.message


def test_broken_streams_are_400():
    body = gzip.compress(os.urandom(5000))
    with pytest.raises(InputError, match="truncated"):
        decode_body(_scope(content_encoding="gzip"), body[:-100], 10**6)
    with pytest.raises(InputError, match="bytes after its gzip stream"):
        decode_body(_scope(content_encoding="gzip"), body + b"junk", 10**6)
    with pytest.raises(InputError, match="does not decode as gzip"):
        decode_body(_scope(content_encoding="gzip"), b'{"inputs": []}', 10**6)


@pytest.mark.parametrize(
    ("accept", "yes"),
    [("gzip", True), ("gzip, deflate, br", True), ("br;q=1.0, gzip;q=0.5", True), ("*", True), ("gzip;q=0", False),
     ("gzip;q=0.000", False), ("deflate", False), ("identity", False), (None, False)],
)  # fmt: skip
def test_accept_encoding(accept, yes):
    assert accepts_gzip(_scope(accept_encoding=accept) if accept else _scope()) is yes


def test_only_large_answers_are_gzipped():
    big = b'{"outputs": [' + b"0.123456789, " * (GZIP_MIN_BYTES // 8) + b"]}"
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(big)).encode())]
    packed = maybe_gzip(_scope(accept_encoding="gzip"), big, headers)
    assert gzip.decompress(packed) == big and len(packed) < len(big) / 2
    assert (
        dict(headers)[b"content-encoding"] == b"gzip" and dict(headers)[b"content-length"] == str(len(packed)).encode()
    )
    assert dict(headers)[b"vary"] == b"accept-encoding"
    small, small_headers = b'{"outputs": [[1.0]]}', [(b"content-length", b"20")]
    assert maybe_gzip(_scope(accept_encoding="gzip"), small, small_headers) is small and len(small_headers) == 1
    noise = os.urandom(GZIP_MIN_BYTES * 2)  # would grow: sent as it is
    assert maybe_gzip(_scope(accept_encoding="gzip"), noise, []) is noise
    assert maybe_gzip(_scope(), big, []) is big
