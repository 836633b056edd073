"""One tuner per GPU set on this host (``autotune tune SPEC --gpus 0,1,2,3 --gpus-per-trial 2``).

Each worker is an ``autotune tune`` process of its own with ``CUDA_VISIBLE_DEVICES`` set to its GPUs, a
label that seeds its sampler apart from the others, and the same storage (passed in its environment as
``AUTOTUNE_STORAGE``, never on its command line, which every user of the host can read): the study's
budget, repeats and retries work across workers exactly as across hosts (:mod:`autotune.study.loop`). The
workers' output comes back line by line, each line prefixed with its GPU set. A signal to this process
(SIGTERM, SIGINT, SIGHUP) is passed to every worker, which stops its trial's server and gives the trial
back (one that arrives while the workers start: no further worker starts); then this process exits as
they did (128 + the signal).

The GPUs named are checked against what NVML sees (an index past the count, an unknown UUID, or a name of
neither form is refused). Where NVML sees no GPU nothing can be checked, so ``--gpus`` is refused unless
``AUTOTUNE_GPUS_WITHOUT_NVML=1`` says to run anyway: the workers then run the same way without a GPU (the
simulated server needs none), which is how the tests drive this path.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType

from autotune.errors import SpecError
from autotune.hardware.gpu import HostGpus
from autotune.inputs.loader import LoadedStudy
from autotune.inputs.spec import CategoricalParam, FloatParam, IntParam

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
WITHOUT_NVML = "AUTOTUNE_GPUS_WITHOUT_NVML"
"""The environment variable that lets ``--gpus`` run where NVML sees no GPU (``1``)."""
STORAGE_VAR = "AUTOTUNE_STORAGE"
"""The environment variable the CLI's ``--storage`` reads: how a worker gets the storage URL."""


def _whole_number(text: str) -> bool:
    """Whether ``text`` is ASCII digits only (``str.isdigit`` also takes '²', which ``int`` refuses)."""
    return re.fullmatch(r"[0-9]+", text) is not None


def gpu_sets(
    gpus: str, per_trial: str, host: HostGpus, *, without_nvml: bool = False
) -> list[tuple[str, ...]]:
    """The GPU sets of ``--gpus`` (``all``, or indices/UUIDs separated by commas), ``per_trial``
    (``--gpus-per-trial``, a whole number as typed) each, checked against the GPUs NVML sees (``host``).

    Where NVML sees no GPU nothing can be checked, and ``--gpus`` is refused unless ``without_nvml``
    (``AUTOTUNE_GPUS_WITHOUT_NVML=1``: the simulated server, or a host whose NVML is hidden); then only
    the names' form is checked. :class:`SpecError` naming the option and the value on bad input."""
    text = per_trial.strip()
    if not _whole_number(text):
        raise SpecError(
            "--gpus-per-trial",
            f"{per_trial!r} is not a whole number: give how many GPUs each trial uses, e.g. 2",
        )
    size = int(text)
    if size < 1:
        raise SpecError("--gpus-per-trial", f"must be at least 1, got {size}")
    if gpus.strip() == "all":
        if not host.uuids:
            raise SpecError("--gpus", "'all' but NVML sees no GPU: list them instead, e.g. --gpus 0,1")
        names = [str(i) for i in range(len(host.uuids))]
    else:
        names = [n.strip() for n in gpus.split(",")]
        if not names or any(not n for n in names):
            raise SpecError("--gpus", f"{gpus!r}: give GPU indices or UUIDs separated by commas, or 'all'")
        for name in names:
            if not _whole_number(name) and not name.startswith(("GPU-", "MIG-")):
                raise SpecError(
                    "--gpus",
                    f"{gpus!r}: {name!r} is neither a GPU index (0, 1, ...) nor a GPU UUID "
                    "(GPU-..., MIG-...)",
                )
        names = [str(int(n)) if _whole_number(n) else n for n in names]
        if len(set(names)) != len(names):
            raise SpecError("--gpus", f"{gpus!r} names a GPU twice")
        if not host.uuids and not without_nvml:
            raise SpecError(
                "--gpus",
                f"{gpus!r} but NVML sees no GPU on this host (no NVIDIA driver, or no pynvml), so the GPUs "
                f"cannot be checked: run without --gpus, or set {WITHOUT_NVML}=1 to run a worker per set "
                "anyway (the simulated server needs no GPU)",
            )
        for name in names:
            problem = host.problem(name)
            if problem is not None:
                raise SpecError("--gpus", f"{gpus!r}: {problem}")
    if len(names) % size:
        raise SpecError(
            "--gpus-per-trial", f"{size} does not divide the {len(names)} GPUs of --gpus {gpus!r}"
        )
    return [tuple(names[i : i + size]) for i in range(0, len(names), size)]


