"""GPU JPEG decoding's split between front ends and engines (issue 50), on the CPU: everything of it but nvJPEG.

- the front end's header check (service/images/gpu_decode.py's `header`): a JPEG of a mode nvJPEG converts as Pillow
  would goes to the engine with its size; PNG, CMYK, a grayscale JPEG for an RGB model, a truncated or unreadable
  file stay on the CPU path (which converts or refuses them); a decompression bomb is refused from its header (413);
- the IMAGES block on the wire round-trips, and a malformed one is refused, not read past its end;
- the engine's BatchDecoder (its decode call replaced by Pillow here, so that rows are comparable exactly): one
  decode call per batch, chunked by pixels; rows equal to the CPU path's; a file the decoder refuses fails only its
  own request;
- end to end through a real Engine and EngineClient on a socket: image requests in the arena and inline, the HELLO's
  flag, DECODE_ON_CPU for the refused file's request alone, and an engine that does not decode answering
  DECODE_ON_CPU;
- a front end's pipeline: which files travel encoded, bad files refused with their 4xx before any submit, and
  run_rows preparing a request on the CPU when its engine answers DECODE_ON_CPU;
- FUSEDSERVE_IMAGE_DECODE and FUSEDSERVE_PINNED_ARENAS resolved on a CPU engine (off) and the registry's ranges.

The same split on a GPU, with nvJPEG and registered arenas: tests/test_images_gpu.py (marked gpu).
"""

from __future__ import annotations

import asyncio
import struct
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from service.config import Settings
from service.engine import pinned
from service.frontend.engine_client import EngineClient, EngineError, ImageRequest
from service.images import gpu_decode
from service.images.decode import ImageError, decode
from service.images.prepare import prepare
from service.images.preprocess import Preprocess
from service.link import wire

from .imagegen import cmyk_jpeg, encode, photo, truncated
from .test_link import EngineThread, ready_states, wait_until

MAX_PIXELS = 50_000_000
PRE = Preprocess(8, 8, resize=8)
SHAPE = (3, 8, 8)
REFUSE = b"nvjpeg-refuses"  # a comment the fake decoder below refuses files by


def pillow_decode(files: list[torch.Tensor], gray: bool, device: torch.device) -> list[torch.Tensor]:
    """BatchDecoder's decode call, by Pillow: (C, H, W) uint8 per file; RuntimeError for a file holding REFUSE (as
    nvJPEG raises for a file it does not take, failing the whole call)."""
    out = []
    for f in files:
        data = f.numpy().tobytes()
        if REFUSE in data:
            raise RuntimeError("nvjpegDecodeBatched failed: the stub refuses this file")
        pixels = np.array(decode(data, "L" if gray else "RGB", MAX_PIXELS))  # writable: torch wants it
        out.append(torch.from_numpy(pixels).permute(2, 0, 1).contiguous())
    return out


def jpeg(rng, h=40, w=56, refuse=False) -> bytes:
    return encode(photo(rng, h, w), "JPEG", quality=90, **({"comment": REFUSE} if refuse else {}))


def jpeg_of_size(height: int, width: int) -> bytes:
    """A small JPEG whose header (SOF0) says height x width: what a decompression bomb's header looks like."""
    data = bytearray(encode(photo(np.random.default_rng(0), 16, 16), "JPEG"))
    at = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, at + 5, height, width)
    return bytes(data)


# ---------------------------------------------------------------------------- the front end's header check


