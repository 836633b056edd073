"""Device facts through NVML (pynvml), with a no-GPU fallback, and the study's device hygiene.

Two real implementations of :class:`Device`: :class:`NvmlDevice` (any object with pynvml's functions:
the real ``pynvml`` module, or a test's fake) and :class:`NoDevice` (no GPU: every check steps aside).
:class:`DeviceGuard` keeps the study's baseline (device memory in use when the study started),
waits before each launch until the device is back to it (vLLM's engine processes can outlive the API
server for a while, vLLM issue 55510) and raises :class:`DeviceBusyError` when something else keeps
holding memory; :meth:`DeviceGuard.peak` samples memory in use while a server lives.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from autotune.errors import AutotuneError, SpecError
from autotune.hardware.catalog import GIB, GPUS, GpuProfile

MIB = 1024**2
CLEAN_TOLERANCE_BYTES = 512 * MIB
"""Device memory above the baseline that still counts as "back to baseline"."""
CLEAN_TIMEOUT_S = 60.0
"""How long to wait for the device to come back to baseline before stopping the study."""
SAMPLE_INTERVAL_S = 0.5


class DeviceBusyError(AutotuneError):
    """Device memory stayed above the study's baseline: another process holds the GPU (environment fault)."""

    transient = True


class Device(Protocol):
    """What the tuner asks of an accelerator."""

    @property
    def present(self) -> bool:
        """Whether there is a device to ask (False: every check steps aside)."""
        ...

    def name(self) -> str:
        """The device's product name ('' without one)."""
        ...

    def total_bytes(self) -> int | None:
        """Total device memory, or None without a device."""
        ...

    def used_bytes(self) -> int | None:
        """Device memory in use right now (all processes), or None without a device."""
        ...

    def driver(self) -> str:
        """The GPU driver's version ('' without one, or when NVML does not say)."""
        ...


class NoDevice:
    """No GPU (or no NVML): knows nothing, so the device checks step aside."""

    present = False

    def name(self) -> str:
        """No name."""
        return ""

    def total_bytes(self) -> int | None:
        """Unknown."""
        return None

    def used_bytes(self) -> int | None:
        """Unknown."""
        return None

    def driver(self) -> str:
        """No driver."""
        return ""


class NvmlDevice:
    """One GPU through NVML. ``nvml`` is the ``pynvml`` module or an object with the same functions."""

    present = True

    def __init__(self, nvml: Any, selector: int | str = 0) -> None:
        self._nvml = nvml
        if isinstance(selector, str):
            self._handle = nvml.nvmlDeviceGetHandleByUUID(selector)
        else:
            self._handle = nvml.nvmlDeviceGetHandleByIndex(selector)
        self.selector = selector

    def name(self) -> str:
        """Product name, e.g. ``NVIDIA H100 80GB HBM3``."""
        raw = self._nvml.nvmlDeviceGetName(self._handle)
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def total_bytes(self) -> int | None:
        """Total memory as NVML reports it."""
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).total)

    def used_bytes(self) -> int | None:
        """Memory in use by every process on the device."""
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def driver(self) -> str:
        """The driver's version as NVML reports it (``550.54.15``); '' when it does not."""
        try:
            raw = self._nvml.nvmlSystemGetDriverVersion()
        except Exception:  # NVMLError subclasses, or an NVML without the call
            return ""
        return raw.decode() if isinstance(raw, bytes) else str(raw)


class DeviceSet:
    """The GPUs of one trial (tensor parallelism) watched as one: memory summed over them, present when
    every one is. The memory model sizes one GPU: :attr:`first` is that one."""

    def __init__(self, devices: list[NvmlDevice | NoDevice]) -> None:
        self.devices = devices
        self.first = devices[0]

    @property
    def present(self) -> bool:
        return all(d.present for d in self.devices)

    def name(self) -> str:
        return f"{len(self.devices)} x {self.first.name()}"

    def total_bytes(self) -> int | None:
        totals = [d.total_bytes() for d in self.devices]
        return None if any(t is None for t in totals) else sum(t for t in totals if t is not None)

    def used_bytes(self) -> int | None:
        used = [d.used_bytes() for d in self.devices]
        return None if any(u is None for u in used) else sum(u for u in used if u is not None)

    def driver(self) -> str:
        return self.first.driver()


def _is_index(name: str) -> bool:
    """Whether ``name`` is a GPU index: ASCII digits only (``str.isdigit`` also takes ``²`` and ``٣``,
    which ``int`` refuses)."""
    return name.isascii() and name.isdigit()


