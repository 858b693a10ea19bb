"""What the CPU offers this process: native bfloat16, and the cores it may really use.

Two questions the CPU checks ask and `os.cpu_count()` cannot answer:

- Does the CPU run bf16 matmuls and convolutions in hardware? Without it, autocast to
  bfloat16 emulates the math and runs slower, so `amp` does not apply to the CPU at all.
  The answer comes from the kernel's feature flags in `/proc/cpuinfo` (x86: AMX and
  AVX512-BF16; Arm: the `bf16` feature). `cpu_flags` is the one place that reads them: a
  test replaces it (monkeypatch) to play a CPU without bf16.
- How many cores may this process keep busy? torch's default intra-op thread count is the
  machine's physical cores, blind to the affinity mask (`taskset`, `numactl`, container
  cpusets) and to a cgroup CPU quota (`docker --cpus`, Kubernetes limits): the available
  count is the physical cores in the affinity mask, capped by the quota.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

# Feature flags meaning bf16 math in hardware, strongest first. x86 (Linux names): Intel AMX
# tiles with bf16, AVX512-BF16 (Intel Cooper Lake+, AMD Zen 4+); Arm: FEAT_BF16 (Neoverse
# V1/N2, Graviton 3+). oneDNN uses each of them for bf16 matmuls and convolutions.
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags as the kernel reports them (`flags` on x86, `Features` on
    Arm), or None where `/proc/cpuinfo` cannot be read (not Linux)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def bf16_features() -> list[str]:
    """The bf16 features this CPU has (e.g. ["amx_bf16", "avx512_bf16"]), strongest first."""
    flags = cpu_flags() or frozenset()
    return [flag for flag in BF16_FLAGS if flag in flags]


def no_bf16_reason() -> str | None:
    """Why bf16 autocast cannot pay off on this CPU, or None when it has native bf16."""
    flags = cpu_flags()
    if flags is None:
        return (
            f"this CPU's feature flags could not be read ({CPUINFO} is Linux-only), so "
            "native bfloat16 support is unknown"
        )
    if not bf16_features():
        return (
            f"this CPU has no native bfloat16 (none of {', '.join(BF16_FLAGS)} among its "
            f"flags in {CPUINFO}): autocast would emulate bf16 and run slower"
        )
    return None


@dataclass(frozen=True)
class Cores:
    """The cores this process may keep busy, and how that number came about."""

    count: int
    detail: str  # e.g. "2 physical cores in the affinity mask; no cgroup CPU quota"


def available_cores(sys_root: Path = Path("/sys"), proc_root: Path = Path("/proc")) -> Cores:
    """Physical cores in the affinity mask, capped by the cgroup CPU quota (rounded up).

    The roots are parameters so a test can point them at a made-up tree."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        count = os.cpu_count() or 1
        return Cores(count, f"{count} logical CPUs (no affinity mask on this platform)")
    physical = _physical_cores(cpus, sys_root)
    if physical is None:
        count, what = len(cpus), f"{_plural(len(cpus), 'logical CPU')} in the affinity mask"
    else:
        count, what = physical, f"{_plural(physical, 'physical core')} in the affinity mask"
        if physical < len(cpus):
            what += f" ({len(cpus)} logical CPUs)"
    quota = cgroup_cpu_quota(sys_root / "fs" / "cgroup", proc_root / "self" / "cgroup")
    if quota is None:
        return Cores(count, f"{what}; no cgroup CPU quota")
    limit = max(1, math.ceil(quota - 1e-9))
    if limit < count:
        return Cores(limit, f"{what}, capped by a cgroup CPU quota of {quota:g} CPUs")
    return Cores(count, f"{what}; cgroup CPU quota {quota:g} CPUs")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def machine_cores(sys_root: Path = Path("/sys")) -> int | None:
    """Physical cores of the whole machine (every online CPU): torch's default thread count,
    which ignores the affinity mask and quotas. None where the topology cannot be read."""
    try:
        online = (sys_root / "devices" / "system" / "cpu" / "online").read_text()
    except OSError:
        return None
    cpus: list[int] = []
    for part in online.strip().split(","):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return _physical_cores(cpus, sys_root)


def _physical_cores(cpus: list[int], sys_root: Path) -> int | None:
    """Distinct (package, core) pairs among `cpus` (hyperthread siblings count once)."""
    seen = set()
    for cpu in cpus:
        topology = sys_root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            return None
        seen.add((package, core))
    return len(seen)


def cgroup_cpu_quota(cgroup_root: Path, self_cgroup: Path) -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup and its ancestors, or None
    when there is none: cgroup v2 `cpu.max` ("max 100000" or "150000 100000"), v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1 for none)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: "0::/path", files under the unified root
            for folder in _ancestors(cgroup_root, path, ("unified", "")):
                quotas.append(_v2_quota(folder / "cpu.max"))
        elif "cpu" in controllers.split(","):
            mounts = (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu")
            for folder in _ancestors(cgroup_root, path, mounts):
                quotas.append(_v1_quota(folder))
    found = [quota for quota in quotas if quota is not None]
    return min(found) if found else None


def _ancestors(root: Path, path: str, mounts: tuple[str, ...]) -> list[Path]:
    """The cgroup folder of `path` and every parent up to the mount, under the first mount
    name that exists (v2 sits under "unified" on hybrid hosts, at the root otherwise; inside
    a container the path may be "/": then only the mount's root)."""
    for mount in mounts:
        base = root / mount if mount else root
        if base.is_dir():
            parts = [p for p in path.strip("/").split("/") if p]
            folders = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
            return [folder for folder in folders if folder.is_dir()]
    return []


def _v2_quota(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
