"""The pass's index kept from pass to pass (broker/core/incremental.py) decides
exactly what a fresh index decides on the same snapshot, whatever changed in
between (design.md §5). Since both share the walk, the index's answers are also
checked against their definitions over the snapshot's slices, and the decisions
against the checks written from the rules (tests/passchecks.py), so a mistake in
the walk or the index cannot hide behind the same mistake in its oracle."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from builders import HOUR, MIN, NOW, flat_tree, nodes, pending, running, snapshot
from hypothesis import event, given, settings
from hypothesis import strategies as st
from passchecks import check_pass, every_node_asked, floors_checked

from broker.core.candidates import Candidates
from broker.core.fairshare import ProjectTree
from broker.core.incremental import NodeHolders, PassState, holder_kind, pending_shape
from broker.core.model import (
    Account,
    Contract,
    Node,
    NodeState,
    Placement,
    Policy,
    QueueStretch,
    Quiet,
    SliceKind,
    SliceState,
    Snapshot,
)
from broker.core.ordering import queue_order
from broker.core.placement import FreeGpus
from broker.core.preemption import is_debug
from broker.core.resume import MOST_UNMADE, RESUME_PHASE, still_quiet
from broker.core.scheduler import _Pass, schedule
from broker.core.transitions import apply, preempting
from broker.core.whatif import alternatives

ACCOUNTS = [
    Account("org1", 2.0),
    Account("org2", 1.0),
    Account("a", 1.0, "org1"),
    Account("b", 3.0, "org1"),
    Account("c", 1.0, "org2"),
]
PROJECTS = ("a", "b", "c")
WEIGHTS = {"h100": 1.0, "b200": 2.5}
NODES = [
    Node("n0", "h100", 8),
    Node("n1", "h100", 8),
    Node("n2", "b200", 4),
    Node("n3", "b200", 8),
]
POLICY = Policy(debug_lane_fraction=0.2, max_reservations=3, project_gpu_caps={"c": 12})
# A changed policy (here: which sessions count as debug) refiles every holder.
POLICIES = (
    POLICY,
    replace(POLICY, debug_max_gpus=1),
    replace(POLICY, debug_max_gpus=4),
    replace(POLICY, debug_first=True),
)


def a_pending(rng: random.Random, now: float):
    kind = rng.choice(list(SliceKind))
    return pending(
        rng.choice(PROJECTS),
        rng.choice([1, 1, 2, 4, 8] + ([12, 16] if kind is SliceKind.BATCH else [])),
        kind=kind,
        min_runtime=rng.choice([0.0, 15 * MIN, HOUR, 4 * HOUR]),
        resumable=rng.random() < 0.5,
        max_runtime=rng.choice([None, None, 2 * HOUR]),
        priority=rng.randint(-1, 1),
        user=f"u{rng.randrange(3)}",
        gpu_type=rng.choice([None, None, "h100", "b200"]),
        submitted_at=now - rng.uniform(0, HOUR),
    )


def a_cluster(rng: random.Random):
    """Nodes partly filled with running slices of random contracts and ages,
    and a backlog of random requests."""
    slices = []
    for node in NODES:
        start = rng.randrange(3)
        while start < node.gpu_count:
            size = rng.randint(1, node.gpu_count - start)
            slices.append(
                running(
                    rng.choice(PROJECTS),
                    node.name,
                    tuple(range(start, start + size)),
                    granted_ago=rng.choice([MIN, 2 * HOUR, 5 * HOUR]),
                    min_runtime=rng.choice([0.0, 15 * MIN, HOUR]),
                    kind=rng.choice(list(SliceKind)),
                    resumable=rng.random() < 0.5,
                    max_runtime=rng.choice([None, 3 * HOUR, 6 * HOUR]),
                    priority=rng.randint(-1, 1),
                )
            )
            start += size
    slices += [a_pending(rng, NOW) for _ in range(rng.randint(0, 12))]
    return slices


def change(rng: random.Random, kind: str, now: float, live: dict, nodes: dict, usage: dict):
    """One change of the kind named, made to the world a pass looks at."""
    if kind == "submit":
        for _ in range(rng.randint(1, 3)):
            slice_ = a_pending(rng, now)
            live[slice_.id] = slice_
    elif kind == "release" and live:
        del live[rng.choice(sorted(live))]
    elif kind == "lease" and live:
        slice_id = rng.choice(sorted(live))
        live[slice_id] = replace(live[slice_id], lease_expires_at=now + rng.choice([-1.0, 0, 90]))
    elif kind == "node":
        name = rng.choice(sorted(nodes))
        state = rng.choice([NodeState.READY, NodeState.DRAINING, NodeState.DOWN, None])
        if state is None:
            del nodes[name]
        else:
            nodes[name] = replace(nodes[name], state=state)
    elif kind == "retype":  # an admin changes a node's GPU type or size under its slices
        name = rng.choice(sorted(nodes))
        gpus = rng.choice([nodes[name].gpu_count, 4, 8])
        nodes[name] = replace(nodes[name], gpu_type=rng.choice(sorted(WEIGHTS)), gpu_count=gpus)
    elif kind == "usage":
        usage[rng.choice(PROJECTS)] = rng.uniform(0, 1e6)
    elif kind == "clock":
        return now + rng.choice([1.0, 60.0, 61.0, 15 * MIN, HOUR, 3 * HOUR])
    return now


def check_index(kept: PassState, snap: Snapshot, rng: random.Random) -> None:
    """The index's answers are their definitions over ``snap``'s slices."""
    slices = snap.slices
    assert [s.id for s in kept.holding()] == sorted(s.id for s in slices if s.holds_gpus)
    # What the index holds of each slice is the slice as it is now, a heartbeat's
    # new lease included: its queues, and the summaries of each node's holders.
    now_is = {s.id: s for s in slices}
    assert all(s == now_is[s.id] for s in kept.pending())
    for node in snap.nodes:
        summary = kept.node_holders(node.name)
        held = [h for found in summary.rivals.values() for h, _ in found] + [
            h for h, _ in summary.unallocated
        ]
        assert all(h == now_is[h.id] for h in held)
    waiting = [s for s in slices if not s.holds_gpus]
    assert sorted(s.id for s in kept.pending()) == sorted(s.id for s in waiting)
    assert set(kept.waiting()) == {s.project for s in waiting if s.allocated}
    assert kept.promised_ids == {s.id for s in waiting if s.promised}
    policy = snap.policy
    debug = any(s.allocated and is_debug(s, policy) for s in waiting)
    assert kept.debug_waits() == debug
    assert kept.debug_waits() == debug  # counted, then kept
    assert kept.shapes.keys() <= {s.id for s in waiting}
    protected: dict[tuple, list[tuple[float, int]]] = {}
    for s in slices:
        if s.holds_gpus:
            until = -math.inf if s.protected_until is None else s.protected_until
            protected.setdefault(holder_kind(s, policy), []).append((until, s.id))
    assert kept.protection_ends_by_kind == {k: sorted(ends) for k, ends in protected.items()}
    # Who could be a victim, as the index keeps it whenever asked: just before a
    # protection's very end and at it, later (moved by the protections that ended
    # since) or sooner (worked out anew), and at now again.
    ends = [at for found in protected.values() for at, _ in found if at > -math.inf]
    for at in (snap.now, *sorted(rng.sample(ends, min(2, len(ends)))), snap.now):
        for when in (math.nextafter(at, -math.inf), at):
            assert_same_candidates(kept.victims_at(when), Candidates.of(slices, when, policy))
    assert all(
        kept.shapes[i] == kept.shape_number(s) for s in waiting if (i := s.id) in kept.shapes
    )
    ranked = list(PROJECTS)
    rng.shuffle(ranked)
    ordered = queue_order(waiting, {name: rank for rank, name in enumerate(ranked)})
    for allocated in (True, False):
        expected = [s.id for s in ordered if s.allocated is allocated]
        assert [s.id for s in kept.backlog(iter(ranked), allocated)] == expected
    nodes = {n.name: n for n in snap.nodes}
    now = snap.now
    gpus: dict[str, int] = {}
    allocated: dict[tuple[str, str], int] = {}
    debug: dict[str, int] = {}
    for s in slices:
        if not s.holds_gpus:
            continue
        gpus[s.project] = gpus.get(s.project, 0) + s.gpus
        for p in s.placements if s.allocated else ():
            where = (s.project, nodes[p.node].gpu_type if p.node in nodes else "")
            allocated[where] = allocated.get(where, 0) + len(p.gpu_indices)
        if is_debug(s, snap.policy):
            debug[s.user] = debug.get(s.user, 0) + s.gpus
    held = kept.holdings()
    assert (held.gpus, held.allocated, held.debug) == (gpus, allocated, debug)
    ready = [n for n in snap.nodes if n.state is NodeState.READY]
    # The order in which a gang's plan asks the ready nodes, and the nodes whose
    # holders hold more GPUs than the node has (made smaller under them).
    order: dict[str, list[tuple[float, str]]] = {}
    overheld = set()
    for n in ready:
        on_node = [
            (s, len(p.gpu_indices))
            for s in slices
            if s.holds_gpus
            for p in s.placements
            if p.node == n.name
        ]
        order.setdefault(n.gpu_type, []).append((NodeHolders(on_node, {}, policy).floor, n.name))
        in_range = {
            g
            for s, _ in on_node
            for p in s.placements
            if p.node == n.name
            for g in p.gpu_indices
            if g < n.gpu_count
        }
        if sum(gpus for _, gpus in on_node) > len(in_range):
            overheld.add(n.name)
    assert kept.floor_order() == ({t: sorted(entries) for t, entries in order.items()}, overheld)
    taken = [p for s in slices if s.holds_gpus for p in s.placements]
    weights = dict(snap.gpu_type_weights)
    fresh, kept_map = FreeGpus(ready, weights, taken), kept.free_map(ready, weights)
    assert (kept_map.free, kept_map._buckets) == (fresh.free, fresh._buckets)
    leaving = {s.id for s in slices if s.holds_gpus and rng.random() < 0.3}
    staying = [p for s in slices if s.holds_gpus and s.id not in leaving for p in s.placements]
    fresh = FreeGpus(ready, snap.gpu_type_weights, staying)
    kept_map = kept.free_map(ready, weights, [s for s in slices if s.id in leaving])
    assert (kept_map.free, kept_map._buckets) == (fresh.free, fresh._buckets)

    def due(s) -> bool:
        if s.lease_expires_at is not None and now >= s.lease_expires_at:
            return True
        if not s.holds_gpus:
            return False
        gone = any(
            p.node not in nodes or nodes[p.node].state is NodeState.DOWN for p in s.placements
        )
        max_runtime = s.contract.max_runtime
        started = now if s.granted_at is None else s.granted_at
        expired = max_runtime is not None and now >= started + max_runtime
        leaving = s.preempt_deadline is not None and now >= s.preempt_deadline
        return gone or expired or leaving

    assert kept.due(now) == sorted(s.id for s in slices if due(s))
    # The nodes as the index keeps them are the snapshot's.
    assert kept.nodes.by_name == nodes and kept.nodes.ready == ready
    assert kept.nodes.draining == any(n.state is NodeState.DRAINING for n in snap.nodes)
    capacity = sum(n.gpu_count * snap.weight(n.gpu_type) for n in ready)
    assert kept.nodes.capacity(snap.gpu_type_weights) == capacity

    def wakes(s) -> list[float]:
        """When a pass may have something to do for ``s``: its lease; a holder's end
        of protection, of grace and of maximum runtime."""
        times = [] if s.lease_expires_at is None else [s.lease_expires_at]
        if s.holds_gpus:
            times += [t for t in (s.protected_until, s.preempt_deadline) if t is not None]
            if s.contract.max_runtime is not None and s.granted_at is not None:
                times.append(s.granted_at + s.contract.max_runtime)
        return times

    for after in (now - HOUR, now, now + rng.uniform(0, 4 * HOUR)):
        soonest = min((t for s in slices for t in wakes(s) if t > after), default=None)
        assert kept.next_wake(after) == soonest, after


CHANGES = (
    *("apply", "apply", "apply", "submit", "release", "lease", "node", "usage", "clock"),
    *("retype", "policy", "weights"),
)


def assert_same_candidates(kept: Candidates, fresh: Candidates) -> None:
    """Two victim indexes hold the same candidates, indexed alike."""
    assert kept.slices == fresh.slices
    assert kept.on == fresh.on
    assert kept.gpus_on == fresh.gpus_on
    assert {g: +nodes for g, nodes in kept.nodes_of.items() if +nodes} == {
        g: +nodes for g, nodes in fresh.nodes_of.items() if +nodes
    }
    assert +kept.by_project == +fresh.by_project
    assert (kept.batch, kept.unallocated) == (fresh.batch, fresh.unallocated)
    assert +kept.unallocated_on == +fresh.unallocated_on


def test_shape_numbers_start_again_once_the_shapes_numbered_are_mostly_gone():
    """The index numbers the walk's shapes (shape_number); numbers of shapes long gone
    are dropped, and then every kept number with them, never one without the other."""
    tree = flat_tree("a", "b")
    kept = PassState(ProjectTree(tree))
    policy = Policy(max_reservations=0, project_gpu_caps={"a": 8})
    # Work larger than any node makes no preemption attempt; where the free GPUs
    # of several nodes could hold it (here its project's cap holds it back), the
    # walk takes it one by one, by its shape.
    holder = running("b", "n0", tuple(range(7)), min_runtime=10 * HOUR)
    staying = pending("a", 16, min_runtime=2 * HOUR)
    snap = snapshot(nodes(3), tree, [holder, staying], policy=policy)
    schedule(snap, index=kept)
    assert staying.id in kept.shapes
    for batch in range(10):  # 300 shapes a pass, each gone by the next
        passing = [pending("a", 16, min_runtime=HOUR + 300 * batch + k) for k in range(300)]
        slices = (holder, staying, *passing)
        schedule(replace(snap, slices=slices), index=kept)
        assert kept.shapes[staying.id] == kept.shape_number(staying)
    assert len(kept._shape_numbers) < 10 * 300  # started again on the way


@settings(max_examples=150, deadline=None)
@given(
    st.randoms(use_true_random=False),
    st.lists(st.lists(st.sampled_from(CHANGES), max_size=3), min_size=1, max_size=10),
)
def test_a_pass_from_kept_state_decides_what_a_pass_from_scratch_decides(rng, steps):
    tree = ProjectTree(ACCOUNTS)
    kept = PassState(tree)
    live = {s.id: s for s in a_cluster(rng)}
    nodes = {n.name: n for n in NODES}
    usage = {p: rng.uniform(0, 1e6) for p in PROJECTS}
    now = NOW
    policy = POLICY
    weights = WEIGHTS
    decisions = None
    last_snap = None
    told = PassState(tree)  # an index told which slices changed (as the store does)
    told_of: dict = {}
    for changes in steps:
        for kind in changes:
            if kind == "apply" and decisions is not None:
                live = apply(live, nodes, decisions, now, weights).slices
                decisions = None
            elif kind == "policy":
                policy = rng.choice(POLICIES)
                decisions = None
            elif kind == "weights":  # an admin values the GPU types anew
                weights = {**weights, "b200": rng.choice([1.0, 2.5, 4.0])}
                decisions = None
            elif kind != "apply":
                now = change(rng, kind, now, live, nodes, usage)
                decisions = None  # taken on a world that has moved on since
        # Some slices made anew, as a service reads them from its database each
        # pass; and the order of a snapshot's slices decides nothing.
        slices = [replace(s) if rng.random() < 0.3 else s for s in live.values()]
        rng.shuffle(slices)
        snap = snapshot(
            list(nodes.values()),
            ACCOUNTS,
            slices,
            usage=dict(usage),
            policy=policy,
            now=now,
            weights=weights,
        )
        before = kept.copy()
        with floors_checked():
            decisions = schedule(snap, index=kept)
        check_index(kept, snap, rng)
        if last_snap is not None:  # a copy is left as it was by the index's update
            check_index(before, last_snap, rng)
        last_snap = snap
        assert decisions == schedule(snap, tree)
        with every_node_asked():  # gangs asking only the nodes that could free up first
            assert schedule(snap, tree) == decisions
        now_of = {s.id: s for s in snap.slices}
        told.expect(
            {
                i: now_of.get(i)
                for i in told_of.keys() | now_of.keys()
                if told_of.get(i) is not now_of.get(i)
            }
        )
        told_of = now_of
        assert schedule(snap, index=told) == decisions
        check_pass(snap, decisions)
        # The store's index takes in what the pass wrote at once (told which slices,
        # or not): then it answers for the slices as the pass left them.
        written = apply(now_of, nodes, decisions, now, weights).slices
        gone_or_new = now_of.keys() ^ written.keys()
        said = {i: written.get(i) for i in gone_or_new | set(decisions_ids(decisions))}
        for taken, changed in ((told.copy(), said), (told.copy(), None)):
            taken.take_in(changed, len(written), written.values())
            check_index(taken, replace(snap, slices=tuple(written.values())), rng)
        waiting = sorted(s.id for s in snap.slices if not s.holds_gpus)
        if waiting and rng.random() < 0.3:
            # What-if passes start from copies of the kept index: the same answers
            # as from a fresh one, and the kept index is left as it was.
            asked = rng.choice(waiting)
            assert alternatives(snap, asked, projects=PROJECTS, index=kept) == alternatives(
                snap, asked, projects=PROJECTS, tree=tree
            )
            check_index(kept, snap, rng)
        for what, count in (
            ("grants", len(decisions.grants)),
            ("preemptions", len(decisions.preemptions)),
            ("endings", len(decisions.endings)),
        ):
            if count:
                event(what)


@settings(max_examples=150, deadline=None)
@given(st.randoms(use_true_random=False), st.lists(st.integers(0, 11), max_size=4))
def test_requests_alike_are_planned_for_as_each_would_be_alone(rng, twinned):
    """A pass plans a reservation once for requests alike (project, class, shape)
    while nothing it plans from changes: it decides what planning each anew does."""
    cluster = a_cluster(rng)
    waiting = [s for s in cluster if s.state is SliceState.PENDING]
    for at, which in enumerate(twinned):
        if waiting:
            twin = waiting[which % len(waiting)]
            cluster.append(replace(twin, id=10_000 + at, submitted_at=twin.submitted_at + at))
    snap = snapshot(NODES, ACCOUNTS, cluster, policy=POLICY, weights=WEIGHTS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_Pass, "_plan_key", lambda self, requester: (requester.id,))
        alone = schedule(snap, ProjectTree(ACCOUNTS))
    assert schedule(snap, ProjectTree(ACCOUNTS)) == alone


@settings(max_examples=150, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(0, 16))
def test_free_work_no_gpu_is_left_for_takes_its_places_as_each_would(rng, free_work):
    """Once no GPU is left, free or to borrow, a pass queues the rest of the free
    work in stretches: the queue and decisions of walking it slice by slice."""
    cluster = a_cluster(rng)
    cluster += [replace(a_pending(rng, NOW), contract=Contract(0.0)) for _ in range(free_work)]
    snap = snapshot(NODES, ACCOUNTS, cluster, policy=POLICY, weights=WEIGHTS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_Pass, "_nothing_fits", lambda self: False)
        walked = schedule(snap, ProjectTree(ACCOUNTS))
    decisions = schedule(snap, ProjectTree(ACCOUNTS))
    event(f"stretches: {any(isinstance(part, QueueStretch) for part in decisions.queue._parts)}")
    assert decisions == walked
    assert list(decisions.queue) == list(walked.queue)


def decisions_ids(decisions) -> list[int]:
    """The slices a pass's decisions change (and its queue's places, written too)."""
    return [
        *(g.slice_id for g in decisions.grants),
        *(p.slice_id for p in decisions.preemptions),
        *(e.slice_id for e in decisions.endings),
        *(r.slice_id for r in decisions.reservations),
        *(q.slice_id for q in decisions.queue),
    ]


def test_the_kept_state_follows_slices_through_their_life():
    """Submitted, granted, preempted, requeued, released: after each, the kept
    queues and holdings are those of the snapshot, not of an earlier one."""
    tree = ProjectTree(ACCOUNTS)
    kept = PassState(tree)
    big = running("b", "n0", tuple(range(8)), min_runtime=0.0, resumable=True)
    wanting = pending("a", 8, gpu_type="h100")
    live = {s.id: s for s in (big, wanting)}
    nodes = {n.name: n for n in NODES}
    now = NOW
    seen = []
    for _ in range(4):
        snap = snapshot(list(nodes.values()), ACCOUNTS, list(live.values()), now=now)
        decisions = schedule(snap, index=kept)
        assert decisions == schedule(snap, tree)
        check_pass(snap, decisions)
        live = apply(live, nodes, decisions, now, WEIGHTS).slices
        seen.append({s.id: s.state for s in live.values()})
        assert sorted(s.id for s in kept.holding()) == sorted(
            s.id for s in snap.slices if s.holds_gpus
        )
        now += 61.0
    # the wanting slice took n1 at once; the big one was never in its way
    assert seen[0][wanting.id] is SliceState.GRANTED
    del live[wanting.id]
    snap = snapshot(list(nodes.values()), ACCOUNTS, list(live.values()), now=now)
    assert schedule(snap, index=kept) == schedule(snap, tree)
    assert wanting.id not in {s.id for s in kept.holding()}


def test_a_holder_filed_on_a_gone_node_is_due_though_the_nodes_did_not_change():
    """The index works out once per list of nodes which holders' nodes are gone;
    a holder filed later on such a node (the list unchanged) is due all the same."""
    cluster = nodes(1)
    on_n0 = running("a", "n0", (0,))
    kept = PassState()
    kept.update(snapshot(cluster, flat_tree("a"), [on_n0]))
    assert kept.due(NOW) == []
    on_gone = running("a", "gone", (0,))  # a node the snapshot no longer lists
    kept.update(snapshot(cluster, flat_tree("a"), [on_n0, on_gone]))
    assert kept.due(NOW) == [on_gone.id]


def test_a_copy_of_the_index_counts_the_gpus_held_apart_from_the_original():
    """A what-if pass's copy that sees a holder gone leaves the original's count of
    held GPUs as it was: the original, rebuilding its free map (its nodes changed),
    still finds the holder's GPUs taken."""
    holder = running("a", "n0", (0, 1, 2))
    first = snapshot(NODES, ACCOUNTS, [holder], weights=WEIGHTS)
    kept = PassState(ProjectTree(ACCOUNTS))
    schedule(first, index=kept)
    copy = kept.copy()
    schedule(replace(first, slices=()), index=copy)  # in the copy's world it ended
    assert copy.free_map(NODES[:2], WEIGHTS).free["n0"] == set(range(8))
    assert kept.free_map(NODES[:2], WEIGHTS).free["n0"] == {3, 4, 5, 6, 7}


