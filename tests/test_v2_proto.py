"""The committed gRPC modules of service/v2 are what grpcio-tools generates from the committed .proto.

They are committed, not generated at import, so that serving needs no grpcio-tools (a compiler, ~10 MB) and
starts without a code generation step; this test catches a .proto edited without regenerating them.
Regenerate, from the repository root:
    .venv/bin/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. service/v2/grpc_predict_v2.proto
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROTO = "service/v2/grpc_predict_v2.proto"
GENERATED = ("service/v2/grpc_predict_v2_pb2.py", "service/v2/grpc_predict_v2_pb2_grpc.py")


def test_generated_modules_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         PROTO],
        cwd=REPO, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    for path in GENERATED:
        assert (tmp_path / path).read_text() == (REPO / path).read_text(), f"{path} is stale: regenerate it (see above)"


def test_the_service_is_the_protocols():
    """Package, service and RPC names are what the protocol's clients call (/inference.GRPCInferenceService/...)."""
    text = (REPO / PROTO).read_text()
    assert "package inference;" in text and "service GRPCInferenceService" in text
    for rpc in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer"):
        assert f"rpc {rpc}({rpc}Request) returns ({rpc}Response)" in text, rpc
