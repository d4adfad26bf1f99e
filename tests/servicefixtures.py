"""The broker service as a real subprocess, for tests that need one (shared helpers).

``python -m broker.service`` is started on a free port of 127.0.0.1 with a
temporary cluster configuration and database; the helpers answer with a
:class:`BrokerService` that knows its URL and an admin token::

    from servicefixtures import BrokerService, broker_service, running_service  # noqa: F401

    def test_whoami(broker_service: BrokerService):        # the fixture: a fresh service
        r = broker_service.get("/whoami", token=broker_service.admin_token)
        assert r.json()["admin"]

    def test_custom(tmp_path):
        with running_service(tmp_path, lease=2, config=MY_TOML) as service:
            token = service.token("alice")
            service.post("/slices", token=token, json={...})
            service.kill()       # SIGKILL
            service.start()      # same port, same database

For tests that need the service's insides (its runner, its waiters), the same
application runs in-process on a real socket of the test's event loop::

    async def test_inside(tmp_path):
        async with serving_in_process(f"sqlite:///{tmp_path}/b.sqlite", lease=1) as api:
            reply = await api.call("POST", "/slices", token=api.token("alice"), json={...})
            assert reply.status == 201, reply.json
            api.runner.watchers   # the long-poll waiters

``service.url`` is the service's base URL (``http://127.0.0.1:PORT/``) and
``service.api_url`` its API root (``.../api/v1``); request helpers take paths
relative to the API root. The service's stdout and stderr go to
``service.log_path`` (:meth:`BrokerService.log_text`).
"""

from __future__ import annotations

import json as jsonlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import requests
from hubfixtures import free_port
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from broker.config import parse_config
from broker.service.apihandlers.base import InFlight
from broker.service.app import make_app
from broker.service.auth import TokenAuthenticator, TokenStore, create_token
from broker.service.runner import BrokerRunner
from broker.store import Broker
from broker.store.lapses import LATE_HEARTBEAT_S

REPO_ROOT = Path(__file__).resolve().parent.parent
STACK_DUMP_END = "tasks, where each waits:"  # logged after the threads' stacks

#: Admin user named in :data:`TEST_CONFIG`; the fixtures' admin token is theirs.
ADMIN_USER = "root"

#: A small cluster: two nodes of 4 H100s, a tree lab -> vision, nlp (half each).
TEST_CONFIG = """\
admins = ["root"]

[policy]
window = "7d"
max_min_runtime = "8h"
grace_period = "2s"
debug_max_gpus = 2
debug_max_min_runtime = "15m"
debug_lane_fraction = 0.25
# Requests preempt at once: the wait before a preemption has tests of its own.
batch_preemption_delay = "0s"
interactive_preemption_delay = "0s"

[defaults.interactive]
min_runtime = "15m"
resumable = false

[defaults.batch]
min_runtime = "1h"
resumable = true

[gpu_types]
h100 = 1.0

[[nodes]]
name = "n0"
gpu_type = "h100"
gpus = 4

[[nodes]]
name = "n1"
gpu_type = "h100"
gpus = 4

[projects.lab]

[projects.vision]
parent = "lab"
users = ["alice", "bob"]

[projects.nlp]
parent = "lab"
users = ["carol"]
groups = ["nlp-team"]
"""

#: Environment variables that would make the service think JupyterHub runs it.
HUB_VARIABLES = (
    "JUPYTERHUB_API_TOKEN",
    "JUPYTERHUB_API_URL",
    "JUPYTERHUB_SERVICE_NAME",
    "JUPYTERHUB_SERVICE_URL",
    "JUPYTERHUB_SERVICE_PREFIX",
    "JUPYTERHUB_OAUTH_ACCESS_SCOPES",
)


