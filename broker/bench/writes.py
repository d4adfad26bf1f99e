"""``python -m broker.bench writes``: what one request's write costs the database thread.

A single writer (the service's Broker, no HTTP) runs ``count`` submissions, then a
heartbeat and a release of each slice they made (the first ones granted, the rest
waiting), each alone in a group commit as a request that finds the thread idle
is. Per kind: the median time and the statements sent to the database (besides
``COMMIT``, and on PostgreSQL ``BEGIN``; each is a round trip there). Beside them, in the
same run, a reference: a minimal write in the same kind of group commit (the
write lock, one row inserted and updated by hand, a durable commit), the least a
write can cost on that database.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import event, insert, update

from ..config import load_config
from ..orm import (
    SCRATCH_POSTGRES_URL,
    ScratchDatabaseUnavailable,
    SliceEventRow,
)
from . import api

#: GPUs of the run's cluster: the first submissions are granted, the rest wait.
CLUSTER_GPUS = 64


def run(backend: str = "both", count: int = 300, postgres_url: str = SCRATCH_POSTGRES_URL) -> dict:
    report: dict[str, Any] = {"benchmark": "writes", "count": count, "results": []}
    for name in ("sqlite", "postgresql") if backend == "both" else (backend,):
        try:
            with (
                tempfile.TemporaryDirectory() as directory,
                api.bench_database(name, Path(directory), postgres_url) as url,
            ):
                report["results"].append({"db": name, **_measure(url, count)})
        except ScratchDatabaseUnavailable as err:
            report["results"].append({"db": name, "skipped": str(err)})
    return report


def _measure(url: str, count: int) -> dict[str, Any]:
    from ..store import Broker, Principal

    with tempfile.TemporaryDirectory() as directory:
        config_file = Path(directory) / "cluster.toml"
        config_file.write_text(api.cluster_config(CLUSTER_GPUS))
        broker = Broker(url, load_config(config_file), single_writer=True)
    project = api.PROJECTS[0]
    user = Principal(api.users_of(project)[0])
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(statement)

    def timed(write: Callable[[], Any]) -> tuple[float, int]:
        sent.clear()
        started = time.perf_counter()
        with broker.journal.group_commit():
            write()
        return time.perf_counter() - started, len(sent)

    engine = broker.journal.engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        figures: dict[str, list[tuple[float, int]]] = {"submit": []}
        made: list[int] = []
        for _ in range(count):
            figures["submit"].append(
                timed(
                    lambda: made.append(
                        broker.submit(principal=user, project=project, gpus=1, kind="batch")["id"]
                    )
                )
            )
        broker.run_pass()
        broker.live_slice_ids()  # what the single writer keeps is loaded, as in service
        figures["heartbeat"] = [timed(lambda i=i: broker.heartbeat(i)) for i in made]
        figures["release"] = [timed(lambda i=i: broker.release(i)) for i in made]
        figures["reference"] = [timed(lambda: _minimal_write(broker)) for _ in range(count)]
    finally:
        event.remove(engine, "before_cursor_execute", record)
        broker.close()
    return {
        kind: {
            "median_ms": round(statistics.median(t for t, _ in runs) * 1e3, 3),
            "statements": round(statistics.mean(n for _, n in runs), 2),
        }
        for kind, runs in figures.items()
    }


def _minimal_write(broker: Any) -> None:
    """One event row inserted and updated by hand in the group's transaction (whose
    write lock it shares, as the Broker's writes do)."""
    with broker.journal.write() as session:
        connection = session.connection()
        inserted = connection.execute(
            insert(SliceEventRow)
            .values(slice_id=1, at=0.0, from_state=None, to_state="pending", reason="")
            .returning(SliceEventRow.id)
        ).scalar_one()
        connection.execute(
            update(SliceEventRow).where(SliceEventRow.id == inserted).values(reason="bench")
        )
