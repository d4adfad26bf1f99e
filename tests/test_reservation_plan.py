"""Reservations for gangs (design.md §5.6) asked of a large cluster's nodes in order of
when each could be wholly free at the soonest, and only until the earliest are known:
the same reservations as asking every node, from a bound that holds for any requester.
"""

from __future__ import annotations

import math
from dataclasses import replace

from builders import MIN, NOW, flat_tree, pending, running, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st
from passchecks import every_node_asked

from broker.core import backfill
from broker.core.incremental import NodeHolders, whole_node_floor
from broker.core.model import (
    HOUR,
    Contract,
    Node,
    Placement,
    Policy,
    Slice,
    SliceKind,
    SliceState,
)
from broker.core.preemption import past_budget
from broker.core.scheduler import _Pass, schedule
from broker.sim.engine import SimConfig, simulate
from broker.sim.policies import FairShare
from broker.sim.workloads import GeneratorConfig, generate

POLICY = Policy()


@st.composite
def clusters(draw):
    """Nodes of two GPU types and sizes, some GPUs free, and per node the releases a
    requester is told of (never more GPUs than the node holds)."""
    count = draw(st.integers(2, 9))
    nodes, free, releases = {}, {}, {}
    for i in range(count):
        size = draw(st.sampled_from([4, 8]))
        name = f"n{i}"
        nodes[name] = Node(name, draw(st.sampled_from(["a100", "h100"])), size)
        unfree = draw(st.integers(0, size))
        free[name] = set(range(unfree, size))
        left, found = unfree, []
        while left:
            gpus = draw(st.integers(1, left))
            if draw(st.booleans()):  # some holders never leave
                found.append((NOW + draw(st.integers(0, 20)) * 600.0, gpus))
            left -= gpus
        releases[name] = sorted(found)
    return nodes, free, releases


@settings(max_examples=300, deadline=None)
@given(clusters(), st.integers(9, 40), st.data())
def test_a_gang_reserves_the_same_nodes_asked_in_floor_order(cluster, gpus, data):
    nodes, free, releases = cluster
    requester = Slice(1, "p", "u", gpus, SliceKind.BATCH, Contract(HOUR))
    # Any floor no later than each node's due: tight ones (ties by name) included.
    floors: dict[str, list[tuple[float, str]]] = {}
    for name, node in nodes.items():
        due = backfill._time_to_free(node, node.gpu_count, free, releases.get, NOW)
        slack = data.draw(st.sampled_from([0.0, 300.0, math.inf]))
        floor = data.draw(st.floats(-1e9, 1e12)) if due is None else due - slack
        floors.setdefault(node.gpu_type, []).append((floor, name))
    for candidates in floors.values():
        candidates.sort()
    plain = backfill.plan(requester, nodes=nodes, free=free, releases=releases.get, now=NOW)
    ordered = backfill.plan(
        requester,
        nodes=nodes,
        free=free,
        releases=releases.get,
        now=NOW,
        whole_node_floors=floors,
    )
    assert ordered == plain


def test_a_gang_asks_only_the_nodes_it_needs_when_the_floors_tell():
    nodes = {f"n{i}": Node(f"n{i}", "h100", 8) for i in range(6)}
    free = {name: set() for name in nodes}
    releases = {name: [(NOW + 600.0 * (6 - i), 8)] for i, name in enumerate(sorted(nodes))}
    asked: list[str] = []

    def told(node: str):
        asked.append(node)
        return releases[node]

    floors = {"h100": sorted((ends[0][0], name) for name, ends in releases.items())}
    requester = Slice(1, "p", "u", 16, SliceKind.BATCH, Contract(HOUR))
    reservation = backfill.plan(
        requester, nodes=nodes, free=free, releases=told, now=NOW, whole_node_floors=floors
    )
    assert reservation is not None
    assert sorted(p.node for p in reservation.placements) == ["n4", "n5"]
    assert reservation.due_at == NOW + 1200.0
    assert sorted(asked) == ["n4", "n5"]  # n3's floor tells it cannot come sooner


