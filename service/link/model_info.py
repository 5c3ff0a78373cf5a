"""What a front end must know of the model (ModelInfo): engine 0 reads the model and sends it to the supervisor, which
hands it to every front end it starts (service/supervisor.py). No tensors, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    """What a front end must know of the model to validate requests and label answers (no tensors, no torch)."""

    name: str
    description: str | None
    input_shape: tuple[int, ...]
    output_features: int
    labels: list[str] | None
    input_dtype: str = "float32"  # what clients send: "float32", or "uint8" pixels (integers 0-255)
    # A model that also takes encoded images: how they become its input (service/images/preprocess.py's
    # Preprocess.describe: resize, crop, interpolation, channels, normalize); None: tensors only.
    image: dict | None = None

    @classmethod
    def of(cls, model) -> ModelInfo:
        spec = model.spec
        image = None
        if spec.input.image is not None:
            from ..images.preprocess import Preprocess

            image = Preprocess.of(spec).describe()
        return cls(model.name, spec.description, tuple(model.input_shape), model.output_features, spec.labels,
                   spec.input.dtype, image)  # fmt: skip

    @property
    def input_features(self) -> int:
        return math.prod(self.input_shape)
