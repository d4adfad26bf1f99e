"""The scheduler's contract as properties over random clusters, trees and workloads.

Each example runs a stretch of time on a small, contended cluster: projects
start with usage (and often one of them fills the cluster first), slices arrive
with mostly protected contracts, caps, leases, priorities and debug sessions;
time moves (often exactly to the next deadline), holders release, heartbeat and
report checkpoints, nodes drain, go down and come back, and the broker "crashes": its live slices
go through the SQLite store's rows and the next pass runs on what was read
back. After every pass it checks:

- **safety**: no GPU is held (or promised) twice; grants are on ready nodes of
  the right type; no protected slice is preempted; caps are never exceeded;
  a node is reported drained only once empty;
- **the contract**: every preemption's deadline is ``now + grace``; each
  preemption reason names a victim that reason may take (drain: on a draining
  node; unallocated: a free slice; priority: the same project's lower-ranked
  work; debug lane: a batch slice, for a debug session); grace periods,
  ``max_runtime`` and leases end no later than the first pass at or after them;
  work lent reserved GPUs is gone or preemptible by the reservation's due time;
- **liveness**: the slice the pass ranks first (past any over its cap), if it
  fits the free GPUs, is granted in that pass (or promised GPUs);
- **determinism** and **accounting**: a restart from the store's rows decides
  as the process before it would have; charges equal the weighted time each
  slice held its GPUs.

None of these depends on which fair-share victim the pass picks, only on what
any victim rule must respect. ``hypothesis.event`` counts what the examples
reach (run with ``--hypothesis-show-statistics``); docs/testing.md gives the
figures. ``SLICEBROKER_PROPERTY_PROFILE=thorough`` runs ten times as many examples.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, delete, select
from sqlalchemy.orm import Session

from broker.core.accounting import LedgerEntry, usage_by_project
from broker.core.fairshare import ProjectTree
from broker.core.model import (
    Account,
    Contract,
    Decisions,
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
from broker.core.scheduler import schedule
from broker.core.transitions import apply, end_slice
from broker.errors import InvalidRequest
from broker.orm import NOT_DURABLE_OPTION, SliceEventRow, SliceRow, make_engine, migrate
from broker.store import LIVE_STATES, _to_slice, _write_state
from broker.validation import validate_slice_request

WEIGHTS = {"h100": 1.0, "b200": 2.0}

settings.register_profile(
    "properties",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
settings.register_profile(
    "properties-thorough", settings.get_profile("properties"), max_examples=5000
)
PROFILE = (
    "properties-thorough"
    if os.environ.get("SLICEBROKER_PROPERTY_PROFILE") == "thorough"
    else "properties"
)


# ---- what an example is made of ---------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    nodes: list[Node]
    accounts: list[Account]
    projects: tuple[str, ...]
    base_usage: dict[str, float]  # weighted GPU-seconds already in the window


def one_of_these(*values: object) -> st.SearchStrategy:
    """A choice among ``values``; a value given twice is drawn twice as often."""
    return st.sampled_from(values)


# Built once: a strategy built anew for every draw costs more than the draw.
GPU_TYPE = one_of_these(*sorted(WEIGHTS))
NODE_SIZE = one_of_these(2, 4, 4, 8)
SHARE = one_of_these(0.5, 1.0, 3.0)
START_USAGE = one_of_these(0.0, 0.0, 3600.0, 36_000.0, 360_000.0)  # weighted GPU-seconds
PICK = st.integers(0, 63)  # which project, slice or node, modulo their number
KIND = one_of_these(SliceKind.INTERACTIVE, SliceKind.BATCH, SliceKind.BATCH)
# Mostly protected contracts: protection is what makes preemption and reservations hard.
MIN_RUNTIME = one_of_these(0.0, 60.0, 300.0, 900.0, 900.0, 3600.0)
MAX_RUNTIME = one_of_these(None, None, 120.0, 600.0, 7200.0)
USER = one_of_these("u1", "u2", "u3")
GPUS = one_of_these(1, 1, 2, 2, 3, 4, 8, 12)
ANY_TYPE = one_of_these(None, None, "h100", "b200")
PRIORITY = one_of_these(-100, -1, 0, 0, 0, 1, 100)
STEP_ARGUMENTS = {
    "advance": one_of_these(1.0, 10.0, 60.0, 600.0, 3600.0),
    "to_deadline": one_of_these(60.0, 600.0),  # how far to go when nothing falls due
}
# Submitting and moving time (often exactly to the next deadline) make contention.
STEP = one_of_these(
    *["submit"] * 6,
    *["advance"] * 2,
    *["to_deadline"] * 3,
    *["release", "heartbeat", "checkpoint", "drain", "down", "restore", "crash"],
)


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    # Few, small nodes: requests of up to 12 GPUs contend, and some need a gang.
    nodes = [Node(f"n{i}", draw(GPU_TYPE), draw(NODE_SIZE)) for i in range(draw(st.integers(1, 4)))]
    # a random tree: every account's parent is an earlier account or the root
    accounts: list[Account] = []
    for i in range(draw(st.integers(2, 6))):
        # Half the accounts at the top: more projects, so fair share has work to do.
        parent = draw(st.integers(-1, i - 1)) if draw(st.booleans()) else -1
        accounts.append(Account(f"a{i}", draw(SHARE), f"a{parent}" if parent >= 0 else None))
    projects = ProjectTree(accounts).projects
    return Cluster(nodes, accounts, projects, {p: draw(START_USAGE) for p in projects})


def draw_policy(draw: st.DrawFn, projects: tuple[str, ...]) -> Policy:
    caps = {p: draw(st.integers(1, 12)) for p in projects if draw(st.integers(0, 2)) == 0}
    return Policy(
        grace_period=draw(one_of_these(0.0, 30.0, 120.0)),
        debug_headroom=draw(one_of_these(0, 0, 0, 1, 2)),
        debug_lane_fraction=draw(one_of_these(0.05, 0.25)),
        max_reservations=draw(one_of_these(1, 8)),
        project_gpu_caps=caps,
    )


def draw_request(draw: st.DrawFn, projects: tuple[str, ...]) -> dict:
    min_runtime, max_runtime = draw(MIN_RUNTIME), draw(MAX_RUNTIME)
    if max_runtime is not None and max_runtime < min_runtime:
        max_runtime = None
    return dict(
        project=projects[draw(PICK) % len(projects)],
        user=draw(USER),
        gpus=draw(GPUS),
        kind=draw(KIND),
        contract=Contract(min_runtime, draw(st.booleans()), max_runtime),
        gpu_type=draw(ANY_TYPE),
        priority=draw(PRIORITY),
    )


@dataclass(frozen=True)
class Scenario:
    cluster: Cluster
    policy: Policy
    lease: float | None  # seconds a heartbeat (or a grant) keeps a slice; None: no leases
    steps: list[tuple[str, object]]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """A cluster, its policy, and a script of steps, drawn in one go."""
    cluster = draw(clusters())
    policy = draw_policy(draw, cluster.projects)
    lease = draw(one_of_these(None, None, 120.0, 600.0))
    steps: list[tuple[str, object]] = []
    if draw(st.booleans()):
        # Contention by construction: one project fills the cluster with batch work
        # protected for a minute, which has run out when the random script starts.
        hog = cluster.projects[draw(PICK) % len(cluster.projects)]
        for _ in range(draw(st.integers(2, 5))):
            request = draw_request(draw, cluster.projects)
            contract = replace(request["contract"], min_runtime=60.0, max_runtime=None)
            # Often top priority: then the project's own debug sessions may take its GPUs
            # only through the debug lane.
            priority = draw(one_of_these(0, 100, 100))
            request.update(project=hog, kind=SliceKind.BATCH, contract=contract, priority=priority)
            steps.append(("submit", request))
        steps += [("advance", 61.0)]
    for _ in range(draw(st.integers(8, 25))):
        name = draw(STEP)
        if name == "submit":
            steps.append((name, draw_request(draw, cluster.projects)))
        else:
            steps.append((name, draw(STEP_ARGUMENTS.get(name, PICK))))
    return Scenario(cluster, policy, lease, steps)


# ---- the store: a crash keeps what its rows keep ----------------------------------------


@dataclass(frozen=True)
class Store:
    """One SQLite database, written by one engine and read back by another, as a
    restarted process would: the reader shares nothing with the writer but the file."""

    writer: Engine
    reader: Engine


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """One migrated database for the module: each crash rewrites its slice rows."""
    url = f"sqlite:///{tmp_path_factory.mktemp('props') / 'broker.sqlite'}"
    writer = make_engine(url)
    migrate(writer)
    reader = make_engine(url)
    # A process crash, not a power cut: the commit need not wait for the disk (the
    # store's own choice for writes a power cut may lose), which keeps a crash cheap.
    yield Store(writer.execution_options(**{NOT_DURABLE_OPTION: True}), reader)
    writer.dispose()
    reader.dispose()


def through_the_store(store: Store, live: dict[int, Slice]) -> dict[int, Slice]:
    """Commit ``live`` as the store's rows; what another process reads back of them."""
    with Session(store.writer) as session, session.begin():
        session.execute(delete(SliceEventRow))
        session.execute(delete(SliceRow))
        for slice_ in live.values():
            row = SliceRow(
                id=slice_.id,
                project=slice_.project,
                user=slice_.user,
                gpus=slice_.gpus,
                gpu_type=slice_.gpu_type,
                kind=slice_.kind.value,
                min_runtime=slice_.contract.min_runtime,
                resumable=slice_.contract.resumable,
                max_runtime=slice_.contract.max_runtime,
                priority=slice_.priority,
                submitted_at=slice_.submitted_at,
                charged_gpu_seconds=0.0,
            )
            _write_state(row, slice_)
            session.add(row)
    with Session(store.reader) as session:
        rows = session.scalars(
            select(SliceRow).where(SliceRow.state.in_(LIVE_STATES)).order_by(SliceRow.id)
        )
        return {row.id: _to_slice(row) for row in rows}


