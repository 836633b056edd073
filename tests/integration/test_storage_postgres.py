"""open_storage against a real (private) PostgreSQL server: plain URLs, heartbeats, refused logins."""

from __future__ import annotations

import optuna
import pytest

from autotune.errors import StudyError
from autotune.storage import (
    HEARTBEAT_INTERVAL_S,
    close_storage,
    create_or_load_study,
    inspect_storage,
    open_storage,
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
