"""The Broker against real databases: every test runs on SQLite and PostgreSQL."""

from __future__ import annotations

import itertools
import multiprocessing
import random
import threading
import time
from collections.abc import Callable, Iterable

import pytest
from builders import by_principal
from sqlalchemy import text
from sqlalchemy.engine import make_url

from broker.config import parse_config
from broker.core.model import (
    Decisions,
    Ending,
    EndReason,
    Grant,
    Node,
    NodeState,
    Placement,
    Preemption,
    PreemptReason,
    QueueEntry,
    Reservation,
    Snapshot,
)
from broker.core.scheduler import schedule as default_schedule
from broker.errors import Conflict, Forbidden, InvalidRequest, NotFound
from broker.orm import (
    UPGRADE_COMMAND,
    Base,
    DatabaseNotInitialized,
    DatabaseOutOfDate,
    DatabaseTooNew,
    check_schema,
    head_revision,
    make_engine,
    migrate,
    upgrade_db,
)
from broker.store import Broker, Principal
from broker.store.lapses import ANSWERING_KEPT_S, LateAnswers

HOUR = 3600.0

SLICE_KEYS = {
    "id", "project", "user", "gpus", "gpu_type", "kind", "min_runtime", "resumable",
    "max_runtime", "priority", "state", "end_reason", "placements", "submitted_at",
    "granted_at", "protected_until", "preempt_deadline", "preempt_reason", "ended_at",
    "queue_position", "fairshare_value", "charged_gpu_seconds",
}  # fmt: skip


def cluster(**changes) -> dict:
    """A small cluster as the configuration file describes it; ``changes`` replace top keys."""
    data = {
        "admins": ["root"],
        "policy": {"window": "7d", "grace_period": "60s", "max_min_runtime": "8h"},
        "defaults": {
            "interactive": {"min_runtime": "1h", "resumable": False, "max_runtime": "8h"},
            "batch": {"min_runtime": "2h", "resumable": True},
        },
        "gpu_types": {"h100": 1.0, "b200": 2.0},
        "nodes": [
            {"name": "h0", "gpu_type": "h100", "gpus": 4},
            {"name": "b0", "gpu_type": "b200", "gpus": 4},
        ],
        "projects": {
            "org": {},
            "vision": {"parent": "org", "share": 3, "users": ["alice"], "groups": ["cv"]},
            "nlp": {"parent": "org", "users": ["bob"]},
        },
    }
    return data | changes


class Script:
    """A stand-in scheduling pass answering with the given decisions, one per pass."""

    def __init__(self, *decisions: Decisions):
        self.decisions = list(decisions)
        self.snapshots: list[Snapshot] = []

    def __call__(self, snapshot: Snapshot) -> Decisions:
        self.snapshots.append(snapshot)
        return self.decisions.pop(0) if self.decisions else Decisions()


@pytest.fixture
def open_broker(db_url, clock) -> Iterable[Callable[..., Broker]]:
    """Open Brokers on the test database (closed at the end); kwargs go to :class:`Broker`."""
    opened: list[Broker] = []

    def open_(config: dict | None = None, **kwargs) -> Broker:
        kwargs.setdefault("clock", clock)
        broker = Broker(db_url, parse_config(config or cluster()), **kwargs)
        opened.append(broker)
        return broker

    yield open_
    for broker in opened:
        broker.close()


@pytest.fixture
def broker(open_broker) -> Broker:
    return open_broker()


def ask(broker: Broker, **request) -> dict:
    """Submit with the usual requester filled in."""
    request = {"user": "alice", "project": "vision", "gpus": 1, "kind": "batch"} | request
    return broker.submit(**by_principal(request))


# ---- submit, get, list ----------------------------------------------------------


def test_a_submitted_slice_reads_back_as_spec_section_8_shows_it(broker, clock):
    made = ask(broker, gpus=2, gpu_type="b200", min_runtime=600, priority=3)
    assert set(made) >= SLICE_KEYS
    assert made["state"] == "pending"
    assert made["submitted_at"] == clock.now
    assert made["placements"] == [] and made["granted_at"] is None
    assert made["charged_gpu_seconds"] == 0.0
    assert broker.get_slice(made["id"]) == made
    assert broker.list_slices() == [made]


def test_contract_terms_left_out_come_from_the_kinds_defaults(broker):
    made = ask(broker, kind="interactive")
    assert (made["min_runtime"], made["resumable"], made["max_runtime"]) == (HOUR, False, 8 * HOUR)
    made = ask(broker, kind="batch", min_runtime=0, resumable=False)
    assert (made["min_runtime"], made["resumable"], made["max_runtime"]) == (0.0, False, None)


def test_list_slices_filters_by_state_project_and_user(broker):
    a = ask(broker)
    b = ask(broker, user="bob", project="nlp")
    broker.release(a["id"])
    assert [s["id"] for s in broker.list_slices(state="pending")] == [b["id"]]
    assert [s["id"] for s in broker.list_slices(state="ended")] == [a["id"]]
    assert [s["id"] for s in broker.list_slices(state="live")] == [b["id"]]
    assert [s["id"] for s in broker.list_slices(project="nlp")] == [b["id"]]
    assert [s["id"] for s in broker.list_slices(user="alice")] == [a["id"]]


BAD_REQUESTS = [
    ("no GPUs", {"gpus": 0}),
    ("an unknown kind", {"kind": "service"}),
    ("protection over the cap", {"min_runtime": 9 * HOUR}),
    ("a negative contract", {"min_runtime": -1}),
    ("an unknown project", {"project": "nowhere"}),
    ("a parent account", {"project": "org"}),
    ("an unknown GPU type", {"gpu_type": "tpu"}),
    ("more GPUs than one node for a session", {"kind": "interactive", "gpus": 5}),
    ("more GPUs than the cluster", {"gpus": 9}),
    ("max_runtime below min_runtime", {"min_runtime": 600, "max_runtime": 60}),
    ("a non-boolean resumable", {"resumable": "yes"}),
]


