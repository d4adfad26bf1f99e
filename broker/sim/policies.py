"""The policies the simulator compares, behind one small interface.

A policy is a callable from a :class:`~broker.core.model.Snapshot` to
:class:`~broker.core.model.Decisions`, with a ``name`` and the
:class:`~broker.core.model.Policy` it runs under (which also tells the engine how
to count usage: a hard window or a half-life). ``fairshare`` is the real
scheduling pass, run from state kept between passes
(:class:`broker.core.incremental.PassState`: the same decisions as
:func:`broker.core.scheduler.schedule`, less work per pass). The
baselines are small pure functions of their own, sharing only the
housekeeping every cluster does (:func:`settle`) and the core's free-GPU map
for placement, so that they differ from ours in ordering, quotas and
preemption — not in how a slice is packed onto a node:

- ``fifo``: first come, first served; the head of the queue waits for room and
  everyone waits behind it. No preemption.
- ``priority``: the system design.md §1 replaces. Strict priority (then submit
  time), greedy: whatever fits starts, the rest is skipped. Non-preemptible
  per-project concurrency quotas. Users set priorities freely, so they are
  inflated (the workloads put most work at the top).
- ``slurm``: Slurm-like multifactor priority — fair-share factor
  ``2^(-usage/share)`` over usage decayed with a half-life, plus an age
  factor — with one reservation for the highest-priority job that does not
  fit. No contracts, no preemption.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from ..core.fairshare import ProjectTree
from ..core.incremental import PassState
from ..core.model import (
    DAY,
    Account,
    Decisions,
    Ending,
    EndReason,
    Grant,
    NodeChange,
    NodeState,
    Placement,
    Policy,
    Quiet,
    Slice,
    SliceKind,
    SliceState,
    Snapshot,
)
from ..core.placement import FreeGpus
from ..core.resume import still_quiet
from ..core.scheduler import schedule
from ..core.transitions import requeued_when_ended


class Scheduler(Protocol):
    """What the engine drives: a pure function of a snapshot, and its knobs."""

    name: str
    policy: Policy

    def __call__(self, snapshot: Snapshot, /) -> Decisions: ...

    def still_quiet(self, quiet: Quiet | None, snapshot: Snapshot, /) -> bool:
        """Whether a pass over the slices and nodes the last pass left, which said
        ``quiet``, would decide nothing at ``snapshot.now``. The engine asks it of a
        quiet that names no window order; one that does, it judges by ``Quiet``'s
        own terms and asks the policy only to check itself (``SimConfig.check``)."""
        ...


class FairShare:
    """Ours: the real pass (design.md §4–§6), with the project tree built once
    and the pass's state kept from one pass to the next, as a long-running
    broker would keep it."""

    name = "fairshare"

    def __init__(self, accounts: Sequence[Account], policy: Policy | None = None):
        self.tree = ProjectTree(accounts)
        self.policy = policy or Policy()
        self.kept = PassState(self.tree)

    def __call__(self, snapshot: Snapshot, /) -> Decisions:
        return schedule(snapshot, index=self.kept)

    def still_quiet(self, quiet: Quiet | None, snapshot: Snapshot, /) -> bool:
        return still_quiet(quiet, snapshot, self.tree)

    def expect(self, changed: Mapping[int, Slice | None]) -> None:
        """The next snapshot differs from the last one only in these slices (id -> the
        slice, None: gone): the kept index files them alone (PassState.expect)."""
        self.kept.expect(changed)


# ---- what every baseline does ----------------------------------------------------


@dataclass
class Settled:
    """A cluster after the housekeeping of :func:`settle`: what ends, what is free."""

    endings: list[Ending]
    node_changes: list[NodeChange]
    free: FreeGpus
    pending: list[Slice]
    held: dict[str, int] = field(default_factory=dict)  # GPUs held per project
    next_end: float = math.inf  # the first end of a holder's maximum runtime or grace


def settle(snapshot: Snapshot) -> Settled:
    """End slices on ``down`` nodes (resumable batch requeues) and past their
    ``max_runtime`` or grace; report empty draining nodes ``drained``; map the
    free GPUs of ``ready`` nodes. No baseline preempts, so a draining node
    empties only as its jobs end (or an operator steps in)."""
    now = snapshot.now
    states = {n.name: n.state for n in snapshot.nodes}
    endings: list[Ending] = []
    holding: list[Slice] = []
    pending: list[Slice] = []
    next_end = math.inf
    for s in snapshot.slices:
        if s.state is SliceState.PENDING:
            pending.append(s)
            continue
        if any(states.get(p.node, NodeState.DOWN) is NodeState.DOWN for p in s.placements):
            requeue = requeued_when_ended(s.kind, s.contract.resumable, EndReason.NODE_DOWN)
            endings.append(Ending(s.id, EndReason.NODE_DOWN, requeue))
        elif (
            s.contract.max_runtime is not None
            and s.granted_at is not None
            and now >= s.granted_at + s.contract.max_runtime
        ):
            endings.append(Ending(s.id, EndReason.EXPIRED))
        elif s.preempt_deadline is not None and now >= s.preempt_deadline:
            requeue = requeued_when_ended(s.kind, s.contract.resumable, EndReason.PREEMPTED)
            endings.append(Ending(s.id, EndReason.PREEMPTED, requeue))
        else:
            holding.append(s)
            if s.contract.max_runtime is not None and s.granted_at is not None:
                next_end = min(next_end, s.granted_at + s.contract.max_runtime)
            if s.preempt_deadline is not None:
                next_end = min(next_end, s.preempt_deadline)
    busy = {p.node for s in holding for p in s.placements}
    changes = [
        NodeChange(n.name, NodeState.DRAINED, "empty after drain")
        for n in sorted(snapshot.nodes, key=lambda n: n.name)
        if n.state is NodeState.DRAINING and n.name not in busy
    ]
    free = FreeGpus(
        [n for n in snapshot.nodes if n.state is NodeState.READY], snapshot.gpu_type_weights
    )
    held: dict[str, int] = {}
    for s in holding:
        free.take(s.placements)
        held[s.project] = held.get(s.project, 0) + s.gpus
    return Settled(endings, changes, free, pending, held, next_end)


def _decisions(settled: Settled, grants: list[Grant]) -> Decisions:
    """What a baseline decided. A pass that decided nothing says so until the first
    end :func:`settle` will find (``Decisions.quiet``; no window order: baselines do
    not read it); its policy's ``still_quiet`` adds what else moves its order in
    time, and the engine leaves out the passes where only time moved meanwhile."""
    decided = grants or settled.endings or settled.node_changes
    return Decisions(
        grants=tuple(grants),
        endings=tuple(settled.endings),
        node_changes=tuple(settled.node_changes),
        quiet=None if decided else Quiet(settled.next_end, None),
    )


def _before_until(quiet: Quiet | None, snapshot: Snapshot) -> bool:
    """``still_quiet`` of a policy that decides the same whatever the time, but for
    the ends :func:`settle` finds: strict priority and FIFO."""
    return quiet is not None and snapshot.now < quiet.until


def _shape(s: Slice) -> tuple[int, str | None, bool]:
    """What :meth:`FreeGpus.fit` reads of a request: its GPUs, GPU type, and whether
    it may span nodes (batch work)."""
    return (s.gpus, s.gpu_type, s.kind is SliceKind.BATCH)


class _Fitter:
    """Where each job of one baseline pass fits (:meth:`FreeGpus.fit`), over free GPUs
    that only shrink as the pass goes (grants and the one reservation take them): a
    shape that found no place finds none later in the pass, so it is not looked for
    again. The long tail of a queue on a full cluster is walked cheaply."""

    def __init__(self, free: FreeGpus):
        self.free = free
        self._misfits: set[tuple[int, str | None, bool]] = set()  # found no place

    def __call__(self, s: Slice) -> tuple[Placement, ...] | None:
        shape = _shape(s)
        if shape in self._misfits:
            return None
        placements = self.free.fit(*shape)
        if placements is None:
            self._misfits.add(shape)
        return placements


# ---- the baselines -----------------------------------------------------------------


class Fifo:
    """First come, first served; the head waits and blocks the queue behind it.

    Order: submit time, then slice id.
    """

    name = "fifo"
    still_quiet = staticmethod(_before_until)

    def __init__(self, accounts: Sequence[Account] = (), policy: Policy | None = None):
        self.policy = policy or Policy()

    def __call__(self, snapshot: Snapshot, /) -> Decisions:
        settled = settle(snapshot)
        grants = []
        fit = _Fitter(settled.free)
        for s in sorted(settled.pending, key=lambda s: (s.submitted_at, s.id)):
            placements = fit(s)
            if placements is None:
                break
            settled.free.take(placements)
            grants.append(Grant(s.id, placements))
        return _decisions(settled, grants)


class StrictPriority:
    """Strict priority with non-preemptible per-project concurrency quotas (design.md §1).

    Order: priority (higher first), submit time, slice id. Each pending slice
    starts if it fits and its project stays within its quota — ``entitlement
    × cluster GPUs × overcommit``, rounded, at least 1 — otherwise it is
    skipped (no reservation, no preemption). A project holding nothing may
    start one job of any size, so that no job is barred for being larger
    than its project's quota.
    """

    name = "priority"
    still_quiet = staticmethod(_before_until)

    def __init__(
        self, accounts: Sequence[Account], policy: Policy | None = None, overcommit: float = 1.5
    ):
        self.policy = policy or Policy()
        tree = ProjectTree(accounts)
        self.entitlements = {p: tree.entitlements[p] for p in tree.projects}
        self.overcommit = overcommit

    def quotas(self, total_gpus: int) -> dict[str, int]:
        return {
            p: max(1, round(share * total_gpus * self.overcommit))
            for p, share in self.entitlements.items()
        }

    def __call__(self, snapshot: Snapshot, /) -> Decisions:
        settled = settle(snapshot)
        quotas = self.quotas(sum(n.gpu_count for n in snapshot.nodes))
        held = settled.held
        grants = []
        fit = _Fitter(settled.free)
        for s in sorted(settled.pending, key=lambda s: (-s.priority, s.submitted_at, s.id)):
            holding = held.get(s.project, 0)
            if holding and holding + s.gpus > quotas[s.project]:
                continue
            placements = fit(s)
            if placements is None:
                continue
            settled.free.take(placements)
            held[s.project] = holding + s.gpus
            grants.append(Grant(s.id, placements))
        return _decisions(settled, grants)


class MultifactorFairShare:
    """Slurm-like multifactor priority (half-life decay, no contracts).

    ``priority = fairshare_weight × 2^(-U/S) + age_weight × min(1, age / max_age)``
    with ``U`` the project's decayed usage over all projects' and ``S`` its
    entitlement (Slurm's classic fair-share factor). Order: priority (higher
    first), submit time, slice id. Jobs start greedily in that order, except
    that the first one that does not fit reserves the node(s) with the most
    free GPUs (whole nodes for a gang), which later jobs may not use: Slurm
    holds back the top job's resources this way, here without time limits to
    backfill against.
    """

    name = "slurm"

    def __init__(
        self,
        accounts: Sequence[Account],
        policy: Policy | None = None,
        *,
        fairshare_weight: float = 10_000.0,
        age_weight: float = 1_000.0,
        max_age: float = 7 * DAY,
    ):
        policy = policy or Policy()
        # usage decays with a half-life (Slurm's PriorityDecayHalfLife, default 7 days)
        self.policy = policy if policy.half_life else replace(policy, half_life=7 * DAY)
        tree = ProjectTree(accounts)
        self.entitlements = {p: tree.entitlements[p] for p in tree.projects}
        self.fairshare_weight = fairshare_weight
        self.age_weight = age_weight
        self.max_age = max_age
        # What the last quiet pass saw first in its queue: each project's oldest job
        # (project, submit time, id), and the first of them.
        self._heads: tuple[tuple[str, float, int], ...] = ()
        self._first: int | None = None

    def factors(self, usage: dict[str, float] | Snapshot) -> dict[str, float]:
        """The fair-share factor ``2^(-U/S)`` of every project (1.0 when nothing is used)."""
        if isinstance(usage, Snapshot):
            usage = dict(usage.usage)
        total = sum(usage.get(p, 0.0) for p in self.entitlements)
        if total <= 0:
            return dict.fromkeys(self.entitlements, 1.0)
        return {p: 2.0 ** (-(usage.get(p, 0.0) / total) / e) for p, e in self.entitlements.items()}

    def order_key(
        self, factors: Mapping[str, float], now: float
    ) -> Callable[[str, float, int], tuple[float, float, int]]:
        """A pending job's place in the queue at ``now``, from its project, submit time
        and id: priority (higher first), submit time, slice id. Within a project the
        oldest job comes first, whatever the time: the fair-share factor is the
        project's, and age only grows with it. One function per pass: the queue's
        every job is placed with it."""
        fair_share = {p: self.fairshare_weight * f for p, f in factors.items()}
        age_weight, max_age = self.age_weight, self.max_age

        def key(project: str, submitted_at: float, id: int) -> tuple[float, float, int]:
            age = min(1.0, max(0.0, now - submitted_at) / max_age)
            return (-(fair_share[project] + age_weight * age), submitted_at, id)

        return key

    def __call__(self, snapshot: Snapshot, /) -> Decisions:
        settled = settle(snapshot)
        key = self.order_key(self.factors(dict(snapshot.usage)), snapshot.now)
        # With no GPU free no job fits and the first one's reservation takes nothing:
        # the queue need not be sorted.
        grants = _walk_with_reservation(settled, key) if settled.free.free_total else []
        decisions = _decisions(settled, grants)
        if decisions.quiet is not None:
            # Nothing fitted, the first job not even with nothing reserved: over the same
            # slices, a later pass decides nothing while that job still comes first (it
            # reserves the same GPUs) — ages and decayed usage reorder the queue in time.
            # Each project's first job is its oldest (order_key), so no sort finds them.
            heads: dict[str, tuple[float, int]] = {}
            for s in settled.pending:
                head = heads.get(s.project)
                if head is None or (s.submitted_at, s.id) < head:
                    heads[s.project] = (s.submitted_at, s.id)
            self._heads = tuple((project, *head) for project, head in heads.items())
            first = min(self._heads, key=lambda head: key(*head), default=None)
            self._first = None if first is None else first[2]
        return decisions

    def still_quiet(self, quiet: Quiet | None, snapshot: Snapshot, /) -> bool:
        """Whether a pass over the slices and nodes the last pass left, at
        ``snapshot.now``, would decide nothing: before ``quiet.until`` and with the
        same job first in the queue (the first of the projects' oldest jobs)."""
        if quiet is None or snapshot.now >= quiet.until:
            return False
        if not self._heads:
            return True
        factors, now = self.factors(snapshot), snapshot.now
        key = self.order_key(factors, now)
        first = min(self._heads, key=lambda head: key(*head))
        return first[2] == self._first


def _walk_with_reservation(
    settled: Settled, key: Callable[[str, float, int], tuple[float, float, int]]
) -> list[Grant]:
    """The Slurm-like walk: jobs in ``key``'s order start where they fit, and the
    first that does not reserves the GPUs it waits for from later jobs."""
    ordered = sorted(settled.pending, key=lambda s: key(s.project, s.submitted_at, s.id))
    fit = _Fitter(settled.free)
    grants = []
    reserved = False
    for s in ordered:
        placements = fit(s)
        if placements is not None:
            settled.free.take(placements)
            grants.append(Grant(s.id, placements))
        elif not reserved:
            reserved = True
            settled.free.take(_reserve(settled.free, s))
    return grants


def _reserve(free: FreeGpus, s: Slice) -> list[Placement]:
    """The free GPUs of the nodes a blocked slice waits for: the node of its type
    with the most free GPUs that could hold it, or for a gang as many such
    nodes as its size needs (most free first, then by name)."""
    nodes = [
        n
        for n in free.nodes.values()
        if (s.gpu_type is None or n.gpu_type == s.gpu_type)
        and (n.gpu_count >= s.gpus or s.kind is SliceKind.BATCH)
    ]
    nodes.sort(key=lambda n: (-len(free.free[n.name]), n.name))
    chosen, count = [], 0
    for n in nodes:
        chosen.append(Placement(n.name, tuple(sorted(free.free[n.name]))))
        count += n.gpu_count
        if count >= s.gpus:
            break
    return chosen


# ---- by name -----------------------------------------------------------------------

PolicyFactory = Callable[[Sequence[Account]], Scheduler]

POLICIES: dict[str, PolicyFactory] = {
    "fairshare": FairShare,
    "priority": StrictPriority,
    "slurm": MultifactorFairShare,
    "fifo": Fifo,
}
