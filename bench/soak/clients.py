"""The soak's clients (bench/soak/cli.py): one process runs every kind at once on raw asyncio streams, so that each
byte (half a header, a body past the limit, a request left mid-body) is under its control.

Each kind counts what happened to it under `kind:what`: `good:200`, `bad:400`, `oversized:413`,
`slow:408`, `disconnect:left`... A `lost:...` key is something that must not happen: no answer where one was
due, an unexpected status, a slow client held past its timeout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import time

FEATURES = 64
# Concurrent connections of each kind in one client process.
MIX = {"good": 8, "bad": 2, "oversized": 1, "slow": 8, "disconnect": 2}
PIECE = 64 * 1024


def _head(path: str, length: int | None, extra: bytes = b"") -> bytes:
    framing = b"transfer-encoding: chunked\r\n" if length is None else b"content-length: %d\r\n" % length
    return b"POST %s HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n%s%s\r\n" % (
        path.encode(),
        framing,
        extra,
    )


def _good_body(rng: random.Random) -> bytes:
    n = rng.randint(1, 8)
    return json.dumps({"inputs": [[rng.randint(0, 16) for _ in range(FEATURES)] for _ in range(n)]}).encode()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """(status, whether the server closes the connection); ConnectionError when it closed without answering."""
    line = await reader.readline()
    if not line:
        raise ConnectionError("closed before answering")
    status = int(line.split()[1])
    length, close = 0, False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"connection" and b"close" in value.lower():
            close = True
    await reader.readexactly(length)
    return status, close


class Client:
    def __init__(self, port: int, end: float, header_timeout_s: float, seed: int):
        self.port = port
        self.end = end
        self.header_timeout_s = header_timeout_s
        self.rng = random.Random(seed)
        self.counts: collections.Counter[str] = collections.Counter()

    async def _open(self):
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def _exchange(self, kind: str, expect: tuple[int, ...], make) -> None:
        """Keep-alive requests of one kind until the end; `make()` -> (head, body)."""
        reader = writer = None
        while time.monotonic() < self.end:
            if writer is None:
                reader, writer = await self._open()
            head, body = make()
            writer.write(head + body)
            try:
                await writer.drain()
                status, close = await asyncio.wait_for(read_answer(reader), 30)
            except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                self.counts[f"lost:{kind}:{type(e).__name__}"] += 1
                writer.close()
                writer = None
                continue
            ok = status in expect or status == 503  # 503: shed under load, answered all the same
            self.counts[f"{kind}:{status}" if ok else f"lost:{kind}:status {status}"] += 1
            if close:
                writer.close()
                writer = None
        if writer is not None:
            writer.close()

    async def good(self) -> None:
        def make():
            body = _good_body(self.rng)
            return _head("/predict", len(body)), body

        await self._exchange("good", (200,), make)

    async def bad(self) -> None:
        bodies = [b'{"inputs": [[1, 2,', json.dumps({"inputs": [[1.0] * (FEATURES - 1)]}).encode()]

        def make():
            body = self.rng.choice(bodies)
            return _head("/predict", len(body)), body

        await self._exchange("bad", (400, 422), make)

    async def oversized(self) -> None:
        """A chunked body offered until the server answers: 413, and the connection closed."""
        piece = b"[" + b"1," * (PIECE // 2 - 1) + b"1"
        frame = b"%x\r\n%s\r\n" % (len(piece), piece)
        while time.monotonic() < self.end:
            reader, writer = await self._open()
            answer = asyncio.ensure_future(read_answer(reader))
            writer.write(_head("/predict", None))
            sent = 0
            try:
                while not answer.done() and sent < 64 * 1024 * 1024:
                    writer.write(frame)
                    await writer.drain()
                    sent += len(frame)
                    await asyncio.sleep(0)
            except ConnectionError:
                pass  # the server closed after its answer
            try:
                status, close = await asyncio.wait_for(answer, 10)
                key = "oversized:413" if status == 413 and close else f"lost:oversized:status {status} close {close}"
            except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                key = f"lost:oversized:{type(e).__name__}"
            self.counts[key] += 1
            writer.close()
            await asyncio.sleep(0.05)

    async def slow(self) -> None:
        """Half a header, then nothing: the server must close within its header timeout (plus its 0.5 s sweep)."""
        while time.monotonic() < self.end:
            reader, writer = await self._open()
            writer.write(b"POST /predict HTTP/1.1\r\nhost: soak\r\ncontent-le")
            started = time.monotonic()
            try:
                data = await asyncio.wait_for(reader.read(), self.header_timeout_s + 5)
                held = time.monotonic() - started
                key = "slow:408" if data.startswith(b"HTTP/1.1 408") else "slow:closed"
                if held > self.header_timeout_s + 2:
                    key = "lost:slow:held too long"
            except asyncio.TimeoutError:
                key = "lost:slow:never closed"
            except ConnectionError:
                key = "slow:reset"
            self.counts[key] += 1
            writer.close()

    async def disconnect(self) -> None:
        """A whole request, or half its body, then gone without reading the answer."""
        while time.monotonic() < self.end:
            _, writer = await self._open()
            body = _good_body(self.rng)
            half = self.rng.random() < 0.5
            writer.write(_head("/predict", len(body)) + (body[: len(body) // 2] if half else body))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            await asyncio.sleep(self.rng.uniform(0, 0.02))
            writer.close()
            self.counts["disconnect:left mid-body" if half else "disconnect:left before the answer"] += 1
            await asyncio.sleep(0.01)

    async def run(self) -> dict[str, int]:
        tasks = [getattr(self, kind)() for kind, n in MIX.items() for _ in range(n)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                self.counts[f"lost:client crashed:{type(r).__name__}: {r}"] += 1
        return dict(self.counts)


def client_main(port: int, end_wall: float, header_timeout_s: float, seed: int) -> dict[str, int]:
    """Entry point of a client process: runs until `end_wall` (time.time()); returns its counts."""
    end = time.monotonic() + max(0.0, end_wall - time.time())
    return asyncio.run(Client(port, end, header_timeout_s, seed).run())
