"""Hostile input against a real ``python -m broker.service``: the login goes nowhere
else, bodies are parsed strictly, every error is JSON (tornado's HTTP layer included)
and the pages' XSRF token belongs to one login.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
from servicefixtures import BrokerService, running_service


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[BrokerService]:
    with running_service(tmp_path_factory.mktemp("hardening")) as service:
        yield service


def log_in(
    service: BrokerService, token: str, next_target: str = ""
) -> tuple[requests.Session, requests.Response]:
    """A browser's login through the form: its session and the login's answer."""
    session = requests.Session()
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
