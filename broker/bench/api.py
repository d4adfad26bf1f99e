"""The broker's HTTP API under load: ``python -m broker.bench api`` (issue #3).

A real broker subprocess (``python -m broker.service``) on a temporary
database — a SQLite file, then a fresh PostgreSQL database made for the run
and dropped after it — is driven over loopback by ``clients`` concurrent
async clients (:class:`broker.client.BrokerClient`, on tornado). Each client
repeats what a notebook session does: submit a 1-GPU interactive slice, wait
for its grant with a long-poll, heartbeat it (twice by default), read it,
release it; one cycle in four (the first included) also reads the project tree
(the spawner's options form). The cluster has a GPU per client, so grants
measure the broker, not a queue.

Figures (JSON): requests per second (long-polls counted apart: they wait on
purpose), latency p50/p99 per route and over all requests, request-to-grant
latency (submit sent to grant seen), errors by route and code, and the CPU
seconds of the broker and of the driver. Both the time (``seconds``, plus a
bounded drain) and the work (one live slice per client) are bounded.

``--open-loop`` (issue #11, :func:`run_open_loop`) sends instead a schedule
fixed in advance (Poisson arrivals at ``rate`` requests/s, a mix of kinds,
:data:`MIX`), each request on time whatever the answers before it, and
measures its latency from its scheduled send, so queueing counts. The same
schedule drives the reference server (:mod:`.reference_server`: one journaled
write per request) in the same run; ``--sweep`` steps the rate until the
broker's p99 passes 100 ms.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..client import API_PREFIX, BrokerAPIError, BrokerClient, HeartbeatBatcher
from ..orm import SCRATCH_POSTGRES_URL, ScratchDatabaseUnavailable, scratch_database

REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECTS = ("alpha", "beta", "gamma", "delta")
USERS_PER_PROJECT = 10
GPUS_PER_NODE = 8
#: How long the clients get, after the run, to finish their cycle and release.
DRAIN_S = 30.0
LONG_POLL = "GET /slices/{id}?wait"


def run(
    db: str = "both",
    clients: int = 200,
    seconds: float = 20.0,
    postgres_url: str = SCRATCH_POSTGRES_URL,
    heartbeats: int = 2,
) -> dict[str, Any]:
    """Drive a broker on each database named by ``db`` (``sqlite``, ``postgresql``, ``both``)
    with ``clients`` clients for ``seconds``; ``heartbeats`` per slice held."""
    backends = ["sqlite", "postgresql"] if db == "both" else [db]
    load = os.getloadavg()[0]  # other work on the machine skews every figure
    results = []
    for backend in backends:
        with tempfile.TemporaryDirectory(prefix="slicebroker-bench-") as directory:
            try:
                with bench_database(backend, Path(directory), postgres_url) as url:
                    work = _Work(clients, seconds, heartbeats)
                    results.append(_run_one(backend, url, Path(directory), work))
            except ScratchDatabaseUnavailable as err:
                results.append({"db": backend, "skipped": str(err)})
    return {
        "benchmark": "api",
        "clients": clients,
        "seconds": seconds,
        "heartbeats_per_slice": heartbeats,
        "cpus": os.cpu_count(),
        "goal": {"requests_per_s": 500, "p99_ms": 50},
        "load_average_before": round(load, 2),
        "results": results,
    }


# ---- the database and the broker ------------------------------------------------------


@contextmanager
def bench_database(backend: str, directory: Path, postgres_url: str) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{directory / 'broker.sqlite'}"
        return
    with scratch_database("slicebroker_bench", postgres_url) as url:
        yield url


def cluster_config(gpus: int) -> str:
    """A cluster of at least ``gpus`` GPUs, four projects of ten users each."""
    nodes = max(1, -(-gpus // GPUS_PER_NODE))
    lines = [
        'admins = ["root"]',
        "[policy]",
        'grace_period = "10s"',
        "debug_lane_fraction = 0.5",
        "[gpu_types]",
        "h100 = 1.0",
    ]
    for i in range(nodes):
        lines += [
            "[[nodes]]",
            f'name = "node{i:03d}"',
            'gpu_type = "h100"',
            f"gpus = {GPUS_PER_NODE}",
        ]
    lines += ["[projects.org]"]
    for project in PROJECTS:
        users = ", ".join(f'"{u}"' for u in users_of(project))
        lines += [f"[projects.{project}]", 'parent = "org"', f"users = [{users}]"]
    return "\n".join(lines) + "\n"


def users_of(project: str) -> list[str]:
    return [f"{project}-user{i}" for i in range(USERS_PER_PROJECT)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class _Server:
    process: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> float:
        """SIGTERM and wait; the CPU seconds the server used."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pid, _status, usage = os.wait4(self.process.pid, os.WNOHANG)
            if pid:
                self.process.returncode = 0
                return usage.ru_utime + usage.ru_stime
            time.sleep(0.05)
        self.process.kill()
        _pid, _status, usage = os.wait4(self.process.pid, 0)
        return usage.ru_utime + usage.ru_stime


