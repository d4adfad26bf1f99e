"""Persistence, all in one place: table models, the engine factory, migrations, schema check.

Only :mod:`broker.store` opens sessions on these models; the scheduler and the
accounting code never see them. Times are seconds since the epoch (floats),
as everywhere in the broker.
"""

from __future__ import annotations

import math
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    CheckConstraint,
    Engine,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    create_engine,
    event,
    func,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

MIGRATIONS_DIR = Path(__file__).parent / "migrations"

#: The command that brings a database up to date; named in every schema error.
UPGRADE_COMMAND = "slicebroker upgrade-db"

#: SQLite waits this long for another writer before failing with "database is locked",
#: unless :func:`make_engine` is given a ``timeout``.
SQLITE_BUSY_TIMEOUT_S = 30.0

#: Key of the PostgreSQL advisory lock serialising the broker's writers.
WRITE_LOCK_KEY = 0x5B_B0_0C  # "slicebroker"; any constant shared by all processes works

#: Who drained a node (``NodeRow.drained_by``): an admin, whose drain holds until an
#: admin puts the node back in service, or the live inventory (a Kubernetes cordon),
#: whose drain the inventory undoes.
DRAINED_BY_ADMIN = "admin"
DRAINED_BY_INVENTORY = "inventory"
DRAIN_ORIGINS = (DRAINED_BY_ADMIN, DRAINED_BY_INVENTORY)

#: What a project event records: the tree seeded from the cluster file on the
#: first start, an admin's change of one account, the cluster file applied on
#: purpose (``slicebroker apply-config``), an account deleted.
PROJECT_ACTIONS = ("seed", "set", "apply", "delete")

#: Execution option marking a connection whose transactions only read.
READ_ONLY_OPTION = "slicebroker_read_only"
#: Execution option marking a connection whose write transactions need not survive a
#: power loss or an operating-system crash (they stay atomic): SQLite commits them
#: without an ``fsync`` (``synchronous=NORMAL`` in WAL mode), PostgreSQL with
#: ``synchronous_commit off``. The next durable commit makes them durable too.
NOT_DURABLE_OPTION = "slicebroker_not_durable"


# ---- errors ---------------------------------------------------------------------


class DatabaseSchemaError(Exception):
    """The database schema does not match this version of slicebroker.

    ``current`` is the database's revision (``None``: never migrated),
    ``expected`` the code's; ``fix`` is what the admin should do.
    """

    def __init__(self, message: str, *, current: str | None, expected: str, fix: str):
        super().__init__(f"{message} {fix}")
        self.current = current
        self.expected = expected
        self.fix = fix


class DatabaseNotInitialized(DatabaseSchemaError):
    """The database has no slicebroker schema at all."""


class DatabaseOutOfDate(DatabaseSchemaError):
    """The database is older than the code: run ``slicebroker upgrade-db``."""


class DatabaseTooNew(DatabaseSchemaError):
    """The database was migrated by a newer slicebroker than this one."""


# ---- models -----------------------------------------------------------------------

# Named constraints keep migrations reproducible on every backend.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    # Float is double precision on both backends: epoch seconds need 53 bits.
    type_annotation_map = {float: Float(), str: String(255)}


class AccountRow(Base):
    """An account of the project tree (design.md §2); leaves are projects."""

    __tablename__ = "accounts"

    name: Mapped[str] = mapped_column(primary_key=True)
    parent: Mapped[str | None]
    share: Mapped[float] = mapped_column(default=1.0)


