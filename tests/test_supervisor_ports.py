"""The service's ports are its own: one that something already listens on, even with SO_REUSEPORT (another fusedserve's
front ends, a gRPC server), stops the start with an error naming the setting, instead of the kernel splitting the
connections between the two servers; the service's own front ends still bind the ports it holds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.frontend.app import listen_socket
from service.supervisor import StartError, _reserve_port

from .server import REPO, free_port, service_env

HOST = "127.0.0.1"


def test_a_port_another_server_listens_on_is_refused_naming_the_setting():
    port = free_port()
    with listen_socket(HOST, port):  # another server's, bound as fusedserve's front ends and grpcio bind: SO_REUSEPORT
        with pytest.raises(StartError, match=rf"cannot listen on 127\.0\.0\.1:{port} \(FUSEDSERVE_PORT\): .*in use"):
            _reserve_port(HOST, port)
        with pytest.raises(StartError, match=rf"127\.0\.0\.1:{port} \(FUSEDSERVE_GRPC_PORT\)"):
            _reserve_port(HOST, port, "FUSEDSERVE_GRPC_PORT")


def test_a_held_port_takes_the_services_front_ends_and_then_refuses_a_second_service():
    port = free_port()
    hold = _reserve_port(HOST, port)
    try:
        with listen_socket(HOST, port), listen_socket(HOST, port), pytest.raises(StartError, match="in use"):
            _reserve_port(HOST, port)  # beside two front ends
    finally:
        hold.close()
    _reserve_port(HOST, port).close()  # free again once the service is gone


def test_serve_stops_when_its_grpc_port_is_taken():
    """The whole command: exit status 2 and the message, before any engine starts (the model is the shipped one)."""
    port, grpc_port = free_port(), free_port()
    with listen_socket(HOST, grpc_port):
        env = service_env(grpc_port=grpc_port, device="cpu")
        argv = [sys.executable, "-m", "service.cli", "serve", "--host", HOST, "--port", str(port)]
        done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert f"cannot listen on {HOST}:{grpc_port} (FUSEDSERVE_GRPC_PORT)" in done.stderr, done.stderr


def test_a_taken_port_typed_on_the_command_line_is_named_as_typed():
    """--grpc-port typed: the error says --grpc-port, not the variable the user never set (issue 51)."""
    port, grpc_port = free_port(), free_port()
    with listen_socket(HOST, grpc_port):
        argv = [sys.executable, "-m", "service.cli", "serve", "--host", HOST, "--port", str(port), "--grpc-port",
                str(grpc_port)]  # fmt: skip
        done = subprocess.run(argv, env=service_env(device="cpu"), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert f"cannot listen on {HOST}:{grpc_port} (--grpc-port)" in done.stderr, done.stderr