def start_broker(url: str, directory: Path, *options: str) -> _Server:
    """A broker on ``directory``'s cluster file and database ``url``; ``options`` are
    more of its command line (``--BrokerApp.what_if_share=1``)."""
    config = directory / "cluster.toml"
    port = free_port()
    return _start_server(
        [
            "broker.service",
            f"--config-file={config}",
            f"--db-url={url}",
            "--ip=127.0.0.1",
            f"--port={port}",
            "--max-wait=30",
            "--log-level=WARN",
            *options,
        ],
        port,
        directory / "broker.log",
    )


def _start_server(module_args: list[str], port: int, log: Path) -> _Server:
    """``python -m <module_args>`` listening on ``port``, once it accepts connections."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for name in [n for n in env if n.startswith("JUPYTERHUB_")]:
        del env[name]  # standalone: the broker's own tokens
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", *module_args],
            cwd=log.parent,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = _Server(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{module_args[0]} exited at start:\n{log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"{module_args[0]} did not start in 60 s") from None
            time.sleep(0.05)


# ---- the load ----------------------------------------------------------------------------

_ID = re.compile(r"/\d+")


@dataclass(frozen=True)
class _Work:
    clients: int
    seconds: float
    heartbeats: int


@dataclass
class _Record:
    """Latencies (seconds) per route, grant latencies and errors, shared by the clients."""

    routes: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    grants: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cycles: int = 0


class _TimedClient(BrokerClient):
    """A client that records the latency of every request it makes."""

    def __init__(self, *args: Any, record: _Record, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.record = record

    async def request(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        route = f"{method} {_ID.sub('/{id}', path)}"
        if (kwargs.get("params") or {}).get("wait") is not None:
            route = LONG_POLL
        started = time.perf_counter()
        try:
            return await super().request(method, path, *args, **kwargs)
        except BrokerAPIError as err:
            self.record.errors[f"{route}: {err.status} {err.code}"] += 1
            raise
        finally:
            self.record.routes[route].append(time.perf_counter() - started)


async def _session(
    client: _TimedClient, project: str, stop_at: float, heartbeats: int, record: _Record
) -> None:
    """One notebook-like client: submit, wait for the grant, heartbeat, read, release; repeat."""
    cycle = 0
    while time.monotonic() < stop_at:
        cycle += 1
        try:
            sent = time.perf_counter()
            slice_ = await client.submit(project, 1, "interactive", min_runtime="15m")
            while slice_["state"] == "pending":
                slice_ = await client.wait_for_change(slice_["id"], "pending", 30)
            if slice_["state"] != "granted":
                continue
            record.grants.append(time.perf_counter() - sent)
            for _ in range(heartbeats):
                await client.heartbeat(slice_["id"])
            await client.get_slice(slice_["id"])
            if cycle % 4 == 1:
                await client.projects()
            await client.release(slice_["id"])
            record.cycles += 1
        except BrokerAPIError:
            await asyncio.sleep(0.1)  # counted in errors; do not spin


async def _drive(url: str, tokens: Sequence[tuple[str, str]], work: _Work):
    record = _Record()
    stop_at = time.monotonic() + work.seconds
    sessions = []
    for i in range(work.clients):
        project, token = tokens[i % len(tokens)]
        client = _TimedClient(url, token, record=record, timeout=30.0, retries=0)
        sessions.append((client, _session(client, project, stop_at, work.heartbeats, record)))
    started = time.perf_counter()
    tasks = [asyncio.ensure_future(session) for _, session in sessions]
    done, late = await asyncio.wait(tasks, timeout=work.seconds + DRAIN_S)
    elapsed = time.perf_counter() - started
    for task in late:
        task.cancel()
    for task in done:
        if task.exception() is not None:
            record.errors[f"client: {type(task.exception()).__name__}"] += 1
    for client, _ in sessions:
        client.close()
    return record, elapsed, len(late)


def _run_one(backend: str, url: str, directory: Path, work: _Work) -> dict:
    from ..service.auth import TokenStore

    (directory / "cluster.toml").write_text(cluster_config(work.clients))
    store = TokenStore(url)  # initialises the schema too
    try:
        tokens = [
            (project, store.create(user)) for project in PROJECTS for user in users_of(project)
        ]
    finally:
        store.close()
    broker = start_broker(url, directory)
    driver_before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        record, elapsed, stuck = asyncio.run(_drive(broker.url, tokens, work))
    finally:
        broker_cpu = broker.stop()
    driver_after = resource.getrusage(resource.RUSAGE_SELF)
    driver_cpu = (driver_after.ru_utime - driver_before.ru_utime) + (
        driver_after.ru_stime - driver_before.ru_stime
    )
    plain = [t for route, times in record.routes.items() if route != LONG_POLL for t in times]
    polls = record.routes.get(LONG_POLL, [])
    return {
        "db": backend,
        "elapsed_s": round(elapsed, 2),
        "cycles": record.cycles,
        "requests": len(plain),
        "requests_per_s": round(len(plain) / elapsed, 1),
        "long_polls": len(polls),
        "latency_ms": _summary(plain),
        "grant_latency_ms": _summary(record.grants),
        "routes": {route: _summary(times) for route, times in sorted(record.routes.items())},
        "errors": dict(sorted(record.errors.items())),
        "clients_stuck": stuck,
        "broker_cpu_s": round(broker_cpu, 1),
        "driver_cpu_s": round(driver_cpu, 1),
    }


def _summary(seconds: Sequence[float]) -> dict[str, Any]:
    ordered = sorted(seconds)
    if not ordered:
        return {"count": 0}
    return {
        "count": len(ordered),
        "p50": round(1000 * percentile(ordered, 0.50), 1),
        "p90": round(1000 * percentile(ordered, 0.90), 1),
        "p99": round(1000 * percentile(ordered, 0.99), 1),
        "max": round(1000 * ordered[-1], 1),
    }


def percentile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank percentile ``q`` (0..1) of sorted values."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# ---- open loop (issue #11) ---------------------------------------------------------------

#: Share of each kind of request in the offered load. Heartbeats dominate at scale
#: (every open notebook sends one per ``heartbeat_every``); submits and releases
#: balance, so the number of live slices stays about constant; each spawn reads
#: the project tree (the options form) and watchers read single slices.
MIX = {"heartbeat": 0.70, "get_slice": 0.10, "projects": 0.04, "submit": 0.08, "release": 0.08}
#: The sweep's offered rates (requests/s), tried in order until p99 passes the limit;
#: the low steps place a broker that is far from the goal.
SWEEP_RATES = (50, 100, 250, 500, 1000, 1500, 2000, 3000, 4000)
SWEEP_P99_S = 0.100
#: Per-request limit; a request past it counts as an error (status 0) with this latency.
REQUEST_TIMEOUT_S = 10.0
#: Connections the driver may hold open at once (long-polls hold one each).
MAX_CLIENTS = 1000
#: Slices held for releases to take, as seconds of release traffic.
CHURN_POOL_S = 5.0
LONG_POLL_WAIT_S = 30.0
#: The hub's agent, whose token sends every session's heartbeats with ``hub_heartbeats``.
HUB = "hub"
OPEN_LOOP_GOALS = {
    "p99_ms_at_500": 50,
    "sweep_rate_sqlite": 1500,
    "sweep_rate_postgresql": 1000,
    "broker_over_reference": 0.8,
    "grant_p50_ms_at_500": 20,
    "grant_p99_ms_at_500": 100,
}


@dataclass(frozen=True)
class OpenLoop:
    """One open-loop run: ``rate`` requests/s offered for ``seconds``, Poisson arrivals
    drawn from ``seed``; each session heartbeats once per ``heartbeat_every``."""

    rate: float
    seconds: float = 20.0
    heartbeat_every: float = 30.0
    seed: int = 1

    @property
    def sessions(self) -> int:
        """Open notebooks, each holding a slice: enough for the heartbeats' share."""
        return max(1, math.ceil(self.rate * self.heartbeat_every * MIX["heartbeat"]))

    @property
    def churn(self) -> int:
        """Slices held at the start for the releases to take."""
        return max(10, math.ceil(self.rate * MIX["release"] * CHURN_POOL_S))


