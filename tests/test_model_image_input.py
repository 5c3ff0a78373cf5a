"""A model's image-preprocessing declaration (input.image): what the loader takes and refuses, what `fusedserve
import` writes for its flags, and what a front end holds of it (state.ModelInfo.image, which /model shows)."""

from __future__ import annotations

import json

import pytest

from service.cli import main
from service.frontend.state import ModelInfo
from service.images.preprocess import Preprocess
from service.model.loader import load_model
from service.model.spec import ModelFormatError
from tests.modelgen import IMAGENET_MEAN, IMAGENET_STD, write_pixel_model

from .server import REPO

RESNET_ONNX = REPO / "model_weights" / "digits-resnet" / "digits-resnet.onnx"


def _with_image(d, image: dict, shape=None):
    config = json.loads((d / "config.json").read_text())
    config["input"]["image"] = image
    if shape is not None:
        config["input"]["shape"] = shape
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_declared_preprocessing_reaches_the_front_end(tmp_path):
    d = _with_image(write_pixel_model(tmp_path / "m"), {"resize": 18, "interpolation": "bicubic", "channels": "BGR"})
    model = load_model(d)
    info = ModelInfo.of(model)
    assert info.image == {
        "formats": ["jpeg", "png", "webp"], "resize": 18, "interpolation": "bicubic", "crop": [16, 16],
        "channels": "BGR", "normalize": {"mean": IMAGENET_MEAN, "std": IMAGENET_STD},
    }  # fmt: skip
    assert Preprocess.from_description(info.image) == Preprocess.of(model.spec)
    plain = load_model(_with_image(write_pixel_model(tmp_path / "p", mean=None, std=None), {}))
    assert ModelInfo.of(plain).image["channels"] == "RGB" and ModelInfo.of(plain).image["resize"] is None
    assert ModelInfo.of(load_model(write_pixel_model(tmp_path / "t"))).image is None  # tensors only


@pytest.mark.parametrize(
    ("image", "shape", "message"),
    [
        ({"channels": "L"}, None, "channels 'L' gives 1 channel(s) but the input has 3"),
        ({"resize": 12}, None, "resize 12 makes the shorter side smaller than the center crop 16x16"),
        ({"resize": 0}, None, "resize: Input should be greater than or equal to 1"),
        ({"interpolation": "lanczos"}, None, "interpolation: Input should be 'bilinear' or 'bicubic'"),
        ({"crop": 224}, None, "crop: Extra inputs are not permitted"),
    ],
)
def test_bad_declarations_are_refused_naming_the_field(tmp_path, image, shape, message):
    d = _with_image(write_pixel_model(tmp_path / "m"), image, shape)
    with pytest.raises(ModelFormatError, match="input.image") as e:
        load_model(d)
    assert message in str(e.value)


def test_a_vector_input_cannot_take_images(tmp_path):
    from tests.modelgen import write_model

    d = _with_image(write_model(tmp_path / "v", [64, 10], ["relu"]), {})
    with pytest.raises(ModelFormatError, match=r"input.image: the input has shape \(64,\) per row"):
        load_model(d)


@pytest.mark.timeout(120)
def test_import_flags_declare_the_preprocessing(tmp_path, capsys):
    out = tmp_path / "digits-images"
    code = main(["import", str(RESNET_ONNX), str(out), "--resize", "8", "--mean", "0", "--std", "15.9375"])
    assert code == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["input"]["image"] == {"resize": 8}  # the rest at their defaults
    assert config["input"]["normalize"] == {"mean": [0.0], "std": [15.9375]}
    assert ModelInfo.of(load_model(out)).image["channels"] == "L"
    assert main(["import", str(RESNET_ONNX), str(tmp_path / "x"), "--channels", "RGB"]) == 1
    assert "channels 'RGB' gives 3 channel(s) but the input has 1" in capsys.readouterr().err
