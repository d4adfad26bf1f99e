"""Checks of one scheduling pass written from the rules of design.md §5, not from the
pass's code: the property tests run them on every pass they make, so a mistake in the
pass cannot hide behind the same mistake in its oracle."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from hypothesis import currently_in_test_context
from hypothesis import event as hypothesis_event

from broker.core import backfill
from broker.core.incremental import whole_node_floor
from broker.core.model import (
    Decisions,
    EndReason,
    Node,
    NodeState,
    Placement,
    Policy,
    PreemptReason,
    Slice,
    SliceKind,
    SliceState,
    Snapshot,
)
from broker.core.ordering import within_project_key
from broker.core.preemption import grace_for, is_debug, past_budget, preemption_delay
from broker.core.scheduler import _Pass


@contextmanager
def every_node_asked() -> Iterator[None]:
    """Reservation plans that ask every node, none skipped for its floor or for
    holders that never give its GPUs back (``backfill.plan`` as it was before gangs
    asked in order)."""
    plan = backfill.plan
    backfill.plan = lambda requester, **asked: plan(
        requester, **{**asked, "whole_node_floors": None, "most_freed": None}
    )
    try:
        yield
    finally:
        backfill.plan = plan


@contextmanager
def floors_checked() -> Iterator[None]:
    """Each pass's whole-node floors (the order in which a gang's plan asks the
    nodes), read from the index where it can, checked when worked out against
    their definition: every ready node's :func:`whole_node_floor` as the pass sees
    it then, sorted. (Kept until someone is preempted, they may then lag behind
    it, never ahead.)"""
    kept_floors = _Pass._whole_node_floors

    def checked(self: _Pass) -> backfill.Floors:
        worked_out = self._floors is None
        floors = kept_floors(self)
        if not worked_out:
            return floors
        grace, expected = self.policy.grace_period, {}
        for name, node in self.free.nodes.items():
            unfree = node.gpu_count - len(self.free.free.get(name, ()))
            floor = whole_node_floor(self._node_holders(name), self.now, grace, unfree)
            expected.setdefault(node.gpu_type, []).append((floor, name))
        event("a gang's plan asked the whole-node floors")
        assert {t: list(f) for t, f in floors.items()} == {
            t: sorted(e) for t, e in expected.items()
        }
        return floors

    _Pass._whole_node_floors = checked  # type: ignore[method-assign]
    try:
        yield
    finally:
        _Pass._whole_node_floors = kept_floors  # type: ignore[method-assign]


def event(what: str) -> None:
    """Tell hypothesis what this pass reached; outside a hypothesis test, nothing."""
    if currently_in_test_context():
        hypothesis_event(what)


def check_pass(snap: Snapshot, decisions: Decisions) -> None:
    """Every check of one pass's decisions on the snapshot it was given."""
    check_endings(snap, decisions)
    check_queue_complete(snap, decisions)
    check_preemptions(snap, decisions)
    check_grants(snap, decisions)
    check_borrowers(snap, decisions)
    check_liveness(snap, decisions)
    check_no_gpu_idle_while_work_fits(snap, decisions)
    count_reach(snap, decisions)


def check_endings(snap: Snapshot, decisions: Decisions) -> None:
    """Every term that fell due by ``now`` (grace, ``max_runtime``) ends the slice; of
    those whose lease is over by more than the broker answered heartbeats late since
    their last heartbeat, the lapse limit's allowance ends ``lost``, those whose lease
    ended longest ago first, and the pass says it holds the rest (design.md §8)."""
    ended = {e.slice_id: e.reason for e in decisions.endings}
    lapsed, excused = [], set()
    for slice_ in snap.slices:
        ends = slice_.ends_at() if slice_.holds_gpus else None
        if ends is not None and ends <= snap.now:
            assert slice_.id in ended, f"slice {slice_.id} outlived its end at {ends}"
        lease = slice_.lease_expires_at
        if (
            lease is not None
            and lease <= snap.now
            and ended.get(slice_.id, EndReason.LOST) is EndReason.LOST
        ):
            late = sum(
                max(0.0, min(until, snap.now) - max(since, lease - snap.lease))
                for since, until in snap.answered_late
            )
            if snap.now - lease < late:
                assert slice_.id not in ended, "no lease runs out over time answered late"
                excused.add(slice_.id)
            else:
                lapsed.append(slice_)
    policy = snap.policy
    leased = sum(1 for s in snap.slices if s.lease_expires_at is not None)
    per_minute = max(policy.lease_lapse_floor, math.floor(policy.lease_lapse_fraction * leased))
    allowed = max(0, per_minute - snap.lapsed_last_minute)
    lapsed.sort(key=lambda s: (s.lease_expires_at, s.id))
    lost = {s.id for s in lapsed if s.id in ended}
    assert lost == {s.id for s in lapsed[:allowed]}, "the lapse limit ends the longest lapsed"
    assert set(decisions.lapses_held) == {s.id for s in lapsed[allowed:]} | excused
    if lapsed[allowed:]:
        event("the lapse limit held leases back")
    if excused:
        event("leases kept over time answered late")


