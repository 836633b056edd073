"""A study's storage URL turned into an Optuna storage: checked without side effects, opened race-free.

Accepted URLs (``PATH`` follows SQLAlchemy's rule: ``sqlite:///study.db`` is relative to the current
folder, ``sqlite:////abs/study.db`` is absolute):

- ``sqlite:///PATH``: one SQLite file, for the tuners of one host.
- ``journal:///PATH``: Optuna's JournalStorage on an append-only log file (``JournalFileBackend``), for
  the tuners of one host; no database library involved.
- ``postgresql://USER:PASSWORD@HOST[:PORT]/DB`` (or ``postgresql+psycopg://``, ``postgresql+psycopg2://``):
  for tuners on several hosts. Plain ``postgresql://`` is opened with the driver that is installed,
  psycopg 3 first (``pip install 'autotune[postgres]'``), whatever SQLAlchemy's own default is.
- ``mysql://USER:PASSWORD@HOST[:PORT]/DB`` (or ``mysql+pymysql://``, ``mysql+mysqldb://``): likewise;
  plain ``mysql://`` uses mysqlclient when installed, else PyMySQL (``pip install 'autotune[mysql]'``).

Heartbeats: on the database storages (SQLite, PostgreSQL, MySQL) a tuner with ``heartbeat=True`` beats
every :data:`HEARTBEAT_INTERVAL_S` while its trial runs; a RUNNING trial whose tuner has not beaten for
:data:`GRACE_PERIOD_S` is failed by the next tuner that looks and handed to ``on_stale`` (the study
re-queues its config: :func:`autotune.study.recovery.recover`). Optuna 5.1's JournalStorage has no heartbeat
(it is not a ``BaseHeartbeat``): a trial whose tuner was killed stays RUNNING in the journal until a tuner on
that host finds the trial's worker process gone (:func:`autotune.study.recovery.recover`, run at start and
while a tuner waits), which fails it and re-queues it. A journal file serves one host, so that check applies.

Before a local file is opened it is inspected read-only (:mod:`autotune.store.storage_inspect`): an SQLite
file that is empty, not SQLite or damaged, and a journal with a line that is not a whole record, are
refused with one line saying how to repair them, and nothing is written to them. :func:`inspect_storage`
is the same look for ``autotune validate`` (a database is reached with a short timeout and only read),
and says whether the study is there. :func:`storage_failure` turns what a storage raises mid-run into one
line: a full disk (:class:`~autotune.errors.DiskFullError`, not retried), a damaged file, or a database
that did not answer (:class:`~autotune.errors.StorageUnavailableError`, retried).

Several processes may open a new storage, and create the same new study, at the same moment: local
files are created under an exclusive ``flock`` on ``<file>.create.lock`` (left in place: removing a
lock file races with its next user), schema races on a database server (``table ... already exists``,
duplicate keys) are retried with a short randomized backoff, and :func:`create_or_load_study` tells
the one process that created the study from the others. Tuners of one host that give back a dead
tuner's trials take turns on ``<file>.recover.lock`` (:func:`recovery_lock`; tuners of any host on
PostgreSQL, on an advisory lock), and tuners taking a trial on ``<file>.queue.lock`` (:func:`queue_lock`):
SQLite does not make either state change atomic.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib
import os
import random
import re
import sqlite3
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
from optuna.exceptions import DuplicatedStudyError
from optuna.storages.journal import JournalFileBackend
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial

from autotune.errors import (
    AutotuneError,
    DiskFullError,
    SpecError,
    StorageDamagedError,
    StorageUnavailableError,
    StudyError,
)
from autotune.store.storage_inspect import (
    SQLITE_BUSY,
    STUDY_TRIALS_SQL,
    inspect_journal,
    inspect_sqlite,
    journal_study_trials,
    sqlite_study_trials,
)

StaleCallback = Callable[[optuna.Study, FrozenTrial], None]
"""Called with a trial whose tuner's heartbeat stopped, after this process failed it."""

