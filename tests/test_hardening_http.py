"""Hostile input against a real ``python -m broker.service``: the login goes nowhere
else, bodies are parsed strictly, every error is JSON (tornado's HTTP layer included)
and the pages' XSRF token belongs to one login.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Iterator

import pytest
import requests
from servicefixtures import BrokerService, running_service, serving_in_process
from test_edge_http import MiB, assert_json_error, parse_answer, raw_exchange


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[BrokerService]:
    with running_service(tmp_path_factory.mktemp("hardening")) as service:
        yield service


def log_in(
    service: BrokerService, token: str, next_target: str = ""
) -> tuple[requests.Session, requests.Response]:
    """A browser's login through the form: its session and the login's answer."""
    session = requests.Session()
    session.headers["Connection"] = "close"  # no idle connection for the service to wait on
    form = session.get(service.url + "login", timeout=10)
    assert form.status_code == 200, form.text[:300]
    answer = session.post(
        service.url + "login",
        data={"_xsrf": session.cookies["_xsrf"], "token": token, "next": next_target},
        allow_redirects=False,
        timeout=10,
    )
    return session, answer


# ---- 1. the login's redirect ------------------------------------------------------------


@pytest.mark.parametrize(
    "target", ["/\\evil.example/", "/\\/evil.example/", "/\t/evil.example/", "/%5Cevil.example/"]
)
def test_the_login_never_redirects_to_another_site(service, target):
    _session, answer = log_in(service, service.token("alice"), target)
    assert answer.status_code == 302, answer.text[:300]
    assert answer.headers["Location"] == "/gpus"


def test_the_login_returns_to_the_page_that_sent_there(service):
    _session, answer = log_in(service, service.token("alice"), "/usage?project=vision")
    assert (answer.status_code, answer.headers["Location"]) == (302, "/usage?project=vision")


# ---- 2. strict bodies ---------------------------------------------------------------------

SLICE = '{"project": "vision", "gpus": 1, "kind": "batch", "min_runtime": "1h"}'


def slice_count(service: BrokerService) -> int:
    return len(service.get("/slices", token=service.admin_token).json()["slices"])


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "text/json"],
)
def test_a_json_body_sent_as_another_type_is_a_415_and_creates_nothing(service, content_type):
    before = slice_count(service)
    headers = {"Content-Type": content_type} if content_type else {}
    alice = service.token("alice")
    response = service.post("/slices", token=alice, data=SLICE, headers=headers)
    assert_json_error(response, 415, "unsupported_media_type")
    assert slice_count(service) == before


def test_a_json_content_type_with_a_charset_is_taken(service):
    alice = service.token("alice")
    headers = {"Content-Type": "Application/JSON; charset=utf-8"}
    response = service.post("/slices", token=alice, data=SLICE, headers=headers)
    assert response.status_code == 201, response.text
    service.delete(f"/slices/{response.json()['id']}", token=alice)


@pytest.mark.parametrize(
    "body",
    [
        '{"project": "nlp", "gpus": 1, "kind": "batch", "project": "vision"}',
        '{"project": "vision", "gpus": 1, "kind": "batch", "gpus": 1}',
        '{"share": 1, "users": ["a"], "groups": [], "users": ["b"]}',
    ],
)
def test_a_body_with_a_key_twice_is_a_400_and_creates_nothing(service, body):
    before = slice_count(service)
    path = "/projects/vision" if "share" in body else "/slices"
    method = "PUT" if "share" in body else "POST"
    headers = {"Content-Type": "application/json"}
    response = service.request(method, path, token=service.admin_token, data=body, headers=headers)
    error = assert_json_error(response, 400, "invalid_json")
    assert "twice" in error["message"]
    assert slice_count(service) == before


@pytest.mark.parametrize("char", ["\x00", "\x1b", "\n", "\x7f", "\x85", "\ud800"])
def test_control_characters_in_a_nodes_reason_are_a_400(service, char):
    body = json.dumps({"reason": f"disk{char}failed"})
    headers = {"Content-Type": "application/json"}
    response = service.post(
        "/nodes/n1/drain", token=service.admin_token, data=body, headers=headers
    )
    assert_json_error(response, 400, "invalid_request")
    assert service.get("/nodes", token=service.admin_token).json()["nodes"][1]["state"] == "ready"


def test_a_reason_over_1000_characters_is_a_400(service):
    response = service.post(
        "/nodes/n1/drain", token=service.admin_token, json={"reason": "x" * 1001}
    )
    assert_json_error(response, 400, "invalid_request")


# ---- 3. errors of the HTTP layer ----------------------------------------------------------

MALFORMED = {
    "Content-Length and Transfer-Encoding": (
        b"POST /api/v1/slices HTTP/1.1\r\nHost: x\r\nAuthorization: token {admin}\r\n"
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "a NUL in a header": b"GET /api/v1/ HTTP/1.1\r\nHost: x\r\nX-Note: a\x00b\r\n\r\n",
    "a header line without a colon": b"GET /api/v1/ HTTP/1.1\r\nHost: x\r\nnocolon\r\n\r\n",
    "no HTTP start line": b"GARBAGE\r\n\r\n",
    "a chunk size that is no number": (
        b"POST /api/v1/slices HTTP/1.1\r\nHost: x\r\nAuthorization: token {admin}\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n"
    ),
    "a page action with both lengths": (
        b"POST /ui/slices/1/release HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
}


@pytest.mark.parametrize("request_bytes", MALFORMED.values(), ids=MALFORMED)
def test_a_request_tornado_cannot_parse_is_a_json_400(service, request_bytes):
    request_bytes = request_bytes.replace(b"{admin}", service.admin_token.encode())
    raw = raw_exchange(service.port, request_bytes)
    assert raw.startswith(b"HTTP/1.1 400 "), raw[:300]
    assert b"\r\nContent-Type: application/json" in raw.partition(b"\r\n\r\n")[0]
    status, body = parse_answer(raw)
    assert (status, body["error"]["code"]) == (400, "bad_request")
    assert "not valid HTTP/1.1" in body["error"]["message"]


def test_headers_over_the_read_limit_close_the_connection_without_a_bare_answer(service):
    # The documented exception (broker.service.httpserver): past 1 MiB of headers tornado's
    # stream closes the socket itself. What the client reads is nothing (a close or a
    # reset), never a non-JSON answer, and the service serves the next request.
    received = b""
    with socket.create_connection(("127.0.0.1", service.port), timeout=10) as sock:
        try:
            sock.sendall(b"GET /api/v1/ HTTP/1.1\r\nX-Pad: " + b"a" * (2 * MiB) + b"\r\n\r\n")
            while chunk := sock.recv(65536):
                received += chunk
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert received == b""
    assert service.get("/").status_code == 200


# ---- 4. the pages' XSRF token belongs to one login ---------------------------------------


def page_xsrf(session: requests.Session, service: BrokerService) -> str:
    """The XSRF token a logged-in page carries for its script."""
    page = session.get(service.url + "gpus", timeout=10)
    assert page.status_code == 200, page.text[:300]
    return re.search(r'data-xsrf="([^"]+)"', page.text).group(1)


def test_one_logins_session_with_another_logins_xsrf_token_is_refused(service):
    alice_session, _ = log_in(service, service.token("alice"))
    bob_token = service.token("bob")
    bob_session, _ = log_in(service, bob_token)
    held = service.post(
        "/slices", token=bob_token, json={"project": "vision", "gpus": 1, "kind": "interactive"}
    ).json()
    release = f"{service.url}ui/slices/{held['id']}/release"
    # bob's session cookie, alice's _xsrf cookie and her page's token: a forged release
    forged = requests.Session()
    forged.headers["Connection"] = "close"
    forged.cookies.set("slicebroker-token", bob_session.cookies["slicebroker-token"])
    forged.cookies.set("_xsrf", alice_session.cookies["_xsrf"])
    refused = forged.post(
        release, headers={"X-XSRFToken": page_xsrf(alice_session, service)}, timeout=10
    )
    assert_json_error(refused, 403, "xsrf")
    assert service.get(f"/slices/{held['id']}", token=bob_token).json()["state"] != "ended"
    # bob's own page's token releases it
    own = bob_session.post(
        release, headers={"X-XSRFToken": page_xsrf(bob_session, service)}, timeout=10
    )
    assert own.status_code == 200, own.text
    assert service.get(f"/slices/{held['id']}", token=bob_token).json()["state"] == "ended"


@pytest.mark.parametrize("path", ["/api/v1/slices", "/ui/slices/1/release"])
async def test_a_request_the_http_layer_cuts_off_is_not_left_in_flight(tmp_path, path):
    # Else a stopping service waits for it the whole stop timeout (5 s).
    async with serving_in_process(f"sqlite:///{tmp_path}/b.sqlite") as api:
        reader, writer = await asyncio.open_connection("127.0.0.1", api.port)
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: token {api.admin_token}\r\n"
            "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode()
        )
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 400 ")
        try:
            await asyncio.wait_for(api.in_flight.idle(), 10)
        except TimeoutError:
            stuck = api.in_flight.count
            for _ in range(stuck):  # so that the fixture's stop does not wait for ever
                api.in_flight.leave()
            pytest.fail(f"{stuck} request(s) still in flight after the connection closed")
