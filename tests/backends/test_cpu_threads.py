"""The CPU thread count: the affinity mask capped by a cgroup CPU quota (v2 ``cpu.max`` and v1
``cpu.cfs_quota_us``), read from cgroup trees written here the way the kernel lays them out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("torch")

from llmserve.plugins.backends.torch import cpu_threads
from llmserve.plugins.backends.torch.cpu_threads import cgroup_cpu_limit, usable_cpus


def v2_tree(tmp_path: Path, limits: dict[str, str], own: str = "/") -> tuple[str, str]:
    """A unified hierarchy with ``cpu.max`` per folder; the process sits in ``own``."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for folder, value in limits.items():
        path = root / folder.strip("/")
        path.mkdir(parents=True, exist_ok=True)
        (path / "cpu.max").write_text(value + "\n")
    (root / own.strip("/")).mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::{own}\n")
    return str(root), str(proc)


def test_a_v2_container_quota_caps_the_threads(tmp_path) -> None:
    root, proc = v2_tree(tmp_path, {"/": "200000 100000"})
    assert cgroup_cpu_limit(root, proc) == 2.0
    count, why = usable_cpus(root, proc)
    cores = len(os.sched_getaffinity(0))
    assert count == min(2, cores)
    if cores > 2:
        assert "quota of 2 CPUs" in why


def test_no_quota_leaves_the_affinity_mask(tmp_path) -> None:
    root, proc = v2_tree(tmp_path, {"/": "max 100000", "/system.slice/app.service": "max 100000"},
                         own="/system.slice/app.service")
    assert cgroup_cpu_limit(root, proc) is None
    assert usable_cpus(root, proc)[0] == len(os.sched_getaffinity(0))


def test_the_tightest_limit_on_the_path_counts_and_fractions_round_down(tmp_path) -> None:
    root, proc = v2_tree(tmp_path, {"/kubepods": "150000 100000", "/kubepods/pod1/c1": "400000 100000"},
                         own="/kubepods/pod1/c1")
    assert cgroup_cpu_limit(root, proc) == 1.5
    assert usable_cpus(root, proc)[0] == 1  # 1.5 CPUs: one thread that never waits on a descheduled one


def test_a_v1_cfs_quota(tmp_path) -> None:
    root = tmp_path / "cgroup"
    cpu = root / "cpu,cpuacct" / "docker" / "abc"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text("300000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")  # the host's root: no limit
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_limit(str(root), str(proc)) == 3.0


def test_unreadable_or_missing_cgroups_mean_no_limit(tmp_path) -> None:
    assert cgroup_cpu_limit(str(tmp_path / "absent"), str(tmp_path / "absent-proc")) is None


def test_the_configured_count_and_omp_num_threads_win(monkeypatch) -> None:
    import torch

    before = torch.get_num_threads()
    try:
        cpu_threads.set_cpu_threads(1)
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: pytest.fail("OMP_NUM_THREADS was overridden"))
        cpu_threads.set_cpu_threads(None)
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: (1, "a test's quota"))
        torch.set_num_threads(max(2, before))
        cpu_threads.set_cpu_threads(None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
