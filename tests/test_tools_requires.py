"""tools/ scripts check what they need before they import it or write anything (tools/requires.py; issue 51:
`python tools/build_resnet.py` wrote its file, then failed on a missing onnxruntime)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .server import REPO

TOOLS = ("build_resnet.py", "train_digits.py", "train_digits_cnn.py", "train_digits_resnet.py")


def _run(script: str, args: list[str], hide: str | None = None) -> subprocess.CompletedProcess:
    """The script as `python tools/<script> ARGS`, with module `hide` made unimportable."""
    code = (
        "import runpy, sys\n"
        f"{f'sys.modules[{hide!r}] = None' if hide else ''}\n"
        f"sys.argv = ['tools/{script}', *{args!r}]\n"
        f"runpy.run_path('tools/{script}', run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("script", TOOLS)
def test_every_tool_checks_its_packages_first(script):
    text = (REPO / "tools" / script).read_text()
    check = text.index("require(")
    assert "import torch" not in text[:check] and "import numpy" not in text[:check], script


def test_a_missing_package_is_named_with_its_install_command_before_anything_is_written(tmp_path):
    out = tmp_path / "stem"
    done = _run("build_resnet.py", ["resnet-stem", "--out", str(out)], hide="onnxruntime")
    assert done.returncode == 2, done
    assert "tools/build_resnet.py needs onnxruntime, which" in done.stderr, done.stderr
    assert "pip install -e '.[tools]'" in done.stderr and "pip install onnxruntime" in done.stderr
    assert not out.exists(), "written before the check"


def test_with_its_packages_the_tool_builds_and_checks_its_file(tmp_path):
    pytest.importorskip("onnxruntime")
    done = _run("build_resnet.py", ["resnet-stem", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "resnet-stem.onnx").is_file() and "onnxruntime vs torch" in done.stdout
