"""Workloads for the simulator: what users ask for, on which cluster, and what breaks.

A :class:`Workload` is plain data — jobs, nodes, a project tree and node
events — so that every policy runs on exactly the same input. Four sources:

- :func:`load_helios`: the Helios trace (pass ``--trace PATH``),
  whose users are mapped to a synthetic project tree and whose short small
  jobs are marked as debug sessions (rules in :func:`classify`);
- :func:`load_alibaba`: Alibaba's GPU pods (the openb pod and node lists), on a
  sample of the trace's own nodes;
- :func:`load_csv`: the generic CSV format of ``docs/simulator.md``;
- :func:`generate`: the conditions of design.md §1 (about 150 users, demand above
  capacity, debug sessions with short contracts, squatters, a node that breaks).

Every random choice draws from a ``random.Random`` seeded for one purpose
(:func:`rng`), so that changing, say, the failure model leaves arrivals alone.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core.fairshare import ProjectTree
from ..core.model import HOUR, Account, Node, NodeState, Policy, SliceKind
from ..errors import InvalidConfig

MIN = 60.0
DAY = 24 * HOUR
DEFAULT_LOAD = 2.5  # demand 2-3x capacity (design.md §1)

# Protected periods users pick from (design.md §7: 15 min debug, 1 h, 2 h, 4 h, 8 h).
CONTRACT_CHOICES = (15 * MIN, HOUR, 2 * HOUR, 4 * HOUR, 8 * HOUR)


def rng(seed: int, purpose: str) -> random.Random:
    """The random source for one purpose (arrivals, runtimes, failures...)."""
    return random.Random(f"{seed}:{purpose}")


@dataclass(frozen=True, slots=True)
class Job:
    """One request as its user makes it; the engine turns it into a slice.

    ``duration`` is the seconds of work it needs (for an idle session: how
    long its owner keeps it). ``idle`` marks a squatter: it holds its GPUs
    without using them. The contract fields apply to policies that read
    contracts; baselines ignore them.
    """

    id: int
    submit: float
    user: str
    project: str
    gpus: int
    duration: float
    kind: SliceKind = SliceKind.BATCH
    min_runtime: float = HOUR
    resumable: bool = False
    max_runtime: float | None = None
    priority: int = 0
    idle: bool = False
    gpu_type: str | None = None


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """``node`` goes ``down`` or starts ``draining`` at ``at``; ``repair`` seconds
    after it is down (or drained) it is ``ready`` again."""

    at: float
    node: str
    state: NodeState
    repair: float = 4 * HOUR


@dataclass(frozen=True)
class Workload:
    name: str
    jobs: tuple[Job, ...]  # sorted by submit time
    nodes: tuple[Node, ...]
    accounts: tuple[Account, ...]
    node_events: tuple[NodeEvent, ...] = ()
    gpu_type_weights: Mapping[str, float] = field(default_factory=dict)
    until: float | None = None  # end of the measured period; default: last submission
    notes: tuple[str, ...] = ()  # how the workload was built, for the report

    @property
    def end(self) -> float:
        if self.until is not None:
            return self.until
        return self.jobs[-1].submit if self.jobs else 0.0

    @property
    def capacity(self) -> int:
        return sum(n.gpu_count for n in self.nodes)

    def offered_load(self) -> float:
        """GPU-time requested over GPU-time the cluster has in the measured period."""
        span = max(self.end, 1.0)
        asked = sum(j.gpus * j.duration for j in self.jobs)
        return asked / (self.capacity * span) if self.capacity else math.inf


# ---- how a trace row becomes a job ---------------------------------------------


DEFAULT_POLICY = Policy()


def classify(
    gpus: int, duration: float, policy: Policy = DEFAULT_POLICY
) -> tuple[SliceKind, float, bool]:
    """``(kind, min_runtime, resumable)`` for a job the trace says nothing about.

    1. a small short job — at most ``policy.debug_max_gpus`` GPUs and at most
       ``policy.debug_max_min_runtime`` (15 min) of runtime — is a debug
       session: interactive, a 15-minute contract, not resumable;
    2. a job of at most an hour is a non-resumable batch job whose contract
       covers its whole run (rounded up to 15 min, 1 h);
    3. a longer job is resumable training that checkpoints: a 1-hour contract.
    """
    if gpus <= policy.debug_max_gpus and duration <= policy.debug_max_min_runtime:
        return SliceKind.INTERACTIVE, policy.debug_max_min_runtime, False
    if duration <= HOUR:
        return SliceKind.BATCH, _round_up_contract(duration), False
    return SliceKind.BATCH, HOUR, True


def _round_up_contract(seconds: float) -> float:
    for choice in CONTRACT_CHOICES:
        if seconds <= choice:
            return choice
    return CONTRACT_CHOICES[-1]


def project_tree(projects: int = 12, programs: int = 3) -> tuple[Account, ...]:
    """A synthetic organisation → program → project tree with unequal shares.

    Program ``gI`` has share ``programs - I`` (3, 2, 1 for three programs);
    project ``pNN`` sits under program ``NN % programs`` with share
    ``1 + NN % 3``, so entitlements range over about an order of magnitude.
    """
    accounts = [Account(f"g{i}", float(programs - i)) for i in range(programs)]
    for n in range(projects):
        accounts.append(Account(f"p{n:02d}", float(1 + n % 3), f"g{n % programs}"))
    return tuple(accounts)


def assign_projects(users: Iterable[str], projects: Sequence[str]) -> dict[str, str]:
    """Users in order of first appearance, dealt round-robin to ``projects``."""
    mapping: dict[str, str] = {}
    for user in users:
        if user not in mapping:
            mapping[user] = projects[len(mapping) % len(projects)]
    return mapping


def nodes_for_load(
    jobs: Sequence[Job], span: float, load: float, gpus_per_node: int = 8, gpu_type: str = "h100"
) -> tuple[Node, ...]:
    """Enough ``gpus_per_node`` nodes that the jobs ask ``load`` times the GPU-time
    the cluster has over ``span`` seconds — never fewer than the largest job needs."""
    asked = sum(j.gpus * j.duration for j in jobs)
    count = max(1, round(asked / (span * load * gpus_per_node)))
    largest = max((j.gpus for j in jobs), default=1)
    count = max(count, math.ceil(largest / gpus_per_node))
    return make_nodes(count, gpus_per_node, gpu_type)


def make_nodes(count: int, gpus_per_node: int = 8, gpu_type: str = "h100") -> tuple[Node, ...]:
    return tuple(Node(f"n{i:04d}", gpu_type, gpus_per_node) for i in range(count))


def failure_events(
    nodes: Sequence[Node],
    span: float,
    seed: int,
    *,
    drains_per_day: float = 1.0,
    breaks: int = 1,
    repair: float = 4 * HOUR,
    down_repair: float = 12 * HOUR,
) -> tuple[NodeEvent, ...]:
    """Health-check drains (a Poisson stream, ``drains_per_day`` over the
    cluster) and ``breaks`` nodes that go down at once, at seeded times."""
    if not nodes or span <= 0:
        return ()
    r = rng(seed, "failures")
    events: list[NodeEvent] = []
    t = 0.0
    while drains_per_day > 0:
        t += r.expovariate(drains_per_day / DAY)
        if t >= span:
            break
        events.append(NodeEvent(t, r.choice(nodes).name, NodeState.DRAINING, repair))
    for _ in range(breaks):
        at = r.uniform(0.1 * span, 0.5 * span)
        events.append(NodeEvent(at, r.choice(nodes).name, NodeState.DOWN, down_repair))
    events.sort(key=lambda e: (e.at, e.node))
    return tuple(events)


# ---- the Helios trace ----------------------------------------------------------------


def load_helios(
    path: str | Path,
    *,
    nodes: int | None = None,
    load: float = DEFAULT_LOAD,
    gpus_per_node: int = 8,
    projects: int = 12,
    seed: int = 1,
    failures: bool = True,
    limit: int | None = None,
) -> Workload:
    """The Helios trace (SC'21) as a workload.

    Submit time is the cumulative ``interval``; ``run_time`` is the work;
    CPU-only jobs (``gpu_num = 0``) are left out. Users are dealt round-robin
    to the projects of :func:`project_tree`; jobs are classified by
    :func:`classify` (all at priority 0: the trace has none). The cluster is
    ``nodes`` nodes, or sized so that the trace asks ``load`` times its GPU-time.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Helios trace not found at {path}")
    rows: list[tuple[float, str, int, float]] = []
    submit = 0.0
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            submit += float(row["interval"])
            gpus = int(row["gpu_num"])
            if gpus <= 0:
                continue
            rows.append((submit, row["user"], gpus, max(1.0, float(row["run_time"]))))
            if limit is not None and len(rows) >= limit:
                break
    accounts = project_tree(projects)
    leaves = ProjectTree(accounts).projects
    mapping = assign_projects((user for _, user, _, _ in rows), leaves)
    jobs = []
    for i, (at, user, gpus, duration) in enumerate(rows):
        kind, min_runtime, resumable = classify(gpus, duration)
        jobs.append(
            Job(i, at, f"u{user}", mapping[user], gpus, duration, kind, min_runtime, resumable)
        )
    span = jobs[-1].submit if jobs else 0.0
    cluster = make_nodes(nodes, gpus_per_node) if nodes else nodes_for_load(jobs, span, load)
    events = failure_events(cluster, span, seed) if failures else ()
    return Workload(
        name="helios",
        jobs=tuple(jobs),
        nodes=cluster,
        accounts=accounts,
        node_events=events,
        until=span,
        notes=(
            f"{len(jobs)} GPU jobs of the Helios trace over {span / DAY:.1f} days",
            f"{len(mapping)} users dealt round-robin to {len(leaves)} projects",
            "debug = at most 2 GPUs and at most 15 min of runtime",
        ),
    )


# ---- the Alibaba GPU trace (openb) -----------------------------------------------

#: Days the Alibaba trace's 149 days of arrivals are pressed into (see load_alibaba).
ALIBABA_DAYS = 14.0


def load_alibaba(
    path: str | Path,
    *,
    days: float = ALIBABA_DAYS,
    load: float = DEFAULT_LOAD,
    nodes: int | None = None,
    gpus_per_node: int = 8,
    projects: int = 12,
    seed: int = 1,
    failures: bool = True,
    limit: int | None = None,
) -> Workload:
    """Alibaba's ``cluster-trace-gpu-v2023`` (the "openb" pods) as a workload.

    - Pods that asked for GPUs and were scheduled; a share of a GPU
      (``gpu_milli`` under 1000) asks for one whole GPU, as the broker grants
      whole GPUs. Work is ``deletion_time - scheduled_time``.
    - The trace's creation times are no arrival process: a few long-running
      services made months before, then 99.7% of the pods in its last 40 of
      149 days, at about 17 GPUs busy on average of its 6,212. The pods keep
      their order and their lengths; they arrive over ``days`` days at the
      generator's rate, with its daily cycle and quieter weekends (seeded).
    - Pods name no user. A deployment's replicas are made together with one
      spec, so a run of consecutive pods with the same CPU, memory, GPUs, GPU
      share and QoS is one user; users are dealt round-robin to the projects.
    - BE (best-effort) pods are free work (no protected period, resumable);
      the rest are classified as Helios jobs are (:func:`classify`).
    - The cluster is drawn from the trace's own node list (the file beside the
      pods, ``*_nodes.csv``): its mix of 1-, 2-, 4- and 8-GPU nodes and GPU
      models, shuffled with ``seed``, until it has the GPUs for ``load``;
      ``nodes`` gives that many nodes of ``gpus_per_node`` instead.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Alibaba pod list not found at {path}")
    rows: list[tuple[float, tuple, str, int, float]] = []
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            gpus = int(row["num_gpu"] or 0)
            if gpus <= 0 or not row["scheduled_time"] or not row["deletion_time"]:
                continue
            spec = (row["cpu_milli"], row["memory_mib"], gpus, row["gpu_milli"], row["qos"])
            work = float(row["deletion_time"]) - float(row["scheduled_time"])
            rows.append((float(row["creation_time"]), spec, row["qos"], gpus, max(1.0, work)))
    rows.sort(key=lambda r: r[0])  # in creation order: a deployment's pods side by side
    if limit is not None:
        rows = rows[:limit]
    arrivals = _arrival_times(rng(seed, "alibaba-arrivals"), len(rows), days * DAY)
    accounts = project_tree(projects)
    leaves = ProjectTree(accounts).projects
    users: list[str] = []
    for i, (_, spec, *_rest) in enumerate(rows):
        same = i > 0 and rows[i - 1][1] == spec
        users.append(users[-1] if same else f"d{len(set(users))}")
    mapping = assign_projects(users, leaves)
    jobs = []
    for i, ((_, _, qos, gpus, work), user, at) in enumerate(
        zip(rows, users, arrivals, strict=True)
    ):
        if qos == "BE":
            kind, min_runtime, resumable = SliceKind.BATCH, 0.0, True
        else:
            kind, min_runtime, resumable = classify(gpus, work)
        jobs.append(Job(i, at, user, mapping[user], gpus, work, kind, min_runtime, resumable))
    span = jobs[-1].submit if jobs else 0.0
    if nodes:
        cluster = make_nodes(nodes, gpus_per_node)
    else:
        cluster = _alibaba_nodes(path, jobs, span, load, seed)
    return Workload(
        name="alibaba",
        jobs=tuple(jobs),
        nodes=cluster,
        accounts=accounts,
        node_events=failure_events(cluster, span, seed) if failures else (),
        until=span,
        notes=(
            f"{len(jobs)} GPU pods of the Alibaba openb trace in their order, arriving "
            f"over {span / DAY:.1f} days",
            f"{len(mapping)} deployments (runs of one spec) dealt round-robin to "
            f"{len(leaves)} projects",
            "a GPU share asks for a whole GPU; best-effort pods are free work",
        ),
    )


def _alibaba_nodes(
    pods: Path, jobs: Sequence[Job], span: float, load: float, seed: int
) -> tuple[Node, ...]:
    """Nodes drawn from the trace's node list beside ``pods`` (its mix of sizes and
    models), until the jobs ask ``load`` times the cluster's GPU-time; 8-GPU nodes of
    one type where the list is missing. Always room for the largest job."""
    listing = pods.with_name(pods.name.replace("pods", "nodes"))
    if listing == pods or not listing.is_file():
        return nodes_for_load(jobs, span, load)
    with listing.open(newline="") as handle:
        kinds = [(row["model"], int(row["gpu"])) for row in csv.DictReader(handle)]
    kinds = [(model, gpus) for model, gpus in kinds if gpus > 0]
    rng(seed, "alibaba-nodes").shuffle(kinds)
    # Work past the end of the run asks nothing of this cluster (a few pods run for months).
    asked = sum(j.gpus * min(j.duration, max(span - j.submit, 0.0)) for j in jobs)
    wanted = asked / (max(span, 1.0) * load)
    largest = max((j.gpus for j in jobs), default=1)
    chosen: list[Node] = []
    total = 0
    for model, gpus in kinds:
        if total >= wanted and any(n.gpu_count >= largest for n in chosen):
            break
        chosen.append(Node(f"n{len(chosen):04d}", model.lower(), gpus))
        total += gpus
    return tuple(chosen)


# ---- the generic CSV format -------------------------------------------------------

GENERIC_COLUMNS = (
    "submit",
    "gpus",
    "duration",
    "user",
    "project",
    "kind",
    "min_runtime",
    "resumable",
    "max_runtime",
    "priority",
    "idle",
    "gpu_type",
)
_TRUE = {"1", "true", "yes", "y", "t"}
_FALSE = {"", "0", "false", "no", "n", "f"}


def _bool(text: str, where: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise InvalidConfig(f"expected true or false, got {text!r}", where)


def _number(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InvalidConfig(f"expected a number, got {text!r}", where) from None


def load_tree_csv(path: str | Path) -> tuple[Account, ...]:
    """A project tree from a CSV file with columns ``name,share,parent``."""
    accounts = []
    with Path(path).open(newline="") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            where = f"{path}:{line}"
            share = _number(row.get("share") or "1", where)
            accounts.append(Account(row["name"].strip(), share, (row.get("parent") or None)))
    ProjectTree(accounts)  # validates
    return tuple(accounts)


def load_csv(
    path: str | Path,
    *,
    tree: Sequence[Account] | None = None,
    nodes: int | None = None,
    load: float = DEFAULT_LOAD,
    gpus_per_node: int = 8,
    seed: int = 1,
    failures: bool = True,
) -> Workload:
    """A workload in the generic CSV format (see ``docs/simulator.md``).

    Required columns: ``submit`` (seconds from the start), ``gpus``,
    ``duration`` (seconds of work). Optional, with their defaults:
    ``user`` (``u0``), ``project`` (users dealt round-robin to the tree's
    projects), ``kind``, ``min_runtime`` and ``resumable`` (:func:`classify`),
    ``max_runtime`` (none), ``priority`` (0), ``idle`` (false), ``gpu_type`` (any).
    """
    accounts = tuple(tree) if tree is not None else project_tree()
    leaves = ProjectTree(accounts).projects
    raw = []
    with Path(path).open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"submit", "gpus", "duration"} - set(reader.fieldnames or ())
        if missing:
            raise InvalidConfig(f"missing column(s) {', '.join(sorted(missing))}", str(path))
        for line, row in enumerate(reader, start=2):
            raw.append((line, row))
    users = [(row.get("user") or "u0").strip() for _, row in raw]
    mapping = assign_projects(
        (u for u, (_, r) in zip(users, raw, strict=True) if not r.get("project")), leaves
    )
    jobs = []
    for i, ((line, row), user) in enumerate(zip(raw, users, strict=True)):
        where = f"{path}:{line}"
        gpus = int(_number(row["gpus"], where))
        duration = _number(row["duration"], where)
        if gpus < 1 or duration <= 0:
            raise InvalidConfig("gpus must be >= 1 and duration > 0", where)
        kind, min_runtime, resumable = classify(gpus, duration)
        if row.get("kind"):
            kind = SliceKind(row["kind"].strip())
        if row.get("min_runtime"):
            min_runtime = _number(row["min_runtime"], where)
        if row.get("resumable"):
            resumable = _bool(row["resumable"], where)
        project = (row.get("project") or "").strip() or mapping[user]
        if project not in leaves:
            raise InvalidConfig(f"project {project!r} is not a project of the tree", where)
        jobs.append(
            Job(
                id=i,
                submit=_number(row["submit"], where),
                user=user,
                project=project,
                gpus=gpus,
                duration=duration,
                kind=kind,
                min_runtime=min(min_runtime, Policy().max_min_runtime),
                resumable=resumable,
                max_runtime=_number(row["max_runtime"], where) if row.get("max_runtime") else None,
                priority=int(_number(row.get("priority") or "0", where)),
                idle=_bool(row.get("idle") or "", where),
                gpu_type=(row.get("gpu_type") or "").strip() or None,
            )
        )
    jobs.sort(key=lambda j: (j.submit, j.id))
    jobs = [_renumber(j, i) for i, j in enumerate(jobs)]
    span = jobs[-1].submit if jobs else 0.0
    cluster = make_nodes(nodes, gpus_per_node) if nodes else nodes_for_load(jobs, span, load)
    return Workload(
        name=Path(path).stem,
        jobs=tuple(jobs),
        nodes=cluster,
        accounts=accounts,
        node_events=failure_events(cluster, span, seed) if failures else (),
        until=span,
        notes=(f"{len(jobs)} jobs from {Path(path).name}",),
    )


def _renumber(job: Job, new_id: int) -> Job:
    return replace(job, id=new_id)


def write_csv(jobs: Iterable[Job], path: str | Path) -> None:
    """Write jobs in the generic CSV format (the inverse of :func:`load_csv`).

    Times are written at full precision (``repr``, the shortest text that reads
    back as the same float), so that a round trip changes no job."""
    with Path(path).open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(GENERIC_COLUMNS)
        for j in jobs:
            writer.writerow(
                [
                    repr(float(j.submit)),
                    j.gpus,
                    repr(float(j.duration)),
                    j.user,
                    j.project,
                    j.kind.value,
                    repr(float(j.min_runtime)),
                    str(j.resumable).lower(),
                    "" if j.max_runtime is None else repr(float(j.max_runtime)),
                    j.priority,
                    str(j.idle).lower(),
                    j.gpu_type or "",
                ]
            )


# ---- the generator (design.md §1) -----------------------------------------------------------


@dataclass(frozen=True)
class GeneratorConfig:
    """The shape of a generated workload; every duration in seconds.

    ``slices``: jobs submitted over ``days``; ``load``: GPU-time asked over the
    cluster's GPU-time (the cluster is sized from it unless ``nodes`` is set).
    Job mix (fractions of the non-squatter jobs): debug sessions
    (interactive, 1–2 GPUs, 15-min contract), notebooks (interactive, 1–4 GPUs,
    1–4 h contract), batch (1–128 GPUs, lognormal runtimes of median
    ``batch_median`` up to 7 days, of which ``unallocated`` run free with
    ``min_runtime = 0``; of the others, 80% of those longer than an hour
    checkpoint (resumable, 1–4 h contracts) and the rest are protected for
    their whole run — every job longer than the 8-hour cap checkpoints, as
    users of contracts must). ``squatters``: the
    fraction of users who keep an idle 1-GPU session parked (8 h contract,
    held 1–3 days, parked again a few hours after it ends). ``inflation``:
    the fraction of batch jobs submitted at the top priority.
    """

    days: float = 30.0
    slices: int = 20_000
    users: int = 150
    projects: int = 15
    programs: int = 3
    load: float = DEFAULT_LOAD
    nodes: int | None = None
    gpus_per_node: int = 8
    debug: float = 0.50
    notebooks: float = 0.10
    unallocated: float = 0.15
    batch_median: float = 3 * HOUR
    squatters: float = 0.10
    inflation: float = 0.8
    drains_per_day: float = 1.0
    breaks: int = 1


BATCH_SIZES = ((1, 0.35), (2, 0.10), (4, 0.15), (8, 0.25), (16, 0.08), (32, 0.045), (64, 0.02))
BATCH_SIZES += ((128, 0.005),)  # large: 16 nodes, two fifths of the default cluster
TOP_PRIORITY = 2


def _weighted(r: random.Random, pairs: Sequence[tuple[int, float]]) -> int:
    return r.choices([v for v, _ in pairs], [w for _, w in pairs])[0]


def _lognormal(r: random.Random, median: float, sigma: float, low: float, high: float) -> float:
    return min(high, max(low, median * math.exp(r.gauss(0.0, sigma))))


def _arrival_times(r: random.Random, count: int, span: float) -> list[float]:
    """``count`` times in ``[0, span)`` with a daily cycle and quieter weekends
    (thinning: uniform candidates kept in proportion to the rate)."""
    times: list[float] = []
    while len(times) < count:
        t = r.uniform(0.0, span)
        day = t / DAY
        weekday = 1.0 if int(day) % 7 < 5 else 0.5
        rate = weekday * (1.0 + 0.6 * math.sin(2 * math.pi * (day % 1.0 - 0.25)))
        if r.random() * 1.6 < rate:
            times.append(t)
    times.sort()
    return times


def generate(config: GeneratorConfig = GeneratorConfig(), seed: int = 1) -> Workload:
    """A workload with the conditions of design.md §1 (see :class:`GeneratorConfig`)."""
    span = config.days * DAY
    accounts = project_tree(config.projects, config.programs)
    leaves = ProjectTree(accounts).projects
    users = [f"user{i:03d}" for i in range(config.users)]
    pick = rng(seed, "users")
    # Heavy and light users (Zipf-like activity); a fifth also work on a second project.
    activity = [1.0 / (1 + i) ** 0.8 for i in range(config.users)]
    pick.shuffle(activity)
    home = {u: leaves[i % len(leaves)] for i, u in enumerate(users)}
    second = {u: pick.choice(leaves) for u in users if pick.random() < 0.2}
    squatters = [u for u in users if pick.random() < config.squatters]

    sizes, runtimes, kinds = rng(seed, "sizes"), rng(seed, "runtimes"), rng(seed, "kinds")
    times = _arrival_times(rng(seed, "arrivals"), config.slices, span)
    jobs: list[Job] = []
    for t in times:
        user = pick.choices(users, activity)[0]
        project = second[user] if user in second and pick.random() < 0.3 else home[user]
        mix = kinds.random()
        if mix < config.debug:
            gpus = 1 if sizes.random() < 0.7 else 2
            duration = _lognormal(runtimes, 12 * MIN, 1.0, MIN, 3 * HOUR)
            job = Job(0, t, user, project, gpus, duration, SliceKind.INTERACTIVE, 15 * MIN,
                      priority=TOP_PRIORITY)  # fmt: skip
        elif mix < config.debug + config.notebooks:
            gpus = _weighted(sizes, ((1, 0.5), (2, 0.3), (4, 0.2)))
            duration = _lognormal(runtimes, 90 * MIN, 0.8, 10 * MIN, 12 * HOUR)
            contract = kinds.choice((HOUR, 2 * HOUR, 4 * HOUR))
            job = Job(0, t, user, project, gpus, duration, SliceKind.INTERACTIVE, contract,
                      priority=TOP_PRIORITY)  # fmt: skip
        else:
            gpus = _weighted(sizes, BATCH_SIZES)
            duration = _lognormal(runtimes, config.batch_median, 1.5, MIN, 7 * DAY)
            priority = TOP_PRIORITY if kinds.random() < config.inflation else 1
            if kinds.random() < config.unallocated:
                contract, resumable = 0.0, True
            elif duration > 8 * HOUR or (duration > HOUR and kinds.random() < 0.8):
                contract, resumable = kinds.choice((HOUR, 2 * HOUR, 4 * HOUR)), True
            else:
                contract, resumable = _round_up_contract(duration), False
            job = Job(0, t, user, project, gpus, duration, SliceKind.BATCH, contract, resumable,
                      priority=priority)  # fmt: skip
        jobs.append(job)
    parked = rng(seed, "squatters")
    for user in squatters:
        t = parked.uniform(0.0, DAY)
        while t < span:
            hold = parked.uniform(1 * DAY, 3 * DAY)
            jobs.append(Job(0, t, user, home[user], 1, hold, SliceKind.INTERACTIVE, 8 * HOUR,
                            idle=True, priority=TOP_PRIORITY))  # fmt: skip
            t += hold + parked.uniform(1 * HOUR, 6 * HOUR)
    jobs.sort(key=lambda j: (j.submit, j.user))
    jobs = [_renumber(j, i) for i, j in enumerate(jobs) if j.submit < span]
    cluster = (
        make_nodes(config.nodes, config.gpus_per_node)
        if config.nodes
        else nodes_for_load(jobs, span, config.load, config.gpus_per_node)
    )
    events = failure_events(
        cluster, span, seed, drains_per_day=config.drains_per_day, breaks=config.breaks
    )
    return Workload(
        name="generated",
        jobs=tuple(jobs),
        nodes=cluster,
        accounts=accounts,
        node_events=events,
        until=span,
        notes=(
            f"{len(jobs)} jobs of {config.users} users over {config.days:g} days (seed {seed})",
            f"{len(squatters)} users park idle sessions; {len(events)} node events",
        ),
    )
