"""The database is the record of the project tree: admin changes last across restarts,
every change is an event, the cluster file is applied only on purpose, projects can be
deleted. Every test runs on SQLite and PostgreSQL."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import pytest

from broker.config import parse_config
from broker.errors import Conflict, InvalidRequest, NotFound
from broker.store import Broker
from tests.test_store import ask, cluster


@pytest.fixture
def open_broker(db_url, clock) -> Iterable[Callable[..., Broker]]:
    opened: list[Broker] = []

    def open_(config: dict | None = None, **kwargs) -> Broker:
        kwargs.setdefault("clock", clock)
        broker = Broker(db_url, parse_config(config or cluster(), "cluster.toml"), **kwargs)
        opened.append(broker)
        return broker

    yield open_
    for broker in opened:
        broker.close()


def tree(broker: Broker) -> dict[str, tuple]:
    return {
        p["name"]: (p["share"], p["parent"], p["users"], p["groups"]) for p in broker.projects()
    }


def test_admin_changes_survive_a_restart_and_show_in_a_second_broker(open_broker, clock):
    first = open_broker()
    first.put_project("vision", share=5, parent="org", users=["alice", "carol"], who="root")
    first.put_project("speech", share=2, parent="org", users=["dan"], who="root")
    first.delete_project("nlp", who="root")
    changed = tree(first)
    assert changed["vision"] == (5.0, "org", ["alice", "carol"], ["cv"])
    second = open_broker()  # another broker on the same database, opened with the same file
    assert tree(second) == changed
    first.close()
    clock.advance(60)
    restarted = open_broker()
    assert tree(restarted) == changed
    assert ask(restarted, user="dan", project="speech")["state"] == "pending"


def test_the_file_seeds_only_the_first_start_and_the_log_says_where_the_tree_came_from(
    open_broker, caplog
):
    with caplog.at_level(logging.INFO, logger="broker.store"):
        open_broker()
    assert "project tree: seeded from the cluster file cluster.toml (3 accounts)" in caplog.text
    caplog.clear()
    other = cluster(projects={"solo": {"users": ["zed"]}})
    with caplog.at_level(logging.INFO, logger="broker.store"):
        broker = open_broker(other)
    assert "project tree: from the database (3 accounts)" in caplog.text
    assert "differs in 4 accounts and is not applied" in caplog.text
    assert set(tree(broker)) == {"org", "vision", "nlp"}
    seeds = broker.project_events()
    assert [(e["account"], e["action"], e["who"]) for e in seeds] == [
        ("nlp", "seed", "file cluster.toml"),
        ("org", "seed", "file cluster.toml"),
        ("vision", "seed", "file cluster.toml"),
    ]
    assert seeds[2]["before"] is None
    assert seeds[2]["after"] == {
        "share": 3.0,
        "parent": "org",
        "users": ["alice"],
        "groups": ["cv"],
    }


def test_every_change_is_an_event_with_who_and_when(open_broker, clock):
    broker = open_broker()
    clock.advance(100)
    broker.put_project("nlp", share=2, parent="org", who="root")
    broker.put_project("nlp", share=2, parent="org", who="root")  # no change: no event
    clock.advance(5)
    broker.put_project("nlp", share=2, parent="org", groups=["linguists"], who="ada")
    events = broker.project_events("nlp")
    assert [(e["action"], e["who"], e["at"]) for e in events] == [
        ("seed", "file cluster.toml", clock.now - 105),
        ("set", "root", clock.now - 5),
        ("set", "ada", clock.now),
    ]
    assert (events[1]["before"]["share"], events[1]["after"]["share"]) == (1.0, 2.0)
    assert (events[2]["before"]["groups"], events[2]["after"]["groups"]) == ([], ["linguists"])
    assert len(broker.project_events()) == 5


def test_apply_tree_shows_the_difference_then_applies_it_as_events(open_broker, clock):
    broker = open_broker()
    before = tree(broker)
    wanted = [
        {"name": "org", "share": 1},
        {"name": "vision", "share": 3, "parent": "org", "users": ["alice"], "groups": []},
        {"name": "speech", "share": 1, "parent": "org", "users": ["dan"]},
    ]
    changes = broker.apply_tree(wanted, who="root", dry_run=True)
    assert [(c["account"], c["change"]) for c in changes] == [
        ("nlp", "removed"),
        ("speech", "added"),
        ("vision", "changed"),
    ]
    assert changes[2]["before"]["groups"] == ["cv"] and changes[2]["after"]["groups"] == []
    assert tree(broker) == before  # a dry run changes nothing
    clock.advance(10)
    assert broker.apply_tree(wanted, who="root") == changes
    assert set(tree(broker)) == {"org", "vision", "speech"}
    assert tree(broker)["vision"] == (3.0, "org", ["alice"], [])
    applied = [e for e in broker.project_events() if e["action"] == "apply"]
    assert [(e["account"], e["who"], e["at"]) for e in applied] == [
        ("nlp", "root", clock.now),
        ("speech", "root", clock.now),
        ("vision", "root", clock.now),
    ]
    assert broker.apply_tree(wanted, who="root") == []


def test_apply_tree_refuses_a_bad_tree_and_removing_a_busy_project(open_broker):
    broker = open_broker()
    with pytest.raises(InvalidRequest, match="listed twice"):
        broker.apply_tree([{"name": "a", "share": 1}, {"name": "a", "share": 1}])
    with pytest.raises(InvalidRequest):
        broker.apply_tree([{"name": "a", "share": 1, "parent": "nowhere"}])
    ask(broker, user="bob", project="nlp")
    with pytest.raises(Conflict, match="'nlp' has live slices"):
        broker.apply_tree([{"name": "org", "share": 1}, {"name": "vision", "parent": "org"}])
    assert set(tree(broker)) == {"org", "vision", "nlp"}


def test_deleting_a_project_is_refused_while_busy_or_a_parent(open_broker):
    broker = open_broker()
    with pytest.raises(NotFound):
        broker.delete_project("nobody")
    with pytest.raises(Conflict, match="sub-accounts"):
        broker.delete_project("org")
    made = ask(broker, user="bob", project="nlp")
    with pytest.raises(Conflict, match="1 live slice"):
        broker.delete_project("nlp")
    broker.release(made["id"])
    broker.delete_project("nlp", who="root")
    assert set(tree(broker)) == {"org", "vision"}
    assert broker.project_events("nlp")[-1]["after"] is None
    assert broker.get_slice(made["id"])["project"] == "nlp"  # history stays
    with pytest.raises(Conflict):
        broker.delete_project("org")
    broker.delete_project("vision")
    broker.delete_project("org")
    assert broker.projects() == []