@dataclass(frozen=True)
class _Send:
    at: float  # seconds after the start of the schedule
    kind: str
    session: int  # which session's slice (heartbeat, get_slice)


def schedule(work: OpenLoop) -> list[_Send]:
    """The arrival times and kinds of every request, fixed before the run.

    Heartbeats go to the sessions in turn, so each session heartbeats about
    once per ``heartbeat_every``.
    """
    rng = random.Random(work.seed)
    kinds, weights = list(MIX), list(MIX.values())
    sends: list[_Send] = []
    at, beats = 0.0, 0
    while True:
        at += rng.expovariate(work.rate)
        if at >= work.seconds:
            return sends
        kind = rng.choices(kinds, weights)[0]
        if kind == "heartbeat":
            session, beats = beats % work.sessions, beats + 1
        else:
            session = rng.randrange(work.sessions)
        sends.append(_Send(at, kind, session))


def run_open_loop(
    db: str = "both",
    rate: float = 500.0,
    seconds: float = 20.0,
    postgres_url: str = SCRATCH_POSTGRES_URL,
    *,
    sweep: bool = False,
    sweep_rates: Sequence[float] = SWEEP_RATES,
    heartbeat_every: float = 30.0,
    seed: int = 1,
    hub_heartbeats: bool = False,
) -> dict[str, Any]:
    """The broker and the reference server (:mod:`.reference_server`), each on a fresh
    database per rate, driven by the same open-loop schedule: at ``rate``, or with
    ``sweep`` at ``sweep_rates`` in turn until the broker's p99 passes 100 ms. With
    ``hub_heartbeats`` the broker's heartbeats are sent as a hub's spawners send them,
    together (:class:`~broker.client.HeartbeatBatcher`); the reference, which has no
    such route, still gets one request each."""
    backends = ["sqlite", "postgresql"] if db == "both" else [db]
    rates = sweep_rates if sweep else (rate,)
    load = os.getloadavg()[0]  # other work on the machine skews every figure
    results = []
    for backend in backends:
        points: list[dict[str, Any]] = []
        try:
            for offered in rates:
                work = OpenLoop(offered, seconds, heartbeat_every, seed)
                point = {
                    "offered_rate": offered,
                    "load_average_before": round(os.getloadavg()[0], 2),
                    "broker": _open_run("broker", backend, work, postgres_url, hub_heartbeats),
                    "reference": _open_run("reference", backend, work, postgres_url),
                }
                point["broker_over_reference"] = _ratios(point["broker"], point["reference"])
                points.append(point)
                if point["broker"]["latency_ms"].get("p99", math.inf) > 1000 * SWEEP_P99_S:
                    break
        except ScratchDatabaseUnavailable as err:
            results.append({"db": backend, "skipped": str(err)})
            continue
        result: dict[str, Any] = {"db": backend, "points": points}
        if sweep:
            result["highest_rate_p99_within_100ms"] = {
                server: _highest_passing(points, server) for server in ("broker", "reference")
            }
        results.append(result)
    return {
        "benchmark": "api-open-loop",
        "seconds": seconds,
        "heartbeat_every_s": heartbeat_every,
        "mix": MIX,
        "seed": seed,
        "hub_heartbeats": hub_heartbeats,
        "transport": _transport_name(),
        "cpus": os.cpu_count(),
        "goals": OPEN_LOOP_GOALS,
        "load_average_before": round(load, 2),
        "results": results,
    }