@pytest.mark.parametrize("change", [c for _, c in BAD_REQUESTS], ids=[n for n, _ in BAD_REQUESTS])
def test_an_invalid_request_is_refused_and_writes_nothing(broker, change):
    with pytest.raises(InvalidRequest):
        ask(broker, **change)
    assert broker.list_slices() == []


MEMBERSHIP = [
    ("a listed user", "alice", (), "vision", True),
    ("a member of a listed group", "zoe", ("cv",), "vision", True),
    ("a user of another project", "bob", (), "vision", False),
    ("a user in unrelated groups", "zoe", ("nlp-team",), "vision", False),
]


@pytest.mark.parametrize(
    ("user", "groups", "project", "allowed"),
    [m[1:] for m in MEMBERSHIP],
    ids=[m[0] for m in MEMBERSHIP],
)
def test_only_members_may_charge_a_project(broker, user, groups, project, allowed):
    if allowed:
        assert ask(broker, user=user, groups=groups, project=project)["user"] == user
    else:
        with pytest.raises(Forbidden):
            ask(broker, user=user, groups=groups, project=project)
        assert broker.list_slices() == []


def test_an_admin_may_charge_any_project(broker):
    assert ask(broker, user="root", project="nlp", admin=True)["project"] == "nlp"


# ---- release and heartbeat ------------------------------------------------------


def test_releasing_a_pending_slice_cancels_it_free_of_charge(broker, clock):
    made = ask(broker)
    clock.advance(100)
    done = broker.release(made["id"], caller=Principal("alice"))
    assert (done["state"], done["end_reason"], done["ended_at"]) == (
        "ended",
        "cancelled",
        clock.now,
    )
    assert done["charged_gpu_seconds"] == 0.0
    assert broker.usage_report("vision", 0, clock.now) == []


def test_releasing_a_granted_slice_charges_its_held_time(broker, clock):
    made = ask(broker, gpus=2, gpu_type="b200")
    broker.run_pass()
    clock.advance(500)
    done = broker.release(made["id"], caller=Principal("alice"))
    assert (done["state"], done["end_reason"]) == ("ended", "released")
    assert done["charged_gpu_seconds"] == pytest.approx(2 * 2.0 * 500)


def test_users_release_only_their_own_slices_and_admins_any(broker):
    made = ask(broker)
    with pytest.raises(Forbidden):
        broker.release(made["id"], caller=Principal("bob"))
    with pytest.raises(NotFound):
        broker.release(made["id"] + 100, caller=Principal("alice"))
    assert broker.get_slice(made["id"])["state"] == "pending"
    assert broker.release(made["id"], caller=Principal("bob", admin=True))["state"] == "ended"


def test_releasing_an_ended_slice_changes_nothing(broker, clock):
    made = ask(broker)
    broker.run_pass()
    clock.advance(10)
    first = broker.release(made["id"])
    clock.advance(10)
    assert broker.release(made["id"]) == first
    assert len(broker.usage_report("vision", 0, clock.now + 1)) == 1


def test_a_heartbeat_extends_the_lease_and_a_lapsed_lease_ends_the_slice(open_broker, clock):
    broker = open_broker(lease=120.0)
    made = ask(broker, kind="interactive")
    broker.run_pass()
    assert broker.get_slice(made["id"])["lease_expires_at"] == clock.now + 120
    clock.advance(100)
    assert (
        broker.heartbeat(made["id"], caller=Principal("alice"))["lease_expires_at"]
        == clock.now + 120
    )
    with pytest.raises(Forbidden):
        broker.heartbeat(made["id"], caller=Principal("bob"))
    clock.advance(119)
    broker.run_pass()
    assert broker.get_slice(made["id"])["state"] == "granted"
    clock.advance(1)
    broker.run_pass()
    lost = broker.get_slice(made["id"])
    assert (lost["state"], lost["end_reason"]) == ("ended", "lost")


def test_a_waiting_slice_that_was_heartbeated_is_lost_when_the_beats_stop(open_broker, clock):
    broker = open_broker(lease=120.0)
    ask(broker, gpus=4, gpu_type="h100")
    ask(broker, gpus=4, gpu_type="b200")
    broker.run_pass()
    waiting = ask(broker, kind="interactive")
    assert (
        broker.heartbeat(waiting["id"], caller=Principal("alice"))["lease_expires_at"]
        == clock.now + 120
    )
    clock.advance(120)
    broker.run_pass()
    assert broker.get_slice(waiting["id"])["end_reason"] == "lost"


def test_the_lapse_limit_ends_so_many_lost_a_minute_and_a_late_heartbeat_keeps_a_slice(
    open_broker, clock
):
    """When more leases are over at once than the lapse limit allows a minute, the
    rest stay granted, and a heartbeat that comes late still keeps its slice: under
    an overload, the broker ends no more live sessions than that (design.md §8)."""
    policy = cluster()["policy"] | {"lease_lapse_floor": 2, "lease_lapse_fraction": 0.0}
    broker = open_broker(cluster(policy=policy), lease=120.0)
    made = [ask(broker, kind="interactive")["id"] for _ in range(6)]
    broker.run_pass()
    clock.advance(120)  # every lease is over

    def ended() -> list[int]:
        return [i for i in made if broker.get_slice(i)["end_reason"] == "lost"]

    assert broker.run_pass().lapses_held == tuple(made[2:])
    assert ended() == made[:2]
    late = broker.heartbeat(made[2], caller=Principal("alice"))
    assert (late["state"], late["lease_expires_at"]) == ("granted", clock.now + 120)
    clock.advance(59)
    broker.run_pass()
    assert ended() == made[:2], "two a minute, and that minute is not over"
    clock.advance(1)
    assert broker.run_pass().lapses_held == (made[5],)
    assert ended() == [*made[:2], *made[3:5]], "the heartbeated slice is kept"
    broker.heartbeat(made[2], caller=Principal("alice"))
    clock.advance(60)
    broker.run_pass()
    assert ended() == [*made[:2], *made[3:]]
    assert broker.get_slice(made[2])["state"] == "granted"