HEARTBEAT_INTERVAL_S = 20
"""Seconds between a tuner's heartbeats on a database storage."""
GRACE_PERIOD_S = 90
"""Seconds without a heartbeat after which another tuner fails a RUNNING trial."""
CREATE_LOCK_SUFFIX = ".create.lock"
"""Appended to a local storage file's path for the lock held while opening it (``.lock`` alone is
taken: JournalFileBackend uses ``<file>.lock`` as its own lock)."""
RECOVER_LOCK_SUFFIX = ".recover.lock"
"""Appended to a local storage file's path for the lock held while a tuner gives back another's trials."""
QUEUE_LOCK_SUFFIX = ".queue.lock"
"""Appended to a local storage file's path for the lock held while a tuner takes a trial (a queued one
first)."""
OPEN_ATTEMPTS = 8
"""Tries at opening a storage when the failure is a race with another process creating it."""
CONNECT_TIMEOUT_S = 10
"""How long :func:`inspect_storage` waits for a database server to accept the connection."""

_RACE_MARKERS = ("already exists", "duplicate key", "unique constraint", "database is locked")
_SCHEMES = "sqlite:///PATH, journal:///PATH, postgresql://USER:PASSWORD@HOST/DB or mysql://..."
_CREDENTIALS = re.compile(r"^(?P<head>[A-Za-z][\w+.-]*://[^:/@]*):(?P<password>.*)@(?P<tail>[^@]*)$", re.S)
_QUERY_PASSWORD = re.compile(r"(?P<key>[?&]password=)[^&]*", re.I)


@dataclass(frozen=True)
class _Driver:
    """A database driver that SQLAlchemy can use, and the extra that installs it."""

    name: str
    """The SQLAlchemy driver name, as in ``postgresql+NAME://``."""
    module: str
    """The Python module to import."""
    hint: str
    """How to install it, for the error when it is missing."""


_TIMEOUT_ARG = {
    "psycopg": "connect_timeout",
    "psycopg2": "connect_timeout",
    "pg8000": "timeout",
    "mysqldb": "connect_timeout",
    "pymysql": "connect_timeout",
    "mysqlconnector": "connection_timeout",
}
"""Each driver's name for its connection timeout (seconds)."""
_PG_HINT = "install the PostgreSQL driver: pip install 'autotune[postgres]'"
_MYSQL_HINT = "install the MySQL driver: pip install 'autotune[mysql]'"
_DRIVERS: dict[str, tuple[_Driver, ...]] = {
    "postgresql": (
        _Driver("psycopg", "psycopg", _PG_HINT),
        _Driver("psycopg2", "psycopg2", "install psycopg2: pip install psycopg2-binary"),
        _Driver("pg8000", "pg8000", "install pg8000: pip install pg8000"),
    ),
    "mysql": (
        _Driver("mysqldb", "MySQLdb", "install mysqlclient: pip install mysqlclient"),
        _Driver("pymysql", "pymysql", _MYSQL_HINT),
        _Driver("mysqlconnector", "mysql.connector", "install it: pip install mysql-connector-python"),
    ),
}
_DEFAULT_HINT = {"postgresql": _PG_HINT, "mysql": _MYSQL_HINT}
_PREFERRED = {"postgresql": ("psycopg", "psycopg2"), "mysql": ("mysqldb", "pymysql")}
"""Drivers tried, in order, for a URL that names none."""


@dataclass(frozen=True)
class _Target:
    """A checked storage URL: its kind, the URL to hand to Optuna, and the local file if any."""

    kind: Literal["sqlite", "journal", "database"]
    url: str
    """For ``database``: the URL with an explicit, installed driver."""
    path: Path | None
    """The local file for ``sqlite`` and ``journal``."""


