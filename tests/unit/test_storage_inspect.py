"""Damaged storage files are found before anything writes to them, with one line saying how to repair
them; what a storage raises mid-run (a full disk, a damaged file) becomes one line too."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import optuna
import pytest
import sqlalchemy
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from autotune.errors import DiskFullError, StorageDamagedError, StorageUnavailableError
from autotune.store.storage import close_storage, inspect_storage, open_storage, storage_failure
from autotune.store.storage_inspect import inspect_journal, inspect_sqlite

SHOWN = "test-storage"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sqlite_study(path: Path, trials: int = 3) -> None:
    """A real Optuna SQLite study ``s`` with ``trials`` finished trials."""
    storage = open_storage(f"sqlite:///{path}", heartbeat=False)
    try:
        study = optuna.create_study(storage=storage, study_name="s")
        for i in range(trials):
            study.add_trial(optuna.trial.create_trial(values=[float(i)], user_attrs={"pad": "x" * 3000}))
    finally:
        close_storage(storage)


def journal_study(path: Path, trials: int = 3) -> None:
    """A real Optuna journal with a study ``s`` and ``trials`` finished trials."""
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    study = optuna.create_study(storage=storage, study_name="s")
    for i in range(trials):
        study.add_trial(optuna.trial.create_trial(values=[float(i)]))


def damaged(call: object) -> str:
    with pytest.raises(StorageDamagedError) as caught:
        call()  # type: ignore[operator]
    message = str(caught.value)
    assert "\n" not in message
    assert "nothing was written" in message
    return message


def test_a_whole_sqlite_file_passes_and_its_study_is_counted(tmp_path: Path) -> None:
    """A healthy database passes quick_check; inspect_storage counts the study's trials, and a study
    that is not there is None (read-only: the file is unchanged)."""
    path = tmp_path / "study.db"
    sqlite_study(path)
    before = digest(path)
    assert "passes quick_check" in inspect_sqlite(path, SHOWN).summary
    assert inspect_storage(f"sqlite:///{path}", "s").trials == 3
    assert inspect_storage(f"sqlite:///{path}", "other").trials is None
    assert digest(path) == before


def test_a_missing_sqlite_file_is_new() -> None:
    """No file yet: a new study, nothing to check (and nothing created)."""
    missing = Path("/nonexistent-autotune-test/study.db")
    facts = inspect_sqlite(missing, SHOWN)
    assert not facts.exists and "new SQLite file" in facts.summary


def test_an_empty_sqlite_file_is_refused_and_left_empty(tmp_path: Path) -> None:
    """A zero-length study.db would silently become a new study: refused, and still 0 bytes."""
    path = tmp_path / "study.db"
    path.write_bytes(b"")
    message = damaged(lambda: open_storage(f"sqlite:///{path}", heartbeat=False))
    assert "is empty (0 bytes)" in message and f"sqlite:///{path}" in message
    assert path.read_bytes() == b""


def test_a_file_without_sqlites_header_is_refused(tmp_path: Path) -> None:
    """The first 16 bytes must be SQLite's header."""
    path = tmp_path / "study.db"
    path.write_bytes(b"SQLite format 2\x00" + b"\x00" * 4096)
    assert "is not an SQLite database" in damaged(lambda: inspect_sqlite(path, SHOWN))


@pytest.mark.parametrize("page", [1, 2, 5])
def test_garbage_inside_an_sqlite_file_fails_quick_check_and_is_not_written(
    tmp_path: Path, page: int
) -> None:
    """Garbage over a page of a real study database: quick_check names the damage, the repair is spelt
    out, and the file keeps every byte (opening it for writing would have gone on)."""
    path = tmp_path / "study.db"
    sqlite_study(path, trials=20)
    with path.open("r+b") as file:
        file.seek(4096 * page)
        file.write(b"\xde\xad\xbe\xef" * 1024)
    before = digest(path)
    message = damaged(lambda: open_storage(f"sqlite:///{path}", heartbeat=True))
    assert "is damaged (SQLite's quick_check:" in message
    assert f"sqlite3 {path} .recover | sqlite3 NEW.db" in message
    assert digest(path) == before


