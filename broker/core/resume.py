"""What a pass that decided nothing tells the next one (design.md §5).

A pass that grants, preempts, ends and changes nothing leaves the slices, the
standings, the free GPUs and the debug lane as it found them. So it can say

- until when a pass over the same slices and nodes decides nothing either
  (:func:`quiet_until`, :class:`~broker.core.model.Quiet`): only time moves, and
  time reaches a pass through the window's project order and a few thresholds;
- what the next pass is when the only change is requests joining or leaving the
  *settled tail* of its queue — past every reservation it planned and past their
  project's preemption attempt, too large for the GPUs left — the same
  decisions, with that queue edited (:func:`resumed`): the walk need not run.

Both are checked against a fresh pass by property tests
(tests/test_incremental_pass.py).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from .backfill import outlasts
from .fairshare import ProjectTree
from .incremental import HolderKind, PassState
from .model import (
    Decisions,
    Policy,
    Queue,
    QueueRow,
    Quiet,
    Reservation,
    Slice,
    SliceKind,
    SliceState,
    Snapshot,
)
from .ordering import walk_key
from .placement import FreeGpus
from .preemption import preemption_delay_ends
from .standing import Standings

#: The one phase a resumed pass reports (``Decisions.phase_seconds``): how many passes
#: resumed rather than walked, and what they took, reach the service's metrics.
RESUME_PHASE = "resume"

#: Resumed passes in a row whose queues may wait to be made: each holds the one it
#: edits and its snapshot's slices, so past these the oldest is made at once (a
#: tenth of the edits the queues cost when each was made in its pass).
MOST_UNMADE = 10


@dataclass(frozen=True)
class Settled:
    """What a quiet pass leaves for the next one to resume from (:func:`resumed`).

    ``planned_by``: the walk key of the request whose reservation was the last the
    policy allows in a pass (None: fewer were planned, so a later request would be);
    ``tried``: per project, the walk key of its preemption attempt; ``free`` and
    ``lendable``: the free GPUs (not to be changed) and how many reserved ones it may
    lend that the walk left after its planning, and ``latest_due`` when the last of
    those reservations falls due (-inf: none has a due time).
    """

    decisions: Decisions
    now: float
    nodes: tuple
    weights: tuple
    standings: Standings
    project_rank: dict[str, int]
    planned_by: tuple | None
    tried: dict[str, tuple]
    free: FreeGpus
    lendable: int
    latest_due: float

    def could_place(self, request: Slice, policy: Policy) -> bool:
        """Whether the walk could give ``request`` GPUs past its planning: it fits in
        the free ones, or it may borrow reserved ones — unless it would outlast every
        reservation (the first tests of the pass's ``_place``, which only refuse
        more as time goes on)."""
        gang = request.kind is SliceKind.BATCH
        if self.free.fit(request.gpus, request.gpu_type, gang) is not None:
            return True
        if request.gpus > self.free.free_total + self.lendable:
            return False
        return not outlasts(request.contract, self.now, policy.grace_period, self.latest_due)


def quiet_until(
    kept: PassState, now: float, policy: Policy, standings: Standings, deferred: Iterable[int]
) -> float:
    """Until when a pass over the slices of ``kept`` (those a quiet pass at ``now``
    left, with ``standings``, and ``deferred``) decides nothing either.

    The earliest of the thresholds at which time changes a pass's answers: a
    grace, maximum runtime or lease ending (and, one grace period before it, where
    the release estimates and the known releases compare with ``now`` plus a
    grace); the preemption delay ending of a request the pass ``deferred``; the
    protection ending of a holder that a drain or a waiting request could then
    take. Whatever else compares with ``now`` (borrowing reserved GPUs) only
    refuses more as time goes on.

    A delay is read only where a search found victims and the delay held the
    request back (design.md §5.7): the other requests' searches find none until a
    protection, grace, runtime or lease ends, thresholds of their own.
    """
    grace = policy.grace_period
    ends, ahead = kept.next_deadline(now), kept.next_deadline(now + grace)
    until = math.inf if ends is None else ends
    if ahead is not None:
        until = min(until, ahead - grace)
    for slice_id in deferred:
        delay_ends = preemption_delay_ends(kept.slices[slice_id], policy)
        if now < delay_ends < until:
            until = delay_ends
    debug_waits = kept.debug_waits()
    waiting = set(kept.waiting())  # projects with allocated work waiting
    taken_from: dict[str, bool] = {}  # project -> whether a waiting project may take its GPUs
    for kind, at in kept.first_protection_ends(now):
        if at < until and _may_become_victim(kind, standings, waiting, debug_waits, taken_from):
            until = at
    # A holder on a node that is not ready may be drained, whatever its kind.
    for slice_id in kept.held_where_unready():
        protected_until = kept.slices[slice_id].protected_until
        if protected_until is not None and now < protected_until < until:
            until = protected_until
    return until


def _may_become_victim(
    kind: HolderKind,
    standings: Standings,
    waiting: set[str],
    debug_waits: bool,
    taken_from: dict[str, bool],
) -> bool:
    """Whether a holder of ``kind`` (:func:`holder_kind`) on a ready node, once its
    protection ends, is one that a request of the ``waiting`` projects could take
    (:func:`preempt_reason`, asked at its most lenient) or one already leaving;
    True where unsure. ``taken_from``: the answers per holder project so far,
    which depend on nothing else."""
    project, allocated, batch, spent, granted = kind
    if not granted:
        return True
    if not waiting:
        return False
    if not allocated or project in waiting:
        return True
    if spent:
        return False
    if debug_waits and batch:
        return True
    taken = taken_from.get(project)
    if taken is None:
        taken = taken_from[project] = any(
            standings.may_take_at_all(mine, project, gang)
            for mine in waiting
            for gang in (False, True)
        )
    return taken


def still_quiet(quiet: Quiet | None, snapshot: Snapshot, tree: ProjectTree) -> bool:
    """Whether a pass over ``snapshot`` would decide nothing, told from the last
    pass's ``quiet`` alone: true only if the caller knows that the slices and
    nodes are those that pass left, and ``snapshot`` comes before ``quiet.until``
    with the window's project order unchanged."""
    return (
        quiet is not None
        and snapshot.now < quiet.until
        and tuple(tree.project_order(snapshot.usage)) == quiet.window_order
    )


