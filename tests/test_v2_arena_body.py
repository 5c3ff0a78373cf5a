"""A large binary REST infer request's tensor written into an engine's arena as it arrives (service/v2/arena_body.py):
in process, the bytes that land in the slot, each case that takes the ordinary path instead, and the slot given back
when a body goes bad; then under real uvicorn, a 224x224 uint8 model answering the same through the arena as through
JSON /predict, and refusing a non-finite FP32 tensor."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import httpx
import numpy as np
import orjson
import pytest

from service.frontend.engine_client import Reservation
from service.frontend.inputs import InputError
from service.frontend.serving import Refused
from service.frontend.state import ModelInfo
from service.link.arena import Arena
from service.v2.arena_body import DIRECT_MIN_BYTES, Direct, read_infer_body

from .modelgen import write_pixel_model
from .server import running_servers

UINT8 = np.dtype(np.uint8)
IMAGE = (3, 224, 224)  # 150,528 bytes of uint8 a row: two rows are past DIRECT_MIN_BYTES
ROW = math.prod(IMAGE)


class Engines:
    """EngineClient's reserve and release over one real arena; `dtypes`: the rows it takes in place."""

    def __init__(self, dtypes=(UINT8,)):
        self.arena = Arena(4 << 20)
        self.dtypes = dtypes
        self.reserved: list[Reservation] = []

    def ready(self) -> bool:
        return True

    def reserve(self, nbytes: int, dtype: np.dtype) -> Reservation | None:
        if dtype not in self.dtypes:
            return None
        slot = self.arena.take(nbytes)
        if slot is None:
            return None
        view = memoryview(self.arena.buf)[slot[0] : slot[0] + nbytes]
        self.reserved.append(Reservation(0, self.arena, slot, 0, view))
        return self.reserved[-1]

    def fits(self, nbytes: int, dtype: np.dtype) -> bool:
        return dtype in self.dtypes and nbytes <= self.arena.size

    def slot_returned(self) -> asyncio.Event:
        if self.room is None:
            self.room = asyncio.Event()
        return self.room

    def release(self, reservation: Reservation) -> None:
        reservation.arena.give_back(reservation.slot)
        if self.room is not None:
            self.room.set()
            self.room = None

    room: asyncio.Event | None = None


def state(input_dtype: str = "uint8", engines: Engines | None = None, timeout_ms: float = 100.0):
    model = ModelInfo("pixels", None, IMAGE, 10, None, input_dtype)
    settings = SimpleNamespace(max_rows_per_request=64, request_timeout_ms=timeout_ms)
    return SimpleNamespace(model=model, settings=settings, engines=engines or Engines(), max_body_bytes=64 << 20,
                           status="ready")  # fmt: skip


def request(data: np.ndarray, datatype: str, size: int | None = None, extra: bytes = b"") -> tuple[dict, bytes]:
    """(ASGI scope, body) of a binary REST infer request of `data` rows."""
    head = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": datatype,
                    "shape": [len(data), *IMAGE],
                    "parameters": {"binary_data_size": data.nbytes if size is None else size},
                }
            ]
        }
    )
    body = head + data.tobytes() + extra
    headers = [(b"inference-header-content-length", str(len(head)).encode()),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    return {"type": "http", "headers": headers}, body


def receiver(body: bytes, chunk: int = 100_003, leave_after: int | None = None):
    """An ASGI receive giving `body` in `chunk`-byte messages (a prime: chunks straddle the header's end), or the
    client leaving after `leave_after` of them."""
    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)]
    sent = 0

    async def receive():
        nonlocal sent
        if leave_after is not None and sent >= leave_after:
            return {"type": "http.disconnect"}
        sent += 1
        return {"type": "http.request", "body": parts[sent - 1], "more_body": sent < len(parts)}

    return receive


def read(st, scope, body, **kw):
    return asyncio.run(read_infer_body(st, scope, receiver(body, **kw)))


def pixels(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, *IMAGE), dtype=np.uint8)


def test_the_tensor_lands_in_the_arena_slot_byte_for_byte():
    st = state()
    data = pixels(3)
    scope, body = request(data, "UINT8")
    got = read(st, scope, body)
    assert isinstance(got, Direct)
    assert got.rows.shape == (3, *IMAGE) and got.rows.dtype == np.uint8
    np.testing.assert_array_equal(got.rows, data)
    slot = got.reservation.slot
    assert bytes(st.engines.arena.buf[slot[0] : slot[0] + data.nbytes]) == data.tobytes()  # in the arena, not a copy
    assert got.doc["inputs"][0]["shape"] == [3, *IMAGE]


def test_float32_rows_are_checked_in_place_and_a_nan_gives_the_slot_back():
    st = state("float32", Engines((np.dtype(np.float32),)))
    data = np.random.default_rng(1).standard_normal((1, *IMAGE), dtype=np.float32)
    scope, body = request(data, "FP32")
    got = read(st, scope, body)
    np.testing.assert_array_equal(got.rows, data)
    st.engines.release(got.reservation)
    data.reshape(-1)[12345] = np.nan
    scope, body = request(data, "FP32")
    with pytest.raises(InputError, match="element 12345 is NaN"):
        read(st, scope, body)
    assert st.engines.arena.slots_live == 0


