"""Behaviour of the pass the simulator relies on, found missing while building it.

Each was reported by the simulator's first runs and fixed in the pass; these
keep the simulator's assumptions checked where it depends on them.
"""

from __future__ import annotations

from dataclasses import replace

from builders import HOUR, NOW, flat_tree, nodes, pending, running, snapshot

from broker.core.model import Placement, SliceState
from broker.core.scheduler import schedule


def test_a_slice_granted_at_time_zero_still_expires_at_its_max_runtime():
    # the simulated clock starts at 0.0; `granted_at or now` read it as "not granted"
    capped = replace(running("a", "n0", (0,), max_runtime=60.0), granted_at=0.0)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [capped], now=100.0))
    assert [e.slice_id for e in d.endings] == [capped.id]


def test_a_slice_requeued_by_a_pass_may_be_granted_in_that_pass():
    leaving = running("a", "n0", tuple(range(8)), resumable=True)
    leaving = replace(leaving, state=SliceState.PREEMPTING, preempt_deadline=NOW)
    d = schedule(snapshot(nodes(2), flat_tree("a"), [leaving]))
    assert [(e.slice_id, e.requeue) for e in d.endings] == [(leaving.id, True)]
    assert [g.slice_id for g in d.grants] == [leaving.id]


def test_a_gang_reservation_that_falls_due_is_honoured():
    # B, over-served, holds n0 whole and half of n1, past protection; A asks for both nodes.
    b0 = running("B", "n0", tuple(range(8)), granted_ago=2 * HOUR, resumable=True)
    b1 = running("B", "n1", (0, 1, 2, 3), granted_ago=2 * HOUR, resumable=True)
    gang = pending("A", 16, resumable=True)
    d = schedule(snapshot(nodes(2), flat_tree("A", "B"), [b0, b1, gang], usage={"B": 1e6}))
    # the holders are asked to leave for the gang, whose GPUs are promised to it
    assert {p.slice_id for p in d.preemptions if p.for_slice == gang.id} == {b0.id, b1.id}
    (promise,) = [r for r in d.reservations if r.slice_id == gang.id]
    assert promise.promised
    assert promise.placements == (
        Placement("n0", tuple(range(8))),
        Placement("n1", tuple(range(8))),
    )
