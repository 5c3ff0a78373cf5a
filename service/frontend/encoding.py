"""Content codings as HTTP means them: a gzip or deflate request body decoded within the body's size limit, and
answers gzipped for a client that accepts gzip where the answer is large enough for it to pay.

The limit counts the decoded bytes: a 2 MB limit takes a 2 MB JSON body sent as 200 KB of gzip, and a zip bomb (1 KB
that inflates to 1 GB) stops after limit + 1 decoded bytes (zlib's max_length), never holding more in memory.
"""

from __future__ import annotations

import zlib

from .asgi import header
from .inputs import InputError

# wbits for zlib: gzip's header and CRC (31); HTTP's "deflate" is the zlib format (15), though some clients send raw
# deflate (-15), which is tried when the zlib header is not there.
_WBITS = {b"gzip": 31, b"x-gzip": 31, b"deflate": 15}
# An answer below this is not compressed: it fits in the initial congestion window of 10 segments (10 x 1460 bytes),
# so it arrives in one round trip either way, and compressing it would cost the front end time for nothing.
GZIP_MIN_BYTES = 16 << 10
# zlib's fastest level: float JSON compresses 2-3x at level 1 and only ~10% further at 6, for about 3x the time.
GZIP_LEVEL = 1
GZIP = (b"content-encoding", b"gzip")
VARY = (b"vary", b"accept-encoding")


def encoded(scope: dict) -> bool:
    """Whether the request body has a content coding other than identity."""
    value = header(scope, b"content-encoding")
    return value is not None and value.strip().lower() not in (b"", b"identity")


def check_encoding(scope: dict) -> None:
    """InputError 415 for a content coding this server cannot decode (checked before the body is read)."""
    value = header(scope, b"content-encoding")
    if value is None:
        return
    for name in value.lower().split(b","):
        name = name.strip()
        if name not in _WBITS and name not in (b"", b"identity"):
            raise InputError(
                415, f"Content-Encoding {name.decode('latin-1')!r} is not supported; send the body as gzip, "
                "deflate or identity (uncompressed)"
            )  # fmt: skip


def decode_body(scope: dict, body: bytes, limit: int) -> bytes:
    """`body` with its content codings undone (in the reverse of the order they were applied), at most `limit`
    bytes; InputError 413 past the limit, 400 for a stream that does not decode."""
    value = header(scope, b"content-encoding")
    if value is None:
        return body
    for name in reversed(value.lower().split(b",")):
        name = name.strip()
        if name in (b"", b"identity"):
            continue
        body = _inflate(body, name, limit)
    return body


def _inflate(data: bytes, name: bytes, limit: int) -> bytes:
    wbits = _WBITS[name]
    try:
        return _inflate_with(data, wbits, limit, name)
    except zlib.error as e:
        if wbits == 15:  # not a zlib stream: raw deflate, as some clients send "deflate"
            try:
                return _inflate_with(data, -15, limit, name)
            except zlib.error:
                pass
        raise InputError(400, f"the body does not decode as {name.decode()}: {e}") from None


def _inflate_with(data: bytes, wbits: int, limit: int, name: bytes) -> bytes:
    d = zlib.decompressobj(wbits)
    out = d.decompress(data, limit + 1)
    if len(out) > limit:
        raise InputError(
            413, f"the body decodes ({name.decode()}) to more than {limit} bytes; at most {limit}", outcome="too_large"
        )
    if not d.eof:
        raise InputError(400, f"the {name.decode()} body is truncated: its stream ends before its last block")
    if d.unused_data.strip(b"\0"):  # some gzip writers pad with zeros; anything else is not part of the body
        raise InputError(400, f"the body holds {len(d.unused_data)} bytes after its {name.decode()} stream")
    return out


def accepts_gzip(scope: dict) -> bool:
    """Whether Accept-Encoding names gzip (or *) without q=0."""
    value = header(scope, b"accept-encoding")
    if value is None:
        return False
    for item in value.lower().split(b","):
        coding, _, params = item.strip().partition(b";")
        if coding.strip() in (b"gzip", b"x-gzip", b"*"):
            q = params.strip()
            return not (q.startswith(b"q=") and q[2:].strip().rstrip(b"0").rstrip(b".") in (b"", b"0"))
    return False


def maybe_gzip(scope: dict, body: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The answer's body, gzipped (its headers updated in place: Content-Encoding, Content-Length, Vary) when the
    client accepts gzip and the body is at least GZIP_MIN_BYTES, and smaller once compressed."""
    if len(body) < GZIP_MIN_BYTES or not accepts_gzip(scope):
        return body
    c = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
    packed = c.compress(body) + c.flush()
    if len(packed) >= len(body):
        return body
    headers[:] = [h for h in headers if h[0] != b"content-length"]
    headers += [GZIP, VARY, (b"content-length", str(len(packed)).encode())]
    return packed