def shifts_with_now(at: float | None, now: float, policy: Policy) -> bool:
    """Whether a quiet pass's estimated start or due time ``at`` moves with ``now``:
    a release estimate of "now plus a grace" (a holder the request could take) or
    of "now" itself. :func:`resumable_at` makes sure no fixed time shares those
    values."""
    return at is not None and (at == now or at == now + policy.grace_period)


def resumable_at(kept: PassState, now: float, policy: Policy) -> bool:
    """Whether no fixed time a pass compares (an end of grace, maximum runtime or
    lease) falls exactly on ``now`` plus a grace, where :func:`shifts_with_now`
    could not tell it from one that moves."""
    return not kept.deadline_at(now + policy.grace_period)


def settled_at(
    settled: Settled, decisions: Decisions, snapshot: Snapshot, kept: PassState
) -> Settled | None:
    """What a pass resumed over ``snapshot`` (its ``decisions``) leaves for the next,
    unless a fixed time falls where :func:`shifts_with_now` could not tell it apart
    from one that moves (then None)."""
    if not resumable_at(kept, snapshot.now, snapshot.policy):
        return None
    return replace(settled, decisions=decisions, now=snapshot.now)


def resumed(
    settled: Settled, snapshot: Snapshot, kept: PassState, tree: ProjectTree
) -> Decisions | None:
    """The pass over ``snapshot`` from what the quiet pass before it ``settled``,
    when the only changes since (``kept.changed``) are allocated requests joining
    or leaving the settled tail of its walk, and heartbeats (:func:`_renewed`);
    None when the walk must run.

    Such a request is past every reservation the walk planned and past its
    project's preemption attempt (so its project waits with other work before
    and after: fair share now is shared among the same projects), and finds no
    GPUs the walk left (free, or reserved ones it may borrow): the walk would
    only give it its place in the queue, and nothing after it would change.
    Time moved too: the window values shown and the estimates that move with
    ``now`` (:func:`shifts_with_now`) follow it.
    """
    changed, policy = kept.changed, snapshot.policy
    before = settled.decisions
    if (
        changed is None
        or policy.debug_first
        or snapshot.nodes != settled.nodes
        or tuple(sorted(snapshot.gpu_type_weights.items())) != settled.weights
        or not still_quiet(before.quiet, snapshot, tree)
    ):
        return None
    rank = settled.project_rank
    joining: list[tuple[tuple, Slice]] = []
    leaving: list[Slice] = []
    for old, new in changed.values():
        if _renewed(old, new, snapshot.now):
            continue
        for slice_ in (old, new):
            if slice_ is None:
                continue
            if slice_.state is not SliceState.PENDING or not slice_.allocated or slice_.promised:
                return None  # a holder, free work or a kept promise: not the walk's tail
            key, tried = walk_key(slice_, rank), settled.tried.get(slice_.project)
            if settled.planned_by is None or key <= settled.planned_by:
                return None  # a reservation could be planned for it, or was
            if tried is None or key <= tried:
                return None  # its project's preemption attempt could be its, or was
        # A request changed in place leaves its old place and joins at its new one.
        if old is not None:
            leaving.append(old)
        if new is not None:
            if settled.could_place(new, policy):
                return None
            joining.append((walk_key(new, rank), new))
    return _edited(settled, snapshot, kept, tree, sorted(joining), leaving)


