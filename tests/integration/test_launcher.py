"""ServerProcess against tiny fake servers: real subprocesses, real HTTP, real signals."""

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

import psutil
import pytest

from autotune.errors import PortInUseError
from autotune.outcome import Cause, ServerFailedError
from autotune.server import ServerProcess, kill_orphans
from autotune.server.launcher import PID_FILE_VAR

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

FAKES = Path(__file__).with_name("fakes")
FAKE = str(FAKES / "fake_server.py")
OOM_TEXT = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 79.19 GiB of which 1.06 GiB is free."
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


MakeServer = Callable[..., ServerProcess]


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[MakeServer]:
    """Build ServerProcess objects for the fake server; every one is stopped (group killed) at the end."""
    made: list[ServerProcess] = []

    def make(
        *fake_args: str, port: int | None = None, argv0: str | None = None, path: str | None = None
    ) -> ServerProcess:
        port = _free_port() if port is None else port
        env = {"PYTHONUNBUFFERED": "1"} if path is None else {"PYTHONUNBUFFERED": "1", "PATH": path}
        server = ServerProcess(
            [argv0 or sys.executable, FAKE, "--port", str(port), *fake_args],
            env=env,
            log_path=tmp_path / f"server-{len(made)}.log",
            host="127.0.0.1",
            port=port,
            model="fake-model",
            stop_timeout=2.0,
        )
        made.append(server)
        return server

    yield make
    for server in made:
        if server.pid is not None:
            _kill_group(server.pid)
        with contextlib.suppress(Exception):
            server.stop()


@pytest.fixture
def popen(tmp_path: Path) -> Iterator[Callable[[list[str]], subprocess.Popen[bytes]]]:
    """Start helper processes in their own session; their groups are SIGKILLed at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str]) -> subprocess.Popen[bytes]:
        log = (tmp_path / f"helper-{len(procs)}.log").open("wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        _kill_group(proc.pid)
        proc.wait(timeout=5)


def test_ready_reports_time_capacity_and_version(make_server: MakeServer) -> None:
    """Ready once /health is 200 and the model is listed; capacity and version are read."""
    ticks: list[float] = []
    with make_server("--delay", "0.3") as server:
        info = server.wait_ready(timeout=10, on_tick=ticks.append)
        assert info.pid == server.pid
        assert info.seconds >= 0.3  # never faster than the fake's start delay
        assert info.version == "0.0.0-fake"
        assert info.capacity is not None
        assert info.capacity.kv_tokens == 1_196_643
        assert info.capacity.max_concurrency == pytest.approx(146.07)
        assert ticks
        assert server.check_alive() is None
        pid_record = json.loads(server.pid_path.read_text())
        assert pid_record["pid"] == pid_record["pgid"] == server.pid
    assert _gone(info.pid)
    assert not server.pid_path.exists()


def test_exit_with_oom_text_is_noticed_quickly(make_server: MakeServer) -> None:
    """A CUDA OOM text and exit 1 is diagnosed `oom` when the process exits, not at the timeout (a start
    timeout far beyond the test's own: how soon is a benchmark's question)."""
    server = make_server("--mode", "exit", "--delay", "0.3", "--text", OOM_TEXT)
    with server, pytest.raises(ServerFailedError) as caught:
        server.wait_ready(timeout=600)  # noticed at the exit: a wait for the timeout fails at 30 s
    diagnosis = caught.value.diagnosis
    assert diagnosis.cause is Cause.OOM
    assert diagnosis.extras["tried_to_allocate_gib"] == pytest.approx(2.0)
    assert diagnosis.extras["exit_code"] == 1


def test_hang_times_out_and_group_is_gone(make_server: MakeServer) -> None:
    """A server that never answers is stopped at the timeout: cause `start_timeout`, no process left."""
    server = make_server("--mode", "hang")
    with server:
        start = time.monotonic()
        with pytest.raises(ServerFailedError) as caught:
            server.wait_ready(timeout=1.0)
        assert time.monotonic() - start >= 1.0  # not before the timeout (a hang fails at the test's own)
        assert caught.value.diagnosis.cause is Cause.START_TIMEOUT
        assert server.pid is not None
        assert _gone(server.pid)


def test_exit_zero_after_start_is_a_crash(make_server: MakeServer) -> None:
    """A server that dies after being ready and exits 0 (as vLLM does) is reported crashed_under_load."""
    with make_server("--mode", "die", "--die-after", "0.3") as server:
        server.wait_ready(timeout=10)
        assert server.pid is not None
        psutil.Process(server.pid).wait(timeout=10)
        diagnosis = server.check_alive()
        assert diagnosis is not None
        assert diagnosis.cause is Cause.CRASHED_UNDER_LOAD
        assert diagnosis.extras["exit_code"] == 0
        assert any("EngineDeadError" in line for line in diagnosis.lines)


def test_health_503_is_a_crash(make_server: MakeServer) -> None:
    """A live server whose /health turns 503 is reported crashed_under_load with the status."""
    with make_server("--mode", "unhealthy", "--die-after", "0.2") as server:
        server.wait_ready(timeout=10)
        deadline = time.monotonic() + 10
        diagnosis = server.check_alive()
        while diagnosis is None and time.monotonic() < deadline:
            time.sleep(0.1)
            diagnosis = server.check_alive()
        assert diagnosis is not None
        assert diagnosis.cause is Cause.CRASHED_UNDER_LOAD
        assert diagnosis.extras["health_status"] == 503
        server.stop()
        assert server.check_alive() is None  # a stop we asked for is not a crash


def test_stop_kills_a_group_that_ignores_sigterm(make_server: MakeServer, tmp_path: Path) -> None:
    """A server ignoring SIGTERM, with a child in its group, is SIGKILLed and nothing of it survives."""
    child_file = tmp_path / "child.pid"
    server = make_server("--mode", "ignore-term", "--child-pid-out", str(child_file))
    with server:
        server.wait_ready(timeout=10)
        child = int(child_file.read_text())
        assert os.getpgid(child) == server.pid
        server.stop(timeout=0.5)  # a stop that waited on SIGTERM would hang until the test's timeout
    assert server.pid is not None
    assert _gone(server.pid)
    assert _gone(child)
    with socket.socket() as sock:  # the port is free again (for a server, which sets SO_REUSEADDR)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", server.port))


def test_port_in_use_raises_and_launches_nothing(make_server: MakeServer) -> None:
    """A port already bound by another process raises PortInUseError naming the port; nothing starts."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = make_server(port=port)
        with pytest.raises(PortInUseError, match=rf"port {port}.*pid {os.getpid()}"):
            server.start()
        assert server.pid is None
        assert not server.log_path.exists()
        assert not server.pid_path.exists()


