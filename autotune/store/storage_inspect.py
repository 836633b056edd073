"""Read-only looks at a study's local storage file before anything opens it for writing.

An SQLite file that is empty, is not SQLite, or fails SQLite's ``PRAGMA quick_check`` (through a
read-only connection), and a journal with a line that is not a whole record, are each a
:class:`~autotune.errors.StorageDamagedError`: one line naming the file, the damage and what to do, with
the file left exactly as it was (opening it would have written to it: SQLite creates its tables in an
empty file, and Optuna appends a journal's next record after a cut one, which makes the whole journal
unreadable).

A journal is read under Optuna's own writer lock (``JournalFileSymlinkLock``, ``<file>.lock``), so a
record being appended by another tuner is never taken for a cut one. An SQLite file that another tuner
is writing (locked), or that holds a hot rollback journal (a writer was killed mid-transaction; the next
writable open rolls it back), cannot be checked read-only: it is reported as not checked, and opened.

The study lookups read Optuna's tables (``studies``, ``trials``: docs/optuna.md) or replay the journal
in memory; they write nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from autotune.errors import StorageDamagedError

SQLITE_HEADER = b"SQLite format 3\x00"
"""The first 16 bytes of every SQLite database file (sqlite.org/fileformat.html, 1.3)."""
STUDY_TRIALS_SQL = (
    "SELECT COUNT(t.trial_id) FROM studies s LEFT JOIN trials t ON t.study_id = s.study_id "
    "WHERE s.study_name = ? GROUP BY s.study_id"
)
"""How many trials Optuna's RDB schema holds for a study name (no row: no such study)."""
SQLITE_BUSY = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_READONLY_ROLLBACK")
"""SQLite's names for a file that cannot be read now: another connection holds the lock, or a hot
rollback journal needs a writable open to roll it back."""


@dataclass(frozen=True)
class FileFacts:
    """What a read-only look at a local storage file found."""

    exists: bool
    summary: str
    """A few words for ``autotune validate``, e.g. ``SQLite, 120 KiB, passes quick_check``."""
    checked: bool = True
    """False when the file could not be read now (see the module docstring): neither damaged nor whole."""


def _size_text(size: int) -> str:
    return f"{size} bytes" if size < 1024 else f"{size / 1024:.0f} KiB"


