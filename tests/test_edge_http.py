"""The HTTP edge against a real ``python -m broker.service``: every bad request is a
JSON 4xx (never a 500, a bare answer or a dropped connection), and slow clients
do not hold sockets.

Each test sends what a careless or hostile client sends: ids in other scripts'
digits, oversized bodies and headers, control characters in names, thousands of
groups, half-sent requests, retried submissions.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from servicefixtures import BrokerService, running_service

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[BrokerService]:
    directory = tmp_path_factory.mktemp("edge")
    with running_service(directory, extra_args=["--log-level=DEBUG"]) as service:
        yield service


@pytest.fixture(scope="module")
def slice_one(service) -> str:
    """A token of alice, who holds slice 1 (which an id such as '١' must not reach)."""
    alice = service.token("alice")
    first = submit(service, alice)
    assert (first.status_code, first.json()["id"]) == (201, 1)
    return alice


def assert_json_error(response: requests.Response, status: int, code: str | None = None) -> dict:
    """The answer is ``status`` with the API's error shape (and ``code`` when given)."""
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"code", "message"}
    if code is not None:
        assert error["code"] == code, error
    return error


def submit(service: BrokerService, token: str, **extra) -> requests.Response:
    body = {"project": "vision", "gpus": 1, "kind": "interactive", **extra.pop("body", {})}
    return service.post("/slices", token=token, json=body, **extra)


