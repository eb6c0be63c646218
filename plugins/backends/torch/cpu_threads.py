"""How many compute threads the CPU path runs: the configured count, else ``OMP_NUM_THREADS``
when the user set it, else the CPUs this process may actually use — its affinity mask, capped
by a cgroup CPU quota (Docker's ``--cpus``, a Kubernetes CPU limit).

The quota matters as much as the mask: a container limited to 2 CPUs on a 64-core host sees 64
cores in its mask, and 64 threads under a 2-CPU quota are descheduled at every step; each
kernel's barrier then waits for the slowest of them and a decode step takes many times longer.
A fractional quota rounds down (1.5 CPUs: one thread), because a thread that runs only part of
the time stalls every barrier it takes part in.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

log = logging.getLogger("llmserve.backend.torch")

CGROUP_ROOT = "/sys/fs/cgroup"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_cgroups(proc_cgroup: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as controller -> path ("" is cgroup v2's unified hierarchy)."""
    out: dict[str, str] = {}
    for line in (_read(Path(proc_cgroup)) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                out[controller] = parts[2]
    return out


def _ancestors(root: Path, rel: str) -> list[Path]:
    """``root/rel`` and every folder above it up to ``root`` (a parent's limit binds its children)."""
    path = root / rel.strip("/")
    out = [path]
    while path != root and root in path.parents:
        path = path.parent
        out.append(path)
    return out


def cgroup_cpu_limit(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPU quota of this process's cgroup (in CPUs, the tightest along its path), or None
    when there is none. Reads cgroup v2's ``cpu.max`` and v1's ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``; in a container the process's own cgroup is usually the root."""
    base = Path(root)
    groups = _own_cgroups(proc_cgroup)
    limits: list[float] = []
    if (base / "cgroup.controllers").exists():  # v2
        for folder in _ancestors(base, groups.get("", "/")):
            fields = (_read(folder / "cpu.max") or "").split()
            if len(fields) == 2 and fields[0] != "max" and int(fields[1]) > 0:
                limits.append(int(fields[0]) / int(fields[1]))
    else:  # v1: the cpu controller's own hierarchy
        for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            if not (base / mount).is_dir():
                continue
            for folder in _ancestors(base / mount, groups.get("cpu", "/")):
                quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
                if quota and period and int(quota) > 0 and int(period) > 0:
                    limits.append(int(quota) / int(period))
            break
    return min(limits) if limits else None


def usable_cpus(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> tuple[int, str]:
    """How many threads can run at once here, and why: the affinity mask, capped by the quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None and math.floor(limit) < cores:
        why = f"the cgroup's CPU quota of {limit:g} CPUs ({cores} cores in the affinity mask)"
        return max(1, math.floor(limit)), why
    return max(1, cores), f"{cores} cores in the affinity mask"


def set_cpu_threads(threads: int | None) -> None:
    """Size torch's thread pool (which the native kernels use too): ``threads`` when configured,
    else leave ``OMP_NUM_THREADS``'s choice, else ``usable_cpus()``."""
    if threads:
        torch.set_num_threads(threads)
        return
    if os.environ.get("OMP_NUM_THREADS"):
        return
    count, why = usable_cpus()
    log.info("compute threads: %d (%s; --torch-threads sets another count)", count, why)
    torch.set_num_threads(count)