def test_a_holder_requeued_in_the_pass_is_no_release_it_was_before():
    """The index keeps each node's holders for release estimates between passes;
    a pass that requeues a holder (its grace over) uses its own instead: the
    holder's GPUs are free now and granted again, not a release to plan on."""
    tree = ProjectTree(ACCOUNTS)
    kept = PassState(tree)
    leaving = replace(
        running("b", "n0", tuple(range(8)), min_runtime=0.0, resumable=True),
        state=SliceState.PREEMPTING,
        preempt_deadline=NOW + 30,
    )
    protected = running("a", "n1", tuple(range(8)), min_runtime=10 * HOUR, max_runtime=12 * HOUR)
    first, second = pending("b", 8, priority=1), pending("b", 8)
    before = snapshot(NODES[:2], ACCOUNTS, [leaving, protected, first, second])
    decisions = schedule(before, index=kept)
    planned = decisions.reservations[0]  # the GPUs the leaving holder frees in 30 s
    assert (planned.slice_id, planned.placements[0].node) == (first.id, "n0")
    after = replace(before, now=NOW + 30)
    decisions = schedule(after, index=kept)
    assert decisions == schedule(after, tree)
    assert [g.slice_id for g in decisions.grants] == [first.id]
    assert [(r.slice_id, r.placements[0].node, r.due_at) for r in decisions.reservations] == [
        (second.id, "n1", NOW + 10 * HOUR)
    ]


