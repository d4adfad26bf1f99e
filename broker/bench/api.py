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
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..client import BrokerAPIError, BrokerClient
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
                with _database(backend, Path(directory), postgres_url) as url:
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
def _database(backend: str, directory: Path, postgres_url: str) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{directory / 'broker.sqlite'}"
        return
    with scratch_database("slicebroker_bench", postgres_url) as url:
        yield url


def _config(clients: int) -> str:
    """A cluster with a GPU per client, four projects of ten users each."""
    nodes = max(1, -(-clients // GPUS_PER_NODE))
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
        users = ", ".join(f'"{u}"' for u in _users(project))
        lines += [f"[projects.{project}]", 'parent = "org"', f"users = [{users}]"]
    return "\n".join(lines) + "\n"


def _users(project: str) -> list[str]:
    return [f"{project}-user{i}" for i in range(USERS_PER_PROJECT)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class _Broker:
    process: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> float:
        """SIGTERM and wait; the CPU seconds the broker used."""
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


def _start_broker(url: str, directory: Path) -> _Broker:
    config = directory / "cluster.toml"
    port = _free_port()
    log = directory / "broker.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for name in [n for n in env if n.startswith("JUPYTERHUB_")]:
        del env[name]  # standalone: the broker's own tokens
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "broker.service",
                f"--config-file={config}",
                f"--db-url={url}",
                "--ip=127.0.0.1",
                f"--port={port}",
                "--max-wait=30",
                "--log-level=WARN",
            ],
            cwd=directory,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    broker = _Broker(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the broker exited at start:\n{log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return broker
        except OSError:
            if time.monotonic() > deadline:
                broker.stop()
                raise RuntimeError("the broker did not start in 60 s") from None
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

    (directory / "cluster.toml").write_text(_config(work.clients))
    store = TokenStore(url)  # initialises the schema too
    try:
        tokens = [(project, store.create(user)) for project in PROJECTS for user in _users(project)]
    finally:
        store.close()
    broker = _start_broker(url, directory)
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
        "p50": round(1000 * _percentile(ordered, 0.50), 1),
        "p99": round(1000 * _percentile(ordered, 0.99), 1),
        "max": round(1000 * ordered[-1], 1),
    }


def _percentile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank percentile ``q`` (0..1) of sorted values."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
