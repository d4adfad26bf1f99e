"""Each rule of the contract at the exact value where it turns: equality on one side,
the smallest step past it on the other.

A comparison written ``<`` for ``<=`` (or ``>=`` for ``>``) passes every test that
stays away from the boundary; these do not.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import HOUR, MIN, NOW, flat_tree, nodes, pending, running, snapshot

from broker.core.model import (
    EndReason,
    Node,
    NodeState,
    Policy,
    PreemptReason,
    SliceKind,
    SliceState,
)
from broker.core.scheduler import schedule
from spawner.options import Choices, OptionsError, ProjectView, resolve_request

# ---- project caps -------------------------------------------------------------------------


@pytest.mark.parametrize(("wanted", "granted"), [(2, True), (3, False)])
def test_a_project_may_fill_its_cap_exactly_and_not_one_gpu_more(wanted, granted):
    held = running("a", "n0", (0, 1))
    more = pending("a", wanted)
    policy = Policy(project_gpu_caps={"a": 4})
    d = schedule(snapshot(nodes(1), flat_tree("a"), [held, more], policy=policy))
    assert [g.slice_id for g in d.grants] == ([more.id] if granted else [])


# ---- lending reserved GPUs ----------------------------------------------------------------
#
# Node n0 (8 h100 GPUs): slice `holder` (project b) holds 6, protected for hours but with
# a hard end in 10 minutes. `blocked` (project a) wants all 8: it reserves n0, due when
# the holder's max runtime ends. The 2 free GPUs are part of that reservation: later work
# may borrow them only if it is gone, or preemptible, by the due time. Project c holds
# all of n1 (b200) and has used the most: it ranks below a whether fair share is judged
# on usage or on what is held now.

DUE_IN = 10 * MIN


def _lending(borrower, *, grace: float = 60.0) -> list[int]:
    holder = running(
        "b", "n0", tuple(range(6)), granted_ago=MIN, min_runtime=8 * HOUR, max_runtime=MIN + DUE_IN
    )
    c_running = running("c", "n1", tuple(range(8)), gpu_type="b200", min_runtime=8 * HOUR)
    blocked = pending("a", 8, gpu_type="h100", submitted_at=NOW - 100)
    snap = snapshot(
        [*nodes(1), Node("n1", "b200", 8)],
        flat_tree("a", "b", "c"),
        [holder, c_running, blocked, borrower],
        usage={"c": 1e9},
        policy=Policy(grace_period=grace),
    )
    d = schedule(snap)
    (reservation,) = [r for r in d.reservations if r.slice_id == blocked.id]
    assert reservation.due_at == NOW + DUE_IN and not reservation.promised
    assert reservation.placements[0].node == "n0"
    return [g.slice_id for g in d.grants]


@pytest.mark.parametrize(("max_runtime", "lent"), [(DUE_IN, True), (DUE_IN + 1, False)])
def test_reserved_gpus_are_lent_to_work_that_ends_by_the_due_time_and_no_later(max_runtime, lent):
    # Same project as the blocked slice, queued behind it: only its max runtime can
    # make it leave in time.
    borrower = pending(
        "a", 2, gpu_type="h100", min_runtime=MIN, max_runtime=max_runtime, submitted_at=NOW - 50
    )
    assert _lending(borrower) == ([borrower.id] if lent else [])


@pytest.mark.parametrize(("min_runtime", "lent"), [(DUE_IN - 60, True), (DUE_IN - 59, False)])
def test_reserved_gpus_are_lent_to_work_preemptible_by_the_due_time_and_no_later(min_runtime, lent):
    # Project c ranks below a, so a may preempt it once its protection and the
    # 60 s grace are over: that must be by the due time.
    borrower = pending("c", 2, gpu_type="h100", min_runtime=min_runtime, submitted_at=NOW - 50)
    assert _lending(borrower, grace=60.0) == ([borrower.id] if lent else [])


# ---- leases, hard ends, grace periods, protection ----------------------------------------


@pytest.mark.parametrize(("expires_in", "lost"), [(0.0, True), (0.001, False)])
@pytest.mark.parametrize("state", ["granted", "pending"])
def test_a_lease_ends_the_slice_in_the_pass_at_its_expiry_not_before(state, expires_in, lost):
    base = running("a", "n0", (0,)) if state == "granted" else pending("a")
    slice_ = replace(base, lease_expires_at=NOW + expires_in)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [slice_]))
    endings = [(e.slice_id, e.reason) for e in d.endings]
    assert endings == ([(slice_.id, EndReason.LOST)] if lost else [])


@pytest.mark.parametrize(("ends_in", "ended"), [(0.0, True), (0.001, False)])
def test_max_runtime_ends_the_slice_at_its_end_not_before(ends_in, ended):
    slice_ = running("a", "n0", (0,), granted_ago=HOUR, max_runtime=HOUR + ends_in)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [slice_]))
    endings = [(e.slice_id, e.reason) for e in d.endings]
    assert endings == ([(slice_.id, EndReason.EXPIRED)] if ended else [])


@pytest.mark.parametrize(("ends_in", "ended"), [(0.0, True), (0.001, False)])
def test_a_grace_period_ends_at_its_deadline_not_before(ends_in, ended):
    leaving = replace(
        running("a", "n0", (0,)), state=SliceState.PREEMPTING, preempt_deadline=NOW + ends_in
    )
    d = schedule(snapshot(nodes(1), flat_tree("a"), [leaving]))
    endings = [(e.slice_id, e.reason) for e in d.endings]
    assert endings == ([(leaving.id, EndReason.PREEMPTED)] if ended else [])


@pytest.mark.parametrize(("protected_for", "preempted"), [(0.0, True), (1.0, False)])
def test_protection_ends_exactly_at_grant_plus_min_runtime(protected_for, preempted):
    # The project's own lower-priority work gives way once its protection is over.
    low = running("a", "n0", tuple(range(8)), granted_ago=HOUR - protected_for, priority=-1)
    high = pending("a", 8, priority=1)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [low, high], policy=Policy(grace_period=30)))
    expected = [(low.id, PreemptReason.PRIORITY, NOW + 30, high.id)] if preempted else []
    assert [(p.slice_id, p.reason, p.deadline, p.for_slice) for p in d.preemptions] == expected


@pytest.mark.parametrize("leaving", [True, False])
def test_a_draining_node_is_reported_drained_only_once_nothing_holds_it(leaving):
    node = replace(nodes(1)[0], state=NodeState.DRAINING)
    slices = []
    if leaving:  # in its grace period: still holding GPUs
        slices = [
            replace(running("a", "n0", (0,)), state=SliceState.PREEMPTING, preempt_deadline=NOW + 1)
        ]
    d = schedule(snapshot([node], flat_tree("a"), slices))
    assert [(c.node, c.state) for c in d.node_changes] == (
        [] if leaving else [("n0", NodeState.DRAINED)]
    )


# ---- gangs ------------------------------------------------------------------------------


def test_an_interactive_slice_is_never_promised_several_nodes():
    cluster = [
        Node("n0", "h100", 2),
        Node("n1", "h100", 4, NodeState.DOWN),  # the only node it fits on
        Node("n2", "h100", 2),
    ]
    free = [
        running("b", "n0", (0, 1), min_runtime=0.0),
        running("b", "n2", (0, 1), min_runtime=0.0),
    ]
    session = pending("a", 3, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN)
    d = schedule(snapshot(cluster, flat_tree("a", "b"), [*free, session]))
    spans = [r.placements for r in d.reservations if r.slice_id == session.id]
    spans += [g.placements for g in d.grants if g.slice_id == session.id]
    assert all(len(placements) == 1 for placements in spans)
    assert not d.preemptions  # nothing can make room for it while n1 is down


# ---- the spawner's options ----------------------------------------------------------------


def _alice() -> list[ProjectView]:
    return [ProjectView("vision", 1.0, 0.0, None, 0.0, 1, 0, 0)]


@pytest.mark.parametrize("gpus", [0, "0", -1])
def test_zero_gpus_is_refused_even_when_the_admin_offers_no_list_of_counts(gpus):
    choices = Choices(gpus=())  # any count up to max_gpus
    assert choices.gpu_counts == ()
    with pytest.raises(OptionsError) as raised:
        resolve_request({"gpus": gpus}, projects=_alice(), gpu_types=[], choices=choices)
    assert raised.value.reason == "gpus"
    assert raised.value.message == (
        f"The number of GPUs must be a whole number of at least 1, got {gpus!r}."
        if not isinstance(gpus, str)
        else f"The number of GPUs must be a whole number of at least 1, got '{gpus}'."
    )