def raw_exchange(port: int, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_until_closed(sock, timeout)


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    chunks = []
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
    raise AssertionError(f"the server did not close the connection in {timeout} s: {chunks!r}")


def parse_answer(raw: bytes) -> tuple[int, dict]:
    """Status and JSON body of the first HTTP answer in ``raw``."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = dict(
        line.split(": ", 1) for line in head.decode("latin1").split("\r\n")[1:] if ": " in line
    )
    length = int(headers.get("Content-Length", len(body)))
    return status, json.loads(body[:length])


# ---- 1. path ids ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "%C2%B2",  # ² : isdigit() but not int()
        "%E2%91%A0",  # ①
        "%D9%A1",  # Arabic-Indic one: int() reads it as 1
        "%EF%BC%91",  # fullwidth one
        "1" * 5000,
        "0",
        "2147483648",
        "01x",
        "%201",
        "-1",
    ],
)
def test_a_path_id_that_is_not_ascii_digits_in_range_is_a_json_404(service, slice_one, text):
    alice = slice_one
    for method, suffix in (
        ("GET", ""),
        ("DELETE", ""),
        ("POST", "/heartbeat"),
        ("POST", "/checkpoint"),
        ("GET", "/events"),
    ):
        response = service.request(method, f"/slices/{text}{suffix}", token=alice)
        error = assert_json_error(response, 404, "not_found")
        assert len(error["message"]) < 400
    assert "Traceback" not in service.log_text()
    assert "uncaught exception" not in service.log_text()
    # slice 1 is still alice's and untouched by the alias attempts
    assert service.get("/slices/1", token=alice).json()["state"] != "ended"


# ---- 2. oversized requests ----------------------------------------------------------------


def test_a_body_over_the_limit_is_a_json_413(service):
    alice = service.token("alice")
    big = b'{"project": "' + b"x" * (2 * MiB) + b'"}'
    response = service.post("/slices", token=alice, data=big)
    assert_json_error(response, 413, "payload_too_large")


def test_a_chunked_body_over_the_limit_is_a_json_413(service):
    alice = service.token("alice")

    def chunks() -> Iterator[bytes]:
        for _ in range(40):
            yield b" " * 65536

    response = service.post("/slices", token=alice, data=chunks())
    assert_json_error(response, 413, "payload_too_large")


def test_an_endless_chunked_body_is_answered_413_and_cut_off(service):
    request = (
        b"POST /api/v1/slices HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Authorization: token " + service.admin_token.encode() + b"\r\n\r\n"
    )
    chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
    with socket.create_connection(("127.0.0.1", service.port), timeout=10) as sock:
        sock.sendall(request)
        sent = 0
        try:
            while sent < 64 * MiB:  # far past what the broker reads
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_until_closed(sock, 10)
    assert sent < 64 * MiB, "the broker read the whole endless body"
    status, body = parse_answer(answer)
    assert (status, body["error"]["code"]) == (413, "payload_too_large")


def test_a_huge_announced_body_is_refused_before_it_is_sent(service):
    request = (
        b"POST /api/v1/slices HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n"
        b"Content-Type: application/json\r\n\r\n"
    )
    status, body = parse_answer(raw_exchange(service.port, request))
    assert (status, body["error"]["code"]) == (413, "payload_too_large")


def test_huge_headers_are_a_json_431(service):
    response = service.get("/whoami", headers={"Authorization": "token " + "a" * 100_000})
    assert_json_error(response, 431, "headers_too_large")
    response = service.get("/no/such/path", headers={"X-Padding": "a" * 100_000})
    assert_json_error(response, 431, "headers_too_large")
    # normal requests on the same service still work
    assert service.get("/whoami", token=service.admin_token).status_code == 200


# ---- 4. the project tree -----------------------------------------------------------------


def test_a_project_with_members_does_not_become_a_parent(tmp_path: Path):
    with running_service(tmp_path) as svc:
        admin = svc.admin_token

        def tree() -> dict[str, tuple]:
            projects = svc.get("/projects", token=admin).json()["projects"]
            return {p["name"]: (p["parent"], p["is_project"], p["users"]) for p in projects}

        before = tree()
        refused = svc.put("/projects/sub", token=admin, json={"share": 1, "parent": "vision"})
        error = assert_json_error(refused, 409, "conflict")
        assert "members" in error["message"]
        assert tree() == before
        assert svc.get("/whoami", token=svc.token("bob")).json()["projects"] == ["vision"]

        # emptied of members, it may become a parent; the config check would accept it
        emptied = svc.put(
            "/projects/vision", token=admin, json={"share": 1, "parent": "lab", "users": []}
        )
        assert emptied.status_code == 200, emptied.text
        made = svc.put("/projects/sub", token=admin, json={"share": 1, "parent": "vision"})
        assert made.status_code == 200, made.text
        assert tree()["vision"][1] is False and tree()["sub"][1] is True
        # members go on projects, never on the parent it now is
        refused = svc.put(
            "/projects/vision", token=admin, json={"share": 1, "parent": "lab", "users": ["bob"]}
        )
        assert_json_error(refused, 400)


# ---- 5. control characters in names --------------------------------------------------------


@pytest.mark.parametrize("name", ["a\u0000", "a\n", "\u001b[31mroot", "b\u007f"])
def test_member_names_with_control_characters_are_refused(service, name):
    before = {
        p["name"]: p for p in service.get("/projects", token=service.admin_token).json()["projects"]
    }
    for key in ("users", "groups"):
        response = service.put(
            "/projects/vision",
            token=service.admin_token,
            json={"share": 1, "parent": "lab", key: ["alice", name]},
        )
        assert_json_error(response, 400)
    response = submit(service, service.admin_token, body={"user": name})
    assert_json_error(response, 400)
    response = service.get("/slices", token=service.admin_token, params={"user": name})
    assert_json_error(response, 400)
    after = {
        p["name"]: p for p in service.get("/projects", token=service.admin_token).json()["projects"]
    }
    assert after["vision"]["users"] == before["vision"]["users"]


# ---- 6. bounded echo -------------------------------------------------------------------------


def test_a_refusal_does_not_echo_thousands_of_groups(service):
    alice = service.token("alice")
    groups = [f"group-{i:05d}" for i in range(9000)]
    response = submit(service, alice, body={"groups": groups})
    error = assert_json_error(response, 403, "forbidden")
    assert "group-00000" in error["message"] and "8995 more" in error["message"]
    assert len(response.content) < 1000
    longest = max(len(line) for line in service.log_text().splitlines())
    assert longest < 3000


def test_an_error_message_quoting_a_long_input_is_bounded(service):
    response = service.get("/slices", token=service.admin_token, params={"state": "x" * 50_000})
    assert_json_error(response, 400)
    assert len(response.content) < 2000
    response = service.get("/" + "y" * 60_000, token=service.admin_token)
    assert_json_error(response, 404, "not_found")
    assert len(response.content) < 2000


# ---- 7. slow clients ---------------------------------------------------------------------------


def test_half_sent_requests_are_cut_off_after_the_timeouts(tmp_path: Path):
    with running_service(tmp_path, extra_args=["--idle-timeout=1", "--body-timeout=1"]) as svc:
        began = time.monotonic()
        assert raw_exchange(svc.port, b"GET /api/v1/ HTTP/1.1\r\nHost: x\r\n", timeout=10) == b""
        assert time.monotonic() - began < 5
        began = time.monotonic()
        answer = raw_exchange(
            svc.port,
            b"POST /api/v1/slices HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
            timeout=10,
        )
        assert time.monotonic() - began < 5
        assert b"200 OK" not in answer and b"201" not in answer
        # an idle keep-alive connection is closed too
        with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as sock:
            sock.sendall(b"GET /api/v1/ HTTP/1.1\r\nHost: x\r\n\r\n")
            began = time.monotonic()
            answer = read_until_closed(sock, 10)
            assert answer.startswith(b"HTTP/1.1 200")
            assert time.monotonic() - began < 5
        # and the service still answers
        assert svc.get("/").status_code == 200


# ---- 9. idempotent submissions ---------------------------------------------------------------


def test_a_retried_submission_with_its_key_answers_the_first_slice(service):
    bob = service.token("bob")
    headers = {"Idempotency-Key": "retry-1"}
    first = submit(service, bob, headers=headers)
    again = submit(service, bob, headers=headers)
    assert first.status_code == again.status_code == 201
    assert again.json()["id"] == first.json()["id"]
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert "Idempotent-Replayed" not in first.headers
    mine = service.get("/slices", token=bob).json()["slices"]
    assert [s["id"] for s in mine].count(first.json()["id"]) == 1 and len(mine) == 1

    # the same key with another request is a conflict, and makes nothing
    other = submit(service, bob, headers=headers, body={"gpus": 2})
    assert_json_error(other, 409, "conflict")
    # another user's key is theirs alone
    alice = service.token("alice")
    theirs = submit(service, alice, headers=headers)
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]
    # a replay after the slice ended still answers it, as it is now
    service.delete(f"/slices/{first.json()['id']}", token=bob)
    late = submit(service, bob, headers=headers)
    assert (late.json()["id"], late.json()["state"]) == (first.json()["id"], "ended")
    assert len(service.get("/slices", token=bob).json()["slices"]) == 1


@pytest.mark.parametrize("key", ["", "has space", "k" * 256, "caf\u00e9"])
def test_a_malformed_idempotency_key_is_a_400(service, key):
    response = submit(service, service.token("carol"), body={"project": "nlp"},
                      headers={"Idempotency-Key": key.encode("utf-8")})  # fmt: skip
    assert_json_error(response, 400)
    assert (
        service.get("/slices", token=service.admin_token, params={"user": "carol"}).json()["slices"]
        == []
    )