def test_a_hot_rollback_journal_is_not_called_damage(tmp_path: Path) -> None:
    """A writer killed mid-transaction leaves a hot journal that a read-only connection cannot roll back:
    reported as not checked (not damaged), and the next writable open rolls it back."""
    path = tmp_path / "study.db"
    sqlite_study(path)
    killed = (
        "import os, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('PRAGMA cache_size=1')\n"
        "c.execute('BEGIN')\n"
        'c.execute("UPDATE trial_user_attributes SET value_json = \'\\"" + \'y\' * 3000 + "\\"\'")\n'
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", killed, str(path)], check=True, timeout=30)
    assert (tmp_path / "study.db-journal").stat().st_size > 0
    assert "not checked" in inspect_sqlite(path, SHOWN).summary
    facts = inspect_storage(f"sqlite:///{path}", "s")
    assert not facts.readable and facts.trials is None, "unknown, not 'no such study'"
    storage = open_storage(f"sqlite:///{path}", heartbeat=False)
    try:
        trials = optuna.load_study(study_name="s", storage=storage).get_trials()
    finally:
        close_storage(storage)
    assert [t.user_attrs["pad"] for t in trials] == ["x" * 3000] * 3


def test_a_whole_journal_passes_and_its_study_is_counted(tmp_path: Path) -> None:
    """Every line a record: passes, and the study's trials are counted without writing."""
    path = tmp_path / "study.log"
    journal_study(path)
    before = digest(path)
    assert "every one whole" in inspect_journal(path, SHOWN).summary
    assert inspect_storage(f"journal:///{path}", "s").trials == 3
    assert digest(path) == before
    assert not (tmp_path / "study.log.lock").exists()


def _repair(message: str, path: Path) -> None:
    """Run the `truncate -s N PATH` the message suggests."""
    command = message.split("`")[1]
    assert command.startswith("truncate -s ") and command.endswith(str(path)), command
    subprocess.run(command.split(), check=True)


@pytest.mark.parametrize("cut", [2, 40, 100])
def test_a_journal_cut_mid_record_says_which_line_and_how_to_truncate(tmp_path: Path, cut: int) -> None:
    """A last record cut short: one line naming it, no write (Optuna would append after it and make the
    journal unreadable), and the suggested truncate leaves a journal Optuna reads and appends to."""
    path = tmp_path / "study.log"
    journal_study(path)
    whole = path.read_bytes()
    lines = whole.count(b"\n")
    path.write_bytes(whole[:-cut])
    message = damaged(lambda: open_storage(f"journal:///{path}", heartbeat=False))
    assert f"last line (line {lines}) is cut short" in message
    assert f"keep the {lines - 1} whole records" in message
    assert path.read_bytes() == whole[:-cut]
    _repair(message, path)
    assert path.read_bytes() == whole[: whole.rindex(b"\n", 0, len(whole) - 1) + 1]
    storage = open_storage(f"journal:///{path}", heartbeat=False)
    study = optuna.load_study(study_name="s", storage=storage)
    study.add_trial(optuna.trial.create_trial(values=[9.0]))
    assert len(optuna.load_study(study_name="s", storage=storage).get_trials()) == 3


def test_a_whole_last_record_without_its_newline_keeps_every_record(tmp_path: Path) -> None:
    """Only the final newline missing: the repair adds it back, losing nothing."""
    path = tmp_path / "study.log"
    journal_study(path)
    path.write_bytes(path.read_bytes()[:-1])
    message = damaged(lambda: inspect_journal(path, SHOWN))
    assert f"`echo >> {path}` (every record is kept)" in message


def test_garbage_after_the_last_record_is_reported_with_its_line(tmp_path: Path) -> None:
    """A garbage last line (with its newline): which line, and the truncate that drops only it."""
    path = tmp_path / "study.log"
    journal_study(path)
    whole = path.read_bytes()
    path.write_bytes(whole + b"\x00\x00garbage\n")
    message = damaged(lambda: inspect_journal(path, SHOWN))
    lines = whole.count(b"\n")
    assert f"the last line of the journal (line {lines + 1}) is not a journal record" in message
    _repair(message, path)
    assert path.read_bytes() == whole


def test_garbage_in_the_middle_of_a_journal_says_what_truncating_loses(tmp_path: Path) -> None:
    """A damaged line with records after it: which line, how many follow, and that truncating loses them."""
    path = tmp_path / "study.log"
    journal_study(path)
    lines = path.read_bytes().split(b"\n")
    lines[2] = b'{"op_code": 4, "cut'
    path.write_bytes(b"\n".join(lines))
    message = damaged(lambda: inspect_journal(path, SHOWN))
    assert f"line 3 of the journal is not a journal record, and {len(lines) - 4} lines follow it" in message
    assert "losing every record from line 3 on" in message


def test_a_record_being_appended_is_waited_for_not_called_cut(tmp_path: Path) -> None:
    """The journal is read under Optuna's writer lock: a record half-written by a tuner holding the lock
    is read whole once the writer releases it."""
    path = tmp_path / "study.log"
    journal_study(path)
    record = json.dumps({"op_code": 2, "worker_id": "w", "study_id": 0, "user_attr": {"k": 1}}) + "\n"
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    with path.open("ab") as file:
        file.write(record[:10].encode())
    results: list[str] = []
    reader = threading.Thread(target=lambda: results.append(inspect_journal(path, SHOWN).summary))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive(), "the reader must wait for the writer's lock"
    with path.open("ab") as file:
        file.write(record[10:].encode())
    lock.release()
    reader.join(10)
    assert results and "every one whole" in results[0]


def _fill(study: optuna.Study) -> Exception:
    """Add big trials until the storage refuses one; that error."""
    for _ in range(50):
        try:
            study.add_trial(optuna.trial.create_trial(values=[1.0], user_attrs={"pad": "z" * 8000}))
        except Exception as exc:  # whatever Optuna wraps SQLite's error in
            return exc
    raise AssertionError("the storage never filled up")


def test_sqlite_full_is_a_disk_full_error(tmp_path: Path) -> None:
    """SQLite's own "database or disk is full" (a page limit reached: SQLITE_FULL, as on a full disk),
    through Optuna and SQLAlchemy, is one line naming the storage: not retried."""
    path = tmp_path / "study.db"
    sqlite_study(path)
    url = f"sqlite:///{path}"
    storage = open_storage(url, heartbeat=False)
    assert isinstance(storage, optuna.storages.RDBStorage)

    def cap(dbapi: sqlite3.Connection, _record: object) -> None:
        pages = dbapi.execute("PRAGMA page_count").fetchone()[0]
        dbapi.execute(f"PRAGMA max_page_count = {pages}")

    sqlalchemy.event.listen(storage.engine, "connect", cap)
    storage.engine.dispose()
    study = optuna.load_study(study_name="s", storage=storage)
    try:
        error = _fill(study)
    finally:
        close_storage(storage)
    failure = storage_failure(error, url)
    assert isinstance(failure, DiskFullError), error
    assert not failure.transient
    assert f"storage {url}" in str(failure) and "\n" not in str(failure)


def test_enospc_names_the_file_when_it_is_known(tmp_path: Path) -> None:
    """A real ENOSPC (writing to /dev/full) is a DiskFullError; with a file name, it names that file."""
    with (
        pytest.raises(OSError, match="No space left") as caught,
        open("/dev/full", "wb", buffering=0) as full,
    ):
        full.write(b"x")
    failure = storage_failure(caught.value, f"journal:///{tmp_path}/study.log")
    assert isinstance(failure, DiskFullError)
    assert f"{tmp_path}/study.log" in str(failure)
    named = OSError(28, "No space left on device", str(tmp_path / "probe-1.json"))
    assert "probe-1.json" in str(storage_failure(named, f"sqlite:///{tmp_path}/study.db"))


def test_a_database_that_does_not_answer_is_transient() -> None:
    """A refused connection (nothing listens on port 1) is StorageUnavailableError, retried; other errors
    are not storage failures."""
    engine = sqlalchemy.create_engine("postgresql+psycopg://u:hunter2@127.0.0.1:1/db")
    with pytest.raises(sqlalchemy.exc.OperationalError) as caught:
        engine.connect()
    engine.dispose()
    failure = storage_failure(caught.value, "postgresql://u:hunter2@127.0.0.1:1/db")
    assert isinstance(failure, StorageUnavailableError) and failure.transient
    assert "hunter2" not in str(failure)
    assert storage_failure(KeyError("x"), "sqlite:///x.db") is None
    assert storage_failure(ValueError("bad"), "journal:///x.log") is None


def test_enospc_without_a_file_names_the_storage_and_the_study_folder(tmp_path: Path) -> None:
    """A full disk whose error names no file (a probe written with write_text): both places the tuner
    writes to are named, with the room left on each."""
    with (
        pytest.raises(OSError, match="No space left") as caught,
        open("/dev/full", "wb", buffering=0) as full,
    ):
        full.write(b"x")
    failure = storage_failure(caught.value, "postgresql://u:p@db/s", tmp_path / "study")
    assert isinstance(failure, DiskFullError)
    assert f"'{tmp_path / 'study'}' (" in str(failure) and "MiB free" in str(failure)