def check_queue_complete(snap: Snapshot, decisions: Decisions) -> None:
    """Every slice left waiting (pending and not ended, or requeued) and not granted
    has one place in the queue, and nothing else has one: a waiting slice left out
    would show no place at all."""
    ended = {e.slice_id: e.requeue for e in decisions.endings}
    granted = {g.slice_id for g in decisions.grants}
    waiting = {
        s.id
        for s in snap.slices
        if ((s.state is SliceState.PENDING and s.id not in ended) or ended.get(s.id))
        and s.id not in granted
    }
    placed = [e.slice_id for e in decisions.queue]
    assert len(placed) == len(set(placed)), "a slice has two places in the queue"
    assert set(placed) == waiting, (
        f"queue places {sorted(set(placed) ^ waiting)} do not match the slices left waiting"
    )


def check_preemptions(snap: Snapshot, decisions: Decisions) -> None:
    live = {s.id: s for s in snap.slices}
    nodes = {n.name: n for n in snap.nodes}
    ended = {e.slice_id for e in decisions.endings}
    requeued = {e.slice_id for e in decisions.endings if e.requeue}
    victims = [p.slice_id for p in decisions.preemptions]
    assert len(victims) == len(set(victims)), "a slice preempted twice in one pass"
    for p in decisions.preemptions:
        victim = live[p.slice_id]
        assert p.slice_id not in ended
        assert victim.state is SliceState.GRANTED, (
            f"slice {victim.id} preempted while {victim.state}"
        )
        assert not victim.is_protected(snap.now), f"protected slice {victim.id} preempted"
        if p.reason is PreemptReason.DRAIN:
            assert p.deadline == snap.now + snap.policy.grace_period
            assert any(nodes[pl.node].state is NodeState.DRAINING for pl in victim.placements)
            continue
        requester = live[p.for_slice] if p.for_slice is not None else None
        assert requester is not None and requester.allocated, "only allocated work preempts"
        assert p.deadline == snap.now + grace_for(requester, victim, snap.policy)
        assert not past_budget(victim, snap.policy), f"slice {victim.id} past its budget taken"
        if victim.allocated:
            waited = snap.now - requester.waiting_since
            assert waited >= preemption_delay(requester, snap.policy), (
                f"slice {requester.id} preempted allocated work after waiting {waited} s"
            )
        assert p.for_slice not in decisions.deferred
        assert requester.state is SliceState.PENDING or p.for_slice in requeued
        assert p.for_slice in {r.slice_id for r in decisions.reservations if r.promised}
        if p.reason is PreemptReason.UNALLOCATED:
            assert not victim.allocated
        elif p.reason is PreemptReason.PRIORITY:
            assert victim.project == requester.project and victim.allocated
            assert within_project_key(victim) > within_project_key(requester)
        elif p.reason is PreemptReason.FAIR_SHARE:
            assert victim.project != requester.project and victim.allocated
        elif p.reason is PreemptReason.DEBUG_LANE:
            assert victim.kind is SliceKind.BATCH and is_debug(requester, snap.policy)


def check_grants(snap: Snapshot, decisions: Decisions) -> None:
    live = {s.id: s for s in snap.slices}
    nodes = {n.name: n for n in snap.nodes}
    for g in decisions.grants:
        slice_ = live[g.slice_id]
        assert sum(len(pl.gpu_indices) for pl in g.placements) == slice_.gpus
        if len(g.placements) > 1:
            assert slice_.kind is SliceKind.BATCH, "only batch work spans nodes"
        for pl in g.placements:
            assert nodes[pl.node].state is NodeState.READY
            assert all(0 <= i < nodes[pl.node].gpu_count for i in pl.gpu_indices)
            assert slice_.gpu_type in (None, nodes[pl.node].gpu_type)
    for r in decisions.reservations:
        assert r.due_at is None or r.due_at >= snap.now
        for pl in r.placements:
            assert nodes[pl.node].state is NodeState.READY


