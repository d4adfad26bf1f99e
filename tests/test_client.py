"""The async API client against a real broker subprocess: every route, errors, retries."""

from __future__ import annotations

import asyncio
import csv
import io
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from servicefixtures import BrokerService, free_port, running_service

from broker.client import BrokerAPIError, BrokerClient, BrokerUnreachable, HeartbeatBatcher


@pytest.fixture
def service(tmp_path: Path) -> Iterator[BrokerService]:
    with running_service(tmp_path / "broker", pass_interval=1) as service:
        yield service


def client_for(service: BrokerService, token: str, **options) -> BrokerClient:
    return BrokerClient(service.url, token, **options)


async def test_every_route_answers_through_the_client(service):
    admin = client_for(service, service.admin_token)
    alice = client_for(service, service.token("alice"))
    try:
        me = await alice.whoami()
        assert (me["name"], me["admin"], me["projects"]) == ("alice", False, ["vision"])

        # Nothing else waits and GPUs are free: the pass grants it within the request.
        slice_ = await alice.submit("vision", 2, "interactive", min_runtime="15m")
        assert (slice_["state"], slice_["min_runtime"], slice_["kind"]) == (
            "granted",
            900.0,
            "interactive",
        )
        granted = slice_
        assert granted["placements"]
        assert (await alice.heartbeat(slice_["id"]))["lease_expires_at"] > time.time()
        batcher = HeartbeatBatcher(alice)  # many slices' heartbeats in one POST /heartbeats
        held, unknown = await asyncio.gather(
            batcher.beat(slice_["id"]), batcher.beat(99999), return_exceptions=True
        )
        assert held["id"] == slice_["id"] and held["lease_expires_at"] > time.time()
        assert (unknown.status, unknown.code) == (404, "not_found")
        assert batcher.requests == 1
        assert [s["id"] for s in await alice.list_slices(state="granted")] == [slice_["id"]]
        assert await alice.list_slices(state="pending") == []
        assert (await alice.get_slice(slice_["id"]))["id"] == slice_["id"]

        projects = {p["name"]: p for p in await alice.projects()}
        assert projects["vision"]["gpus_held"] == 2
        node = granted["placements"][0]["node"]
        assert {n["name"]: n["gpus_held"] for n in await alice.nodes()}[node] == 2

        released = await alice.release(slice_["id"])
        assert released["end_reason"] == "released"
        events = await alice.events(slice_["id"])
        assert [e["to_state"] for e in events] == ["pending", "granted", "ended"]

        report = await alice.usage("vision")
        assert [(r["user"], r["slices"]) for r in report["usage"]] == [("alice", 1)]
        text = await alice.usage("vision", since=time.time() - 60, by="project", format="csv")
        (row,) = csv.DictReader(io.StringIO(text))
        assert (row["project"], row["slices"]) == ("vision", "1")

        changed = await admin.put_project("vision", share=3, parent="lab", users=["alice"])
        assert (changed["share"], changed["users"]) == (3.0, ["alice"])
        assert (await admin.drain(node, "test"))["state"] == "draining"
        assert (await admin.undrain(node))["state"] == "ready"
        assert (await admin.down(node, "PSU"))["state"] == "down"
        assert "slicebroker" in await admin.metrics()
    finally:
        admin.close()
        alice.close()


async def test_wait_for_change_returns_after_the_timeout_when_nothing_changes(service):
    async with client_for(service, service.admin_token) as admin:
        for node in ("n0", "n1"):  # nothing will be granted
            await admin.drain(node)
    async with client_for(service, service.token("alice")) as alice:
        slice_ = await alice.submit("vision", 1, "batch", min_runtime="1h")
        started = time.monotonic()
        latest = await alice.wait_for_change(slice_["id"], "pending", 0.5)
        assert latest["state"] == "pending"
        assert 0.4 < time.monotonic() - started < 5
        await alice.release(slice_["id"])


# ---- errors -----------------------------------------------------------------------


async def test_error_answers_become_broker_api_errors(service):
    alice = client_for(service, service.token("alice"))
    stranger = client_for(service, "sb_999_nope")
    try:
        with pytest.raises(BrokerAPIError) as caught:
            await alice.get_slice(12345)
        assert (caught.value.status, caught.value.code) == (404, "not_found")
        assert caught.value.message == "no slice 12345"

        with pytest.raises(BrokerAPIError) as caught:
            await stranger.projects()
        assert (caught.value.status, caught.value.code) == (401, "unauthorized")

        with pytest.raises(BrokerAPIError) as caught:
            await alice.drain("n0")
        assert (caught.value.status, caught.value.code) == (403, "forbidden")

        with pytest.raises(BrokerAPIError) as caught:
            await alice.submit("nlp", 1, "batch")
        assert (caught.value.status, caught.value.code) == (403, "forbidden")

        with pytest.raises(BrokerAPIError) as caught:
            await alice.submit("vision", 1, "batch", min_runtime="forever")
        assert caught.value.status == 400
        assert "min_runtime" in caught.value.message
    finally:
        alice.close()
        stranger.close()