def _renewed(old: Slice | None, new: Slice | None, now: float) -> bool:
    """Whether ``new`` is ``old`` with only its lease moved, and not over by ``now``:
    a heartbeat, which a pass reads only when the lease ends (and the next quiet
    until, worked out again from the index, counts that end)."""
    if old is None or new is None or new.lease_expires_at is None:
        return False
    return new.lease_expires_at > now and replace(old, lease_expires_at=new.lease_expires_at) == new


def _edited(
    settled: Settled,
    snapshot: Snapshot,
    kept: PassState,
    tree: ProjectTree,
    joining: list[tuple[tuple, Slice]],
    leaving: list[Slice],
) -> Decisions:
    """The quiet pass's decisions with ``joining`` placed in its queue by their walk
    keys, ``leaving`` taken out, and what moves with time moved."""
    before, now, policy = settled.decisions, snapshot.now, snapshot.policy
    then, shift = settled.now, now - settled.now
    if before.queue.unmade() >= MOST_UNMADE:
        before.queue.rows()  # see MOST_UNMADE
    edit = _QueueEdit(
        before=before.queue,
        gone=frozenset(s.id for s in leaving),
        joining=tuple(joining),
        slices=snapshot.slices,
        rank=settled.project_rank,
        values=tree.share_used(snapshot.usage),
        # The walk's part of the queue: after the kept promises, before unallocated work.
        promised=sum(1 for r in before.reservations if r.promised),
        unallocated=sum(
            len(queued) for (allocated, _), (_, queued) in kept.queues.items() if not allocated
        ),
        then=then,
        shift=shift,
        policy=policy,
    )
    reservations = tuple(
        Reservation(r.slice_id, r.placements, r.promised, r.due_at + shift)  # type: ignore[operator]
        if shift and shifts_with_now(r.due_at, then, policy)
        else r
        for r in before.reservations
    )
    quiet = before.quiet
    assert quiet is not None  # resumed only from a quiet pass
    until = quiet_until(kept, now, policy, settled.standings, before.deferred)
    return Decisions(
        reservations=reservations,
        queue=Queue.later(edit.rows, unmade=before.queue.unmade() + 1),
        deferred=before.deferred,
        quiet=Quiet(until, quiet.window_order),
    )


@dataclass(frozen=True)
class _QueueEdit:
    """A resumed pass's queue, worked out only when read (the simulator never reads
    it): the quiet pass's ``before`` less ``gone``, with ``joining`` placed by their
    walk keys, values and moving estimates brought to now. Holds only data that no
    longer changes (the snapshot's slices, not the index's)."""

    before: Queue
    gone: frozenset[int]
    joining: tuple[tuple[tuple, Slice], ...]
    slices: Sequence[Slice]
    rank: Mapping[str, int]
    values: Mapping[str, float]
    promised: int
    unallocated: int
    then: float
    shift: float
    policy: Policy

    def rows(self) -> list[QueueRow]:
        live = {s.id: s for s in self.slices}
        gone, rank, values, then, shift = self.gone, self.rank, self.values, self.then, self.shift
        rows = [r for r in self.before.rows() if r[0] not in gone]
        start, end = self.promised, len(rows) - self.unallocated
        for key, slice_ in reversed(self.joining):
            at = bisect_left(rows, key, start, end, key=lambda r: walk_key(live[r[0]], rank))
            rows.insert(at, (slice_.id, 0, math.nan, None))  # made whole below
            end += 1
        made: list[QueueRow] = []
        for position, (slice_id, _, _, estimated) in enumerate(rows, 1):
            if estimated is not None and shift and shifts_with_now(estimated, then, self.policy):
                estimated += shift
            made.append((slice_id, position, values[live[slice_id].project], estimated))
        return made