def test_header_sends_jpegs_nvjpeg_takes_and_keeps_the_rest_on_the_cpu():
    rng = np.random.default_rng(0)
    assert gpu_decode.header(jpeg(rng, 37, 53), MAX_PIXELS, "RGB") == (37, 53)
    assert gpu_decode.header(jpeg(rng, 37, 53), MAX_PIXELS, "BGR") == (37, 53)
    gray = encode(photo(rng, 20, 30)[:, :, 0], "JPEG")
    assert gpu_decode.header(gray, MAX_PIXELS, "RGB") is None  # Pillow converts it: the CPU path
    assert gpu_decode.header(gray, MAX_PIXELS, "L") == (20, 30)  # nvJPEG's GRAY is its luma
    assert gpu_decode.header(jpeg(rng), MAX_PIXELS, "L") == (40, 56)
    assert gpu_decode.header(cmyk_jpeg(rng)[0], MAX_PIXELS, "RGB") is None
    assert gpu_decode.header(encode(photo(rng, 20, 30), "PNG"), MAX_PIXELS, "RGB") is None
    assert gpu_decode.header(truncated(jpeg(rng)), MAX_PIXELS, "RGB") is None  # no end marker: the CPU path says so
    assert gpu_decode.header(b"\xff\xd8\xff" + b"\0" * 40 + b"\xff\xd9", MAX_PIXELS, "RGB") is None  # unreadable


def test_an_adobe_rgb_coded_jpeg_stays_on_the_cpu():
    """APP14 "Adobe" with transform 0: the file holds RGB, not YCbCr (Pillow reads it so; nvJPEG may not)."""
    data = jpeg(np.random.default_rng(14))
    app14 = b"\xff\xee" + struct.pack(">H", 14) + b"Adobe" + struct.pack(">HHHB", 100, 0, 0, 0)
    assert gpu_decode.header(data[:2] + app14 + data[2:], MAX_PIXELS, "RGB") is None
    ycc = b"\xff\xee" + struct.pack(">H", 14) + b"Adobe" + struct.pack(">HHHB", 100, 0, 0, 1)
    assert gpu_decode.header(data[:2] + ycc + data[2:], MAX_PIXELS, "RGB") == (40, 56)


def test_a_bomb_is_refused_from_its_header_before_it_travels():
    with pytest.raises(ImageError) as e:
        gpu_decode.header(jpeg_of_size(30_000, 30_000), MAX_PIXELS, "RGB", "part 2")
    assert e.value.status == 413 and "30000x30000" in e.value.message and "part 2" in e.value.message


# ---------------------------------------------------------------------------- the wire


def test_the_images_block_round_trips_and_a_malformed_one_is_refused():
    items = [(wire.ENCODED_JPEG, b"\xff\xd8jpeg\xff\xd9", 375, 500), (wire.PREPARED_ROW, bytes(range(192)), 0, 0)]
    block = wire.pack_images(items)
    assert len(block) == wire.images_size(items)
    buf = bytearray(7) + block + bytearray(5)
    got, end = wire.unpack_images(buf, 7, 2, len(buf))
    assert end == 7 + len(block)
    assert [(k, bytes(d), h, w) for k, d, h, w in got] == items
    into = bytearray(len(block))
    wire.pack_images(items, memoryview(into))
    assert bytes(into) == block
    for cut in (len(block) - 1, 3):
        with pytest.raises(ValueError):
            wire.unpack_images(block[:cut], 0, 2, cut)
    with pytest.raises(ValueError):
        wire.unpack_images(block, 0, 200, len(block))  # more images than the block holds records for


def test_the_hello_carries_the_decode_flag():
    assert wire.read_hello(wire.hello(np.float16, wire.DECODES_JPEG)) == (1, wire.DECODES_JPEG)
    assert wire.read_hello(wire.hello(np.float32)) == (0, 0)


# ---------------------------------------------------------------------------- the engine's batch decoder


def _cpu(files: list[bytes], pre: Preprocess = PRE) -> np.ndarray:
    return np.stack([prepare(f, pre, MAX_PIXELS) for f in files])


def _items(files: list[bytes]) -> list[tuple]:
    out = []
    for f in files:
        hw = gpu_decode.header(f, MAX_PIXELS, "RGB")
        out.append((wire.ENCODED_JPEG, memoryview(f), *hw) if hw else
                   (wire.PREPARED_ROW, memoryview(prepare(f, PRE, MAX_PIXELS).tobytes()), 0, 0))  # fmt: skip
    return out


