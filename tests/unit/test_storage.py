"""Storage URLs: what check_storage_url rejects (and that it writes nothing), redaction, and opening."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from autotune.errors import SpecError, StorageDamagedError, StudyError
from autotune.store.storage import (
    CREATE_LOCK_SUFFIX,
    HEARTBEAT_INTERVAL_S,
    check_storage_url,
    create_or_load_study,
    inspect_storage,
    open_storage,
    queue_lock,
    recovery_lock,
    redact_url,
)


def files_under(root: Path) -> list[Path]:
    return sorted(root.rglob("*"))


def spec_error(url: str, field: str = "study.storage") -> SpecError:
    with pytest.raises(SpecError) as caught:
        check_storage_url(url, field)
    return caught.value


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis://localhost:6379/0", "unknown storage scheme 'redis'"),
        ("study.db", "not a storage URL"),
        ("://x", "not a storage URL"),
        ("oracle://u:p@h/db", "unknown storage scheme 'oracle'"),
        ("sqlite://", "names a host or no file"),
        ("sqlite:///", "names no file"),
        ("sqlite:///:memory:", "in-memory study is lost"),
        ("journal://somehost/study.log", "names a host or no file"),
        ("journal+redis:///study.log", "unknown journal driver 'redis'"),
        ("postgresql+asyncpg://u@h/db", "unsupported postgresql driver 'asyncpg'"),
        ("mysql+aiomysql://u@h/db", "unsupported mysql driver 'aiomysql'"),
    ],
)
def test_bad_scheme_is_a_spec_error_naming_the_field(url: str, reason: str) -> None:
    """Unknown schemes and URLs that name no file are bad input: SpecError (exit 2) naming the field."""
    error = spec_error(url)
    assert error.exit_code == 2
    assert error.field == "study.storage"
    assert str(error).startswith("study.storage: ")
    assert reason in str(error)
    assert "\n" not in str(error)


def test_field_is_the_one_given() -> None:
    """The caller says which field the URL came from (a CLI option, say) and the error names it."""
    error = spec_error("nope://x", field="--storage")
    assert error.field == "--storage"
    assert str(error).startswith("--storage: ")


@pytest.mark.parametrize("scheme", ["sqlite", "journal"])
def test_folder_under_a_regular_file_is_rejected(tmp_path: Path, scheme: str) -> None:
    """A local path whose folder would have to be created inside a regular file cannot work."""
    (tmp_path / "plain").write_text("x")
    error = spec_error(f"{scheme}:///{tmp_path}/plain/sub/study.db")
    assert "it is not a folder" in str(error)
    assert str(tmp_path / "plain") in str(error)


@pytest.mark.parametrize("scheme", ["sqlite", "journal"])
def test_proc_is_rejected(scheme: str) -> None:
    """A path under /proc (a filesystem that holds no files) is rejected, even for root."""
    error = spec_error(f"{scheme}:////proc/autotune-test/study.db")
    assert "/proc" in str(error)


def test_existing_folder_as_the_file_is_rejected(tmp_path: Path) -> None:
    """The storage file must not be an existing folder."""
    assert "is a folder, not a file" in str(spec_error(f"sqlite:///{tmp_path}"))


NOBODY = 65534


@contextlib.contextmanager
def unprivileged() -> Iterator[None]:
    """Act as user nobody (when root: root may write anywhere, so its checks would always pass)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.fixture
def read_only_folder() -> Iterator[Path]:
    """A folder only root may write, with ``existing.db`` (read-only) and ``writable.db`` (writable).

    Anyone may enter it: it is made outside pytest's own temporary folders, which only their owner may.
    """
    folder = Path(tempfile.mkdtemp(prefix="autotune-ro-"))
    (folder / "existing.db").write_text("")
    (folder / "existing.db").chmod(0o444)
    (folder / "writable.db").write_text("")
    (folder / "writable.db").chmod(0o666)
    folder.chmod(0o555)
    try:
        yield folder
    finally:
        folder.chmod(0o755)
        (folder / "existing.db").unlink()
        (folder / "writable.db").unlink()
        folder.rmdir()


