"""What-if reads under load: ``python -m broker.bench whatif`` (design.md §5.8).

A real broker subprocess on a SQLite file, its 1,024 GPUs held under protection
and ``waiting`` requests queued behind them (2 GPUs, 4 h protected: each has
alternatives to compute), is polled for ``seconds`` at ``rate`` requests/s, open
loop, round-robin over the waiting requests with their owners' tokens:
``GET /slices/{id}/alternatives`` (what a pending page asks), and in the same run
``GET /slices/{id}`` at the same rate as the reference (what any page asks). Each
phase runs once with the default ``what_if_share`` (0.1) and once with it at 1
(no bound).

Figures (JSON): per phase the broker's CPU seconds over the load (from
``/proc/<pid>/stat``) as a share of one core, answers, stale answers and p50/p99
latency; and the what-if phases' CPU share above the reference's.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from tornado.httpclient import AsyncHTTPClient, HTTPClientError

from . import api

#: Clock ticks per second of ``/proc/<pid>/stat``'s CPU times.
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _seed(url: str, directory: Path, gpus: int, waiting: int) -> tuple[list, dict[str, str]]:
    """``gpus`` 1-GPU slices held, then ``waiting`` 2-GPU requests queued; the waiting
    ones as ``(id, user)``, and a token per user."""
    from sqlalchemy.orm import Session

    from ..config import load_config
    from ..orm import make_engine
    from ..service.auth import TokenStore
    from ..store import Broker

    (directory / "cluster.toml").write_text(api.cluster_config(gpus))
    store = TokenStore(url)
    try:
        tokens = {u: store.create(u) for p in api.PROJECTS for u in api.users_of(p)}
    finally:
        store.close()
    broker = Broker(url, load_config(directory / "cluster.toml"))
    engine = make_engine(url)
    try:
        with Session(engine) as session, session.begin():
            session.add_all(api.pending_rows(gpus))
        broker.run_pass()
        with Session(engine) as session, session.begin():
            queued = api.pending_rows(waiting, gpus=2, min_runtime=4 * 3600.0)
            session.add_all(queued)
            session.flush()
            asked = [(row.id, row.user) for row in queued]
        broker.run_pass()
    finally:
        engine.dispose()
        broker.close()
    return asked, tokens


async def _poll(server_url: str, path: str, asked: list, tokens: dict, rate: float,
                seconds: float) -> dict[str, Any]:  # fmt: skip
    """Open loop: a request every ``1/rate`` s, whatever the answers; their figures."""
    client = AsyncHTTPClient(max_clients=1000)
    latencies: list[float] = []
    stale = errors = 0

    async def one(slice_id: int, user: str) -> None:
        nonlocal stale, errors
        began = time.perf_counter()
        try:
            answer = await client.fetch(
                f"{server_url}{api.API_PREFIX}{path.format(id=slice_id)}",
                headers={"Authorization": f"token {tokens[user]}"},
                request_timeout=60,
            )
        except (HTTPClientError, OSError):
            errors += 1
            return
        latencies.append(time.perf_counter() - began)
        stale += answer.headers.get("Slicebroker-Stale") == "true"

    sent = []
    start = time.perf_counter()
    for n in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, start + n / rate - time.perf_counter()))
        slice_id, user = asked[n % len(asked)]
        sent.append(asyncio.ensure_future(one(slice_id, user)))
    await asyncio.gather(*sent)
    latencies.sort()
    return {
        "answers": len(latencies),
        "stale": stale,
        "errors": errors,
        "p50_ms": round(1000 * api.percentile(latencies, 0.5), 1) if latencies else None,
        "p99_ms": round(1000 * api.percentile(latencies, 0.99), 1) if latencies else None,
    }


def _phase(share: float, path: str, rate: float, seconds: float, waiting: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="slicebroker-whatif-") as tmp:
        directory = Path(tmp)
        url = f"sqlite:///{directory / 'broker.sqlite'}"
        asked, tokens = _seed(url, directory, 1024, waiting)
        server = api.start_broker(url, directory, f"--BrokerApp.what_if_share={share}")
        try:
            before, began = _cpu_seconds(server.process.pid), time.perf_counter()
            figures = asyncio.run(_poll(server.url, path, asked, tokens, rate, seconds))
            cpu = _cpu_seconds(server.process.pid) - before
            wall = time.perf_counter() - began
        finally:
            server.stop()
    return {"cpu_share_of_a_core": round(cpu / wall, 3), "seconds": round(wall, 1), **figures}


def run(rate: float = 50.0, seconds: float = 20.0, waiting: int = 200) -> dict:
    """Every phase, each on a broker of its own; see the module docstring."""
    report: dict[str, Any] = {"rate": rate, "seconds": seconds, "waiting": waiting, "gpus": 1024}
    report["reference: GET /slices/{id}"] = _phase(0.1, "/slices/{id}", rate, seconds, waiting)
    for share in (0.1, 1.0):
        phase = _phase(share, "/slices/{id}/alternatives", rate, seconds, waiting)
        phase["cpu_share_above_reference"] = round(
            phase["cpu_share_of_a_core"]
            - report["reference: GET /slices/{id}"]["cpu_share_of_a_core"],
            3,
        )
        report[f"alternatives, what_if_share={share:g}"] = phase
    return report
