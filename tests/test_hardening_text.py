"""The free-text rule (broker.validation.check_text) holds on every database alike: what
one of them would refuse with an error of its own (PostgreSQL and NUL) is a 400 first."""

from __future__ import annotations

import pytest
from servicefixtures import serving_in_process
from test_store import cluster

from broker.config import parse_config
from broker.errors import InvalidRequest
from broker.store import Broker
from broker.validation import REASON_MAX_LENGTH, check_text


@pytest.mark.parametrize("text", ["a\x00b", "a\x01", "\x9f", "tab\there", "a\ud800"])
def test_check_text_refuses_control_characters_and_lone_surrogates(text):
    with pytest.raises(InvalidRequest):
        check_text(text, "reason", REASON_MAX_LENGTH)


def test_check_text_keeps_plain_unicode_and_refuses_the_over_long():
    assert check_text("GPU 3 fällt aus — ✓", "reason", REASON_MAX_LENGTH)
    with pytest.raises(InvalidRequest, match="longer than 1000"):
        check_text("x" * 1001, "reason", REASON_MAX_LENGTH)


async def test_a_nul_in_a_nodes_reason_is_a_400_on_every_database(db_url):
    async with serving_in_process(db_url) as api:
        admin = api.admin_token
        reply = await api.call("POST", "/nodes/n0/down", token=admin, json={"reason": "a\x00b"})
        assert reply.status == 400, reply.text
        assert reply.json["error"]["code"] == "invalid_request"
        with pytest.raises(InvalidRequest, match="control character"):
            api.broker.set_node_state("n0", "down", "a\x00b")  # the store holds the rule too
        nodes = (await api.call("GET", "/nodes", token=admin)).json["nodes"]
        assert nodes[0]["state"] == "ready"


@pytest.mark.parametrize(
    ("users", "problem"),
    [
        (["x" * 256], "1 to 255 characters"),
        (["carol\x85"], "control characters"),  # C1: refused as C0 and DEL are
        (["carol\x00"], "control characters"),
    ],
)
def test_the_store_holds_member_names_to_the_same_rule(db_url, clock, users, problem):
    broker = Broker(db_url, parse_config(cluster()), clock=clock)
    try:
        with pytest.raises(InvalidRequest, match=problem):
            broker.put_project("nlp", share=1.0, parent="org", users=users, who="root")
        kept = broker.put_project("nlp", share=1.0, parent="org", users=["x" * 255], who="root")
    finally:
        broker.close()
    assert kept["users"] == ["x" * 255]


def test_the_store_refuses_a_tree_with_a_blank_or_over_long_account_name(db_url, clock):
    # A survivor of the mutation sample: the account name check's `or`s -> `and`.
    broker = Broker(db_url, parse_config(cluster()), clock=clock)
    try:
        for name in ("", "   ", "x" * 256, 7):
            with pytest.raises(InvalidRequest, match="needs a name"):
                broker.apply_tree([{"name": name, "share": 1.0}], who="root")
        names = {project["name"] for project in broker.projects()}
    finally:
        broker.close()
    assert names == {"org", "vision", "nlp"}
