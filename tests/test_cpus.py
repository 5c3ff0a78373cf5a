"""service/cpus.py: the CPUs a container may use (cgroup v2 cpu.max and v1 cfs quota along the cgroup's path, CPU
affinity), which the supervisor's default worker count follows (issue 51)."""

from __future__ import annotations

import os

import pytest

import service.cpus as cpus
from service.supervisor import default_workers


def _v2(tmp_path, limits: dict[str, str], path: str = "/kubepods/pod1/ctr") -> tuple:
    """A cgroup v2 tree with cpu.max per directory ({"": root's, "kubepods/pod1": ...}); (root, /proc/self/cgroup)."""
    root = tmp_path / "cgroup"
    (root / path.strip("/")).mkdir(parents=True)
    for where, value in limits.items():
        (root / where / "cpu.max").write_text(value + "\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::{path}\n")
    return root, proc


def test_a_v2_quota_is_read_in_cpus(tmp_path):
    assert cpus.quota_cpus(*_v2(tmp_path, {"kubepods/pod1/ctr": "200000 100000"})) == 2.0


def test_no_quota_is_none(tmp_path):
    assert cpus.quota_cpus(*_v2(tmp_path, {"kubepods/pod1/ctr": "max 100000", "": "max 100000"})) is None
    assert cpus.quota_cpus(tmp_path / "none", tmp_path / "no-such-file") is None


def test_the_smallest_quota_along_the_path_counts(tmp_path):
    """A pod's limit sits on the pod's directory, above the container's (which may have none)."""
    limits = {"kubepods/pod1/ctr": "max 100000", "kubepods/pod1": "150000 100000", "kubepods": "800000 100000"}
    assert cpus.quota_cpus(*_v2(tmp_path, limits)) == 1.5


def test_a_v1_quota_is_read(tmp_path):
    d = tmp_path / "cgroup" / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("300000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert cpus.quota_cpus(tmp_path / "cgroup", proc) == 3.0
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpus.quota_cpus(tmp_path / "cgroup", proc) is None


@pytest.mark.parametrize(("affinity", "quota", "want"), [(16, None, 16), (16, 2.0, 2), (16, 1.5, 2), (4, 8.0, 4),
                                                         (16, 0.5, 1)])  # fmt: skip
def test_usable_cpus_is_the_affinity_capped_by_the_quota_rounded_up(monkeypatch, affinity, quota, want):
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: affinity)
    monkeypatch.setattr(cpus, "quota_cpus", lambda: quota)
    assert cpus.usable_cpus() == want


def test_default_workers_follow_a_containers_quota(monkeypatch):
    """`docker run --cpus=3` on a 16-core host: two front ends beside the engine, not eight."""
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 16)
    monkeypatch.setattr(cpus, "quota_cpus", lambda: 3.0)
    assert default_workers(1) == 2


def test_this_machine_reads_without_error():
    n = cpus.usable_cpus()
    assert 1 <= n <= (os.cpu_count() or 1)