def test_a_lease_runs_out_only_over_the_time_the_broker_answered_heartbeats_on_time(
    open_broker, clock
):
    """Heartbeats answered late, and one still being answered once it is late, are
    time over which no lease runs out (design.md §8): the pass that follows a stall
    may run before the answers it held up are written."""
    broker = open_broker(cluster(), lease=120.0)
    start = clock.now
    made = ask(broker, kind="interactive")["id"]
    broker.run_pass()
    held_up = broker.late_answers.came(start + 100)  # another holder's heartbeat
    clock.advance(130)  # the lease ran out 10 s ago; the heartbeat waits 30 s so far
    assert broker.run_pass().lapses_held == (made,)
    assert broker.late_answers.answered(held_up, clock.now)
    clock.advance(19)  # over by 29 s, of which 30 s answered late
    assert broker.run_pass().lapses_held == (made,)
    clock.advance(1)
    assert broker.run_pass().lapses_held == ()
    assert broker.get_slice(made)["end_reason"] == "lost"
    # Answered within late_after is on time; 0 counts nothing as late.
    assert not broker.late_answers.answered(broker.late_answers.came(clock.now), clock.now + 1)
    never = LateAnswers(late_after=0)
    assert not never.answered(never.came(start), start + 3600)
    assert never.times(start + 3600) == ()
    # A ticket never answered (its request gone) stops counting after ANSWERING_KEPT_S.
    left = LateAnswers()
    ticket = left.came(start)
    assert left.times(start + ANSWERING_KEPT_S) == ((start, start + ANSWERING_KEPT_S),)
    assert left.times(start + ANSWERING_KEPT_S + 1) == ()
    assert not left.answered(ticket, start + ANSWERING_KEPT_S + 2)
    # Counted from the earliest request still being answered, whatever order their
    # handlers took tickets in; one gone for good does not hide one still counting.
    both = LateAnswers()
    both.came(start + 10)
    both.came(start + 5)  # came first, its handler started second
    assert both.times(start + 20) == ((start + 5, start + 20),)
    both = LateAnswers()
    both.came(start + 10)
    both.came(start)  # left behind
    assert both.times(start + ANSWERING_KEPT_S + 5) == ((start + 10, start + ANSWERING_KEPT_S + 5),)


def test_bad_filters_are_refused(broker):
    with pytest.raises(InvalidRequest):
        broker.list_slices(state="running")
    with pytest.raises(InvalidRequest):
        broker.usage_report("vision", by="node")


# ---- charging -------------------------------------------------------------------


def test_an_idle_granted_slice_is_charged_for_its_idle_time(broker, clock):
    made = ask(broker, kind="interactive", gpus=2, gpu_type="h100")
    broker.run_pass()
    clock.advance(1800)  # nobody used the GPUs; the heartbeats kept coming
    for _ in range(3):
        broker.heartbeat(made["id"], caller=Principal("alice"))
    assert broker.get_slice(made["id"])["charged_gpu_seconds"] == pytest.approx(2 * 1800)
    usage = {row["name"]: row["usage"] for row in broker.projects()}
    assert usage == {"org": pytest.approx(3600), "vision": pytest.approx(3600), "nlp": 0.0}
    assert broker.release(made["id"])["charged_gpu_seconds"] == pytest.approx(2 * 1800)


def test_charges_equal_the_time_gpus_were_held(broker, clock):
    held = {}  # slice id -> (weighted GPUs, seconds)
    for gpus, gpu_type, weight in [(1, "h100", 1.0), (3, "b200", 2.0), (2, "h100", 1.0)]:
        made = ask(broker, gpus=gpus, gpu_type=gpu_type)
        held[made["id"]] = (gpus * weight, 0.0)
    broker.run_pass()
    for seconds, slice_id in zip([300, 700, 1100], held, strict=True):
        clock.advance(seconds - (clock.now - 1_000_000.0))
        broker.release(slice_id)
        held[slice_id] = (held[slice_id][0], seconds)
    expected = sum(rate * seconds for rate, seconds in held.values())
    rows = broker.usage_report("vision", 0, clock.now)
    assert rows[0]["weighted_gpu_seconds"] == pytest.approx(expected)
    assert rows[0]["gpu_seconds"] == pytest.approx(1 * 300 + 3 * 700 + 2 * 1100)
    for slice_id, (rate, seconds) in held.items():
        assert broker.get_slice(slice_id)["charged_gpu_seconds"] == pytest.approx(rate * seconds)


def test_unallocated_slices_are_never_charged(broker, clock):
    made = ask(broker, min_runtime=0, gpus=4)
    broker.run_pass()
    clock.advance(HOUR)
    assert broker.get_slice(made["id"])["charged_gpu_seconds"] == 0.0
    assert broker.release(made["id"])["charged_gpu_seconds"] == 0.0
    assert broker.usage_report("vision", 0, clock.now) == []


def test_a_running_slice_counts_in_usage_reports_up_to_now(broker, clock):
    ask(broker, user="alice", gpus=1)
    ask(broker, user="zoe", groups=["cv"], gpus=2)
    broker.run_pass()
    clock.advance(100)
    rows = broker.usage_report("org", clock.now - 50, clock.now)
    assert [(r["project"], r["user"], r["weighted_gpu_seconds"]) for r in rows] == [
        ("vision", "alice", pytest.approx(50.0)),
        ("vision", "zoe", pytest.approx(100.0)),
    ]
    assert broker.usage_report("vision", by="project")[0]["weighted_gpu_seconds"] == (
        pytest.approx(300.0)
    )
    with pytest.raises(NotFound):
        broker.usage_report("nowhere")


# ---- applying decisions -------------------------------------------------------


