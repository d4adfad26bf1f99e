"""``python -m broker.bench storepass``: the service's own pass — the Broker's, a
single writer on SQLite, snapshot and usage and writes included — with many
running slices, each timed beside the minimal pass (``scheduling.minimal_pass``)
on the same snapshot in the same run.

Each timed pass follows one change, as a submission's pass does: a request
submitted, then withdrawn again. ``ledger`` charges of holdings that ended in the
last day are in the window's ledger, as a busy week leaves it.
"""

from __future__ import annotations

import gc
import itertools
import tempfile
import time
from functools import partial
from pathlib import Path

from sqlalchemy.orm import Session

from ..config import load_config
from ..core.model import Snapshot
from ..orm import make_engine
from . import api
from .scheduling import _summary, _timed, minimal_pass


def run(live: int = 10_000, repeat: int = 40, ledger: int = 50_000) -> dict:
    from ..orm import LedgerRow
    from ..store import Broker, Principal

    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        url = f"sqlite:///{folder / 'broker.db'}"
        (folder / "cluster.toml").write_text(api.cluster_config(live + api.GPUS_PER_NODE))
        broker = Broker(url, load_config(folder / "cluster.toml"), single_writer=True)
        engine = make_engine(url)
        try:
            with Session(engine) as session, session.begin():
                rows = api.pending_rows(live)
                session.add_all(rows)
                session.flush()
                now = time.time()
                session.add_all(
                    LedgerRow(slice_id=row.id, project=row.project, user=row.user,
                              start=now - 86_400 + i % 80_000, end=now - 3_600 + i % 3_000,
                              gpus=1, weight=1.0, gpu_seconds=1.0)
                    for i, row in zip(range(ledger), itertools.cycle(rows))
                )  # fmt: skip
            broker.run_pass()  # grants every one of them
            project, user = api.slice_owners(1)[0]
            gc.collect()
            gc.freeze()  # as the service does once started
            service: tuple[list[float], list[float]] = ([], [])
            minimal: tuple[list[float], list[float]] = ([], [])
            for i in range(repeat):
                if i % 2 == 0:
                    added = broker.submit(
                        project=project, principal=Principal(user), gpus=1, kind="interactive"
                    )
                else:
                    broker.release(added["id"])
                _timed(broker.run_pass, *service)
                _timed(partial(minimal_pass, _live(broker)), *minimal)
            gc.unfreeze()
            running = sum(1 for _ in broker.list_slices(state="granted"))
        finally:
            engine.dispose()
            broker.close()
    result: dict = {"benchmark": "store_pass", "running": running, "ledger": ledger}
    result["repeat"] = repeat
    result["service_pass"] = _summary(*service)
    result["minimal"] = _summary(*minimal)
    result["ratio_to_minimal_median"] = round(
        result["service_pass"]["median_ms"] / result["minimal"]["median_ms"], 2
    )
    return result


def _live(broker) -> Snapshot:
    """What the minimal pass reads: the live slices, the nodes and their weights."""
    journal = broker.journal
    with journal.read() as session:
        catalog = journal.catalog(session)
        return Snapshot(
            now=time.time(),
            nodes=catalog.nodes,
            accounts=(),
            slices=tuple(journal.live_values(session)),
            usage={},
            gpu_type_weights=catalog.costs.weights,
        )