def _highest_passing(points: Sequence[dict[str, Any]], server: str) -> float | None:
    passing = [
        p["offered_rate"]
        for p in points
        if p[server]["latency_ms"].get("p99", math.inf) <= 1000 * SWEEP_P99_S
    ]
    return max(passing, default=None)


def _ratios(broker: dict[str, Any], reference: dict[str, Any]) -> dict[str, float | None]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 2)

    return {
        "achieved_rate": ratio(broker["achieved_rate"], reference["achieved_rate"]),
        "p99": ratio(broker["latency_ms"].get("p99"), reference["latency_ms"].get("p99")),
    }


def _open_run(
    server: str, backend: str, work: OpenLoop, postgres_url: str, hub_heartbeats: bool = False
) -> dict[str, Any]:
    """One server on a fresh database, seeded with the sessions' slices, under ``work``
    (the broker's heartbeats gathered as a hub's with ``hub_heartbeats``)."""
    with tempfile.TemporaryDirectory(prefix="slicebroker-bench-") as name:
        directory = Path(name)
        with bench_database(backend, directory, postgres_url) as url:
            seeding = time.perf_counter()
            if server == "broker":
                held, tokens = _seed_broker(url, directory, work)
                process = start_broker(url, directory)
            else:
                tokens = {user: f"reference-{user}" for p in PROJECTS for user in users_of(p)}
                owners = slice_owners(work.sessions + work.churn)
                held = [(i + 1, project, user) for i, (project, user) in enumerate(owners)]
                port = free_port()
                process = _start_server(
                    [f"{__package__}.reference_server", f"--db-url={url}", f"--port={port}"],
                    port,
                    directory / "reference.log",
                )
            seeded_s = time.perf_counter() - seeding
            try:
                hub = tokens.get(HUB) if hub_heartbeats else None
                figures = asyncio.run(_drive_open(process.url, tokens, held, work, hub))
            finally:
                server_cpu = process.stop()
            if server == "broker":
                figures["leases_lapsed"] = leases_lapsed(url)
    return {
        **figures,
        "live_slices_at_start": len(held),
        "setup_s": round(seeded_s, 1),
        "server_cpu_s": round(server_cpu, 1),
    }


