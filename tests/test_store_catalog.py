"""A single writer keeps the catalog (nodes, GPU types, the project tree, members) and
the live slices in memory (design.md §8): it must answer exactly as a Broker that
reads every time."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from builders import by_principal
from sqlalchemy import event

from broker.config import parse_config
from broker.core.model import Node, NodeState
from broker.errors import BrokerError
from broker.store import Broker
from broker.store import journal as journal_module
from broker.store.access import NotYours, Principal
from tests.test_store import ask, cluster

USERS = ("alice", "bob", "carol")
PROJECTS = ("vision", "nlp", "speech")


def random_step(rng: random.Random) -> tuple[str, Any]:
    """One request of a random workload: mostly slices, with catalog changes mixed in."""
    kind = rng.choice(
        ["submit"] * 5 + ["release"] * 2 + ["pass"] * 2 + ["heartbeat", "late pass"]
        + ["heartbeats"]
        + ["checkpoint", "extend"]
        + ["put_project", "delete_project", "apply_tree", "node", "inventory"]
    )  # fmt: skip
    if kind == "submit":
        return kind, {
            "user": rng.choice(USERS),
            "project": rng.choice(PROJECTS),
            "gpus": rng.choice([1, 2, 4, 5]),
            "kind": rng.choice(["batch", "interactive"]),
            "gpu_type": rng.choice([None, "h100", "b200", "a100"]),
        }
    if kind in ("release", "heartbeat", "checkpoint"):
        return kind, rng.randrange(1, 40)
    if kind == "extend":
        return kind, (rng.randrange(1, 40), rng.choice([600.0, 7200.0]))
    if kind == "heartbeats":  # a hub's, together: its own slices, others', gone ones
        hub = [None, Principal("hub", agent=True, kind="service")] * 2  # reach every slice
        callers = [*hub, *(Principal(user) for user in USERS)]
        return kind, [
            (rng.randrange(1, 40), rng.choice(callers)) for _ in range(rng.randrange(2, 16))
        ]
    if kind == "put_project":
        return kind, {
            "name": rng.choice(PROJECTS),
            "share": rng.choice([1.0, 2.0, -1.0]),
            "parent": rng.choice(["org", None, "nowhere"]),
            "users": rng.sample(USERS, rng.randrange(len(USERS) + 1)),
        }
    if kind == "delete_project":
        return kind, rng.choice(PROJECTS)
    if kind == "apply_tree":
        return kind, [
            {"name": "org", "share": 1.0, "parent": None},
            *(
                {"name": name, "share": rng.choice([1.0, 3.0]), "parent": "org",
                 "users": rng.sample(USERS, rng.randrange(len(USERS) + 1)), "groups": []}
                for name in rng.sample(PROJECTS, rng.randrange(1, len(PROJECTS) + 1))
            ),
        ]  # fmt: skip
    if kind == "node":
        return kind, (rng.choice(["h0", "b0", "x9"]), rng.choice(["draining", "ready", "down"]))
    if kind == "inventory":
        gpu_type = rng.choice(["h100", "a100"])
        return kind, [Node("h0", "h100", 4), Node("b0", "b200", 4), Node("a0", gpu_type, 2)]
    return kind, None


def apply(broker: Broker, kind: str, argument: Any) -> Any:
    """The step's answer, or the refusal's type and message: both must agree."""
    try:
        if kind == "submit":
            return broker.submit(**by_principal(argument))
        if kind == "release":
            return broker.release(argument)
        if kind == "heartbeat":
            return broker.heartbeat(argument)
        if kind == "checkpoint":
            return broker.checkpoint(argument)
        if kind == "heartbeats":  # each answer a slice or its own refusal
            return [
                (type(answer).__name__, str(answer)) if isinstance(answer, BrokerError) else answer
                for answer in broker.heartbeats(argument)
            ]
        if kind == "extend":
            return broker.extend_protection(*argument)
        if kind == "late pass":  # the last pass long ago: leases are extended first
            return broker.run_pass_and_live(usual_gap=60.0)
        if kind == "put_project":
            return broker.put_project(**argument)
        if kind == "delete_project":
            return broker.delete_project(argument)
        if kind == "apply_tree":
            return broker.apply_tree(argument)
        if kind == "node":
            return broker.set_node_state(*argument)
        if kind == "inventory":
            return broker.sync_inventory(argument)
        return broker.run_pass()
    except BrokerError as err:
        return type(err).__name__, str(err)


@pytest.mark.parametrize("seed", range(6))
def test_a_single_writer_answers_as_a_broker_that_reads_every_time(tmp_path, clock, seed):
    config = parse_config(cluster())
    kept = Broker(
        f"sqlite:///{tmp_path / 'kept.sqlite'}", config, clock, lease=900.0, single_writer=True
    )
    read = Broker(f"sqlite:///{tmp_path / 'read.sqlite'}", config, clock, lease=900.0)
    rng = random.Random(seed)
    filters = random.Random(-seed)  # apart, so that the workloads stay as they were
    published = 0  # steps after which the last commit's state was there to read
    try:
        for number in range(120):
            kind, argument = random_step(rng)
            assert apply(kept, kind, argument) == apply(read, kind, argument), (number, kind)
            if kind in ("pass", "late pass"):  # the kept index took in what the pass wrote
                wakes = [
                    b.next_wake(clock() + ahead) for b in (kept, read) for ahead in (-1, 0, 60)
                ]
                assert wakes[:3] == wakes[3:], (number, kind)
            # What the step left, read as the event loop reads it (before any other read
            # of the kept Broker's): as the database has it.
            live = read.list_slices(state="live")
            committed = kept.committed_live_slices()
            assert committed in (None, live), (number, kind)
            assert kept.committed_nodes() in (None, read.nodes()), (number, kind)
            for answer in filters.sample(live, min(3, len(live))):
                assert kept.committed_slice(answer["id"]) in (None, answer), (number, kind)
            published += committed is not None
            clock.advance(rng.choice([0, 30, 600]))
            assert kept.projects() == read.projects(), (number, kind)
            assert kept.nodes() == read.nodes(), (number, kind)
            assert kept.list_slices() == read.list_slices(), (number, kind)
            state = filters.choice(["live", "pending", "granted", "preempting"])
            user, project = filters.choice([None, *USERS]), filters.choice([None, *PROJECTS])
            listed = [b.list_slices(state=state, user=user, project=project) for b in (kept, read)]
            assert listed[0] == listed[1], (number, kind, state)
            report = (filters.choice(PROJECTS), clock() - filters.choice([600, 86400]))
            by = filters.choice(["user", "project"])
            assert _report(kept, *report, by) == _report(read, *report, by), (number, kind)
        last = max(s["id"] for s in read.list_slices())
        for slice_id in range(1, last + 1):
            assert kept.events(slice_id) == read.events(slice_id), slice_id
        assert published > 60  # mostly read from memory: a rare fallback, not the rule
    finally:
        kept.close()
        read.close()


def _report(broker: Broker, project: str, since: float, by: str) -> Any:
    """A usage report up to now, or the refusal's type and message."""
    try:
        return broker.usage_report(project, since, by=by)
    except BrokerError as err:
        return type(err).__name__, str(err)