def visible_devices(cuda_visible_devices: str | None) -> list[int | str]:
    """Every GPU a server will use, from a ``CUDA_VISIBLE_DEVICES`` value: NVML indices or UUIDs (GPU 0
    when unset)."""
    names = [n.strip() for n in (cuda_visible_devices or "").split(",") if n.strip()]
    return [int(n) if _is_index(n) else n for n in names] or [0]


def open_devices(indices: list[int | str], nvml: Any = None) -> NvmlDevice | NoDevice | DeviceSet:
    """The GPUs ``indices`` as one device (:func:`open_device` for a single one)."""
    if len(indices) == 1:
        return open_device(nvml, indices[0])
    return DeviceSet([open_device(nvml, i) for i in indices])


@dataclass(frozen=True)
class HostGpus:
    """The GPUs NVML sees on this host: what GPU names given by the user are checked against."""

    uuids: tuple[str, ...] = ()
    """Each GPU's UUID, in NVML index order (empty: no pynvml, no driver, or no GPU)."""
    mig_uuids: tuple[str, ...] | None = ()
    """The UUIDs of the MIG devices; None when this NVML cannot list them (MIG names go unchecked)."""

    def problem(self, name: str) -> str | None:
        """Why ``name`` (a GPU index or UUID, as ``CUDA_VISIBLE_DEVICES`` takes it) is no GPU of this
        host; None when it is one. Without any GPU seen, only its form is checked."""
        if not _is_index(name) and not name.startswith(("GPU-", "MIG-")):
            return f"{name!r} is neither a GPU index (0, 1, ...) nor a GPU UUID (GPU-..., MIG-...)"
        if not self.uuids:
            return None
        count = len(self.uuids)
        seen = f"NVML sees {count} GPU{'s' if count > 1 else ''} on this host"
        if _is_index(name):
            if int(name) >= count:
                return f"GPU {int(name)} does not exist: {seen} ({', '.join(map(str, range(count)))})"
            return None
        if name.startswith("MIG-"):
            if self.mig_uuids is None or name in self.mig_uuids:
                return None
            return f"no MIG device has UUID {name!r}: NVML lists {len(self.mig_uuids)} MIG devices here"
        matches = [u for u in self.uuids if u.startswith(name)]  # CUDA takes a unique prefix too
        if len(matches) == 1:
            return None
        if matches:
            return f"{name!r} is the start of {len(matches)} GPUs' UUIDs: give more of it"
        return f"no GPU has UUID {name!r}: {seen} ({', '.join(self.uuids)})"


def host_gpus(nvml: Any = None) -> HostGpus:
    """The GPUs (and MIG devices) NVML sees here; an empty :class:`HostGpus` without pynvml, its library
    or a GPU."""
    if nvml is None:
        try:
            import pynvml

            nvml = pynvml
        except ImportError:
            return HostGpus()
    try:
        nvml.nvmlInit()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(int(nvml.nvmlDeviceGetCount()))]
        uuids = tuple(_text(nvml.nvmlDeviceGetUUID(h)) for h in handles)
    except Exception:  # NVMLError subclasses: library missing, driver not loaded, ...
        return HostGpus()
    return HostGpus(uuids, _mig_uuids(nvml, handles))


def _mig_uuids(nvml: Any, handles: list[Any]) -> tuple[str, ...] | None:
    """The UUIDs of every MIG device of ``handles``; None when this pynvml has no MIG functions."""
    if not hasattr(nvml, "nvmlDeviceGetMigDeviceHandleByIndex"):
        return None
    found = []
    for handle in handles:
        try:
            slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        except Exception:  # not MIG-capable, or MIG off
            continue
        for slot in range(slots):
            try:
                found.append(
                    _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)))
                )
            except Exception:  # an empty slot
                continue
    return tuple(found)


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def check_visible_devices(value: str | None, host: HostGpus) -> None:
    """Raise :class:`SpecError` naming ``CUDA_VISIBLE_DEVICES`` when, on a host where NVML sees GPUs, it
    names an index or a UUID that is no GPU here (the server would find no device, and the device checks
    would step aside). Entries of other forms (``-1`` hides every GPU) are CUDA's business."""
    if not value or not host.uuids:
        return
    for name in (n.strip() for n in value.split(",")):
        if _is_index(name) or name.startswith(("GPU-", "MIG-")):
            problem = host.problem(name)
            if problem is not None:
                raise SpecError("CUDA_VISIBLE_DEVICES", f"{value!r}: {problem}")