def test_a_holder_preempted_in_the_pass_is_a_release_at_its_grace_deadline():
    """Once a pass preempts a holder, the release estimates see it leave when its
    grace ends, whoever plans next, and not as the index kept it (a holder that
    fair share would not let the planner take)."""
    tree = ProjectTree(ACCOUNTS)
    kept = PassState(tree)
    low = running("b", "n0", tuple(range(8)), priority=-1)  # unprotected for an hour
    protected = running("c", "n1", tuple(range(8)), min_runtime=10 * HOUR, max_runtime=12 * HOUR)
    outranks, other = pending("b", 8, priority=1), pending("a", 8)
    # b's work is walked first (a used the cluster more), and preempts its own.
    snap = snapshot(NODES[:2], ACCOUNTS, [low, protected, outranks, other], usage={"a": 100 * HOUR})
    decisions = schedule(snap, index=kept)
    assert decisions == schedule(snap, tree)
    assert [p.slice_id for p in decisions.preemptions] == [low.id]
    grace = snap.policy.grace_period
    assert (other.id, "n0", NOW + grace) in [
        (r.slice_id, r.placements[0].node, r.due_at) for r in decisions.reservations
    ]


def test_fair_shares_answers_are_kept_only_while_the_holdings_stay():
    """The index keeps fair share's "may b take from a at all" from one pass to
    the next only while the standings are the same: here a's holdings grew
    (and fair shares did not move), so b may now take from a, as a fresh pass says."""
    tree = flat_tree("a", "b", "c")
    kept = PassState(ProjectTree(tree))
    waiting = pending("b", 8)
    first = [
        running("a", "n0", tuple(range(8))),
        running("c", "n1", tuple(range(8))),
        running("b", "n2", tuple(range(8))),
    ]
    decisions = schedule(snapshot(nodes(3), tree, [*first, waiting]), index=kept)
    assert decisions.preemptions == ()  # every project at its share: b may not take
    grown = [running("a", "n2", (0, 1, 2, 3)), running("a", "n2", (4, 5, 6, 7))]
    after = snapshot(nodes(3), tree, [*first[:2], *grown, waiting], now=NOW + 60)
    decisions = schedule(after, index=kept)
    assert decisions == schedule(after, ProjectTree(tree))
    assert [p.slice_id for p in decisions.preemptions] == [first[0].id]  # a's, one for two


