"""A database outage longer than the lease loses no slice (design.md §8): the first
pass after it extends every live lease by the outage's length. Real broker process;
a real SQLite file locked by another process for the outage, or a real PostgreSQL
server that the broker cannot reach for the outage (its connections go through a
TCP relay that the test cuts, as a failed network or a stopped server would)."""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import _postgres_database
from hubfixtures import wait_until
from servicefixtures import running_service
from sqlalchemy import func, select
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from broker.orm import make_engine
from broker.service.leader import LEADER_LOCK_KEY, PostgresLeaderLock

LEASE = 2.0


def loses_no_slice(service, outage) -> None:
    """A granted, heartbeated slice outlives ``outage`` (a context manager keeping
    the database out of reach) lasting three leases, with its lease extended by the
    first pass after it."""
    alice = service.token("alice")
    made = service.post(
        "/slices", token=alice, json={"project": "vision", "gpus": 1, "kind": "batch"}
    ).json()
    wait_until(
        lambda: service.get(f"/slices/{made['id']}", token=alice).json()["state"] == "granted",
        30,
        "the grant",
    )
    service.post(f"/slices/{made['id']}/heartbeat", token=alice)
    with outage:  # the holder cannot heartbeat and no pass can run
        began = time.monotonic()
        # The outage is the test's subject, not a synchronisation: it must last.
        while time.monotonic() - began < 3 * LEASE:
            time.sleep(0.2)
    outage_ended = time.time()
    wait_until(
        lambda: "extended the leases of 1 live slices" in service.log_text(),
        60,
        "the first pass after the outage",
    )
    after = service.get(f"/slices/{made['id']}", token=alice).json()
    # The first pass after the outage moved the lease past it (it had run out during it).
    assert after["lease_expires_at"] > outage_ended, after
    # So the outage lost nothing: the slice holds on, or — where this read came later
    # than the lease the pass gave back (the holder heartbeats no more) — it ended only
    # once that lease was over.
    if after["state"] != "granted":
        assert after["end_reason"] == "lost" and after["ended_at"] >= after["lease_expires_at"]


@contextlib.contextmanager
def write_locked(path: Path) -> Iterator[None]:
    """Another process holds the SQLite database's write lock."""
    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        lock.execute("ROLLBACK")
        lock.close()


def test_a_database_locked_longer_than_the_lease_loses_no_slice(tmp_path):
    with running_service(tmp_path, lease=LEASE, pass_interval=0.5) as service:
        loses_no_slice(service, write_locked(tmp_path / "broker.sqlite"))


class Relay:
    """A TCP relay to PostgreSQL that can be cut: while cut, every connection through
    it is closed and new ones are closed as soon as they arrive."""

    def __init__(self, port: int):
        self.upstream = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut = threading.Event()
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            if self.cut.is_set():
                client.close()
                continue
            server = socket.create_connection(self.upstream)
            with self.lock:
                self.sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            end.close()

    @contextlib.contextmanager
    def severed(self) -> Iterator[None]:
        """Out of reach while inside."""
        self.sever()
        try:
            yield
        finally:
            self.cut.clear()

    def sever(self) -> None:
        self.cut.set()
        with self.lock:
            for end in self.sockets:
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()
            self.sockets.clear()

    def close(self) -> None:
        self.sever()
        self.listener.close()


@pytest.fixture
def relayed_postgres() -> Iterator[tuple[str, Relay]]:
    """A scratch PostgreSQL database and the URL that reaches it through a relay."""
    for url in _postgres_database():
        real = make_url(url)
        relay = Relay(real.port or 5432)
        try:
            yield real.set(port=relay.port).render_as_string(hide_password=False), relay
        finally:
            relay.close()


def test_a_postgresql_server_away_longer_than_the_lease_loses_no_slice(tmp_path, relayed_postgres):
    url, relay = relayed_postgres
    with running_service(tmp_path, db_url=url, lease=LEASE, pass_interval=0.5) as service:
        loses_no_slice(service, relay.severed())


@pytest.fixture
def scratch_postgres() -> Iterator[str]:
    yield from _postgres_database()