def test_a_requeued_slice_is_charged_for_its_held_time_and_keeps_its_place(open_broker, clock):
    script = Script(
        Decisions(grants=(Grant(1, (Placement("h0", (0, 1)),)),)),
        Decisions(endings=(Ending(1, EndReason.PREEMPTED, requeue=True, protect_next=7200.0),)),
    )
    broker = open_broker(schedule=script)
    made = ask(broker, gpus=2, resumable=True, min_runtime=3600)
    broker.run_pass()
    clock.advance(250)
    broker.run_pass()
    again = broker.get_slice(made["id"])
    assert again["state"] == "pending"
    assert again["placements"] == [] and again["granted_at"] is None
    assert again["submitted_at"] == made["submitted_at"]
    assert again["end_reason"] is None
    assert again["min_runtime"] == 7200.0  # its next run is protected as the pass chose
    assert again["charged_gpu_seconds"] == pytest.approx(2 * 250)
    assert broker.usage_report("vision", 0, clock.now)[0]["weighted_gpu_seconds"] == (
        pytest.approx(500)
    )
    assert [e["to_state"] for e in broker.events(made["id"])] == ["pending", "granted", "pending"]


def test_a_preemption_then_its_ending(open_broker, clock):
    script = Script(
        Decisions(grants=(Grant(1, (Placement("b0", (2,)),)),)),
        Decisions(preemptions=(Preemption(1, PreemptReason.FAIR_SHARE, clock.now + 60, 9),)),
        Decisions(endings=(Ending(1, EndReason.PREEMPTED),)),
    )
    broker = open_broker(schedule=script)
    made = ask(broker)
    broker.run_pass()
    broker.run_pass()
    leaving = broker.get_slice(made["id"])
    assert leaving["state"] == "preempting"
    assert (leaving["preempt_reason"], leaving["preempt_deadline"]) == (
        "fair_share",
        clock.now + 60,
    )
    clock.advance(60)
    broker.run_pass()
    gone = broker.get_slice(made["id"])
    assert (gone["state"], gone["end_reason"]) == ("ended", "preempted")
    assert gone["placements"] == [{"node": "b0", "gpu_indices": [2]}]
    assert gone["charged_gpu_seconds"] == pytest.approx(2.0 * 60)
    assert broker.events(made["id"])[2]["reason"] == "fair_share (for slice 9)"


def test_promises_and_queue_places_are_kept_until_a_pass_drops_them(open_broker):
    promise = Reservation(1, (Placement("h0", (0,)),), promised=True, due_at=5.0)
    script = Script(
        Decisions(reservations=(promise,), queue=(QueueEntry(1, 1, 0.25, 5.0),)),
        Decisions(),
    )
    broker = open_broker(schedule=script)
    made = ask(broker)
    broker.run_pass()
    waiting = broker.get_slice(made["id"])
    assert (waiting["queue_position"], waiting["fairshare_value"]) == (1, 0.25)
    assert waiting["estimated_start"] == 5.0
    assert script.snapshots[0].slices[0].promised == ()
    broker.run_pass()
    assert script.snapshots[1].slices[0].promised == promise.placements
    assert broker.get_slice(made["id"])["queue_position"] is None
    broker.run_pass()
    assert script.snapshots[2].slices[0].promised == ()


GRANTS_REFUSED = [
    ("a GPU granted twice in one pass", [Placement("h0", (0,))], [Placement("h0", (0,))]),
    ("a GPU that is held", [Placement("h0", (1,))], [Placement("h0", (1, 2))]),
    ("a GPU that does not exist", [Placement("h0", (3,))], [Placement("h0", (4,))]),
    ("a node that does not exist", [Placement("h0", (3,))], [Placement("x9", (0,))]),
]


@pytest.mark.parametrize(
    ("first", "second"), [c[1:] for c in GRANTS_REFUSED], ids=[c[0] for c in GRANTS_REFUSED]
)
def test_a_grant_the_pass_should_not_have_made_is_refused_and_the_rest_applied(
    open_broker, first, second
):
    grants = (Grant(1, tuple(first)), Grant(2, tuple(second)), Grant(3, (Placement("b0", (0,)),)))
    broker = open_broker(schedule=Script(Decisions(grants=grants)))
    for _ in range(3):
        ask(broker)
    broker.run_pass()
    assert [s["state"] for s in broker.list_slices()] == ["granted", "pending", "granted"]


@pytest.mark.parametrize("single_writer", [False, True])
def test_a_grant_of_a_gpu_held_since_an_earlier_pass_is_refused(open_broker, single_writer):
    # The store's last guard checks the GPUs of the nodes a pass grants on against
    # every live slice, not only against the grants of the same pass.
    earlier = Decisions(grants=(Grant(1, (Placement("h0", (0, 1)),)),))
    later = Decisions(
        grants=(Grant(2, (Placement("h0", (1, 2)),)), Grant(3, (Placement("b0", (1,)),)))
    )
    broker = open_broker(schedule=Script(earlier, later), single_writer=single_writer)
    for _ in range(3):
        ask(broker)
    broker.run_pass()
    broker.run_pass()
    assert [s["state"] for s in broker.list_slices()] == ["granted", "pending", "granted"]


def test_the_snapshot_holds_usage_weights_policy_and_live_slices(open_broker, clock):
    script = Script(Decisions(grants=(Grant(1, (Placement("b0", (0, 1)),)),)))
    broker = open_broker(schedule=script)
    ask(broker, gpus=2)
    ended = ask(broker, user="bob", project="nlp")
    broker.release(ended["id"])
    broker.run_pass()
    clock.advance(10)
    broker.run_pass()
    snapshot = script.snapshots[1]
    assert snapshot.now == clock.now
    assert [s.id for s in snapshot.slices] == [1]
    assert snapshot.usage == {"vision": pytest.approx(2 * 2.0 * 10)}
    assert snapshot.gpu_type_weights == {"h100": 1.0, "b200": 2.0}
    assert {n.name: n.state for n in snapshot.nodes} == {"b0": "ready", "h0": "ready"}
    assert {a.name for a in snapshot.accounts} == {"org", "vision", "nlp"}


# ---- with the real scheduling pass ---------------------------------------------