@pytest.mark.parametrize("scheme", ["sqlite", "journal"])
def test_folder_without_write_permission_is_rejected(read_only_folder: Path, scheme: str) -> None:
    """A path whose nearest existing folder this user cannot write to is rejected (as nobody if root)."""
    with unprivileged(), pytest.raises(SpecError) as caught:
        check_storage_url(f"{scheme}:///{read_only_folder}/new/study.db")
    assert caught.value.field == "study.storage"
    assert f"folder {str(read_only_folder)!r} is not writable by this user" in str(caught.value)


def test_existing_file_in_a_read_only_folder_is_rejected(read_only_folder: Path) -> None:
    """A writable storage file is not enough: SQLite and the opener also write next to it."""
    with unprivileged(), pytest.raises(SpecError) as caught:
        check_storage_url(f"sqlite:///{read_only_folder}/writable.db")
    assert f"folder {str(read_only_folder)!r} is not writable by this user" in str(caught.value)


def test_existing_file_without_write_permission_is_rejected(read_only_folder: Path) -> None:
    """An existing storage file this user cannot write is rejected."""
    with unprivileged(), pytest.raises(SpecError) as caught:
        check_storage_url(f"sqlite:///{read_only_folder}/existing.db")
    assert f"{str(read_only_folder / 'existing.db')!r} is not writable by this user" in str(caught.value)


@pytest.mark.parametrize("scheme", ["sqlite", "journal"])
def test_check_creates_nothing(tmp_path: Path, scheme: str) -> None:
    """check_storage_url accepts a path in folders yet to be made, and makes none of them (nor a lock)."""
    check_storage_url(f"{scheme}:///{tmp_path}/a/b/c/study.db")
    check_storage_url(f"{scheme}:///{tmp_path}/study.db")
    assert files_under(tmp_path) == []


def test_relative_path_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sqlite:///rel/path is relative to the current folder, as in SQLAlchemy; nothing is created."""
    monkeypatch.chdir(tmp_path)
    check_storage_url("sqlite:///studies/x/study.db?timeout=30")
    check_storage_url("journal:///studies/x/study.log")
    assert files_under(tmp_path) == []


def test_postgres_url_with_an_installed_driver_is_accepted() -> None:
    """postgresql:// and its psycopg spellings pass when psycopg is installed (it is, in dev)."""
    for url in ("postgresql://u:p@h/db", "postgresql+psycopg://u:p@h:5432/db", "POSTGRESQL://h/db"):
        check_storage_url(url)


