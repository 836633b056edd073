"""open_storage against a real (private) PostgreSQL server: plain URLs, heartbeats, refused logins."""

from __future__ import annotations

import optuna
import pytest

from autotune.errors import StudyError
from autotune.storage import HEARTBEAT_INTERVAL_S, close_storage, create_or_load_study, open_storage

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
