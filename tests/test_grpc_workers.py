"""gRPC in front ends of its own (FUSEDSERVE_GRPC_WORKERS, service/supervisor.py's frontend_roles): against the real
service (CPU, one HTTP front end and one gRPC front end, API keys on, real uvicorn and grpcio on loopback), each port
is listened on by its own process only, both answer with the key and refuse without it, and the gRPC front end,
killed, is started again holding the keys in force."""

from __future__ import annotations

import httpx
import pytest

from service.config import Settings
from service.processes import GRPC, HTTP, HTTP_AND_GRPC
from service.supervisor import frontend_roles

from .procs import children, listens_on
from .server import free_port, running_servers
from .test_keys_restart import KEY, assert_keys, kill_front_end
from .test_security import ROW, TIMEOUT, bearer


def test_roles_by_index():
    assert frontend_roles(2, grpc=False, grpc_workers=0) == [HTTP, HTTP]
    assert frontend_roles(2, grpc=True, grpc_workers=0) == [HTTP_AND_GRPC, HTTP_AND_GRPC]
    assert frontend_roles(2, grpc=True, grpc_workers=1) == [HTTP, HTTP, GRPC]


def test_grpc_workers_without_a_grpc_port_is_refused():
    with pytest.raises(ValueError, match="GRPC_WORKERS \\(2\\) needs FUSEDSERVE_GRPC_PORT"):
        Settings(_env_file=None, grpc_workers=2)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_grpc_served_by_a_front_end_of_its_own(tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text(f"{KEY}\n")
    grpc_port = free_port()
    env = {"workers": 1, "grpc_workers": 1, "grpc_port": grpc_port, "max_batch_size": 8, "dtype": "float32",
           "api_keys_file": keys, "log_level": "info"}  # fmt: skip
    with running_servers({"s": ("unfused", env)}, tmp_path) as servers:
        server = servers["s"]
        address = f"127.0.0.1:{grpc_port}"
        kids = children(server.process.proc.pid)
        http_port = int(server.url.rsplit(":", 1)[1])
        http_end, grpc_end = kids["fs-frontend-0"], kids["fs-frontend-1"]
        assert listens_on(http_end, http_port) and not listens_on(http_end, grpc_port)
        assert listens_on(grpc_end, grpc_port) and not listens_on(grpc_end, http_port)
        log = server.log()
        assert "1 front end(s) and 1 gRPC front end(s)" in log, log[-3000:]
        assert f"front end 1 (pid {grpc_end}) serving gRPC alone on 127.0.0.1:{grpc_port}" in log, log[-3000:]
        assert_keys(server, address, allowed=KEY)
        # The gRPC front end answers /health through no port, but the HTTP one reports the service ready.
        ready = httpx.get(server.url + "/health/ready", headers=bearer(KEY), timeout=TIMEOUT)
        assert ready.status_code == 200, ready.text
        kill_front_end(server, "fs-frontend-1")  # a crash: started again with the keys in force
        assert listens_on(children(server.process.proc.pid)["fs-frontend-1"], grpc_port)
        assert_keys(server, address, allowed=KEY)
        answer = httpx.post(server.url + "/predict", json={"inputs": [ROW]}, headers=bearer(KEY), timeout=TIMEOUT)
        assert answer.status_code == 200 and len(answer.json()["predictions"]) == 1, answer.text