def test_port_taken_after_launch_is_port_in_use(make_server: MakeServer) -> None:
    """A server that logs `Address already in use` and exits raises PortInUseError, not a config cause."""
    server = make_server(
        "--mode", "exit", "--text", "OSError: [Errno 98] Address already in use", "--delay", "0.1"
    )
    with server, pytest.raises(PortInUseError):
        server.wait_ready(timeout=10)


def test_other_server_on_port_is_not_ready(
    make_server: MakeServer, popen: Callable[[list[str]], subprocess.Popen[bytes]]
) -> None:
    """While our process has not bound the port, a different server answering there is never 'ready'."""
    server = make_server("--mode", "hang")
    with server:
        other = popen([sys.executable, FAKE, "--port", str(server.port)])
        with pytest.raises(ServerFailedError) as caught:
            server.wait_ready(timeout=2.0)
        assert caught.value.diagnosis.cause is Cause.START_TIMEOUT
        assert other.poll() is None
        other.kill()  # else stop() rightly reports the port still busy
        other.wait(timeout=5)


def test_argv_value_with_spaces_stays_one_argument(make_server: MakeServer, tmp_path: Path) -> None:
    """Argv items go to the process as-is (no shell); argv[0] `python` is found next to the interpreter."""
    argv_out = tmp_path / "argv.json"
    server = make_server(
        "--argv-out",
        str(argv_out),
        "--max-num-seqs",
        "16 --trust-remote-code",
        argv0="python",
        path="/nonexistent",
    )
    with server:
        server.wait_ready(timeout=10)
    argv = json.loads(argv_out.read_text())
    assert argv[-2:] == ["--max-num-seqs", "16 --trust-remote-code"]
    assert "--trust-remote-code" not in argv


def test_kill_orphans_removes_server_of_killed_launcher(
    tmp_path: Path, popen: Callable[[list[str]], subprocess.Popen[bytes]]
) -> None:
    """A server left behind by a SIGKILLed launcher is found through its pid file and killed."""
    port = _free_port()
    report = tmp_path / "report"
    orphans = tmp_path / "trials"
    launcher = popen(
        [
            sys.executable,
            str(FAKES / "orphan_launcher.py"),
            str(orphans / "trial-0.log"),
            str(port),
            str(report),
        ]
    )
    deadline = time.monotonic() + 20
    while not report.exists():
        assert time.monotonic() < deadline, "launcher did not report"
        assert launcher.poll() is None, "launcher exited"
        time.sleep(0.05)
    server_pid = int(report.read_text())
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=5)
        assert not _gone(server_pid)  # orphaned, still running
        assert kill_orphans(orphans, grace=1.0) == [server_pid]
        assert _gone(server_pid)
        assert list(orphans.glob("*.pid")) == []
        assert kill_orphans(orphans) == []
    finally:
        _kill_group(server_pid)


