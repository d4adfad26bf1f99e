"""The reference the API benchmark measures the broker against (issue #11).

``python -m broker.bench.reference_server --db-url URL --port N``: a trivial
tornado server answering the routes the open-loop benchmark sends
(``POST /slices``, ``POST /slices/{id}/heartbeat``, ``GET /slices/{id}``,
``DELETE /slices/{id}``, ``GET /projects``), each after exactly one
journaled write (an ``INSERT`` committed) to a database of the same kind as
the broker's, with the broker's durability choices (``broker/orm.py``): SQLite
in WAL mode, ``synchronous=FULL`` except for heartbeats (``NORMAL``);
PostgreSQL with ``synchronous_commit`` off for heartbeats only. The write runs
on the event loop, one request after another: what a broker that did nothing
but one commit per request could serve on the same machine.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import time
from typing import Any

from sqlalchemy.engine import make_url
from tornado.ioloop import IOLoop
from tornado.web import Application, RequestHandler

from ..orm import normalize_url

JOURNAL = "CREATE TABLE IF NOT EXISTS journal (id INTEGER PRIMARY KEY, at REAL, route TEXT)"
POSTGRES_JOURNAL = (
    "CREATE TABLE IF NOT EXISTS journal (id BIGSERIAL PRIMARY KEY, at REAL, route TEXT)"
)


class Journal:
    """One connection to the database; :meth:`write` commits one row."""

    def __init__(self, url: str):
        parsed = make_url(normalize_url(url))
        self.sqlite = parsed.get_backend_name() == "sqlite"
        if self.sqlite:
            self._db: Any = sqlite3.connect(parsed.database or ":memory:", isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(JOURNAL)
            self._synchronous = ""
        else:
            import psycopg

            dsn = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
            self._db = psycopg.connect(dsn)
            with self._db.transaction():
                self._db.execute(POSTGRES_JOURNAL)

    def write(self, route: str, *, durable: bool = True) -> int:
        """Commit one journal row; its id."""
        if self.sqlite:
            synchronous = "FULL" if durable else "NORMAL"
            if synchronous != self._synchronous:  # as the broker: only when it changes
                self._db.execute(f"PRAGMA synchronous={synchronous}")
                self._synchronous = synchronous
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute(
                "INSERT INTO journal (at, route) VALUES (?, ?)", (time.time(), route)
            ).lastrowid
            self._db.execute("COMMIT")
            return int(row)
        with self._db.transaction():
            if not durable:
                self._db.execute("SET LOCAL synchronous_commit TO OFF")
            cursor = self._db.execute(
                "INSERT INTO journal (at, route) VALUES (%s, %s) RETURNING id", (time.time(), route)
            )
            return int(cursor.fetchone()[0])


class _Handler(RequestHandler):
    def initialize(self, journal: Journal) -> None:
        self.journal = journal

    def prepare(self) -> None:
        if not self.request.headers.get("Authorization", "").startswith("token "):
            self.send_error(401)

    def answer(self, body: dict[str, Any], status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))


class SlicesHandler(_Handler):
    def post(self) -> None:
        json.loads(self.request.body or b"{}")
        slice_id = self.journal.write("submit")
        self.answer({"id": slice_id, "state": "granted"}, 201)


class SliceHandler(_Handler):
    def get(self, slice_id: str) -> None:
        self.journal.write("get_slice")
        self.answer({"id": int(slice_id), "state": "granted"})

    def delete(self, slice_id: str) -> None:
        self.journal.write("release")
        self.answer({"id": int(slice_id), "state": "released"})


class HeartbeatHandler(_Handler):
    def post(self, slice_id: str) -> None:
        self.journal.write("heartbeat", durable=False)
        self.answer({"id": int(slice_id), "state": "granted"})


class ProjectsHandler(_Handler):
    def get(self) -> None:
        self.journal.write("projects")
        self.answer({"projects": []})


def make_app(journal: Journal) -> Application:
    args = {"journal": journal}
    return Application(
        [
            (r"/api/v1/slices", SlicesHandler, args),
            (r"/api/v1/slices/(\d+)", SliceHandler, args),
            (r"/api/v1/slices/(\d+)/heartbeat", HeartbeatHandler, args),
            (r"/api/v1/projects", ProjectsHandler, args),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m broker.bench.reference_server")
    parser.add_argument("--db-url", required=True, help="sqlite:///FILE or a PostgreSQL URL")
    parser.add_argument("--ip", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    make_app(Journal(args.db_url)).listen(args.port, args.ip, xheaders=False)
    IOLoop.current().start()


if __name__ == "__main__":
    main()
