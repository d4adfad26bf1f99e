"""Who may preempt whom (SPEC §5.2–§5.3), and the fewest victims that make a request fit."""

from __future__ import annotations

import math
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

    def record(self, project: str, weighted_gpus: float) -> None:
        for account in self.tree.paths[project]:
            self.held[account] = self.held.get(account, 0.0) + weighted_gpus

    def _projected(self, account: str, delta: float) -> float:
        held = self.held.get(account, 0.0) + delta
        return (self.usage[account] + held * self.horizon) / self.tree.entitlements[account]

    def ranks_above(self, mine: str, theirs: str) -> bool:
        """Whether project ``mine`` ranks above ``theirs`` where their paths part."""
        level = self.tree.parting(mine, theirs)
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
        level = self.tree.parting(mine, theirs)
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
        # Slices that someone could preempt now, per node they hold GPUs on.
        self.candidates: dict[str, list[Slice]] = {}
        for slice_ in running:
            if slice_.state is SliceState.GRANTED and not slice_.is_protected(now):
                for placement in slice_.placements:
                    self.candidates.setdefault(placement.node, []).append(slice_)

    def remove(self, slice_: Slice) -> None:
        """Forget a slice that is leaving (preempted in this pass)."""
        for placement in slice_.placements:
            self.candidates[placement.node].remove(slice_)

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
        gained = requester.gpus * weight
        lost = victim.gpus * weight
        if self.view.may_take(requester.project, victim.project, gained, lost):
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
        best: tuple | None = None
        for node_name, slices in self.candidates.items():
            node = self.nodes.get(node_name)
            if node is None or node.gpu_count < requester.gpus:
                continue
            if requester.gpu_type is not None and node.gpu_type != requester.gpu_type:
                continue
            free_here = free.get(node_name, set())
            need = requester.gpus - len(free_here)
            if need <= 0 or sum(len(_gpus_on(s, node_name)) for s in slices) < need:
                continue
            weight = self.weights.get(node.gpu_type, 1.0)
            eligible = []
            for slice_ in slices:
                reason = self.reason(requester, slice_, weight)
                if reason is not None:
                    eligible.append((slice_, reason))
            eligible.sort(key=lambda pair: victim_key(pair[0], self._value(pair[0].project)))
            chosen = _fewest(eligible, need, node_name)
            if chosen is None:
                continue
            score = (
                sum(1 for s, _ in chosen if s.allocated),
                len(chosen),
                sum(len(_gpus_on(s, node_name)) for s, _ in chosen),
                node_name,
            )
            if best is None or score < best[0]:
                best = (score, node_name, chosen)
        if best is None:
            return None
        _, node_name, chosen = best
        freed = sorted(i for s, _ in chosen for i in _gpus_on(s, node_name))
        gpu_indices = sorted(free.get(node_name, set())) + freed
        placement = Placement(node_name, tuple(sorted(gpu_indices[: requester.gpus])))
        return Victims(placement, tuple(chosen))

    def _value(self, project: str) -> float:
        return self.view.values[project]


def _gpus_on(slice_: Slice, node: str) -> tuple[int, ...]:
    for placement in slice_.placements:
        if placement.node == node:
            return placement.gpu_indices
    return ()


def _fewest(
    eligible: list[tuple[Slice, PreemptReason]], need: int, node: str
) -> list[tuple[Slice, PreemptReason]] | None:
    """Take victims in order until ``need`` GPUs are freed, then put back the
    ones not needed, last taken first."""
    chosen: list[tuple[Slice, PreemptReason]] = []
    freed = 0
    for pair in eligible:
        chosen.append(pair)
        freed += len(_gpus_on(pair[0], node))
        if freed >= need:
            break
    else:
        return None
    for pair in reversed(chosen[:-1]):
        gpus = len(_gpus_on(pair[0], node))
        if freed - gpus >= need:
            chosen.remove(pair)
            freed -= gpus
    return chosen
