"""The scheduling pass (design.md §5): a pure function from a snapshot to decisions.

It reads nothing but its :class:`~broker.core.model.Snapshot` — no database, no
network, no wall clock for decisions — so the service, the simulator and the
benchmarks all run this same code, and the same snapshot always gives the
same decisions.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from bisect import bisect_right, insort
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import cached_property
from operator import attrgetter, itemgetter

from . import backfill
from .fairshare import ProjectTree
from .incremental import NodeHolders, PassState, borrow_traits, holders_floor, whole_node_floor
from .model import (
    Decisions,
    Ending,
    EndReason,
    Grant,
    NodeChange,
    NodeState,
    Placement,
    Preemption,
    PreemptReason,
    Queue,
    QueueRow,
    QueueStretch,
    Quiet,
    Reservation,
    Slice,
    SliceKind,
    SliceState,
    Snapshot,
)
from .ordering import lane_first, lapse_order, project_rank, walk_key, within_project_key
from .preemption import (
    DebugLane,
    Preemptor,
    Victims,
    grace_for,
    is_debug,
    preempt_reason,
    preemption_delay_ends,
)
from .resume import (
    RESUME_PHASE,
    Settled,
    quiet_until,
    resumable_at,
    resumed,
    settled_at,
)
from .standing import Standings
from .transitions import granted, protected_after_preemption, requeued, requeued_when_ended


def schedule(
    snapshot: Snapshot, tree: ProjectTree | None = None, *, index: PassState | None = None
) -> Decisions:
    """Run one scheduling pass. ``tree`` may be given to reuse a validated tree.

    ``index``: the pass's index of the live slices kept from the last pass by a
    long-running caller (:class:`~broker.core.incremental.PassState`, which has
    its own tree); it is brought up to date with ``snapshot`` and decides as a
    fresh one, built here when none is given.
    """
    if index is None:
        index = PassState(tree)
    elif tree is not None:
        raise ValueError("an index brings its own project tree")
    tree = index.update(snapshot)
    settled = index.settled
    if settled is not None:
        started = time.perf_counter()  # timed for metrics only, as the phases are
        decisions = resumed(settled, snapshot, index, tree)
        if decisions is not None:
            index.settled = settled_at(settled, decisions, snapshot, index)
            return replace(decisions, phase_seconds={RESUME_PHASE: time.perf_counter() - started})
    return _Pass(snapshot, tree, index).run()


_FLOOR = itemgetter(0)


class _Floors:
    """A GPU type's nodes as :meth:`_Pass._whole_node_floors` orders them: those
    worked out in the pass (``exact``, sorted) merged with the index's order from
    ``late`` on, less the nodes ``apart`` (worked out among ``exact``)."""

    __slots__ = ("apart", "entries", "exact", "late")

    def __init__(
        self,
        exact: list[tuple[float, str]],
        entries: list[tuple[float, str]],
        late: int,
        apart: set[str],
    ):
        self.exact, self.entries, self.late, self.apart = exact, entries, late, apart

    def __iter__(self) -> Iterator[tuple[float, str]]:
        apart = self.apart
        rest = itertools.islice(self.entries, self.late, None)
        if apart:
            rest = (entry for entry in rest if entry[1] not in apart)
        return heapq.merge(self.exact, rest)


class _Pass:
    """The working state of one pass; :meth:`run` lists its phases in order.

    ``kept``: the index of the live slices, already updated to ``snapshot``.
    """

    def __init__(self, snapshot: Snapshot, tree: ProjectTree, kept: PassState):
        self.snap = snapshot
        self.kept = kept
        self.now = snapshot.now
        self.policy = snapshot.policy
        self.tree = tree
        self.nodes = kept.nodes.by_name  # shared with the index: never changed here
        self.grants: list[Grant] = []
        self.preemptions: list[Preemption] = []
        self.endings: list[Ending] = []
        self.reservations: list[Reservation] = []
        self.node_changes: list[NodeChange] = []
        self.queue: list[QueueRow | QueueStretch] = []  # of Decisions.queue, see Queue
        self.stretches: list[int] = []  # where self.queue holds a QueueStretch
        self.timings: dict[str, float] = {}
        # The index's own map until the pass requeues a slice (see _end): most passes
        # requeue none, and a copy of thousands is the dearest part of a small pass.
        self.live: dict[int, Slice] = kept.slices
        self.ended: set[int] = set()
        # Slices preempted in this pass -> their grace deadline (when their GPUs are free)
        self.leaving: dict[int, float] = {}
        self.deferred: list[int] = []  # requests that wait for releases instead
        self.lapses_held: tuple[int, ...] = ()  # see _end_lapsed
        self._smallest_misfit: dict[tuple, int] = {}
        self._usable: dict[tuple, tuple[int, ...]] = {}
        self._spans_memo: dict[tuple, tuple[str, ...]] = {}
        self._latest_due_memo: tuple[int, float] = (0, -math.inf)
        self._as_granted: dict[int, Slice] = {}  # see _may_use_reserved
        self._lendable: list[list[Placement]] = []  # per backfill reservation
        self._lendable_gpus = 0  # how many GPUs _lendable holds in all
        self._gang_claimed = False
        # For the next pass to resume from (broker/core/resume.py): the walk key of the
        # last request a reservation was planned for once no more may be, and of each
        # project's preemption attempt.
        self._planned_by: tuple | None = None
        self._tried: dict[str, tuple] = {}
        # (node, requester class) -> expected releases; see _releases_for
        self._releases: dict[tuple, list[tuple[float, int]]] = {}
        # A reservation plan per request shape, class and state it was worked out on
        # (see _plan): blocked requests alike are planned for anew only when a grant,
        # a preemption or a change of the free GPUs could change the plan.
        self._plans: dict[tuple, Reservation | None] = {}
        self._floors: dict[str, _Floors] | None = None  # see _whole_node_floors
        # Per requester class, its gangs planned this pass, whose nodes not yet asked
        # are estimated as they would have been (see _releases_for); those still
        # judged on fair share as it stands now.
        self._deferred: dict[tuple, list[_Estimate]] = {}
        self._judged_now: list[_Estimate] = []
        self._node_summaries: dict[str, NodeHolders] = {}  # see _node_holders
        self._moved_nodes: set[str] = set()  # nodes where this pass ended or preempted
        # node -> (known end, GPUs) of holders with a maximum runtime; see _released_by
        self._expiring: dict[str, list[tuple[float, int]]] | None = None
        # GPUs still held by slices preempted in this pass, lent to the queue:
        # (node, GPU) -> when they are free (the victim's grace deadline)
        self.freeing: dict[tuple[str, int], float] = {}

    @cached_property
    def ids(self) -> list[int]:
        """The live slices' ids in order, for the phases that walk every slice (a pass
        with a drain or an ending): sorted when one first asks, not in every pass."""
        return sorted(self.live)

    @cached_property
    def holding(self) -> list[Slice]:
        """The holders as phase 1 left them, in id order: the index's, less those it
        ended or requeued. Listed when a phase first asks: most passes never do, and
        a list of thousands was a tenth of a busy service's pass."""
        if not self.endings:
            return list(self.kept.holding())
        live, gone = self.live, self.ended
        return [s for s in self.kept.holding() if s.id not in gone and live[s.id] is s]

    @cached_property
    def pending(self) -> list[Slice]:
        """The pending slices as phase 1 left them, in no particular order: the
        index's, less those it ended, with those it requeued. A pass after no
        ending asks the index's queues what it needs instead (a walk of the backlog)."""
        found = [s for s in self.kept.pending() if s.id not in self.ended]
        found += (self.live[e.slice_id] for e in self.endings if e.requeue)
        return found

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        # Timed for metrics only; nothing decided depends on it.
        started = time.perf_counter()
        yield
        self.timings[name] = time.perf_counter() - started

    def run(self) -> Decisions:
        with self._phase("end"):
            self.end_finished()  # 1. contracts over: down nodes, max runtime, grace, lease
        with self._phase("drain"):
            self.drain_nodes()  # 2. draining nodes give back their GPUs as contracts end
        with self._phase("snapshot"):
            self.build_free_map()  # 3. what is free, held and promised
        with self._phase("promises"):
            self.keep_promises()  # 4. grant GPUs freed by earlier preemptions
        with self._phase("allocate"):
            self.allocate()  # 5. walk the queue: fit, preempt or reserve
        with self._phase("backfill"):
            self.backfill_unallocated()  # 6. free work fills what nobody wants
        decisions = Decisions(
            grants=tuple(self.grants),
            preemptions=tuple(self.preemptions),
            endings=tuple(self.endings),
            reservations=tuple(self.reservations),
            node_changes=tuple(self.node_changes),
            queue=Queue(self.queue, self.stretches),
            deferred=tuple(self.deferred),
            lapses_held=self.lapses_held,
            quiet=self._quiet(),
            phase_seconds=self.timings,
        )
        self.kept.settled = self._settled(decisions)
        return decisions

    def _quiet(self) -> Quiet | None:
        """Until when a pass over the same slices and nodes decides nothing either, if
        this one decided nothing (:mod:`broker.core.resume`); else None."""
        if self.grants or self.preemptions or self.endings or self.node_changes:
            return None
        if self.lapses_held:
            return None  # a later pass ends them as the lapse limit allows: not the same
        promised = {r.slice_id: r.placements for r in self.reservations if r.promised}
        if promised.keys() != self.kept.promised_ids or any(
            self.live[i].promised != placements for i, placements in promised.items()
        ):
            return None  # applying this pass changes a promise: the next is not the same
        until = quiet_until(self.kept, self.now, self.policy, self.standings, self.deferred)
        return Quiet(until, tuple(self.window_order))

    def _settled(self, decisions: Decisions) -> Settled | None:
        """What the next pass may resume from (:func:`~broker.core.resume.resumed`),
        if this one was quiet."""
        if decisions.quiet is None or not resumable_at(self.kept, self.now, self.policy):
            return None
        return Settled(
            decisions,
            self.now,
            self.snap.nodes,
            tuple(sorted(self.snap.gpu_type_weights.items())),
            self.standings,
            self.project_rank,
            self._planned_by,
            self._tried,
            self.free,
            self._lendable_gpus,
            self._latest_due(self._backfill_reserved),
        )

    # -- phase 1 -----------------------------------------------------------

    def _end(self, slice_: Slice, reason: EndReason) -> None:
        requeue = requeued_when_ended(slice_.kind, slice_.contract.resumable, reason)
        protect_next = None
        if requeue and reason is EndReason.PREEMPTED:
            protect_next = protected_after_preemption(slice_.contract.min_runtime, self.policy)
        self.endings.append(Ending(slice_.id, reason, requeue, protect_next))
        self._moved_nodes.update(p.node for p in slice_.placements)
        if requeue:
            # Back in the queue at once, so this very pass may grant it again.
            if self.live is self.kept.slices:
                self.live = dict(self.live)  # never changed in the index's own map
            self.live[slice_.id] = requeued(slice_, self.now, protect_next)
        else:
            self.ended.add(slice_.id)

    def end_finished(self) -> None:
        now = self.now
        lapsed: list[Slice] = []
        for slice_ in map(self.live.__getitem__, self.kept.due(now)):
            if slice_.holds_gpus:
                if any(
                    self.nodes.get(p.node) is None or self.nodes[p.node].state is NodeState.DOWN
                    for p in slice_.placements
                ):
                    self._end(slice_, EndReason.NODE_DOWN)
                    continue
                max_runtime = slice_.contract.max_runtime
                granted_at = slice_.granted_at if slice_.granted_at is not None else now
                if max_runtime is not None and now >= granted_at + max_runtime:
                    self._end(slice_, EndReason.EXPIRED)
                    continue
                if slice_.preempt_deadline is not None and now >= slice_.preempt_deadline:
                    self._end(slice_, EndReason.PREEMPTED)
                    continue
            if slice_.lease_expires_at is not None and now >= slice_.lease_expires_at:
                lapsed.append(slice_)
        if lapsed:
            self._end_lapsed(lapsed)

    def _end_lapsed(self, lapsed: list[Slice]) -> None:
        """End the slices whose lease is over as ``lost``, within the lapse limit
        (``Policy.lease_lapse_floor`` and ``lease_lapse_fraction`` per minute),
        those lapsed longest first; the rest stay as they are until a later pass.

        A holder that stopped heartbeating is gone or cut off; many at once are
        more often the broker's own trouble (heartbeats it could not read in time)
        than many holders dying together, and ending them all would end live
        sessions. A heartbeat before a later pass keeps a slice held here.

        A lease counts only the time the broker answered heartbeats on time
        (``Snapshot.answered_late``): one that ran out by no more than the time it
        answered late since the holder's last heartbeat is kept too, and counts
        towards no limit.
        """
        excused: list[int] = []
        if self.snap.answered_late:
            on_time = []
            for slice_ in lapsed:
                if self._ran_out_late(slice_):
                    excused.append(slice_.id)
                else:
                    on_time.append(slice_)
            lapsed = on_time
        policy, already = self.policy, self.snap.lapsed_last_minute
        limit = policy.lease_lapse_floor
        if len(lapsed) > limit - already:  # the fraction can only allow more
            # Of the slices as the pass found them: one this pass requeued has no lease
            # any more, and must not shrink the limit it is judged by.
            leased = sum(1 for s in self.kept.slices.values() if s.lease_expires_at is not None)
            limit = max(limit, math.floor(policy.lease_lapse_fraction * leased))
        allowed = max(0, limit - already)
        lapsed.sort(key=lapse_order)
        for slice_ in lapsed[:allowed]:
            self._end(slice_, EndReason.LOST)
        self.lapses_held = tuple(sorted([s.id for s in lapsed[allowed:]] + excused))

    def _ran_out_late(self, slice_: Slice) -> bool:
        """Whether ``slice_``'s lease ran out only over time the broker answered late
        since its last heartbeat (its lease before it ran out)."""
        expires_at, now = slice_.lease_expires_at or 0.0, self.now
        return now - expires_at < self.snap.late_between(expires_at - self.snap.lease, now)

    # -- phase 2 -----------------------------------------------------------

    def drain_nodes(self) -> None:
        if not self.kept.nodes.draining:
            return
        busy: set[str] = set()
        for slice_ in map(self.live.__getitem__, self.ids):
            if not slice_.holds_gpus or slice_.id in self.ended:
                continue
            draining = [
                p.node for p in slice_.placements if self.nodes[p.node].state is NodeState.DRAINING
            ]
            busy.update(p.node for p in slice_.placements)
            if (
                draining
                and slice_.state is SliceState.GRANTED
                and not slice_.is_protected(self.now)
            ):
                self._preempt(slice_, PreemptReason.DRAIN, None, self.policy.grace_period)
        for node in sorted(self.nodes.values(), key=lambda n: n.name):
            if node.state is NodeState.DRAINING and node.name not in busy:
                self.node_changes.append(
                    NodeChange(node.name, NodeState.DRAINED, "empty after drain")
                )

    def _preempt(
        self, slice_: Slice, reason: PreemptReason, for_slice: int | None, grace: float
    ) -> float:
        """Preempt ``slice_`` with ``grace`` seconds to checkpoint; its deadline."""
        deadline = self.now + grace
        self.preemptions.append(Preemption(slice_.id, reason, deadline, for_slice))
        self.leaving[slice_.id] = deadline
        self._releases.clear()  # a leaving slice frees its GPUs sooner
        self._deferred.clear()
        self._judged_now.clear()
        self._floors = None
        for placement in slice_.placements:
            self._moved_nodes.add(placement.node)
            self._node_summaries.pop(placement.node, None)
        return deadline

    def _preempt_for(self, victim: Slice, reason: PreemptReason, requester: Slice) -> float:
        """Preempt a running slice for ``requester``: it is no candidate any more, and
        its project's standing drops by what it held, for the rest of the pass.
        Returns when its GPUs are free (:func:`grace_for`)."""
        deadline = self._preempt(
            victim, reason, requester.id, grace_for(requester, victim, self.policy)
        )
        self.preemptor.remove(victim)
        if victim.allocated:
            self.standings.record(victim.project, -self._weighted(victim.placements))
        return deadline

    # -- phase 3 -----------------------------------------------------------

    def build_free_map(self) -> None:
        ready = self.kept.nodes.ready
        ended = [self.kept.slices[e.slice_id] for e in self.endings]
        self.free = self.kept.free_map(ready, self.snap.gpu_type_weights, ended)
        self.largest_node = max(self.free.largest.values(), default=0)
        # Work larger than this may span nodes, on a type whose nodes are smaller.
        self.spans_above = min(self.free.largest.values(), default=0)  # see FreeGpus.fit
        self._holders: dict[str, list[tuple[Slice, int]]] = {}  # see _holders_on
        # The window's share used is what the queue shows (the order itself is
        # project_rank's); fair share now decides who may take running GPUs from whom.
        self.values = self.tree.share_used(self.snap.usage)
        capacity = self.kept.nodes.capacity(self.snap.gpu_type_weights)
        # What the holders hold, from the index's counts: not a walk over them.
        held = self.kept.holdings(ended)
        wanting = {project for project, _ in held.allocated}
        # The index's queues, not a walk of the backlog: less what this pass ended,
        # with what it requeued.
        wanting.update(self.kept.waiting(self.ended))
        for ending in self.endings:
            requeued = self.live[ending.slice_id]
            if ending.requeue and requeued.allocated:
                wanting.add(requeued.project)
        margin = self.policy.fair_share_margin
        wanting_now = (self.tree, capacity, frozenset(wanting), margin)
        fair_shares = self.kept.fair_shares
        if fair_shares is not None and fair_shares[0] == wanting_now:
            self.standings = Standings(self.tree, dict(fair_shares[1]), margin=margin)
        else:
            self.standings = Standings.now(self.tree, capacity, wanting, margin=margin)
            self.kept.fair_shares = (wanting_now, dict(self.standings.fair))
        # In one fixed order, so that the same counts always give the same floats.
        for (project, gpu_type), gpus in sorted(held.allocated.items()):
            self.standings.record(project, gpus * self.snap.weight(gpu_type))
        # Mostly the same as the pass before (a submission moves no holdings): then
        # its answers of may_take_at_all serve again.
        standing_now = (self.tree, self.standings.margin, self.standings.fair, self.standings.held)
        if self.kept.lenient is not None and self.kept.lenient[0] == standing_now:
            self.standings.lenient, over_share = self.kept.lenient[1:]
        else:
            # Copies: the pass moves the standings' holdings as it grants and preempts.
            standing_now = (*standing_now[:2], dict(self.standings.fair), dict(self.standings.held))
            over_share = self.standings.over_share()
            self.kept.lenient = (standing_now, self.standings.lenient, over_share)
        self.lane = DebugLane.for_cluster(sum(self.free.total.values()), self.policy)
        self.lane.held, self.lane.held_by_user = sum(held.debug.values()), held.debug
        self.project_gpus: dict[str, int] = held.gpus
        # The victim indexes are built when a search first needs them (many passes
        # make none), from what holds and stands at this point of the pass.
        self._preemptor: Preemptor | None = None
        self._start_standing = {p: self.standings.standing(p) for p in self.tree.projects}
        self._left_before = set(self.leaving)  # drained in phase 2
        self.window_order = self.tree.project_order(self.snap.usage)
        self.project_rank = project_rank(self.window_order, over_share)

    @property
    def preemptor(self) -> Preemptor:
        if self._preemptor is None:
            # The index's candidates, less the holders this pass ended (phase 1) or
            # drained (phase 2): the holders as phase 2 left them.
            self._preemptor = Preemptor(
                now=self.now,
                policy=self.policy,
                standings=self.standings,
                lane=self.lane,
                nodes=self.free.nodes,
                weights=self.snap.gpu_type_weights,
                candidates=self.kept.victims_at(self.now),
                leaving_out=itertools.chain(self.ended, self._left_before),
                standing=self._start_standing,
            )
        return self._preemptor

    def _holders_on(self, node: str) -> list[tuple[Slice, int]]:
        """The slices holding GPUs on ``node`` at the start of phase 3, in id order,
        with how many GPUs each holds there; from the index, per node asked."""
        found = self._holders.get(node)
        if found is None:
            found = self.kept.holders_on(node)
            if self.endings:
                live, gone = self.live, self.ended
                found = [(s, gpus) for s, gpus in found if s.id not in gone and live[s.id] is s]
            self._holders[node] = found
        return found

    def _blockers(self, promised: tuple[Placement, ...]) -> list[Slice]:
        """The holders of any of the ``promised`` GPUs, each once: from the holders of
        the promise's nodes, not a walk over every holding (thousands on a large
        cluster, with a promise or two to keep)."""
        found: dict[int, Slice] = {}
        for placement in promised:
            wanted = set(placement.gpu_indices)
            for holder, _ in self._holders_on(placement.node):
                if holder.id not in found and any(
                    p.node == placement.node and not wanted.isdisjoint(p.gpu_indices)
                    for p in holder.placements
                ):
                    found[holder.id] = holder
        return list(found.values())

    def _count(self, slice_: Slice, placements: tuple[Placement, ...]) -> None:
        """Account for GPUs a slice holds (or will hold) in caps, fair share and the lane."""
        if self._judged_now:
            # Gangs planned before this grant are judged on fair share as it was.
            judged = (
                replace(
                    self.standings,
                    held=dict(self.standings.held),
                    lenient=dict(self.standings.lenient),
                ),
                replace(self.lane, held_by_user=dict(self.lane.held_by_user)),
            )
            for estimate in self._judged_now:
                estimate.judged = judged
            self._judged_now.clear()
        self.project_gpus[slice_.project] = self.project_gpus.get(slice_.project, 0) + (slice_.gpus)
        if slice_.allocated:
            self.standings.record(slice_.project, self._weighted(placements))
        if is_debug(slice_, self.policy):
            self.lane.record(slice_)

    def _weighted(self, placements: tuple[Placement, ...]) -> float:
        """Weighted GPUs of ``placements``: what they count for in fair share."""
        return sum(
            len(p.gpu_indices) * self.snap.weight(self.nodes[p.node].gpu_type) for p in placements
        )

    # -- phase 4 -----------------------------------------------------------

    def keep_promises(self) -> None:
        self.promised: set[int] = set()
        if self.endings:
            found = (s for s in self.pending if s.promised)
        else:  # the index knows them: no walk of the backlog
            found = map(self.live.__getitem__, self.kept.promised_ids)
        promised = sorted(found, key=attrgetter("id"))
        if not promised:
            return
        leaving = self.leaving
        for slice_ in promised:
            nodes_ok = all(self._still_fits(slice_, p) for p in slice_.promised)
            blockers = self._blockers(slice_.promised)
            if not nodes_ok or any(
                s.state is not SliceState.PREEMPTING and s.id not in leaving for s in blockers
            ):
                continue  # the promise no longer holds: queue as usual
            self.promised.add(slice_.id)
            self.free.take(slice_.promised)
            self._count(slice_, slice_.promised)
            if not blockers:
                self.grants.append(Grant(slice_.id, slice_.promised))
            else:
                deadline = max(s.preempt_deadline or self.now for s in blockers)
                self.reservations.append(Reservation(slice_.id, slice_.promised, True, deadline))
                value = self.values[slice_.project]
                self.queue.append((slice_.id, len(self.queue) + 1, value, deadline))

    def _still_fits(self, slice_: Slice, placement: Placement) -> bool:
        """Whether a promised placement still suits ``slice_``: its node is ready
        and, since an admin may have changed it meanwhile, of the GPU type asked
        for and with those GPUs."""
        node = self.free.nodes.get(placement.node)
        return (
            node is not None
            and slice_.gpu_type in (None, node.gpu_type)
            and all(i < node.gpu_count for i in placement.gpu_indices)
        )

    # -- phase 5 -----------------------------------------------------------

    def _sort_backlog(self) -> None:
        """The queue, less kept promises: allocated slices for :meth:`allocate`,
        unallocated ones after them for :meth:`backfill_unallocated`."""
        rank = self.project_rank
        allocated = self.kept.backlog(iter(rank), True)
        unallocated = self.kept.backlog(iter(rank), False)
        if self.endings:
            # The index's queues, less the slices phase 1 ended, with those it
            # requeued put in their places: the queue order of the pending slices.
            gone = self.ended
            allocated = [s for s in allocated if s.id not in gone]
            unallocated = [s for s in unallocated if s.id not in gone]
            for ending in self.endings:
                if ending.requeue:
                    slice_ = self.live[ending.slice_id]
                    backlog = allocated if slice_.allocated else unallocated
                    insort(backlog, slice_, key=lambda s: walk_key(s, rank))
        if self.promised:
            allocated = [s for s in allocated if s.id not in self.promised]
            unallocated = [s for s in unallocated if s.id not in self.promised]
        if self.policy.debug_first:
            allocated = lane_first(allocated, self._lane_admits())
        self.allocated_backlog = allocated
        self.unallocated_backlog = unallocated

    def _lane_admits(self) -> Callable[[Slice], bool]:
        """Whether each debug session, asked in queue order, is one the lane admits
        beside those held and those admitted before it."""
        lane = replace(self.lane, held_by_user=dict(self.lane.held_by_user))
        policy = self.policy

        def admits(slice_: Slice) -> bool:
            if not is_debug(slice_, policy) or not lane.admits(slice_):
                return False
            lane.record(slice_)
            return True

        return admits

    def _under_cap(self, slice_: Slice) -> bool:
        cap = self.policy.project_gpu_caps.get(slice_.project)
        return cap is None or self.project_gpus.get(slice_.project, 0) + slice_.gpus <= cap

    def _grant(self, slice_: Slice, placements: tuple[Placement, ...]) -> float | None:
        """Give ``slice_`` its placements: at once, or, where some of those GPUs are
        still held by a slice this pass preempted, as a promise due at the end of
        its grace (returned)."""
        self.free.take(placements)
        self._count(slice_, placements)
        if self.freeing:  # only after a preemption in this pass: grants are the hot path
            due = max(
                (self.freeing.get((p.node, i), 0.0) for p in placements for i in p.gpu_indices),
                default=0.0,
            )
            if due:
                self.reservations.append(Reservation(slice_.id, placements, True, due))
                return due
        self.grants.append(Grant(slice_.id, placements))
        return None

    def _pass_on_leftovers(self, found: Victims, deadlines: dict[int, float]) -> None:
        """Offer the GPUs the victims free beyond the request's need to the rest of
        the queue, promised to whoever fits them (design.md §5.3): a preemption
        never leaves GPUs idle while work waits."""
        taken = {(found.placement.node, i) for i in found.placement.gpu_indices}
        leftover: list[Placement] = []
        for victim, _ in found.victims:
            for placement in victim.placements:
                if placement.node not in self.free.nodes:
                    continue  # a draining node keeps what its slices free
                rest = tuple(i for i in placement.gpu_indices if (placement.node, i) not in taken)
                if rest:
                    leftover.append(Placement(placement.node, rest))
                    deadline = deadlines[victim.id]
                    self.freeing.update(((placement.node, i), deadline) for i in rest)
        if leftover:
            self.free.give(leftover)
            self._smallest_misfit.clear()  # free GPUs grew: earlier misfits may fit now

    def allocate(self) -> None:
        tried_preemption: set[str] = set()
        backfill_reserved: list[tuple[Reservation, Slice]] = []
        planned = 0  # blocked slices a reservation was sought for
        # Once no more reservations are made, free GPUs (lent ones included) only
        # shrink and caps only fill, so a request shaped like one that stayed
        # blocked, and with no preemption attempt to make, stays blocked too:
        # the long tail of a backlog is walked cheaply.
        blocked_shapes: set[int] = set()  # shape numbers
        position = len(self.queue)
        self._sort_backlog()
        # Read once: the loop below runs for every pending slice of every pass.
        values, largest_node = self.values, self.largest_node
        max_reservations, enqueue = self.policy.max_reservations, self.queue.append
        # With debug headroom, whether a debug session may use it depends on its
        # user's place in the lane, which its shape does not tell: never settled.
        headroom, policy = self.policy.debug_headroom, self.policy
        backlog = self.allocated_backlog
        # Each pending slice's shape, kept by the index between passes; a pass that
        # requeued a slice has pending slices the index does not: its own then.
        shapes = self.kept.shapes if self.live is self.kept.slices else {}
        shape_number = self.kept.shape_number
        at = 0
        while at < len(backlog):
            slice_ = backlog[at]
            at += 1
            if planned >= max_reservations and (
                slice_.project in tried_preemption or slice_.gpus > largest_node
            ):
                end = self._blocked_until(
                    backlog, at - 1, backfill_reserved, slice_.project in tried_preemption
                )
                if end >= at:
                    # Each takes its place in the queue, its row made when it is read.
                    value = values[slice_.project]
                    self.stretches.append(len(self.queue))
                    enqueue(QueueStretch(backlog, at - 1, end, position + 1, value))
                    position += 1 + end - at
                    at = end
                    continue
            position += 1
            value = values[slice_.project]
            # One preemption attempt per project and pass, for its first blocked
            # slice that fits a node (as Kueue nominates one head per queue).
            tries_preemption = (
                slice_.project not in tried_preemption and slice_.gpus <= largest_node
            )
            settled = (
                planned >= max_reservations
                and not tries_preemption
                and not (headroom and is_debug(slice_, policy))
            )
            if settled:
                shape = shapes.get(slice_.id)
                if shape is None:
                    shape = shapes[slice_.id] = shape_number(slice_)
                if shape in blocked_shapes:
                    enqueue((slice_.id, position, value, None))
                    continue
            if not self._under_cap(slice_):
                enqueue((slice_.id, position, value, None))
                continue
            placements = self._place(slice_, backfill_reserved)
            if placements is not None:
                due = self._grant(slice_, placements)
                if due is not None:
                    enqueue((slice_.id, position, value, due))
                continue
            if tries_preemption:
                tried_preemption.add(slice_.project)
                self._tried[slice_.project] = walk_key(slice_, self.project_rank)
            if self._held_back(slice_):
                # It fits, but only on GPUs kept for debug sessions: it waits for
                # more to free up, and neither preempts nor reserves meanwhile.
                if settled:
                    blocked_shapes.add(shape)
                enqueue((slice_.id, position, value, None))
                continue
            estimated: float | None = None
            if tries_preemption:
                found = self.preemptor.find(slice_, self.free.free)
                if found is not None and not self._worth_preempting(slice_, found):
                    self.deferred.append(slice_.id)
                    found = None
                if found is not None:
                    deadlines = {
                        victim.id: self._preempt_for(victim, reason, slice_)
                        for victim, reason in found.victims
                    }
                    deadline = max(deadlines.values())
                    promise = Reservation(slice_.id, (found.placement,), True, deadline)
                    self.reservations.append(promise)
                    self.free.take(promise.placements)
                    self._count(slice_, promise.placements)
                    enqueue((slice_.id, position, value, deadline))
                    self._pass_on_leftovers(found, deadlines)
                    blocked_shapes.clear()
                    continue
            if planned < self.policy.max_reservations:
                planned += 1
                if planned == self.policy.max_reservations:
                    self._planned_by = walk_key(slice_, self.project_rank)
                reservation = self._plan(slice_)
                if reservation is not None and self._claim_due_gang(slice_, reservation, position):
                    continue
                if reservation is not None:
                    backfill_reserved.append((reservation, slice_))
                    self._lendable.append(list(reservation.placements))
                    self._lendable_gpus += sum(len(p.gpu_indices) for p in reservation.placements)
                    self.reservations.append(reservation)
                    self.free.take(reservation.placements)
                    estimated = reservation.due_at
            elif settled:
                blocked_shapes.add(shape)
            enqueue((slice_.id, position, value, estimated))
        self._backfill_reserved = backfill_reserved
        self._position = position

    def _plan(self, requester: Slice) -> Reservation | None:
        """:func:`backfill.plan` for ``requester``: the plan of an earlier request of
        the same shape and class (what its release estimates are kept per, see
        :meth:`_releases_for`) when no grant, preemption or change of the free GPUs
        came between; a third of the plans of a month with a long queue."""
        key = self._plan_key(requester)
        if key in self._plans:
            planned = self._plans[key]
            return None if planned is None else replace(planned, slice_id=requester.id)
        releases, most_freed = self._releases_for(requester)
        planned = self._plans[key] = backfill.plan(
            requester,
            nodes=self.free.nodes,
            free=self.free.free,
            releases=releases,
            now=self.now,
            whole_node_floors=self._whole_node_floors(),
            most_freed=most_freed,
        )
        return planned

    def _plan_key(self, requester: Slice) -> tuple:
        """What :meth:`_plan` reads of ``requester`` and of the pass so far."""
        return (
            requester.project,
            within_project_key(requester),
            requester.gpus,
            requester.gpu_type,
            requester.kind,
            self.free.changes,
            len(self.grants),
            len(self.preemptions),
        )

    def _worth_preempting(self, requester: Slice, found: Victims) -> bool:
        """Whether the preemption ``found`` buys ``requester`` what waiting would not
        (design.md §5.7).

        Free (unallocated) victims always give way: that was their contract.
        Allocated victims pay a restart and their work since the last
        checkpoint, so the request first waits :func:`preemption_delay` for
        natural releases — how fast the cluster frees GPUs of its shape is
        observed that way, not assumed — and is not served by a release this
        pass already knows of (a maximum runtime ending) before the victims'
        grace would end anyway.
        """
        if all(not victim.allocated for victim, _ in found.victims):
            return True
        if self.now < preemption_delay_ends(requester, self.policy):
            return False
        grace = max(grace_for(requester, victim, self.policy) for victim, _ in found.victims)
        return not self._released_by(requester, self.now + grace)

    def _released_by(self, requester: Slice, until: float) -> bool:
        """Whether GPUs that holders are known to give back by ``until`` (their
        maximum runtime ends) make ``requester`` fit on one node."""
        if self._expiring is None:
            self._expiring = {}
            for holder in self.holding:
                ends = holder.ends_at()
                if holder.state is SliceState.GRANTED and ends is not None:
                    for placement in holder.placements:
                        self._expiring.setdefault(placement.node, []).append(
                            (ends, len(placement.gpu_indices))
                        )
        for name, expiring in self._expiring.items():
            node = self.free.nodes.get(name)
            if node is None or node.gpu_count < requester.gpus:
                continue
            if requester.gpu_type is not None and node.gpu_type != requester.gpu_type:
                continue
            released = sum(gpus for ends, gpus in expiring if ends <= until)
            if released and released + len(self.free.free.get(name, ())) >= requester.gpus:
                return True
        return False

    def _blocked_until(
        self,
        backlog: list[Slice],
        start: int,
        reserved: list[tuple[Reservation, Slice]],
        tried: bool,
    ) -> int:
        """Where the blocked stretch of ``backlog[start]``'s project's run ends: the
        first request from ``start`` on that might be placed, or the run's end
        (``start`` itself when it might be).

        Asked once no more reservations are planned, of a project that has made
        its preemption attempt (``tried``) or, until its first request that fits
        a node (which would make that attempt), of its work larger than any node:
        such work can then only be granted, or wait. A request waits if it does
        not fit in the free GPUs (more than any one node has free and, if it
        could span nodes, more than all have) and may not borrow reserved ones
        (more than that with every lendable GPU too, or it would outlast every
        reservation): bounds of the tests of :meth:`_place`, asked of the stretch
        at once. Such a request only takes its place in the queue; one that
        might be placed is walked on its own.
        """
        project, largest_node = backlog[start].project, self.largest_node
        free, most_free = self.free.free_total, self.free.most_free()
        spans_above = self.spans_above
        # Reserved GPUs it may borrow (none while nothing is reserved, when every
        # request outlasts them all: the latest due time is then -inf).
        lent, latest = self._lendable_gpus, self._latest_due(reserved)
        most_lent, free_lent = most_free + lent, free + lent
        now, grace = self.now, self.policy.grace_period
        for end in range(start, len(backlog)):
            slice_ = backlog[end]
            if slice_.project != project:
                return end
            gpus = slice_.gpus
            if not tried and gpus <= largest_node:
                return end  # its project's preemption attempt
            if gpus > most_lent and not spans_above < gpus <= free_lent:
                continue  # too large for the free GPUs, even with all the lent ones
            if gpus <= most_free or spans_above < gpus <= free:
                return end
            if not backfill.outlasts(slice_.contract, now, grace, latest):
                return end
        return len(backlog)

    def _claim_due_gang(self, slice_: Slice, reservation: Reservation, position: int) -> bool:
        """Honour a multi-node reservation that has fallen due.

        Gang requests do not preempt to fit (that thrashes); they reserve the
        nodes that free up first. When every holder left on those nodes is one
        the request may preempt now, the reservation is due: they are
        preempted together and the nodes promised to it. At most one per pass.
        """
        if self._gang_claimed or slice_.gpus <= self.free.largest.get(
            self.free.nodes[reservation.placements[0].node].gpu_type, 0
        ):
            return False
        if reservation.due_at is None or reservation.due_at > self.now + self.policy.grace_period:
            return False
        names = [p.node for p in reservation.placements]
        promised = {
            (p.node, i)
            for r in self.reservations
            if r.promised
            for p in r.placements
            for i in p.gpu_indices
        }
        victims: list[tuple[Slice, PreemptReason]] = []
        for name in names:
            weight = self.snap.weight(self.free.nodes[name].gpu_type)
            for holder, _ in self._holders_on(name):
                if holder.id in self.leaving or holder.state is SliceState.PREEMPTING:
                    continue  # already leaving
                # The rule itself: the victim indexes are not needed to ask it.
                reason = self._reason(slice_, holder, self.now, weight, gang=True)
                if reason is None:
                    return False
                victims.append((holder, reason))
        placements: list[Placement] = []
        remaining = slice_.gpus
        for name in names:
            take = min(remaining, self.free.nodes[name].gpu_count)
            placements.append(Placement(name, tuple(range(take))))
            remaining -= take
        if remaining or any((p.node, i) in promised for p in placements for i in p.gpu_indices):
            return False
        if any(victim.allocated for victim, _ in victims) and self.now < preemption_delay_ends(
            slice_, self.policy
        ):
            self.deferred.append(slice_.id)
            return False  # as any request, it first waits for releases (design.md §5.7)
        self._gang_claimed = True
        for victim, reason in victims:
            if victim.id not in self.leaving:
                self._preempt_for(victim, reason, slice_)
        deadline = self.now + self.policy.grace_period
        promise = Reservation(slice_.id, tuple(placements), True, deadline)
        self.reservations.append(promise)
        self.free.take(promise.placements)
        self._count(slice_, promise.placements)
        value = self.values[slice_.project]
        self.queue.append((slice_.id, position, value, deadline))
        return True

    def _releases_for(
        self, requester: Slice
    ) -> tuple[backfill.Releases, Callable[[str], int | None] | None]:
        """``backfill.plan``'s ``releases`` for ``requester`` (expected releases per
        node, earliest first) and, for a gang, its ``most_freed``.

        The lists are kept per node and requester class (project and
        :func:`within_project_key`) for the rest of the pass (until someone is
        preempted): the blocked requests a pass plans for mostly share a few
        classes. That is an approximation: the rule also reads the requester's
        size (what its project would gain, whether it is a gang), so a class's
        list is the one computed for its first request, and a larger request of
        the class may be told of releases that only a smaller one could force.
        Keying the lists on the size too was measured and not kept
        (docs/simulator.md, "Speed").

        A gang asks only the nodes that could free up first
        (``backfill.plan``'s floors); a node of its GPU type it did not ask is
        estimated later as it would have been then (:class:`_Estimate`).

        The rule is asked only of holders it could let ``requester`` take
        (:meth:`_estimate`); where it could take none, each holder leaves at its
        known end, and the node's list of those, kept by the index, serves.

        A gang's ``most_freed`` spares it the lists of nodes that can never be
        wholly free for it (nearly half the nodes its plans ask, in a month with a
        long queue): those where holders with no known end are work no one may take
        or belong to projects the rule refuses it at all (:meth:`_open_ended`). A
        node it skips that way is estimated later as it would have been then, as
        above.
        """
        requester_class = (requester.project, within_project_key(requester))
        estimate = _Estimate(self, requester)
        deferred = self._deferred.setdefault(requester_class, [])
        largest = self.free.largest
        of_its_type = (
            self.largest_node if requester.gpu_type is None else largest.get(requester.gpu_type, 0)
        )
        gang = bool(of_its_type) and backfill.takes_whole_nodes(requester, of_its_type)
        if gang:
            deferred.append(estimate)
            self._judged_now.append(estimate)
        types = self.kept.nodes.types

        def how(node: str) -> _Estimate:
            for earlier in deferred:
                if earlier.requester.gpu_type in (None, types[node]):
                    return earlier  # its plan would have asked then
            return estimate

        def releases(node: str) -> list[tuple[float, int]]:
            key = (node, requester_class)
            found = self._releases.get(key)
            if found is None:
                found = self._releases[key] = how(node)(node)
            return found

        if not gang:
            return releases, None

        free, known = self.free.free, self._releases

        def most_freed(node: str) -> int | None:
            if (node, requester_class) in known:
                return None  # its list is there to read
            holders = self._node_holders(node)
            most = len(free.get(node, ())) + holders.held - holders.open_ended_fixed
            if holders.open_ended:
                most -= self._open_ended(holders, how(node))
            return most

        return releases, most_freed

    def _open_ended(self, holders: NodeHolders, estimate: _Estimate) -> int:
        """GPUs of rivals among ``holders`` that :meth:`_estimate` gives no release
        for, at least: those held with no known end by projects the rule refuses
        the request at all (none counted where it asks every holder)."""
        requester = estimate.requester
        if not requester.allocated or (estimate.takes_batch and holders.batch):
            return 0
        # The estimate's answers read in place: asked per node of every gang's plan.
        refused, never = estimate.refused, 0
        for project, gpus in holders.open_ended.items():
            if project != requester.project:
                refuses = refused.get(project)
                if refuses is None:
                    refuses = self._refuses(estimate, project)
                if refuses:
                    never += gpus
        return never

    def _refuses(self, estimate: _Estimate, project: str) -> bool:
        """Whether fair share refuses ``estimate``'s request every holder of
        ``project``: it refuses at its most lenient, so whatever moves. Kept per
        estimate, on the fair share it is judged on."""
        refuses = estimate.refused.get(project)
        if refuses is None:
            judged = estimate.judged
            standings = self.standings if judged is None else judged[0]
            refuses = estimate.refused[project] = not standings.may_take_at_all(
                estimate.requester.project, project, estimate.gang
            )
        return refuses

    def _whole_node_floors(self) -> backfill.Floors:
        """Per GPU type, the nodes in order of when each could be wholly free at the
        soonest, whoever asks (:func:`~broker.core.incremental.whole_node_floor`);
        kept until someone is preempted. Free GPUs only shrink as the queue is
        walked, so a node's floor stays no later than its due meanwhile.

        Worked out here only for the nodes that could be free within a grace
        period and those this pass moved or that are smaller than their holders:
        the others' floors are their holders' own, in the index's order
        (:meth:`PassState.floor_order`), read only as far as a plan asks."""
        if self._floors is None:
            now, grace = self.now, self.policy.grace_period
            free, nodes = self.free.free, self.free.nodes
            order, overheld = self.kept.floor_order()
            apart = {name for name in (*self._moved_nodes, *overheld) if name in nodes}
            floors: dict[str, _Floors] = {}
            soonest = now + grace
            kept_holders = self.kept.node_holders
            for gpu_type, entries in order.items():
                late = bisect_right(entries, soonest, key=_FLOOR)
                exact: list[tuple[float, str]] = []
                for _, name in entries[:late]:
                    if name not in apart:
                        # Outside ``apart`` a node's holders hold no more than it has: no
                        # count of its free GPUs (a third of the nodes each time).
                        exact.append((holders_floor(kept_holders(name), now, soonest), name))
                for name in apart:
                    if nodes[name].gpu_type == gpu_type:
                        unfree = nodes[name].gpu_count - len(free.get(name, ()))
                        floor = whole_node_floor(self._node_holders(name), now, grace, unfree)
                        exact.append((floor, name))
                exact.sort()
                floors[gpu_type] = _Floors(exact, entries, late, apart)
            self._floors = floors
        return self._floors

    def _estimate(self, node: str, estimate: _Estimate) -> list[tuple[float, int]]:
        """``node``'s expected releases for the request of ``estimate`` (see
        :meth:`_releases_for`): the rule is asked only of holders it could let the
        request take, once per kind of rival and per rival project (the estimate's
        ``answers`` and ``refused``), on the fair share and debug lane it is
        ``judged`` on; the others leave at their known ends."""
        requester, judged, answers = estimate.requester, estimate.judged, estimate.answers
        holders = self._node_holders(node)
        if not requester.allocated:
            return holders.known  # free work preempts no one
        found: list[tuple[float, int]] = []
        if estimate.takes_batch and holders.batch:
            # The debug lane may take their batch work: every holder is asked.
            for holder, gpus in self._holders_on(node):
                at = self._release_at(holder, requester, judged)
                if at is not None:
                    found.append((at, gpus))
            found.sort()
            return found
        asked = False
        if holders.unallocated:
            # The rule lets an allocated request take free work once its
            # protection is over: each leaves then, or at its known end if sooner.
            asked = True
            now, grace, leaving = self.now, self.policy.grace_period, self.leaving
            for holder, gpus in holders.unallocated:
                at = leaving.get(holder.id)
                if at is None:
                    protected_until = holder.protected_until
                    at = (now if protected_until is None else max(now, protected_until)) + grace
                    known = holder.ends_at()
                    if known is not None and known < at:
                        at = known
                found.append((at, gpus))
        for project, rivals in holders.rivals.items():
            if project != requester.project and self._refuses(estimate, project):
                found += holders.rival_ends[project]
                continue
            asked = True
            for holder, gpus in rivals:
                at = self._release_at(holder, requester, judged, answers)
                if at is not None:
                    found.append((at, gpus))
        if not asked:
            return holders.known
        found += holders.fixed
        found.sort()
        return found

    def _node_holders(self, node: str) -> NodeHolders:
        """What the release estimates need of ``node``'s holders whoever asks: the
        index's, kept between passes, where this pass has ended, requeued or preempted
        no slice; the pass's own where it has (until it preempts another there)."""
        if node not in self._moved_nodes:
            return self.kept.node_holders(node)
        found = self._node_summaries.get(node)
        if found is None:
            found = self._node_summaries[node] = NodeHolders(
                self._holders_on(node), self.leaving, self.policy
            )
        return found

    def _release_at(
        self,
        holder: Slice,
        requester: Slice,
        judged: tuple[Standings, DebugLane] | None,
        answers: dict[tuple, bool] | None = None,
    ) -> float | None:
        """When ``holder`` is expected to give back its GPUs to ``requester``: its
        known end, or sooner if the preemption rule lets ``requester`` take them
        once its protection is over (judged on the fair share and lane of ``judged``,
        None: as they stand now).

        ``answers``, for rivals only (granted, allocated, within their budget, not
        leaving: :class:`NodeHolders`), keeps the rule's answer per what it reads of
        them then: their project, GPUs, kind and priority, and the GPUs' weight.
        """
        known = holder.ends_at()
        if holder.id in self.leaving:
            return self.leaving[holder.id]
        protected_until = holder.protected_until
        if protected_until is None:
            protected_until = self.now
        unprotected = max(self.now, protected_until)
        at = unprotected + self.policy.grace_period
        if known is not None and known <= at:
            return known  # gone before the rule could make it go, whatever it says
        weight = self.snap.weight(self.nodes[holder.placements[0].node].gpu_type)
        if answers is None:
            could = self._reason(requester, holder, unprotected, weight, judged=judged) is not None
        else:
            traits = (holder.project, holder.gpus, holder.kind, holder.priority, weight)
            could = answers.get(traits)
            if could is None:
                reason = self._reason(requester, holder, unprotected, weight, judged=judged)
                could = answers[traits] = reason is not None
        return at if could else known

    def _reason(
        self,
        requester: Slice,
        holder: Slice,
        at: float,
        weight: float,
        lost_before: float = 0.0,
        judged: tuple[Standings, DebugLane] | None = None,
        gang: bool | None = None,
    ) -> PreemptReason | None:
        """:func:`~broker.core.preemption.preempt_reason` at time ``at``, on the fair
        share and lane of ``judged`` (default: as they stand now); ``gang``: whether
        the request is judged as one (default: larger than any node)."""
        standings, lane = judged or (self.standings, self.lane)
        return preempt_reason(
            requester,
            holder,
            now=at,
            policy=self.policy,
            standings=standings,
            lane=lane,
            weight=weight,
            lost_before=lost_before,
            gang=requester.gpus > self.largest_node if gang is None else gang,
        )

    def _may_use_reserved(self, slice_: Slice, reservation: Reservation, owner: Slice) -> bool:
        """Later work may use reserved GPUs only if it is gone before they are due:
        it is unallocated, or its max runtime ends in time, or the owner could
        preempt it by then (the preemption rule, asked of it as if granted now)."""
        due = reservation.due_at
        if due is None:
            return False
        if not slice_.allocated:
            return True
        if (
            slice_.contract.max_runtime is not None
            and self.now + slice_.contract.max_runtime <= due
        ):
            return True
        protected_end = self.now + slice_.contract.min_runtime
        if protected_end + self.policy.grace_period > due:
            return False
        weight = self.snap.weight(self.nodes[reservation.placements[0].node].gpu_type)
        # The rule reads no placements: one granted copy per slice serves every reservation.
        as_granted = self._as_granted.get(slice_.id)
        if as_granted is None:
            as_granted = self._as_granted[slice_.id] = granted(slice_, (), self.now)
        # Not yet counted in its project's holdings: what it would lose, it has not gained.
        lost_before = -slice_.gpus * weight
        return self._reason(owner, as_granted, protected_end, weight, lost_before) is not None

    def _place(
        self, slice_: Slice, reserved: list[tuple[Reservation, Slice]]
    ) -> tuple[Placement, ...] | None:
        """Where ``slice_`` fits now, on free GPUs or on reserved ones it may use.

        Free GPUs only shrink while the queue is walked, so once a request of
        ``g`` GPUs fails, larger ones of the same class fail too: the
        ``_smallest_misfit`` memo skips them, which keeps a long blocked queue cheap.
        Neither way may it take the free GPUs kept for debug sessions (``debug_headroom``).
        """
        headroom = self._headroom_for(slice_)
        gang = slice_.kind is SliceKind.BATCH
        spans = None
        if slice_.gpus <= self.free.free_total - headroom:
            spans = self._spans(slice_)
            key = (slice_.gpu_type, gang, spans, ())
            if slice_.gpus < self._smallest_misfit.get(key, _NEVER):
                placements = self.free.fit(slice_.gpus, slice_.gpu_type, gang)
                if placements is not None:
                    return placements
                self._smallest_misfit[key] = slice_.gpus
        if not reserved or slice_.gpus > self.free.free_total + self._lendable_gpus:
            # No reserved GPUs to borrow, or too few with every free one: as a long
            # blocked queue mostly is once the reservations have lent theirs out.
            return None
        if slice_.allocated:
            # It may use none if it would outlast every reservation: the first
            # tests of _may_use_reserved, asked of the latest due time at once.
            latest = self._latest_due(reserved)
            if backfill.outlasts(slice_.contract, self.now, self.policy.grace_period, latest):
                return None
        traits = (*borrow_traits(slice_, self.policy), slice_.gpus)
        usable = self._usable.get((traits, len(reserved)))
        if usable is None:
            usable = tuple(
                i
                for i, (r, owner) in enumerate(reserved)
                if self._may_use_reserved(slice_, r, owner)
            )
            self._usable[(traits, len(reserved))] = usable
        if not usable:
            return None
        if spans is None:
            spans = self._spans(slice_)
        key = (slice_.gpu_type, gang, spans, usable)
        if slice_.gpus >= self._smallest_misfit.get(key, _NEVER):
            return None
        borrowed = [p for i in usable for p in self._lendable[i]]
        self.free.give(borrowed)
        placements = self.free.fit(slice_.gpus, slice_.gpu_type, gang)
        self.free.take(borrowed)  # reserved again; the grant takes the rest of its GPUs
        if placements is None:
            self._smallest_misfit[key] = slice_.gpus
            return None
        taken = {(p.node, i) for p in placements for i in p.gpu_indices}
        if headroom:
            # Only the free GPUs it takes beside the lent ones count against the
            # headroom: where best fit chose too many of those, it may still fit
            # on the lent GPUs alone, which leaves the headroom as it was.
            lent = {(p.node, i) for p in borrowed for i in p.gpu_indices}
            unlent = len(taken - lent)
            if unlent and unlent > self.free.free_total - headroom:
                placements = self._fit_lent(slice_, borrowed)
                if placements is None:
                    return None
                taken = {(p.node, i) for p in placements for i in p.gpu_indices}
        # GPUs lent out are no longer free to lend to the next request.
        for i in usable:
            self._lendable[i] = [
                Placement(p.node, tuple(g for g in p.gpu_indices if (p.node, g) not in taken))
                for p in self._lendable[i]
            ]
        self._lendable_gpus = sum(len(p.gpu_indices) for lent in self._lendable for p in lent)
        return placements

    def _fit_lent(self, slice_: Slice, borrowed: list[Placement]) -> tuple[Placement, ...] | None:
        """Where ``slice_`` fits on the ``borrowed`` (reserved) GPUs alone, leaving
        every free GPU free."""
        free = [Placement(node, tuple(gpus)) for node, gpus in self.free.free.items() if gpus]
        self.free.take(free)
        self.free.give(borrowed)
        placements = self.free.fit(slice_.gpus, slice_.gpu_type, slice_.kind is SliceKind.BATCH)
        self.free.take(borrowed)
        self.free.give(free)
        return placements

    def _latest_due(self, reserved: list[tuple[Reservation, Slice]]) -> float:
        """When the last of ``reserved`` falls due (-inf: none has a due time);
        kept while the list does not grow."""
        count, latest = self._latest_due_memo
        if count != len(reserved):
            dues = [r.due_at for r, _ in reserved if r.due_at is not None]
            latest = max(dues, default=-math.inf)
            self._latest_due_memo = (len(reserved), latest)
        return latest

    def _held_back(self, slice_: Slice) -> bool:
        """Whether ``slice_`` would fit on free GPUs now but for ``debug_headroom``."""
        headroom = self._headroom_for(slice_)
        return (
            headroom > 0
            and slice_.gpus > self.free.free_total - headroom
            and self.free.fit(slice_.gpus, slice_.gpu_type, slice_.kind is SliceKind.BATCH)
            is not None
        )

    def _headroom_for(self, slice_: Slice) -> int:
        """Free GPUs ``slice_`` must leave free: ``debug_headroom``, unless it is a
        debug session within the lane's limits, for which they are kept."""
        headroom = self.policy.debug_headroom
        if headroom and is_debug(slice_, self.policy) and self.lane.admits(slice_):
            return 0
        return headroom

    def _spans(self, slice_: Slice) -> tuple[str, ...]:
        """The GPU types on which ``slice_`` needs several nodes; kept for the pass
        (``_spans_memo``: :meth:`_place` asks on its hot path)."""
        spans = self._spans_memo.get((slice_.gpu_type, slice_.gpus))
        if spans is None:
            largest = self.free.largest
            spans = tuple(t for t in self.free.types(slice_.gpu_type) if slice_.gpus > largest[t])
            self._spans_memo[slice_.gpu_type, slice_.gpus] = spans
        return spans

    # -- phase 6 -----------------------------------------------------------

    def backfill_unallocated(self) -> None:
        position = self._position
        # From here free GPUs (lent ones included) only shrink, and where unallocated
        # work fits depends only on its size, GPU type and kind (it may use any
        # reservation): a size that found no place finds none later in the queue,
        # which is then walked cheaply. With debug headroom a debug session's place
        # also depends on the lane: never kept.
        unplaced: set[tuple] = set()
        headroom, policy = self.policy.debug_headroom, self.policy
        backlog = self.unallocated_backlog
        for at, slice_ in enumerate(backlog):
            if self._nothing_fits():
                # No GPU left, free or to borrow: the rest only take their places,
                # in stretches (three in four rows of a month with a long queue).
                self._stretch_rest(backlog, at, position)
                return
            position += 1
            value = self.values[slice_.project]
            shape = (
                None
                if headroom and is_debug(slice_, policy)
                else (slice_.gpus, slice_.gpu_type, slice_.kind)
            )
            if shape in unplaced:
                self.queue.append((slice_.id, position, value, None))
                continue
            placements = self._place(slice_, self._backfill_reserved)
            if placements is not None and self._under_cap(slice_):
                due = self._grant(slice_, placements)
                if due is not None:
                    self.queue.append((slice_.id, position, value, due))
            else:
                if placements is None and shape is not None:
                    unplaced.add(shape)
                self.queue.append((slice_.id, position, value, None))

    def _nothing_fits(self) -> bool:
        """Whether no GPU is left, free or to borrow from a reservation (then none is
        until the pass ends: free GPUs only shrink from here)."""
        return self.free.free_total + self._lendable_gpus == 0

    def _stretch_rest(self, backlog: list[Slice], start: int, position: int) -> None:
        """Queue ``backlog[start:]``, after ``position``, in stretches of one project
        each (the backlog is in project rank first), with no estimated start."""
        for project, run in itertools.groupby(backlog[start:], key=_PROJECT):
            stop = start + len(list(run))
            self.stretches.append(len(self.queue))
            self.queue.append(
                QueueStretch(backlog, start, stop, position + 1, self.values[project])
            )
            position += stop - start
            start = stop


_PROJECT = attrgetter("project")
_NEVER = 1 << 62


class _Estimate:
    """How one planned request is told of a node's releases (:meth:`_Pass._estimate`):
    what it reads of the rule is kept per plan, and, for a gang whose plan skipped
    nodes, fair share and the debug lane as they stood then (``judged``, set at the
    next grant; None until then: as they stand)."""

    __slots__ = ("answers", "gang", "judged", "pass_", "refused", "requester", "takes_batch")

    def __init__(self, pass_: _Pass, requester: Slice):
        self.pass_, self.requester = pass_, requester
        self.gang = requester.gpus > pass_.largest_node
        self.takes_batch = is_debug(requester, pass_.policy) and pass_.lane.admits(requester)
        self.answers: dict[tuple, bool] = {}  # see _Pass._release_at
        self.refused: dict[str, bool] = {}  # per rival project: fair share refuses it at all
        self.judged: tuple[Standings, DebugLane] | None = None

    def __call__(self, node: str) -> list[tuple[float, int]]:
        return self.pass_._estimate(node, self)