def test_missing_postgres_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without psycopg or psycopg2 the error says which pip extra installs the driver, password hidden."""
    monkeypatch.setitem(sys.modules, "psycopg", None)  # None in sys.modules makes the import fail
    monkeypatch.setitem(sys.modules, "psycopg2", None)
    message = str(spec_error("postgresql://tuner:hunter2@db.example/studies"))
    assert "install the PostgreSQL driver: pip install 'autotune[postgres]'" in message
    assert "postgresql://tuner:***@db.example/studies" in message
    assert "hunter2" not in message
    message = str(spec_error("postgresql+psycopg2://tuner:hunter2@db.example/studies"))
    assert "pip install psycopg2-binary" in message
    assert "hunter2" not in message


def test_missing_mysql_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """mysql:// without mysqlclient or PyMySQL names the mysql extra."""
    monkeypatch.setitem(sys.modules, "MySQLdb", None)
    monkeypatch.setitem(sys.modules, "pymysql", None)
    message = str(spec_error("mysql://tuner:hunter2@db/studies"))
    assert "pip install 'autotune[mysql]'" in message
    assert "hunter2" not in message


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://tuner:hunter2@db:5432/s", "postgresql://tuner:***@db:5432/s"),
        ("postgresql+psycopg://tuner:hunter2@db/s", "postgresql+psycopg://tuner:***@db/s"),
        ("postgresql://tuner:pa@ss/w:rd@db/s", "postgresql://tuner:***@db/s"),
        ("mysql://tuner:@db/s", "mysql://tuner:***@db/s"),
        (
            "postgresql://db/s?user=t&password=hunter2&sslmode=require",
            "postgresql://db/s?user=t&password=***&sslmode=require",
        ),
        ("postgresql://tuner@db/s", "postgresql://tuner@db/s"),
        ("postgresql://db:5432/s", "postgresql://db:5432/s"),
        ("sqlite:////var/lib/study.db", "sqlite:////var/lib/study.db"),
        ("journal:///x.log", "journal:///x.log"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    """Passwords, in the user part or as a query parameter, become ***; nothing else changes."""
    assert redact_url(url) == shown


def test_unknown_scheme_error_redacts_the_password() -> None:
    """Every message shows the URL with its password redacted."""
    message = str(spec_error("redis://:hunter2@cache:6379/0"))
    assert "hunter2" not in message
    assert "redis://:***@cache:6379/0" in message


@pytest.mark.parametrize("scheme", ["sqlite", "journal"])
def test_open_creates_the_folder_and_the_study_once(tmp_path: Path, scheme: str) -> None:
    """open_storage makes missing folders; the first create_or_load_study creates, the next loads."""
    url = f"{scheme}:///{tmp_path}/deep/er/study.db"
    storage = open_storage(url, heartbeat=True)
    study, created = create_or_load_study(storage, "s", ["maximize", "minimize"], None)
    assert created
    again, created_again = create_or_load_study(
        open_storage(url, heartbeat=True), "s", ["maximize", "minimize"], None
    )
    assert not created_again
    assert again._study_id == study._study_id
    assert (tmp_path / "deep" / "er" / ("study.db" + CREATE_LOCK_SUFFIX)).exists()


def test_other_directions_are_a_study_error(tmp_path: Path) -> None:
    """A stored study with other directions than asked is refused with a StudyError, not loaded."""
    storage = open_storage(f"sqlite:///{tmp_path}/study.db", heartbeat=False)
    create_or_load_study(storage, "s", ["maximize", "minimize"], None)
    with pytest.raises(
        StudyError, match=r"created with directions \['maximize', 'minimize'\].*\['maximize'\]"
    ):
        create_or_load_study(storage, "s", ["maximize"], None)


def test_heartbeat_on_database_storage(tmp_path: Path) -> None:
    """heartbeat=True gives a database storage the heartbeat interval; heartbeat=False gives none."""
    with_beat = open_storage(f"sqlite:///{tmp_path}/a.db", heartbeat=True)
    without = open_storage(f"sqlite:///{tmp_path}/b.db", heartbeat=False)
    assert isinstance(with_beat, optuna.storages.RDBStorage)
    assert with_beat.get_heartbeat_interval() == HEARTBEAT_INTERVAL_S
    assert without.get_heartbeat_interval() is None


def test_journal_storage_has_no_heartbeat(tmp_path: Path) -> None:
    """Optuna's JournalStorage cannot beat: heartbeat=True still opens it, without one."""
    storage = open_storage(f"journal:///{tmp_path}/study.log", heartbeat=True)
    assert isinstance(storage, optuna.storages.JournalStorage)
    assert not hasattr(storage, "get_heartbeat_interval")


def test_not_a_database_is_a_one_line_study_error(tmp_path: Path) -> None:
    """A file that is not SQLite gives a one-line StorageDamagedError naming the URL; it is not written."""
    text = "this is not a database\n" * 100
    (tmp_path / "study.db").write_text(text)
    with pytest.raises(StorageDamagedError) as caught:
        open_storage(f"sqlite:///{tmp_path}/study.db", heartbeat=False)
    message = str(caught.value)
    assert f"sqlite:///{tmp_path}/study.db" in message
    assert "is not an SQLite database" in message
    assert "\n" not in message
    assert (tmp_path / "study.db").read_text() == text


def test_unreachable_server_is_a_study_error_without_the_password() -> None:
    """A database server that refuses the connection gives one line with the password redacted."""
    with pytest.raises(StudyError) as caught:
        open_storage("postgresql://tuner:hunter2@127.0.0.1:1/studies", heartbeat=True)
    message = str(caught.value)
    assert "postgresql://tuner:***@127.0.0.1:1/studies" in message
    assert "hunter2" not in message
    assert "\n" not in message
    assert "check that the database server is running" in message


def test_open_rejects_a_bad_url_as_bad_input() -> None:
    """open_storage checks the URL first: a bad one is a SpecError, and nothing is opened."""
    with pytest.raises(SpecError, match="unknown storage scheme"):
        open_storage("redis://h/0", heartbeat=True)


def test_a_look_at_a_storage_being_created_waits_for_its_creator(tmp_path: Path) -> None:
    """A new SQLite file is empty for a moment while a tuner creates it (under its create lock): another
    tuner's read-only look (``inspect_storage``) waits for it instead of calling the file damaged (seen:
    two tuners started together by `tune --gpus 0,1`). An empty file that no tuner is creating is still
    damaged, and the look creates no lock file."""
    from autotune.store.storage import _file_lock

    path = tmp_path / "study.db"
    url = f"sqlite:///{path}"
    script = (
        "import sys\n"
        "from autotune.store.storage import inspect_storage\n"
        "print(inspect_storage(sys.argv[1], 'q').summary, flush=True)\n"
    )
    with _file_lock(url, path):
        path.write_bytes(b"")  # the creator's first moment: the file exists, still empty
        other = subprocess.Popen(
            [sys.executable, "-c", script, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=1.0)
        optuna.create_study(study_name="q", storage=url)
    out, err = other.communicate(timeout=60)
    assert other.returncode == 0, err
    assert "passes quick_check" in out

    empty = tmp_path / "empty" / "study.db"
    empty.parent.mkdir()
    empty.write_bytes(b"")
    with pytest.raises(StorageDamagedError, match="is empty"):
        inspect_storage(f"sqlite:///{empty}", "q")
    assert sorted(p.name for p in empty.parent.iterdir()) == ["study.db"]


def test_tuners_of_one_host_recover_one_at_a_time(tmp_path: Path) -> None:
    """While one process holds a local storage's recovery lock, another's waits for it (PostgreSQL's:
    tests/integration/test_storage_postgres.py; MySQL takes none)."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    script = (
        "import sys, time\n"
        "from autotune.store.storage import recovery_lock\n"
        "with recovery_lock(sys.argv[1]):\n"
        "    print(time.monotonic(), flush=True)\n"
    )
    with recovery_lock(url):
        other = subprocess.Popen([sys.executable, "-c", script, url], stdout=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=1.0)
        released = time.monotonic()
    out, _ = other.communicate(timeout=30)
    assert float(out) >= released
    assert (tmp_path / "study.db.recover.lock").exists()


TAKER = """
import sys, warnings
import optuna
from autotune.store.storage import queue_lock
optuna.logging.set_verbosity(optuna.logging.ERROR)
warnings.simplefilter("ignore")
url = sys.argv[1]
study = optuna.load_study(study_name="q", storage=url)
while True:
    with queue_lock(url):
        trial = study.ask()
    queued = "fixed_params" in study._storage.get_trial_system_attrs(trial._trial_id)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    if not queued:
        break
    print(trial.number, flush=True)
"""


def test_tuners_of_one_host_take_each_queued_trial_once(tmp_path: Path) -> None:
    """Three processes taking queued trials from one SQLite study at once, each under the queue lock:
    every queued trial is taken by exactly one (without the lock, SQLite let two take the same one, and
    the second to finish it failed with UpdateFinishedTrialError)."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="q", storage=url)
    for k in range(120):
        study.enqueue_trial({"x": k})
    takers = [
        subprocess.Popen([sys.executable, "-c", TAKER, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(3)
    ]  # fmt: skip
    outputs = [p.communicate(timeout=100) for p in takers]
    assert [p.returncode for p in takers] == [0, 0, 0], [err for _, err in outputs]
    taken = [int(line) for out, _ in outputs for line in out.split()]
    assert sorted(taken) == list(range(120))
    assert (tmp_path / "study.db.queue.lock").exists()
    with queue_lock("postgresql://u:p@localhost/db"):
        pass


def test_a_password_is_hidden_where_it_stands_alone_and_only_there() -> None:
    """The driver's words keep the password out, and keep the words that merely contain its letters."""
    from autotune.store.storage import _one_line

    url = "postgresql://tuner:s3cret@db:5432/studies"
    error = RuntimeError('connection to "tuner:s3cret@db" failed: s3crets3cret port 5432 s3cret')
    assert _one_line(error, url) == 'connection to "tuner:***@db" failed: s3crets3cret port 5432 ***'
    short = RuntimeError("connection to server at 127.0.0.1, port 1 failed (user u:p@host)")
    assert _one_line(short, "postgresql://u:p@127.0.0.1:1/x") == (
        "connection to server at 127.0.0.1, port 1 failed (user u:***@host)"
    )
