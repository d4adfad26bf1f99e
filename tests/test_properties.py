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
  ``max_runtime`` end no later than the first pass at or after them, and leases
  too, as many a minute as the lease lapse limit allows, longest lapsed first,
  none over time the broker answered heartbeats late (a ``behind`` step);
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
from passchecks import check_after, check_pass
from sqlalchemy import Engine, delete, select
from sqlalchemy.orm import Session

from broker.core.accounting import LedgerEntry, usage_by_project
from broker.core.fairshare import ProjectTree
from broker.core.model import (
    Account,
    Contract,
    EndReason,
    Node,
    NodeState,
    Policy,
    Slice,
    SliceKind,
    SliceState,
    Snapshot,
)
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
    "behind": one_of_these(10.0, 60.0, 300.0),  # time passes, heartbeats answered late
}
# Submitting and moving time (often exactly to the next deadline) make contention.
STEP = one_of_these(
    *["submit"] * 6,
    *["advance"] * 2,
    *["to_deadline"] * 3,
    *["release", "heartbeat", "checkpoint", "drain", "down", "restore", "crash", "behind"],
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
        fair_share_margin=draw(one_of_these(0.0, 0.0, 0.5)),
        lease_lapse_floor=draw(one_of_these(10, 1, 2)),
        lease_lapse_fraction=draw(one_of_these(0.05, 0.0, 0.5)),
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
    promise_holders: set[int] = field(default_factory=set)  # as the last apply told
    lapses: list[tuple[float, int]] = field(default_factory=list)  # (when, how many) lost
    late: list[tuple[float, float]] = field(default_factory=list)  # answered late, in order

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

    def behind(self, seconds: float) -> None:
        """``seconds`` pass while the broker answers heartbeats late."""
        self.late.append((self.now, self.now + seconds))
        self.advance(seconds)

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
            lapsed_last_minute=sum(n for at, n in self.lapses if at > self.now - 60),
            answered_late=tuple(self.late),
            lease=self.lease or 0.0,
        )

    def run_pass(self) -> None:
        snap = self.snapshot()
        decisions = schedule(snap, self.tree)
        check_pass(snap, decisions)
        lost = sum(1 for e in decisions.endings if e.reason is EndReason.LOST)
        self.lapses.append((self.now, lost))
        applied = apply(self.live, self.nodes, decisions, self.now, WEIGHTS)
        told = apply(self.live, self.nodes, decisions, self.now, WEIGHTS, self.promise_holders)
        assert told == applied, "the holders of promises an apply tells are all of them"
        live, nodes = dict(self.live), dict(self.nodes)
        changed = apply(live, nodes, decisions, self.now, WEIGHTS, in_place=True)
        assert changed == applied, "an apply in place decides as one on copies"
        assert changed.slices is live and changed.nodes is nodes
        self.promise_holders = applied.promise_holders
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
        elif step == "behind":
            world.behind(arg)
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


def test_unallocated_slices_are_never_charged() -> None:
    nodes = {"n0": Node("n0", "h100", 8)}
    free = Slice(1, "a", "u", 8, SliceKind.BATCH, Contract(0.0))
    snap = Snapshot(0.0, tuple(nodes.values()), (Account("a"),), (free,))
    applied = apply({1: free}, nodes, schedule(snap), 0.0, {})
    granted = applied.slices[1]
    assert granted.state is SliceState.GRANTED
    assert end_slice(granted, 3600.0, {"n0": "h100"}, {}) is None