def test_kill_orphans_finds_a_server_launched_but_never_recorded(
    tmp_path: Path, popen: Callable[[list[str]], subprocess.Popen[bytes]]
) -> None:
    """A launcher SIGKILLed between the launch and the pid file leaves a server no file names: it is
    found by the pid file its environment names (under the trial's folder) and killed with its session;
    a process naming another folder's pid file is left alone."""
    trials = tmp_path / "trials"
    trials.mkdir()
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    lost = popen(["env", f"{PID_FILE_VAR}={trials / 'trial-0.log.pid'}", *sleeper])
    other = popen(["env", f"{PID_FILE_VAR}={tmp_path / 'elsewhere' / 'trial-0.log.pid'}", *sleeper])
    deadline = time.monotonic() + 10
    while PID_FILE_VAR not in psutil.Process(lost.pid).environ():  # until env has exec'd the sleeper
        assert time.monotonic() < deadline, "the sleeper never started"
        time.sleep(0.02)
    assert kill_orphans(trials, grace=1.0) == [lost.pid]
    assert _gone(lost.pid)
    assert not _gone(other.pid)


def test_a_launched_server_names_its_pid_file_in_its_environment(make_server: MakeServer) -> None:
    """What the recovery above reads: every server is launched with its pid file's absolute path."""
    with make_server() as server:
        server.wait_ready(timeout=10)
        assert server.pid is not None
        named = psutil.Process(server.pid).environ()[PID_FILE_VAR]
        assert named == str(server.pid_path.resolve())


def _write_pid_file(path: Path, pid: int, create_time: float) -> None:
    record = {"pid": pid, "pgid": pid, "sid": pid, "create_time": create_time}
    path.write_text(json.dumps({**record, "host": socket.gethostname()}))


def test_kill_orphans_kills_children_that_outlive_their_leader(
    tmp_path: Path, popen: Callable[[list[str]], subprocess.Popen[bytes]]
) -> None:
    """When only the leader died (vLLM issue 55510), the children left in its session are killed."""
    child_file = tmp_path / "child.pid"
    port = _free_port()
    argv = [sys.executable, FAKE, "--port", str(port), "--mode", "ignore-term"]
    leader = popen([*argv, "--child-pid-out", str(child_file)])
    deadline = time.monotonic() + 20
    while not child_file.exists() or not child_file.read_text():
        assert time.monotonic() < deadline, "fake server did not start its child"
        time.sleep(0.05)
    child = int(child_file.read_text())
    _write_pid_file(tmp_path / "server.log.pid", leader.pid, psutil.Process(leader.pid).create_time())
    leader.kill()
    leader.wait(timeout=5)
    assert not _gone(child)
    assert kill_orphans(tmp_path, grace=0.5) == [leader.pid]
    assert _gone(child)


def test_kill_orphans_ignores_a_reused_pid(
    tmp_path: Path, popen: Callable[[list[str]], subprocess.Popen[bytes]]
) -> None:
    """A pid file whose pid now belongs to another process (other create time) kills nothing."""
    bystander = popen([sys.executable, "-c", "import time; time.sleep(60)"])
    created = psutil.Process(bystander.pid).create_time()
    _write_pid_file(tmp_path / "old.log.pid", bystander.pid, created - 100.0)
    assert kill_orphans(tmp_path) == []
    assert bystander.poll() is None
    assert not (tmp_path / "old.log.pid").exists()


def test_relaunch_on_same_log_classifies_only_its_own_output(make_server: MakeServer) -> None:
    """A second launch appending to the same log file is diagnosed from its own output only."""
    first = make_server("--mode", "exit", "--text", OOM_TEXT)
    with first, pytest.raises(ServerFailedError) as caught:
        first.wait_ready(timeout=10)
    assert caught.value.diagnosis.cause is Cause.OOM
    second = ServerProcess(
        [sys.executable, FAKE, "--port", str(first.port), "--mode", "exit", "--text", "hello"],
        env={},
        log_path=first.log_path,
        host="127.0.0.1",
        port=first.port,
        model="fake-model",
    )
    with second, pytest.raises(ServerFailedError) as caught:
        second.wait_ready(timeout=10)
    assert caught.value.diagnosis.cause is Cause.START_FAILED
    assert "CUDA out of memory" in first.log_path.read_text()
    assert "CUDA out of memory" not in second.log_text()