@pytest.fixture
def broker(db_url, clock) -> Iterator[Broker]:
    """A single writer on the test database (SQLite and PostgreSQL)."""
    broker = Broker(db_url, parse_config(cluster()), clock, single_writer=True)
    yield broker
    broker.close()


def test_a_refused_change_leaves_the_kept_catalog_as_the_database_has_it(broker):
    ask(broker)  # the catalog is loaded and kept
    with pytest.raises(BrokerError):
        broker.put_project("vision", share=1.0, parent="vision")  # a cycle: refused
    assert [p["parent"] for p in broker.projects() if p["name"] == "vision"] == ["org"]
    broker.put_project("speech", share=1.0, parent="org", users=["carol"])
    assert ask(broker, user="carol", project="speech")["project"] == "speech"


def test_readers_off_the_database_thread_see_the_last_commit_whole(broker, clock):
    """What the event loop reads (``committed_*``) moves only when a write commits: a
    write under way, or one rolled back, leaves it as the database has it."""
    held = ask(broker)
    broker.run_pass()
    before = broker.committed_slice(held["id"])
    assert before is not None and before["state"] == "granted"
    with pytest.raises(RuntimeError), broker.journal.group_commit():
        broker.release(held["id"])
        # Written, not committed: readers on other threads still see the grant.
        assert broker.committed_slice(held["id"]) == before
        assert {n["name"]: n["gpus_held"] for n in broker.committed_nodes()}["h0"] == 1
        raise RuntimeError("the group fails")  # and is rolled back
    assert broker.committed_slice(held["id"]) == before
    with broker.journal.group_commit():
        broker.release(held["id"])
    # Committed: nothing read in between, the readers see it at once.
    assert broker.committed_slice(held["id"]) is None  # ended: ask the database
    assert broker.committed_live_slices() == []
    assert {n["name"]: n["gpus_held"] for n in broker.committed_nodes()}.get("h0", 0) == 0
    assert broker.get_slice(held["id"])["state"] == "ended"


