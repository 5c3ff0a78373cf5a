"""Which GPU each engine gets (service.supervisor.engine_devices), on the CPU with torch.cuda.device_count faked:
the forms CUDA_VISIBLE_DEVICES takes, fewer GPUs than listed, more engines than GPUs, and none at all.

Each engine process sets CUDA_VISIBLE_DEVICES to the id it is given, so an id is passed on as written (an index,
a GPU-/MIG- UUID or a prefix of one): CUDA, not fusedserve, resolves it.
"""

from __future__ import annotations

import pytest
import torch

from service.config import Settings
from service.supervisor import StartError, engine_devices

UUID_A = "GPU-8f3c1e2a-5d6b-4c7d-9e8f-0a1b2c3d4e5f"
UUID_B = "GPU-1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
MIG = "MIG-4b5c6d7e-8f90-5a1b-9c2d-3e4f5a6b7c8d"


@pytest.fixture
def gpus(monkeypatch):
    """gpus(count, visible): torch reports `count` devices; CUDA_VISIBLE_DEVICES is `visible` (None: unset)."""
    monkeypatch.delenv("FUSEDSERVE_ENGINES", raising=False)

    def set_up(count: int, visible: str | None) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)

    return set_up


def devices(engines: int | None = None, device_type: str = "cuda") -> list[str | None]:
    return engine_devices(Settings(_env_file=None, engines=engines), device_type)


@pytest.mark.parametrize(
    "count,visible,want",
    [
        (2, None, ["0", "1"]),  # unset: every device torch sees, by index
        (4, None, ["0", "1", "2", "3"]),
        (2, "0,1", ["0", "1"]),
        (2, " 1, 3 ", ["1", "3"]),  # spaces around ids are CUDA's to ignore, and ours
        (2, "3,1", ["3", "1"]),  # the listed order is CUDA's device order: kept
        (2, "1,,3,", ["1", "3"]),  # empty entries dropped
        (1, "0,1,2", ["0"]),  # more ids listed than torch sees (CUDA stops at an id that is not there): torch's count
        (2, f"{UUID_A},{UUID_B}", [UUID_A, UUID_B]),  # UUIDs passed on as written
        (2, f" {UUID_A} , 1", [UUID_A, "1"]),
        (1, MIG, [MIG]),
        (1, "GPU-8f3c", ["GPU-8f3c"]),  # a UUID prefix, as CUDA accepts it
    ],
    ids=lambda v: repr(v) if isinstance(v, str) or v is None else None,
)
def test_one_engine_per_visible_gpu(gpus, count, visible, want):
    gpus(count, visible)
    assert devices() == want


@pytest.mark.parametrize(
    "count,visible,engines,want",
    [
        (2, "0,1", 3, ["0", "1", "0"]),  # more engines than GPUs: round-robin
        (2, None, 5, ["0", "1", "0", "1", "0"]),
        (2, f"{UUID_A},{UUID_B}", 4, [UUID_A, UUID_B, UUID_A, UUID_B]),
        (4, "0,1,2,3", 2, ["0", "1"]),  # fewer engines than GPUs: the first ones
        (1, " 2 ", 2, ["2", "2"]),
    ],
)
def test_engines_setting_spreads_round_robin(gpus, count, visible, engines, want):
    gpus(count, visible)
    assert devices(engines) == want


@pytest.mark.parametrize("visible", [None, "", "0,1", "-1"])
@pytest.mark.parametrize("engines", [None, 2])
def test_no_visible_gpu_is_a_start_error_that_names_the_variable(gpus, visible, engines):
    """torch sees no device (CUDA_VISIBLE_DEVICES="" or "-1" hides them all): no engine list, a clear error, not an
    empty list (the supervisor would divide by it) or a ZeroDivisionError from the round-robin."""
    gpus(0, visible)
    with pytest.raises(StartError, match="CUDA_VISIBLE_DEVICES"):
        devices(engines)


@pytest.mark.parametrize("engines,want", [(None, [None]), (3, [None, None, None])])
def test_cpu_engines_get_no_device_and_cuda_is_not_asked(monkeypatch, engines, want):
    monkeypatch.delenv("FUSEDSERVE_ENGINES", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")

    def no_cuda():
        raise AssertionError("torch.cuda.device_count called for CPU engines")

    monkeypatch.setattr(torch.cuda, "device_count", no_cuda)
    assert devices(engines, "cpu") == want