def redact_url(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` query parameter) shown as ``***``."""
    match = _CREDENTIALS.match(url)
    if match is not None:
        url = f"{match['head']}:***@{match['tail']}"
    return _QUERY_PASSWORD.sub(lambda m: m["key"] + "***", url)


def check_storage_url(url: str, field: str = "study.storage") -> None:
    """Raise :class:`SpecError` naming ``field`` when ``url`` cannot be a study's storage.

    Opens, creates and writes nothing: checks the scheme, that a database driver is installed, and that
    a local file's folder exists or can be created (its nearest existing ancestor is a writable folder
    on a filesystem that holds files).
    """
    _resolve(url, field)


def open_storage(
    url: str,
    *,
    heartbeat: bool,
    on_stale: StaleCallback | None = None,
    field: str = "study.storage",
) -> optuna.storages.BaseStorage:
    """Open (creating when new) the storage at ``url``; see the module docstring for what is accepted.

    With ``heartbeat``, a database storage beats every :data:`HEARTBEAT_INTERVAL_S` while a trial runs,
    and a trial whose tuner went silent for :data:`GRACE_PERIOD_S` is failed by the next tuner that looks
    (``optuna.storages.fail_stale_trials``), which then calls ``on_stale`` with it (journal storage has no
    heartbeat). Safe when several processes
    open the same new storage at once. Raises :class:`SpecError` for a URL :func:`check_storage_url`
    rejects, :class:`StudyError` (one line, password redacted) when the storage cannot be opened.
    """
    target = _resolve(url, field)
    if target.path is None:
        return _retry_races(url, lambda: _open_database(target.url, heartbeat=heartbeat, on_stale=on_stale))
    try:
        target.path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StudyError(
            f"cannot create the folder of storage {redact_url(url)}: {exc.strerror or exc}"
        ) from exc
    with _file_lock(url, target.path):
        if target.kind == "journal":
            inspect_journal(target.path, redact_url(url))
            return _open_journal(url, target.path)
        inspect_sqlite(target.path, redact_url(url))
        return _retry_races(url, lambda: _open_database(target.url, heartbeat=heartbeat, on_stale=on_stale))


@dataclass(frozen=True)
class StorageFacts:
    """What a read-only look at a storage found (:func:`inspect_storage`)."""

    summary: str
    """A few words on the storage itself, e.g. ``SQLite, 120 KiB, passes quick_check``."""
    trials: int | None
    """The study's trials in it, or None when the study is not there (a new study, or the wrong storage)
    or could not be read now (``readable`` False)."""
    readable: bool = True
    """False when the file could not be read now: another tuner holds SQLite's lock, or a hot rollback
    journal waits for the next writable open (a tuner killed mid-write). Then whether the study is there
    is unknown."""


def inspect_storage(
    url: str, study: str, field: str = "study.storage", *, timeout_s: float = CONNECT_TIMEOUT_S
) -> StorageFacts:
    """Look at the storage ``url`` and the study ``study`` in it, writing nothing anywhere.

    A local file is inspected (:mod:`autotune.store.storage_inspect`); a database server is reached within
    ``timeout_s`` and only read (Optuna's tables, if there). Raises :class:`SpecError` for a URL
    :func:`check_storage_url` rejects, :class:`StorageDamagedError` for a damaged file,
    :class:`StudyError` (one line, password redacted) for a database that cannot be reached or read.
    """
    target = _resolve(url, field)
    if target.path is None:
        return _inspect_database(target.url, url, study, timeout_s)
    with _after_creation(target.path):
        return _inspect_file(target.path, target.kind == "journal", url, study)


def _inspect_file(path: Path, journal: bool, url: str, study: str) -> StorageFacts:
    """:func:`inspect_storage` of a local file (a journal, or SQLite)."""
    shown = redact_url(url)
    try:
        if journal:
            facts = inspect_journal(path, shown)
            trials = journal_study_trials(path, study) if facts.exists else None
        else:
            facts = inspect_sqlite(path, shown)
            if not facts.checked:
                return StorageFacts(facts.summary, None, readable=False)
            trials = sqlite_study_trials(path, study) if facts.exists else None
    except sqlite3.OperationalError as exc:
        if getattr(exc, "sqlite_errorname", "") in SQLITE_BUSY:
            return StorageFacts("SQLite, in use or mid-recovery: not read", None, readable=False)
        raise StudyError(f"cannot read storage {shown}: {_one_line(exc, url)}") from exc
    except (OSError, sqlite3.Error) as exc:
        raise StudyError(f"cannot read storage {shown}: {_one_line(exc, url)}") from exc
    return StorageFacts(facts.summary, trials)


@contextlib.contextmanager
def _connected(driver_url: str, url: str, timeout_s: float) -> Iterator[Any]:
    """A connection to a database server (given up after ``timeout_s``) that has answered one ``SELECT
    1``; a :class:`StudyError` naming why in the driver's words (not Optuna's wrapper of them) when it
    cannot be reached or read. The engine is disposed after."""
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    driver = driver_url.partition("://")[0].partition("+")[2]
    timeout = {_TIMEOUT_ARG[driver]: max(1, round(timeout_s))} if driver in _TIMEOUT_ARG else {}
    engine = sqlalchemy.create_engine(driver_url, poolclass=NullPool, connect_args=timeout)
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT 1"))
            yield conn
    except Exception as exc:  # SQLAlchemy and driver errors come in many types
        raise StudyError(
            f"cannot reach storage {redact_url(url)}: {_one_line(exc, url)}: {_advice(exc)}"
        ) from exc
    finally:
        engine.dispose()


def _reach_database(driver_url: str, url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Reach a database server once (:func:`_connected`), or say why it cannot be reached."""
    with _connected(driver_url, url, timeout_s):
        pass


def _inspect_database(driver_url: str, url: str, study: str, timeout_s: float) -> StorageFacts:
    """Connect to a database server (within ``timeout_s``), read whether Optuna's tables and the study
    are there, and roll back: nothing is written."""
    import sqlalchemy

    with _connected(driver_url, url, timeout_s) as conn:
        if not sqlalchemy.inspect(conn).has_table("studies"):
            return StorageFacts(
                "reachable, without Optuna's tables (the first `autotune tune` makes them)", None
            )
        query = sqlalchemy.text(STUDY_TRIALS_SQL.replace("?", ":name"))
        row = conn.execute(query, {"name": study}).fetchone()
        conn.rollback()
    return StorageFacts("reachable", None if row is None else int(row[0]))


def storage_failure(exc: BaseException, url: str, folder: Path | None = None) -> AutotuneError | None:
    """What an error raised while the study's storage (``url``) was in use means, as one line; None when
    it is not a storage failure. Looks through the chain of causes (Optuna wraps SQLAlchemy, which wraps
    the driver):

    - no space left on a device (``ENOSPC``, ``EDQUOT``, SQLite's "database or disk is full"):
      :class:`DiskFullError`, not retried; it names the file when the error does, else the storage's file
      and the study's ``folder`` (its logs and probe files), with the room left on each;
    - a damaged SQLite file ("malformed", "not a database") or journal line: :class:`StorageDamagedError`;
    - a database that did not answer (SQLAlchemy's ``OperationalError``/``InterfaceError``, Optuna's
      ``StorageInternalError`` around them): :class:`StorageUnavailableError`, retried.
    """
    import sqlalchemy.exc

    shown = redact_url(url)
    chain = list(_causes(exc))
    for error in chain:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            if error.filename:
                places = [Path(os.fsdecode(error.filename))]
            else:
                places = [p for p in (_local_file(url), folder) if p is not None]
            where = " or ".join(f"{str(p)!r} ({_free_text(p)})" for p in dict.fromkeys(places)) or shown
            return DiskFullError(
                f"no space left on the device of {where}: free space there, then rerun to resume (what "
                "was stored before this write is kept)"
            )
        if isinstance(error, sqlite3.DatabaseError):
            text = str(error)
            if "disk is full" in text:
                room = _free_text(_local_file(url) or shown)
                return DiskFullError(
                    f"no space left on the device of storage {shown} ({room}): free space "
                    "there, then rerun to resume (SQLite rolled the write back: the study is as it was)"
                )
            if "malformed" in text or "not a database" in text:
                return StorageDamagedError(
                    f"storage {shown} is damaged ({text}): stop every tuner of the study, then run "
                    "`autotune validate` for how to repair it"
                )
        if isinstance(error, ValueError) and _raised_in(error, os.path.join("optuna", "storages", "journal")):
            return StorageDamagedError(
                f"storage {shown}: a journal record could not be read ({_one_line(error, url)}): stop every "
                "tuner of the study, then run `autotune validate` for how to repair it"
            )
    for error in chain:
        if isinstance(error, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
            return StorageUnavailableError(
                f"the study's storage {shown} did not answer: {_one_line(error, url)}"
            )
    return None


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes and contexts, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        orig = getattr(current, "orig", None)  # SQLAlchemy's DBAPIError keeps the driver's error here
        if isinstance(orig, BaseException) and id(orig) not in seen:
            yield orig
            seen.add(id(orig))
        current = current.__cause__ or current.__context__


def _raised_in(error: BaseException, package: str) -> bool:
    """Whether code in ``package`` (a path fragment) is on ``error``'s traceback."""
    tb = error.__traceback__
    while tb is not None:
        if package in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _local_file(url: str) -> Path | None:
    """The file of a local storage URL, or None (a database server, or a URL that does not parse)."""
    try:
        return _resolve(url, "study.storage").path
    except SpecError:
        return None


def _free_text(where: str | Path) -> str:
    """How much room is left on the filesystem holding ``where`` (or its nearest existing ancestor)."""
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stat = os.statvfs(path)
    except OSError:
        return "free space unknown"
    return f"{stat.f_bavail * stat.f_frsize / 1024**2:.1f} MiB free"


@contextlib.contextmanager
def storage_errors(url: str, folder: Path | None = None) -> Iterator[None]:
    """Raise what :func:`storage_failure` makes of an error of the storage ``url`` (or of a write in the
    study's ``folder``) in the block, from the error; other errors pass unchanged."""
    try:
        yield
    except AutotuneError:
        raise
    except Exception as exc:
        failure = storage_failure(exc, url, folder)
        if failure is None:
            raise
        raise failure from exc


def close_storage(storage: optuna.storages.BaseStorage) -> None:
    """Close the database connections of a storage from :func:`open_storage` (a journal holds none).

    The storage must not be used afterwards.
    """
    if isinstance(storage, optuna.storages.RDBStorage):
        storage.remove_session()
        storage.engine.dispose()


def create_or_load_study(
    storage: optuna.storages.BaseStorage,
    name: str,
    directions: Sequence[str],
    sampler: optuna.samplers.BaseSampler | None,
) -> tuple[optuna.Study, bool]:
    """The study ``name`` in ``storage``, and whether this call created it.

    When several processes call this at once for a new study, exactly one gets ``True``. Raises
    :class:`StudyError` when the stored study has other directions than ``directions``.
    """
    wanted = [StudyDirection[d.upper()] for d in directions]
    try:
        study = optuna.create_study(storage=storage, study_name=name, directions=wanted, sampler=sampler)
    except DuplicatedStudyError:
        pass
    else:
        return study, True
    study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    if study.directions != wanted:
        stored = [d.name.lower() for d in study.directions]
        asked = [d.name.lower() for d in wanted]
        raise StudyError(
            f"study {name!r} was created with directions {stored}, the spec asks for {asked}: "
            "use a new study name"
        )
    return study, False


def _resolve(url: str, field: str) -> _Target:
    """Check ``url`` (see :func:`check_storage_url`) and say how to open it."""
    shown = redact_url(url)
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme:
        raise SpecError(field, f"not a storage URL: {shown!r}: use {_SCHEMES}")
    dialect, _, driver = scheme.lower().partition("+")
    if dialect in ("sqlite", "journal"):
        if driver and not (dialect == "sqlite" and driver == "pysqlite"):
            raise SpecError(field, f"unknown {dialect} driver {driver!r} in {shown!r}: use {dialect}:///PATH")
        kind: Literal["sqlite", "journal"] = "sqlite" if dialect == "sqlite" else "journal"
        path = _local_path(rest, dialect, shown, field)
        _check_creatable(path, shown, field)
        return _Target(kind, url, path)
    if dialect in _DRIVERS:
        return _Target("database", _with_driver(url, dialect, driver, rest, shown, field), None)
    raise SpecError(field, f"unknown storage scheme {scheme!r} in {shown!r}: use {_SCHEMES}")


def _local_path(rest: str, dialect: str, shown: str, field: str) -> Path:
    """The file of a ``sqlite:///PATH`` or ``journal:///PATH`` URL (``rest`` is what follows ``://``)."""
    if not rest.startswith("/"):
        raise SpecError(
            field,
            f"{shown!r} names a host or no file: use {dialect}:///PATH "
            f"(relative to the current folder) or {dialect}:////ABSOLUTE/PATH",
        )
    path = rest[1:].split("?", 1)[0] if dialect == "sqlite" else rest[1:]
    if not path or path == ":memory:":
        raise SpecError(
            field,
            f"{shown!r} names no file (an in-memory study is lost when the tuner exits): "
            f"use {dialect}:///PATH",
        )
    return Path(os.path.abspath(path))


def _check_creatable(path: Path, shown: str, field: str) -> None:
    """Raise SpecError unless ``path`` can be written or created, touching nothing.

    The file, when it exists, must be readable and writable; its folder (or, when the folder is yet to
    be made, the nearest existing ancestor) must be a writable folder on a filesystem that holds files:
    SQLite writes its rollback journal next to the file, and :func:`open_storage` its lock.
    """
    # os.path answers False where pathlib would raise (a folder this user cannot search).
    if os.path.isdir(path):
        raise SpecError(field, f"{str(path)!r} is a folder, not a file, in {shown!r}")
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK, effective_ids=True):
        raise SpecError(field, f"{str(path)!r} is not writable by this user, in {shown!r}")
    check_folder(path.parent, field, f", in {shown!r}")


def check_folder(path: Path, field: str, where: str = "") -> None:
    """Raise :class:`SpecError` naming ``field`` unless files can be written in folder ``path`` (it
    exists, or its nearest existing ancestor is a writable folder on a filesystem that holds files).
    Touches nothing. ``where`` ends the message (the URL the folder belongs to)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise SpecError(field, f"{str(path)!r} is not a folder{where}")
    ancestor = path
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not os.path.isdir(ancestor):
        raise SpecError(field, f"cannot create a folder under {str(ancestor)!r}: it is not a folder{where}")
    if not os.access(ancestor, os.W_OK | os.X_OK, effective_ids=True):
        raise SpecError(field, f"folder {str(ancestor)!r} is not writable by this user{where}")
    if os.statvfs(ancestor).f_blocks == 0:
        raise SpecError(
            field, f"folder {str(ancestor)!r} is on a filesystem that holds no files (like /proc){where}"
        )


def _with_driver(url: str, dialect: str, driver: str, rest: str, shown: str, field: str) -> str:
    """``url`` with an explicit installed driver; SpecError naming the pip extra when there is none."""
    known = {d.name: d for d in _DRIVERS[dialect]}
    if driver:
        if driver not in known:
            raise SpecError(
                field,
                f"unsupported {dialect} driver {driver!r} in {shown!r}: use one of {', '.join(known)}",
            )
        if not _importable(known[driver].module):
            raise SpecError(field, f"{known[driver].hint} (for {shown!r})")
        return url
    for name in _PREFERRED[dialect]:
        if _importable(known[name].module):
            return f"{dialect}+{name}://{rest}"
    raise SpecError(field, f"{_DEFAULT_HINT[dialect]} (for {shown!r})")


def _importable(module: str) -> bool:
    """Whether ``module`` imports (psycopg without its C or binary part fails only on import)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def recovery_lock(url: str) -> Iterator[None]:
    """Let one tuner at a time fail the trials of dead ones and queue their configs again (and queue
    vLLM's defaults when the study lost them): an exclusive flock on ``<file>.recover.lock`` for a local
    storage, a session advisory lock (``pg_advisory_lock``) for PostgreSQL, whose tuners may be on
    several hosts; MySQL takes none.

    SQLite reads a trial's state outside the transaction that changes it, so two tuners recovering the
    same trial at once could both fail it and each queue a retry. On PostgreSQL failing it is atomic, but
    a tuner that found the defaults' trial failed (by the tuner recovering it, which then queues its
    retry) could queue the defaults itself in between: two retries of one trial (seen with three tuners,
    one killed while it measured the defaults)."""
    try:
        target = _resolve(url, "study.storage")
    except SpecError:  # as _local_file: a URL that does not parse has no lock (it opens nothing either)
        yield
        return
    if target.path is not None:
        with _file_lock(url, target.path, RECOVER_LOCK_SUFFIX):
            yield
    elif target.url.startswith("postgresql"):
        with _advisory_lock(target.url, RECOVER_ADVISORY_KEY):
            yield
    else:
        yield


RECOVER_ADVISORY_KEY = int.from_bytes(hashlib.sha256(b"autotune recover").digest()[:8], "big", signed=True)
"""The PostgreSQL advisory lock key of :func:`recovery_lock` (a signed 64-bit value, as the server takes)."""


@contextlib.contextmanager
def _advisory_lock(driver_url: str, key: int) -> Iterator[None]:
    """Hold PostgreSQL's session advisory lock ``key`` on a connection of its own (released by the server
    if this process dies)."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(driver_url, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": key})
            try:
                yield
            finally:
                connection.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), {"key": key})
    finally:
        engine.dispose()


@contextlib.contextmanager
def queue_lock(url: str) -> Iterator[None]:
    """Hold an exclusive flock on ``<file>.queue.lock`` while this tuner takes a trial (``study.ask``,
    which takes the first queued one), for a local storage (a no-op for a database server: its row lock
    makes the pop atomic). SQLite reads the queued trial's state outside the transaction that sets it
    RUNNING, so two tuners asking at once could both take the same queued trial: both launched its config,
    and the second to finish failed with ``UpdateFinishedTrialError`` (seen with three tuners on one study
    when one was killed and its retry was queued)."""
    with _local_lock(url, QUEUE_LOCK_SUFFIX):
        yield


@contextlib.contextmanager
def _local_lock(url: str, suffix: str) -> Iterator[None]:
    path = _local_file(url)
    if path is None:
        yield
        return
    with _file_lock(url, path, suffix):
        yield


@contextlib.contextmanager
def _after_creation(path: Path) -> Iterator[None]:
    """Wait until no process is creating the local storage ``path`` (an opener holds
    ``<file>.create.lock`` while it makes the file, which is empty for a moment), writing nothing: with no
    lock file, no process ever opened the storage and there is nothing to wait for. Seen: a second tuner
    started beside the first read the new file while it was empty and called it damaged."""
    try:
        fd = os.open(path.with_name(path.name + CREATE_LOCK_SUFFIX), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        yield
        return
    with _flocked(fd, fcntl.LOCK_SH):
        yield


@contextlib.contextmanager
def _file_lock(url: str, path: Path, suffix: str = CREATE_LOCK_SUFFIX) -> Iterator[None]:
    """Hold an exclusive flock on ``<path><suffix>`` (processes of this host take it one at a time)."""
    lock_path = path.with_name(path.name + suffix)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise StudyError(
            f"cannot create the lock file {str(lock_path)!r} of storage {redact_url(url)}: "
            f"{exc.strerror or exc}"
        ) from exc
    with _flocked(fd, fcntl.LOCK_EX):
        yield


@contextlib.contextmanager
def _flocked(fd: int, operation: int) -> Iterator[None]:
    """Hold ``flock(fd, operation)`` for the block, then close ``fd`` (closing releases the lock)."""
    try:
        fcntl.flock(fd, operation)
        yield
    finally:
        os.close(fd)


class _RDBStorage(optuna.storages.RDBStorage):
    """RDBStorage that closes its connections when its own construction fails (e.g. a lost race)."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        try:
            super().__init__(url, **kwargs)
        except BaseException:
            engine = getattr(self, "engine", None)
            if engine is not None:
                engine.dispose()
            raise


def _open_database(
    url: str, *, heartbeat: bool, on_stale: StaleCallback | None
) -> optuna.storages.BaseStorage:
    """One attempt at opening an SQLAlchemy URL as RDBStorage (tables are created when missing)."""
    if not heartbeat:
        return _RDBStorage(url)
    with warnings.catch_warnings():  # heartbeats are experimental in Optuna; used on purpose
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return _RDBStorage(
            url,
            heartbeat_interval=HEARTBEAT_INTERVAL_S,
            grace_period=GRACE_PERIOD_S,
            heartbeat_stale_trial_callback=on_stale,
        )


def _open_journal(url: str, path: Path) -> optuna.storages.BaseStorage:
    """Open (creating when missing) the journal log at ``path``."""
    try:
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    except Exception as exc:  # OSError, or a damaged log (ValueError, JSON errors)
        raise StudyError(
            f"cannot open storage {redact_url(url)}: {_one_line(exc, url)}: "
            "check that the file is an Optuna journal and is writable"
        ) from exc


def _retry_races(url: str, attempt: Callable[[], optuna.storages.BaseStorage]) -> optuna.storages.BaseStorage:
    """Call ``attempt`` until it succeeds, retrying (briefly, randomized) only races with other openers."""
    for number in range(1, OPEN_ATTEMPTS + 1):
        try:
            storage = attempt()
        except Exception as exc:  # SQLAlchemy, driver and Optuna errors come in many types
            if number < OPEN_ATTEMPTS and _is_race(exc):
                time.sleep(random.uniform(0.05, 0.25) * number)
                continue
            raise StudyError(
                f"cannot open storage {redact_url(url)}: {_one_line(exc, url)}: {_advice(exc)}"
            ) from exc
        return storage
    raise AssertionError("unreachable")


def _is_race(exc: BaseException) -> bool:
    """Whether ``exc`` is what a process gets when another creates the same tables at the same time."""
    import sqlalchemy.exc

    if not isinstance(exc, sqlalchemy.exc.DBAPIError):
        return False
    text = str(exc.orig if exc.orig is not None else exc).lower()
    return any(marker in text for marker in _RACE_MARKERS)


def _advice(exc: BaseException) -> str:
    """What to do about an error opening a database storage."""
    if isinstance(exc, RuntimeError) and "optuna storage upgrade" in str(exc):
        return "upgrade the storage as the message says, or use a new one"
    return (
        "check that the database server is running and reachable, and the URL's user, password and "
        "database name"
    )


def _one_line(exc: BaseException, url: str) -> str:
    """The first line of an error's message (the driver's own for SQLAlchemy errors), password hidden."""
    import sqlalchemy.exc

    source: BaseException = exc
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.orig is not None:
        source = exc.orig
    text = str(source).strip() or type(source).__name__
    line = text.splitlines()[0].strip()
    match = _CREDENTIALS.match(url)
    password = match["password"] if match is not None else ""
    if not password:
        return line
    # Only where it stands alone: a password "p" must not turn "port" into "***ort".
    return re.sub(rf"(?<![A-Za-z0-9]){re.escape(password)}(?![A-Za-z0-9])", "***", line)


def open_storage_readonly(url: str, field: str = "study.storage") -> optuna.storages.BaseStorage | None:
    """Open the storage at ``url`` for reading only (``autotune status``, ``autotune report``): nothing
    is created, locked or written, so it is safe while tuners write to it, and from a host or user that
    may only read. ``None`` when a local storage file does not exist (no study yet).

    SQLite is checked first as every command checks it (an empty or damaged file is one line naming why:
    its read-only ``quick_check`` reads the whole file, a second or so per GiB), then opened with
    ``mode=ro`` (a write would fail, not happen); a journal file is read without its lock (readers stop
    at the last whole line); a database server is asked one ``SELECT 1`` first (why it cannot be
    reached, in the driver's words), and its tables are not created."""
    dialect, sep, rest = url.partition("://")
    dialect = dialect.lower().partition("+")[0]
    if sep and dialect in ("sqlite", "journal"):
        path = _local_path(rest, dialect, redact_url(url), field)
        if not path.is_file():
            return None
        if dialect == "journal":
            try:
                return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
            except Exception as exc:
                raise StudyError(f"cannot read storage {redact_url(url)}: {_one_line(exc, url)}") from exc
        inspect_sqlite(path, redact_url(url))  # an empty or damaged file says so, as every command does
        target = f"sqlite:///file:{urllib.parse.quote(str(path))}?mode=ro&uri=true"
    else:
        target = _resolve(url, field).url
        _reach_database(target, url)  # an unreachable server says why, not Optuna's wrapper of it
    try:
        return _RDBStorage(target, skip_table_creation=True)
    except Exception as exc:
        raise StudyError(
            f"cannot read storage {redact_url(url)}: {_one_line(exc, url)}: {_advice(exc)}"
        ) from exc
