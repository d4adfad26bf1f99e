"""Invariants of SPEC §5 as properties over random clusters, trees and workloads.

Each example runs a short stretch of time: slices arrive, passes run, holders
release, nodes drain or go down, and the scheduler "crashes" (its working
state is rebuilt from the committed slices alone). After every pass:
no GPU is held twice, no protected slice is preempted, every grant is on a
ready node, charges equal the held time, and the same snapshot gives the same
decisions.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.accounting import usage_by_project
from broker.fairshare import ProjectTree
from broker.model import (
    Account,
    Contract,
    Node,
    NodeState,
    Policy,
    Slice,
    SliceKind,
    SliceState,
    Snapshot,
)
from broker.scheduler import schedule
from broker.transitions import apply, end_slice

WEIGHTS = {"h100": 1.0, "b200": 2.0}


@st.composite
def clusters(draw):
    node_count = draw(st.integers(1, 4))
    nodes = [
        Node(f"n{i}", draw(st.sampled_from(sorted(WEIGHTS))), draw(st.sampled_from([1, 2, 4, 8])))
        for i in range(node_count)
    ]
    # a random tree: every account's parent is an earlier account or the root
    names = [f"a{i}" for i in range(draw(st.integers(1, 6)))]
    accounts = []
    for i, name in enumerate(names):
        parent = draw(st.sampled_from([None, *names[:i]]))
        accounts.append(Account(name, draw(st.sampled_from([0.5, 1.0, 3.0])), parent))
    projects = ProjectTree(accounts).projects
    return nodes, accounts, projects


def requests(projects):
    return st.tuples(
        st.sampled_from(projects),
        st.integers(1, 12),
        st.sampled_from(list(SliceKind)),
        st.sampled_from([0.0, 60.0, 900.0, 3600.0]),
        st.booleans(),
        st.sampled_from([None, 300.0, 7200.0]),
        st.integers(-1, 1),
        st.sampled_from(["u1", "u2", "u3"]),
        st.sampled_from([None, "h100", "b200"]),
    )


events = st.sampled_from(["submit", "submit", "advance", "release", "drain", "down", "crash"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), cluster=clusters())
def test_invariants_hold_after_every_pass(data, cluster):
    nodes_list, accounts, projects = cluster
    nodes = {n.name: n for n in nodes_list}
    tree = ProjectTree(accounts)
    policy = Policy(
        grace_period=data.draw(st.sampled_from([0.0, 30.0, 120.0])),
        debug_headroom=data.draw(st.sampled_from([0, 0, 2])),
    )
    now = 1_000_000.0
    ids = itertools.count(1)
    live: dict[int, Slice] = {}
    ledger = []
    held_seconds: dict[int, float] = {}  # independent record: weighted GPU-seconds held

    def run_pass():
        nonlocal live, nodes
        running = [
            e
            for s in live.values()
            if s.holds_gpus
            and (e := end_slice(s, now, {n: v.gpu_type for n, v in nodes.items()}, WEIGHTS))
        ]
        usage = usage_by_project(ledger, running, now, policy.window)
        snap = Snapshot(
            now=now,
            nodes=tuple(nodes.values()),
            accounts=tuple(accounts),
            slices=tuple(live.values()),
            usage=usage,
            gpu_type_weights=WEIGHTS,
            policy=policy,
        )
        decisions = schedule(snap, tree)
        assert decisions == schedule(snap), "same snapshot, same decisions"
        for p in decisions.preemptions:
            victim = live[p.slice_id]
            assert not victim.is_protected(now), f"protected slice {victim.id} preempted"
            assert p.deadline >= now
        for g in decisions.grants:
            assert sum(len(pl.gpu_indices) for pl in g.placements) == live[g.slice_id].gpus
            for pl in g.placements:
                assert nodes[pl.node].state is NodeState.READY
                assert all(0 <= i < nodes[pl.node].gpu_count for i in pl.gpu_indices)
                if live[g.slice_id].gpu_type:
                    assert nodes[pl.node].gpu_type == live[g.slice_id].gpu_type
        applied = apply(live, nodes, decisions, now, WEIGHTS)
        ledger.extend(applied.charges)
        live, nodes = applied.slices, applied.nodes
        check_no_gpu_held_twice(live)

    def advance(seconds):
        nonlocal now
        for s in live.values():
            if s.holds_gpus and s.allocated:
                rate = sum(
                    len(p.gpu_indices) * WEIGHTS[nodes[p.node].gpu_type] for p in s.placements
                )
                held_seconds[s.id] = held_seconds.get(s.id, 0.0) + rate * seconds
        now += seconds

    for _ in range(data.draw(st.integers(5, 25))):
        event = data.draw(events)
        if event == "submit":
            project, gpus, kind, min_rt, resumable, max_rt, prio, user, gtype = data.draw(
                requests(projects)
            )
            if max_rt is not None and max_rt < min_rt:
                max_rt = None
            slice_id = next(ids)
            live[slice_id] = Slice(
                id=slice_id,
                project=project,
                user=user,
                gpus=gpus,
                kind=kind,
                contract=Contract(min_rt, resumable, max_rt),
                gpu_type=gtype,
                priority=prio,
                submitted_at=now,
            )
        elif event == "advance":
            advance(data.draw(st.sampled_from([10.0, 60.0, 600.0, 3600.0])))
        elif event == "release" and live:
            slice_ = live.pop(data.draw(st.sampled_from(sorted(live))))
            entry = end_slice(slice_, now, {n: v.gpu_type for n, v in nodes.items()}, WEIGHTS)
            if entry is not None:
                ledger.append(entry)
        elif event in ("drain", "down"):
            name = data.draw(st.sampled_from(sorted(nodes)))
            state = NodeState.DRAINING if event == "drain" else NodeState.DOWN
            if nodes[name].state is NodeState.READY:
                nodes[name] = replace(nodes[name], state=state)
        elif event == "crash":
            # Only committed state survives: rebuild every value from scratch.
            live = {k: replace(v) for k, v in live.items()}
        run_pass()

    # Close everything still held, then compare the ledger with the independent record.
    node_types = {n: v.gpu_type for n, v in nodes.items()}
    for slice_ in live.values():
        entry = end_slice(slice_, now, node_types, WEIGHTS)
        if entry is not None:
            ledger.append(entry)
    charged: dict[int, float] = {}
    for entry in ledger:
        charged[entry.slice_id] = charged.get(entry.slice_id, 0.0) + entry.weighted_gpu_seconds
    for slice_id in set(charged) | set(held_seconds):
        assert abs(charged.get(slice_id, 0.0) - held_seconds.get(slice_id, 0.0)) < 1e-6


def check_no_gpu_held_twice(live: dict[int, Slice]) -> None:
    owners: dict[tuple[str, int], int] = {}
    for slice_ in live.values():
        gpus = slice_.placements if slice_.holds_gpus else ()
        for placement in gpus:
            for index in placement.gpu_indices:
                key = (placement.node, index)
                assert key not in owners, f"GPU {key} held by {owners[key]} and {slice_.id}"
                owners[key] = slice_.id
    # promised GPUs belong to one pending slice each, and only held by leaving slices
    promised: dict[tuple[str, int], int] = {}
    for slice_ in live.values():
        if slice_.state is SliceState.PENDING:
            for placement in slice_.promised:
                for index in placement.gpu_indices:
                    key = (placement.node, index)
                    assert key not in promised, f"GPU {key} promised twice"
                    promised[key] = slice_.id
                    holder = owners.get(key)
                    if holder is not None:
                        assert live[holder].state is SliceState.PREEMPTING


def test_unallocated_slices_are_never_charged():
    nodes = {"n0": Node("n0", "h100", 8)}
    free = Slice(1, "a", "u", 8, SliceKind.BATCH, Contract(0.0))
    snap = Snapshot(0.0, tuple(nodes.values()), (Account("a"),), (free,))
    applied = apply({1: free}, nodes, schedule(snap), 0.0, {})
    granted = applied.slices[1]
    assert granted.state is SliceState.GRANTED
    assert end_slice(granted, 3600.0, {"n0": "h100"}, {}) is None