def check_fixed_parallelism(loaded: LoadedStudy, per_trial: int) -> None:
    """The fixed ``tensor_parallel_size × data_parallel_size`` of ``server.args`` must fit a trial's
    ``per_trial`` GPUs (vLLM would fail every launch for want of GPUs)."""
    args = {key.replace("-", "_"): value for key, value in loaded.spec.server.args.items()}
    sizes = {name: args.get(name) for name in ("tensor_parallel_size", "data_parallel_size")}
    if not all(isinstance(v, int) or v is None for v in sizes.values()):
        return
    tp, dp = (v if isinstance(v, int) else 1 for v in sizes.values())
    if tp * dp > per_trial:
        given = [n for n, v in sizes.items() if v is not None]
        raise SpecError(
            f"server.args.{given[0] if len(given) == 1 else 'tensor_parallel_size'}",
            f"tensor_parallel_size ({tp}) x data_parallel_size ({dp}) = {tp * dp} GPUs, more than the "
            f"{per_trial} GPUs of each trial",
        )


def check_parallelism(loaded: LoadedStudy, per_trial: int) -> None:
    """A trial's parallelism must fit its GPU set: the fixed ``server.args`` sizes
    (:func:`check_fixed_parallelism`), and the space's smallest ``tensor_parallel_size`` and
    ``data_parallel_size`` together at most ``per_trial``. Larger values of the space are fine: the study
    never samples a value that cannot fit (``tensor_parallel_size * data_parallel_size <= gpus_per_trial``
    makes it impossible), so one space serves sets of any size."""
    check_fixed_parallelism(loaded, per_trial)
    smallest: dict[str, float] = {}
    for name in ("tensor_parallel_size", "data_parallel_size"):
        param = loaded.space.params.get(name)
        if isinstance(param, CategoricalParam):
            low = min((v for v in param.choices if isinstance(v, int | float)), default=None)
        elif isinstance(param, IntParam | FloatParam):
            low = param.low
        else:
            continue
        if low is not None:
            smallest[name] = low
    if smallest and math.prod(smallest.values()) > per_trial:
        name = max(smallest, key=lambda n: smallest[n])
        shown = " × ".join(f"{n} {v:g}" for n, v in smallest.items())
        raise SpecError(
            f"search_space.{name}",
            f"the smallest layout ({shown}) needs more than the {per_trial} GPUs of each trial "
            "(--gpus-per-trial)",
        )


def label_of(gpus: Sequence[str]) -> str:
    """A worker's label: its GPU set (seeds its sampler apart from the other workers')."""
    return "gpus-" + ",".join(gpus)


@dataclass(frozen=True)
class WorkerCommand:
    """One worker's command line, and what its environment gets on top of the fleet's.

    A secret never goes in ``argv``: every user of the host can read a command line (``ps``,
    ``/proc/PID/cmdline``). The storage URL, which may hold a database password, goes in the environment
    as :data:`STORAGE_VAR`, which the worker's ``--storage`` reads."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict, repr=False)


def run_fleet(
    argv: WorkerCommand | Sequence[str],
    sets: Sequence[tuple[str, ...]],
    on_line: Callable[[str], None],
    env: Mapping[str, str] | None = None,
) -> int:
    """Run ``argv`` (an ``autotune tune`` command line without ``--gpus``, see :func:`worker_argv`) once
    per GPU set, pass each output line to ``on_line`` prefixed with the set, forward SIGTERM/SIGINT/SIGHUP
    to every worker (a signal while the workers start: no more start, and those started get it); the exit
    status: 128 + the signal when one arrived, else the first non-zero worker's, else 0."""
    command = argv if isinstance(argv, WorkerCommand) else WorkerCommand(tuple(argv))
    base = {**(env if env is not None else os.environ), **command.env}
    lock = threading.Lock()
    received: list[tuple[int, int]] = []  # each signal, and how many workers it was forwarded to
    procs: list[subprocess.Popen[str]] = []

    def relay(prefix: str, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                with lock:
                    on_line(f"[{prefix}] {line.rstrip()}")

    def tell(proc: subprocess.Popen[str], signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    def forward(signum: int, _frame: FrameType | None) -> None:
        # Runs in the main thread, between two steps of the loop below: ``procs`` as it is now.
        received.append((signum, len(procs)))
        for proc in procs:
            tell(proc, signum)

    threads = []
    with _handlers(forward):
        for gpus in sets:
            if received:
                break  # stopping: start no more workers
            worker_env = {**base, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
            proc = subprocess.Popen(
                [*command.argv, "--worker-label", label_of(gpus)],
                env=worker_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
            index = len(procs)
            procs.append(proc)
            # A signal that came while this worker started (before it was in ``procs``) missed it.
            for signum, started in list(received):
                if started <= index:
                    tell(proc, signum)
            thread = threading.Thread(target=relay, args=("gpus " + ",".join(gpus), proc), daemon=True)
            thread.start()
            threads.append(thread)
        codes = [proc.wait() for proc in procs]
        for thread in threads:
            thread.join(timeout=5)
    if received:
        return 128 + received[0][0]
    return next((c for c in codes if c != 0), 0)


@contextlib.contextmanager
def _handlers(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    previous = {sig: signal.signal(sig, handler) for sig in FORWARDED}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def worker_argv(spec: str, storage: str | None) -> WorkerCommand:
    """The command of one worker: this interpreter's ``autotune tune SPEC`` (its summary left to the
    fleet), with ``storage`` (``--storage``) in its environment, never on its command line."""
    return WorkerCommand(
        argv=(sys.executable, "-c", "from autotune.cli import main; main()", "tune", spec, "--no-summary"),
        env={STORAGE_VAR: storage} if storage else {},
    )