def open_device(nvml: Any = None, index: int | str = 0) -> NvmlDevice | NoDevice:
    """GPU ``index`` (an NVML index or a UUID) through NVML, or :class:`NoDevice` when pynvml, its
    library or the GPU is missing.

    ``nvml`` defaults to the real ``pynvml`` module; tests pass a fake with the same functions.
    """
    if nvml is None:
        try:
            import pynvml

            nvml = pynvml
        except ImportError:
            return NoDevice()
    try:
        nvml.nvmlInit()
        if isinstance(index, int) and index >= int(nvml.nvmlDeviceGetCount()):
            return NoDevice()
        return NvmlDevice(nvml, index)
    except Exception:  # pynvml raises NVMLError subclasses (library missing, driver not loaded, ...)
        return NoDevice()


def device_profile(device: Device) -> GpuProfile | None:
    """A :class:`GpuProfile` for a present device: the catalog's entry when the name and memory match one
    (for bandwidth and FLOPs), with the device's own total memory; None without a device."""
    if isinstance(device, DeviceSet):
        return device_profile(device.first)  # the memory model sizes one GPU of the set
    total = device.total_bytes()
    if not device.present or total is None:
        return None
    name = device.name()
    words = name.upper().replace("NVIDIA", "").split()
    for profile in GPUS.values():
        model = profile.name.split("-")[0].upper()
        if model in words and abs(profile.memory_bytes - total) < 0.1 * total:
            return GpuProfile(name, total, profile.bandwidth_gbs, profile.tflops, profile.interconnect_gbs)
    return GpuProfile(name or "gpu", total, 1000.0, 100.0)


class DeviceGuard:
    """The study's device hygiene: baseline memory, clean-before-launch, peak sampling per trial."""

    def __init__(
        self,
        device: Device,
        *,
        tolerance_bytes: int = CLEAN_TOLERANCE_BYTES,
        timeout_s: float = CLEAN_TIMEOUT_S,
        interval_s: float = SAMPLE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.device = device
        self.tolerance_bytes = tolerance_bytes
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self.baseline_bytes = device.used_bytes() if device.present else None
        """Memory in use when the study started (None without a device)."""

    def wait_clean(self) -> float | None:
        """Wait until memory in use is back within tolerance of the baseline; return the seconds waited.

        Returns None without a device. Raises :class:`DeviceBusyError` after ``timeout_s``.
        """
        if self.baseline_bytes is None:
            return None
        start = self._clock()
        while True:
            used = self.device.used_bytes()
            if used is None or used <= self.baseline_bytes + self.tolerance_bytes:
                return self._clock() - start
            waited = self._clock() - start
            if waited >= self.timeout_s:
                raise DeviceBusyError(
                    f"GPU {self.device.name()!r} still has {used / GIB:.2f} GiB in use after {waited:.0f}s, "
                    f"the study started at {self.baseline_bytes / GIB:.2f} GiB (tolerance "
                    f"{self.tolerance_bytes / GIB:.2f} GiB): another process holds the GPU; find it with "
                    "`nvidia-smi`, stop it, and rerun to resume the study"
                )
            self._sleep(min(self.interval_s, max(0.0, self.timeout_s - waited)))

    @contextlib.contextmanager
    def peak(self) -> Iterator[MemoryPeak]:
        """Sample memory in use while the block runs; the yielded :class:`MemoryPeak` holds the highest
        reading (and the baseline) once the block has ended. Without a device it stays empty."""
        result = MemoryPeak()
        if self.baseline_bytes is None:
            yield result
            return
        peak = [self.device.used_bytes() or 0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(self.interval_s):
                used = self.device.used_bytes()
                if used is not None:
                    peak[0] = max(peak[0], used)

        thread = threading.Thread(target=sample, name="autotune-gpu-peak", daemon=True)
        thread.start()
        try:
            yield result
        finally:
            stop.set()
            thread.join(timeout=self.interval_s + 5.0)  # a daemon: a driver call that hangs is left to it
            last = self.device.used_bytes()
            if last is not None:
                peak[0] = max(peak[0], last)
            result.peak_gib = round(peak[0] / GIB, 3)
            result.baseline_gib = round(self.baseline_bytes / GIB, 3)


class MemoryPeak:
    """Filled in by :meth:`DeviceGuard.peak` when its block ends (``None`` without a device)."""

    def __init__(self) -> None:
        self.peak_gib: float | None = None
        """Highest device memory in use while the block ran (GiB)."""
        self.baseline_gib: float | None = None
        """The study's baseline (GiB)."""