@pytest.mark.parametrize("rebase_after", [1, 8, 1000])
def test_a_commits_copy_of_the_live_slices_holds_them_as_they_are(monkeypatch, rebase_after):
    """Each commit's copy (the whole copy it shares, and what was written since) holds
    exactly the live slices, oldest first, whether or not it was copied whole again."""
    monkeypatch.setattr(journal_module, "REBASE_AFTER", rebase_after)
    rng = random.Random(rebase_after)
    live: dict[int, Any] = {i: object() for i in range(1, 30)}
    committed = journal_module.CommittedLive(dict(live), {}, len(live))
    next_id = 30
    for _ in range(300):
        written = []
        for _ in range(rng.randrange(1, 5)):
            change = rng.choice(["new", "new", "change", "end"])
            if change == "new" or not live:
                live[next_id] = object()
                written.append(next_id)
                next_id += 1
            else:
                slice_id = rng.choice(list(live))
                if change == "change":
                    live[slice_id] = object()
                else:
                    del live[slice_id]
                written.append(slice_id)
        committed = committed.then(live, written)
        assert list(committed.items()) == list(live.items()) and len(committed) == len(live)
        assert list(committed) == list(live) and list(committed.values()) == list(live.values())
        gone = rng.randrange(next_id)
        assert (gone in committed) == (gone in live)
        assert committed.get(gone) is live.get(gone)


def test_a_pass_takes_its_slices_from_the_last_commit_while_none_is_written(broker):
    """A pass's snapshot walks no live slice when none was written since the last
    commit: its slices are that commit's copy, and only then."""
    journal = broker.journal
    held, waiting = ask(broker), ask(broker, gpus=4)
    broker.run_pass()
    with journal.read() as session:
        live = journal.live_values(session)
    assert [s.id for s in live] == [held["id"], waiting["id"]]
    assert list(journal.committed_values()) == live
    with pytest.raises(RuntimeError), journal.write() as session:
        journal.row(session, waiting["id"]).priority = 5
        journal.live_slices(session)  # flushed: written, not committed
        assert journal.committed_values() is None
        raise RuntimeError("rolled back")
    assert journal.committed_values() is None  # rolled back: the slices are read again
    broker.heartbeat(held["id"])
    assert journal.committed_values()[0].lease_expires_at is not None  # as committed


def test_a_pass_that_drains_a_node_is_seen_by_the_next_request(broker):
    broker.set_node_state("h0", "draining")
    broker.run_pass()  # nothing runs on h0: it reports drained
    assert {n["name"]: n["state"] for n in broker.nodes()}["h0"] == "drained"
    broker.sync_inventory([Node("h0", "h100", 4, NodeState.DOWN), Node("b0", "b200", 4)])
    assert {n["name"]: n["state"] for n in broker.nodes()}["h0"] == "down"