def test_a_leader_whose_lock_session_outlived_its_connection_ends_it_and_leads_again(
    scratch_postgres,
):
    """After a network cut the server may not yet know that the leader's lock session is
    dead: the leader ends that session, its own, and takes the lock back; a session of
    another broker is never ended."""
    url = scratch_postgres
    engine = make_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    stale = engine.connect()  # what the server still holds of the broken connection
    assert stale.scalar(select(func.pg_try_advisory_lock(LEADER_LOCK_KEY)))
    stale_pid = stale.scalar(select(func.pg_backend_pid()))
    other = engine.connect()  # another broker's session, not holding the lock
    other_pid = other.scalar(select(func.pg_backend_pid()))
    try:
        stranger = PostgresLeaderLock(url, timeout=5)
        stranger._backend_pid = other_pid  # its own session was another one
        assert not stranger.try_acquire()  # the holder is not its own: it stands by
        assert stale.scalar(select(1)) == 1  # and the holder's session lives on
        stranger.release()

        leader = PostgresLeaderLock(url, timeout=5)
        leader._backend_pid = stale_pid  # its own session, as the server still sees it
        assert leader.try_acquire()
        assert leader.still_held()
        holder = engine.connect()
        assert not holder.scalar(select(func.pg_try_advisory_lock(LEADER_LOCK_KEY)))
        holder.close()
        leader.release()
    finally:
        for connection in (stale, other):
            with contextlib.suppress(Exception):
                connection.close()
        engine.dispose()


def test_the_lock_of_a_broker_of_another_database_on_the_server_is_not_this_ones(
    scratch_postgres,
):
    """Advisory locks are per database, but pg_locks lists every database's: a broker
    must not take another database's holder for its own lock's holder (two suites, or
    staging and production, on one server), nor end that session as its own."""
    databases = _postgres_database()
    elsewhere = make_engine(next(databases), poolclass=NullPool, isolation_level="AUTOCOMMIT")
    other_broker = elsewhere.connect()
    leader = PostgresLeaderLock(scratch_postgres, timeout=5)
    try:
        assert other_broker.scalar(select(func.pg_try_advisory_lock(LEADER_LOCK_KEY)))
        other_pid = other_broker.scalar(select(func.pg_backend_pid()))
        leader._connection = leader._engine.connect()  # connected, holding nothing yet
        assert leader._holder() is None  # nobody holds this database's lock
        # A leader that took the other broker's session for its own old one leaves it be.
        leader._backend_pid = other_pid
        assert leader.try_acquire()
        assert other_broker.scalar(select(1)) == 1
        leader.release()
    finally:
        with contextlib.suppress(Exception):
            other_broker.close()
        elsewhere.dispose()
        databases.close()  # drops the other database


def test_a_pooled_connection_is_checked_only_after_sitting_idle_and_replaced_if_dead(
    scratch_postgres, monkeypatch
):
    """A connection given back a moment ago is handed out again without a round trip
    to check it (a busy broker gives its connection back between groups); one that sat
    idle longer is checked first, and one whose server session ended meanwhile (a
    restart) is replaced before anyone uses it."""
    engine = make_engine(scratch_postgres)
    pings: list[object] = []
    ping = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping", lambda c: pings.append(c) or ping(c))
    try:
        with engine.connect() as connection:
            first = connection.scalar(select(func.pg_backend_pid()))
        with engine.connect() as connection:
            assert connection.scalar(select(func.pg_backend_pid())) == first
        assert pings == []  # given back a moment ago: handed out unchecked

        killer = make_engine(scratch_postgres, poolclass=NullPool, isolation_level="AUTOCOMMIT")
        with killer.connect() as connection:
            assert connection.scalar(select(func.pg_terminate_backend(first)))
        killer.dispose()
        monkeypatch.setattr("broker.orm.PING_AFTER_IDLE_S", 0.0)  # it has sat idle long enough
        with engine.connect() as connection:
            assert connection.scalar(select(func.pg_backend_pid())) not in (None, first)
        assert len(pings) == 1
    finally:
        engine.dispose()
