"""Shared fixtures: a fresh database on every supported backend, and a clock tests move.

``db_url`` runs each test that uses it twice: on a SQLite file and on a fresh
PostgreSQL database (created with a random name, dropped afterwards). The
PostgreSQL server comes from ``SLICEBROKER_TEST_POSTGRES`` (a URL of a database
the user may create databases from; default: local ``postgres`` with trust
auth); where none answers, the PostgreSQL case is skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from broker.orm import ScratchDatabaseUnavailable, scratch_database


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
    try:
        with scratch_database("slicebroker_test") as url:
            yield url
    except ScratchDatabaseUnavailable as err:  # no server here: run the SQLite case only
        if os.environ.get("CI"):  # CI starts PostgreSQL: a skip there would hide a failure
            pytest.fail(str(err))
        pytest.skip(str(err))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """Under CI every skip is a failure: CI installs every prerequisite, so a skip hides one."""
    report = yield
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under CI, which must run every test: {reason}"
    return report