@pytest.mark.parametrize("channels", ["RGB", "BGR"])
def test_the_batch_decoder_gives_the_cpu_paths_rows_in_one_call(channels):
    rng = np.random.default_rng(1)
    pre = Preprocess(24, 24, resize=28, channels=channels)
    sizes = [(40, 56), (56, 40), (40, 56), (30, 30), (40, 56)]
    files = [jpeg(rng, h, w) for h, w in sizes]
    dec = gpu_decode.BatchDecoder(pre, "cpu", decode=pillow_decode)
    requests = [_items(files[:2]), _items(files[2:3]), _items(files[3:])]
    rows = dec(requests)
    assert dec.calls == 1  # every JPEG of the batch in one decode call
    got = torch.cat(rows).numpy()
    np.testing.assert_array_equal(got, _cpu(files, pre))  # the same decoder, the same torch code: equal
    assert [r.shape[0] for r in rows] == [2, 1, 2]


def test_a_file_the_decoder_refuses_fails_its_request_alone():
    rng = np.random.default_rng(2)
    files = [jpeg(rng), jpeg(rng, refuse=True), jpeg(rng), encode(photo(rng, 20, 20), "PNG")]
    dec = gpu_decode.BatchDecoder(PRE, "cpu", decode=pillow_decode)
    rows = dec([_items(files[:1]), _items(files[1:3]), _items(files[3:])])
    assert rows[1] is None  # the refused file's request: its front end decodes it
    np.testing.assert_array_equal(rows[0].numpy(), _cpu(files[:1]))
    np.testing.assert_array_equal(rows[2].numpy(), _cpu(files[3:]))  # a prepared row, copied as it came


def test_one_refused_file_in_many_is_found_by_halving():
    rng = np.random.default_rng(13)
    files = [jpeg(rng, refuse=i == 5) for i in range(8)]
    dec = gpu_decode.BatchDecoder(PRE, "cpu", decode=pillow_decode)
    rows = dec([_items([f]) for f in files])
    assert dec.calls == 7  # 8 fail; 4 ok, 4 fail; 2 ok, 2 fail; 1 ok, 1 fail
    assert [r is None for r in rows] == [i == 5 for i in range(8)]


def test_decode_calls_are_bounded_by_pixels():
    rng = np.random.default_rng(3)
    files = [jpeg(rng, 40, 50) for _ in range(5)]  # 2,000 pixels each
    dec = gpu_decode.BatchDecoder(PRE, "cpu", decode=pillow_decode, batch_pixels=4_000)
    rows = dec([_items(files)])
    assert dec.calls == 3
    np.testing.assert_array_equal(rows[0].numpy(), _cpu(files))


def test_preprocess_many_equals_one_at_a_time():
    rng = np.random.default_rng(4)
    images = [torch.from_numpy(photo(rng, h, w)).permute(2, 0, 1) for h, w in [(30, 40), (40, 30), (30, 40), (9, 9)]]
    pre = Preprocess(16, 16, resize=18)
    many = pre.many(images)
    for i, im in enumerate(images):
        assert torch.equal(many[i], pre.chw(im))


# ---------------------------------------------------------------------------- engine and front end on a socket


class ImageStub:
    """A runner answering each row with its mean and its first pixel; takes numpy rows and device tensors alike."""

    wire_dtype = np.dtype(np.float32)

    def __init__(self):
        self.parts = []

    def launch(self, parts):
        self.parts.append([type(p).__name__ for p in parts])
        rows = np.concatenate([p.numpy() if isinstance(p, torch.Tensor) else p for p in parts]).astype(np.float32)
        flat = rows.reshape(len(rows), -1)
        return np.stack([flat.mean(1), flat[:, 0], flat[:, 1], flat[:, 2]], axis=1)

    def collect(self, out):
        return out


def _want(files: list[bytes]) -> np.ndarray:
    rows = _cpu(files).astype(np.float32).reshape(len(files), -1)
    return np.stack([rows.mean(1), rows[:, 0], rows[:, 1], rows[:, 2]], axis=1)