def test_waiting_slices_show_their_queue_place_and_fair_share_value(broker):
    ask(broker, gpus=4, gpu_type="h100")
    ask(broker, gpus=4, gpu_type="b200")
    broker.run_pass()
    waiting = ask(broker, user="bob", project="nlp", gpus=2)
    broker.run_pass()
    shown = broker.get_slice(waiting["id"])
    assert shown["state"] == "pending"
    assert shown["queue_position"] == 1
    assert shown["fairshare_value"] == pytest.approx(0.0)


def test_a_down_node_requeues_resumable_batch_work_and_ends_sessions(broker, clock):
    batch = ask(broker, gpus=4, gpu_type="h100", resumable=True)
    session = ask(broker, kind="interactive", gpus=1, gpu_type="b200")
    broker.run_pass()
    clock.advance(60)
    broker.set_node_state("h0", "down", "disk failed")
    broker.set_node_state("b0", "down", "psu")
    broker.run_pass()
    again, gone = broker.get_slice(batch["id"]), broker.get_slice(session["id"])
    assert again["state"] == "pending" and again["charged_gpu_seconds"] == pytest.approx(240)
    assert again["min_runtime"] == batch["min_runtime"]  # not preempted: protection as it was
    assert (gone["state"], gone["end_reason"]) == ("ended", "node_down")


def test_a_drained_node_reports_drained_once_empty(broker, clock):
    made = ask(broker, kind="interactive", min_runtime=60, gpu_type="h100")
    broker.run_pass()
    assert broker.set_node_state("h0", "draining", "repair")["state"] == "draining"
    clock.advance(61)
    broker.run_pass()  # past protection: preempted with a grace period
    assert broker.get_slice(made["id"])["state"] == "preempting"
    clock.advance(60)
    broker.run_pass()  # ended
    broker.run_pass()  # empty: drained
    node = next(n for n in broker.nodes() if n["name"] == "h0")
    assert node["state"] == "drained" and node["gpus_held"] == 0
    assert broker.set_node_state("h0", "draining")["state"] == "drained"
    assert broker.set_node_state("h0", "ready")["state"] == "ready"


def test_node_states_an_admin_cannot_set(broker):
    with pytest.raises(InvalidRequest):
        broker.set_node_state("h0", "drained")
    with pytest.raises(NotFound):
        broker.set_node_state("nowhere", "draining")


# ---- projects -------------------------------------------------------------------


def test_projects_show_the_tree_with_entitlement_usage_and_rank(broker, clock):
    ask(broker, gpus=1, gpu_type="h100")
    broker.run_pass()
    clock.advance(100)
    rows = {row["name"]: row for row in broker.projects()}
    assert [r["name"] for r in broker.projects()] == ["org", "nlp", "vision"]
    assert rows["vision"]["entitlement"] == pytest.approx(0.75)
    assert rows["vision"]["usage"] == pytest.approx(100)
    # share used: vision's part of all usage (all of it) over its entitlement
    assert rows["vision"]["fairshare_value"] == pytest.approx(1 / 0.75)
    assert rows["nlp"]["fairshare_value"] == 0.0
    assert (rows["nlp"]["rank"], rows["vision"]["rank"], rows["org"]["rank"]) == (1, 2, None)
    assert rows["org"]["usage"] == pytest.approx(100) and not rows["org"]["is_project"]
    assert (rows["vision"]["users"], rows["vision"]["groups"]) == (["alice"], ["cv"])
    assert rows["vision"]["gpus_held"] == 1
    # a parent counts what its projects hold and wait for, as it sums their usage
    assert (rows["org"]["gpus_held"], rows["org"]["pending"]) == (1, 0)
    ask(broker, gpus=4, gpu_type="h100")  # one of the 4 is held: it waits
    rows = {row["name"]: row for row in broker.projects()}
    assert (rows["org"]["gpus_held"], rows["org"]["pending"]) == (1, rows["vision"]["pending"])
    assert rows["vision"]["pending"] == 1


def test_put_project_adds_and_changes_accounts_and_members(broker):
    row = broker.put_project("audio", share=2, parent="org", users=["carol"], groups=["sound"])
    assert row["entitlement"] == pytest.approx(2 / 6)
    assert ask(broker, user="carol", project="audio")["project"] == "audio"
    broker.put_project("audio", share=1, parent="org", users=["dan"])
    row = next(r for r in broker.projects() if r["name"] == "audio")
    assert (row["users"], row["groups"], row["share"]) == (["dan"], ["sound"], 1.0)


BAD_PROJECTS = [
    ("a missing parent", {"name": "x", "share": 1, "parent": "nowhere"}),
    ("a zero share", {"name": "x", "share": 0, "parent": "org"}),
    ("a cycle", {"name": "org", "share": 1, "parent": "vision"}),
    ("members on a parent", {"name": "org", "share": 1, "users": ["a"]}),
]


@pytest.mark.parametrize("change", [c for _, c in BAD_PROJECTS], ids=[n for n, _ in BAD_PROJECTS])
def test_put_project_checks_the_tree_before_writing(broker, change):
    before = broker.projects()
    with pytest.raises(InvalidRequest):
        broker.put_project(**change)
    assert broker.projects() == before


def test_a_project_with_live_slices_cannot_become_a_parent(broker):
    ask(broker)
    with pytest.raises(Conflict):
        broker.put_project("vision-sub", share=1, parent="vision")


# ---- restart and configuration --------------------------------------------------


def test_a_restart_sees_exactly_what_was_committed(open_broker, clock):
    first = open_broker()
    ask(first, gpus=2, gpu_type="b200")
    first.run_pass()
    pending = ask(first, user="bob", project="nlp", gpus=4, gpu_type="b200")
    first.run_pass()
    first.set_node_state("h0", "draining", "firmware")
    clock.advance(30)
    state = (first.list_slices(), first.nodes(), first.projects(), first.usage_report("org"))
    first.close()
    second = open_broker()
    assert (second.list_slices(), second.nodes(), second.projects()) == state[:3]
    assert second.usage_report("org") == state[3]
    assert second.get_slice(pending["id"])["queue_position"] == 1


