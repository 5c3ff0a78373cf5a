"""Build ResNet-18 or ResNet-50 (torchvision's architecture, random weights: bench/resnets.py) as an ONNX file that
`fusedserve serve` loads like any user's file, and check the file against the torch module through onnxruntime.

    .venv/bin/python tools/build_resnet.py resnet50 --out /tmp/resnet50    # /tmp/resnet50/resnet50.onnx (102 MB), ~5 s
    FUSEDSERVE_MODEL=/tmp/resnet50 fusedserve serve               # serves it (the importer folds BatchNorm)

`resnet-stem` writes the stem, pools and classifier alone (0.3 MB): the same 224x224 images for little GPU work, to
measure what bringing the images in costs (bench/resnets.py).

No pretrained weights can be downloaded here: the file is for measuring speed, not accuracy. Its BatchNorm nodes
carry statistics measured on random images and random affine parameters (bench/resnets.py says why).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from requires import require

require("numpy", "torch", "onnx", "onnxruntime")  # before importing them or writing anything

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import resnets

CHECK_ROWS = 2
MAX_RELATIVE_ERROR = 1e-4  # onnxruntime against torch, float32 (measured: ~1e-6)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", choices=resnets.NAMES)
    p.add_argument("--out", type=Path, required=True, help="directory to write <name>.onnx into")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and BatchNorm statistics [0]")
    p.add_argument("--image", type=int, default=resnets.IMAGE[1], help="image side in pixels [224]")
    args = p.parse_args(argv)
    t = time.perf_counter()
    path, module = resnets.write(args.name, args.out, args.seed, image=(3, args.image, args.image))
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t:.1f} s")

    import onnxruntime as ort

    x = torch.randn(CHECK_ROWS, 3, args.image, args.image, generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        want = module(x).numpy()
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    err = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"onnxruntime vs torch on {CHECK_ROWS} random images: max relative error {err:.1e}")
    if not err < MAX_RELATIVE_ERROR:
        print(f"FAIL: above {MAX_RELATIVE_ERROR:.0e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
