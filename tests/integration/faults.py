"""Helpers of the fault tests: a tuner as a real process, kill points read from its event log, and the
invariants a study must keep whatever happened to its tuners.

Every server of a test carries a marker in its environment, which its children inherit: the process
table is searched by that marker, so a child that left the server's process group is found too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import yaml
from optuna.trial import TrialState

from autotune.loader import load_study
from autotune.record import TrialRecord
from autotune.study import FINISHED, close_study, is_launch, open_study

MARKER_VAR = "AUTOTUNE_TEST_MARKER"

SPACE = {
    "params": {
        "max_num_seqs": {"type": "int", "low": 8, "high": 128, "log": True, "default": 32},
        "max_num_batched_tokens": {"type": "int", "low": 512, "high": 4096, "log": True, "default": 2048},
    },
    "constraints": [{"expr": "max_num_batched_tokens >= max_num_seqs"}],
}


def marked_processes(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``marker`` (servers and every child they made)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARKER_VAR) == marker:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_marked(marker: str) -> None:
    """Kill whatever a failed test left behind."""
    for proc in marked_processes(marker):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def write_spec(
    tmp_path: Path,
    marker: str,
    *,
    launches: int,
    sim_flags: tuple[str, ...] = (),
    stop_timeout: str = "5s",
    start_delay: float = 0.5,
    storage: str | None = None,
    port: int = 0,
    faults: dict[str, Any] | None = None,
    sampler: dict[str, Any] | None = None,
) -> Path:
    """A small study over the simulated server (random sampler, short probes), its servers marked; ``port``
    0 picks a free port per trial, ``faults`` and ``sampler`` replace those sections."""
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    command = [
        sys.executable,
        "-m",
        "autotune.sim",
        "Llama-3.1-8B",
        "--served-model-name",
        "m",
        "--sim-hardware",
        "H100-80GB",
        "--sim-start-delay",
        str(start_delay),
        "--sim-seed",
        "1",
        *sim_flags,
    ]
    spec: dict[str, Any] = {
        "study": {"name": "faults", **({"storage": storage} if storage else {})},
        "server": {
            "command": command,
            "model": "m",
            "args": {"max-model-len": 2048},
            "env": {MARKER_VAR: marker},
            "port": port,
            "start_timeout": "30s",
            "stop_timeout": stop_timeout,
        },
        "search_space": "space.yaml",
        "workload": {
            "dataset": {
                "input_len": {"dist": "uniform", "low": 32, "high": 128},
                "output_len": {"dist": "uniform", "low": 8, "high": 32},
            },
            "seed": 3,
        },
        "slo": {"terms": ["ttft:p95<=2s", "tpot:p95<=200ms"]},
        "measurement": {
            "probe_duration": "1s",
            "min_requests": 20,
            "min_tail_samples": 1,
            "saturation_requests": 20,
            "max_probes": 3,
            "rate_tolerance": 0.3,
            "request_timeout": "20s",
        },
        "budget": {"launches": launches},
        "finalists": {"count": 0},
        "faults": faults or {"retries": 2, "pause": "1s"},
        "sampler": sampler or {"name": "random", "seed": 7},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def autotune(*args: str) -> list[str]:
    """The command line of the ``autotune`` CLI in this interpreter."""
    return [sys.executable, "-c", "from autotune.cli import main; main()", *args]


class Tuner:
    """``autotune tune SPEC`` as a real process in its own session, its output in a file, marked (with
    ``marker``) so that a failed test's cleanup finds the tuner too. With ``split`` its standard error
    goes to a file of its own (:attr:`err_path`), else to ``out`` with its standard output."""

    def __init__(self, spec: Path, out: Path, marker: str | None = None, *, split: bool = False) -> None:
        self.spec = spec
        self.out = out
        self.events_path = load_study(spec).workdir / "events.jsonl"
        self._seen = self._line_count()
        self._file = out.open("a")
        self._err = self.err_path.open("a") if split else None
        self.proc = subprocess.Popen(
            autotune("tune", str(spec)),
            stdout=self._file,
            stderr=self._err if self._err is not None else subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, MARKER_VAR: marker} if marker else None,
        )

    @property
    def err_path(self) -> Path:
        """Where the tuner's standard error goes (its standard output goes to ``out``)."""
        return self.out.with_name(self.out.name + ".err")

    def stderr_lines(self) -> list[str]:
        """The non-empty lines the tuner wrote to standard error."""
        return [line for line in self.err_path.read_text().splitlines() if line.strip()]

    def _line_count(self) -> int:
        try:
            return len(self.events_path.read_text().splitlines())
        except FileNotFoundError:
            return 0

    def events(self) -> list[dict[str, Any]]:
        """The events this tuner wrote (the log is shared by every run of the study)."""
        try:
            lines = self.events_path.read_text().splitlines()[self._seen :]
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 90.0
    ) -> dict[str, Any] | None:
        """The first event of this run that matches, or None when the tuner ended first or time ran out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events():
                if predicate(event):
                    return event
            if self.proc.poll() is not None:
                return None
            time.sleep(0.02)
        return None

    def wait_for_count(self, count: int, timeout: float = 90.0) -> bool:
        """Whether this run wrote ``count`` events while it ran (False: it ended first, or time ran out)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.events()) >= count:
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.02)
        return False

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the tuner process alone (as `kill -SIG PID` does)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 120.0) -> int:
        """Wait for the tuner to exit; its exit status (negative: killed by that signal)."""
        try:
            return self.proc.wait(timeout)
        finally:
            self._file.close()
            if self._err is not None:
                self._err.close()