def service_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a service subprocess: this one, without hub variables,
    with the repository importable."""
    env = {k: v for k, v in os.environ.items() if k not in HUB_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class BrokerService:
    """A broker service subprocess (see the module's docstring)."""

    port: int
    db_url: str
    config_path: Path
    log_path: Path
    args: list[str]
    env: dict[str, str]
    admin_token: str = ""
    process: subprocess.Popen | None = None
    session: requests.Session = field(default_factory=requests.Session)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    @property
    def api_url(self) -> str:
        return f"{self.url}api/v1"

    # ---- lifecycle ---------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> BrokerService:
        """Start the process (again) and return once it answers ``GET /api/v1/``."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("the service is already running")
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "broker.service", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.log_path.parent,
            )
        finally:
            log.close()
        try:
            self.wait_until_up(timeout)
        except BaseException:
            self.kill()  # a service that never came up must not outlive its test
            raise
        return self

    def wait_until_up(self, timeout: float = 30.0) -> None:
        wait_until_answering(
            self.api_url + "/",
            self.process,
            lambda: self.log_text()[-3000:],
            timeout,
            what="the service",
        )

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the exit status."""
        process = self.process
        if process is None or process.poll() is not None:
            return None if process is None else process.returncode
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.dump_stacks()  # where it waits, into the log the failing test prints
            process.kill()
            return process.wait()

    def dump_stacks(self, timeout: float = 5.0) -> None:
        """Have the service write every thread's stack to its log (SIGUSR1)."""
        before = self.log_text().count(STACK_DUMP_END)
        self.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while self.log_text().count(STACK_DUMP_END) == before and time.monotonic() < deadline:
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the process dies at once, wherever it was."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self) -> BrokerService:
        self.stop()
        return self.start()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # ---- tokens and requests -----------------------------------------------------

    def token(self, user: str, *, admin: bool = False, agent: bool = False) -> str:
        """A new broker token for ``user`` (written straight to the database)."""
        return create_token(self.db_url, user, admin=admin, agent=agent)

    def request(
        self,
        method: str,
        path: str,
        *,
        token: str | None = None,
        json: Any = None,
        data: str | bytes | None = None,
        params: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float = 30.0,
    ) -> requests.Response:
        """``method`` on ``path`` (relative to the API root, e.g. ``/slices/1``)."""
        all_headers = dict(headers or {})
        if token is not None:
            all_headers["Authorization"] = f"token {token}"
        return self.session.request(
            method,
            self.api_url + path,
            json=json,
            data=data,
            params=params,
            headers=all_headers,
            timeout=timeout,
        )

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> requests.Response:
        return self.request("POST", path, **kwargs)

    def put(self, path: str, **kwargs: Any) -> requests.Response:
        return self.request("PUT", path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> requests.Response:
        return self.request("DELETE", path, **kwargs)


def make_service(
    directory: Path,
    *,
    config: str = TEST_CONFIG,
    db_url: str | None = None,
    port: int | None = None,
    lease: float = 120.0,
    pass_interval: float = 5.0,
    max_wait: float = 10.0,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    admin_user: str = ADMIN_USER,
) -> BrokerService:
    """A :class:`BrokerService` ready to :meth:`~BrokerService.start`, files in ``directory``.

    ``config`` is the cluster TOML text; ``db_url`` defaults to a SQLite file in
    ``directory``. The database is initialised and an admin token made for
    ``admin_user`` (``service.admin_token``) before the service starts.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config_path = directory / "cluster.toml"
    config_path.write_text(config)
    db_url = db_url or f"sqlite:///{directory / 'broker.sqlite'}"
    port = port or free_port()
    args = [
        f"--cluster-file={config_path}",
        f"--db-url={db_url}",
        "--ip=127.0.0.1",
        f"--port={port}",
        f"--lease={lease}",
        f"--pass-interval={pass_interval}",
        f"--max-wait={max_wait}",
        *extra_args,
    ]
    service = BrokerService(
        port=port,
        db_url=db_url,
        config_path=config_path,
        log_path=directory / "service.log",
        args=args,
        env=service_env(env),
    )
    service.admin_token = service.token(admin_user, admin=True)
    return service


def start_service(directory: Path, **kwargs: Any) -> BrokerService:
    """:func:`make_service` and start it; stop it yourself (or use :func:`running_service`)."""
    return make_service(directory, **kwargs).start()


@contextmanager
def running_service(directory: Path, **kwargs: Any) -> Iterator[BrokerService]:
    """A started service, stopped (SIGTERM) on exit; arguments as :func:`make_service`."""
    service = start_service(directory, **kwargs)
    try:
        yield service
    finally:
        service.stop()
        service.session.close()


def fill_cluster(service: BrokerService) -> list[int]:
    """Every GPU of the test cluster (two nodes of 4) to carol (nlp) for an hour, granted:
    the ids of the two slices."""
    carol = service.token("carol")
    ids = []
    for _ in range(2):
        body = {"project": "nlp", "gpus": 4, "kind": "batch", "min_runtime": "1h"}
        slice_id = service.post("/slices", token=carol, json=body).json()["id"]
        params = {"wait": 10, "state": "pending"}
        granted = service.get(f"/slices/{slice_id}", token=carol, params=params).json()
        assert granted["state"] == "granted", granted
        ids.append(slice_id)
    return ids


#: :data:`TEST_CONFIG` with a preemption budget of one: a job preempted once is kept to its end.
BUDGET_OF_ONE_CONFIG = TEST_CONFIG.replace("[policy]\n", "[policy]\npreemption_budget = 1\n")


def kept_to_its_end(service: BrokerService, token: str) -> dict:
    """A batch slice of vision (4 GPUs) granted, preempted once by a drain of its node,
    then granted again on the other: on :data:`BUDGET_OF_ONE_CONFIG`, kept to its end.
    The slice as granted the second time (protected a second: a drain waits for the
    protection to end)."""
    body = {"project": "vision", "gpus": 4, "kind": "batch", "min_runtime": 1}
    slice_id = service.post("/slices", token=token, json=body).json()["id"]

    def after(state: str) -> dict:
        params = {"wait": 10, "state": state}
        return service.get(f"/slices/{slice_id}", token=token, params=params).json()

    first = after("pending")
    assert first["state"] == "granted", first
    node = first["placements"][0]["node"]
    drained = service.post(f"/nodes/{node}/drain", token=service.admin_token, json={})
    assert drained.status_code == 200, drained.text
    assert after("granted")["state"] == "preempting"
    again = after("preempting")
    if again["state"] == "pending":
        again = after("pending")
    assert again["state"] == "granted" and again["preemptions"] == 1, again
    assert again["placements"][0]["node"] != node
    return again


@pytest.fixture
def broker_service(tmp_path: Path) -> Iterator[BrokerService]:
    """A fresh service on :data:`TEST_CONFIG` and a SQLite file, for one test."""
    with running_service(tmp_path / "broker-service") as service:
        yield service


# ---- in-process ----------------------------------------------------------------------


@dataclass
class Reply:
    """An HTTP answer: status, headers, body text, and the body as JSON (``None`` if not)."""

    status: int
    headers: Mapping[str, str]
    text: str

    @property
    def json(self) -> Any:
        try:
            return jsonlib.loads(self.text)
        except ValueError:
            return None


@dataclass
class InProcessBroker:
    """The service's application on a real socket of the running event loop."""

    runner: BrokerRunner
    store: TokenStore
    db_url: str
    port: int
    max_wait: float
    in_flight: InFlight
    admin_token: str = ""

    @property
    def broker(self) -> Broker:
        return self.runner.broker

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v1"

    def token(self, user: str, *, admin: bool = False, agent: bool = False) -> str:
        return self.store.create(user, admin=admin, agent=agent)

    async def call(
        self,
        method: str,
        path: str,
        *,
        token: str | None = None,
        json: Any = None,
        body: str | bytes | None = None,
        params: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        timeout: float = 30.0,
    ) -> Reply:
        """``method`` on ``path`` (relative to the API root); never raises for a status."""
        headers = {}
        if token is not None:
            headers["Authorization"] = f"token {token}"
        if json is not None:
            body = jsonlib.dumps(json)
        if body:  # a raw body too is sent as JSON, as every client must (docs/api.md)
            headers["Content-Type"] = "application/json"
        if body is None and method in ("POST", "PUT", "PATCH"):
            body = b""
        url = self.api_url + path + (f"?{urlencode(params, doseq=True)}" if params else "")
        response = await AsyncHTTPClient().fetch(
            url,
            method=method,
            body=body,
            headers=headers,
            raise_error=False,
            request_timeout=timeout,
            allow_nonstandard_methods=True,
        )
        return Reply(response.code, response.headers, response.body.decode("utf-8", "replace"))


@asynccontextmanager
async def serving_in_process(
    db_url: str,
    *,
    config: str = TEST_CONFIG,
    lease: float = 120.0,
    pass_interval: float = 5.0,
    max_wait: float = 10.0,
    authenticate_metrics: bool = True,
    admin_user: str = ADMIN_USER,
    shed_after: float = 0.0,
    single_writer: bool = False,
    token_cache_max_age: float = 0.0,
    late_heartbeat: float = LATE_HEARTBEAT_S,
) -> AsyncIterator[InProcessBroker]:
    """The service's application for ``db_url`` on a free port, in this event loop.

    Token answers are cached ``token_cache_max_age`` seconds (by default not at all:
    revocations show at once); the Broker keeps the catalog and live slices in memory
    if ``single_writer`` (as the service's leader does); the rest is as in
    ``python -m broker.service``.
    """
    import tomllib

    cluster = parse_config(tomllib.loads(config))
    broker = Broker(
        db_url, cluster, lease=lease, late_heartbeat=late_heartbeat, single_writer=single_writer
    )
    runner = BrokerRunner(broker, pass_interval=pass_interval, shed_after=shed_after)
    store = TokenStore(db_url)
    authenticator = TokenAuthenticator(
        store, runner.read_urgent, admins=cluster.admins, cache_max_age=token_cache_max_age
    )
    app = make_app(
        runner, authenticator, max_wait=max_wait, authenticate_metrics=authenticate_metrics
    )
    sockets = bind_sockets(0, "127.0.0.1")
    server = HTTPServer(app)
    server.add_sockets(sockets)
    runner.start()
    port = sockets[0].getsockname()[1]
    api = InProcessBroker(runner, store, db_url, port, max_wait, app.settings["in_flight"])
    api.admin_token = api.token(admin_user, admin=True)
    try:
        await runner.started()
        yield api
    finally:
        server.stop()
        runner.watchers.close()
        await app.settings["in_flight"].idle()
        await server.close_all_connections()
        await runner.stop()
        store.close()


def wait_until_answering(
    url: str,
    process: subprocess.Popen | None,
    log_tail: Callable[[], str],
    timeout: float,
    *,
    what: str,
) -> None:
    """Poll ``url`` until it answers 200; fail with ``log_tail()`` if ``process``
    exits first or ``timeout`` seconds pass (a slow answer is just polled again)."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}:\n{log_tail()}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not answer in {timeout} s:\n{log_tail()}")
        time.sleep(0.05)