def holder(slice_id: int, data) -> tuple[Slice, int]:
    gpus = data.draw(st.integers(1, 2))
    max_runtime = data.draw(st.sampled_from([None, HOUR, 4 * HOUR]))
    slice_ = Slice(
        slice_id,
        data.draw(st.sampled_from(["p", "q"])),
        "u",
        gpus,
        SliceKind.BATCH,
        Contract(data.draw(st.sampled_from([0.0, HOUR, 2 * HOUR])), max_runtime=max_runtime),
        state=data.draw(st.sampled_from([SliceState.GRANTED, SliceState.PREEMPTING])),
        granted_at=NOW - data.draw(st.integers(0, 6)) * 1800.0,
        placements=(Placement("n0", tuple(range(gpus))),),
        preemptions=data.draw(st.integers(0, 6)),
    )
    if slice_.state is SliceState.PREEMPTING:
        slice_ = replace(slice_, preempt_deadline=NOW + data.draw(st.integers(0, 120)))
    return slice_, gpus


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_no_requester_sees_a_node_wholly_free_before_its_floor(data):
    """The floor against what the pass may estimate of each holder (``_release_at``):
    whatever the rule answers, a holder leaves at its known end, or, if the rule lets
    the requester take it, a grace period after its protection ends, if sooner."""
    holders = [holder(i, data) for i in range(data.draw(st.integers(0, 5)))]
    leaving = {s.id: NOW + 30.0 for s, _ in holders if data.draw(st.booleans())}
    floor = whole_node_floor(
        NodeHolders(holders, leaving, POLICY),
        NOW,
        POLICY.grace_period,
        unfree=sum(gpus for _, gpus in holders),
    )
    leaves = []
    for slice_, _ in holders:
        if slice_.id in leaving:
            leaves.append(leaving[slice_.id])
            continue
        known = slice_.ends_at()
        protected_until = slice_.protected_until
        at = max(NOW, NOW if protected_until is None else protected_until)
        at += POLICY.grace_period
        # The rule may take only a granted slice within its budget, when it does.
        may_be_taken = slice_.state is SliceState.GRANTED and not past_budget(slice_, POLICY)
        taken = may_be_taken and data.draw(st.booleans())
        if known is not None and known <= at:
            leaves.append(known)
        elif taken:
            leaves.append(at)
        elif known is not None:
            leaves.append(known)
        else:
            return  # it never leaves: the node is never wholly free
    assert max([NOW, *leaves]) >= floor


def test_gangs_planned_in_floor_order_make_the_same_run():
    """A generated day with gangs, planned with each node's floor and with none (every
    node asked): the same run, figure for figure."""
    workload = generate(GeneratorConfig(days=1, slices=400, users=12, load=2.5), seed=2)
    plans = {"gang": 0}
    real_plan = backfill.plan

    def counted(requester, **kwargs):
        largest = max(node.gpu_count for node in kwargs["nodes"].values())
        plans["gang"] += backfill.takes_whole_nodes(requester, largest)
        return real_plan(requester, **kwargs)

    config = SimConfig(seed=2)
    try:
        backfill.plan = counted
        ordered = simulate(workload, FairShare(workload.accounts), config)
    finally:
        backfill.plan = real_plan
    with every_node_asked():
        everyone = simulate(workload, FairShare(workload.accounts), config)
    assert plans["gang"] > 0  # gangs were planned
    assert ordered.summary == everyone.summary


def test_a_node_made_smaller_under_its_holders_may_be_free_now():
    """Holders of 8 GPUs on a node now of 4: it is wholly free once any 4 of theirs
    are, before the long-protected one has left."""
    holders = [
        (
            Slice(
                i,
                "p",
                "u",
                4,
                SliceKind.BATCH,
                Contract(protection),
                state=SliceState.GRANTED,
                granted_at=NOW,
                placements=(Placement("n0", tuple(range(4 * i, 4 * i + 4))),),
            ),
            4,
        )
        for i, protection in enumerate([0.0, 8 * HOUR])
    ]
    summary = NodeHolders(holders, {}, POLICY)
    assert whole_node_floor(summary, NOW, POLICY.grace_period, unfree=8) > NOW + HOUR
    assert whole_node_floor(summary, NOW, POLICY.grace_period, unfree=4) == NOW


@st.composite
def crowded_large_clusters(draw):
    """Up to 16 nodes of two GPU types, mostly full of work of four projects of
    every age and contract, and a backlog with gangs and smaller requests of the
    same projects and priorities (so that they share release estimates)."""
    count = draw(st.integers(6, 16))
    nodes_ = [
        Node(f"n{i:02d}", draw(st.sampled_from(["h100", "b200"])), draw(st.sampled_from([4, 8])))
        for i in range(count)
    ]
    projects = ["a", "b", "c", "d"]
    slices = []
    for node in nodes_:
        start = draw(st.integers(0, 1))
        while start < node.gpu_count:
            size = draw(st.integers(1, node.gpu_count - start))
            slices.append(
                running(
                    draw(st.sampled_from(projects)),
                    node.name,
                    tuple(range(start, start + size)),
                    granted_ago=draw(st.sampled_from([MIN, 2 * HOUR, 5 * HOUR])),
                    min_runtime=draw(st.sampled_from([0.0, 15 * MIN, HOUR, 4 * HOUR])),
                    max_runtime=draw(st.sampled_from([None, 3 * HOUR, 6 * HOUR])),
                    priority=draw(st.integers(0, 1)),
                )
            )
            start += size
    for _ in range(draw(st.integers(1, 12))):
        slices.append(
            pending(
                draw(st.sampled_from(projects)),
                draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 24])),
                priority=draw(st.integers(0, 1)),
                gpu_type=draw(st.sampled_from([None, None, "h100", "b200"])),
                submitted_at=NOW - draw(st.sampled_from([0.0, 2 * HOUR])),
            )
        )
    shares = {p: draw(st.sampled_from([1.0, 2.0])) for p in projects}
    usage = {p: draw(st.floats(0, 1e6)) for p in projects}
    return snapshot(
        nodes_,
        flat_tree(*projects, shares=shares),
        slices,
        usage=usage,
        policy=Policy(max_reservations=8),
        weights={"b200": draw(st.sampled_from([1.0, 2.0]))},
    )