def test_fair_shares_are_kept_only_while_the_same_projects_want_gpus():
    """The index keeps the fair shares from one pass to the next only while the
    same projects want GPUs: here c joins a and b, so each one's share shrinks to a
    third and c may take from a, as a fresh pass says."""
    tree = flat_tree("a", "b", "c")
    kept = PassState(ProjectTree(tree))
    first = [
        running("a", "n0", (0, 1, 2, 3)),
        running("a", "n0", (4, 5, 6, 7)),
        running("b", "n1", (0, 1, 2, 3)),
        running("b", "n1", (4, 5, 6, 7)),
        pending("a", 8),
    ]
    decisions = schedule(snapshot(nodes(2), tree, first), index=kept)
    assert decisions.preemptions == ()  # a and b at their shares of two
    after = snapshot(nodes(2), tree, [*first, pending("c", 2)], now=NOW + 60)
    decisions = schedule(after, index=kept)
    assert decisions == schedule(after, ProjectTree(tree))
    assert len(decisions.preemptions) == 1


def test_a_kept_shape_is_the_shape_of_the_slice_as_it_is_now():
    """The index keeps each blocked request's shape for the walk; a request that
    comes back changed (here: preempted once more, now past its preemption
    budget, so no reservation's owner may take it back) is walked with its new one."""
    tree = flat_tree("a", "b")
    kept = PassState(ProjectTree(tree))
    policy = Policy(max_reservations=0, preemption_budget=5, project_gpu_caps={"a": 8})
    holder = running("b", "n0", tuple(range(7)), min_runtime=10 * HOUR)
    # Larger than any node, the request makes no preemption attempt; the free GPUs
    # of three nodes could hold it (its project's cap holds it back), so the walk
    # takes it on its own, by its shape.
    again = pending("a", 16, preemptions=4)
    snap = snapshot(nodes(3), tree, [holder, again], policy=policy)
    schedule(snap, index=kept)
    assert kept.shapes[again.id] == kept.shape_number(again)
    budget_spent = replace(again, preemptions=5)
    snap = replace(snap, slices=(holder, budget_spent), now=NOW + 60)
    schedule(snap, index=kept)
    assert kept.shapes[again.id] == kept.shape_number(budget_spent) != kept.shape_number(again)
    assert pending_shape(budget_spent, policy) != pending_shape(again, policy)


