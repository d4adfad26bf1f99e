"""One active broker per database: the leader lock, and the standby that waits for it.

A broker serves writes and runs passes only while it holds its database's
leader lock:

- PostgreSQL: a session-level advisory lock (``pg_try_advisory_lock``) held on
  a connection of its own; the server releases it when that connection ends,
  so a leader that dies (even by SIGKILL, or with its host) frees it;
- SQLite: an exclusive ``flock`` on ``<database file>.leader``, which the
  operating system releases when the process ends.

A broker that finds the lock taken is a hot standby: it listens on its port,
answers ``GET {base_url}api/v1/`` and ``GET .../metrics`` with its role, every
other request 503 ``standby`` with ``Retry-After``, and tries the lock every
``standby_poll_interval`` seconds. When it gets it, it opens the database as a
leader does at start (the state is the database's) and serves.

The lock is about who works, not about safety: every write still takes the
database-wide write lock (docs/persistence.md), so two brokers that both
believed they led would take turns, never grant a GPU twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import time
from pathlib import Path
from typing import IO, Any

from sqlalchemy import func, select, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool
from tornado import httputil, web

from .. import __version__
from ..orm import WRITE_LOCK_KEY, make_engine, normalize_url
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

log = logging.getLogger("slicebroker.service")

#: Key of the PostgreSQL advisory lock held by the leader (distinct from the write lock's).
LEADER_LOCK_KEY = WRITE_LOCK_KEY + 1
#: What a standby tells clients to wait before trying again, in seconds.
STANDBY_RETRY_AFTER_S = 1


class LeaderLock:
    """The leader lock of one database. Its methods block: call them off the event loop."""

    def try_acquire(self) -> bool:
        """Take the lock if it is free; whether this broker holds it now."""
        raise NotImplementedError

    def still_held(self) -> bool:
        """Whether the lock taken is still this broker's (``False``: it was lost)."""
        raise NotImplementedError

    def release(self) -> None:
        """Give the lock up (it is also released when the process ends)."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class FileLeaderLock(LeaderLock):
    """An exclusive ``flock`` on ``path``; the OS releases it when the process ends."""

    def __init__(self, path: Path):
        self.path = path
        self._file: IO[bytes] | None = None

    def try_acquire(self) -> bool:
        if self._file is None:
            self._file = open(self.path, "ab")  # noqa: SIM115 - held while leading
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def still_held(self) -> bool:
        return self._file is not None  # a flock lasts as long as the open file

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the file releases the flock
            self._file = None

    def describe(self) -> str:
        return f"file lock {self.path}"


#: How long a leader whose lock connection broke waits, after ending its own old
#: session, for the server to release that session's lock (seconds).
OWN_SESSION_END_S = 5.0


class PostgresLeaderLock(LeaderLock):
    """A session-level advisory lock on a connection kept for it alone.

    When that connection breaks (a network cut), the server may not have noticed yet:
    its session, this broker's own, still holds the lock, and a new connection would
    find it taken as if by another broker. So the lock remembers its session's backend
    pid, and a retake that finds the lock held by exactly that pid ends the old session
    (``pg_terminate_backend``, allowed on one's own sessions) and takes the lock again.
    """

    def __init__(self, url: str, timeout: float | None):
        self._engine = make_engine(
            url, timeout=timeout, poolclass=NullPool, isolation_level="AUTOCOMMIT"
        )
        self._connection: Connection | None = None
        self._backend_pid: int | None = None  # the session holding the lock, once held

    def try_acquire(self) -> bool:
        try:
            if self._connection is None:
                self._connection = self._engine.connect()
            held = self._take()
            if not held and self._backend_pid is not None:
                held = self._end_own_old_session()
            if held:
                self._backend_pid = self._connection.scalar(select(func.pg_backend_pid()))
        except SQLAlchemyError:
            self._drop()  # a new connection next time
            raise
        return held

    def _take(self) -> bool:
        assert self._connection is not None
        return bool(self._connection.scalar(select(func.pg_try_advisory_lock(LEADER_LOCK_KEY))))

    def _holder(self) -> int | None:
        """The backend pid holding this database's leader lock, if any (pg_locks splits a
        bigint key into its high and low 32 bits, and lists every database's locks: a
        broker of another database on the same server holds a lock of the same key)."""
        assert self._connection is not None
        return self._connection.scalar(
            text(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND classid = :high AND objid = :low AND objsubid = 1 AND database = "
                "(SELECT oid FROM pg_database WHERE datname = current_database())"
            ),
            {"high": LEADER_LOCK_KEY >> 32, "low": LEADER_LOCK_KEY & 0xFFFFFFFF},
        )

    def _end_own_old_session(self) -> bool:
        """If the lock is held by this broker's own earlier session, end that session and
        take the lock (within :data:`OWN_SESSION_END_S`); whether it is held now."""
        old = self._backend_pid
        if old is None or self._holder() != old:
            return False  # another broker's: it leads
        log.warning("leader lock: held by this broker's own broken session %s; ending it", old)
        assert self._connection is not None
        self._connection.scalar(select(func.pg_terminate_backend(old)))
        deadline = time.monotonic() + OWN_SESSION_END_S
        while time.monotonic() < deadline:
            if self._take():
                return True
            time.sleep(0.05)  # the old backend is exiting; its locks go with it
        return False

    def still_held(self) -> bool:
        # The lock lives as long as the session: a live connection still holds it.
        if self._connection is None:
            return False
        try:
            self._connection.execute(text("SELECT 1"))
        except SQLAlchemyError:
            self._drop()
            return False
        return True

    def release(self) -> None:
        self._drop()
        self._backend_pid = None  # given up: no session of this broker holds it
        self._engine.dispose()

    def _drop(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(SQLAlchemyError):
                self._connection.close()
            self._connection = None

    def describe(self) -> str:
        return f"PostgreSQL advisory lock {LEADER_LOCK_KEY}"


class NoLeaderLock(LeaderLock):
    """For a database no other process can open (SQLite in memory): always held."""

    def try_acquire(self) -> bool:
        return True

    def still_held(self) -> bool:
        return True

    def release(self) -> None:
        pass

    def describe(self) -> str:
        return "no lock (a private database)"


def leader_lock(db_url: str, timeout: float | None = None) -> LeaderLock:
    """The leader lock for the database at ``db_url``; ``timeout`` bounds a PostgreSQL
    connection's wait (see :func:`~broker.orm.make_engine`)."""
    url = make_url(normalize_url(db_url))
    if url.get_backend_name() != "sqlite":
        return PostgresLeaderLock(url.render_as_string(hide_password=False), timeout)
    if not url.database or url.database == ":memory:":
        return NoLeaderLock()
    return FileLeaderLock(Path(url.database + ".leader").absolute())


