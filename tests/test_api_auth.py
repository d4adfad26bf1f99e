"""Who may do what: the authorization matrix, against a real ``python -m broker.service``.

Callers: anonymous (no token), a token nobody issued, ``alice`` (member of
vision), ``bob`` (another member of vision), ``dave`` (member of nothing), an
agent token (``spawner``) and an admin token (``root``). The slice in each case
belongs to alice and is made fresh for the case, so cases do not depend on
each other. Another user's slice answers 404, exactly like no slice.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from servicefixtures import BrokerService, running_service

CALLERS = ("anonymous", "forged", "alice", "bob", "dave", "agent", "admin")


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[BrokerService]:
    with running_service(tmp_path_factory.mktemp("auth")) as service:
        yield service


@pytest.fixture(scope="module")
def tokens(service) -> dict[str, str | None]:
    return {
        "anonymous": None,
        "forged": "sb_1_not-a-real-secret",
        "alice": service.token("alice"),
        "bob": service.token("bob"),
        "dave": service.token("dave"),
        "agent": service.token("spawner", agent=True),
        "admin": service.admin_token,
    }


@dataclass(frozen=True)
class Case:
    """``who`` calls ``method path`` (``{slice}``: a fresh slice of alice's) and gets ``status``."""

    name: str
    who: str
    method: str
    path: str
    status: int
    json: Any = None
    params: Any = None


VISION = {"project": "vision", "gpus": 1, "kind": "batch", "min_runtime": 0}
NLP = {"project": "nlp", "gpus": 1, "kind": "batch", "min_runtime": 0}

CASES = [
    # unauthenticated routes
    Case("anyone reads the version", "anonymous", "GET", "/", 200),
    Case("anyone reads the OpenAPI document", "anonymous", "GET", "/openapi.json", 200),
    # identity
    Case("anonymous callers are asked for a token", "anonymous", "GET", "/whoami", 401),
    Case("a forged token is refused", "forged", "GET", "/whoami", 401),
    Case("a user sees who they are", "alice", "GET", "/whoami", 200),
    Case("a user may not look as another", "alice", "GET", "/whoami", 403, params={"user": "bob"}),
    Case("an agent looks as a user", "agent", "GET", "/whoami", 200, params={"user": "bob"}),
    Case("an admin looks as a user", "admin", "GET", "/whoami", 200, params={"user": "bob"}),
    # requesting slices
    Case("anonymous callers cannot request", "anonymous", "POST", "/slices", 401, json=VISION),
    Case("a member requests for their project", "alice", "POST", "/slices", 201, json=VISION),
    Case("a non-member may not charge a project", "dave", "POST", "/slices", 403, json=VISION),
    Case("a member of another project may not", "alice", "POST", "/slices", 403, json=NLP),
    Case(
        "a user may not request for another",
        "alice",
        "POST",
        "/slices",
        403,
        json=VISION | {"user": "bob"},
    ),
    Case(
        "a user may not claim a group",
        "dave",
        "POST",
        "/slices",
        403,
        json=NLP | {"groups": ["nlp-team"]},
    ),
    Case(
        "an agent requests for a member",
        "agent",
        "POST",
        "/slices",
        201,
        json=VISION | {"user": "bob"},
    ),
    Case(
        "an agent requests for a group member",
        "agent",
        "POST",
        "/slices",
        201,
        json=NLP | {"user": "erin", "groups": ["nlp-team"]},
    ),
    Case(
        "an agent may not charge what the user may not",
        "agent",
        "POST",
        "/slices",
        403,
        json=NLP | {"user": "bob"},
    ),
    Case("an admin charges any project", "admin", "POST", "/slices", 201, json=NLP),
    Case(
        "an admin requests for anyone",
        "admin",
        "POST",
        "/slices",
        201,
        json=NLP | {"user": "dave"},
    ),
    # listing
    Case("anonymous callers cannot list", "anonymous", "GET", "/slices", 401),
    Case("a user lists their slices", "alice", "GET", "/slices", 200),
    Case("a user may not list another's", "alice", "GET", "/slices", 403, params={"user": "bob"}),
    Case("an agent lists anyone's", "agent", "GET", "/slices", 200, params={"user": "bob"}),
    Case("an admin lists everything", "admin", "GET", "/slices", 200),
    # one slice (alice's)
    *[
        Case(f"{who_says} {what} a slice", who, method, f"/slices/{{slice}}{suffix}", status)
        for what, method, suffix in [
            ("reads", "GET", ""),
            ("waits on", "GET", "?wait=0.01"),
            ("heartbeats", "POST", "/heartbeat"),
            ("reads the events of", "GET", "/events"),
            ("releases", "DELETE", ""),
        ]
        for who, who_says, status in [
            ("anonymous", "an anonymous caller never", 401),
            ("forged", "a forged token never", 401),
            ("alice", "its owner", 200),
            ("bob", "another user gets 404 when he", 404),
            ("dave", "a non-member gets 404 when he", 404),
            ("agent", "an agent", 200),
            ("admin", "an admin", 200),
        ]
    ],
    # a checkpoint, an extension: those allowed reach the slice, which holds no GPUs yet
    *[
        Case(f"{who_says} {what} a waiting slice", who, "POST", path, status, json=body)
        for what, path, body in [
            ("a checkpoint of", "/slices/{slice}/checkpoint", None),
            ("more protection for", "/slices/{slice}/protection", {"extend_by": "30m"}),
        ]
        for who, who_says, status in [
            ("anonymous", "an anonymous caller never asks", 401),
            ("forged", "a forged token never asks", 401),
            ("alice", "its owner is refused (409)", 409),
            ("bob", "another user gets 404 for", 404),
            ("dave", "a non-member gets 404 for", 404),
            ("agent", "an agent is refused (409)", 409),
            ("admin", "an admin is refused (409)", 409),
        ]
    ],
    # projects
    Case("anonymous callers cannot see projects", "anonymous", "GET", "/projects", 401),
    Case("a user sees the project tree", "dave", "GET", "/projects", 200),
    Case("a member reads their project's usage", "alice", "GET", "/projects/vision/usage", 200),
    Case("a non-member may not read usage", "dave", "GET", "/projects/vision/usage", 403),
    Case("another project's usage is closed", "alice", "GET", "/projects/nlp/usage", 403),
    Case("an agent reads any usage", "agent", "GET", "/projects/nlp/usage", 200),
    Case("an admin reads any usage", "admin", "GET", "/projects/lab/usage", 200),
    Case("users may not change projects", "alice", "PUT", "/projects/x", 403, json={"share": 2}),
    Case("agents may not change projects", "agent", "PUT", "/projects/x", 403, json={"share": 2}),
    Case(
        "anonymous callers may not change projects",
        "anonymous",
        "PUT",
        "/projects/x",
        401,
        json={"share": 2},
    ),
    Case("an admin changes projects", "admin", "PUT", "/projects/vision", 200, json={"share": 1}),
    # nodes
    Case("anonymous callers cannot see nodes", "anonymous", "GET", "/nodes", 401),
    Case("a user sees the nodes", "dave", "GET", "/nodes", 200),
    *[
        Case(
            f"{who} {'may' if status == 200 else 'may not'} {action} a node",
            who,
            "POST",
            f"/nodes/n1/{action}",
            status,
        )
        for action in ("drain", "undrain", "down", "undrain")
        for who, status in [("anonymous", 401), ("alice", 403), ("agent", 403), ("admin", 200)]
    ],
    # metrics
    Case("anonymous callers cannot scrape metrics", "anonymous", "GET", "/metrics", 401),
    Case("any user may scrape metrics", "dave", "GET", "/metrics", 200),
]


def _unique(cases: list[Case]) -> list[Case]:
    seen: dict[str, int] = {}
    out = []
    for case in cases:
        seen[case.name] = seen.get(case.name, 0) + 1
        out.append(case if seen[case.name] == 1 else _renamed(case, seen[case.name]))
    return out


def _renamed(case: Case, n: int) -> Case:
    return replace(case, name=f"{case.name} ({n})")


@pytest.mark.parametrize("case", _unique(CASES), ids=lambda c: c.name)
def test_authorization(service, tokens, case: Case):
    path = case.path
    if "{slice}" in path:
        made = service.post(
            "/slices", token=tokens["admin"], json=VISION | {"user": "alice", "kind": "batch"}
        )
        assert made.status_code == 201, made.text
        path = path.replace("{slice}", str(made.json()["id"]))
    reply = service.request(
        case.method, path, token=tokens[case.who], json=case.json, params=case.params
    )
    assert reply.status_code == case.status, reply.text
    if case.status >= 400:
        assert reply.headers["Content-Type"].startswith("application/json")
        assert set(reply.json()) == {"error"} and set(reply.json()["error"]) == {"code", "message"}


def test_every_caller_appears_in_the_matrix():
    assert {case.who for case in CASES} == set(CALLERS)


def test_users_see_only_their_own_slices_in_lists(service, tokens):
    for who in ("alice", "bob", "dave"):
        listed = service.get("/slices", token=tokens[who]).json()["slices"]
        assert {s["user"] for s in listed} <= {who}, who


def test_an_admin_from_the_configuration_is_admin_with_a_plain_token(service):
    token = service.token("root")  # root is in the file's admins
    assert service.get("/whoami", token=token).json()["admin"] is True


def test_tokens_never_reach_the_log(service, tokens):
    for token in tokens.values():
        service.get("/whoami", token=token)
        service.post("/slices", token=token, data=b"{broken")
        service.get("/slices/1", token=token, params={"wait": 0.01})
    log = service.log_text()
    assert "GET /api/v1/whoami" in log  # the log does record requests
    for who, token in tokens.items():
        if token is not None:
            secret = token.split("_", 2)[2]  # sb_<id>_<secret>; the secret may hold "_"
            assert token not in log and secret not in log, who