def test_a_kept_slice_s_heartbeat_is_one_write_that_others_read(broker, db_url, clock):
    """A single writer renews a live slice's lease from its own copy (no read of the
    row): what it writes is what a Broker reading the database sees, and another
    user's heartbeat is refused before anything is written."""
    held = ask(broker)
    broker.run_pass()
    reader = Broker(db_url, parse_config(cluster()), clock)
    try:
        clock.advance(120)
        statements: list[str] = []
        record = _record(statements)
        event.listen(broker.journal.engine, "before_cursor_execute", record)
        before = reader.get_slice(held["id"])["lease_expires_at"]
        answer = broker.heartbeat(held["id"], caller=Principal("alice"))
        event.remove(broker.journal.engine, "before_cursor_execute", record)
        assert answer == reader.get_slice(held["id"])  # charged to now, as read
        assert answer["lease_expires_at"] == clock() + broker.lease > before
        slice_reads = [s for s in statements if s.startswith("SELECT") and "FROM slices" in s]
        assert slice_reads == [] and sum(s.startswith("UPDATE slices") for s in statements) == 1
        clock.advance(broker.lease - 90)  # past the lease of the grant, not the renewed one
        broker.run_pass()
        assert broker.get_slice(held["id"])["state"] == "granted"
        with pytest.raises(NotYours):
            broker.heartbeat(held["id"], caller=Principal("bob"))
        assert reader.get_slice(held["id"])["lease_expires_at"] == answer["lease_expires_at"]
        # Refused before it wrote anything: what is kept still holds, nothing is read
        # again (a stream of refused requests cannot make every pass reload the slices).
        statements.clear()
        event.listen(broker.journal.engine, "before_cursor_execute", record)
        broker.heartbeat(held["id"], caller=Principal("alice"))
        broker.run_pass()
        assert [s for s in statements if "FROM slices" in s and s.startswith("SELECT")] == []
    finally:
        reader.close()


def test_a_kept_live_slice_is_written_without_reading_its_row(broker, db_url, clock):
    """A single writer releases, checkpoints and extends a live slice from its kept
    copy of the row (no SELECT of it): a slice just submitted (never read back), one
    granted by a pass and one whose lease a heartbeat renewed. What it writes is what
    a Broker reading the database sees, events and charges included."""
    waiting = ask(broker)
    broker.live_slice_ids()  # the live slices are kept from here on
    granted, renewed = ask(broker, gpus=2), ask(broker, gpus=2)
    broker.run_pass()
    reader = Broker(db_url, parse_config(cluster()), clock)
    try:
        clock.advance(600)
        broker.heartbeat(renewed["id"])
        submitted = ask(broker, user="bob", project="nlp")  # kept as its insert wrote it
        statements: list[str] = []
        record = _record(statements)
        event.listen(broker.journal.engine, "before_cursor_execute", record)
        answers = [
            broker.release(submitted["id"]),
            broker.checkpoint(granted["id"], caller=Principal("alice")),
            broker.extend_protection(granted["id"], 600.0),
            broker.extend_protection(renewed["id"], 600.0),
        ]
        event.remove(broker.journal.engine, "before_cursor_execute", record)
        assert answers[-1] == reader.get_slice(renewed["id"])  # the renewed lease kept
        event.listen(broker.journal.engine, "before_cursor_execute", record)
        answers += [broker.release(granted["id"]), broker.release(renewed["id"])]
        event.remove(broker.journal.engine, "before_cursor_execute", record)
        assert [s for s in statements if s.startswith("SELECT") and "FROM slices" in s] == []
        states = ["ended", "granted", "granted", "granted", "ended", "ended"]
        assert [a["state"] for a in answers] == states
        for slice_ in (waiting, submitted, granted, renewed):
            assert broker.get_slice(slice_["id"]) == reader.get_slice(slice_["id"])
            assert broker.events(slice_["id"]) == reader.events(slice_["id"])
        assert reader.get_slice(granted["id"])["charged_gpu_seconds"] == pytest.approx(2 * 600)
        with pytest.raises(NotYours):  # the owner is checked on the kept copy too
            broker.release(waiting["id"], caller=Principal("bob"))
        assert reader.get_slice(waiting["id"])["state"] == broker.get_slice(waiting["id"])["state"]
        # A pass writes its grants and queue places on rows rebuilt the same way.
        fresh = ask(broker, user="bob", project="nlp")
        statements.clear()
        event.listen(broker.journal.engine, "before_cursor_execute", record)
        decisions = broker.run_pass()
        event.remove(broker.journal.engine, "before_cursor_execute", record)
        assert {grant.slice_id for grant in decisions.grants} >= {fresh["id"]}
        assert [s for s in statements if s.startswith("SELECT") and "FROM slices" in s] == []
        assert broker.list_slices() == reader.list_slices()
    finally:
        reader.close()


