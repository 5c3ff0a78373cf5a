"""Installs that do not break each other (issue 51): service/v2's generated gRPC modules load under every protobuf and
grpcio that pyproject.toml admits, that range holds what the latest tritonclient pulls (setup.sh --test installs it
beside the service, so these run against it), and a start that cannot import says what to install, once."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from .server import REPO, service_env

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _declared() -> dict[str, Requirement]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, deps)}


def _gencode() -> tuple[Version, Version]:
    """(protobuf gencode version, grpcio-tools version) the committed modules were generated with."""
    pb2 = (REPO / "service/v2/grpc_predict_v2_pb2.py").read_text()
    major, minor, patch = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb2).groups()
    grpc = re.search(
        r"GRPC_GENERATED_VERSION = '([\d.]+)'", (REPO / "service/v2/grpc_predict_v2_pb2_grpc.py").read_text()
    )
    return Version(f"{major}.{minor}.{patch}"), Version(grpc.group(1))


def test_declared_ranges_hold_only_runtimes_the_generated_code_accepts():
    """protobuf's runtime loads gencode of its own major and the one before (its cross-version guarantee), never a
    newer gencode; grpcio loads code from its own version or older. So the floors are the generators' versions and
    protobuf's ceiling is one major past the gencode's."""
    gencode, grpc_tools = _gencode()
    declared = _declared()
    protobuf, grpcio = declared["protobuf"].specifier, declared["grpcio"].specifier
    assert gencode in protobuf and Version(f"{gencode.major + 1}.99") in protobuf
    assert Version(f"{gencode.major + 2}.0") not in protobuf, "a runtime two majors past the gencode is not promised"
    assert grpc_tools in grpcio
    for spec, floor in ((protobuf, gencode), (grpcio, grpc_tools)):
        assert any(s.operator == ">=" and Version(s.version) >= floor for s in spec), (spec, floor)
    # the test extra's grpcio-tools is the generator itself, so test_v2_proto's regeneration check compares like
    test_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert f"grpcio-tools=={grpc_tools}" in test_extra


def test_installed_tritonclient_shares_one_protobuf_with_the_service():
    """The tritonclient installed here (the latest, by setup.sh --test) and the service agree on protobuf and grpcio,
    and each imports with warnings as errors (a gencode/runtime mismatch warns or raises)."""
    from importlib.metadata import PackageNotFoundError, requires, version

    try:
        theirs = [Requirement(r) for r in requires("tritonclient") or []]
    except PackageNotFoundError:
        pytest.skip("tritonclient is not installed (setup.sh --test installs it)")
    declared = _declared()
    for package in ("protobuf", "grpcio"):
        have = Version(version(package))
        assert have in declared[package].specifier, f"{package} {have} is outside fusedserve's {declared[package]}"
        for r in theirs:
            if r.name == package and r.marker is not None and r.marker.evaluate({"extra": "grpc"}):
                assert have in r.specifier, f"{package} {have} is outside tritonclient's {r}"
    # Each in a process of its own: both define Triton's `inference` package in protobuf's default pool.
    for code in ("import tritonclient.grpc, tritonclient.http", "import service.v2.grpc_server"):
        out = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=REPO, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert out.returncode == 0, f"{code}: {out.stderr[-2000:]}"


def test_a_protobuf_too_old_stops_the_start_once_naming_what_to_install(tmp_path: Path):
    """A runtime older than the gencode (simulated: this protobuf made to report 6.0.0, as an older install would)
    stops `serve` with gRPC on before any front end starts: exit 2, one message with the package, the version it
    found and the range to install, and no front end started again and again."""
    (tmp_path / "sitecustomize.py").write_text(
        "import google.protobuf.runtime_version as rv\nrv.MAJOR, rv.MINOR, rv.PATCH = 6, 0, 0\n"
    )
    env = service_env(device="cpu", mode="unfused", grpc_port=1, port=2)  # never bound: the check comes first
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "service.cli", "serve"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert text.count('pip install "protobuf') == 1, text
    declared = str(_declared()["protobuf"])
    assert f'pip install "{declared}"' in text and "grpc_predict_v2" in text, text
    assert "starting it again" not in text and "front end" not in text, text
    assert time.monotonic() - start < 60
