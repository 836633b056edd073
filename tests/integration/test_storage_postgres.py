"""open_storage against a real (private) PostgreSQL server: plain URLs, heartbeats, refused logins."""

from __future__ import annotations

import subprocess
import sys
import time

import optuna
import pytest

from autotune.errors import StudyError
from autotune.store.storage import (
    HEARTBEAT_INTERVAL_S,
    close_storage,
    create_or_load_study,
    inspect_storage,
    open_storage,
    recovery_lock,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_plain_postgresql_url_opens_with_heartbeat(postgres_url: str) -> None:
    """A plain postgresql:// URL opens with the installed driver, beats, and keeps a study across opens."""
    assert postgres_url.startswith("postgresql://")
    storage = open_storage(postgres_url, heartbeat=True)
    try:
        assert isinstance(storage, optuna.storages.RDBStorage)
        assert storage.get_heartbeat_interval() == HEARTBEAT_INTERVAL_S
        study, created = create_or_load_study(storage, "plain-url", ["maximize"], None)
        study.add_trial(optuna.trial.create_trial(values=[1.5]))
    finally:
        close_storage(storage)
    assert created
    storage = open_storage(postgres_url, heartbeat=False)
    try:
        again, created = create_or_load_study(storage, "plain-url", ["maximize"], None)
        assert not created
        assert [t.values for t in again.get_trials()] == [[1.5]]
    finally:
        close_storage(storage)


def test_wrong_password_is_one_line_without_it(postgres_url: str) -> None:
    """A refused login gives one line naming the URL with the password hidden, and what to check."""
    scheme, _, rest = postgres_url.partition("://")
    user_part, _, where = rest.partition("@")
    user = user_part.split(":", 1)[0]
    url = f"{scheme}://{user}:not-the-password@{where}"
    with pytest.raises(StudyError) as caught:
        open_storage(url, heartbeat=True)
    message = str(caught.value)
    assert "not-the-password" not in message
    assert f"{scheme}://{user}:***@{where}" in message
    assert "password authentication failed" in message
    assert "\n" not in message


def _tables(url: str) -> list[str]:
    """The tables of the database at ``url`` (read through SQLAlchemy, outside autotune)."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        return sorted(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_inspect_reads_a_database_without_writing_to_it(new_postgres_url: str) -> None:
    """inspect_storage (what `autotune validate` shows) reaches an empty database and creates nothing in
    it; once a study is stored, it counts the study's trials, and a missing study is None."""
    facts = inspect_storage(new_postgres_url, "inspected")
    assert facts.trials is None and "without Optuna's tables" in facts.summary
    assert _tables(new_postgres_url) == []
    storage = open_storage(new_postgres_url, heartbeat=False)
    try:
        study, _ = create_or_load_study(storage, "inspected", ["maximize"], None)
        study.add_trial(optuna.trial.create_trial(values=[1.0]))
        study.add_trial(optuna.trial.create_trial(values=[2.0]))
    finally:
        close_storage(storage)
    assert inspect_storage(new_postgres_url, "inspected").trials == 2
    assert inspect_storage(new_postgres_url, "other").trials is None


def test_inspect_of_a_refused_login_is_one_line_without_the_password(postgres_url: str) -> None:
    """A wrong password: one StudyError line, password hidden, within the connect timeout."""
    scheme, _, rest = postgres_url.partition("://")
    user, _, where = rest.partition("@")
    url = f"{scheme}://{user.split(':', 1)[0]}:not-the-password@{where}"
    with pytest.raises(StudyError) as caught:
        inspect_storage(url, "s", timeout_s=5)
    message = str(caught.value)
    assert "not-the-password" not in message and "\n" not in message
    assert message.startswith("cannot reach storage ") and "password authentication failed" in message


def test_tuners_on_any_host_recover_one_at_a_time(postgres_url: str) -> None:
    """While one process holds the recovery lock of a PostgreSQL storage (an advisory lock on the server,
    so tuners of several hosts take it in turn), another's waits for it; a process that dies holding it
    loses it."""
    script = (
        "import sys, time\n"
        "from autotune.store.storage import recovery_lock\n"
        "with recovery_lock(sys.argv[1]):\n"
        "    print(time.monotonic(), flush=True)\n"
    )
    with recovery_lock(postgres_url):
        other = subprocess.Popen(
            [sys.executable, "-c", script, postgres_url], stdout=subprocess.PIPE, text=True
        )
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=2.0)
        released = time.monotonic()
    out, _ = other.communicate(timeout=30)
    assert float(out) >= released

    with subprocess.Popen(
        [sys.executable, "-c", script + "    time.sleep(600)\n", postgres_url],
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdout is not None and holder.stdout.readline()  # it holds the lock now
        holder.kill()
    with recovery_lock(postgres_url):  # the server released it with the dead process's connection
        pass