# ---- one example's world ---------------------------------------------------------------


@dataclass
class World:
    """The cluster as plain values, moved by steps; :meth:`run_pass` checks every pass."""

    cluster: Cluster
    policy: Policy
    lease: float | None
    store: Store
    now: float = 1_000_000.0
    nodes: dict[str, Node] = field(default_factory=dict)
    live: dict[int, Slice] = field(default_factory=dict)
    ledger: list[LedgerEntry] = field(default_factory=list)
    held_seconds: dict[int, float] = field(default_factory=dict)  # independent record
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.nodes = {n.name: n for n in self.cluster.nodes}
        self.tree = ProjectTree(self.cluster.accounts)

    # -- steps

    def submit(self, request: dict) -> None:
        """Queue ``request`` if the broker's own validation accepts it, as the API does."""
        contract = request["contract"]
        try:
            validate_slice_request(
                gpus=request["gpus"],
                kind=request["kind"],
                min_runtime=contract.min_runtime,
                max_runtime=contract.max_runtime,
                gpu_type=request["gpu_type"],
                priority=request["priority"],
                project=request["project"],
                tree=self.tree,
                nodes=self.cluster.nodes,
                policy=self.policy,
                known_gpu_types=WEIGHTS,
            )
        except InvalidRequest:
            event("request refused by validation")
            return
        slice_id = next(self.ids)
        self.live[slice_id] = Slice(id=slice_id, submitted_at=self.now, **request)

    def advance(self, seconds: float) -> None:
        for s in self.live.values():
            if s.holds_gpus and s.allocated:
                rate = sum(
                    len(p.gpu_indices) * WEIGHTS[self.nodes[p.node].gpu_type] for p in s.placements
                )
                self.held_seconds[s.id] = self.held_seconds.get(s.id, 0.0) + rate * seconds
        self.now += seconds

    def next_deadline(self) -> float | None:
        """The earliest future time at which a contract term falls due."""
        times = []
        for s in self.live.values():
            ends = (s.protected_until, s.ends_at(), s.lease_expires_at)
            times += [t for t in ends if t is not None and t > self.now]
        return min(times, default=None)

    def release(self, slice_id: int) -> None:
        slice_ = self.live.pop(slice_id)
        entry = end_slice(slice_, self.now, self.node_types(), WEIGHTS)
        if entry is not None:
            self.ledger.append(entry)

    def heartbeat(self, slice_id: int) -> None:
        if self.lease is not None:
            self.live[slice_id] = replace(
                self.live[slice_id], lease_expires_at=self.now + self.lease
            )

    def checkpoint(self, slice_id: int) -> None:
        """The holder saved its work: victims are chosen by the work since (§5.3)."""
        if self.live[slice_id].state in (SliceState.GRANTED, SliceState.PREEMPTING):
            self.live[slice_id] = replace(self.live[slice_id], checkpointed_at=self.now)

    def set_node(self, name: str, state: NodeState) -> None:
        self.nodes[name] = replace(self.nodes[name], state=state)

    def crash(self) -> None:
        """The broker restarts: the next pass sees only what the store's rows kept, and
        decides as the process that wrote them would have."""
        before = self.snapshot()
        rebuilt = through_the_store(self.store, self.live)
        assert rebuilt == self.live, "the store keeps every field a pass reads"
        self.live = rebuilt
        assert schedule(self.snapshot()) == schedule(before, self.tree), (
            "same state, same decisions"
        )

    def node_types(self) -> dict[str, str]:
        return {n: v.gpu_type for n, v in self.nodes.items()}

    # -- the pass and its checks

    def snapshot(self) -> Snapshot:
        running = [
            (e.project, e.start, e.rate)
            for s in self.live.values()
            if (e := end_slice(s, self.now, self.node_types(), WEIGHTS)) is not None
        ]
        usage = usage_by_project(self.ledger, running, self.now, self.policy.window)
        for project, amount in self.cluster.base_usage.items():
            usage[project] = usage.get(project, 0.0) + amount
        return Snapshot(
            now=self.now,
            nodes=tuple(self.nodes.values()),
            accounts=tuple(self.cluster.accounts),
            slices=tuple(self.live.values()),
            usage=usage,
            gpu_type_weights=WEIGHTS,
            policy=self.policy,
        )

    def run_pass(self) -> None:
        snap = self.snapshot()
        decisions = schedule(snap, self.tree)
        check_endings(snap, decisions)
        check_preemptions(snap, decisions)
        check_grants(snap, decisions)
        check_borrowers(snap, decisions)
        check_liveness(snap, decisions)
        check_no_gpu_idle_while_work_fits(snap, decisions)
        count_reach(snap, decisions)
        applied = apply(self.live, self.nodes, decisions, self.now, WEIGHTS)
        self.ledger.extend(applied.charges)
        granted = {g.slice_id for g in decisions.grants}
        self.live = {
            i: replace(s, lease_expires_at=self.now + self.lease)
            if i in granted and self.lease is not None
            else s
            for i, s in applied.slices.items()
        }
        self.nodes = applied.nodes
        check_after(self.now, self.live, self.nodes, self.policy)

    def close_and_compare_charges(self) -> None:
        """Close everything still held; each slice's charges equal the time it held GPUs."""
        for slice_id in list(self.live):
            self.release(slice_id)
        charged: dict[int, float] = {}
        for entry in self.ledger:
            charged[entry.slice_id] = charged.get(entry.slice_id, 0.0) + entry.weighted_gpu_seconds
        for slice_id in set(charged) | set(self.held_seconds):
            assert abs(charged.get(slice_id, 0.0) - self.held_seconds.get(slice_id, 0.0)) < 1e-6


