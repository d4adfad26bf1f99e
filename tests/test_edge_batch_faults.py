"""``slicebroker run`` and the client against a broker that goes away for a while.

A real broker subprocess sits behind a small real HTTP proxy (tornado, in a
thread of the test) that forwards every request, except during an outage, when
it answers 503 as a proxy in front of a restarting broker does. The runner must
wait through it while it queues and while its command runs, never leave a
slice behind, and say what it was charged.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hubfixtures import wait_until
from servicefixtures import BrokerService, fill_cluster, running_service, service_env
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from broker.batch import BatchRequest, run_batch
from broker.client import BrokerAPIError, BrokerClient

#: How long each outage lasts (seconds): three times the client's own retries (4 tries
#: after 0.25, 0.5, 1 and 2 s: 3.75 s), so that only the runner's own waiting carries a
#: job through it; SLICEBROKER_TEST_OUTAGE_S sets another (30 s was the first figure).
OUTAGE_S = float(os.environ.get("SLICEBROKER_TEST_OUTAGE_S", "12"))

#: The job: says it started, then exits 0 once the file DIR/go exists.
COMMAND = r"""
import os, sys, time
directory = sys.argv[1]
open(os.path.join(directory, "started"), "w").close()
while not os.path.exists(os.path.join(directory, "go")):
    time.sleep(0.05)