def inspect_sqlite(path: Path, shown: str) -> FileFacts:
    """Check the SQLite file ``path`` (of storage ``shown``) without writing to it; raise
    :class:`StorageDamagedError` when it is empty, not SQLite, or fails ``PRAGMA quick_check``."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return FileFacts(False, "a new SQLite file, made by the first `autotune tune`")
    where = f"storage {shown}: the file"
    if size == 0:
        raise StorageDamagedError(
            f"{where} is empty (0 bytes), not an SQLite database: nothing was written to it; restore the "
            f"study's database from a backup, or remove the empty file to start a new study"
        )
    with open(path, "rb") as file:
        header = file.read(len(SQLITE_HEADER))
    if header != SQLITE_HEADER:
        raise StorageDamagedError(
            f"{where} is not an SQLite database (it does not start with SQLite's header): nothing was "
            "written to it; point study.storage (or --storage) at the study's database, or restore it"
        )
    try:
        problem = _quick_check(path)
    except sqlite3.OperationalError as exc:
        if getattr(exc, "sqlite_errorname", "") in SQLITE_BUSY:
            return FileFacts(True, f"SQLite, {_size_text(size)}, in use or mid-recovery: not checked", False)
        problem = str(exc)
    if problem is not None:
        raise StorageDamagedError(
            f"{where} is damaged (SQLite's quick_check: {problem}): nothing was written to it; restore it "
            f"from a backup, or salvage what is readable with `sqlite3 {path} .recover | sqlite3 NEW.db` "
            "and point study.storage at NEW.db"
        )
    return FileFacts(True, f"SQLite, {_size_text(size)}, passes quick_check")


def _quick_check(path: Path) -> str | None:
    """The first problem ``PRAGMA quick_check`` reports (None: ok), through a read-only connection.

    Raises ``sqlite3.OperationalError`` when the file cannot be read now (locked, hot journal)."""
    with _read_only(path) as conn:
        try:
            rows = conn.execute("PRAGMA quick_check").fetchall()
        except sqlite3.OperationalError:
            raise
        except sqlite3.DatabaseError as exc:  # "database disk image is malformed", "file is not a database"
            return str(exc)
    first = str(rows[0][0]) if rows else "no answer"
    if first == "ok":
        return None
    lines = [line.strip() for line in first.splitlines() if line.strip() and not line.startswith("***")]
    return "; ".join(lines) or first.strip()


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection that cannot write (``mode=ro``), closed afterwards."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=2.0)
    try:
        yield conn
    finally:
        conn.close()


def sqlite_study_trials(path: Path, study: str) -> int | None:
    """How many trials the study ``study`` has in the SQLite file ``path``; None when the file, Optuna's
    tables or the study are missing. Read-only."""
    if not path.exists():
        return None
    with _read_only(path) as conn:
        try:
            row = conn.execute(STUDY_TRIALS_SQL, (study,)).fetchone()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return None
            raise
    return None if row is None else int(row[0])


def inspect_journal(path: Path, shown: str) -> FileFacts:
    """Check that every line of the journal ``path`` (of storage ``shown``) is a whole record, without
    writing to it; raise :class:`StorageDamagedError` saying which line is not and how to repair it.

    The file is read under Optuna's writer lock when the lock can be taken (it cannot in a folder this
    user may not write: then it is read as it is)."""
    if not path.exists():
        return FileFacts(False, "a new journal file, made by the first `autotune tune`")
    with _journal_lock(path):
        data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # what follows the last newline: b"" when the file ends with one
    offset = 0
    for number, line in enumerate(lines, start=1):
        if not _is_record(line):
            after = len(lines) - number
            keep = f"keep the {number - 1} records before it with `truncate -s {offset} {path}`"
            if after == 0 and not tail:
                raise StorageDamagedError(
                    f"storage {shown}: the last line of the journal (line {number}) is not a journal record "
                    f"(a write cut short or overwritten): nothing was written to it; {keep} (if it ended a "
                    "trial, that trial runs again), or move the file aside"
                )
            raise StorageDamagedError(
                f"storage {shown}: line {number} of the journal is not a journal record, and "
                f"{after + bool(tail)} lines follow it: nothing was written to it; restore it from a backup, "
                f"or {keep} (losing every record from line {number} on)"
            )
        offset += len(line) + 1
    if tail:
        number = len(lines) + 1
        if _is_record(tail):
            repair = f"add the missing newline with `echo >> {path}` (every record is kept)"
        else:
            repair = (
                f"keep the {len(lines)} whole records with `truncate -s {offset} {path}` (if it ended a "
                "trial, that trial runs again), or move the file aside"
            )
        raise StorageDamagedError(
            f"storage {shown}: the journal's last line (line {number}) is cut short (no newline: a write "
            f"that did not finish, a full disk?): nothing was written to it; {repair}"
        )
    return FileFacts(True, f"journal, {len(lines)} records, every one whole")


def _is_record(line: bytes) -> bool:
    """Whether ``line`` is one journal record: a JSON object with an ``op_code``."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return False
    return isinstance(record, dict) and "op_code" in record


@contextlib.contextmanager
def _journal_lock(path: Path) -> Iterator[None]:
    """Hold Optuna's journal writer lock on ``path`` while the block runs, when it can be taken."""
    lock = JournalFileSymlinkLock(str(path))
    try:
        lock.acquire()
    except OSError:  # a folder this user may not write: read as it is
        yield
        return
    try:
        yield
    finally:
        lock.release()


def journal_study_trials(path: Path, study: str) -> int | None:
    """How many trials the study ``study`` has in the journal ``path`` (replayed in memory); None when
    the file or the study is missing. Read-only: call it on a journal :func:`inspect_journal` passed."""
    if not path.exists():
        return None
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    try:
        study_id = storage.get_study_id_from_name(study)
    except KeyError:
        return None
    return len(storage.get_all_trials(study_id, deepcopy=False))