@settings(settings.get_profile(PROFILE))
@given(scenario=scenarios())
def test_the_contract_holds_after_every_pass(scenario: Scenario, store: Store) -> None:
    world = World(scenario.cluster, scenario.policy, scenario.lease, store)
    node_names = sorted(world.nodes)
    for step, arg in scenario.steps:
        if step == "submit":
            world.submit(arg)
        elif step == "advance":
            world.advance(arg)
        elif step == "to_deadline":
            due = world.next_deadline()
            world.advance(arg if due is None else due - world.now)
        elif step in ("release", "heartbeat", "checkpoint") and world.live:
            slice_id = sorted(world.live)[arg % len(world.live)]
            if step == "release":
                world.release(slice_id)
            elif step == "heartbeat":
                world.heartbeat(slice_id)
            else:
                world.checkpoint(slice_id)
        elif step in ("drain", "down", "restore"):
            name = node_names[arg % len(node_names)]
            state = {"drain": NodeState.DRAINING, "down": NodeState.DOWN}.get(step, NodeState.READY)
            if (world.nodes[name].state is NodeState.READY) != (state is NodeState.READY):
                world.set_node(name, state)
        elif step == "crash":
            event("crash through the store")
            world.crash()
        world.run_pass()
    world.close_and_compare_charges()


# ---- checks ---------------------------------------------------------------------------


def check_endings(snap: Snapshot, decisions: Decisions) -> None:
    """Every term that fell due by ``now`` (grace, ``max_runtime``, lease) ends the slice."""
    ended = {e.slice_id for e in decisions.endings}
    for slice_ in snap.slices:
        ends = slice_.ends_at() if slice_.holds_gpus else None
        if ends is not None and ends <= snap.now:
            assert slice_.id in ended, f"slice {slice_.id} outlived its end at {ends}"
        lease = slice_.lease_expires_at
        if lease is not None and lease <= snap.now:
            assert slice_.id in ended, f"slice {slice_.id} outlived its lease at {lease}"


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


def test_unallocated_slices_are_never_charged() -> None:
    nodes = {"n0": Node("n0", "h100", 8)}
    free = Slice(1, "a", "u", 8, SliceKind.BATCH, Contract(0.0))
    snap = Snapshot(0.0, tuple(nodes.values()), (Account("a"),), (free,))
    applied = apply({1: free}, nodes, schedule(snap), 0.0, {})
    granted = applied.slices[1]
    assert granted.state is SliceState.GRANTED
    assert end_slice(granted, 3600.0, {"n0": "h100"}, {}) is None