@settings(max_examples=150, deadline=None)
@given(st.randoms(use_true_random=False), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4))
def test_a_pass_before_a_quiet_pass_s_until_decides_nothing_either(rng, later):
    """What lets the simulator leave passes out (``Decisions.quiet``): over the slices
    and nodes a pass that decided nothing left, any pass that ``still_quiet`` allows
    (before its ``until``, the window's order unchanged) decides nothing either."""
    tree = ProjectTree(ACCOUNTS)
    # Requests of the last minutes (their preemption delays still running) behind
    # holders whose protections end within the hours checked.
    live = {
        s.id: replace(s, submitted_at=NOW - rng.uniform(0, 20 * MIN))
        if s.state is SliceState.PENDING
        else replace(
            s,
            granted_at=NOW - s.contract.min_runtime + rng.choice([-MIN, 10 * MIN, HOUR, 3 * HOUR]),
        )
        for s in a_cluster(rng)
    }
    nodes = list(NODES)
    usage = {p: rng.uniform(0, 1e6) for p in PROJECTS}
    now = NOW
    for _ in range(6):  # let the cluster settle: passes until one decides nothing
        slices = list(live.values())
        snap = snapshot(
            nodes, ACCOUNTS, slices, usage=usage, policy=POLICY, now=now, weights=WEIGHTS
        )
        decisions = schedule(snap, tree)
        if decisions.quiet is not None:
            break
        live = apply(live, {n.name: n for n in nodes}, decisions, now, WEIGHTS).slices
        now += rng.choice([1.0, 61.0, 20 * MIN])
    else:
        event("never quiet")
        return
    quiet = decisions.quiet
    assert not (decisions.grants or decisions.preemptions or decisions.endings)
    assert apply(live, {n.name: n for n in nodes}, decisions, now, WEIGHTS).slices == live
    event("quiet")
    if decisions.deferred:
        event("quiet, with requests left to wait for releases")
    horizon = min(quiet.until, now + 6 * HOUR)
    for fraction in later:
        moved = dict(usage)
        if rng.random() < 0.5:  # usage moves with time; the order may or may not
            moved[rng.choice(PROJECTS)] *= rng.uniform(0.9, 1.1)
        at = now + fraction * (horizon - now)
        later_snap = replace(snap, now=at, usage=moved)
        if at >= quiet.until or not still_quiet(quiet, later_snap, tree):
            continue
        event("checked")
        again = schedule(later_snap, tree)
        assert not (again.grants or again.preemptions or again.endings or again.node_changes)
        assert set(again.deferred) <= set(decisions.deferred)
        assert again.quiet is not None