def _gpus(placements: tuple[Placement, ...]) -> set[tuple[str, int]]:
    return {(p.node, i) for p in placements for i in p.gpu_indices}


def check_borrowers(snap: Snapshot, decisions: Decisions) -> None:
    """Work granted on GPUs reserved for a blocked slice must be gone, or preemptible,
    by the reservation's due time: it never delays the reservation."""
    live = {s.id: s for s in snap.slices}
    grace = snap.policy.grace_period
    for r in decisions.reservations:
        if r.promised or r.due_at is None:
            continue
        reserved = _gpus(r.placements)
        for g in decisions.grants:
            if not _gpus(g.placements) & reserved:
                continue
            event("grant on reserved GPUs")
            borrower = live[g.slice_id]
            max_runtime = borrower.contract.max_runtime
            assert (
                not borrower.allocated
                or (max_runtime is not None and snap.now + max_runtime <= r.due_at)
                or snap.now + borrower.contract.min_runtime + grace <= r.due_at
            ), f"slice {borrower.id} borrows GPUs reserved for {r.slice_id} past {r.due_at}"


def fits(slice_: Slice, free: dict[str, set[int]], nodes: dict[str, Node], headroom: int) -> bool:
    """Whether ``slice_`` could be placed on ``free`` GPUs now, leaving ``headroom`` free:
    on one node, or, for batch work larger than any node of its type, on several."""
    if sum(map(len, free.values())) - headroom < slice_.gpus:
        return False
    types = {n.gpu_type for n in nodes.values() if slice_.gpu_type in (None, n.gpu_type)}
    for gpu_type in types:
        of_type = [name for name, n in nodes.items() if n.gpu_type == gpu_type]
        if any(len(free[name]) >= slice_.gpus for name in of_type):
            return True
        largest = max(nodes[name].gpu_count for name in of_type)
        spans = slice_.kind is SliceKind.BATCH and slice_.gpus > largest
        if spans and sum(len(free[name]) for name in of_type) >= slice_.gpus:
            return True
    return False


def check_liveness(snap: Snapshot, decisions: Decisions) -> None:
    """The slice the pass ranks first (past any over its cap), if it fits the GPUs left
    free after this pass's endings and kept promises, is granted (or promised GPUs): a
    pass that drops or forgets work fails here.

    Whom the pass ranks first is its own business (fair share decides it); where it
    ranked each slice it left waiting is in its queue, whose positions count the
    slices it granted too. So the first position after the kept promises' is the
    head: granted if the queue has no entry there.
    """
    live = {s.id: s for s in snap.slices}
    requeued = {e.slice_id for e in decisions.endings if e.requeue}
    gone = {e.slice_id for e in decisions.endings}
    holding = [s for s in live.values() if s.holds_gpus and s.id not in gone]
    pending = [s for s in live.values() if s.state is SliceState.PENDING and s.id not in gone]
    pending += [replace(live[i], state=SliceState.PENDING, promised=()) for i in sorted(requeued)]
    kept = {
        s.id
        for s in pending
        if s.promised
        and any(
            o.slice_id == s.id and o.placements == s.promised
            for o in (*decisions.grants, *decisions.reservations)
        )
    }
    ready = {n.name: n for n in snap.nodes if n.state is NodeState.READY}
    free = {name: set(range(n.gpu_count)) for name, n in ready.items()}
    taken = [p for s in holding for p in s.placements]
    taken += [p for s in pending if s.id in kept for p in s.promised]
    for p in taken:
        free.get(p.node, set()).difference_update(p.gpu_indices)
    held_by: dict[str, int] = {}
    for s in [*holding, *(s for s in pending if s.id in kept)]:
        held_by[s.project] = held_by.get(s.project, 0) + s.gpus
    caps = snap.policy.project_gpu_caps
    waiting = {e.position: e.slice_id for e in decisions.queue if e.slice_id not in kept}
    # A backfill reservation is no answer for a slice that fits now: it waits on it.
    answered = {g.slice_id for g in decisions.grants}
    answered |= {r.slice_id for r in decisions.reservations if r.promised}
    by_id = {s.id: s for s in pending}
    position = 1 + sum(1 for e in decisions.queue if e.slice_id in kept)
    while position in waiting:
        head = by_id[waiting[position]]
        if head.project in caps and held_by.get(head.project, 0) + head.gpus > caps[head.project]:
            event("cap holds back work")
            position += 1  # it takes nothing: the next one is ranked behind nothing
            continue
        if fits(head, free, ready, snap.policy.debug_headroom):
            event("liveness: the head of the queue fits")
            assert head.id in answered, f"slice {head.id} fits, ranks first, and was left waiting"
        return
    if any(s.id not in kept for s in pending):
        event("liveness: the head of the queue was granted")