@contextlib.contextmanager
def marker_cleanup(marker: str) -> Iterator[None]:
    """Never leave a test's processes behind, even when it failed."""
    try:
        yield
    finally:
        kill_marked(marker)


def port_free(port: int) -> bool:
    """Whether a listening socket could bind ``127.0.0.1:port`` now."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def check_study(spec: Path, marker: str, launches: int) -> dict[str, int]:
    """The invariants of a study that ran to its budget through any number of faults: exactly ``launches``
    launched trials, no config launched twice (interrupted trials are FAIL; their retries are the runs), every
    given-up trial retried exactly once (unless discarded, or its config was given up too often: a tuner
    that dies on one config again and again), no process of any trial left, every trial's port free.
    Returns counts for the record."""
    loaded = load_study(spec)
    study = open_study(loaded, create=False, heartbeat=False)
    try:
        trials = study.get_trials(deepcopy=False)
    finally:
        close_study(study)
    launched = [t for t in trials if t.state in FINISHED and is_launch(t)]
    assert len(launched) == launches, [(t.number, t.state.name) for t in trials]
    keys = [json.dumps(dict(TrialRecord.from_trial(t).flags), sort_keys=True) for t in launched]
    twice = {key for key in keys if keys.count(key) > 1}
    assert not twice, "a config was launched twice: " + "; ".join(
        f"trial {t.number} {t.state.name} {t.user_attrs}"
        for t, key in zip(launched, keys, strict=True)
        if key in twice
    )
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    failed = [t for t in trials if t.state == TrialState.FAIL]
    retries = [TrialRecord.from_trial(t).retry_of for t in trials]
    for trial in failed:
        record = TrialRecord.from_trial(trial)
        if record.discarded:
            assert trial.number not in retries
            continue
        assert record.failed_because, trial.number
        expected = 0 if "not retried" in record.failed_because else 1
        assert retries.count(trial.number) == expected, f"trial {trial.number}: {record.failed_because}"
    assert marked_processes(marker) == [], "a process of a trial survived"
    for trial in trials:
        argv = TrialRecord.from_trial(trial).argv
        if "--port" in argv:
            port = int(argv[argv.index("--port") + 1])
            assert port_free(port), f"port {port} of trial {trial.number} is still taken"
    return {"trials": len(trials), "failed": len(failed), "launched": len(launched)}
