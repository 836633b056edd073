"""Launch one server process, wait until it is ready, watch it, and tear it down completely.

The server runs in its own session (so its own process group), writes stdout and stderr to a
per-trial log file, and is stopped by signalling the whole group (SIGTERM, wait, SIGKILL), after
which we verify that no process of the session survives and that the port is free again.
A small JSON pid file next to the log lets a later run find and kill an orphaned server
(:func:`kill_orphans`); a server whose launcher was killed before it wrote that file is found by the
pid file named in its environment (:data:`PID_FILE_VAR`).
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import psutil

from autotune.errors import PortInUseError, ServerError, TeardownError
from autotune.executable import find_executable
from autotune.interrupts import shielded
from autotune.outcome import Cause, Diagnosis, ServerFailedError
from autotune.server.capacity import Capacity, parse_capacity
from autotune.server.classify import classify_runtime_failure, classify_start_failure
from autotune.server.endpoint import Endpoint

POLL_INTERVAL = 0.25
"""Seconds between readiness polls; the process exit is checked in between, so an exit is noticed
within about this long plus one refused connection."""
LOG_TAIL_BYTES = 2 * 1024 * 1024
""":meth:`ServerProcess.log_text` reads at most this many bytes from the end of the log."""
PID_SUFFIX = ".pid"
#: Every server is launched with this environment variable set to the absolute path of its pid file: a
#: launcher killed (SIGKILL, which nothing holds) between the launch and writing the file leaves a server
#: no file names, and :func:`kill_orphans` finds it, and the children that inherit it, by this.
PID_FILE_VAR = "AUTOTUNE_SERVER_PID_FILE"
_EXIT_CHECK = 0.05
_PORT_WAIT = 5.0


@dataclass(frozen=True)
class ReadyInfo:
    """What we learnt when the server became ready."""

    seconds: float
    """Seconds from launch to ready (``/health`` 200 and the model listed)."""
    capacity: Capacity | None
    """The capacity line(s) parsed from the log, if logged."""
    version: str | None
    """``/version`` of the server, if it answers."""
    pid: int
    """Process id of the server (its process group and session id too)."""


@dataclass(frozen=True)
class _PidRecord:
    pid: int
    pgid: int
    sid: int
    create_time: float
    host: str


def _client_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _port_is_free(host: str, port: int) -> bool:
    """True when a listening socket could bind ``host:port`` (SO_REUSEADDR, as uvicorn binds)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServerError(f"cannot resolve server host {host!r}: {exc}") from exc
    family, socktype, proto, _, address = infos[0]
    with socket.socket(family, socktype, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            return False
    return True


def _listener_pids(port: int) -> set[int] | None:
    """Pids listening on ``port``, or None when psutil may not tell (no permission)."""
    try:
        connections = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, PermissionError):
        return None
    return {
        conn.pid
        for conn in connections
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid
    }


def _describe_holder(port: int) -> str:
    pids = _listener_pids(port)
    if not pids:
        return "a process psutil cannot identify"
    names = []
    for pid in sorted(pids):
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())[:120]
        except psutil.Error:
            cmd = "?"
        names.append(f"pid {pid} ({cmd})")
    return ", ".join(names)


def _resolve_executable(name: str, path_env: str | None) -> str:
    found = find_executable(name, path_env)
    if found is None:
        raise ServerError(
            f"server command {name!r} not found next to {sys.executable} or on PATH: install it or give "
            "its full path"
        )
    return found


