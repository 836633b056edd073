"""Device hygiene (autotune/hardware/gpu.py) against a FAKE NVML passed in, and the no-GPU fallback."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from autotune.errors import SpecError
from autotune.hardware.catalog import GIB
from autotune.hardware.gpu import (
    DeviceBusyError,
    DeviceGuard,
    DeviceSet,
    HostGpus,
    NoDevice,
    NvmlDevice,
    check_visible_devices,
    device_profile,
    host_gpus,
    open_device,
    open_devices,
    visible_devices,
)


@dataclass
class _Memory:
    total: int
    used: int
    free: int


class FakeNvml:
    """pynvml's functions over a scripted list of memory-in-use readings (the last one repeats)."""

    class NVMLError(Exception):
        pass

    def __init__(self, used: list[int], total: int = 80 * GIB, name: str = "NVIDIA H100 80GB HBM3") -> None:
        self.used = list(used)
        self.total = total
        self.device_name = name
        self.reads = 0

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml\'s names
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 - pynvml\'s names
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:  # noqa: N802 - pynvml\'s names
        return ("handle", index)

    def nvmlDeviceGetName(self, handle: object) -> bytes:  # noqa: N802 - pynvml\'s names
        return self.device_name.encode()

    def nvmlDeviceGetUUID(self, handle: tuple[str, int]) -> bytes:  # noqa: N802 - pynvml\'s names
        return f"GPU-{handle[1]:04d}-aaaa".encode() if handle[0] == "handle" else f"MIG-{handle[1]}".encode()

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> _Memory:  # noqa: N802 - pynvml\'s names
        value = self.used[min(self.reads, len(self.used) - 1)]
        self.reads += 1
        return _Memory(self.total, value, self.total - value)

    def nvmlSystemGetDriverVersion(self) -> bytes:  # noqa: N802 - pynvml\'s names
        return b"550.54.15"


class BrokenNvml(FakeNvml):
    """NVML whose library cannot be loaded (no driver)."""

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml\'s names
        raise FakeNvml.NVMLError("NVML Shared Library Not Found")


class FakeClock:
    """A clock that advances only when slept."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.01)


def test_wait_clean_returns_once_memory_is_back_to_baseline() -> None:
    """After a trial, the guard waits while the old server's memory drains and returns when it is back."""
    nvml = FakeNvml([1 * GIB, 30 * GIB, 20 * GIB, 1 * GIB])
    clock = FakeClock()
    guard = DeviceGuard(open_device(nvml), timeout_s=10, interval_s=1, clock=clock, sleep=clock.sleep)
    assert guard.baseline_bytes == 1 * GIB
    waited = guard.wait_clean()
    assert waited == pytest.approx(2.0)


def test_something_else_holding_the_gpu_stops_the_study() -> None:
    """Memory that never comes back raises DeviceBusyError (an AutotuneError), naming the amounts."""
    nvml = FakeNvml([1 * GIB, 40 * GIB])
    clock = FakeClock()
    guard = DeviceGuard(open_device(nvml), timeout_s=5, interval_s=1, clock=clock, sleep=clock.sleep)
    with pytest.raises(DeviceBusyError, match=r"40\.00 GiB in use.*nvidia-smi"):
        guard.wait_clean()
    assert clock.now == pytest.approx(5.0)


def test_peak_sampler_records_the_highest_reading() -> None:
    """The peak sampler stores the highest memory in use seen while the block ran, and the baseline."""
    nvml = FakeNvml([1 * GIB, 1 * GIB, 22 * GIB, 3 * GIB])
    guard = DeviceGuard(open_device(nvml), interval_s=0.001)
    with guard.peak() as seen:
        while nvml.reads < 4:
            pass
    assert seen.peak_gib == pytest.approx(22.0)
    assert seen.baseline_gib == pytest.approx(1.0)


def test_without_a_gpu_the_checks_step_aside() -> None:
    """No NVML library (or no GPU): the device is NoDevice, waiting returns at once, no attrs are added."""
    device = open_device(BrokenNvml([0]))
    assert isinstance(device, NoDevice)
    guard = DeviceGuard(device)
    assert guard.wait_clean() is None
    with guard.peak() as seen:
        pass
    assert seen.peak_gib is None and seen.baseline_gib is None
    assert device_profile(device) is None


def test_device_profile_uses_the_catalog_entry_with_the_real_memory() -> None:
    """An H100 found through NVML gets the catalog's bandwidth and FLOPs with the device's own memory size."""
    device = open_device(FakeNvml([0], total=81559 * 1024**2))
    assert isinstance(device, NvmlDevice)
    profile = device_profile(device)
    assert profile is not None
    assert profile.memory_bytes == 81559 * 1024**2
    assert profile.bandwidth_gbs == 3350.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [0]),
        ("", [0]),
        ("2", [2]),
        ("3,1", [3, 1]),
        ("GPU-8f3a-11", ["GPU-8f3a-11"]),
        (" 1 , 0", [1, 0]),
        ("²", ["²"]),  # a digit to str.isdigit, not to int(): never an index
    ],
)
def test_visible_devices_follow_cuda_visible_devices(value: str | None, expected: list[int | str]) -> None:
    """NVML ignores CUDA_VISIBLE_DEVICES: the watched devices are its entries (indices or UUIDs)."""
    assert visible_devices(value) == expected