@settings(max_examples=200, deadline=None)
@given(crowded_large_clusters())
def test_a_pass_decides_the_same_with_every_node_asked(snap):
    decisions = schedule(snap)
    with every_node_asked():
        assert schedule(snap) == decisions


def test_a_node_a_gang_skipped_is_estimated_for_its_class_as_the_gang_would_have_been():
    # light (16 of 40 GPUs, share 0.9: under) and heavy (24, share 1.1: over). A gang of
    # light may take heavy's work; a 4-GPU request of light may not (it would leave
    # light above heavy). The gang plans first and stops at n0 and n1 (free in 2 h);
    # n2, whose bound is later, it skips. Release estimates are kept per class, the
    # first request's standing for the pass: asked later by the 4-GPU request, n2 is
    # told as the gang would have been (heavy's 4 GPUs free in a minute).
    held = [
        running("heavy", f"n{i}", tuple(range(8)), granted_ago=MIN, min_runtime=2 * HOUR + MIN)
        for i in (0, 1)
    ]
    held += [
        running("heavy", "n2", (0, 1, 2, 3), granted_ago=3 * HOUR),
        running("heavy", "n2", (4, 5, 6, 7), granted_ago=MIN, min_runtime=5 * HOUR + MIN),
    ]
    held += [
        running("light", f"n{i}", tuple(range(8)), granted_ago=MIN, min_runtime=6 * HOUR)
        for i in (3, 4)
    ]
    gang = pending("light", 16, submitted_at=NOW - MIN)  # planned first, no preemption
    small = pending("light", 4, submitted_at=NOW)  # too new to preempt: it plans
    tree = flat_tree("heavy", "light", shares={"heavy": 1.1, "light": 0.9})
    nodes_ = [Node(f"n{i}", "h100", 8) for i in range(5)]
    decisions = schedule(snapshot(nodes_, tree, [*held, gang, small]))
    assert decisions.preemptions == ()
    plans = {r.slice_id: r for r in decisions.reservations}
    assert [p.node for p in plans[gang.id].placements] == ["n0", "n1"]
    assert plans[gang.id].due_at == NOW + 2 * HOUR + 60
    assert [p.node for p in plans[small.id].placements] == ["n2"]
    assert plans[small.id].due_at == NOW + 60


def test_a_gang_asks_no_releases_of_a_node_that_never_frees_for_it(monkeypatch):
    # heavy holds 22 of 24 GPUs (share 8), tiny 2 on n2 with no known end and under its
    # share: fair share refuses light's gang every GPU of tiny's, so n2, though the
    # first that could be free, never is for the gang. Its releases are not worked
    # out; the gang reserves n0 and n1 as when every node is asked.
    held = [
        running("heavy", f"n{i}", tuple(range(8)), granted_ago=MIN, max_runtime=2 * HOUR)
        for i in (0, 1)
    ]
    held += [
        running("heavy", "n2", tuple(range(6)), granted_ago=MIN, max_runtime=30 * MIN),
        running("tiny", "n2", (6, 7), granted_ago=3 * HOUR),
    ]
    gang = pending("light", 16, submitted_at=NOW)
    tree = flat_tree("heavy", "light", "tiny")
    snap = snapshot([Node(f"n{i}", "h100", 8) for i in range(3)], tree, [*held, gang])
    estimated: list[str] = []
    real_estimate = _Pass._estimate

    def counted(self, node, estimate):
        estimated.append(node)
        return real_estimate(self, node, estimate)

    monkeypatch.setattr(_Pass, "_estimate", counted)
    with every_node_asked():
        everyone = schedule(snap)
    asked_of_every = list(estimated)
    estimated.clear()
    decisions = schedule(snap)
    assert "n2" in asked_of_every and "n2" not in estimated
    assert decisions == everyone
    (plan,) = decisions.reservations
    assert [p.node for p in plan.placements] == ["n0", "n1"]