def _session_members(sid: int, pgid: int, not_before: float = 0.0) -> list[psutil.Process]:
    """Live (non-zombie) processes in session ``sid`` or process group ``pgid``."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) != sid and os.getpgid(proc.pid) != pgid:
                continue
            if proc.status() == psutil.STATUS_ZOMBIE or proc.create_time() < not_before:
                continue
        except (OSError, psutil.Error):
            continue
        members.append(proc)
    return members


def refused_diagnosis(words: str) -> Diagnosis:
    """A server that refused the tuner's API key: its start failed, with the server's words."""
    return Diagnosis(
        Cause.START_FAILED,
        f"the server refused the API key ({words}): check server.api_key_env and workload.headers",
        (words,),
    )


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _kill_session(sid: int, pgid: int, grace: float, not_before: float = 0.0) -> list[psutil.Process]:
    """SIGTERM the group, wait ``grace`` s, SIGKILL the group and the session; return survivors."""
    if sid == os.getsid(0):
        raise ServerError(f"refusing to kill session {sid}: it is our own")
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _session_members(sid, pgid, not_before):
        time.sleep(0.05)
    survivors = _session_members(sid, pgid, not_before)
    if survivors:
        _signal_group(pgid, signal.SIGKILL)
        for proc in survivors:  # members that moved to another group of the session
            with contextlib.suppress(psutil.Error):
                proc.kill()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and survivors:
            time.sleep(0.05)
            survivors = _session_members(sid, pgid, not_before)
    return survivors


def _read_pid_file(path: Path) -> _PidRecord | None:
    try:
        data = json.loads(path.read_text())
        return _PidRecord(
            int(data["pid"]),
            int(data["pgid"]),
            int(data["sid"]),
            float(data["create_time"]),
            str(data.get("host", socket.gethostname())),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def kill_orphans(directory: Path, *, grace: float = 5.0) -> list[int]:
    """Kill servers left behind by an earlier run, found through ``*.pid`` files under ``directory``.

    A pid file counts only when it was written on this host and its process still exists with the
    recorded create time (so a reused pid is never killed); when the leader is gone but processes
    of its session survive (created after it), those are killed. Returns the process-group ids that
    were signalled; removes pid files that are handled or stale. Raises :class:`TeardownError` when
    something survives SIGKILL. Servers that no pid file names but whose environment names one under
    ``directory`` (:data:`PID_FILE_VAR`: the launcher died before writing it) are killed the same way.
    Call it only on directories of trials that no live run owns.
    """
    with shielded():
        return _kill_orphans(directory, grace)


def _kill_orphans(directory: Path, grace: float) -> list[int]:
    killed: list[int] = []
    for pid_file in sorted(directory.rglob(f"*{PID_SUFFIX}")):
        record = _read_pid_file(pid_file)
        if record is None or record.host != socket.gethostname():
            continue  # unreadable, or a server of another machine sharing the directory
        try:
            leader = psutil.Process(record.pid)
            reused = abs(leader.create_time() - record.create_time) > 0.01
            members = [] if reused else [leader]
            # Reused: Linux never reuses a pid still in use as a group or session id, so
            # nothing of our session can be left.
        except psutil.NoSuchProcess:
            # Leader gone (reaped by init); children of its session may survive (vLLM issue 55510).
            members = _session_members(record.sid, record.pgid, not_before=record.create_time)
        except psutil.Error:
            members = []
        if members:
            survivors = _kill_session(record.sid, record.pgid, grace, record.create_time)
            killed.append(record.pgid)
            if survivors:
                raise TeardownError(
                    f"orphaned server group {record.pgid} from {pid_file} survived SIGKILL: "
                    f"pids {[p.pid for p in survivors]}"
                )
        pid_file.unlink(missing_ok=True)
    for sid, pgid in _unrecorded_sessions(directory):
        survivors = _kill_session(sid, pgid, grace)
        killed.append(pgid)
        if survivors:
            raise TeardownError(
                f"orphaned server group {pgid} (launched for {directory}, no pid file) survived SIGKILL: "
                f"pids {[p.pid for p in survivors]}"
            )
    return killed


def _unrecorded_sessions(directory: Path) -> list[tuple[int, int]]:
    """(session, group) of live processes whose :data:`PID_FILE_VAR` names a pid file under
    ``directory``: servers (and their children) whose launcher died before it could record them."""
    root = directory.resolve()
    found: list[tuple[int, int]] = []
    for proc in psutil.process_iter():
        try:
            named = proc.environ().get(PID_FILE_VAR)
            if named is None or not Path(named).is_relative_to(root) or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            key = (os.getsid(proc.pid), os.getpgid(proc.pid))
        except (OSError, psutil.Error):
            continue  # gone, or another user's: not a server of ours
        if key not in found:
            found.append(key)
    return found


class ServerProcess:
    """One server process in its own session, as a context manager.

    ``with ServerProcess(argv, env=..., log_path=..., host=..., port=..., model=...) as server:``
    launches it (after checking the port is free); :meth:`wait_ready` waits for ``/health`` and
    ``/v1/models``; :meth:`check_alive` reports a crash during measurement; leaving the block stops
    the whole process group and verifies that nothing survives and the port is free.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str | None],
        log_path: Path,
        host: str,
        port: int,
        model: str,
        clock: Callable[[], float] = time.monotonic,
        stop_timeout: float = 10.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if not argv:
            raise ServerError("server command line is empty")
        self.argv: tuple[str, ...] = tuple(argv)
        self.env = dict(env)
        self.log_path = log_path
        self.pid_path = log_path.with_name(log_path.name + PID_SUFFIX)
        self.host = host
        self.port = port
        self.model = model
        self.stop_timeout = stop_timeout
        self.headers = dict(headers or {})
        """Headers of the readiness and liveness checks (the API key)."""
        self._clock = clock
        self._base_url = f"http://{_url_host(_client_host(host))}:{port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_start = 0
        self._started_at = 0.0
        self._create_time = 0.0
        self._stopping = False
        self._stopped = False

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Check the port is free, then launch the server in a new session with output to the log."""
        if self._proc is not None:
            raise ServerError(f"server on port {self.port} was already started")
        if not _port_is_free(self.host, self.port):
            raise PortInUseError(
                f"port {self.port} on {self.host or '*'} is already in use by "
                f"{_describe_holder(self.port)}: stop it or choose another port"
            )
        env = {k: v for k, v in {**os.environ, **self.env}.items() if v is not None}
        env[PID_FILE_VAR] = str(self.pid_path.resolve())
        argv = [_resolve_executable(self.argv[0], env.get("PATH")), *self.argv[1:]]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")  # keep an earlier launch's output, read only ours
        self._log_start = self._log.seek(0, os.SEEK_END)
        self._started_at = self._clock()
        try:
            with shielded():  # a signal must not fall between the launch and the pid file
                self._launch(argv, env)
        except BaseException:  # a signal held during the launch is raised here: stop what started
            with contextlib.suppress(Exception):
                self.stop(check_port=False)
            raise

    def _launch(self, argv: list[str], env: dict[str, str]) -> None:
        assert self._log is not None
        try:
            self._proc = subprocess.Popen(  # argv list, never a shell
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                close_fds=True,
            )
        except OSError as exc:
            self._log.close()
            raise ServerError(f"could not launch {argv[0]!r}: {exc}") from exc
        try:
            self._after_launch(argv)
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop(check_port=False)
            raise

    def _after_launch(self, argv: list[str]) -> None:
        proc = self._require_proc()
        try:
            self._create_time = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            self._create_time = 0.0  # unknown: do not filter session members by age
        record = {
            "pid": proc.pid,
            "pgid": proc.pid,
            "sid": proc.pid,
            "create_time": self._create_time,
            "host": socket.gethostname(),
            "port": self.port,
            "argv": argv,
        }
        self.pid_path.write_text(json.dumps(record))

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A port another process took is already reported; do not wait on it again.
        self.stop(check_port=not isinstance(exc, PortInUseError))

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the server as a client on this machine reaches it."""
        return self._base_url

    @property
    def pid(self) -> int | None:
        """The server's pid (also its process group and session id), or None before start."""
        return None if self._proc is None else self._proc.pid

    def _require_proc(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise ServerError("server not started: use it as a context manager or call start()")
        return self._proc

    # -- readiness -----------------------------------------------------------------------------

    def _owns_port(self) -> bool:
        """False only when psutil can tell that the listener on our port is not in our session."""
        proc = self._require_proc()
        pids = _listener_pids(self.port)
        if not pids:
            return True
        for pid in pids:
            try:
                if os.getsid(pid) == proc.pid:
                    return True
            except OSError:
                continue
        return False

    def _exit_code(self) -> int | None:
        """The leader's exit code (negative: killed by that signal), or None while it runs.

        Uses ``waitid(WNOWAIT)``: the exited leader stays a zombie, so its pid (our process group and
        session id) cannot be reused by another process before :meth:`stop` has verified the group is
        gone and reaps it. Signalling the group is therefore always safe until then.
        """
        proc = self._require_proc()
        if proc.returncode is not None:
            return proc.returncode
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere
            return proc.poll()
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def _wait_exit(self, seconds: float) -> int | None:
        deadline = time.monotonic() + seconds
        while True:
            code = self._exit_code()
            if code is not None:
                return code
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(_EXIT_CHECK, remaining))

    def _fail_start(self, exit_code: int | None, timed_out: bool) -> ServerFailedError:
        self._kill()
        return ServerFailedError(classify_start_failure(self.log_text(), exit_code, timed_out))

    def wait_ready(self, timeout: float, on_tick: Callable[[float], None] | None = None) -> ReadyInfo:
        """Poll ``/health`` then ``/v1/models`` until the model is listed and our process is alive.

        Raises :class:`~autotune.outcome.ServerFailedError` with the log's diagnosis as soon as the process
        exits (within about :data:`POLL_INTERVAL`), or with ``start_timeout`` after ``timeout`` seconds
        (the process group is killed in both cases); :class:`PortInUseError` when the log says the
        port was taken. ``on_tick`` gets the seconds elapsed since launch, once per poll.
        """
        proc = self._require_proc()
        deadline = self._clock() + timeout
        with Endpoint(self._base_url, timeout=min(1.0, max(timeout, 0.1)), headers=self.headers) as endpoint:
            while True:
                if on_tick is not None:
                    on_tick(self._clock() - self._started_at)
                code = self._exit_code()
                if code is not None:
                    raise self._fail_start(code, timed_out=False)
                serves = endpoint.serves(self.model)
                if endpoint.refused is not None and self._exit_code() is None and self._owns_port():
                    self._kill()
                    raise ServerFailedError(refused_diagnosis(endpoint.refused))
                if serves and self._exit_code() is None and self._owns_port():
                    seconds = self._clock() - self._started_at
                    version = endpoint.version()
                    return ReadyInfo(seconds, parse_capacity(self.log_text()), version, proc.pid)
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise self._fail_start(self._exit_code(), timed_out=True)
                code = self._wait_exit(min(POLL_INTERVAL, remaining))
                if code is not None:
                    raise self._fail_start(code, timed_out=False)

    # -- during measurement --------------------------------------------------------------------

    def check_alive(self, health_timeout: float = 5.0) -> Diagnosis | None:
        """None while the server runs and ``/health`` answers 200; else a ``crashed_under_load`` diagnosis.

        Any exit counts, exit code 0 included (vLLM exits 0 after an engine death). A stop we asked
        for never counts as a crash. ``/health`` not answering within ``health_timeout`` counts.
        """
        self._require_proc()
        if self._stopping:
            return None
        code = self._exit_code()
        if code is not None:
            return classify_runtime_failure(self.log_text(), code, None)
        with Endpoint(self._base_url, timeout=health_timeout, headers=self.headers) as endpoint:
            status = endpoint.health()
        if status == 200:
            return None
        code = self._exit_code()
        if self._stopping:
            return None
        return classify_runtime_failure(self.log_text(), code, status)

    # -- teardown ------------------------------------------------------------------------------

    def _kill(self) -> list[psutil.Process]:
        """Stop the whole session (the leader is not reaped); return what survived SIGKILL."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return []  # reaped: the group id may belong to someone else now
        self._stopping = True
        return _kill_session(proc.pid, proc.pid, self.stop_timeout, self._create_time)

    def stop(self, timeout: float | None = None, *, check_port: bool = True) -> None:
        """Stop the server: SIGTERM its group, wait ``timeout`` s, SIGKILL, verify nothing survives.

        Idempotent. Raises :class:`TeardownError` when a process of the session survives SIGKILL or
        (with ``check_port``) the port is still busy a few seconds later.
        """
        if self._stopped:
            return
        self._stopped = True
        if timeout is not None:
            self.stop_timeout = timeout
        with shielded():  # a signal now would leave the server running: hold it until the group is gone
            self._stop(check_port)

    def _stop(self, check_port: bool) -> None:
        try:
            survivors = self._kill()
        finally:
            if self._log is not None:
                self._log.close()
        if self._proc is None:
            return
        if survivors:
            raise TeardownError(
                f"server on port {self.port} (process group {self._proc.pid}) survived SIGKILL: "
                f"pids {[p.pid for p in survivors]}; kill them by hand before the next trial"
            )
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5.0)  # reap the leader now that its group is gone
        if check_port:
            _wait_port_free(self.host, self.port)
        self.pid_path.unlink(missing_ok=True)

    # -- log -----------------------------------------------------------------------------------

    def log_text(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        """This launch's log output so far: its last ``max_bytes`` bytes, starting at a whole line.

        Output of earlier launches that appended to the same file is left out.
        """
        return _tail(self.log_path, self._log_start, max_bytes)


def _wait_port_free(host: str, port: int) -> None:
    """Wait until ``port`` is free after a server stopped; :class:`TeardownError` naming its holder after
    :data:`_PORT_WAIT` seconds."""
    deadline = time.monotonic() + _PORT_WAIT
    while not _port_is_free(host, port):
        if time.monotonic() > deadline:
            raise TeardownError(
                f"port {port} is still in use after the server stopped, by {_describe_holder(port)}"
            )
        time.sleep(0.05)


def _tail(path: Path, since: int, max_bytes: int) -> str:
    """The last ``max_bytes`` bytes of ``path`` written from offset ``since`` on, starting at a whole line
    ("" when the file is gone)."""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            start = max(since, size - max_bytes)
            fh.seek(start)
            data = fh.read()
    except FileNotFoundError:
        return ""
    if start > since:  # cut into the middle of a line: drop that partial line
        data = data[data.find(b"\n") + 1 :]
    return data.decode("utf-8", errors="replace")