@pytest.mark.parametrize(
    "case",
    ["small", "bad json", "trailing bytes", "size short", "wrong rows", "wire casts", "arena full", "no length"],
)
def test_anything_unusual_reads_the_whole_body_for_the_ordinary_path(case):
    st = state(engines=Engines((np.dtype(np.float16),)) if case == "wire casts" else None)
    data = pixels(2)
    scope, body = request(data, "UINT8")
    if case == "small":
        scope, body = request(pixels(1)[:, :, :100], "UINT8")  # 30 KB: under DIRECT_MIN_BYTES
        assert len(body) < DIRECT_MIN_BYTES
    elif case == "bad json":
        body = body.replace(b'"inputs"', b'"inputs" oops', 1)
    elif case == "trailing bytes":
        scope, body = request(data, "UINT8", extra=b"\0" * 64)
    elif case == "size short":
        scope, body = request(data, "UINT8", size=data.nbytes - 1, extra=b"")
    elif case == "wrong rows":
        body = body.replace(b'"shape":[2,', b'"shape":[3,', 1)  # declares 3 rows of data it does not hold
    elif case == "arena full":
        st.engines.arena.take(st.engines.arena.size - 1000)
    elif case == "no length":
        scope = {"type": "http", "headers": scope["headers"][:1]}  # chunked: no Content-Length
    got = read(st, scope, body)
    assert got == body
    assert not st.engines.reserved or case == "arena full"


def test_a_request_that_finds_the_arena_full_waits_for_a_slot_to_go_back():
    """The arena full of earlier requests: this one waits (its body unread) and lands in the arena once one of them
    goes back, well inside its timeout."""
    st = state(timeout_ms=30_000)
    ahead = st.engines.reserve(st.engines.arena.size - 1000, UINT8)
    data = pixels(3)
    scope, body = request(data, "UINT8")

    async def scenario():
        reading = asyncio.create_task(read_infer_body(st, scope, receiver(body)))
        await asyncio.sleep(0.05)
        assert not reading.done()  # waiting for room
        st.engines.release(ahead)
        return await asyncio.wait_for(reading, 5)

    got = asyncio.run(scenario())
    assert isinstance(got, Direct)
    np.testing.assert_array_equal(got.rows, data)


def test_a_tensor_no_arena_could_hold_does_not_wait():
    st = state(timeout_ms=30_000)
    data = pixels(30)  # 4.5 MB: past the 4 MB arena
    scope, body = request(data, "UINT8")

    async def scenario():
        return await asyncio.wait_for(read_infer_body(st, scope, receiver(body)), 5)

    assert asyncio.run(scenario()) == body and not st.engines.reserved


def test_a_client_that_leaves_midway_is_refused_and_its_slot_given_back():
    st = state()
    scope, body = request(pixels(3), "UINT8")
    with pytest.raises(Refused) as e:
        read(st, scope, body, leave_after=2)
    assert e.value.status == 499
    assert len(st.engines.reserved) == 1 and st.engines.arena.slots_live == 0


def test_a_body_past_the_limit_is_refused_before_it_is_read():
    st = state()
    st.max_body_bytes = 1000
    scope, body = request(pixels(2), "UINT8")
    with pytest.raises(Refused) as e:
        read(st, scope, body)
    assert e.value.status == 413 and e.value.close


# ---- under real uvicorn: the service answers the same either way ----


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_pixel_model(tmp_path_factory.mktemp("arena-body") / "pixels", input_shape=list(IMAGE), seed=3,
                              name="pixels")  # fmt: skip
    env = {"model": str(model), "dtype": "float32", "max_batch_size": 8, "device": "cpu"}
    with running_servers({"unfused": ("unfused", env)}, tmp_path_factory.mktemp("arena-body-logs")) as s:
        yield s["unfused"].url


@pytest.mark.slow
def test_a_large_uint8_request_through_the_arena_answers_as_json_predict_does(server):
    data = pixels(4, seed=7)  # 602 KB of pixels: the arena path
    scope, body = request(data, "UINT8")
    head_length = dict(scope["headers"])[b"inference-header-content-length"].decode()
    binary = httpx.post(f"{server}/v2/models/pixels/infer", content=body, timeout=60,
                        headers={"Inference-Header-Content-Length": head_length})  # fmt: skip
    assert binary.status_code == 200, binary.text[:300]
    logits = np.array(binary.json()["outputs"][0]["data"], dtype=np.float32).reshape(4, 10)
    plain = httpx.post(f"{server}/predict", json={"inputs": data.reshape(4, -1).tolist()}, timeout=60)
    assert plain.status_code == 200, plain.text[:300]
    np.testing.assert_allclose(logits, np.array(plain.json()["outputs"], dtype=np.float32), rtol=1e-5, atol=1e-6)
    assert binary.json()["outputs"][1]["data"] == [str(p) for p in plain.json()["predictions"]]