def _sent(broker: Broker, call: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``call()``'s answer and the statements it sent the database."""
    statements: list[str] = []
    record = _record(statements)
    event.listen(broker.journal.engine, "before_cursor_execute", record)
    try:
        return call(), statements
    finally:
        event.remove(broker.journal.engine, "before_cursor_execute", record)


def _record(statements: list[str]):
    def before_cursor_execute(_conn, _cursor, statement, *_args) -> None:
        statements.append(" ".join(statement.split()))

    return before_cursor_execute


def test_a_kept_live_slice_is_read_from_memory_as_the_database_has_it(broker, db_url, clock):
    """GET /slices/{id} of a live slice reads no row from a single writer: the same
    answer as a Broker reading the database, charged to now; another user's is
    refused, and an ended slice is read from its row."""
    held, other = ask(broker), ask(broker, user="bob", project="nlp")
    broker.run_pass()
    reader = Broker(db_url, parse_config(cluster()), clock)
    try:
        clock.advance(300)
        broker.get_slice(held["id"])  # the live slices are kept from here on
        alice = Principal("alice")
        answer, statements = _sent(broker, lambda: broker.get_slice(held["id"], caller=alice))
        assert [s for s in statements if "FROM slices" in s] == []
        assert answer == reader.get_slice(held["id"])
        assert answer["charged_gpu_seconds"] > 0  # accrued to now, not as journaled
        with pytest.raises(NotYours):
            broker.get_slice(other["id"], caller=Principal("alice"))
        broker.release(held["id"])
        assert broker.get_slice(held["id"]) == reader.get_slice(held["id"])
    finally:
        reader.close()


def test_a_single_writer_lists_the_live_slices_from_memory_as_the_database_has_them(
    broker, db_url, clock
):
    """GET /slices?state=live (the pages and the queue) reads no row from a single
    writer: the same answer as a Broker reading the database, charged to now, through
    a pass, time and a release; the filters hold and ended slices are read as before."""
    reader = Broker(db_url, parse_config(cluster()), clock)
    try:
        held, other = ask(broker, gpus=2), ask(broker, user="bob", project="nlp")
        broker.run_pass()
        waiting = ask(broker, gpus=1)
        clock.advance(300)
        broker.list_slices(state="live")  # the live slices are kept from here on
        answer, statements = _sent(broker, lambda: broker.list_slices(state="live"))
        assert [s for s in statements if "FROM slices" in s] == []
        assert answer == reader.list_slices(state="live")
        assert [s["id"] for s in answer] == [held["id"], other["id"], waiting["id"]]
        assert answer[0]["charged_gpu_seconds"] > 0  # accrued to now
        mine = broker.list_slices(state="granted", user="alice")
        assert [s["id"] for s in mine] == [held["id"]]
        assert broker.list_slices(state="pending", project="nlp") == []
        broker.release(held["id"])
        assert broker.list_slices(state="live") == reader.list_slices(state="live")
        assert [s["id"] for s in broker.list_slices(state="ended")] == [held["id"]]
    finally:
        reader.close()


def test_a_single_writer_reports_usage_with_running_slices_from_memory(broker, db_url, clock):
    """A usage report (the pages ask one per day) reads no slice row from a single
    writer: its running slices are the kept copies, charged to now; the same answer as
    a Broker reading the database, before and after a release."""
    reader = Broker(db_url, parse_config(cluster()), clock)
    try:
        held = ask(broker, gpus=2)
        ask(broker, user="bob", project="nlp")
        broker.run_pass()
        clock.advance(600)
        broker.list_slices(state="live")  # the live slices are kept from here on
        since = clock() - 3600
        answer, statements = _sent(broker, lambda: broker.usage_report("vision", since))
        assert [s for s in statements if "FROM slices" in s] == []
        assert answer == reader.usage_report("vision", since)
        assert sum(row["gpu_seconds"] for row in answer) == pytest.approx(2 * 600)
        broker.release(held["id"])
        clock.advance(600)
        assert broker.usage_report("vision", since) == reader.usage_report("vision", since)
    finally:
        reader.close()


def test_a_single_writer_lists_the_nodes_from_memory_as_the_database_has_them(
    broker, db_url, clock
):
    """GET /nodes reads no row from a single writer (its catalog and its record of who
    holds each GPU): the same answer as a Broker reading the database, through a
    grant, an admin's drain and a release."""
    reader = Broker(db_url, parse_config(cluster()), clock)
    try:
        held = ask(broker, gpus=2)
        broker.run_pass()
        broker.nodes()  # the catalog and the holders are kept from here on
        answer, statements = _sent(broker, lambda: broker.nodes())
        assert [s for s in statements if s.startswith("SELECT")] == []
        assert answer == reader.nodes()
        assert sum(node["gpus_held"] for node in answer) == 2
        node = broker.get_slice(held["id"])["placements"][0]["node"]
        broker.set_node_state(node, "draining", "a broken fan")
        assert broker.nodes() == reader.nodes()
        broker.release(held["id"])
        assert broker.nodes() == reader.nodes()
        assert sum(node["gpus_held"] for node in broker.nodes()) == 0
    finally:
        reader.close()


def test_a_single_writer_counts_the_projects_from_memory_as_the_database_has_them(
    broker, db_url, clock
):
    """GET /projects reads no row from a single writer and walks no live slice: its
    counts of waiting slices and held GPUs are moved by every write, and its usage
    takes in the slices written since the last pass alone. The same answer as a
    Broker reading the database, through submissions, a pass, a release and time."""
    reader = Broker(db_url, parse_config(cluster()), clock)
    try:
        held = ask(broker, gpus=2)
        ask(broker, user="bob", project="nlp")
        broker.run_pass()
        broker.projects()  # what is kept is loaded
        ask(broker, gpus=1)  # waits for the next pass
        clock.advance(600)
        broker.heartbeat(held["id"])
        answer, statements = _sent(broker, lambda: broker.projects())
        assert [s for s in statements if s.startswith("SELECT")] == []
        assert answer == reader.projects()
        counts = {p["name"]: (p["pending"], p["gpus_held"]) for p in answer}
        assert counts == {"org": (1, 3), "vision": (1, 2), "nlp": (0, 1)}
        broker.release(held["id"])
        clock.advance(300)
        assert broker.projects() == reader.projects()
        broker.run_pass()
        assert broker.projects() == reader.projects()
    finally:
        reader.close()


def test_the_pass_takes_in_what_was_written_since_the_last_one_alone(broker, clock):
    """A single writer's pass looks again only at the slices written since the last
    pass (the journal lists them): a lease renewed by a heartbeat between two passes
    that changed nothing else is one of them, so the slice is not ended at its old
    lease; a pass with nothing written looks at no slice at all."""
    held = ask(broker)
    broker.run_pass()  # granted: written by the pass itself
    broker.run_pass()  # takes in the grant; nothing is written since
    filed: list[int] = []
    index = broker._kept_index
    original = index._changed

    def changed(before, after) -> None:  # every slice the index takes in again
        filed.append((after or before).id)
        original(before, after)

    index._changed = changed
    broker.run_pass()
    assert filed == []  # nothing written since: no slice looked at again
    clock.advance(60)
    broker.heartbeat(held["id"], caller=Principal("alice"))
    clock.advance(broker.lease - 30)  # past the lease before the heartbeat
    broker.run_pass()
    assert filed == [held["id"]]
    assert broker.get_slice(held["id"])["state"] == "granted"
