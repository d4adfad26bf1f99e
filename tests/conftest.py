"""Shared fixtures: a fresh database on every supported backend, a clock tests move, and
a browser (Playwright on the system Chromium) with a place for its screenshots.

``db_url`` runs each test that uses it twice: on a SQLite file and on a fresh
PostgreSQL database (created with a random name, dropped afterwards). The
PostgreSQL server comes from ``SLICEBROKER_TEST_POSTGRES`` (a URL of a database
the user may create databases from; default: local ``postgres`` with trust
auth); where none answers, the PostgreSQL case is skipped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from broker.orm import ScratchDatabaseUnavailable, scratch_database

if TYPE_CHECKING:
    from playwright.sync_api import Browser

#: The system Chromium (Playwright's own download is not used).
CHROMIUM = "/usr/bin/chromium"


class FakeClock:
    """A clock that stands still until a test moves it: pass it wherever a clock goes."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture(autouse=True)
def _service_loggers_restored() -> Iterator[None]:
    """Put the service's loggers back as they were after each test.

    A ``BrokerApp`` built in a test configures them (traitlets' logging config) with a
    handler on that test's captured stderr; a later test in the same worker would log
    to that closed stream ("--- Logging error ---" on a CLI's stderr).
    """
    from broker.service.app import LOGGERS

    saved = {}
    for name in LOGGERS:
        logger = logging.getLogger(name)
        saved[name] = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """A headless Chromium for the module's tests."""
    from playwright.sync_api import expect, sync_playwright  # only the browser tests need it

    # What a page shows after a pass may take seconds on a loaded two-core machine running
    # the suite on several workers: assertions wait up to 20 s (5 s by default) for it.
    expect.set_options(timeout=20_000)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--headless", "--disable-gpu"]
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: $SLICEBROKER_SCREENSHOTS (``docs/screenshots`` refreshes the
    documentation's), else a temporary directory."""
    where = os.environ.get("SLICEBROKER_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


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


#: The modules that take longest (a minute or more on two cores, waits included), longest
#: first. The suite runs on several workers, a module to a worker (``--dist loadfile``);
#: a long module handed out last would run on alone after the rest, so these go first.
SLOWEST_MODULES = (
    "test_service_crash.py",
    "test_lab_extension_browser.py",
    "test_spawner_jupyterhub.py",
    "test_api_schema.py",
    "test_service_failover.py",
    "test_service_outage.py",
    "test_properties.py",
    "test_store.py",
    "test_e2e_hub.py",
    "test_slurm_spawner.py",
    "test_lab_extension_server.py",
    "test_incremental_pass.py",
    "test_edge_batch_faults.py",
    "test_ops_backup.py",
    "test_ops_upgrade.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the slowest modules first, in the order above; the rest keep theirs."""
    rank = {name: index for index, name in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """Under CI every skip is a failure: CI installs every prerequisite, so a skip hides one."""
    report = yield
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under CI, which must run every test: {reason}"
    return report
