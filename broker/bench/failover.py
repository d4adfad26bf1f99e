"""Failover to a hot standby under load: ``python -m broker.bench failover``.

Two broker processes (``python -m broker.service``) share one database — a
SQLite file, then a fresh PostgreSQL database made for the run — so that one
leads and the other waits as a standby (docs/persistence.md, "Standby").
``inflight`` client threads keep one request each in flight against the
leader: submit a 1-GPU slice, heartbeat it, release it, again and again.

Each round SIGKILLs the leader and times how long the standby takes to answer
an authenticated ``GET /slices`` (``failover_s``: from the kill to the first
successful answer); the killed broker then comes back as the new standby. As
the reference, measured in the same run, the standby is stopped and the leader
killed and started again on the same database (``restart_s``: the plain
restart a single broker has). Afterwards the database is checked: every
acknowledged submission exists and every acknowledged release ended its slice.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from sqlalchemy import select

from ..orm import (
    READ_ONLY_OPTION,
    SCRATCH_POSTGRES_URL,
    ScratchDatabaseUnavailable,
    SliceRow,
    make_engine,
)
from .api import PROJECTS, REPO_ROOT, bench_database, cluster_config, free_port, users_of

#: How long a broker may take to come up, or a standby to take over, before the run fails.
START_TIMEOUT_S = 60.0


def run(
    db: str = "both",
    inflight: int = 20,
    rounds: int = 3,
    postgres_url: str = SCRATCH_POSTGRES_URL,
) -> dict[str, Any]:
    """Fail over ``rounds`` times (and restart as many) on each database named by ``db``
    (``sqlite``, ``postgresql``, ``both``) with ``inflight`` requests in flight."""
    backends = ["sqlite", "postgresql"] if db == "both" else [db]
    load = os.getloadavg()[0]
    results = []
    for backend in backends:
        with tempfile.TemporaryDirectory(prefix="slicebroker-bench-") as directory:
            try:
                with bench_database(backend, Path(directory), postgres_url) as url:
                    results.append(_run_one(backend, url, Path(directory), inflight, rounds))
            except ScratchDatabaseUnavailable as err:
                results.append({"db": backend, "skipped": str(err)})
    return {
        "benchmark": "failover",
        "requests_in_flight": inflight,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "goal": {"failover_s": 5.0, "acknowledged_lost": 0},
        "load_average_before": round(load, 2),
        "results": results,
    }


# ---- the brokers ----------------------------------------------------------------------


@dataclass
class _Broker:
    url: str
    config: Path
    port: int
    log: Path
    process: subprocess.Popen | None = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v1"

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        for name in [n for n in env if n.startswith("JUPYTERHUB_")]:
            del env[name]  # standalone: the broker's own tokens
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "broker.service",
                    f"--cluster-file={self.config}",
                    f"--db-url={self.url}",
                    "--ip=127.0.0.1",
                    f"--port={self.port}",
                    "--log-level=WARN",
                ],
                cwd=self.log.parent,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def answers_root(self) -> bool:
        try:
            return requests.get(self.api + "/", timeout=2).ok
        except requests.RequestException:
            return False

    def serves(self, token: str) -> bool:
        """Whether it answers as the leader (a standby answers 503)."""
        try:
            reply = requests.get(
                self.api + "/slices",
                params={"state": "live"},
                headers={"Authorization": f"token {token}"},
                timeout=2,
            )
        except requests.RequestException:
            return False
        return reply.ok

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def _wait(condition, what: str, broker: _Broker) -> float:
    """Poll ``condition`` every 10 ms; the seconds it took. Fails after START_TIMEOUT_S."""
    started = time.monotonic()
    while not condition():
        if broker.process is not None and broker.process.poll() is not None:
            raise RuntimeError(f"the broker exited: {broker.log.read_text()[-2000:]}")
        if time.monotonic() - started > START_TIMEOUT_S:
            raise RuntimeError(f"{what}: not in {START_TIMEOUT_S} s")
        time.sleep(0.01)
    return time.monotonic() - started


# ---- the load ---------------------------------------------------------------------------


@dataclass
class _Load:
    """``inflight`` threads, one request in flight each, against ``target``."""

    target: str
    tokens: list[tuple[str, str]]
    stop: threading.Event = field(default_factory=threading.Event)
    created: set[int] = field(default_factory=set)
    released: set[int] = field(default_factory=set)
    answered: int = 0
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, project: str, token: str) -> None:
        session = requests.Session()
        headers = {"Authorization": f"token {token}"}
        held: int | None = None
        while not self.stop.is_set():
            url = self.target
            try:
                if held is None:
                    body = {"project": project, "gpus": 1, "kind": "interactive"}
                    reply = session.post(f"{url}/slices", json=body, headers=headers, timeout=10)
                    if reply.status_code == 201:
                        held = reply.json()["id"]
                        with self.lock:
                            self.created.add(held)
                else:
                    reply = session.delete(f"{url}/slices/{held}", headers=headers, timeout=10)
                    if reply.ok:
                        with self.lock:
                            self.released.add(held)
                        held = None
                ok = reply.status_code < 300
            except requests.RequestException:
                ok = False
                session.close()
                session = requests.Session()
            with self.lock:
                if ok:
                    self.answered += 1
                else:
                    self.failed += 1
            if not ok:
                self.stop.wait(0.02)


def _run_one(backend: str, url: str, directory: Path, inflight: int, rounds: int) -> dict:
    from ..service.auth import TokenStore

    config = directory / "cluster.toml"
    config.write_text(cluster_config(inflight))
    store = TokenStore(url)  # initialises the schema too
    try:
        tokens = [
            (project, store.create(user)) for project in PROJECTS for user in users_of(project)
        ]
        probe = store.create("root", admin=True)
    finally:
        store.close()
    brokers = [_Broker(url, config, free_port(), directory / f"broker-{i}.log") for i in (0, 1)]
    leader = 0
    load = _Load(brokers[0].api, tokens)
    threads = [
        threading.Thread(target=load.client, args=tokens[i % len(tokens)], daemon=True)
        for i in range(inflight)
    ]
    failovers: list[float] = []
    restarts: list[float] = []
    try:
        brokers[0].start()
        _wait(lambda: brokers[0].serves(probe), "the leader's start", brokers[0])
        brokers[1].start()
        _wait(brokers[1].answers_root, "the standby's start", brokers[1])
        for thread in threads:
            thread.start()
        for _ in range(rounds):
            target = load.answered + 2 * inflight  # each kill meets load
            _wait(lambda target=target: load.answered >= target, "load", brokers[leader])
            standby = 1 - leader
            brokers[leader].kill()
            load.target = brokers[standby].api
            failovers.append(_wait(lambda s=standby: brokers[s].serves(probe), "takeover",
                                   brokers[standby]))  # fmt: skip
            brokers[leader].start()  # back as the standby
            _wait(brokers[leader].answers_root, "the new standby", brokers[leader])
            leader = standby
        brokers[1 - leader].stop()  # the reference: one broker, killed and started again
        for _ in range(rounds):
            target = load.answered + 2 * inflight  # each kill meets load
            _wait(lambda target=target: load.answered >= target, "load", brokers[leader])
            brokers[leader].kill()
            killed = time.monotonic()
            brokers[leader].start()
            _wait(lambda: brokers[leader].serves(probe), "restart", brokers[leader])
            restarts.append(time.monotonic() - killed)
    finally:
        load.stop.set()
        for thread in threads:
            thread.join(15)
        for broker in brokers:
            broker.stop()
    lost, unreleased = _check(url, load)
    return {
        "db": backend,
        "failover_s": _figures(failovers),
        "restart_s": _figures(restarts),
        "answered": load.answered,
        "requests_refused_during_outages": load.failed,
        "acknowledged_submissions": len(load.created),
        "acknowledged_lost": lost,
        "acknowledged_releases_not_ended": unreleased,
    }


def _check(url: str, load: _Load) -> tuple[int, int]:
    """Acknowledged submissions missing, and acknowledged releases whose slice lives."""
    engine = make_engine(url).execution_options(**{READ_ONLY_OPTION: True})
    try:
        with engine.connect() as connection:
            states = dict(connection.execute(select(SliceRow.id, SliceRow.state)).tuples().all())
    finally:
        engine.dispose()
    lost = len(load.created - set(states))
    unreleased = sum(1 for i in load.released if states.get(i) != "ended")
    return lost, unreleased


def _figures(seconds: list[float]) -> dict[str, Any]:
    return {
        "runs": [round(s, 3) for s in seconds],
        "median": round(statistics.median(seconds), 3) if seconds else None,
        "max": round(max(seconds), 3) if seconds else None,
    }