def check_no_gpu_idle_while_work_fits(snap: Snapshot, decisions: Decisions) -> None:
    """Beyond the head: no request of any rank is left waiting while the GPUs that nobody
    holds, is granted, is promised or has reserved after this pass would fit it (past its
    project's cap and the debug headroom). A pass that stops its walk early, or skips
    a shape it wrongly took for blocked, fails here."""
    live = {s.id: s for s in snap.slices}
    gone = {e.slice_id for e in decisions.endings}
    ready = {n.name: n for n in snap.nodes if n.state is NodeState.READY}
    free = {name: set(range(n.gpu_count)) for name, n in ready.items()}
    answered = {g.slice_id for g in decisions.grants} | {
        r.slice_id for r in decisions.reservations if r.promised
    }
    taken = [p for s in live.values() if s.holds_gpus and s.id not in gone for p in s.placements]
    taken += [p for s in live.values() if s.state is SliceState.PENDING for p in s.promised]
    taken += [p for g in decisions.grants for p in g.placements]
    taken += [p for r in decisions.reservations for p in r.placements]
    for p in taken:
        free.get(p.node, set()).difference_update(p.gpu_indices)
    if not any(free.values()):
        return
    claimed: dict[str, int] = {}
    for s in live.values():
        if (s.holds_gpus and s.id not in gone) or s.id in answered or s.promised:
            claimed[s.project] = claimed.get(s.project, 0) + s.gpus
    caps = snap.policy.project_gpu_caps
    for s in live.values():
        if s.state is not SliceState.PENDING or s.id in answered or s.id in gone:
            continue
        if s.project in caps and claimed.get(s.project, 0) + s.gpus > caps[s.project]:
            continue
        if fits(s, free, ready, snap.policy.debug_headroom):
            event("idle GPUs: a waiting request fits them")
            raise AssertionError(f"slice {s.id} fits GPUs left idle ({free}) and waits")


def check_after(now: float, live: dict[int, Slice], nodes: dict[str, Node], policy: Policy) -> None:
    """After the pass: nothing held twice, caps kept, and drained nodes empty."""
    owners: dict[tuple[str, int], int] = {}
    for slice_ in live.values():
        for key in _gpus(slice_.placements if slice_.holds_gpus else ()):
            assert key not in owners, f"GPU {key} held by {owners[key]} and {slice_.id}"
            owners[key] = slice_.id
    # promised GPUs belong to one pending slice each, and only held by leaving slices
    promised: dict[tuple[str, int], int] = {}
    for slice_ in live.values():
        if slice_.state is SliceState.PENDING:
            for key in _gpus(slice_.promised):
                assert key not in promised, f"GPU {key} promised twice"
                promised[key] = slice_.id
                holder = owners.get(key)
                if holder is not None:
                    assert live[holder].state is SliceState.PREEMPTING
    claimed: dict[str, int] = {}
    for slice_ in live.values():
        if slice_.holds_gpus or slice_.promised:
            claimed[slice_.project] = claimed.get(slice_.project, 0) + slice_.gpus
    for project, cap in policy.project_gpu_caps.items():
        assert claimed.get(project, 0) <= cap, f"{project} holds {claimed[project]} > cap {cap}"
    for node in nodes.values():
        if node.state is NodeState.DRAINED:
            assert all(key[0] != node.name for key in owners), f"{node.name} drained while held"


def count_reach(snap: Snapshot, decisions: Decisions) -> None:
    """Tell hypothesis which states this pass reached, for --hypothesis-show-statistics."""
    live = {s.id: s for s in snap.slices}
    for p in decisions.preemptions:
        event(f"preempted: {p.reason.value}")
    for e in decisions.endings:
        event(f"ended: {e.reason.value}" + (", requeued" if e.requeue else ""))
    for r in decisions.reservations:
        event("reservation: promised" if r.promised else "reservation: backfill")
        if len(r.placements) > 1:
            event("reservation: gang")
    for g in decisions.grants:
        event("granted")
        if len(g.placements) > 1:
            event("granted: gang over several nodes")
        if live[g.slice_id].promised:
            event("granted: a kept promise")
        if is_debug(live[g.slice_id], snap.policy):
            event("granted: debug session")
    for change in decisions.node_changes:
        event(f"node {change.state.value}")