class MemberRow(Base):
    """A user or a JupyterHub group allowed to charge a project."""

    __tablename__ = "members"
    __table_args__ = (
        UniqueConstraint("project", "kind", "name"),
        CheckConstraint("kind IN ('user', 'group')", name="kind"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    project: Mapped[str] = mapped_column(ForeignKey("accounts.name", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(8))
    name: Mapped[str]


class GpuTypeRow(Base):
    """Cost units per GPU-second of a GPU type."""

    __tablename__ = "gpu_types"

    name: Mapped[str] = mapped_column(primary_key=True)
    weight: Mapped[float] = mapped_column(default=1.0)


class NodeRow(Base):
    """A node and its admin- or scheduler-set state (design.md §6).

    ``in_config`` is false for a node that left the configuration file: it is
    kept (down) so that history and running slices still resolve.
    ``drained_by`` says who took the node out of service (one of
    :data:`DRAIN_ORIGINS`), ``None`` when nobody did.
    """

    __tablename__ = "nodes"
    __table_args__ = (CheckConstraint("drained_by IN ('admin', 'inventory')", name="drained_by"),)

    name: Mapped[str] = mapped_column(primary_key=True)
    gpu_type: Mapped[str]
    gpu_count: Mapped[int]
    state: Mapped[str] = mapped_column(String(16), default="ready")
    state_changed_at: Mapped[float | None]
    state_reason: Mapped[str] = mapped_column(String(1024), default="")
    in_config: Mapped[bool] = mapped_column(default=True)
    drained_by: Mapped[str | None] = mapped_column(String(16))


class SliceRow(Base):
    """A slice: request, contract, and (once granted) what it holds.

    ``placements``/``promised`` are JSON lists of ``{"node", "gpu_indices"}``.
    ``queue_position``/``fairshare_value``/``estimated_start`` are written by
    the last scheduling pass for pending slices, so every process shows them.
    """

    __tablename__ = "slices"
    __table_args__ = (
        Index(None, "state"),
        Index(None, "project"),
        Index(None, "user"),
        # One slice per user and Idempotency-Key: a retried submission finds the first.
        UniqueConstraint("user", "idempotency_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    project: Mapped[str]
    user: Mapped[str]
    gpus: Mapped[int]
    gpu_type: Mapped[str | None]
    kind: Mapped[str] = mapped_column(String(16))
    min_runtime: Mapped[float]
    resumable: Mapped[bool] = mapped_column(default=False)
    max_runtime: Mapped[float | None]
    priority: Mapped[int] = mapped_column(default=0)
    submitted_at: Mapped[float]
    state: Mapped[str] = mapped_column(String(16), default="pending")
    placements: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    granted_at: Mapped[float | None]
    preempt_deadline: Mapped[float | None]
    preempt_reason: Mapped[str | None] = mapped_column(String(32))
    promised: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    lease_expires_at: Mapped[float | None]
    #: Times preempted so far, and when it last went back to the queue (design.md §5.7).
    preemptions: Mapped[int] = mapped_column(default=0, server_default="0")
    queued_at: Mapped[float | None]
    #: The holder's last reported checkpoint: work before it is not lost to a preemption.
    checkpointed_at: Mapped[float | None]
    #: The slice that took its place when it was replaced while waiting (design.md §5.8).
    replaced_by: Mapped[int | None]
    ended_at: Mapped[float | None]
    end_reason: Mapped[str | None] = mapped_column(String(32))
    charged_gpu_seconds: Mapped[float] = mapped_column(default=0.0)
    queue_position: Mapped[int | None]
    fairshare_value: Mapped[float | None]
    estimated_start: Mapped[float | None]
    #: The Idempotency-Key the submission came with, and a digest of what it asked for.
    idempotency_key: Mapped[str | None]
    request_digest: Mapped[str | None] = mapped_column(String(64))


class SliceEventRow(Base):
    """One state transition of a slice (``from_state`` is ``None`` on submission)."""

    __tablename__ = "slice_events"
    __table_args__ = (Index(None, "slice_id"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    slice_id: Mapped[int] = mapped_column(ForeignKey("slices.id"))
    at: Mapped[float]
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(String(1024), default="")


class LedgerRow(Base):
    """Append-only charges: one row per held interval of an allocated slice.

    ``gpu_seconds`` is weighted (``gpus × weight × (end - start)``); ``weight``
    is the mean weight of the GPUs held. Never updated, never deleted.
    """

    __tablename__ = "ledger"
    __table_args__ = (Index(None, "end"), Index(None, "project", "end"))

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    slice_id: Mapped[int] = mapped_column(ForeignKey("slices.id"))
    project: Mapped[str]
    user: Mapped[str]
    start: Mapped[float]
    end: Mapped[float]
    gpus: Mapped[int]
    weight: Mapped[float]
    gpu_seconds: Mapped[float]


class BrokerAliveRow(Base):
    """When a broker last ran a pass (one row, ``id`` 1): how long the brokers
    were away, for the leases (design.md §8)."""

    __tablename__ = "broker_alive"

    id: Mapped[int] = mapped_column(primary_key=True)
    alive_at: Mapped[float]


class ProjectEventRow(Base):
    """One change of the project tree: an account created, changed or deleted.

    ``before``/``after`` are the account's ``{"share", "parent", "users", "groups"}``
    (``None`` where it did not exist); ``who`` is the admin who made the change,
    or the cluster file that seeded the tree; ``action`` is one of
    :data:`PROJECT_ACTIONS`. Never updated, never deleted.
    """

    __tablename__ = "project_events"
    __table_args__ = (Index(None, "account"), Index(None, "at"))

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    account: Mapped[str]
    who: Mapped[str]
    at: Mapped[float]
    action: Mapped[str] = mapped_column(String(16))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class ApiTokenRow(Base):
    """The broker's own API tokens (standalone mode); only a hash is stored."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    user: Mapped[str]
    hashed: Mapped[str] = mapped_column(String(255), unique=True)
    admin: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[float]


# ---- engine -----------------------------------------------------------------------


def normalize_url(url: str) -> str:
    """Accept ``postgresql://``/``postgres://`` and use the psycopg 3 driver for them."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


#: Where tests and benchmarks create scratch databases: a PostgreSQL role allowed to.
SCRATCH_POSTGRES_URL = os.environ.get(
    "SLICEBROKER_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


class ScratchDatabaseUnavailable(Exception):
    """No scratch database could be created (no server here, or no right to)."""


@contextmanager
def scratch_database(prefix: str, admin_url: str = SCRATCH_POSTGRES_URL) -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database named ``prefix_<random>``, for a
    test or benchmark; dropped afterwards. Raises :class:`ScratchDatabaseUnavailable`."""
    admin = create_engine(normalize_url(admin_url), isolation_level="AUTOCOMMIT")
    name = f"{prefix}_{secrets.token_hex(6)}"
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as err:
        admin.dispose()
        raise ScratchDatabaseUnavailable(
            f"PostgreSQL not available: {type(err).__name__}: {str(err).splitlines()[0]}"
        ) from None
    try:
        yield (
            make_url(normalize_url(admin_url))
            .set(database=name)
            .render_as_string(hide_password=False)
        )
    finally:
        with admin.connect() as connection:
            # FORCE: a failed run may leave a connection open.
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def make_engine(url: str, *, timeout: float | None = None, **kwargs: Any) -> Engine:
    """An engine for ``url`` set up for the broker.

    SQLite: WAL (readers do not block the writer), foreign keys on, a busy
    timeout, and SQLAlchemy emitting ``BEGIN IMMEDIATE`` itself so that a
    write transaction holds the write lock from its first statement — two
    processes can then never both read free GPUs and both grant them.
    Connections carrying :data:`READ_ONLY_OPTION` begin deferred instead.
    PostgreSQL: psycopg 3, connections checked before use once they sat idle in
    the pool (:data:`PING_AFTER_IDLE_S`).

    ``timeout`` (seconds) bounds how long one statement may wait for the
    database: SQLite's busy timeout (default :data:`SQLITE_BUSY_TIMEOUT_S`);
    on PostgreSQL the connect timeout and ``statement_timeout`` (default: none),
    which also bounds waits for locks. A statement past it fails with
    ``OperationalError``, which the API answers 503.
    """
    url = normalize_url(url)
    if make_url(url).get_backend_name() != "sqlite":
        if timeout is not None:
            # libpq counts whole seconds (at least 2); the server cancels a statement
            # past statement_timeout, lock waits included.
            connect_args = {
                "connect_timeout": max(2, math.ceil(timeout)),
                "options": f"-c statement_timeout={max(1, round(timeout * 1000))}",
                **kwargs.pop("connect_args", {}),
            }
            kwargs["connect_args"] = connect_args
        engine = create_engine(url, **kwargs)
        _ping_when_idle(engine)
        return engine

    busy_timeout = SQLITE_BUSY_TIMEOUT_S if timeout is None else timeout
    connect_args = {"timeout": busy_timeout, **kwargs.pop("connect_args", {})}
    engine = create_engine(url, connect_args=connect_args, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take BEGIN away from the sqlite3 module, which would defer it.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        options = connection.get_execution_options()
        if options.get(READ_ONLY_OPTION, False):
            connection.exec_driver_sql("BEGIN")
            return
        # The safety level cannot change inside a transaction: set it before
        # BEGIN, and only when it differs from the connection's last one.
        synchronous = "NORMAL" if options.get(NOT_DURABLE_OPTION, False) else "FULL"
        info = connection.connection.info
        if info.get("synchronous") != synchronous:
            connection.exec_driver_sql(f"PRAGMA synchronous={synchronous}")
            info["synchronous"] = synchronous
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


#: A pooled PostgreSQL connection idle longer than this (seconds) is checked before
#: use. A busy broker's connection goes back to the pool for a moment between
#: groups; a check each time was a round trip per group.
PING_AFTER_IDLE_S = 1.0


def _ping_when_idle(engine: Any) -> None:
    """Check a connection that sat idle in the pool before handing it out (the
    database may have restarted meanwhile): a dead one is replaced, as
    ``pool_pre_ping`` would, without a round trip for one just given back. One
    that breaks in use fails its transaction, and the pool drops its siblings."""

    @event.listens_for(engine, "checkin")
    def _given_back(_dbapi_connection: Any, record: Any) -> None:
        record.info["given_back_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _handed_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        given_back = record.info.get("given_back_at")
        if given_back is None or time.monotonic() - given_back <= PING_AFTER_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as err:
            raise DisconnectionError("connection closed while idle") from err  # the pool retries


def take_write_lock(connection: Any) -> None:
    """Serialise writers on PostgreSQL until the transaction ends (a write that may
    be lost also stops waiting for its commit to reach the disk, in the same round
    trip).

    SQLite needs nothing here: its ``BEGIN IMMEDIATE`` already holds the lock.
    """
    if connection.dialect.name == "postgresql":
        asked = [func.pg_advisory_xact_lock(WRITE_LOCK_KEY)]
        if connection.get_execution_options().get(NOT_DURABLE_OPTION, False):
            asked.append(func.set_config("synchronous_commit", "off", True))  # SET LOCAL
        connection.execute(select(*asked))


# ---- migrations -----------------------------------------------------------------


def _alembic_config(connection: Any = None) -> Any:
    from alembic.config import Config

    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        # env.py runs on this connection, inside the caller's transaction.
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The schema revision this code expects."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None, "the migrations have no head"
    return head


def migrate(engine: Engine, revision: str = "head") -> None:
    """Migrate the database behind ``engine`` to ``revision``.

    The whole upgrade runs in one transaction holding the broker's write lock,
    so two processes starting on a fresh database do not both create it.
    """
    from alembic import command

    with engine.begin() as connection:
        take_write_lock(connection)
        if connection.dialect.name == "postgresql":
            # A migration may rewrite a large table: no statement timeout for it.
            connection.exec_driver_sql("SET LOCAL statement_timeout = 0")
        command.upgrade(_alembic_config(connection), revision)


def upgrade_db(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` to ``revision``: what ``slicebroker upgrade-db`` runs."""
    engine = make_engine(url)
    try:
        migrate(engine, revision)
    finally:
        engine.dispose()


def current_revision(engine: Engine) -> str | None:
    """The database's schema revision, ``None`` when it was never migrated."""
    from alembic.migration import MigrationContext

    with engine.connect().execution_options(**{READ_ONLY_OPTION: True}) as connection:
        heads = MigrationContext.configure(connection).get_current_heads()
    return heads[0] if heads else None


def is_blank(engine: Engine) -> bool:
    """Whether the database holds no tables at all (safe to initialise)."""
    with engine.connect().execution_options(**{READ_ONLY_OPTION: True}) as connection:
        return not inspect(connection).get_table_names()


def check_schema(engine: Engine) -> None:
    """Raise a :class:`DatabaseSchemaError` unless the database is at this code's revision."""
    from alembic.script import ScriptDirectory

    expected = head_revision()
    current = current_revision(engine)
    if current == expected:
        return
    url = engine.url.render_as_string(hide_password=True)
    if current is None:
        raise DatabaseNotInitialized(
            f"The database {url} has no slicebroker schema.",
            current=None,
            expected=expected,
            fix=f"Run `{UPGRADE_COMMAND}` to create it.",
        )
    known = {
        rev.revision for rev in ScriptDirectory.from_config(_alembic_config()).walk_revisions()
    }
    if current in known:
        raise DatabaseOutOfDate(
            f"The database {url} is at schema revision {current}, older than this "
            f"slicebroker's {expected}.",
            current=current,
            expected=expected,
            fix=f"Back it up, then run `{UPGRADE_COMMAND}`.",
        )
    raise DatabaseTooNew(
        f"The database {url} is at schema revision {current}, unknown to this slicebroker "
        f"(which expects {expected}); a newer slicebroker migrated it.",
        current=current,
        expected=expected,
        fix="Upgrade the slicebroker package, or restore a backup made before the upgrade.",
    )