async def test_a_closed_port_is_retried_then_reported_unreachable(caplog):
    url = f"http://127.0.0.1:{free_port()}"
    token = "sb_1_secret-token-value"
    async with BrokerClient(url, token, retries=3, backoff=0.01) as client:
        with caplog.at_level(logging.WARNING, logger="broker.client"):
            with pytest.raises(BrokerUnreachable) as caught:
                await client.nodes()
            retried = [r for r in caplog.records if "retrying" in r.getMessage()]
            assert len(retried) == 3
            assert caught.value.status == 0 and caught.value.code == "unreachable"
            assert caught.value.message.endswith("connection refused")

            caplog.clear()
            # A refused connection never delivered the request: even a submission is resent.
            with pytest.raises(BrokerUnreachable):
                await client.submit("vision", 1)
            assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 3
    assert token not in caplog.text
    assert token not in repr(client)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


async def test_no_answer_retries_reads_and_submissions_a_bounded_number_of_times(
    silent_port, caplog
):
    url = f"http://127.0.0.1:{silent_port}"
    async with BrokerClient(url, "t", timeout=0.2, retries=2, backoff=0.01) as client:
        with caplog.at_level(logging.WARNING, logger="broker.client"):
            with pytest.raises(BrokerUnreachable):
                await client.get_slice(1)
            assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 2

            # a submission carries an Idempotency-Key, so resending it is safe
            caplog.clear()
            with pytest.raises(BrokerUnreachable):
                await client.submit("vision", 1)
            assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 2

            # a heartbeat that may have reached a broker that is behind is not sent again:
            # the holder's next heartbeat is the retry
            caplog.clear()
            with pytest.raises(BrokerUnreachable, match="may or may not have been applied"):
                await client.heartbeat(1)
            assert not [r for r in caplog.records if "retrying" in r.getMessage()]


async def test_a_long_poll_is_not_retried_past_its_wait(silent_port, caplog):
    # A session's watch heartbeats between long-polls: a long-poll that a silent broker
    # let time out must come back, not wait the whole wait again per retry.
    url = f"http://127.0.0.1:{silent_port}"
    async with BrokerClient(url, "t", timeout=0.2, retries=4, backoff=0.01) as client:
        with (
            caplog.at_level(logging.WARNING, logger="broker.client"),
            pytest.raises(BrokerUnreachable, match="within the wait"),
        ):
            await client.wait_for_change(1, "pending", 0.3)
    # its one attempt had 0.5 s (timeout and wait): past the wait, so never retried
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


async def test_a_long_polls_retry_asks_only_what_is_left_of_its_wait():
    asked: list[str] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        asked.append(head.split(b" ")[1].decode())
        if len(asked) > 1:  # the first connection is dropped unanswered: the retry
            body = b'{"id": 1, "state": "granted"}'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with BrokerClient(f"http://127.0.0.1:{port}", "t", backoff=0.2) as client:
            latest = await client.wait_for_change(1, "pending", 30)
    finally:
        server.close()
    assert latest["state"] == "granted" and len(asked) == 2
    waits = [float(path.split("wait=")[1].split("&")[0]) for path in asked]
    # Less the pause before the retry (0.2 s) and the first try's time, to the ms.
    assert waits[0] == 30 and 29 < waits[1] <= 29.8


async def test_a_read_survives_a_broker_restart(service):
    # Retries enough for a restart on a loaded machine (about 30 s in all, 4 s apart at most).
    async with client_for(service, service.admin_token, retries=10, backoff=0.2) as client:
        assert await client.nodes()
        service.kill()
        reading = asyncio.ensure_future(client.nodes())  # retries while the broker is away
        await asyncio.get_running_loop().run_in_executor(None, service.start)
        assert [n["name"] for n in await reading] == ["n0", "n1"]


def test_url_and_token_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("SLICEBROKER_URL", "http://broker.example:8000/")
    monkeypatch.setenv("SLICEBROKER_TOKEN", "sb_1_x")
    client = BrokerClient()
    assert client.url == "http://broker.example:8000"
    assert "sb_1_x" not in repr(client)
    monkeypatch.delenv("SLICEBROKER_URL")
    with pytest.raises(ValueError, match="SLICEBROKER_URL"):
        BrokerClient()