def test_a_quiet_pass_holds_only_before_its_until_and_while_the_windows_order_stays():
    """``still_quiet`` itself: the property above only reaches the passes it allows."""
    tree = ProjectTree(ACCOUNTS)
    usage = {"a": 10.0, "b": 60.0, "c": 40.0}  # a, then b (org1), then c
    order = tuple(tree.project_order(usage))
    quiet = Quiet(NOW + HOUR, order)
    snap = Snapshot(now=NOW, nodes=tuple(NODES), accounts=tuple(ACCOUNTS), slices=(), usage=usage)
    later = replace(snap, now=NOW + HOUR - 1, usage={p: 2 * u for p, u in usage.items()})
    assert still_quiet(quiet, later, tree)  # all doubled: the same order
    flipped = replace(later, usage={**later.usage, "a": 1000.0})  # b before a now
    assert tuple(tree.project_order(flipped.usage)) != order
    assert not still_quiet(quiet, flipped, tree)
    assert not still_quiet(quiet, replace(later, now=NOW + HOUR), tree)  # at its until
    assert not still_quiet(None, later, tree)


def _quiet_queue(max_reservations: int):
    """One node held by two of a's 4-GPU jobs past protection; b, under its share,
    asked for 4 GPUs 5 minutes ago and waits out its 15-minute preemption delay;
    a waits with a request of its own: nothing is granted or preempted, and b's
    request is planned for the end of a grace from now."""
    holders = [running("a", "n0", (0, 1, 2, 3)), running("a", "n0", (4, 5, 6, 7))]
    waiting = [pending("b", 4, submitted_at=NOW - 5 * MIN), pending("a", 2)]
    policy = Policy(max_reservations=max_reservations, batch_preemption_delay=15 * MIN)
    return snapshot(nodes(1), flat_tree("a", "b"), [*holders, *waiting], policy=policy)


def _after(snap, later):
    """The pass over ``later`` from the index kept by a pass over ``snap``, which must
    be quiet, beside a fresh pass over ``later``."""
    tree = ProjectTree(snap.accounts)
    kept = PassState(tree)
    assert schedule(snap, index=kept).quiet is not None and kept.settled is not None
    return schedule(later, index=kept), schedule(later, tree)


def _resume(snap, *joining, seconds: float = 1.0):
    """:func:`_after` with ``joining`` submitted ``seconds`` later."""
    return _after(snap, replace(snap, now=snap.now + seconds, slices=(*snap.slices, *joining)))


def test_a_request_joining_the_settled_tail_resumes_the_last_pass():
    # a's new request comes after a's preemption attempt and after the one
    # reservation the policy allows, and no GPU is free: the walk would only queue it
    snap = _quiet_queue(max_reservations=1)
    joining = pending("a", 4, submitted_at=snap.now)
    resumed, fresh = _resume(snap, joining, seconds=30.0)
    assert resumed == fresh
    assert resumed.phase_seconds.keys() == {RESUME_PHASE}  # no phase of a walk ran
    assert [e.slice_id for e in resumed.queue][-1] == joining.id
    # b's reservation falls due a grace after now: it moved with the 30 s
    assert resumed.reservations[0].due_at == snap.now + 30.0 + snap.policy.grace_period
    assert resumed.quiet.until == NOW - 5 * MIN + 15 * MIN  # b's delay ends


def test_a_request_that_could_still_be_planned_for_walks_the_queue():
    # two reservations allowed: the second went to a's first request, and b's new
    # one ranks before it, so it would be planned for instead
    snap = _quiet_queue(max_reservations=2)
    resumed, fresh = _resume(snap, pending("b", 4, submitted_at=snap.now))
    assert resumed == fresh and RESUME_PHASE not in resumed.phase_seconds


def test_a_request_that_fits_walks_the_queue():
    # a second node with one GPU free, which nobody waiting fits in: a's new 1-GPU
    # request does
    snap = _quiet_queue(max_reservations=1)
    seven = running("a", "n1", tuple(range(7)))
    snap = replace(snap, nodes=tuple(nodes(2)), slices=(*snap.slices, seven))
    resumed, fresh = _resume(snap, pending("a", 1, submitted_at=snap.now))
    assert resumed == fresh and RESUME_PHASE not in resumed.phase_seconds and resumed.grants


def test_a_request_that_comes_before_its_project_s_preemption_attempt_walks_the_queue():
    # a's new notebook ranks before a's batch request in a's own order: it makes a's
    # attempt now (and may take a's own batch work), so the walk must run
    snap = _quiet_queue(max_reservations=1)
    notebook = pending("a", 2, kind=SliceKind.INTERACTIVE, submitted_at=snap.now)
    resumed, fresh = _resume(snap, notebook)
    assert resumed == fresh and RESUME_PHASE not in resumed.phase_seconds


def test_a_request_that_may_borrow_reserved_gpus_walks_the_queue():
    # b's reservation holds the node's two free GPUs until a's job ends in an hour; a
    # new request that is sure to be gone by then may borrow them
    holders = [
        running("a", "n0", (0, 1, 2), max_runtime=3 * HOUR),
        running("a", "n0", (3, 4, 5)),
    ]
    waiting = [pending("b", 4, submitted_at=NOW - 5 * MIN), pending("a", 2)]
    snap = snapshot(
        nodes(1), flat_tree("a", "b"), [*holders, *waiting], policy=Policy(max_reservations=1)
    )
    short = pending("a", 2, max_runtime=30 * MIN, submitted_at=snap.now)
    resumed, fresh = _resume(snap, short)
    assert resumed == fresh and resumed.grants


def test_a_known_end_a_grace_from_now_is_not_taken_for_a_time_that_moves():
    # One of a's jobs ends a grace after the second pass: there the release estimate
    # is that fixed time, which equals "now plus a grace" and must not move with the
    # clock at the third.
    snap = _quiet_queue(max_reservations=1)
    first, second, *waiting = snap.slices
    ends = snap.now + 30.0 + snap.policy.grace_period
    first = replace(first, contract=replace(first.contract, max_runtime=ends - first.granted_at))
    snap = replace(snap, slices=(first, second, *waiting))
    tree = ProjectTree(snap.accounts)
    kept = PassState(tree)
    schedule(snap, index=kept)
    for seconds in (30.0, 40.0):
        joining = pending("a", 4, submitted_at=snap.now + seconds)
        snap = replace(snap, now=NOW + seconds, slices=(*snap.slices, joining))
        assert schedule(snap, index=kept) == schedule(snap, tree)