def test_the_configuration_files_nodes_are_synced_on_open_but_not_its_tree(open_broker, clock):
    open_broker().set_node_state("h0", "draining", "firmware")
    ask(open_broker(), user="bob", project="nlp")
    changed = cluster(
        nodes=[
            {"name": "h0", "gpu_type": "h100", "gpus": 8},
            {"name": "h1", "gpu_type": "h100", "gpus": 4},
        ],
        projects={"org": {}, "vision": {"parent": "org", "users": ["alice", "eve"]}},
        gpu_types={"h100": 1.5},
    )
    broker = open_broker(changed)
    nodes = {n["name"]: n for n in broker.nodes()}
    assert (nodes["h0"]["state"], nodes["h0"]["gpu_count"], nodes["h0"]["weight"]) == (
        "draining",
        8,
        1.5,
    )
    assert (nodes["h1"]["state"], nodes["b0"]["state"], nodes["b0"]["in_config"]) == (
        "ready",
        "down",
        False,
    )
    with pytest.raises(Conflict):
        broker.set_node_state("b0", "ready")
    # The database is the record of the tree: the file's projects seed it only once.
    assert [r["name"] for r in broker.projects()] == ["org", "nlp", "vision"]
    assert broker.list_slices(project="nlp")[0]["state"] == "pending"
    with pytest.raises(Forbidden):
        ask(broker, user="eve")
    back = open_broker()
    assert {n["name"]: n["state"] for n in back.nodes()}["b0"] == "ready"


# ---- schema --------------------------------------------------------------------


def test_an_unmigrated_database_fails_the_schema_check_naming_the_fix(db_url):
    engine = make_engine(db_url)
    try:
        with pytest.raises(DatabaseNotInitialized, match=UPGRADE_COMMAND):
            check_schema(engine)
        upgrade_db(db_url)
        check_schema(engine)
    finally:
        engine.dispose()


def test_a_database_from_a_newer_broker_is_refused(db_url):
    upgrade_db(db_url)
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = 'ffffffff'"))
        with pytest.raises(DatabaseTooNew) as raised:
            check_schema(engine)
        assert raised.value.current == "ffffffff"
        with pytest.raises(DatabaseTooNew):
            Broker(db_url, parse_config(cluster()))
    finally:
        engine.dispose()


def test_a_database_at_revision_0001_is_refused_then_upgraded_keeping_its_drains(db_url):
    engine = make_engine(db_url)
    try:
        migrate(engine, "0001")
        with engine.begin() as connection:
            connection.execute(
                text(
                    "INSERT INTO nodes (name, gpu_type, gpu_count, state, state_reason, in_config)"
                    " VALUES (:name, 'h100', 4, :state, '', :in_config)"
                ),
                [
                    {"name": "h0", "state": "ready", "in_config": True},
                    {"name": "b0", "state": "drained", "in_config": True},
                ],
            )
        with pytest.raises(DatabaseOutOfDate, match=UPGRADE_COMMAND) as raised:
            check_schema(engine)
        assert (raised.value.current, raised.value.expected) == ("0001", head_revision())
        with pytest.raises(DatabaseOutOfDate):
            Broker(db_url, parse_config(cluster()))
        broker = Broker(db_url, parse_config(cluster()), upgrade=True)
        try:
            check_schema(engine)
            nodes = {n["name"]: (n["state"], n["drained_by"]) for n in broker.nodes()}
            # Nobody recorded who drained b0: it stays drained until an admin says otherwise.
            assert nodes == {"h0": ("ready", None), "b0": ("drained", "admin")}
            broker.sync_inventory([Node("h0", "h100", 4), Node("b0", "b200", 4)])
            assert {n["name"]: n["state"] for n in broker.nodes()}["b0"] == "drained"
        finally:
            broker.close()
    finally:
        engine.dispose()


def test_the_migrations_build_exactly_the_models(db_url):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    upgrade_db(db_url)
    engine = make_engine(db_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


# ---- concurrency ------------------------------------------------------------------


def check_one_holder(slices: Iterable[dict]) -> None:
    """No GPU is held by two live slices, nor was at any time (from grant to end)."""
    spans: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
    for s in slices:
        if s["granted_at"] is None:
            continue
        end = s["ended_at"] if s["state"] == "ended" else float("inf")
        for p in s["placements"]:
            for index in p["gpu_indices"]:
                spans.setdefault((p["node"], index), []).append((s["granted_at"], end, s["id"]))
    for gpu, held in spans.items():
        held.sort()
        for (_, end, first), (start, _, second) in itertools.pairwise(held):
            assert start >= end, f"GPU {gpu} held by slices {first} and {second} at once"


def churn(broker: Broker, seed: int, rounds: int) -> None:
    """Submit, schedule and release at random, checking the live slices after each pass."""
    rng = random.Random(seed)
    for _ in range(rounds):
        user, project = rng.choice([("alice", "vision"), ("bob", "nlp")])
        broker.submit(
            principal=Principal(user),
            project=project,
            gpus=rng.randint(1, 3),
            kind="interactive",
            min_runtime=rng.choice([0, HOUR]),
        )
        broker.run_pass()
        live = broker.list_slices(state="live")
        check_one_holder(live)
        held = [s for s in live if s["state"] == "granted"]
        if held and rng.random() < 0.5:
            broker.release(rng.choice(held)["id"])


def test_two_brokers_in_two_threads_never_hold_one_gpu_twice(open_broker):
    brokers = [open_broker(clock=time.time), open_broker(clock=time.time)]
    errors: list[BaseException] = []

    def run(broker: Broker, seed: int) -> None:
        try:
            churn(broker, seed, rounds=30)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(b, i)) for i, b in enumerate(brokers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    check_one_holder(brokers[0].list_slices())
    assert len(brokers[0].list_slices()) == 60


def churn_in_a_process(url: str, seed: int, rounds: int) -> None:
    broker = Broker(url, parse_config(cluster()))
    try:
        churn(broker, seed, rounds)
    finally:
        broker.close()


def test_two_brokers_in_two_processes_never_hold_one_gpu_twice(db_url):
    # The database exists before the workers start, as it would in production.
    Broker(db_url, parse_config(cluster())).close()
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=churn_in_a_process, args=(db_url, i, 30)) for i in (1, 2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0]
    broker = Broker(db_url, parse_config(cluster()))
    try:
        slices = broker.list_slices()
        assert len(slices) == 60
        check_one_holder(slices)
    finally:
        broker.close()