class Leadership:
    """Waits for the leader lock (:meth:`acquire`), then watches it (:meth:`watch`).

    ``role`` is ``standby`` until the lock is held, then ``leader``.
    """

    def __init__(self, lock: LeaderLock, poll_interval: float):
        self.lock = lock
        self.poll_interval = poll_interval
        self.role = "standby"
        self.waited_s = 0.0
        self._last_error = ""

    def _warn(self, err: Exception) -> None:
        """Log why the lock could not be tried: once per distinct reason, not per poll."""
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if reason != self._last_error:
            log.warning("leader lock: %s", reason)
            self._last_error = reason

    async def _try(self) -> bool:
        try:
            return await asyncio.to_thread(self.lock.try_acquire)
        except (OSError, SQLAlchemyError) as err:
            self._warn(err)
            return False

    async def try_acquire(self) -> bool:
        """One try; whether this broker leads now. Raises ``OSError`` or
        ``SQLAlchemyError`` when the lock cannot be tried (no database)."""
        if await asyncio.to_thread(self.lock.try_acquire):
            self.role = "leader"
        return self.role == "leader"

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait as a standby until the lock is held (``True``) or ``stop`` is set."""
        started = time.monotonic()
        log.info("standby: waiting for the leader lock (%s)", self.lock.describe())
        while not await self._try():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval):
                    await stop.wait()
            if stop.is_set():
                return False
        self.role = "leader"
        self.waited_s = time.monotonic() - started
        log.info("leader: got the leader lock after %.1f s; opening the database", self.waited_s)
        return True

    async def watch(self, lost: asyncio.Event) -> None:
        """While leading, check the lock every poll interval; set ``lost`` if another
        broker took it (a PostgreSQL leader whose lock connection broke tries to take
        the lock again on a new one, and keeps leading if it gets it)."""
        while True:
            await asyncio.sleep(self.poll_interval)
            if await asyncio.to_thread(self.lock.still_held):
                continue
            log.warning("leader: the leader lock's connection broke; taking the lock again")
            if not await self._retake():
                log.error("leader: another broker holds the leader lock now; stopping")
                self.role = "standby"
                lost.set()
                return

    async def _retake(self) -> bool:
        """Take the lock again after its connection broke, waiting out a database that
        is away; whether this broker got it (``False``: another broker holds it)."""
        while True:
            try:
                return await asyncio.to_thread(self.lock.try_acquire)
            except (OSError, SQLAlchemyError) as err:
                self._warn(err)
                await asyncio.sleep(self.poll_interval)

    async def release(self) -> None:
        await asyncio.to_thread(self.lock.release)


class AppSwitch(httputil.HTTPServerConnectionDelegate):
    """The server's application, exchangeable while it serves: the standby's, then the
    leader's. Requests go to the application current when they arrive."""

    def __init__(self, app: web.Application):
        self.app = app

    @property
    def settings(self) -> dict[str, Any]:
        return self.app.settings

    def start_request(
        self, server_conn: object, request_conn: httputil.HTTPConnection
    ) -> httputil.HTTPMessageDelegate:
        return self.app.start_request(server_conn, request_conn)

    def on_close(self, server_conn: object) -> None:
        self.app.on_close(server_conn)


