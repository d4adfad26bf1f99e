"""Shared fixtures: a fresh database on every supported backend, and a clock tests move.

``db_url`` runs each test that uses it twice: on a SQLite file and on a fresh
PostgreSQL database (created with a random name, dropped afterwards). The
PostgreSQL server comes from ``SLICEBROKER_TEST_POSTGRES`` (a URL of a database
the user may create databases from; default: local ``postgres`` with trust
auth); where none answers, the PostgreSQL case is skipped.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

POSTGRES_ADMIN_URL = os.environ.get(
    "SLICEBROKER_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


class FakeClock:
    """A clock that stands still until a test moves it: pass it wherever a clock goes."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """The URL of an empty database, one per test and backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'broker.sqlite'}"
        return
    yield from _postgres_database()


def _postgres_database() -> Iterator[str]:
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"slicebroker_test_{secrets.token_hex(6)}"
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as err:  # no server here: run the SQLite case only
        admin.dispose()
        if os.environ.get("CI"):  # CI starts PostgreSQL: a skip there would hide a failure
            pytest.fail(f"PostgreSQL not available in CI: {err}")
        pytest.skip(f"PostgreSQL not available: {err.__class__.__name__}")
    try:
        yield make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            # FORCE: a test that failed may leave a connection open.
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
