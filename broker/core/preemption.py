"""Who may preempt whom (design.md §5.2–§5.3), and the fewest victims that make a request fit.

:func:`preempt_reason` is the one rule. Everything else that asks whether a
slice could be preempted (the victim search's shortcut, the release estimates
of backfill reservations, which work may borrow reserved GPUs) calls it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import combinations

from .candidates import (
    BATCH,
    PROJECT,
    UNALLOCATED,
    Candidates,
    Group,
    groups,
    past_budget,
    tally,
)
from .model import Node, Placement, Policy, PreemptReason, Slice, SliceKind, SliceState
from .ordering import victim_key, within_project_key
from .standing import Standings

# Bound once: on Python 3.11 a member read off its enum class goes through a slow
# hook, and the rule and the victim indexes ask these of every candidate.
_GRANTED = SliceState.GRANTED
_INTERACTIVE, _BATCH_KIND = SliceKind.INTERACTIVE, SliceKind.BATCH


def is_debug(slice_: Slice, policy: Policy) -> bool:
    """A short, small interactive session: what the debug lane is for."""
    return (
        slice_.kind is _INTERACTIVE
        and slice_.allocated
        and slice_.gpus <= policy.debug_max_gpus
        and slice_.contract.min_runtime <= policy.debug_max_min_runtime
    )


def preemption_delay(slice_: Slice, policy: Policy) -> float:
    """How long ``slice_`` waits for natural releases before it may preempt
    allocated work: short for a debug session, longer for batch (design.md §5.7)."""
    if is_debug(slice_, policy):
        return policy.debug_preemption_delay
    if slice_.kind is _INTERACTIVE:
        return policy.interactive_preemption_delay
    return policy.batch_preemption_delay


def preemption_delay_ends(slice_: Slice, policy: Policy) -> float:
    """When a pending slice's :func:`preemption_delay` ends: counted from when it last
    entered the queue."""
    return slice_.waiting_since + preemption_delay(slice_, policy)


def grace_for(requester: Slice | None, victim: Slice, policy: Policy) -> float:
    """The grace ``victim`` gets to checkpoint when preempted for ``requester``.

    A batch slice preempted for a debug session gets ``debug_grace_period`` (the
    batch runner checkpoints on SIGTERM), so that the session starts in seconds;
    every other victim, a notebook above all, gets ``grace_period``.
    """
    if requester is not None and victim.kind is _BATCH_KIND and is_debug(requester, policy):
        return min(policy.debug_grace_period, policy.grace_period)
    return policy.grace_period


@dataclass
class DebugLane:
    """GPUs held by debug sessions, in all and per user, against the lane's limits."""

    capacity: int
    per_user: int
    held: int = 0
    held_by_user: dict[str, int] = field(default_factory=dict)

    @classmethod
    def for_cluster(cls, total_gpus: int, policy: Policy) -> DebugLane:
        # Rounded up so that a small cluster still has a lane of one GPU.
        capacity = math.ceil(policy.debug_lane_fraction * total_gpus)
        return cls(capacity=capacity, per_user=policy.debug_max_gpus)

    def admits(self, slice_: Slice) -> bool:
        return (
            self.held + slice_.gpus <= self.capacity
            and self.held_by_user.get(slice_.user, 0) + slice_.gpus <= self.per_user
        )

    def record(self, slice_: Slice) -> None:
        self.held += slice_.gpus
        self.held_by_user[slice_.user] = self.held_by_user.get(slice_.user, 0) + slice_.gpus


@dataclass(frozen=True, slots=True)
class Victims:
    """A chosen preemption: the request's promised placement and who leaves for it."""

    placement: Placement
    victims: tuple[tuple[Slice, PreemptReason], ...]


