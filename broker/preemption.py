"""Who may preempt whom (SPEC §5.2–§5.3), and the fewest victims that make a request fit."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .fairshare import ProjectTree
from .model import Node, Placement, Policy, PreemptReason, Slice, SliceKind, SliceState
from .ordering import victim_key, within_project_key


@dataclass
class FairShareView:
    """Fair-share standing during one pass.

    ``held`` is the weighted GPUs each account's subtree holds in allocated
    slices; it moves as the pass grants and preempts, so that the
    anti-ping-pong check sees the cluster as it will be after each move.
    """

    tree: ProjectTree
    usage: Mapping[str, float]  # subtree usage per account
    values: Mapping[str, float]  # usage / entitlement per account
    horizon: float
    held: dict[str, float] = field(default_factory=dict)
    _partings: dict = field(default_factory=dict)

    def parting(self, mine: str, theirs: str):
        key = (mine, theirs)
        if key not in self._partings:
            self._partings[key] = self.tree.parting(mine, theirs)
        return self._partings[key]

    def record(self, project: str, weighted_gpus: float) -> None:
        for account in self.tree.paths[project]:
            self.held[account] = self.held.get(account, 0.0) + weighted_gpus

    def _projected(self, account: str, delta: float) -> float:
        held = self.held.get(account, 0.0) + delta
        return (self.usage[account] + held * self.horizon) / self.tree.entitlements[account]

    def ranks_above(self, mine: str, theirs: str) -> bool:
        """Whether project ``mine`` ranks above ``theirs`` where their paths part."""
        level = self.parting(mine, theirs)
        if level is None:
            return False
        return (self.values[level.mine], level.mine) < (self.values[level.theirs], level.theirs)

    def may_take(self, mine: str, theirs: str, gained: float, lost: float) -> bool:
        """Fair-share preemption with hysteresis (Kueue's LessThanOrEqualToFinalShare):
        ``mine`` ranks above ``theirs`` now, and would still rank at or above it
        after gaining ``gained`` weighted GPUs that ``theirs`` loses (``lost``),
        both projected ``horizon`` seconds ahead — so the GPUs never go back and forth."""
        if not self.ranks_above(mine, theirs):
            return False
        level = self.parting(mine, theirs)
        assert level is not None
        return self._projected(level.mine, gained) <= self._projected(level.theirs, -lost)


def is_debug(slice_: Slice, policy: Policy) -> bool:
    """A short, small interactive session: what the debug lane is for."""
    return (
        slice_.kind is SliceKind.INTERACTIVE
        and slice_.allocated
        and slice_.gpus <= policy.debug_max_gpus
        and slice_.contract.min_runtime <= policy.debug_max_min_runtime
    )


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


class Preemptor:
    """Finds, for one request at a time, the least harmful victims on one node."""

    def __init__(
        self,
        *,
        now: float,
        policy: Policy,
        view: FairShareView,
        lane: DebugLane,
        nodes: Mapping[str, Node],
        weights: Mapping[str, float],
        running: Iterable[Slice],
    ):
        self.now = now
        self.policy = policy
        self.view = view
        self.lane = lane
        self.nodes = nodes
        self.weights = weights
        # Slices that someone could preempt now, per node they hold GPUs on, in
        # victim order (project values do not change during a pass), with the
        # GPUs each holds there.
        self.candidates: dict[str, list[tuple[Slice, int]]] = {}
        for slice_ in running:
            if slice_.state is SliceState.GRANTED and not slice_.is_protected(now):
                for placement in slice_.placements:
                    self.candidates.setdefault(placement.node, []).append(
                        (slice_, len(placement.gpu_indices))
                    )
        self._fair: dict[tuple[int, str, float], bool] = {}
        self.candidate_gpus: dict[str, int] = {}
        # Which projects have candidates, and how many of them are unallocated or
        # batch: enough to tell cheaply when a request can preempt nothing at all.
        self.by_project: Counter[str] = Counter()
        self.unallocated = 0
        self.batch = 0
        for node_name, entries in self.candidates.items():
            entries.sort(key=lambda e: victim_key(e[0], view.values[e[0].project]))
            self.candidate_gpus[node_name] = sum(gpus for _, gpus in entries)
            for slice_, _ in entries:
                self._tally(slice_, 1)

    def _tally(self, slice_: Slice, step: int) -> None:
        self.by_project[slice_.project] += step
        self.unallocated += step * (not slice_.allocated)
        self.batch += step * (slice_.kind is SliceKind.BATCH)

    def hopeless(self, requester: Slice) -> bool:
        """True when no running slice could be preempted for ``requester``, whatever
        the node: a shortcut that spares a scan of the cluster."""
        if not requester.allocated:
            return True
        if self.unallocated > 0:
            return False
        if self.batch > 0 and is_debug(requester, self.policy) and self.lane.admits(requester):
            return False
        if self.by_project[requester.project] > 0:
            return False  # its own lower-ranked work; checked per slice
        # With nothing moved, the hysteresis check is at its most lenient.
        return not any(
            count and self.view.may_take(requester.project, project, 0.0, 0.0)
            for project, count in self.by_project.items()
        )

    def remove(self, slice_: Slice) -> None:
        """Forget a slice that is leaving (preempted in this pass)."""
        for placement in slice_.placements:
            entries = self.candidates[placement.node]
            entries[:] = [e for e in entries if e[0].id != slice_.id]
            self.candidate_gpus[placement.node] -= len(placement.gpu_indices)
            self._tally(slice_, -1)

    def reason(self, requester: Slice, victim: Slice, weight: float) -> PreemptReason | None:
        """Why ``requester`` may preempt ``victim`` now, or None if it may not.

        Only allocated requests preempt, and only slices past protection:
        unallocated ones always; the same project's lower-ranked work; another
        project's work when fair share says so; a batch slice for the debug lane.
        """
        if not requester.allocated or victim.state is not SliceState.GRANTED:
            return None
        if not victim.allocated:
            return PreemptReason.UNALLOCATED
        if victim.is_protected(self.now):
            return None
        if victim.project == requester.project:
            if within_project_key(victim) > within_project_key(requester):
                return PreemptReason.PRIORITY
            return None
        # What moves is the request's GPUs: the requester gains them, the victim's
        # project loses as much (a larger victim's rest frees up for anyone).
        # Fair share is a matter of the two projects only: decide it once per find.
        key = (requester.id, victim.project, weight)
        fair = self._fair.get(key)
        if fair is None:
            moved = requester.gpus * weight
            fair = self._fair[key] = self.view.may_take(
                requester.project, victim.project, moved, moved
            )
        if fair:
            return PreemptReason.FAIR_SHARE
        if (
            victim.kind is SliceKind.BATCH
            and is_debug(requester, self.policy)
            and self.lane.admits(requester)
        ):
            return PreemptReason.DEBUG_LANE
        return None

    def find(self, requester: Slice, free: Mapping[str, set[int]]) -> Victims | None:
        """The least harmful way to make ``requester`` fit on one node, or None.

        On each node that could hold it, victims are added in :func:`victim_key`
        order until the request fits, then each is put back if the request
        still fits without it. Nodes compare by (allocated victims, victims,
        victim GPUs, node name).
        """
        if self.hopeless(requester):
            return None
        best: tuple | None = None
        self._fair = {}
        for node_name, entries in self.candidates.items():
            node = self.nodes.get(node_name)
            if node is None or node.gpu_count < requester.gpus:
                continue
            if requester.gpu_type is not None and node.gpu_type != requester.gpu_type:
                continue
            need = requester.gpus - len(free.get(node_name, ()))
            if need <= 0 or self.candidate_gpus[node_name] < need:
                continue
            weight = self.weights.get(node.gpu_type, 1.0)
            chosen: list[tuple[Slice, PreemptReason, int]] = []
            freed = 0
            for slice_, gpus in entries:
                reason = self.reason(requester, slice_, weight)
                if reason is not None:
                    chosen.append((slice_, reason, gpus))
                    freed += gpus
                    if freed >= need:
                        break
            else:
                continue
            # Put back, last taken first, every victim the request fits without.
            for victim in reversed(chosen[:-1]):
                if freed - victim[2] >= need:
                    chosen.remove(victim)
                    freed -= victim[2]
            score = (
                sum(1 for s, _, _ in chosen if s.allocated),
                len(chosen),
                freed,
                node_name,
            )
            if best is None or score < best[0]:
                best = (score, node_name, [(s, r) for s, r, _ in chosen])
        if best is None:
            return None
        _, node_name, chosen = best
        freed = sorted(i for s, _ in chosen for i in _gpus_on(s, node_name))
        gpu_indices = sorted(free.get(node_name, set())) + freed
        placement = Placement(node_name, tuple(sorted(gpu_indices[: requester.gpus])))
        return Victims(placement, tuple(chosen))


def _gpus_on(slice_: Slice, node: str) -> tuple[int, ...]:
    for placement in slice_.placements:
        if placement.node == node:
            return placement.gpu_indices
    return ()
