"""The store's own guards, on SQLite and PostgreSQL: idempotent submissions, member
names, and the project tree rules ``PUT /projects`` relies on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from builders import by_principal

from broker.config import parse_config
from broker.errors import Conflict, InvalidRequest
from broker.store import Broker

CLUSTER = {
    "admins": ["root"],
    "policy": {"project_gpu_caps": {"capped": 2}},
    "gpu_types": {"h100": 1.0},
    "nodes": [{"name": "h0", "gpu_type": "h100", "gpus": 4}],
    "projects": {
        "org": {},
        "vision": {"parent": "org", "users": ["alice"]},
        "empty": {"parent": "org"},
        "capped": {"parent": "org", "users": ["carol"]},
    },
}


@pytest.fixture
def broker(db_url, clock) -> Iterator[Broker]:
    broker = Broker(db_url, parse_config(CLUSTER), clock=clock)
    yield broker
    broker.close()


def request(**changes) -> dict:
    return by_principal(
        {"user": "alice", "project": "vision", "gpus": 1, "kind": "batch"} | changes
    )


def test_a_replayed_key_answers_the_first_slice_and_writes_nothing(broker):
    first, new = broker.submit_once(**request(), idempotency_key="k1")
    again, replayed_new = broker.submit_once(**request(), idempotency_key="k1")
    assert (new, replayed_new) == (True, False)
    assert again == first
    assert len(broker.list_slices()) == 1
    assert [e["to_state"] for e in broker.events(first["id"])] == ["pending"]

    # without a key, or with another, a new slice
    assert broker.submit(**request())["id"] != first["id"]
    assert broker.submit(**request(), idempotency_key="k2")["id"] != first["id"]
    # keys are per user
    other = broker.submit(**request(user="root", admin=True), idempotency_key="k1")
    assert other["id"] != first["id"]


def test_a_key_reused_for_another_request_is_a_conflict(broker):
    broker.submit(**request(), idempotency_key="k1")
    with pytest.raises(Conflict):
        broker.submit(**request(gpus=2), idempotency_key="k1")
    assert len(broker.list_slices()) == 1


@pytest.mark.parametrize("name", ["a\x00", "a\n", "\x1b[0m", "b\x7f"])
def test_names_with_control_characters_are_refused_and_nothing_changes(broker, name):
    for key in ("users", "groups"):
        with pytest.raises(InvalidRequest):
            broker.put_project("vision", share=1, parent="org", **{key: ["alice", name]})
    with pytest.raises(InvalidRequest):
        broker.submit(**request(user=name, admin=True))
    with pytest.raises(InvalidRequest):
        broker.submit(**request(groups=[name]))
    vision = next(p for p in broker.projects() if p["name"] == "vision")
    assert vision["users"] == ["alice"]


def test_a_project_with_members_or_a_cap_does_not_become_a_parent(broker):
    with pytest.raises(Conflict, match="members"):
        broker.put_project("sub", share=1, parent="vision")
    with pytest.raises(Conflict, match="cap"):
        broker.put_project("sub", share=1, parent="capped")
    names = {p["name"] for p in broker.projects()}
    assert "sub" not in names
    # a project without members, caps or work may
    broker.put_project("sub", share=1, parent="empty")
    tree = {p["name"]: p["is_project"] for p in broker.projects()}
    assert (tree["empty"], tree["sub"]) == (False, True)