def _engine(path: str, decodes: bool = True) -> EngineThread:
    et = EngineThread(path, ImageStub())
    et.engine.input_shape, et.engine.features = SHAPE, int(np.prod(SHAPE))
    if decodes:
        et.engine.jpeg = gpu_decode.BatchDecoder(PRE, "cpu", decode=pillow_decode)
    return et


def test_image_requests_travel_encoded_and_come_back_as_the_cpu_paths(tmp_path, monkeypatch):
    path = str(tmp_path / "engine.sock")
    rng = np.random.default_rng(5)
    files = [jpeg(rng), jpeg(rng, 56, 40), encode(photo(rng, 20, 30), "PNG"), jpeg(rng, refuse=True), jpeg(rng)]

    async def scenario():
        client = EngineClient([path], ready_states(), 4)
        client.start()
        await wait_until(lambda: client._wire[0] is not None)
        assert client.decodes_jpeg()
        parts = [files[:3], files[3:4], files[4:]]
        futs = [client.submit(ImageRequest(_items(p), []), time.monotonic() + 5, time.monotonic())[1] for p in parts]
        out = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 5)
        await wait_until(lambda: not client._slots)  # every slot back once answered
        client.close()
        return out

    with _engine(path) as engine:
        first, refused, last = asyncio.run(scenario())
    np.testing.assert_allclose(first[0], _want(files[:3]), rtol=1e-6)
    np.testing.assert_allclose(last[0], _want(files[4:]), rtol=1e-6)
    assert isinstance(refused, EngineError) and refused.status == wire.DECODE_ON_CPU
    assert engine.runner.parts and all(set(p) == {"Tensor"} for p in engine.runner.parts)


def test_image_requests_travel_inline_when_the_arena_is_full(tmp_path, monkeypatch):
    from service.link.arena import Arena

    monkeypatch.setattr(Arena, "take", lambda self, n: None)
    path = str(tmp_path / "engine.sock")
    files = [jpeg(np.random.default_rng(6))]

    async def scenario():
        client = EngineClient([path], ready_states(), 4)
        client.start()
        await wait_until(lambda: client._wire[0] is not None)
        got = await asyncio.wait_for(client.submit(ImageRequest(_items(files), []), time.monotonic() + 5,
                                                   time.monotonic())[1], 5)  # fmt: skip
        client.close()
        return got

    with _engine(path):
        out, _ = asyncio.run(scenario())
    np.testing.assert_allclose(out, _want(files), rtol=1e-6)


def test_an_engine_that_does_not_decode_answers_decode_on_cpu(tmp_path):
    path = str(tmp_path / "engine.sock")
    files = [jpeg(np.random.default_rng(7))]

    async def scenario():
        client = EngineClient([path], ready_states(), 4)
        client.start()
        await wait_until(lambda: client._wire[0] is not None)
        assert not client.decodes_jpeg()
        # The front end's own check refuses at once; an engine asked anyway (a front end that had not heard its
        # HELLO) answers DECODE_ON_CPU too.
        fut = client.submit(ImageRequest(_items(files), []), time.monotonic() + 5, time.monotonic())[1]
        client._flags[0] = wire.DECODES_JPEG
        asked = client.submit(ImageRequest(_items(files), []), time.monotonic() + 5, time.monotonic())[1]
        out = await asyncio.wait_for(asyncio.gather(fut, asked, return_exceptions=True), 5)
        client.close()
        return out

    with _engine(path, decodes=False):
        for err in asyncio.run(scenario()):
            assert isinstance(err, EngineError) and err.status == wire.DECODE_ON_CPU


# ---------------------------------------------------------------------------- the front end's pipeline


