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
re-queues its config: :func:`autotune.study.recover`). Optuna 5.1's JournalStorage has no heartbeat (it
is not a ``BaseHeartbeat``): a trial whose tuner was killed stays RUNNING in the journal until a tuner on
that host finds the trial's worker process gone (:func:`autotune.study.recover`, run at start and while a
tuner waits), which fails it and re-queues it. A journal file serves one host, so that check applies.

Several processes may open a new storage, and create the same new study, at the same moment: local
files are created under an exclusive ``flock`` on ``<file>.create.lock`` (left in place: removing a
lock file races with its next user), schema races on a database server (``table ... already exists``,
duplicate keys) are retried with a short randomized backoff, and :func:`create_or_load_study` tells
the one process that created the study from the others.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import random
import re
import time
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

from autotune.errors import SpecError, StudyError

StaleCallback = Callable[[optuna.Study, FrozenTrial], None]
"""Called with a trial whose tuner's heartbeat stopped, after this process failed it."""

HEARTBEAT_INTERVAL_S = 20
"""Seconds between a tuner's heartbeats on a database storage."""
GRACE_PERIOD_S = 90
"""Seconds without a heartbeat after which another tuner fails a RUNNING trial."""
CREATE_LOCK_SUFFIX = ".create.lock"
"""Appended to a local storage file's path for the lock held while opening it (``.lock`` alone is
taken: JournalFileBackend uses ``<file>.lock`` as its own lock)."""
OPEN_ATTEMPTS = 8
"""Tries at opening a storage when the failure is a race with another process creating it."""

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
            return _open_journal(url, target.path)
        return _retry_races(url, lambda: _open_database(target.url, heartbeat=heartbeat, on_stale=on_stale))


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
def _file_lock(url: str, path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``<path>.create.lock`` (processes of this host open one at a time)."""
    lock_path = path.with_name(path.name + CREATE_LOCK_SUFFIX)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise StudyError(
            f"cannot create the lock file {str(lock_path)!r} of storage {redact_url(url)}: "
            f"{exc.strerror or exc}"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


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
    return line.replace(password, "***") if password else line