def test_postgres_urls_use_psycopg():
    from broker.orm import normalize_url

    url = make_url(normalize_url("postgresql://u:p%40ss@db/broker"))
    assert (url.drivername, url.password) == ("postgresql+psycopg", "p@ss")


#: Steps on node h0 as (who, what, h0's state after, its drained_by after): "inventory"
#: reports h0 in state ``what`` (b0 stays ready), "gone" leaves h0 out of the inventory,
#: "admin" sets ``what``, "pass" runs a scheduling pass (h0 is empty: a drain completes).
DRAIN_STORIES = {
    "an admin's drain holds while the inventory says ready or draining": [
        ("inventory", "ready", "ready", None),
        ("admin", "draining", "draining", "admin"),
        ("inventory", "ready", "draining", "admin"),
        ("pass", "", "drained", "admin"),
        ("inventory", "ready", "drained", "admin"),
        ("inventory", "draining", "drained", "admin"),  # cordoned as well
        ("inventory", "ready", "drained", "admin"),  # uncordoned: still the admin's
        ("admin", "ready", "ready", None),
        ("inventory", "draining", "draining", "inventory"),  # the inventory rules again
    ],
    "the inventory's down wins, and an admin's drain is back with the node": [
        ("admin", "draining", "draining", "admin"),
        ("inventory", "down", "down", "admin"),
        ("inventory", "ready", "draining", "admin"),
        ("gone", "", "down", "admin"),
        ("inventory", "ready", "draining", "admin"),
        ("pass", "", "drained", "admin"),
    ],
    "the inventory's own drain goes with the cordon": [
        ("inventory", "draining", "draining", "inventory"),
        ("pass", "", "drained", "inventory"),
        ("inventory", "draining", "drained", "inventory"),
        ("inventory", "ready", "ready", None),
        ("inventory", "draining", "draining", "inventory"),
        ("inventory", "down", "down", None),
        ("inventory", "ready", "ready", None),
    ],
    "an admin's drain of a cordoned node outlives the cordon": [
        ("inventory", "draining", "draining", "inventory"),
        ("admin", "draining", "draining", "admin"),
        ("inventory", "ready", "draining", "admin"),
    ],
    "an admin's undrain of a cordoned node lasts until the next inventory change": [
        ("inventory", "draining", "draining", "inventory"),
        ("admin", "ready", "ready", None),
        ("inventory", "draining", "draining", "inventory"),
    ],
    "an admin's down keeps the node out of service until an admin undrains it": [
        ("admin", "down", "down", "admin"),
        ("inventory", "ready", "draining", "admin"),
        ("pass", "", "drained", "admin"),
        ("admin", "ready", "ready", None),
        ("inventory", "ready", "ready", None),
    ],
}


@pytest.mark.parametrize("steps", list(DRAIN_STORIES.values()), ids=list(DRAIN_STORIES))
def test_drains_by_an_admin_and_by_the_inventory(broker, steps):
    for number, (who, what, state, drained_by) in enumerate(steps, 1):
        if who == "inventory":
            broker.sync_inventory([Node("h0", "h100", 4, NodeState(what)), Node("b0", "b200", 4)])
        elif who == "gone":
            broker.sync_inventory([Node("b0", "b200", 4)])
        elif who == "admin":
            broker.set_node_state("h0", what)
        else:
            broker.run_pass()
        h0 = next(n for n in broker.nodes() if n["name"] == "h0")
        assert (h0["state"], h0["drained_by"]) == (state, drained_by), f"after step {number}"


def test_an_admins_drain_and_its_origin_survive_a_restart(open_broker):
    open_broker().set_node_state("h0", "draining", "firmware")
    again = open_broker()
    again.sync_inventory([Node("h0", "h100", 4), Node("b0", "b200", 4)])
    h0 = next(n for n in again.nodes() if n["name"] == "h0")
    assert (h0["state"], h0["drained_by"], h0["state_reason"]) == ("draining", "admin", "firmware")


def test_a_live_inventory_adds_changes_and_removes_nodes(broker):
    mig = Node("kube-0", "h100-1g.10gb", 7, NodeState.READY)
    cordoned = Node("h0", "h100", 4, NodeState.DRAINING)
    broker.sync_inventory([mig, cordoned])
    states = {n["name"]: n["state"] for n in broker.nodes()}
    assert states == {"kube-0": "ready", "h0": "draining", "b0": "down"}
    broker.run_pass()  # nothing runs on h0: it reports drained
    broker.sync_inventory([mig, cordoned])  # still cordoned: stays drained
    assert {n["name"]: n["state"] for n in broker.nodes()}["h0"] == "drained"
    assert ask(broker, gpus=7, gpu_type="h100-1g.10gb")["state"] == "pending"


# ---- leases across the broker's own absences (design.md §8) ------------------------
# A pass that finds the last one long gone (a restart, a database outage) first extends
# every live lease by that long; a crash loop does not keep a dead holder's GPUs for ever.

USUAL_GAP = 15.0
LEASE = 60.0


def run_passes(broker, clock, seconds: float, every: float = 5.0) -> None:
    """The scheduling loop at work for ``seconds``: a pass every ``every`` seconds."""
    end = clock.now + seconds
    while clock.now < end:
        clock.advance(min(every, end - clock.now))
        broker.run_pass_and_live(usual_gap=USUAL_GAP)