class FakeEngines:
    """run_rows' view of an EngineClient: answers an ImageRequest DECODE_ON_CPU (`refuse`) or with its row count,
    and rows with their mean."""

    def __init__(self, decodes=True, refuse=False):
        self.decodes, self.refuse, self.submitted = decodes, refuse, []

    def decodes_jpeg(self):
        return self.decodes

    def submit(self, rows, deadline, arrival):
        self.submitted.append(rows)
        fut = asyncio.get_running_loop().create_future()
        if isinstance(rows, ImageRequest) and self.refuse:
            fut.set_exception(EngineError(wire.DECODE_ON_CPU, "refused"))
        else:
            fut.set_result((np.zeros((len(rows), 4), np.float32), "fused"))
        return len(self.submitted), fut

    def cancel(self, rid):
        pass


def _state(engines) -> SimpleNamespace:
    model = SimpleNamespace(image=PRE.describe(), input_dtype="uint8")
    return SimpleNamespace(model=model, settings=Settings(image_decode_threads=2), engines=engines)


def test_the_pipeline_sends_jpegs_encoded_and_prepares_the_rest():
    from service.frontend.images import pipeline

    rng = np.random.default_rng(8)
    cmyk = cmyk_jpeg(rng, 20, 24)[0]
    files = [("a", jpeg(rng)), ("b", encode(photo(rng, 20, 30), "PNG")), ("c", cmyk)]
    got = asyncio.run(pipeline(_state(FakeEngines())).rows(files))
    assert isinstance(got, ImageRequest) and got.files == files
    assert [k for k, *_ in got.items] == [wire.ENCODED_JPEG, wire.PREPARED_ROW, wire.PREPARED_ROW]
    assert got.items[0][1] == files[0][1] and got.items[0][2:] == (40, 56)
    assert got.items[1][1] == prepare(files[1][1], PRE, MAX_PIXELS).tobytes()
    # Engines that do not decode: every file prepared here, as before.
    rows = asyncio.run(pipeline(_state(FakeEngines(decodes=False))).rows(files))
    np.testing.assert_array_equal(rows, _cpu([f for _, f in files]))
    # No file the GPU takes: rows, as before.
    rows = asyncio.run(pipeline(_state(FakeEngines())).rows(files[1:]))
    assert isinstance(rows, np.ndarray) and rows.shape == (2, *SHAPE)


@pytest.mark.parametrize(
    ("bad", "status", "words"),
    [(truncated(jpeg(np.random.default_rng(9))), 422, "not a valid JPEG"), (b"", 422, "empty"),
     (jpeg_of_size(30_000, 30_000), 413, "30000x30000"), (b"GIF89a....", 422, "not a JPEG, PNG or WebP")],
    ids=["truncated", "empty", "bomb", "gif"],
)  # fmt: skip
def test_bad_files_are_refused_before_anything_is_submitted(bad, status, words):
    from service.frontend.images import pipeline
    from service.frontend.inputs import InputError

    engines = FakeEngines()
    files = [("part 1", jpeg(np.random.default_rng(10))), ("part 2", bad)]
    with pytest.raises(InputError) as e:
        asyncio.run(pipeline(_state(engines)).rows(files))
    assert e.value.status == status and words in e.value.message and "part 2" in e.value.message
    assert engines.submitted == []


def test_run_rows_prepares_on_the_cpu_what_the_engine_sends_back():
    from service.frontend.images import pipeline
    from service.frontend.serving import run_rows

    engines = FakeEngines(refuse=True)
    state = _state(engines)
    files = [("a", jpeg(np.random.default_rng(11))), ("b", jpeg(np.random.default_rng(12)))]

    async def scenario():
        request = await pipeline(state).rows(files)
        return await run_rows(state, request, time.monotonic(), time.monotonic() + 5)

    out, mode = asyncio.run(scenario())
    assert out.shape == (2, 4) and mode == "fused"
    first, second = engines.submitted
    assert isinstance(first, ImageRequest)
    np.testing.assert_array_equal(second, _cpu([f for _, f in files]))  # then as rows, prepared here


# ---------------------------------------------------------------------------- settings on a CPU engine


