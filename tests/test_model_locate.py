"""One rule finds a model for `serve --model`, `check-model` and `import` (service/model/locate.py), and a model that is
nowhere is refused with what the user typed and every place looked at (issue 51)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from service.cli import main
from service.config import PACKAGE_MODEL_DIR
from service.model.loader import load_model
from service.model.locate import ModelNotFound, locate_model


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory with no model_weights/ and no FUSEDSERVE_ variable."""
    for k in [k for k in os.environ if k.startswith("FUSEDSERVE_")]:
        monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_check_model_finds_a_name_as_serve_does(elsewhere, capsys):
    """`check-model digits-mlp` failed (`no such model directory`) where `serve --model digits-mlp` worked."""
    assert main(["check-model", "digits-mlp"]) == 0
    assert capsys.readouterr().out.startswith("digits-mlp: input (64,) -> 10 outputs")


def test_a_name_is_looked_up_in_the_working_directory_first(elsewhere):
    shutil.copytree(PACKAGE_MODEL_DIR / "digits-mlp", elsewhere / "digits-mlp")
    assert locate_model("digits-mlp") == Path("digits-mlp")  # ./digits-mlp, as README's export example writes it
    assert locate_model("digits-cnn") == PACKAGE_MODEL_DIR / "digits-cnn"


def test_a_path_is_taken_as_typed_and_reported_as_typed(elsewhere, capsys):
    """`serve --model ./does-not-exist` reported `model_weights/does-not-exist`."""
    with pytest.raises(ModelNotFound) as e:
        locate_model("./does-not-exist")
    assert str(e.value) == f"./does-not-exist: no such model directory or .onnx file ({elsewhere / 'does-not-exist'})"
    assert "model_weights" not in str(e.value)
    assert main(["check-model", "./does-not-exist"]) == 1
    assert "invalid model: ./does-not-exist: no such model directory" in capsys.readouterr().err


def test_a_missing_onnx_file_is_called_a_file(elsewhere, capsys):
    """A missing .onnx was called a directory."""
    with pytest.raises(ModelNotFound, match=r"^resnet\.onnx: no such \.onnx file \("):
        locate_model("resnet.onnx")
    assert main(["import", "missing.onnx", str(elsewhere / "out")]) == 1
    err = capsys.readouterr().err
    assert "missing.onnx: no such .onnx file" in err and "directory" not in err
    assert not (elsewhere / "out").exists()
    with pytest.raises(Exception, match=r"no such \.onnx file"):  # the loader, given a path directly, says the same
        load_model(elsewhere / "gone.onnx")


def test_a_name_found_nowhere_names_every_place_looked_at(elsewhere, monkeypatch, capsys):
    with pytest.raises(ModelNotFound) as e:
        locate_model("digits-mpl")
    assert str(e.value) == (
        f"no model named 'digits-mpl': looked in digits-mpl, model_weights/digits-mpl, {PACKAGE_MODEL_DIR}/digits-mpl "
        "(give a model directory or an .onnx file)"
    )
    # FUSEDSERVE_MODEL_DIR is read by check-model as by serve: a model_dir that was set is the only one looked in
    monkeypatch.setenv("FUSEDSERVE_MODEL_DIR", str(elsewhere / "models"))
    assert main(["check-model", "digits-mlp"]) == 1
    err = capsys.readouterr().err
    assert f"looked in digits-mlp, {elsewhere}/models/digits-mlp (give" in err and str(PACKAGE_MODEL_DIR) not in err


def test_serve_refuses_a_missing_model_naming_it(elsewhere, capsys):
    assert main(["serve", "--model", "./does-not-exist", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "cannot serve: ./does-not-exist: no such model directory or .onnx file" in err, err


def test_import_takes_a_model_name_holding_one_onnx_file(elsewhere):
    from service.cli import _onnx_source

    found = locate_model("digits-resnet")
    assert found == PACKAGE_MODEL_DIR / "digits-resnet"
    assert _onnx_source(found) == found / "digits-resnet.onnx"
    two = elsewhere / "two"
    two.mkdir()
    (two / "a.onnx").write_bytes(b"")
    (two / "b.onnx").write_bytes(b"")
    with pytest.raises(Exception, match=r"holds 2 \.onnx files; import needs one: name it"):
        _onnx_source(two)