def test_a_device_set_is_watched_as_one() -> None:
    """Two GPUs of a tensor-parallel trial: memory summed, the memory model sized on the first one."""
    nvml = FakeNvml([GIB], total=80 * GIB)
    nvml.nvmlDeviceGetCount = lambda: 2  # type: ignore[method-assign]
    device = open_devices([0, 1], nvml)
    assert isinstance(device, DeviceSet) and device.present
    assert device.total_bytes() == 160 * GIB and device.used_bytes() == 2 * GIB
    profile = device_profile(device)
    assert profile is not None and profile.memory_bytes == 80 * GIB
    assert len(host_gpus(nvml).uuids) == 2 and host_gpus(BrokenNvml([0])) == HostGpus()
    assert device.driver() == "550.54.15"


def test_a_driver_nvml_cannot_name_is_left_empty() -> None:
    """An NVML without the call (or one that raises) names no driver; no GPU, none either."""

    class Silent(FakeNvml):
        def nvmlSystemGetDriverVersion(self) -> bytes:  # noqa: N802 - pynvml\'s names
            raise FakeNvml.NVMLError("Not Supported")

    assert open_device(Silent([GIB])).driver() == ""
    assert NoDevice().driver() == ""


class MigNvml(FakeNvml):
    """Two GPUs; the second split into two MIG devices (MIG functions as pynvml has them)."""

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 - pynvml\'s names
        return 2

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: tuple[str, int]) -> int:  # noqa: N802
        if handle[1] == 0:
            raise FakeNvml.NVMLError("Not Supported")
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: object, slot: int) -> tuple[str, int]:  # noqa: N802
        if slot >= 2:
            raise FakeNvml.NVMLError("Not Found")
        return ("mig", slot)


def test_host_gpus_lists_each_gpu_and_mig_device_by_uuid() -> None:
    """NVML's GPUs by index with their UUIDs, and the MIG devices of the GPUs that have them."""
    host = host_gpus(MigNvml([0]))
    assert host.uuids == ("GPU-0000-aaaa", "GPU-0001-aaaa")
    assert host.mig_uuids == ("MIG-0", "MIG-1")
    assert host_gpus(FakeNvml([0])).mig_uuids is None, "a pynvml without MIG functions: MIG goes unchecked"


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("0", None),
        ("1", None),
        ("7", "GPU 7 does not exist: NVML sees 2 GPUs on this host (0, 1)"),
        ("GPU-0001", None),
        ("GPU-000", "is the start of 2 GPUs' UUIDs"),
        ("GPU-9", "no GPU has UUID 'GPU-9'"),
        ("MIG-1", None),
        ("MIG-5", "no MIG device has UUID 'MIG-5'"),
        ("abc", "'abc' is neither a GPU index (0, 1, ...) nor a GPU UUID"),
        ("-1", "neither a GPU index"),
        ("²", "'²' is neither a GPU index"),
        ("٣", "'٣' is neither a GPU index"),
    ],
)
def test_a_gpu_name_must_be_a_gpu_of_this_host(name: str, problem: str | None) -> None:
    """Indices past NVML's count, unknown or ambiguous UUIDs and names of neither form are no GPU here."""
    found = HostGpus(("GPU-0000-aaaa", "GPU-0001-aaaa"), ("MIG-0", "MIG-1")).problem(name)
    assert (found is None) if problem is None else (found is not None and problem in found)


def test_without_a_gpu_only_the_form_of_a_name_is_checked() -> None:
    """No GPU seen: any index or UUID may be meant; garbage is still refused."""
    assert HostGpus().problem("7") is None and HostGpus().problem("GPU-x") is None
    assert HostGpus().problem("seven") is not None
    assert HostGpus().problem("²") is not None


def test_cuda_visible_devices_past_the_count_is_refused_where_nvml_sees_gpus() -> None:
    """CUDA_VISIBLE_DEVICES=7 on a 2-GPU host would run every trial without a device: refused, naming the
    variable and the value; no GPU seen, or CUDA's own forms (-1), are left alone."""
    host = HostGpus(("GPU-0000-aaaa", "GPU-0001-aaaa"))
    with pytest.raises(SpecError) as caught:
        check_visible_devices("1,7", host)
    assert caught.value.field == "CUDA_VISIBLE_DEVICES" and "'1,7'" in str(caught.value)
    check_visible_devices("1,0", host)
    check_visible_devices("-1", host)
    check_visible_devices("7", HostGpus())
