"""One tuner per GPU set on this host (``autotune tune SPEC --gpus 0,1,2,3 --gpus-per-trial 2``).

Each worker is an ``autotune tune`` process of its own with ``CUDA_VISIBLE_DEVICES`` set to its GPUs, a
label that seeds its sampler apart from the others, and the same storage: the study's budget, repeats and
retries work across workers exactly as across hosts (:mod:`autotune.study`). The workers' output comes
back line by line, each line prefixed with its GPU set. A signal to this process (SIGTERM, SIGINT,
SIGHUP) is passed to every worker, which stops its trial's server and gives the trial back; then this
process exits as they did (128 + the signal).

The workers need not see a GPU: without one (or with the simulated server) they run the same way, which
is how the tests drive this path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType

from autotune.errors import SpecError
from autotune.loader import LoadedStudy
from autotune.spec import CategoricalParam, FloatParam, IntParam

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def gpu_sets(gpus: str, per_trial: int, count: Callable[[], int]) -> list[tuple[str, ...]]:
    """The GPU sets of ``--gpus`` (``all``, or indices/UUIDs separated by commas), ``per_trial`` each;
    ``count`` says how many GPUs NVML sees (for ``all``). :class:`SpecError` on bad input."""
    if per_trial < 1:
        raise SpecError("--gpus-per-trial", f"must be at least 1, got {per_trial}")
    if gpus.strip() == "all":
        found = count()
        if not found:
            raise SpecError("--gpus", "'all' but NVML sees no GPU: list them instead, e.g. --gpus 0,1")
        names = [str(i) for i in range(found)]
    else:
        names = [n.strip() for n in gpus.split(",")]
        if not names or any(not n for n in names):
            raise SpecError("--gpus", f"{gpus!r}: give GPU indices or UUIDs separated by commas, or 'all'")
        if len(set(names)) != len(names):
            raise SpecError("--gpus", f"{gpus!r} names a GPU twice")
    if len(names) % per_trial:
        raise SpecError(
            "--gpus-per-trial", f"{per_trial} does not divide the {len(names)} GPUs of --gpus {gpus!r}"
        )
    return [tuple(names[i : i + per_trial]) for i in range(0, len(names), per_trial)]


def check_parallelism(loaded: LoadedStudy, per_trial: int) -> None:
    """A trial's tensor parallelism must fit its GPU set: the space's upper bound of
    ``tensor_parallel_size`` and a fixed ``server.args`` value at most ``per_trial``."""
    for key, value in loaded.spec.server.args.items():
        if key.replace("-", "_") == "tensor_parallel_size" and isinstance(value, int) and value > per_trial:
            raise SpecError(
                f"server.args.{key}",
                f"{value} is more than the {per_trial} GPUs of each trial (--gpus-per-trial)",
            )
    param = loaded.space.params.get("tensor_parallel_size")
    if isinstance(param, CategoricalParam):
        high: float | None = max((v for v in param.choices if isinstance(v, int | float)), default=None)
    elif isinstance(param, IntParam | FloatParam):
        high = param.high
    else:
        return
    if high is not None and high > per_trial:
        raise SpecError(
            "search_space.tensor_parallel_size",
            f"reaches {high:g}, more than the {per_trial} GPUs of each trial (--gpus-per-trial)",
        )


def label_of(gpus: Sequence[str]) -> str:
    """A worker's label: its GPU set (seeds its sampler apart from the other workers')."""
    return "gpus-" + ",".join(gpus)


def run_fleet(
    argv: Sequence[str],
    sets: Sequence[tuple[str, ...]],
    on_line: Callable[[str], None],
    env: Mapping[str, str] | None = None,
) -> int:
    """Run ``argv`` (an ``autotune tune`` command line without ``--gpus``) once per GPU set, pass each
    output line to ``on_line`` prefixed with the set, forward SIGTERM/SIGINT/SIGHUP to every worker; the
    exit status: 128 + the signal when one arrived, else the first non-zero worker's, else 0."""
    base = dict(env if env is not None else os.environ)
    lock = threading.Lock()
    received: list[int] = []
    procs: list[subprocess.Popen[str]] = []

    def relay(prefix: str, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with lock:
                on_line(f"[{prefix}] {line.rstrip()}")

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    threads = []
    with _handlers(forward):
        for gpus in sets:
            worker_env = {**base, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
            proc = subprocess.Popen(
                [*argv, "--worker-label", label_of(gpus)],
                env=worker_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
            procs.append(proc)
            thread = threading.Thread(target=relay, args=("gpus " + ",".join(gpus), proc), daemon=True)
            thread.start()
            threads.append(thread)
        codes = [proc.wait() for proc in procs]
        for thread in threads:
            thread.join(timeout=5)
    if received:
        return 128 + received[0]
    return next((c for c in codes if c != 0), 0)


@contextlib.contextmanager
def _handlers(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    previous = {sig: signal.signal(sig, handler) for sig in FORWARDED}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def worker_argv(spec: str, storage: str | None) -> list[str]:
    """The command line of one worker: this interpreter's ``autotune tune SPEC`` (its summary left to
    the fleet)."""
    return [
        sys.executable,
        "-c",
        "from autotune.cli import main; main()",
        "tune",
        spec,
        *(["--storage", storage] if storage else []),
        "--no-summary",
    ]
