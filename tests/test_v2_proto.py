"""The committed gRPC modules of service/v2 are what grpcio-tools generates from the committed .proto, and the .proto
is Triton's: every message, field, enum value and RPC it declares is in tritonclient's copy of Triton's descriptors
with the same name, number, type and label.

The modules are committed, not generated at import, so that serving needs no grpcio-tools (a compiler, ~10 MB) and
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
    for rpc in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
                "ModelConfig", "ModelStatistics"):  # fmt: skip
        assert f"rpc {rpc}({rpc}Request) returns ({rpc}Response)" in text, rpc


def _ours(tmp_path):
    """The committed .proto as a FileDescriptorProto, compiled by protoc (never imported: its package's names would
    clash with tritonclient's in protobuf's default pool)."""
    from google.protobuf import descriptor_pb2

    out = tmp_path / "ours.pb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--descriptor_set_out={out}", PROTO],
                   cwd=REPO, check=True, capture_output=True, timeout=60)  # fmt: skip
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    assert len(files) == 1
    return files[0]


def _theirs():
    """Triton's messages, enums and service as tritonclient ships them: {full name: descriptor proto}."""
    from google.protobuf import descriptor_pb2

    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    found = {}
    for module in (service_pb2, model_config_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        _index(found, f".{proto.package}", proto.message_type, proto.enum_type)
        for service in proto.service:
            found[f".{proto.package}.{service.name}"] = service
    return found


def _index(found: dict, scope: str, messages, enums) -> None:
    for enum in enums:
        found[f"{scope}.{enum.name}"] = enum
    for message in messages:
        found[f"{scope}.{message.name}"] = message
        _index(found, f"{scope}.{message.name}", message.nested_type, message.enum_type)


def test_every_declaration_is_tritons(tmp_path):
    """Names, numbers, types, labels, oneofs and enum values as Triton's grpc_service.proto and model_config.proto
    declare them (ours may leave fields out, never add or renumber one), and the RPCs' request and response types."""
    pytest.importorskip("grpc_tools")
    theirs = _theirs()
    ours = _ours(tmp_path)
    found: dict = {}
    _index(found, f".{ours.package}", ours.message_type, ours.enum_type)
    assert ours.package == "inference"
    checked = 0
    for name, decl in found.items():
        assert name in theirs, f"{name} is not a Triton declaration"
        triton = theirs[name]
        if hasattr(decl, "value"):  # an enum
            assert {(v.name, v.number) for v in decl.value} <= {(v.name, v.number) for v in triton.value}, name
            continue
        fields = {f.name: f for f in triton.field}
        for f in decl.field:
            t = fields.get(f.name)
            assert t is not None, f"{name}.{f.name} is not a field of Triton's {name}"
            assert (f.number, f.type, f.label, f.type_name) == (t.number, t.type, t.label, t.type_name), (
                f"{name}.{f.name}: ours {(f.number, f.type, f.label, f.type_name)}, "
                f"Triton's {(t.number, t.type, t.label, t.type_name)}"
            )
            if f.HasField("oneof_index"):
                assert t.HasField("oneof_index"), f"{name}.{f.name} is in a oneof; Triton's is not"
                assert decl.oneof_decl[f.oneof_index].name == triton.oneof_decl[t.oneof_index].name
            checked += 1
    (service,) = ours.service
    triton = theirs[f".inference.{service.name}"]
    methods = {m.name: m for m in triton.method}
    for m in service.method:
        assert (m.input_type, m.output_type) == (methods[m.name].input_type, methods[m.name].output_type), m.name
    assert checked > 100, checked
