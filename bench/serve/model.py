"""The model a `bench serve` run serves, resolved as `fusedserve serve --model` resolves it: a directory under
model_weights/ by name (digits-mlp, digits-cnn, digits-resnet), or a path to a model directory (config.json +
model.safetensors, or one .onnx file) or to an .onnx file. The run needs its name (the Open Inference Protocol's
URL), its input shape per row (what the request bodies carry) and its input dtype (which tensor datatypes it takes).

A config.json is read as JSON here; an ONNX model is imported by fusedserve's own loader in a child process, so this
process (which forks the client processes) stays free of torch.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL_WEIGHTS = REPO / "model_weights"
DEFAULT = "digits-mlp"
# The model format's input dtypes -> the v2 datatypes a client may send for them. A float input takes FP32 and FP16
# (converted at the front end); UINT8 only where the model declares uint8 pixels, which its first conv normalizes.
DATATYPES = {"float32": ("FP32", "FP16"), "float16": ("FP32", "FP16"), "uint8": ("UINT8", "FP32", "FP16")}


class ModelError(ValueError):
    """The model cannot be found or read; the message says which path was tried."""


@dataclass(frozen=True)
class ModelInfo:
    """What the benchmark needs of the served model."""

    name: str  # the Open Inference Protocol's model name (config.json's `name`; an ONNX file's stem or folder)
    path: str  # what `fusedserve serve --model` is given: absolute, since the servers run from the repository
    input_shape: tuple[int, ...]  # one row: (64,) for the digits MLP, (C, H, W) for an image model
    input_dtype: str  # the model format's: float32 (uint8 where the format declares pixels)
    takes_files: bool = False  # config.json's input declares image preprocessing: encoded files are taken too

    @property
    def image(self) -> bool:
        """An image model: rows of C x H x W. The JSON /predict phases and the MLP-only comparison apps skip it."""
        return len(self.input_shape) == 3

    @property
    def features(self) -> int:
        return math.prod(self.input_shape)

    @property
    def shipped_mlp(self) -> bool:
        """The digits MLP's shape: what the empty and eager comparison apps answer for."""
        return self.input_shape == (64,)

    def datatypes(self) -> tuple[str, ...]:
        return DATATYPES.get(self.input_dtype, ("FP32", "FP16"))

    def check_datatype(self, datatype: str) -> None:
        """ModelError unless the model takes `datatype` (UINT8: only a model that declares uint8 input)."""
        if datatype not in self.datatypes():
            raise ModelError(
                f"--input-dtype {datatype}: model {self.name!r} declares a {self.input_dtype} input, which takes "
                f"{', '.join(self.datatypes())}"
                + (' (UINT8 needs `"dtype": "uint8"` in its config.json\'s input)' if datatype == "UINT8" else "")
            )


def locate(given: str | None) -> Path:
    """The model's path as the server will load it: `given` as a path if one exists, else model_weights/<given>."""
    given = given or DEFAULT
    path = Path(given).expanduser()
    if path.exists():
        return path.resolve()
    named = MODEL_WEIGHTS / given
    if named.exists():
        return named
    choices = ", ".join(sorted(p.name for p in MODEL_WEIGHTS.iterdir() if p.is_dir())) if MODEL_WEIGHTS.is_dir() else ""
    raise ModelError(f"--model {given}: no such path, and no {named} (model_weights has {choices or 'nothing'})")


def resolve(given: str | None) -> ModelInfo:
    path = locate(given)
    config = path / "config.json"
    if path.is_dir() and config.is_file():
        return from_config(json.loads(config.read_text()), path)
    return _from_loader(path)


def from_config(config: dict, path: Path) -> ModelInfo:
    try:
        inp = config["input"]
        return ModelInfo(
            name=str(config["name"]), path=str(path), input_shape=tuple(int(d) for d in inp["shape"]),
            input_dtype=str(inp.get("dtype", "float32")), takes_files=inp.get("image") is not None,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{path / 'config.json'}: no model name or input shape ({type(e).__name__}: {e})") from None


def _from_loader(path: Path) -> ModelInfo:
    """An ONNX model: fusedserve's loader imports it (a few seconds: torch, onnx) in a child process."""
    code = (
        "import json, sys; from service.model.loader import load_model; m = load_model(sys.argv[1]); "
        "print(json.dumps({'name': m.name, 'shape': list(m.input_shape), 'dtype': m.spec.input.dtype}))"
    )
    run = subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelError(f"--model {path}: fusedserve cannot load it: {last}")
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    return ModelInfo(name=doc["name"], path=str(path), input_shape=tuple(doc["shape"]), input_dtype=doc["dtype"])