def test_a_request_changed_in_place_in_the_settled_tail_moves_to_its_new_place():
    snap = _quiet_queue(max_reservations=1)
    *rest, mine = snap.slices  # a's request, behind a's own attempt: make it two
    twin = replace(mine, id=mine.id + 1000, submitted_at=mine.submitted_at + 1)
    snap = replace(snap, slices=(*rest, mine, twin))
    later = replace(snap, now=snap.now + 1, slices=(*rest, mine, replace(twin, priority=-1)))
    resumed, fresh = _after(snap, later)
    assert resumed == fresh and resumed.phase_seconds.keys() == {RESUME_PHASE}


def test_a_node_set_draining_walks_the_queue():
    snap = _quiet_queue(max_reservations=1)
    draining = replace(snap.nodes[0], state=NodeState.DRAINING)
    walked, fresh = _after(snap, replace(snap, now=snap.now + 1, nodes=(draining,)))
    assert walked == fresh and walked.preemptions


def test_free_work_joining_walks_the_queue():
    # unallocated work is queued after every allocated request, whatever its project
    snap = _quiet_queue(max_reservations=1)
    free_work = pending("b", 8, min_runtime=0.0, submitted_at=snap.now)
    resumed, fresh = _resume(snap, free_work)
    assert resumed == fresh and fresh.queue[-1].slice_id == free_work.id


def test_a_release_walks_the_queue():
    # one of a's jobs ends: b's request fits in its GPUs now
    snap = _quiet_queue(max_reservations=1)
    first, second, *waiting = snap.slices
    recent = replace(second, submitted_at=snap.now)  # ranks late in a's own order
    snap = replace(snap, slices=(first, recent, *waiting))
    walked, fresh = _after(snap, replace(snap, now=snap.now + 1, slices=(first, *waiting)))
    assert walked == fresh and walked.grants


def test_a_resumed_pass_makes_its_queue_when_read_from_its_own_time():
    # The queue of a resumed pass is worked out when first read (the simulator never
    # reads it): after later passes have moved the index on, it is still its own.
    snap = _quiet_queue(max_reservations=1)
    joining = pending("a", 4, submitted_at=snap.now)
    later = replace(snap, now=snap.now + 30.0, slices=(*snap.slices, joining))
    tree = ProjectTree(snap.accounts)
    kept = PassState(tree)
    schedule(snap, index=kept)
    resumed = schedule(later, index=kept)
    assert resumed.phase_seconds.keys() == {RESUME_PHASE}
    # the requests leave before anyone reads the queue (the index told, as the
    # simulator tells it, so that it forgets them in place)
    holders, requests = later.slices[:2], later.slices[2:]
    kept.expect({s.id: None for s in requests})
    schedule(replace(later, now=later.now + HOUR, slices=holders), index=kept)
    fresh = schedule(later, tree).queue
    assert [e.slice_id for e in fresh][-1] == joining.id
    assert resumed.queue == fresh


def test_resumed_passes_in_a_row_leave_few_queues_unmade():
    # Each unmade queue holds the one it edits: past MOST_UNMADE in a row the
    # oldest is made, so a long run of resumed passes holds few, and reading the
    # last one still gives the queue a walked pass gives.
    snap = _quiet_queue(max_reservations=1)
    tree = ProjectTree(snap.accounts)
    kept = PassState(tree)
    schedule(snap, index=kept)
    later = snap
    for step in range(1, 3 * MOST_UNMADE):
        joining = pending("a", 4, submitted_at=snap.now + step)
        later = replace(later, now=snap.now + step, slices=(*later.slices, joining))
        resumed = schedule(later, index=kept)
        assert resumed.phase_seconds.keys() == {RESUME_PHASE}
        assert 1 <= resumed.queue.unmade() <= MOST_UNMADE
    assert resumed.queue == schedule(later, tree).queue
    assert [e.slice_id for e in resumed.queue][-1] == joining.id


def test_a_resumed_pass_says_until_when_it_is_quiet_as_a_walked_one_does():
    # A request that has waited 10 of its 15 minutes joins the settled tail: past its
    # project's preemption attempt, its delay ending changes nothing, and the first
    # threshold is still the end of b's delay, which held b's found victims back.
    snap = _quiet_queue(max_reservations=1)
    early = pending("a", 4, submitted_at=NOW - 10 * MIN)
    resumed, fresh = _resume(snap, early)
    assert resumed == fresh and resumed.phase_seconds.keys() == {RESUME_PHASE}
    assert resumed.deferred == fresh.deferred == (snap.slices[2].id,)  # b's request
    assert resumed.quiet.until == NOW + 10 * MIN
    # ... and so it is for a walked pass with it, and for a resumed one once it left
    tree = ProjectTree(snap.accounts)
    kept = PassState(tree)
    with_early = replace(snap, slices=(*snap.slices, early))
    assert schedule(with_early, index=kept).quiet.until == NOW + 10 * MIN
    later = replace(snap, now=snap.now + 1)
    resumed = schedule(later, index=kept)
    assert resumed == schedule(later, tree) and resumed.phase_seconds.keys() == {RESUME_PHASE}
    assert resumed.quiet.until == NOW + 10 * MIN


def test_a_quiet_pass_ends_where_a_drain_or_the_debug_lane_could_take_a_holder():
    # a's 8-GPU batch job on n0 is protected for 30 more minutes, b's on n1 for
    # nearly 8 hours; each holds its fair share, so fair share takes from neither.
    a_job = running("a", "n0", tuple(range(8)), min_runtime=HOUR, granted_ago=30 * MIN)
    b_job = running("b", "n1", tuple(range(8)), min_runtime=8 * HOUR, granted_ago=MIN)
    accounts = flat_tree("a", "b")
    # Nothing waits: the pass is quiet for as long as nothing is due.
    snap = snapshot(nodes(2), accounts, [a_job, b_job])
    assert schedule(snap).quiet.until == math.inf
    # n0 drains: a's job leaves when its protection ends.
    draining = (replace(snap.nodes[0], state=NodeState.DRAINING), snap.nodes[1])
    quiet = schedule(replace(snap, nodes=draining)).quiet
    assert quiet.until == a_job.protected_until
    # b's debug session waits: the debug lane may take a's batch job once it is
    # unprotected, before b's own job's protection ends.
    session = pending("b", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN)
    quiet = schedule(replace(snap, slices=(a_job, b_job, session))).quiet
    assert quiet.until == a_job.protected_until < b_job.protected_until