def test_a_cpu_engine_decodes_nothing_and_registers_nothing():
    assert gpu_decode.resolve("auto", "cpu") is False
    assert gpu_decode.resolve("cpu", "cuda") is False
    with pytest.raises(RuntimeError, match="FUSEDSERVE_IMAGE_DECODE=gpu"):
        gpu_decode.resolve("gpu", "cpu")
    assert not pinned.wanted("on", "cpu", True, 1 << 20)
    assert not pinned.wanted("auto", "cuda", True, 256)  # the digits MLP: staged inside its graph as before
    assert pinned.wanted("auto", "cuda", True, 3 * 224 * 224)
    assert not pinned.wanted("auto", "cuda", False, 3 * 224 * 224)  # no graphs: no direct copies
    assert pinned.wanted("on", "cuda", True, 256) and not pinned.wanted("off", "cuda", True, 1 << 20)
    assert Settings().image_decode == "auto" and Settings().pinned_arenas == "auto"


def test_the_registry_knows_its_ranges():
    reg = pinned.PinnedArenas(True)
    for start, end in [(1000, 2000), (5000, 9000)]:  # what register() records for two arenas
        reg._starts.append(start)
        reg._ends[start] = end
    assert reg.contains(1000, 1000) and reg.contains(5000, 64) and reg.contains(8000, 1000)
    assert not reg.contains(1999, 2) and not reg.contains(999, 10) and not reg.contains(3000, 1)
    assert not reg.contains(8999, 2)


def test_every_loaded_cuda_runtime_is_found_in_the_memory_maps(tmp_path):
    """_clear_cuda_error opens each libcudart the process has loaded (torch's binding has no cudaGetLastError, and
    torchvision's wheel loads a copy of its own, whose error state is apart from torch's), found by path in
    /proc/self/maps: lines without a path, other libraries and each runtime's several lines as Linux writes them."""
    maps = tmp_path / "maps"
    torchvision = "/opt/venv/lib/torchvision.libs/libcudart.faf08d9a.so.13"
    torch_own = "/opt/venv/lib/nvidia/cu13/lib/libcudart.so.13"
    maps.write_text(
        "55d4c6a00000-55d4c6a21000 r--p 00000000 fd:01 1835 /usr/bin/python3.12\n"
        "7f3a10000000-7f3a10021000 rw-p 00000000 00:00 0 \n"
        f"7f3a20000000-7f3a200a2000 r--p 00000000 fd:01 91 {torchvision}\n"
        f"7f3a2c000000-7f3a2c0a2000 r--p 00000000 fd:01 77 {torch_own}\n"
        f"7f3a2c0a2000-7f3a2c0f0000 r-xp 000a2000 fd:01 77 {torch_own}\n"
        "7f3a30000000-7f3a30001000 r--p 00000000 fd:01 78 /opt/venv/lib/libcudart_helper.so\n"
    )  # fmt: skip
    assert pinned.cuda_runtime_paths(str(maps)) == [torchvision, torch_own]
    maps.write_text("7f3a10000000-7f3a10021000 rw-p 00000000 00:00 0\n55d4c6a00000-55d4c6a21000 r--p 0 fd:01 1 /x\n")
    assert pinned.cuda_runtime_paths(str(maps)) == []
    assert pinned.cuda_runtime_paths(str(tmp_path / "absent")) == []
    pinned._clear_cuda_error()  # no CUDA runtime here: a no-op, not an error