def leases_lapsed(url: str) -> int:
    """Slices of the database at ``url`` ended because no heartbeat came within their
    lease: in an open loop, heartbeats the broker lost (a run shorter than the lease,
    120 s, cannot show any)."""
    from sqlalchemy import func, select
    from sqlalchemy.orm import Session

    from ..core.model import EndReason
    from ..orm import SliceRow, make_engine

    engine = make_engine(url)
    try:
        with Session(engine) as session:
            lost = select(func.count()).where(SliceRow.end_reason == EndReason.LOST.value)
            return session.scalar(lost)
    finally:
        engine.dispose()


#: A live slice the driver knows: its id, project and user.
_Held = tuple[int, str, str]


def slice_owners(count: int) -> list[tuple[str, str]]:
    """``(project, user)`` for ``count`` slices, spread over every project and user."""
    users = [(project, user) for project in PROJECTS for user in users_of(project)]
    return [users[i % len(users)] for i in range(count)]


def pending_rows(count: int, gpus: int = 1, min_runtime: float = 3600.0) -> list:
    """``count`` waiting interactive requests of ``gpus`` each, spread over every project
    and user (:func:`slice_owners`), as rows to write straight to the database."""
    from ..orm import SliceRow

    now = time.time()
    return [
        SliceRow(project=project, user=user, gpus=gpus, gpu_type=None, kind="interactive",
                 min_runtime=min_runtime, resumable=False, max_runtime=None, priority=0,
                 submitted_at=now, state="pending", placements=[], promised=[],
                 charged_gpu_seconds=0.0)
        for project, user in slice_owners(count)
    ]  # fmt: skip


def _seed_broker(url: str, directory: Path, work: OpenLoop) -> tuple[list[_Held], dict[str, str]]:
    """The cluster file, a token per user, and the sessions' and the release pool's
    slices written straight to the database and granted by one pass (submitting
    thousands through the API, a pass each, would take minutes)."""
    from sqlalchemy.orm import Session

    from ..config import load_config
    from ..orm import make_engine
    from ..service.auth import TokenStore
    from ..store import Broker

    live = work.sessions + work.churn
    # Room for every live slice and the submits of the whole run, so that grants
    # measure the broker, not a queue.
    gpus = live + math.ceil(work.rate * MIX["submit"] * work.seconds) + GPUS_PER_NODE
    (directory / "cluster.toml").write_text(cluster_config(gpus))
    store = TokenStore(url)  # initialises the schema too
    try:
        tokens = {user: store.create(user) for project in PROJECTS for user in users_of(project)}
        tokens[HUB] = store.create(HUB, agent=True)
    finally:
        store.close()
    broker = Broker(url, load_config(directory / "cluster.toml"))
    engine = make_engine(url)
    try:
        rows = pending_rows(live)
        with Session(engine) as session, session.begin():
            session.add_all(rows)
            session.flush()
            held = [(row.id, row.project, row.user) for row in rows]
        broker.run_pass()
        granted = sum(1 for s in broker.list_slices(state="granted"))
        if granted != live:
            raise RuntimeError(f"seeding granted {granted} of {live} slices")
    finally:
        engine.dispose()
        broker.close()
    return held, tokens