def test_an_outage_longer_than_the_lease_loses_no_slice(open_broker, clock):
    broker = open_broker(lease=LEASE)
    held = ask(broker)
    broker.run_pass_and_live(usual_gap=USUAL_GAP)
    before = broker.heartbeat(held["id"])["lease_expires_at"]

    clock.advance(3 * LEASE)  # no pass and no heartbeat could get through meanwhile
    _, live = broker.run_pass_and_live(usual_gap=USUAL_GAP)

    again = live[held["id"]]
    assert again["state"] == "granted"
    assert again["lease_expires_at"] == pytest.approx(before + 3 * LEASE)
    # Once the broker is back at work, a holder that stays silent loses it as usual.
    run_passes(broker, clock, LEASE)
    ended = broker.get_slice(held["id"])
    assert (ended["state"], ended["end_reason"]) == ("ended", "lost")


@pytest.mark.parametrize("single_writer", [True, False])
def test_a_pass_that_failed_after_reading_the_last_pass_time_leaves_the_absence_whole(
    open_broker, clock, single_writer
):
    """A single writer keeps the last pass's time in memory instead of reading its row:
    only a pass that committed moves it, or the absence would be forgotten."""
    failing = False

    def schedule(snapshot):
        if failing:
            raise RuntimeError("the pass failed after the absence was counted")
        return default_schedule(snapshot)

    broker = open_broker(lease=LEASE, single_writer=single_writer, schedule=schedule)
    held = ask(broker)
    broker.run_pass_and_live(usual_gap=USUAL_GAP)
    broker.run_pass_and_live(usual_gap=USUAL_GAP)  # from the kept time, where kept
    before = broker.heartbeat(held["id"])["lease_expires_at"]
    clock.advance(3 * LEASE)
    failing = True
    with pytest.raises(RuntimeError):
        broker.run_pass_and_live(usual_gap=USUAL_GAP)
    failing = False
    _, live = broker.run_pass_and_live(usual_gap=USUAL_GAP)
    assert live[held["id"]]["lease_expires_at"] == pytest.approx(before + 3 * LEASE)


def test_passes_at_their_usual_pace_extend_nothing(open_broker, clock):
    broker = open_broker(lease=LEASE)
    held = ask(broker)
    broker.run_pass_and_live(usual_gap=USUAL_GAP)
    lease = broker.heartbeat(held["id"])["lease_expires_at"]
    run_passes(broker, clock, LEASE / 2, every=USUAL_GAP)  # exactly the usual gap
    assert broker.get_slice(held["id"])["lease_expires_at"] == lease


def test_a_crash_loop_does_not_keep_a_silent_holder_alive(open_broker, clock):
    """Each restart adds the seconds the broker was away, not a fresh lease: the
    lease runs out over the time the brokers were up."""
    broker = open_broker(lease=LEASE)
    held = ask(broker)
    broker.run_pass_and_live(usual_gap=USUAL_GAP)
    broker.heartbeat(held["id"])  # then the holder dies
    restarts = 0
    while broker.get_slice(held["id"])["state"] != "ended":
        broker.close()
        clock.advance(20)  # down for 20 s
        broker = open_broker(lease=LEASE)
        restarts += 1
        broker.run_pass_and_live(usual_gap=USUAL_GAP)  # the first pass, at start
        run_passes(broker, clock, 10)  # up for 10 s, then it crashes again
        assert restarts < 20, "the lease never ran out"
    # 60 s of lease, 10 s of it used up per restart
    assert restarts == LEASE / 10
    assert broker.get_slice(held["id"])["end_reason"] == "lost"


def test_passes_driven_by_hand_leave_leases_alone(open_broker, clock):
    """Without ``usual_gap`` (tests, tools), time between passes is not an absence."""
    broker = open_broker(lease=LEASE)
    held = ask(broker)
    broker.run_pass()
    broker.heartbeat(held["id"])
    clock.advance(LEASE)
    broker.run_pass()
    assert broker.get_slice(held["id"])["end_reason"] == "lost"


# ---- restoring a session -------------------------------------------------------------


def preempted_session(open_broker, clock) -> tuple[Broker, dict]:
    """alice's interactive session, granted, preempted and ended by the passes."""
    script = Script(
        Decisions(grants=(Grant(1, (Placement("h0", (0,)),)),)),
        Decisions(preemptions=(Preemption(1, PreemptReason.FAIR_SHARE, clock.now + 60, 9),)),
        Decisions(endings=(Ending(1, EndReason.PREEMPTED),)),
    )
    broker = open_broker(schedule=script)
    made = ask(broker, kind="interactive", min_runtime=900)
    for _ in range(2):
        broker.run_pass()
        clock.advance(60)
    broker.run_pass()
    assert broker.get_slice(made["id"])["end_reason"] == "preempted"
    return broker, made


def test_a_preempted_session_is_restored_once_in_its_place_in_the_queue(open_broker, clock):
    broker, old = preempted_session(open_broker, clock)
    clock.advance(30)
    back = ask(broker, kind="interactive", min_runtime=900, restores=old["id"])
    assert back["state"] == "pending" and back["id"] != old["id"]
    assert back["submitted_at"] == old["submitted_at"]  # its place in vision's queue
    assert back["preemptions"] == broker.get_slice(old["id"])["preemptions"] == 1
    assert broker.get_slice(old["id"])["replaced_by"] == back["id"]
    assert broker.events(back["id"])[0]["reason"] == f"submitted: restores slice {old['id']}"
    with pytest.raises(Conflict, match="restored already"):
        ask(broker, kind="interactive", restores=old["id"])


def test_only_a_users_own_session_ended_by_a_preemption_is_restored(open_broker, clock):
    broker, old = preempted_session(open_broker, clock)
    released = ask(broker)
    broker.release(released["id"])
    live = ask(broker)
    before = len(broker.list_slices())
    with pytest.raises(NotFound):
        ask(broker, user="bob", admin=True, restores=old["id"])  # not bob's
    with pytest.raises(NotFound):
        ask(broker, restores=10_000)
    with pytest.raises(Conflict, match="not by a preemption"):
        ask(broker, restores=released["id"])
    with pytest.raises(Conflict, match="not ended"):
        ask(broker, restores=live["id"])
    assert len(broker.list_slices()) == before  # nothing written by a refusal
    assert broker.get_slice(old["id"])["replaced_by"] is None
