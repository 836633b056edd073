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
from typing import Any, ClassVar

import psutil
import yaml
from optuna.trial import TrialState

from autotune.inputs.loader import load_study
from autotune.store.record import TrialRecord
from autotune.study.loop import close_study, open_study
from autotune.study.standing import FINISHED, is_launch

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


#: Seconds a killed process may take to be gone.
GONE_TIMEOUT_S = 10.0


def kill_marked(marker: str) -> None:
    """Kill whatever a failed test left behind, and wait (bounded) until it is gone."""
    procs = marked_processes(marker)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _, alive = psutil.wait_procs(procs, timeout=GONE_TIMEOUT_S)
    alive = [p for p in alive if _running(p)]
    assert not alive, f"processes marked {marker} survived SIGKILL for {GONE_TIMEOUT_S:g} s: {alive}"


def _described(proc: psutil.Process) -> str:
    """A process for a failure message: pid, parent, group, session, age, command line."""
    try:
        with proc.oneshot():
            age = time.time() - proc.create_time()
            where = f"ppid {proc.ppid()} pgid {os.getpgid(proc.pid)} sid {os.getsid(proc.pid)}"
            return f"pid {proc.pid} ({where}, {age:.0f} s old): {' '.join(proc.cmdline())}"
    except (psutil.Error, OSError):
        return f"pid {proc.pid} (gone)"


def _running(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs (a zombie waiting for its parent to reap it does not)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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


def whole_lines(path: Path) -> list[str]:
    """The complete lines of a log a running tuner appends to (none while it is missing): a line being
    written at this moment may be read half written (a read is not atomic with a concurrent append), so
    the text after the last newline waits for the next read."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return text[: text.rfind("\n") + 1].splitlines()


class Tuner:
    """``autotune tune SPEC`` as a real process in its own session, its output in a file, marked (with
    ``marker``) so that a failed test's cleanup finds the tuner too. With ``split`` its standard error
    goes to a file of its own (:attr:`err_path`), else to ``out`` with its standard output.

    Every wait is bounded: one that runs out of time fails the test with what the tuner printed, and
    :meth:`wait` kills a tuner that did not exit (its whole session)."""

    POLL_S = 0.02
    """How often the event log is read while waiting for an event."""

    _live: ClassVar[list[Tuner]] = []
    """Every tuner not yet waited for: :func:`marker_cleanup` reaps those of its marker when a test failed
    before it waited (else the unreaped process and its open files surface as warnings in a later test)."""

    def __init__(self, spec: Path, out: Path, marker: str | None = None, *, split: bool = False) -> None:
        self.spec = spec
        self.out = out
        self.marker = marker
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
        Tuner._live.append(self)

    @property
    def err_path(self) -> Path:
        """Where the tuner's standard error goes (its standard output goes to ``out``)."""
        return self.out.with_name(self.out.name + ".err")

    def stderr_lines(self) -> list[str]:
        """The non-empty lines the tuner wrote to standard error (with ``split``)."""
        return [line for line in self.err_path.read_text().splitlines() if line.strip()]

    def output(self) -> str:
        """What the tuner printed so far: standard output, then (with ``split``) standard error."""
        text = self.out.read_text()
        if self._err is not None:
            text += "\n--- stderr ---\n" + self.err_path.read_text()
        return text

    def _line_count(self) -> int:
        return len(whole_lines(self.events_path))

    def events(self) -> list[dict[str, Any]]:
        """The events this tuner wrote (the log is shared by every run of the study)."""
        return [json.loads(line) for line in whole_lines(self.events_path)[self._seen :] if line.strip()]

    def _waited(self, what: str, timeout: float) -> str:
        """The failure message of a wait for ``what`` that ran out of time."""
        kinds = [e["kind"] for e in self.events()]
        return (
            f"the tuner (pid {self.proc.pid}) wrote no {what} within {timeout:g} s and is still running; "
            f"its events: {kinds}; its output:\n{self.output()}"
        )

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 90.0
    ) -> dict[str, Any] | None:
        """The first event of this run that matches, or None when the tuner ended first; fails the test
        when time runs out first."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events():
                if predicate(event):
                    return event
            if self.proc.poll() is not None:
                return None
            assert time.monotonic() < deadline, self._waited("matching event", timeout)
            time.sleep(self.POLL_S)

    def wait_for_count(self, count: int, timeout: float = 90.0) -> bool:
        """Whether this run wrote ``count`` events while it ran (False: it ended first); fails the test
        when time runs out first."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self.events()) >= count:
                return True
            if self.proc.poll() is not None:
                return False
            assert time.monotonic() < deadline, self._waited(f"event number {count}", timeout)
            time.sleep(self.POLL_S)

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the tuner process alone (as `kill -SIG PID` does)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 120.0) -> int:
        """Wait for the tuner to exit; its exit status (negative: killed by that signal). A tuner still
        running after ``timeout`` is killed (its session) and the test fails, with its output."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(GONE_TIMEOUT_S)
            raise AssertionError(
                f"the tuner (pid {self.proc.pid}) did not exit within {timeout:g} s (killed); its output:\n"
                + self.output()
            ) from None
        finally:
            self._close()

    def _close(self) -> None:
        self._file.close()
        if self._err is not None:
            self._err.close()
        with contextlib.suppress(ValueError):
            Tuner._live.remove(self)

    @classmethod
    def reap(cls, marker: str) -> None:
        """Kill (its session), wait for and close every tuner of ``marker`` not yet waited for."""
        for tuner in [t for t in cls._live if t.marker == marker]:
            if tuner.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(tuner.proc.pid, signal.SIGKILL)
                tuner.proc.wait(GONE_TIMEOUT_S)
            tuner._close()


@contextlib.contextmanager
def marker_cleanup(marker: str) -> Iterator[None]:
    """Never leave a test's processes behind, even when it failed."""
    try:
        yield
    finally:
        try:
            Tuner.reap(marker)
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
    survivors = marked_processes(marker)
    assert survivors == [], "a process of a trial survived: " + "; ".join(map(_described, survivors))
    for trial in trials:
        argv = TrialRecord.from_trial(trial).argv
        if "--port" in argv:
            port = int(argv[argv.index("--port") + 1])
            assert port_free(port), f"port {port} of trial {trial.number} is still taken"
    return {"trials": len(trials), "failed": len(failed), "launched": len(launched)}