def test_direct_staging_copies_each_contiguous_run_once():
    """runner._stage_direct on the CPU, its graphs replaced by a stand-in (input_of, host_in) and its registry given
    one range: adjacent parts in registered memory are one copy, read from where they are (by address); other parts
    go through host_in; device parts (decoded there) are copied as they are; the input holds the batch in order."""
    import mmap

    from service.model.runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)  # no executor: only the staging is under test
    dst = torch.zeros((64, *SHAPE), dtype=torch.uint8)
    host_in = torch.zeros((64, *SHAPE), dtype=torch.uint8)
    runner.graphs = SimpleNamespace(input_of=lambda rows: dst, host_in=host_in)
    runner._host_in_np, runner._copier, runner.direct_copies = host_in.numpy(), None, 0
    buf = mmap.mmap(-1, 1 << 16)
    reg = pinned.PinnedArenas(True)
    start = pinned.address(buf)
    reg._starts.append(start)
    reg._ends[start] = start + len(buf)
    runner.pinned = reg
    x = np.random.default_rng(15).integers(0, 256, (20, *SHAPE), dtype=np.uint8)
    arena = np.frombuffer(buf, dtype=np.uint8, count=x[:12].size, offset=192).reshape(12, *SHAPE)
    arena[:] = x[:12]
    # arena[9:12] follows arena[5:9] in memory but not in the batch (two parts between): a run of its own
    parts = [arena[:5], arena[5:9], x[12:14].copy(), torch.from_numpy(x[14:15].copy()), arena[9:12], x[15:].copy()]
    want = np.concatenate([np.asarray(p) for p in parts])
    runner._stage_direct(parts, len(want))
    np.testing.assert_array_equal(dst[: len(want)].numpy(), want)
    assert runner.direct_copies == 2  # arena[:9] as one copy, arena[9:12] as another
    del arena, parts


class _FakeCudart:
    """torch.cuda.cudart() on a machine without CUDA: registrations recorded, each answered `err`."""

    def __init__(self, err: int = 0):
        self.err = err
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, start, size, flags):  # noqa: N802 - CUDA's name
        self.registered.append(start)
        return self.err

    def cudaHostUnregister(self, start):  # noqa: N802 - CUDA's name
        self.unregistered.append(start)
        return self.err


def test_an_engine_that_stops_unregisters_the_arenas_still_registered(tmp_path, monkeypatch):
    """A front end still connected when its engine stops: its arena was registered at connect and is unregistered at
    the stop (release_all), so no range stays in CUDA's table after its mapping goes. An in-process engine that left
    one behind made later GPU tests in the same process fail with "resource already mapped"."""
    from .test_link import OUT, StubRunner

    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    path = str(tmp_path / "engine.sock")
    et = EngineThread(path, StubRunner("float32"))
    et.engine.pinned = arenas = pinned.PinnedArenas(True)
    x = np.random.default_rng(16).standard_normal((3, *et.engine.input_shape)).astype(np.float32)

    async def scenario():
        client = EngineClient([path], ready_states(), OUT, arena_size=1 << 20)
        client.start()
        await wait_until(lambda: client._wire[0] is not None)
        out = await asyncio.wait_for(client.submit(x, time.monotonic() + 5, time.monotonic())[1], 5)
        return client, out

    with et:
        client, (out, _) = asyncio.run(scenario())
        assert len(cudart.registered) == 1 and arenas.contains(cudart.registered[0], 1)
    client.close()
    assert out.shape == (3, OUT)
    assert cudart.unregistered == cudart.registered  # at the stop, with the front end still connected
    assert not arenas.contains(cudart.registered[0], 1)
    arenas.release_all()  # nothing left: no second unregistration
    assert cudart.unregistered == cudart.registered


def test_release_all_unregisters_each_arena_once_and_clears_a_failure(monkeypatch):
    import mmap

    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    cleared = []
    monkeypatch.setattr(pinned, "_clear_cuda_error", lambda: cleared.append(True))
    bufs = [mmap.mmap(-1, 1 << 16) for _ in range(3)]
    arenas = pinned.PinnedArenas(True)
    assert all(arenas.register(b) for b in bufs)
    arenas.retire(bufs[1])  # retired but not yet released: unregistered once, not twice
    cudart.err = 713  # cudaErrorHostMemoryNotRegistered: cleared, not raised
    arenas.release_all()
    assert sorted(cudart.unregistered) == sorted(pinned.address(b) for b in bufs) and len(cleared) == 3
    assert not any(arenas.contains(pinned.address(b), 1) for b in bufs)
    arenas.release_retired()
    assert len(cudart.unregistered) == 3
