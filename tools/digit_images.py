"""Write model_weights/digits-resnet/images/: the 8 held-out digits of examples.json as the image files a client of an
image model sends (N.png, N.jpg, N.webp, 8x8 gray), for the README's and docs/api.md's image examples.

Each raw pixel 0..16 becomes round(v * 255 / 16) (16 -> 255), so a model imported with `--mean 0 --std 15.9375` gets
the raw values back within 0.031. PNG and lossless WebP hold them exactly, the JPEGs (quality 95) within 6 levels of
255, and digits-resnet's top-1 on them is the raw rows' (tests/test_service_e2e_images.py checks all 360 digits).

    .venv/bin/python tools/digit_images.py
"""

from __future__ import annotations

from requires import REPO, require

require("numpy", "PIL")

import json  # noqa: E402

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

SCALE = 255 / 16


def main() -> None:
    folder = REPO / "model_weights" / "digits-resnet"
    rows = json.loads((folder / "examples.json").read_text())["inputs"]
    out = folder / "images"
    out.mkdir(exist_ok=True)
    for i, row in enumerate(rows):
        img = Image.fromarray(np.rint(np.asarray(row, np.float64).reshape(8, 8) * SCALE).astype(np.uint8))
        for name, options in ((f"{i}.png", {}), (f"{i}.jpg", {"quality": 95}), (f"{i}.webp", {"lossless": True})):
            img.save(out / name, **options)
            (out / name).chmod(0o644)
    print(f"wrote {len(rows) * 3} files to {out}: N.png, N.jpg, N.webp for N in 0..{len(rows) - 1}")


if __name__ == "__main__":
    main()