"""


class FlakyProxy:
    """An HTTP proxy to ``target`` that answers 503 during :meth:`outage`."""

    def __init__(self, target: str):
        self.target = target.rstrip("/")
        self.failing_until = 0.0
        self.failing_with = 503  # or 404: the hub's proxy before the service's route is back
        self.refused = 0  # 503s (or 404s) answered
        self.forwarded = 0
        self.lose_answers = 0  # answers to drop (502 instead) after forwarding the request
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the proxy did not start"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    @property
    def failing(self) -> bool:
        return time.monotonic() < self.failing_until

    def outage(self, seconds: float, status: int = 503) -> None:
        self.failing_with = status
        self.failing_until = time.monotonic() + seconds

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        proxy = self

        class Forward(web.RequestHandler):
            async def _any(self) -> None:
                if proxy.failing and proxy.failing_with == 404:
                    # configurable-http-proxy with no route for the service yet: a page.
                    proxy.refused += 1
                    self.set_status(404)
                    self.set_header("Content-Type", "text/html")
                    self.finish("<html><body><h1>404: Not Found</h1></body></html>")
                    return
                if proxy.failing:
                    proxy.refused += 1
                    self.set_status(503)
                    self.set_header("Content-Type", "application/json")
                    self.finish(
                        json.dumps(
                            {"error": {"code": "unavailable", "message": "upstream restarting"}}
                        )
                    )
                    return
                proxy.forwarded += 1
                request = self.request
                response = await AsyncHTTPClient().fetch(
                    HTTPRequest(
                        proxy.target + request.uri,
                        method=request.method,
                        headers=request.headers,
                        body=request.body if request.method in ("POST", "PUT") else None,
                        allow_nonstandard_methods=True,
                        request_timeout=120,
                    ),
                    raise_error=False,
                )
                if proxy.lose_answers > 0:  # the broker did it; the caller never hears
                    proxy.lose_answers -= 1
                    self.set_status(502)
                    self.finish(b"")
                    return
                self.set_status(response.code)
                for name in ("Content-Type", "Location", "Idempotent-Replayed"):
                    if name in response.headers:
                        self.set_header(name, response.headers[name])
                self.finish(response.body or b"")

            get = post = put = delete = _any

        sockets = bind_sockets(0, "127.0.0.1")
        self.port = sockets[0].getsockname()[1]
        server = HTTPServer(web.Application([(r"/.*", Forward)]))
        server.add_sockets(sockets)
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._ready.set()
        await self._stop.wait()
        server.stop()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[BrokerService]:
    # A lease longer than an outage: a running job's heartbeats may all fail in one.
    with running_service(tmp_path / "broker", lease=2 * OUTAGE_S + 10, pass_interval=1) as svc:
        yield svc


@pytest.fixture
def proxy(service: BrokerService) -> Iterator[FlakyProxy]:
    proxy = FlakyProxy(service.url)
    yield proxy
    proxy.close()


def alices_slices(service: BrokerService) -> list[dict]:
    params = {"user": "alice"}
    return service.get("/slices", token=service.admin_token, params=params).json()["slices"]


def test_the_runner_waits_through_503s_while_queued_and_while_running(service, proxy, tmp_path):
    blocking = fill_cluster(service)
    markers = tmp_path / "markers"
    markers.mkdir()
    stderr_path = tmp_path / "runner.err"
    env = service_env({"SLICEBROKER_URL": proxy.url, "SLICEBROKER_TOKEN": service.token("alice")})
    args = ["--project", "vision", "--gpus", "4", "--min-runtime", "1m", "--poll", "1"]
    with open(stderr_path, "wb") as stderr:
        runner = subprocess.Popen(
            [sys.executable, "-m", "broker.cli", "run", *args, "--",
             sys.executable, "-c", COMMAND, str(markers)],
            env=env, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    try:
        wait_until(lambda: "waiting" in stderr_path.read_text(), 30, "the runner to queue")

        # 1. the broker "restarts" while the job waits; the GPUs free up meanwhile
        proxy.outage(OUTAGE_S)
        for slice_id in blocking:
            service.delete(f"/slices/{slice_id}", token=service.admin_token)
        wait_until(lambda: not proxy.failing, OUTAGE_S + 10, "the first outage to end")
        assert proxy.refused > 5, "the runner did not keep asking during the outage"
        assert runner.poll() is None, stderr_path.read_text()
        wait_until(lambda: (markers / "started").exists(), 30, "the command to start")

        # 2. again while the command runs; it finishes in the middle of it
        refused = proxy.refused
        proxy.outage(OUTAGE_S)
        wait_until(lambda: proxy.refused > refused, 30, "a heartbeat or watch to be refused")
        (markers / "go").touch()
        status = runner.wait(OUTAGE_S + 60)
    finally:
        if runner.poll() is None:
            runner.kill()
    text = stderr_path.read_text()
    assert status == 0, text
    assert proxy.refused > refused + 5
    (mine,) = alices_slices(service)  # one slice: nothing left behind, nothing doubled
    assert (mine["state"], mine["end_reason"]) == ("ended", "released"), text
    assert f"slice {mine['id']} released, charged " in text
    assert "Traceback" not in text


def test_ctrl_c_says_what_was_released_and_charged(service, proxy, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    stderr_path = tmp_path / "runner.err"
    env = service_env({"SLICEBROKER_URL": service.url, "SLICEBROKER_TOKEN": service.token("alice")})
    with open(stderr_path, "wb") as stderr:
        runner = subprocess.Popen(
            [sys.executable, "-m", "broker.cli", "run", "--project", "vision", "--gpus", "1",
             "--min-runtime", "1m", "--", sys.executable, "-c", COMMAND, str(markers)],
            env=env, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    try:
        wait_until(lambda: (markers / "started").exists(), 30, "the command to start")
        runner.send_signal(signal.SIGINT)
        runner.wait(30)
    finally:
        if runner.poll() is None:
            runner.kill()
    (mine,) = alices_slices(service)
    assert (mine["state"], mine["end_reason"]) == ("ended", "released")
    assert f"slice {mine['id']} released, charged " in stderr_path.read_text()


async def test_a_runner_that_gives_up_waiting_still_releases_its_request(service, proxy):
    fill_cluster(service)
    lines: list[str] = []
    request = BatchRequest(project="vision", gpus=4, min_runtime=60)
    async with BrokerClient(proxy.url, service.token("alice"), retries=1, backoff=0.05) as client:
        queued = asyncio.ensure_future(
            run_batch(client, request, ["true"], poll=0.5, patience=1.0, say=lines.append,
                      handle_signals=False)
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not any("waiting" in line for line in lines):
            # A runner that ended (or raised) first never says it: fail, do not hang.
            assert not queued.done(), (lines, queued)
            assert time.monotonic() < deadline, f"the runner never said it waits: {lines}"
            await asyncio.sleep(0.02)
        proxy.outage(3.0)  # longer than the patience, shorter than patience * 2
        with pytest.raises(BrokerAPIError) as raised:
            await asyncio.wait_for(queued, 30)
    assert raised.value.status == 503
    (mine,) = alices_slices(service)
    assert (mine["state"], mine["end_reason"]) == ("ended", "cancelled"), lines
    assert any("giving up" in line for line in lines), lines
    assert any(f"slice {mine['id']} released, charged 0.00 GPU-h" in line for line in lines)


async def test_a_proxy_404_while_the_hub_restarts_is_an_outage_not_an_answer(
    service, proxy, tmp_path
):
    """The hub restarts as the job ends: its proxy answers 404 pages for the service until
    the service's route is back. The runner waits it out and releases the slice."""
    lines: list[str] = []
    request = BatchRequest(project="vision", gpus=1, min_runtime=60)
    go = tmp_path / "go"
    command = [sys.executable, "-c", COMMAND, str(tmp_path)]
    async with BrokerClient(proxy.url, service.token("alice"), retries=1, backoff=0.05) as client:
        running = asyncio.ensure_future(
            run_batch(client, request, command, poll=0.5, patience=30, say=lines.append,
                      handle_signals=False)
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not (tmp_path / "started").exists():
            assert not running.done(), (lines, running)
            assert time.monotonic() < deadline, f"the command never started: {lines}"
            await asyncio.sleep(0.02)
        proxy.outage(2.0, status=404)
        go.touch()
        status = await asyncio.wait_for(running, 30)

    assert status == 0, lines
    assert proxy.refused > 0
    (mine,) = alices_slices(service)
    assert (mine["state"], mine["end_reason"]) == ("ended", "released"), lines
    assert not any("could not release" in line for line in lines), lines


async def test_a_submission_whose_answer_is_lost_makes_one_slice(service, proxy):
    """The first attempt reaches the broker, but the proxy loses its answer (a 502); the
    client's retry, with the same Idempotency-Key, answers the slice the first one made."""
    proxy.lose_answers = 1
    async with BrokerClient(proxy.url, service.token("alice"), retries=3, backoff=0.05) as client:
        slice_ = await client.submit("vision", 1, "interactive")
    assert proxy.lose_answers == 0 and proxy.forwarded == 2
    (mine,) = alices_slices(service)
    assert mine["id"] == slice_["id"]
