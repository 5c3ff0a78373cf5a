"""Development probe (issue 50): where a batch of JPEG requests spends the engine's time. The issue's serve run
before it (bench/results/h200/serve_issue50_before_h200.md) reached 9,681 JPEG images/s on ResNet-50 and 10,463 on
MobileNetV2 against 17,485 and 22,848 as UINT8 tensors, the GPU 52-74% busy: the engine decoded a batch's JPEGs
(nvJPEG through torchvision.io.decode_jpeg), resized them, then ran the forward, one after the other.

256 synthesized photos of about 500x375 at quality 90 (bench/serve/images.py, as the serve run sends), timed on the
GPU's wall clock (synchronized), median of 5 after 2 warm-ups; the process's CPU time per call beside it:
    decode 256           one decode_jpeg call for all 256 files
    decode 64 x4         four calls of 64, one after the other
    decode Tn            n Python threads, each its share of the 256 in calls of its own (each on a stream of its own)
    resize torch         Preprocess.many (shorter side 256, crop 224) of the decoded images: torch's ops
    resize kernel        kernels/resize.py's resize_crop of the same, one kernel (and its launch alone: device ms)
    BatchDecoder         the engine's whole step (service/images/gpu_decode.py): decode + resize + rows in place
    decode beside fwd    one decode call while a 12 ms GPU load runs on another stream: does the decode slow it?
    pil 1 image          Pillow's decode + the CPU resize of one file, for scale (a front end's core per image)

    python3 -m bench.probes.jpeg_decode --out $OUT     # ~30 s on an H200
"""

from __future__ import annotations

import statistics
import threading
import time
import warnings

import numpy as np
import torch

from .common import main

FILES = 256


def timed(fn, reps: int = 5, warmups: int = 2) -> dict:
    """fn's wall ms (synchronized) and the process's CPU ms per call, medians of `reps`."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    walls, cpus = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - t0))
        cpus.append(1e3 * (time.process_time() - c0))
    return {"wall_ms": statistics.median(walls), "cpu_ms": statistics.median(cpus)}


def _kernel_alone_ms(call) -> float:
    """The device ms of the one Triton launch `call` makes (kernels/resize.py's), without the host's work around it:
    the launch is captured with its arguments, then timed alone (triton.testing.do_bench)."""
    import triton

    import kernels.resize as resize

    captured = {}
    launch = resize.grid_launch

    def capture(kernel, grid):
        def run(*args, **kwargs):
            captured.update(kernel=kernel, grid=grid, args=args, kwargs=kwargs)
            return launch(kernel, grid)(*args, **kwargs)

        return run

    resize.grid_launch = capture
    try:
        call()
    finally:
        resize.grid_launch = launch
    k = captured
    return float(triton.testing.do_bench(lambda: k["kernel"][k["grid"]](*k["args"], **k["kwargs"]), rep=50))


def sweep() -> dict:
    from torchvision.io import ImageReadMode, decode_jpeg

    from bench.serve.images import encoded
    from kernels.resize import resize_crop
    from service.images.decode import decode as pil_decode
    from service.images.gpu_decode import BatchDecoder
    from service.images.preprocess import Preprocess
    from service.link import wire

    raw = encoded("v2_jpeg", FILES, seed=0, channels=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        files = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in raw]
    print(f"{FILES} files, {sum(map(len, raw)) / FILES / 1e3:.1f} KB each on average", flush=True)
    pre = Preprocess(224, 224, resize=256)
    dev = torch.device("cuda")

    def decode(fs):
        return decode_jpeg(fs, mode=ImageReadMode.RGB, device=dev)

    cases: dict[str, dict] = {}
    cases["decode 256"] = timed(lambda: decode(files))
    cases["decode 64 x4"] = timed(lambda: [decode(files[i : i + 64]) for i in range(0, FILES, 64)])
    cases["decode 32 x8"] = timed(lambda: [decode(files[i : i + 32]) for i in range(0, FILES, 32)])
    for n in (2, 4, 8):
        streams = [torch.cuda.Stream() for _ in range(n)]

        def threaded(n=n, streams=streams):
            share = FILES // n

            def work(i):
                with torch.cuda.stream(streams[i]):
                    decode(files[i * share : (i + 1) * share])
                    streams[i].synchronize()

            ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        cases[f"decode T{n}"] = timed(threaded)
    images = decode(files)
    cases["resize torch"] = timed(lambda: pre.many(images))
    cases["resize kernel"] = timed(lambda: resize_crop(images, 224, 224, 256))
    cases["resize kernel alone"] = {"device_ms": _kernel_alone_ms(lambda: resize_crop(images, 224, 224, 256))}
    dec = BatchDecoder(pre, dev)
    reqs = [[(wire.ENCODED_JPEG, memoryview(raw[i * 32 + j]), 0, 0) for j in range(32)] for i in range(FILES // 32)]
    cases["BatchDecoder"] = timed(lambda: dec(reqs))

    # A GPU load of about 12 ms (ResNet-50's forward of 256 images): matmuls on a stream of their own.
    a = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
    side = torch.cuda.Stream()

    def load():
        with torch.cuda.stream(side):
            for _ in range(6):
                a @ a

    cases["fwd alone"] = timed(load)
    cases["decode beside fwd"] = timed(lambda: (load(), decode(files)))
    cases["pil 1 image"] = timed(lambda: pre(torch.from_numpy(pil_decode(raw[0], "RGB", 10**8))), reps=21)

    print(
        f"\nresize kernel alone (its launch, without the host's work: do_bench): "
        f"{cases.pop('resize kernel alone')['device_ms']:.3f} ms of device time"
    )
    print("\n| case | wall ms | CPU ms | images/s |\n|---|---:|---:|---:|")
    for name, v in cases.items():
        n = 1 if name.startswith("pil") else (0 if name == "fwd alone" else FILES)
        rate = f"{n / v['wall_ms'] * 1e3:,.0f}" if n else ""
        print(f"| {name} | {v['wall_ms']:.2f} | {v['cpu_ms']:.2f} | {rate} |", flush=True)
    return {"files": FILES, "mean_kb": float(np.mean([len(b) for b in raw]) / 1e3), "cases": cases}


if __name__ == "__main__":
    main("jpeg_decode", sweep)
