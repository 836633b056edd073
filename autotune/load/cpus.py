"""The cores this process may really use: its CPU affinity, capped by its own cgroup's CPU quota.

A process limited by a CPU quota (a Kubernetes pod with ``resources.limits.cpu``, ``docker run --cpus``,
a systemd ``CPUQuota=``) still sees every core in its affinity mask; the quota is in the cgroup the
process belongs to, which is rarely the root cgroup. So the quota is read from the process's own cgroup
(``/proc/self/cgroup``), where its hierarchy is mounted (``/proc/self/mountinfo``), and from each
ancestor up to that mount: the tightest quota on the way limits the process.

* cgroup v2 (the ``0::<path>`` line): ``cpu.max`` = ``<quota> <period>`` (``max``: unlimited).
* cgroup v1 (the hierarchy whose controllers include ``cpu``, often ``cpu,cpuacct``):
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (a quota of ``-1``: unlimited).

Both are read when both exist (a hybrid host) and the tighter wins. Every function takes the root of
the file system (``root``), so tests read fabricated ``/proc`` and ``/sys`` trees.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_OCTAL = re.compile(r"\\([0-7]{3})")
_Reader = Callable[[Path], float | None]


@dataclass(frozen=True)
class _Mount:
    """One cgroup hierarchy mounted in this mount namespace."""

    root: str
    """The directory of the hierarchy that is mounted (``/`` unless only a subtree is visible)."""
    point: str
    """Where it is mounted (``/sys/fs/cgroup``, ``/sys/fs/cgroup/cpu,cpuacct``, ...)."""
    version: int
    controllers: frozenset[str]
    """v1: the controllers of the hierarchy (``cpu``, ``cpuacct``, ...); empty for v2."""


def available_cores(root: Path = Path("/")) -> float:
    """Cores this process may use: its CPU affinity, capped by its cgroup's CPU quota (v1 or v2)."""
    cores = float(len(os.sched_getaffinity(0)))
    quota = cgroup_quota(root)
    return min(cores, quota) if quota is not None else cores


def cgroup_quota(root: Path = Path("/")) -> float | None:
    """The tightest CPU quota (in cores) on this process's own cgroup and its ancestors, v1 or v2;
    ``None`` when there is none or it cannot be read."""
    try:
        own = (root / "proc/self/cgroup").read_text()
    except OSError:
        return None
    mounts = _mounts(root)
    found: list[float] = []
    for line in own.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path:
            continue
        if hierarchy == "0" and not controllers:
            found += _walk(root, path, [m for m in mounts if m.version == 2], _v2_quota, "/sys/fs/cgroup")
        elif "cpu" in controllers.split(","):
            v1 = [m for m in mounts if m.version == 1 and "cpu" in m.controllers]
            found += _walk(root, path, v1, _v1_quota, "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpu")
    return min(found) if found else None


def _mounts(root: Path) -> list[_Mount]:
    """The cgroup hierarchies mounted here, from ``/proc/self/mountinfo`` (empty when unreadable)."""
    try:
        text = (root / "proc/self/mountinfo").read_text()
    except OSError:
        return []
    mounts = []
    for line in text.splitlines():
        # id parent major:minor root mount-point options [optional fields] - type source super-options
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        kind = tail[0]
        if kind == "cgroup2":
            mounts.append(_Mount(_unescape(fields[3]), _unescape(fields[4]), 2, frozenset()))
        elif kind == "cgroup" and len(tail) >= 3:
            mounts.append(
                _Mount(_unescape(fields[3]), _unescape(fields[4]), 1, frozenset(tail[2].split(",")))
            )
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as an octal escape (``\\040``)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def _walk(root: Path, path: str, mounts: list[_Mount], read: _Reader, *fallbacks: str) -> list[float]:
    """The quotas found on ``path``'s directory and each ancestor up to its hierarchy's mount point.

    Without mountinfo the usual mount points (``fallbacks``) are tried, with the path as it is."""
    places = [(m.point, _relative(path, m.root)) for m in mounts]
    if not mounts:
        places = [(point, path) for point in fallbacks if (root / point.lstrip("/")).is_dir()]
    found = []
    for point, rel in places:
        if rel is None:  # the process's cgroup is outside what is mounted: read the mount's own root
            rel = "/"
        base = root / point.lstrip("/")
        parts = [p for p in rel.split("/") if p]
        for depth in range(len(parts), -1, -1):
            quota = read(base.joinpath(*parts[:depth]))
            if quota is not None:
                found.append(quota)
    return found


def _relative(path: str, mount_root: str) -> str | None:
    """``path`` (a cgroup path from ``/proc/self/cgroup``) below ``mount_root``, or ``None`` when it is
    not inside it."""
    if mount_root in ("", "/"):
        return path
    if path == mount_root:
        return "/"
    if path.startswith(mount_root.rstrip("/") + "/"):
        return path[len(mount_root.rstrip("/")) :]
    return None


def _v2_quota(directory: Path) -> float | None:
    """``cpu.max`` of one v2 cgroup in cores (``None``: unlimited, absent or unreadable)."""
    try:
        fields = (directory / "cpu.max").read_text().split()
        if len(fields) >= 2 and fields[0] != "max":
            quota, period = float(fields[0]), float(fields[1])
            return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        pass
    return None


def _v1_quota(directory: Path) -> float | None:
    """``cpu.cfs_quota_us / cpu.cfs_period_us`` of one v1 cgroup in cores (``None``: unlimited, absent)."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