def test_a_heartbeat_resumes_the_last_pass_and_a_lapsed_lease_walks_it():
    snap = _quiet_queue(max_reservations=1)
    first, *rest = snap.slices
    leased = replace(first, lease_expires_at=NOW + 2 * HOUR)
    snap = replace(snap, slices=(leased, *rest))
    tree = ProjectTree(snap.accounts)
    kept = PassState(tree)
    schedule(snap, index=kept)
    renewed = replace(leased, lease_expires_at=NOW + 3 * MIN)
    beat = replace(snap, now=NOW + 30, slices=(renewed, *rest))
    resumed = schedule(beat, index=kept)
    assert resumed == schedule(beat, tree) and resumed.phase_seconds.keys() == {RESUME_PHASE}
    # no heartbeat comes again: the lease runs out, and the holder is lost
    lapsed = replace(beat, now=NOW + 3 * MIN)
    walked = schedule(lapsed, index=kept)
    assert walked == schedule(lapsed, tree) and walked.endings


def test_a_lease_moved_to_the_past_walks_the_queue():
    # not a heartbeat: a lease set to end before now ends its holder at once
    snap = _quiet_queue(max_reservations=1)
    first, *rest = snap.slices
    snap = replace(snap, slices=(replace(first, lease_expires_at=NOW + 2 * HOUR), *rest))
    cut = replace(snap, now=NOW + 30, slices=(replace(first, lease_expires_at=NOW + 29), *rest))
    walked, fresh = _after(snap, cut)
    assert walked == fresh and walked.endings


def test_gpu_types_valued_anew_walk_the_queue():
    # a holds the h100 node, b the b200 node, c waits out its delay; valued alike, c's
    # reservation is the first node by name (b's); with b200s worth 0.4 h100s, b
    # stands under its share and only a's node may be taken for c
    holders = [
        running("a", "n0", (0, 1, 2, 3)),
        running("a", "n0", (4, 5, 6, 7)),
        running("b", "m0", (0, 1, 2, 3), gpu_type="b200"),
        running("b", "m0", (4, 5, 6, 7), gpu_type="b200"),
    ]
    request = pending("c", 4, submitted_at=NOW - 5 * MIN)
    policy = Policy(max_reservations=1, batch_preemption_delay=15 * MIN)
    cluster = [*nodes(1), *nodes(1, gpu_type="b200", prefix="m")]
    snap = snapshot(
        cluster,
        flat_tree("a", "b", "c"),
        [*holders, request],
        policy=policy,
        weights={"h100": 1.0, "b200": 1.0},
    )
    assert schedule(snap).reservations[0].placements[0].node == "m0"
    valued = replace(snap, now=snap.now + 1, gpu_type_weights={"h100": 1.0, "b200": 0.4})
    walked, fresh = _after(snap, valued)
    assert walked == fresh and walked.reservations[0].placements[0].node == "n0"


def test_a_request_holding_a_promise_that_leaves_walks_the_queue():
    # b's request was promised the GPUs of a's job on its way out; it is withdrawn
    # before they are free: the promise goes with it, which only the walk knows
    leaving = preempting(running("a", "n0", (0, 1, 2, 3)), NOW + 30)
    staying = running("a", "n0", (4, 5, 6, 7), granted_ago=10 * MIN)
    first = pending("b", 8, submitted_at=NOW - 2 * HOUR)
    promised = replace(
        pending("b", 4, submitted_at=NOW - HOUR), promised=(Placement("n0", (0, 1, 2, 3)),)
    )
    snap = snapshot(
        nodes(1),
        flat_tree("a", "b"),
        [leaving, staying, first, promised],
        policy=Policy(max_reservations=1),
    )
    assert any(r.promised for r in schedule(snap).reservations)
    withdrawn = replace(snap, now=NOW + 1, slices=(leaving, staying, first))
    walked, fresh = _after(snap, withdrawn)
    assert walked == fresh and not any(r.promised for r in walked.reservations)


def test_with_debug_sessions_first_the_queue_is_walked():
    # debug_first puts a's two debug sessions ahead of b's request, out of the
    # queue's own order: a request of b's joining goes after b's, not before them
    holders = [
        running("a", "n0", (0, 1, 2, 3), granted_ago=10 * MIN),
        running("a", "n0", (4, 5, 6, 7), granted_ago=10 * MIN),
    ]
    sessions = [pending("a", 1, kind=SliceKind.INTERACTIVE, min_runtime=10 * MIN) for _ in range(2)]
    request = pending("b", 4, submitted_at=NOW - 2 * HOUR)
    policy = Policy(debug_first=True, max_reservations=3, debug_lane_fraction=0.25)
    snap = snapshot(nodes(1), flat_tree("a", "b"), [*holders, *sessions, request], policy=policy)
    assert schedule(snap).queue[-1].slice_id == request.id
    joining = pending("b", 4, submitted_at=NOW)
    walked, fresh = _resume(snap, joining)
    assert walked == fresh and walked.queue[-1].slice_id == joining.id


def test_a_holder_with_no_grant_time_is_unprotected_to_the_index_as_to_the_rule():
    """A holder without a grant time has no protection (``Slice.is_protected``): the
    index lists it among who could be a victim, as a pass over every holder did."""
    timeless = replace(running("a", "n0", (0,)), granted_at=None)
    timed = running("a", "n0", (1,), granted_ago=0.0)
    kept = PassState()
    kept.update(snapshot(nodes(1), flat_tree("a"), [timed]))
    kept.victims_at(NOW)  # filed from now on as the protections end
    kept.update(snapshot(nodes(1), flat_tree("a"), [timeless, timed]))
    assert not timeless.is_protected(NOW) and timed.is_protected(NOW)
    assert list(kept.victims_at(NOW).slices) == [timeless.id]