def preempt_reason(
    requester: Slice,
    victim: Slice,
    *,
    now: float,
    policy: Policy,
    standings: Standings,
    lane: DebugLane,
    weight: float,
    lost_before: float = 0.0,
    gang: bool = False,
) -> PreemptReason | None:
    """Why ``requester`` may preempt ``victim`` at ``now``, or None if it may not.

    Only allocated requests preempt, and only slices past protection and within
    their preemption budget (:func:`past_budget`):

    1. unallocated slices, always (they were free and knew it);
    2. the same project's work that ranks below the request in
       :func:`~broker.core.ordering.within_project_key`;
    3. another project's work when fair share now allows the move
       (:meth:`Standings.may_take`): the victim's project is above its fair share
       and the move brings the two closer where their paths part; the requester's
       project gains the request's GPUs, the victim's project loses all of the
       victim's (``weight`` per GPU), on top of ``lost_before`` it already loses
       to this request (``gang``: the request is larger than any node);
    4. a batch slice, for a debug session the debug lane admits.
    """
    if not requester.allocated or victim.state is not _GRANTED:
        return None
    if not victim.allocated:
        return PreemptReason.UNALLOCATED
    if victim.is_protected(now) or past_budget(victim, policy):
        return None
    if victim.project == requester.project:
        if within_project_key(victim) > within_project_key(requester):
            return PreemptReason.PRIORITY
        return None
    gained = requester.gpus * weight
    lost = lost_before + victim.gpus * weight
    if standings.may_take(
        requester.project, victim.project, gained, lost, gang=gang, lost_before=lost_before
    ):
        return PreemptReason.FAIR_SHARE
    if victim.kind is _BATCH_KIND and is_debug(requester, policy) and lane.admits(requester):
        return PreemptReason.DEBUG_LANE
    return None


