"""The cores the client may use: its own cgroup's CPU quota (v1 and v2, read on fabricated /proc and /sys
trees, and for real in a cgroup with a quota where this machine lets the test make one) and its affinity."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.load.cpus import available_cores, cgroup_quota

V2_MOUNT = "41 23 0:38 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw\n"
V1_MOUNT = (
    "31 23 0:28 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    "33 31 0:30 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
)


def _write(root: Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def test_v2_reads_the_processs_own_cgroup_and_the_tightest_ancestor(tmp_path: Path) -> None:
    """cgroup v2: the 0:: line names the process's cgroup; cpu.max is read there and on every ancestor up
    to the mount, and the tightest quota wins (a pod limited at 2 cores inside a node slice at 0.5)."""
    _write(tmp_path, "proc/self/cgroup", "0::/kubepods.slice/pod1/ctr\n")
    _write(tmp_path, "proc/self/mountinfo", V2_MOUNT)
    _write(tmp_path, "sys/fs/cgroup/cpu.max", "max 100000\n")  # never on a real root, harmless here
    _write(tmp_path, "sys/fs/cgroup/kubepods.slice/cpu.max", "50000 100000\n")
    _write(tmp_path, "sys/fs/cgroup/kubepods.slice/pod1/cpu.max", "200000 100000\n")
    _write(tmp_path, "sys/fs/cgroup/kubepods.slice/pod1/ctr/cpu.max", "max 100000\n")
    assert cgroup_quota(tmp_path) == pytest.approx(0.5)
    _write(tmp_path, "sys/fs/cgroup/kubepods.slice/pod1/ctr/cpu.max", "30000 100000\n")
    assert cgroup_quota(tmp_path) == pytest.approx(0.3)


def test_v2_without_a_quota_anywhere_is_unlimited(tmp_path: Path) -> None:
    """cpu.max of 'max' (or no cpu.max: the controller is not enabled) means no quota."""
    _write(tmp_path, "proc/self/cgroup", "0::/user.slice/session-1.scope\n")
    _write(tmp_path, "proc/self/mountinfo", V2_MOUNT)
    _write(tmp_path, "sys/fs/cgroup/user.slice/cpu.max", "max 100000\n")
    (tmp_path / "sys/fs/cgroup/user.slice/session-1.scope").mkdir()
    assert cgroup_quota(tmp_path) is None


def test_v2_in_a_cgroup_namespace_reads_below_the_mount(tmp_path: Path) -> None:
    """Inside a container with its own cgroup namespace, /proc/self/cgroup says 0::/ and the container's
    cgroup is what is mounted at /sys/fs/cgroup: its cpu.max is the limit (the Kubernetes Job's case)."""
    _write(tmp_path, "proc/self/cgroup", "0::/\n")
    _write(tmp_path, "proc/self/mountinfo", V2_MOUNT)
    _write(tmp_path, "sys/fs/cgroup/cpu.max", "150000 100000\n")
    assert cgroup_quota(tmp_path) == pytest.approx(1.5)


def test_v1_reads_the_cpu_hierarchy_of_the_process(tmp_path: Path) -> None:
    """cgroup v1: the hierarchy with the cpu controller (cpu,cpuacct); cfs_quota_us / cfs_period_us on the
    process's cgroup and its ancestors (-1: unlimited); other controllers' paths are ignored."""
    _write(tmp_path, "proc/self/cgroup", "5:memory:/elsewhere\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(tmp_path, "proc/self/mountinfo", V1_MOUNT)
    base = "sys/fs/cgroup/cpu,cpuacct"
    for path, quota in ((base, "-1"), (f"{base}/docker", "-1"), (f"{base}/docker/abc", "30000")):
        _write(tmp_path, f"{path}/cpu.cfs_quota_us", quota + "\n")
        _write(tmp_path, f"{path}/cpu.cfs_period_us", "100000\n")
    _write(tmp_path, "sys/fs/cgroup/memory/elsewhere/cpu.cfs_quota_us", "1000\n")  # not a cpu hierarchy
    assert cgroup_quota(tmp_path) == pytest.approx(0.3)


def test_v1_mounted_subtree_and_escaped_mount_point(tmp_path: Path) -> None:
    """A container without a cgroup namespace sees its own cgroup path (/docker/abc) while only that
    subtree is mounted (mountinfo's root field); mount points with spaces are octal-escaped."""
    _write(tmp_path, "proc/self/cgroup", "2:cpu:/docker/abc\n")
    _write(
        tmp_path,
        "proc/self/mountinfo",
        r"32 31 0:29 /docker/abc /sys/fs/cgroup/my\040cpu rw - cgroup cgroup rw,cpu" + "\n",
    )
    _write(tmp_path, "sys/fs/cgroup/my cpu/cpu.cfs_quota_us", "250000\n")
    _write(tmp_path, "sys/fs/cgroup/my cpu/cpu.cfs_period_us", "100000\n")
    assert cgroup_quota(tmp_path) == pytest.approx(2.5)


def test_hybrid_takes_the_tighter_of_v1_and_v2(tmp_path: Path) -> None:
    """A hybrid host has both; the tighter quota limits the process."""
    _write(tmp_path, "proc/self/cgroup", "1:cpu:/job\n0::/job\n")
    _write(
        tmp_path,
        "proc/self/mountinfo",
        "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
    )
    _write(tmp_path, "sys/fs/cgroup/cpu/job/cpu.cfs_quota_us", "80000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu/job/cpu.cfs_period_us", "100000\n")
    _write(tmp_path, "sys/fs/cgroup/unified/job/cpu.max", "60000 100000\n")
    assert cgroup_quota(tmp_path) == pytest.approx(0.6)


def test_without_mountinfo_the_usual_mount_points_are_tried(tmp_path: Path) -> None:
    """No mountinfo (a stripped /proc): v2 at /sys/fs/cgroup, v1 at /sys/fs/cgroup/cpu[,cpuacct]."""
    _write(tmp_path, "proc/self/cgroup", "0::/a\n")
    _write(tmp_path, "sys/fs/cgroup/a/cpu.max", "40000 100000\n")
    assert cgroup_quota(tmp_path) == pytest.approx(0.4)


def test_unreadable_or_garbled_files_mean_no_quota(tmp_path: Path) -> None:
    """Nothing to read, or nonsense in the files: no quota rather than an error."""
    assert cgroup_quota(tmp_path) is None
    _write(tmp_path, "proc/self/cgroup", "garbage\n0::/x\n")
    _write(tmp_path, "proc/self/mountinfo", V2_MOUNT + "nonsense line\n")
    _write(tmp_path, "sys/fs/cgroup/x/cpu.max", "lots 0\n")
    assert cgroup_quota(tmp_path) is None


def test_available_cores_is_the_affinity_capped_by_the_quota(tmp_path: Path) -> None:
    """The core count is the affinity mask's size, or the quota when that is smaller."""
    affinity = len(os.sched_getaffinity(0))
    assert available_cores(tmp_path) == affinity  # no cgroup files: the affinity alone
    _write(tmp_path, "proc/self/cgroup", "0::/\n")
    _write(tmp_path, "proc/self/mountinfo", V2_MOUNT)
    _write(tmp_path, "sys/fs/cgroup/cpu.max", "25000 100000\n")
    assert available_cores(tmp_path) == pytest.approx(0.25)
    _write(tmp_path, "sys/fs/cgroup/cpu.max", f"{(affinity + 3) * 100000} 100000\n")
    assert available_cores(tmp_path) == affinity


# -- for real -----------------------------------------------------------------------------------------


def _quota_cgroup() -> Iterator[Path]:
    """A new cgroup with a quota of 0.3 core beside this process's own (v2 where the cpu controller is
    delegated, else v1's cpu hierarchy), removed afterwards; skips where this machine does not allow it."""
    own = Path("/proc/self/cgroup").read_text().splitlines()
    mounts = [line.split(" - ") for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    name = f"autotune-test-{uuid.uuid4().hex[:8]}"
    candidates: list[tuple[Path, str, str]] = []
    for left, right in (m for m in mounts if len(m) == 2):
        fields, tail = left.split(), right.split()
        if tail[0] == "cgroup2" and fields[3] == "/":
            path = next((line[3:] for line in own if line.startswith("0::")), None)
            if path is not None:
                candidates.append((Path(fields[4] + path), "cpu.max", "30000 100000"))
        elif tail[0] == "cgroup" and "cpu" in tail[2].split(",") and fields[3] == "/":
            path = next(
                (line.split(":", 2)[2] for line in own if "cpu" in line.split(":")[1].split(",")), None
            )
            if path is not None:
                candidates.append((Path(fields[4] + path), "cpu.cfs_quota_us", "30000"))
    for parent, knob, value in candidates:
        group = parent / name
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            (group / knob).write_text(value)
        except OSError:
            group.rmdir()
            continue
        try:
            yield group
        finally:
            group.rmdir()
        return
    pytest.skip(
        "no cgroup with a CPU quota can be made here (needs root and a writable cgroup cpu controller)"
    )


@pytest.fixture
def quota_cgroup() -> Iterator[Path]:
    yield from _quota_cgroup()


def test_a_process_in_a_cgroup_with_a_quota_counts_its_quota(quota_cgroup: Path) -> None:
    """Run for real: a process placed in a cgroup limited to 0.3 core counts 0.3 cores, not the machine's
    (the issue's case: the root cgroup's unlimited quota was read instead)."""
    code = "from autotune.load.cpus import available_cores; print(available_cores())"
    out = subprocess.run(
        ["sh", "-c", f'echo $$ > "{quota_cgroup}/cgroup.procs" && exec "{sys.executable}" -c "{code}"'],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=60,
    )
    assert float(out.stdout) == pytest.approx(0.3)
