"""A private PostgreSQL server for tests: Debian's binaries on a temporary data folder and a free port.

The server listens on 127.0.0.1 only, with its unix socket in the temporary folder; it needs no system
PostgreSQL service. initdb refuses to run as root, so as root the binaries run as the ``postgres`` user
that Debian's package creates (``runuser -u postgres --``), and the folder is owned by that user.
Clients connect over TCP with a password (scram-sha-256); the unix socket trusts its users.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = "PostgreSQL binaries not found: apt-get install -y postgresql"
SUPERUSER = "autotune"
START_TIMEOUT_S = 60


class PostgresUnavailableError(Exception):
    """The binaries (or, as root, the ``postgres`` user) are missing: tests that need them skip."""


@dataclass(frozen=True)
class PostgresServer:
    """A running private server: where it listens and how to reach it."""

    bin_dir: Path
    socket_dir: Path
    port: int
    password: str
    run_as: tuple[str, ...]
    """The command prefix that runs a binary as the data folder's owner (empty when not root)."""

    def url(self, database: str) -> str:
        """A plain ``postgresql://`` URL (password included) for ``database`` on this server."""
        return f"postgresql://{SUPERUSER}:{self.password}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create the empty database ``name`` and return its URL."""
        where = ["-h", str(self.socket_dir), "-p", str(self.port), "-U", SUPERUSER]
        subprocess.run(
            [*self.run_as, str(self.bin_dir / "createdb"), *where, name],
            check=True,
            capture_output=True,
            timeout=30,
        )
        return self.url(name)


def find_bin_dir() -> Path:
    """The newest Debian PostgreSQL ``bin`` folder, else the one of ``initdb`` on PATH."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).resolve().parent
    raise PostgresUnavailableError(INSTALL_HINT)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _owner() -> tuple[tuple[str, ...], int | None, int | None]:
    """The command prefix, uid and gid to run the server as (root hands it to ``postgres``)."""
    if os.geteuid() != 0:
        return (), None, None
    try:
        user = pwd.getpwnam("postgres")
    except KeyError as exc:
        raise PostgresUnavailableError("running as root and no 'postgres' user: " + INSTALL_HINT) from exc
    runuser = shutil.which("runuser")
    if runuser is None:
        raise PostgresUnavailableError("running as root and no runuser to drop to the 'postgres' user")
    return (runuser, "-u", "postgres", "--"), user.pw_uid, user.pw_gid


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    """Start a private server in a new temporary folder; stop it and remove the folder afterwards.

    Raises :class:`PostgresUnavailableError` when it cannot be started for lack of binaries or user.
    """
    bin_dir = find_bin_dir()
    run_as, uid, gid = _owner()
    root = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    try:
        if uid is not None and gid is not None:
            os.chown(root, uid, gid)
        password = secrets.token_hex(12)
        pwfile = root / "pwfile"
        pwfile.write_text(password + "\n")
        if uid is not None and gid is not None:
            os.chown(pwfile, uid, gid)
        data = root / "data"
        settings = ["--auth-local=trust", "--auth-host=scram-sha-256", "--encoding=UTF8", "--no-sync"]
        subprocess.run(
            [
                *run_as,
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                SUPERUSER,
                f"--pwfile={pwfile}",
                *settings,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        server = _start(bin_dir, root, data, run_as, password)
        try:
            yield server
        finally:
            _stop(bin_dir, data, run_as)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _start(bin_dir: Path, root: Path, data: Path, run_as: tuple[str, ...], password: str) -> PostgresServer:
    """Start the server on a free port (trying again when another process took the port first)."""
    for _ in range(3):
        port = _free_port()
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off -c max_connections=50"
        wait = ["-w", "-t", str(START_TIMEOUT_S)]
        started = subprocess.run(
            [
                *run_as,
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(root / "server.log"),
                "-o",
                options,
                *wait,
                "start",
            ],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S + 30,
            check=False,
        )
        if started.returncode == 0:
            return PostgresServer(bin_dir, root, port, password, run_as)
        _stop(bin_dir, data, run_as)
    log = (root / "server.log").read_text(errors="replace")[-2000:]
    raise RuntimeError(f"PostgreSQL did not start: {started.stderr.strip()}\n{log}")


def _stop(bin_dir: Path, data: Path, run_as: tuple[str, ...]) -> None:
    """Stop the server (fast shutdown), and kill its postmaster if pg_ctl could not."""
    with contextlib.suppress(subprocess.SubprocessError):
        subprocess.run(
            [*run_as, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "30", "stop"],
            capture_output=True,
            timeout=60,
            check=False,
        )
    pid_file = data / "postmaster.pid"
    if pid_file.exists():
        with contextlib.suppress(ValueError, IndexError, ProcessLookupError):
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
