"""Alembic environment for slicebroker.

Run programmatically by :func:`broker.orm.upgrade_db`, which hands over a
connection inside its own locked transaction; or by the ``alembic`` command
with ``-x url=...`` (or ``SLICEBROKER_DB_URL``).
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context

from broker.orm import Base, make_engine, normalize_url, take_write_lock

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or os.environ.get(
        "SLICEBROKER_DB_URL"
    )
    if not url:
        raise SystemExit("give the database URL with -x url=... or SLICEBROKER_DB_URL")
    return normalize_url(url)


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode recreates tables instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    if config.cmd_opts is not None and config.config_file_name is not None:
        # Only alembic's own command line sets up logging; a program running the
        # migrations (the broker, its tests) keeps its own handlers.
        fileConfig(config.config_file_name, disable_existing_loggers=False)
    engine = make_engine(_url())
    try:
        with engine.begin() as connection:
            take_write_lock(connection)
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
