"""Fixtures shared by all tests: a private PostgreSQL server (see tests/pg.py), started on first use."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest

from .pg import PostgresServer, PostgresUnavailableError, running_postgres

_database_numbers = itertools.count()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A private PostgreSQL server for the session; skips with the reason when it cannot be had."""
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(running_postgres())
        except PostgresUnavailableError as exc:
            pytest.skip(str(exc))
        yield server


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """A ``postgresql://`` URL of a database created for this session (shared by its tests)."""
    return postgres_server.create_database("autotune")


@pytest.fixture
def new_postgres_url(postgres_server: PostgresServer) -> str:
    """A ``postgresql://`` URL of a new, empty database for one test."""
    return postgres_server.create_database(f"autotune_{next(_database_numbers)}")