class Preemptor:
    """Finds, for one request at a time, the least harmful victims on one node."""

    def __init__(
        self,
        *,
        now: float,
        policy: Policy,
        standings: Standings,
        lane: DebugLane,
        nodes: Mapping[str, Node],
        weights: Mapping[str, float],
        candidates: Candidates,
        leaving_out: Iterable[int] = (),
        standing: Mapping[str, float] | None = None,
    ):
        """The candidates are ``candidates`` (an index brought to ``now``, left as
        it is) less the slices ``leaving_out``. ``standing``: each project's
        standing to order victims by, if not the ``standings``' of now."""
        self.now = now
        self.policy = policy
        self.standings = standings
        self.lane = lane
        self.nodes = nodes
        self.weights = weights
        self.candidates = candidates
        # What this search's candidates are beside the index's: the slices it left
        # out or took (by node, their GPUs), and its own counts, copied when first
        # changed. The index's ``nodes_of`` serves unchanged: a node it names only
        # for slices left out is visited for nothing, as its eligible candidates
        # (each node's own, from :meth:`on`) cannot make the request fit.
        self._removed: set[int] = set()
        self._gpus_removed: Counter[str] = Counter()
        self.by_project = candidates.by_project
        self.batch, self.unallocated = candidates.batch, candidates.unallocated
        self.unallocated_on = candidates.unallocated_on
        self._own_counts = False
        # Each node's candidates in victim order, by the standings at the start of
        # the pass, sorted when a search first reads the node (most read a few).
        self._in_order: dict[str, list[tuple[Slice, int]]] = {}
        if standing is None:
            standing = {p: standings.standing(p) for p in standings.tree.projects}
        self._standing = standing
        for slice_id in leaving_out:
            slice_ = candidates.slices.get(slice_id)
            if slice_ is not None:
                self.remove(slice_)

    def candidate_gpus(self, node_name: str) -> int:
        """The GPUs candidates hold on ``node_name``."""
        return self.candidates.gpus_on.get(node_name, 0) - self._gpus_removed.get(node_name, 0)

    def on(self, node_name: str) -> list[tuple[Slice, int]]:
        """The candidates on ``node_name`` in victim order (:func:`victim_key`), with
        the GPUs each holds there."""
        entries = self._in_order.get(node_name)
        if entries is None:
            held = self.candidates.on.get(node_name, {}).values()
            removed, standing = self._removed, self._standing
            entries = [e for e in held if e[0].id not in removed] if removed else list(held)
            entries.sort(key=lambda e: victim_key(e[0], standing[e[0].project]))
            self._in_order[node_name] = entries
        return entries

    @property
    def nodes_of(self) -> dict[Group, Counter[str]]:
        """Per group of candidates, the GPUs they hold on each node (the index's:
        see ``__init__``)."""
        return self.candidates.nodes_of

    def reason(
        self,
        requester: Slice,
        victim: Slice,
        weight: float,
        lost_before: float = 0.0,
        gang: bool = False,
    ) -> PreemptReason | None:
        """:func:`preempt_reason` at this pass's time, standings and lane."""
        return preempt_reason(
            requester,
            victim,
            now=self.now,
            policy=self.policy,
            standings=self.standings,
            lane=self.lane,
            weight=weight,
            lost_before=lost_before,
            gang=gang,
        )

    def hopeless(self, requester: Slice) -> bool:
        """True when :func:`preempt_reason` refuses every candidate for ``requester``,
        told from the counts alone: a shortcut that spares a scan of the cluster.

        It asks the rule's own questions in the same order, each at its most
        lenient: fair share with nothing moved (``may_take`` only gets harder as
        ``gained`` and ``lost`` grow), the debug lane for any batch candidate.
        """
        if not requester.allocated:
            return True
        if self.unallocated > 0:
            return False
        if self.by_project[requester.project] > 0:
            return False  # its own lower-ranked work; checked per slice
        if self.batch > 0 and is_debug(requester, self.policy) and self.lane.admits(requester):
            return False
        counts, standings = self.by_project, self.standings
        return not any(
            counts.get(project) and standings.may_take_at_all(requester.project, project)
            for project in standings.above_share()
        )

    def remove(self, slice_: Slice) -> None:
        """Forget a candidate that is leaving (ended, drained or preempted in this
        pass); the index stays as it is."""
        if not self._own_counts:
            self.by_project = Counter(self.by_project)
            self.unallocated_on = Counter(self.unallocated_on)
            self._own_counts = True
        self._removed.add(slice_.id)
        self.by_project[slice_.project] -= 1
        self.batch -= slice_.kind is _BATCH_KIND
        self.unallocated -= not slice_.allocated
        for placement in slice_.placements:
            node, gpus = placement.node, len(placement.gpu_indices)
            self._gpus_removed[node] += gpus
            entries = self._in_order.get(node)
            if entries is not None:
                entries[:] = [e for e in entries if e[0].id != slice_.id]
            if not slice_.allocated:
                tally(self.unallocated_on, node, -gpus)

    def _eligible(self, requester: Slice) -> tuple[list[Group], set[Group]]:
        """The groups of candidates the rule could let ``requester`` take from,
        each asked at its most lenient (as :meth:`hopeless` does): any other
        candidate is refused whatever the search has already taken.

        Returned as the groups to visit and the groups whose members are worth
        asking about (the latter also holds the requester's own project, since
        a project's own lower-ranked work may be taken whatever fair share says).
        """
        visit: list[Group] = [UNALLOCATED, (PROJECT, requester.project)]
        counts, standings = self.by_project, self.standings
        visit += [
            (PROJECT, project)
            for project in standings.above_share()
            if counts.get(project)
            and project != requester.project
            and standings.may_take_at_all(requester.project, project)
        ]
        if self.batch > 0 and is_debug(requester, self.policy) and self.lane.admits(requester):
            visit.append(BATCH)
        return visit, set(visit)

    def find(self, requester: Slice, free: Mapping[str, set[int]]) -> Victims | None:
        """The least harmful way to make ``requester`` fit on one node, or None.

        On each node that could hold it, victims are added in :func:`victim_key`
        order until the request fits, each judged with what the earlier ones
        already cost its project; then each is put back if the request still
        fits without it. Nodes compare by (allocated victims, victims, victim
        GPUs, node name).

        Unallocated candidates come first in that order and may always be
        taken, so a node whose unallocated GPUs make the request fit costs no
        allocated victim, and every other node costs at least one: those nodes
        are searched first, the others only when none of them serves.
        """
        if self.hopeless(requester):
            return None
        free_only = [
            name
            for name, gpus in self.unallocated_on.items()
            if gpus + len(free.get(name, ())) >= requester.gpus
        ]
        best = self._search_unallocated(requester, free, free_only)
        if best is None:
            visit, eligible = self._eligible(requester)
            where: set[str] = set()
            for group in visit:
                where.update(self.nodes_of.get(group, ()))
            where.difference_update(free_only)
            best = self._search(requester, free, where, eligible)
        if best is None:
            return None
        _, node_name, chosen = best
        freed = sorted(i for s, _ in chosen for i in _gpus_on(s, node_name))
        gpu_indices = sorted(free.get(node_name, set())) + freed
        placement = Placement(node_name, tuple(sorted(gpu_indices[: requester.gpus])))
        return Victims(placement, tuple(chosen))

    def _search_unallocated(
        self, requester: Slice, free: Mapping[str, set[int]], node_names: Iterable[str]
    ) -> tuple | None:
        """:meth:`_search` on nodes whose unallocated candidates alone make the
        request fit: they lead each node's victim order and the rule always lets
        an allocated request take them, so it need not be asked."""
        best: tuple | None = None
        for node_name in node_names:
            need = self._shortfall(requester, free, node_name)
            if need is None:
                continue
            chosen: list[tuple[Slice, int]] = []
            freed = 0
            for entry in self.on(node_name):
                chosen.append(entry)
                freed += entry[1]
                if freed >= need:
                    break
            freed = _put_back(chosen, freed, need)
            score = (0, len(chosen), freed, node_name)
            if best is None or score < best[0]:
                best = (score, node_name, [(s, PreemptReason.UNALLOCATED) for s, _ in chosen])
        return best

    def _shortfall(
        self, requester: Slice, free: Mapping[str, set[int]], node_name: str
    ) -> int | None:
        """How many GPUs ``requester`` lacks on ``node_name`` beyond its free ones, or
        ``None`` when preemption there cannot serve it (no such node, too small, the
        wrong type, or enough free already)."""
        node = self.nodes.get(node_name)
        if node is None or node.gpu_count < requester.gpus:
            return None
        if requester.gpu_type is not None and node.gpu_type != requester.gpu_type:
            return None
        need = requester.gpus - len(free.get(node_name, ()))
        return need if need > 0 else None

    def _search(
        self,
        requester: Slice,
        free: Mapping[str, set[int]],
        node_names: Iterable[str],
        eligible: set[Group],
    ) -> tuple | None:
        """The best (score, node, victims) among ``node_names``, or None (see :meth:`find`)."""
        best: tuple | None = None
        for node_name in node_names:
            need = self._shortfall(requester, free, node_name)
            if need is None or self.candidate_gpus(node_name) < need:
                continue
            # Only candidates of an eligible group could be taken (the rest the
            # rule refuses): too few of their GPUs, and the node cannot serve.
            entries = [e for e in self.on(node_name) if not eligible.isdisjoint(groups(e[0]))]
            if sum(gpus for _, gpus in entries) < need:
                continue
            weight = self.weights.get(self.nodes[node_name].gpu_type, 1.0)
            chosen: list[tuple[Slice, PreemptReason, int]] = []
            lost: dict[str, float] = {}  # weighted GPUs each project loses so far
            freed = 0
            spent = False  # a candidate refused only for what earlier ones cost
            for slice_, gpus in entries:
                before = lost.get(slice_.project, 0.0)
                reason = self.reason(requester, slice_, weight, before)
                if reason is not None:
                    chosen.append((slice_, reason, gpus))
                    if slice_.allocated:
                        lost[slice_.project] = before + slice_.gpus * weight
                    freed += gpus
                    if freed >= need:
                        break
                elif before and self.reason(requester, slice_, weight) is not None:
                    spent = True
            else:
                # Smaller victims of a project, taken first, may have spent what it
                # could lose that a larger one alone would have made do with.
                found = self._fewest(requester, entries, need, weight) if spent else None
                if found is None:
                    continue
                chosen = found
                freed = sum(gpus for _, _, gpus in chosen)
            freed = _put_back(chosen, freed, need)
            score = (
                sum(1 for s, _, _ in chosen if s.allocated),
                len(chosen),
                freed,
                node_name,
            )
            if best is None or score < best[0]:
                best = (score, node_name, [(s, r) for s, r, _ in chosen])
        return best

    def _fewest(
        self, requester: Slice, entries: list, need: int, weight: float
    ) -> list[tuple[Slice, PreemptReason, int]] | None:
        """The fewest of ``entries``, first in victim order, that free ``need`` GPUs
        and the rule allows in that order, each judged with what the earlier ones
        cost its project; None if no set does. Asked only where taking them in
        turn failed on a refusal the earlier victims caused (rare: at most a
        node's slices, all subsets)."""
        for size in range(1, len(entries) + 1):
            for subset in combinations(entries, size):
                if sum(gpus for _, gpus in subset) < need:
                    continue
                chosen: list[tuple[Slice, PreemptReason, int]] = []
                lost: dict[str, float] = {}
                for slice_, gpus in subset:
                    before = lost.get(slice_.project, 0.0)
                    reason = self.reason(requester, slice_, weight, before)
                    if reason is None:
                        break
                    chosen.append((slice_, reason, gpus))
                    if slice_.allocated:
                        lost[slice_.project] = before + slice_.gpus * weight
                else:
                    return chosen
        return None


def _put_back(chosen: list, freed: int, need: int) -> int:
    """Put back, last taken first, every victim the request fits without; what the
    rest free. Each of ``chosen`` ends with the GPUs it frees."""
    for victim in reversed(chosen[:-1]):
        if freed - victim[-1] >= need:
            chosen.remove(victim)
            freed -= victim[-1]
    return freed


def _gpus_on(slice_: Slice, node: str) -> tuple[int, ...]:
    for placement in slice_.placements:
        if placement.node == node:
            return placement.gpu_indices
    return ()