def _transport_name() -> str:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return "tornado"
    return "aiohttp"


class _Transport:
    """HTTP requests with a pool of ``MAX_CLIENTS`` connections: aiohttp when installed
    (keep-alive connections: less client CPU per request), else tornado's client."""

    def __init__(self) -> None:
        self.name = _transport_name()
        if self.name == "aiohttp":
            import aiohttp

            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=MAX_CLIENTS))
        else:
            from tornado.httpclient import AsyncHTTPClient

            self._http = AsyncHTTPClient(force_instance=True, max_clients=MAX_CLIENTS)

    async def send(
        self, method: str, url: str, token: str, body: bytes | None, timeout: float
    ) -> tuple[int, bytes]:
        """``(status, body)``; status 0 when no answer came (refused, reset, timed out)."""
        headers = {"Authorization": f"token {token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.name == "aiohttp":
            import aiohttp

            try:
                async with self._session.request(
                    method,
                    url,
                    headers=headers,
                    data=body,
                    timeout=aiohttp.ClientTimeout(total=timeout),
                ) as response:
                    return response.status, await response.read()
            except (TimeoutError, aiohttp.ClientError, OSError):
                return 0, b""
        from tornado.httpclient import HTTPRequest

        request = HTTPRequest(
            url,
            method=method,
            headers=headers,
            body=body,
            allow_nonstandard_methods=True,
            connect_timeout=timeout,
            request_timeout=timeout,
        )
        try:
            response = await self._http.fetch(request, raise_error=False)
        except OSError:
            return 0, b""
        return (0 if response.code == 599 else response.code), response.body or b""

    async def close(self) -> None:
        if self.name == "aiohttp":
            await self._session.close()
        else:
            self._http.close()


@dataclass
class _OpenRecord:
    """Latencies (seconds, from the scheduled send) per kind; grants; errors; send lags."""

    kinds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    ok: int = 0
    grants: list[float] = field(default_factory=list)
    not_granted: int = 0
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lags: list[float] = field(default_factory=list)
    releases_without_slice: int = 0
    last_answer: float = 0.0


async def _drive_open(
    url: str,
    tokens: dict[str, str],
    held: Sequence[_Held],
    work: OpenLoop,
    hub_token: str | None = None,
) -> dict[str, Any]:
    """Send ``schedule(work)`` at its times, each request in a task of its own, so a
    slow answer never delays the next send (no coordinated omission). With
    ``hub_token``, heartbeats go instead through one
    :class:`~broker.client.HeartbeatBatcher` as that agent; each counts as answered
    if its slice came back within the client's timeout of when it was due."""
    sends = schedule(work)
    sessions = list(held[: work.sessions])
    pool = deque(held[work.sessions :])  # slices for releases to take, oldest first
    record = _OpenRecord()
    transport = _Transport()
    api = f"{url}{API_PREFIX}"
    loop = asyncio.get_running_loop()
    clock = loop.time

    async def request(kind: str, method: str, path: str, user: str, body: Any, due: float):
        data = None if body is None else json.dumps(body).encode()
        timeout = REQUEST_TIMEOUT_S + (LONG_POLL_WAIT_S if kind == LONG_POLL else 0)
        status, answer = await transport.send(method, api + path, tokens[user], data, timeout)
        now = clock()
        record.last_answer = now
        record.kinds[kind].append(now - due)
        if 200 <= status < 300:
            if kind != LONG_POLL:
                record.ok += 1
            return json.loads(answer)
        record.errors[f"{kind}: {status}"] += 1
        return None

    # The hub's own client and connections: its heartbeats wait for none of the driver's.
    hub = None if hub_token is None else BrokerClient(url, hub_token, timeout=REQUEST_TIMEOUT_S)
    batcher = None if hub is None else HeartbeatBatcher(hub)

    async def hub_heartbeat(slice_id: int, due: float) -> None:
        assert batcher is not None
        try:
            await batcher.beat(slice_id)
            status = 200
        except BrokerAPIError as err:
            status = err.status
        now = clock()
        record.last_answer = now
        record.kinds["heartbeat"].append(min(now - due, REQUEST_TIMEOUT_S))
        if status == 200 and now - due > REQUEST_TIMEOUT_S:
            # Its lease was renewed, but later than a request of its own would wait.
            record.errors["heartbeat: late"] += 1
        elif status == 200:
            record.ok += 1
        else:
            record.errors[f"heartbeat: {status}"] += 1

    async def submit(due: float, project: str, user: str) -> None:
        body = {"project": project, "gpus": 1, "kind": "interactive", "min_runtime": "1h"}
        slice_ = await request("submit", "POST", "/slices", user, body, due)
        if slice_ is None:
            return
        pool.append((slice_["id"], project, user))
        while slice_ is not None and slice_["state"] == "pending":
            path = f"/slices/{slice_['id']}?wait={LONG_POLL_WAIT_S}&state=pending"
            slice_ = await request(LONG_POLL, "GET", path, user, None, clock())
        if slice_ is not None and slice_["state"] == "granted":
            record.grants.append(clock() - due)
        else:
            record.not_granted += 1

    def start(send: _Send, due: float) -> Any:
        slice_id, project, user = sessions[send.session]
        if send.kind == "heartbeat" and batcher is not None:
            return hub_heartbeat(slice_id, due)
        if send.kind == "heartbeat":
            path = f"/slices/{slice_id}/heartbeat"
            return request("heartbeat", "POST", path, user, {}, due)
        if send.kind == "get_slice":
            return request("get_slice", "GET", f"/slices/{slice_id}", user, None, due)
        if send.kind == "projects":
            return request("projects", "GET", "/projects", user, None, due)
        if send.kind == "submit":
            return submit(due, project, user)
        if not pool:
            record.releases_without_slice += 1
            return None
        slice_id, _project, user = pool.popleft()
        return request("release", "DELETE", f"/slices/{slice_id}", user, None, due)

    # The server is listening; wait until it answers before the clock starts.
    for _ in range(100):
        status, _body = await transport.send(
            "GET", f"{api}/projects", next(iter(tokens.values())), None, 30
        )
        if status == 200:
            break
        await asyncio.sleep(0.1)
    tasks = []
    began = clock() + 0.1
    cpu_before = time.process_time()
    for send in sends:
        due = began + send.at
        if due > clock():
            await asyncio.sleep(due - clock())
        record.lags.append(clock() - due)
        coroutine = start(send, due)
        if coroutine is not None:
            tasks.append(asyncio.ensure_future(coroutine))
    done, late = await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + LONG_POLL_WAIT_S)
    for task in late:
        task.cancel()
    for task in done:
        if task.exception() is not None:
            record.errors[f"client: {type(task.exception()).__name__}"] += 1
    driver_cpu = time.process_time() - cpu_before
    await transport.close()
    if hub is not None:
        hub.close()
    elapsed = max(record.last_answer, began + work.seconds) - began
    answered = [t for kind, times in record.kinds.items() if kind != LONG_POLL for t in times]
    return {
        "offered_rate": round(len(sends) / work.seconds, 1),
        "achieved_rate": round(record.ok / elapsed, 1),
        "requests": len(sends),
        "ok": record.ok,
        "elapsed_s": round(elapsed, 2),
        "latency_ms": _summary(answered),
        "kinds": {kind: _summary(times) for kind, times in sorted(record.kinds.items())},
        "grant_latency_ms": _summary(record.grants),
        "not_granted": record.not_granted,
        "errors": dict(sorted(record.errors.items())),
        "unfinished": len(late),
        "releases_without_slice": record.releases_without_slice,
        "send_lag_ms": _summary(record.lags),
        "driver_cpu_s": round(driver_cpu, 1),
        **({} if batcher is None else {"heartbeat_requests": batcher.requests}),
    }
