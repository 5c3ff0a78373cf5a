"""Where a model the user named is: one rule for `serve --model`, `check-model` and `import` (issue 51: `check-model
digits-mlp` failed where `serve --model digits-mlp` worked, and `serve --model ./does-not-exist` reported
`model_weights/does-not-exist`).

What was typed is either a path or a name:
- a path (it holds a `/`, starts with `.` or `~`, or ends in `.onnx`) is taken as given, and only there;
- a name is looked up as a path in the working directory, then under the model directory (FUSEDSERVE_MODEL_DIR),
  then, while that is left at its default, in the model_weights beside the package (so the shipped models are found
  from any working directory of a source checkout).
A model that is nowhere is refused with every place looked at, as the user would type them.
"""

from __future__ import annotations

import os
from pathlib import Path

from .spec import ModelFormatError

DEFAULT_MODEL_DIR = Path("model_weights")
PACKAGE_MODEL_DIR = Path(__file__).resolve().parents[2] / "model_weights"


class ModelNotFound(ModelFormatError):
    """No model where the user said; the message names each place looked at."""


def is_path(given: str) -> bool:
    return "/" in given or os.sep in given or given.startswith((".", "~")) or given.lower().endswith(".onnx")


def candidates(given: str, model_dir: Path | str | None = None) -> list[Path]:
    """The places `given` may be, in the order they are looked at."""
    if is_path(given):
        return [Path(given).expanduser()]
    model_dir = DEFAULT_MODEL_DIR if model_dir is None else Path(model_dir)
    places = [Path(given), model_dir / given]
    if model_dir == DEFAULT_MODEL_DIR and PACKAGE_MODEL_DIR.resolve() != DEFAULT_MODEL_DIR.resolve():
        places.append(PACKAGE_MODEL_DIR / given)  # a model_dir that was set is taken as given: a typo is reported
    return places


def locate_model(given: str | Path, model_dir: Path | str | None = None) -> Path:
    """The model directory or .onnx file `given` names; ModelNotFound naming the places looked at."""
    given = str(given)
    places = candidates(given, model_dir)
    for place in places:
        if place.is_dir() or place.is_file():
            return place
    if is_path(given):
        what = "no such .onnx file" if given.lower().endswith(".onnx") else "no such model directory or .onnx file"
        where = places[0].resolve()
        raise ModelNotFound(f"{given}: {what}" + (f" ({where})" if str(where) != given else ""))
    looked = ", ".join(str(p) for p in places)
    raise ModelNotFound(f"no model named {given!r}: looked in {looked} (give a model directory or an .onnx file)")