class StandbyHandler(web.RequestHandler):
    """Every request to a standby: its role at the API root and /metrics, else 503."""

    def initialize(self, api_prefix: str, leadership: Leadership) -> None:
        self.api_prefix = api_prefix
        self.leadership = leadership

    def prepare(self) -> None:
        path = self.request.path
        # The path under the API root ("" for the root itself), None outside the API.
        under_api = (
            path[len(self.api_prefix) :].rstrip("/") if path.startswith(self.api_prefix) else None
        )
        self.set_header("Cache-Control", "no-store")
        role = self.leadership.role
        if self.request.method == "GET" and under_api == "":
            self.set_header("Content-Type", "application/json; charset=UTF-8")
            self.finish(json.dumps({"version": __version__, "api": "v1", "role": role}))
        elif self.request.method == "GET" and under_api == "/metrics":
            self.set_header("Content-Type", METRICS_CONTENT_TYPE)  # the leader's, too
            self.finish(
                "# HELP slicebroker_leader Whether this broker holds the leader lock "
                "(1) or waits as a standby (0); a standby exports only this.\n"
                "# TYPE slicebroker_leader gauge\n"
                f"slicebroker_leader {int(role == 'leader')}\n"
            )
        else:
            self.set_status(503)
            self.set_header("Content-Type", "application/json; charset=UTF-8")
            self.set_header("Retry-After", str(STANDBY_RETRY_AFTER_S))
            message = "this broker is a standby; another broker leads (try again shortly)"
            self.finish(json.dumps({"error": {"code": "standby", "message": message}}))


def standby_app(base_url: str, leadership: Leadership, settings: dict[str, Any]) -> web.Application:
    """The application a standby serves: :class:`StandbyHandler` for every path."""
    prefix = base_url.rstrip("/") + "/api/v1"
    return web.Application(
        [(r".*", StandbyHandler, {"api_prefix": prefix, "leadership": leadership})],
        **settings,
    )
