"""What a simulation measures, and the summary the report is made of.

The engine tells a :class:`Recorder` what happens (a request, a grant, GPUs
held or released, a preemption, a drain); the recorder integrates the
piecewise-constant quantities — GPUs wanted and held per project, capacity,
GPUs held by idle sessions — into hourly bins, lazily, so that each change
costs O(1) plus the hours it crosses. :func:`summarise` turns that into the
figures of the report. Definitions (also in ``docs/simulator.md``):

- *wait*: from a request (a submission, or a user starting a preempted job
  again) to its grant. Requests still waiting at the end count with the time
  they have waited so far (a lower bound), so a policy that starves a class
  cannot look good by never starting it.
- *occupancy*: GPU-time held by any slice over GPU-time of usable nodes
  (``ready`` or ``draining``).
- *owed*: per project and hour, ``min(demand, entitlement × capacity)``, where
  demand is the GPU-time its slices wanted (held or pending), summed over the
  hours. *delivered*: the GPU-time the project held, up to what it was owed
  (``min(held, owed)`` over the whole run); the stricter *hour-by-hour*
  variant caps each hour separately, so that a project served late (or in
  bursts larger than its share) does not make up for it.
- *wasted*: GPU-time held by work that came to nothing — progress lost since
  a job's last checkpoint, work run again from the start, and restarts
  (loading, warm-up) — counted in the hours it was held. *goodput*:
  GPU-time held by working (not idle) slices less what was wasted, over
  GPU-time of usable nodes: the useful part of occupancy.
- *churn*: preemptions per job (each request of a job counts for the job),
  per 1,000 GPU-hours held and over time by reason.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.model import HOUR, SliceKind
from .workloads import Job

DEBUG_MAX_GPUS = 2
DEBUG_MAX_CONTRACT = 15 * 60.0
LARGE_GANG_GPUS = 32  # a class every trace with big jobs has, whatever its cluster's size

# What wasted GPU-time was: a restart, progress since the last checkpoint, or a
# job that does not checkpoint run again from the start.
RESTART, SINCE_CHECKPOINT, RERUN = "restart", "since checkpoint", "rerun"
# A victim granted again this soon after its preemption only swapped seats with its
# requester: the preemption bought little that waiting would not (design.md §5.7).
MUSICAL_CHAIRS = HOUR

# Why: a preemption by the policy, an operator ending work on an overdue drain, or a
# failed node.
PREEMPTION, OPERATOR, FAILURE = "preemption", "operator", "failure"
CAUSES = (PREEMPTION, OPERATOR, FAILURE)

# What a preemption served (see served()): a debug session, a request no larger than
# its victim (a swap: one release of the victim's size would have served it too), a
# request larger than its victim (a shape gathered from smaller holders), or none.
DEBUG_SESSION, SWAP, GATHER, NO_REQUEST = "debug session", "swap", "gather", "no request"
NEEDS = (DEBUG_SESSION, SWAP, GATHER, NO_REQUEST)


def is_debug(job: Job) -> bool:
    """A debug session: interactive, at most 2 GPUs, a contract of at most 15 min."""
    return (
        job.kind is SliceKind.INTERACTIVE
        and not job.idle
        and job.gpus <= DEBUG_MAX_GPUS
        and 0 < job.min_runtime <= DEBUG_MAX_CONTRACT
    )


def served(requester: Job | None, victim: Job) -> str:
    """What preempting ``victim`` for ``requester`` served (one of :data:`NEEDS`)."""
    if requester is None:
        return NO_REQUEST
    if is_debug(requester):
        return DEBUG_SESSION
    return SWAP if requester.gpus <= victim.gpus else GATHER


def wait_class(job: Job, node_gpus: int = 8, cluster_gpus: int = 64) -> str:
    """The class a request's wait is reported under.

    ``debug`` (interactive, ≤ 2 GPUs, contract ≤ 15 min), ``interactive`` (other
    sessions), ``squatter`` (idle sessions), else batch by size: ``batch 1``,
    ``batch 2-8`` (within a node of 8), ``batch multi-node`` (up to a quarter of
    the cluster) and ``batch large`` (more than a quarter of the cluster's GPUs:
    what fragmentation makes wait).
    """
    if job.idle:
        return "squatter"
    if job.kind is SliceKind.INTERACTIVE:
        return "debug" if is_debug(job) else "interactive"
    if job.gpus <= 1:
        return "batch 1"
    if job.gpus <= node_gpus:
        return f"batch 2-{node_gpus}"
    if job.gpus * 4 <= cluster_gpus:
        return "batch multi-node"
    return "batch large"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0–100) by linear interpolation between ranks; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class Hourly:
    """A piecewise-constant quantity integrated into hourly bins (value × seconds)."""

    __slots__ = ("bins", "since", "value")

    def __init__(self, start: float = 0.0, value: float = 0.0):
        self.bins: list[float] = []
        self.since = start
        self.value = value

    def add(self, t: float, delta: float) -> None:
        self.flush(t)
        self.value += delta

    def flush(self, t: float) -> None:
        since, value = self.since, self.value
        if t <= since:
            return
        self.since = t
        if value == 0:
            return
        bins = self.bins
        while since < t:
            hour = int(since // HOUR)
            upto = min(t, (hour + 1) * HOUR)
            while len(bins) <= hour:
                bins.append(0.0)
            bins[hour] += value * (upto - since)
            since = upto

    def series(self, hours: int) -> list[float]:
        return self.bins[:hours] + [0.0] * max(0, hours - len(self.bins))


@dataclass
class Drain:
    node: str
    started: float
    emptied: float | None = None
    intervened: bool = False
    interrupted: bool = False  # the node went down first


@dataclass
class Recorder:
    """Everything measured during one run (see the module docstring)."""

    projects: Sequence[str]
    node_gpus: int = 8
    cluster_gpus: int = 64
    warmup: float = 0.0  # requests before this are not in the waits, hours before it not counted
    wanted: dict[str, Hourly] = field(init=False)
    held: dict[str, Hourly] = field(init=False)
    capacity: Hourly = field(default_factory=Hourly)
    idle: Hourly = field(default_factory=Hourly)
    busy: Hourly = field(default_factory=Hourly)
    pending: Hourly = field(default_factory=Hourly)
    waits: dict[str, list[float]] = field(default_factory=dict)
    censored: Counter = field(default_factory=Counter)
    preemptions: Counter = field(default_factory=Counter)
    preemptions_by_job: Counter = field(default_factory=Counter)  # job id -> times preempted
    # The policy's preemption budget (None: none), and the preemptions of jobs under
    # contract (free work has no budget): job id -> times preempted
    preemption_budget: int | None = None
    budgeted_preemptions: Counter = field(default_factory=Counter)
    # GPUs held by jobs granted past their budget (no one's victim but a drain's), and
    # the jobs among the holders counted there
    past_budget_held: Hourly = field(default_factory=Hourly)
    past_budget_holders: set[int] = field(default_factory=set)
    # Preemptions of jobs larger than a node (each ends the job on all its nodes)
    multi_node_preemptions: int = 0
    multi_node_preempted_gpus: int = 0
    preemptions_by_hour: dict[str, list[int]] = field(default_factory=dict)  # reason -> counts
    # Musical chairs: victims granted again within MUSICAL_CHAIRS of their
    # preemption, and the GPU-seconds those preemptions cost them
    musical_chairs: int = 0
    musical_chairs_gpu_seconds: float = 0.0
    musical_chairs_by_reason: Counter = field(default_factory=Counter)  # reason -> count
    # The same per what the preemption served (served()), with the requester's wait
    preemptions_by_need: Counter = field(default_factory=Counter)
    musical_chairs_by_need: Counter = field(default_factory=Counter)
    requester_waits_by_need: dict[str, list[float]] = field(default_factory=dict)
    # Fair-share preemptions per (requester's project, victim's project): a move
    # matched by one the other way only swapped the two projects' jobs
    fair_share_moves: Counter = field(default_factory=Counter)
    # Preemptions avoided: requests the pass let wait for releases instead, that
    # were then granted without preempting, and what they waited for it
    avoided_preemptions: int = 0
    avoided_wait_seconds: list[float] = field(default_factory=list)
    # waits of classes that overlap those above: debug sessions within the per-user
    # cap and beyond it, batch jobs of LARGE_GANG_GPUS or more
    group_waits: dict[str, list[float]] = field(default_factory=dict)
    group_censored: Counter = field(default_factory=Counter)
    endings: Counter = field(default_factory=Counter)
    jobs: int = 0  # jobs of the workload, for the per-job preemption distribution
    lost_gpu_seconds: float = 0.0  # progress thrown away (since checkpoint, reruns)
    wasted: Counter = field(default_factory=Counter)  # (cause, what) -> GPU-seconds
    wasted_by_hour: list[float] = field(default_factory=list)  # GPU-seconds
    completed: int = 0
    completed_gpu_seconds: float = 0.0
    resubmitted: int = 0
    requeued: int = 0
    drains: list[Drain] = field(default_factory=list)
    interventions: int = 0
    killed_by_operator: int = 0

    def __post_init__(self) -> None:
        self.wanted = {p: Hourly() for p in self.projects}
        self.held = {p: Hourly() for p in self.projects}

    # -- what the engine reports -------------------------------------------

    def want(self, t: float, project: str, gpus: int) -> None:
        self.wanted[project].add(t, gpus)

    def queue(self, t: float, gpus: int) -> None:
        self.pending.add(t, gpus)

    def hold(self, t: float, job: Job, gpus: int) -> None:
        self.held[job.project].add(t, gpus)
        (self.idle if job.idle else self.busy).add(t, gpus)
        if gpus > 0 and self.past_budget(job.id):
            self.past_budget_held.add(t, gpus)
            self.past_budget_holders.add(job.id)
        elif gpus < 0 and job.id in self.past_budget_holders:
            self.past_budget_held.add(t, gpus)
            self.past_budget_holders.discard(job.id)

    def past_budget(self, job_id: int) -> bool:
        """Whether job ``job_id`` has been preempted as often as its budget allows (free
        work has none)."""
        budget = self.preemption_budget
        return budget is not None and self.budgeted_preemptions[job_id] >= budget

    def set_capacity(self, t: float, gpus: int) -> None:
        self.capacity.add(t, gpus - self.capacity.value)

    def waited(
        self,
        job: Job,
        requested_at: float,
        seconds: float,
        started: bool = True,
        within_cap: bool | None = None,
    ) -> None:
        """A request's wait; ``within_cap``: for a debug session, whether its user's
        debug GPUs in flight, this one's included, were within the per-user cap."""
        if requested_at < self.warmup:
            return
        cls = wait_class(job, self.node_gpus, self.cluster_gpus)
        self.waits.setdefault(cls, []).append(seconds)
        if not started:
            self.censored[cls] += 1
        groups = []
        if within_cap is not None:
            groups.append("debug within cap" if within_cap else "debug beyond cap")
        if job.kind is SliceKind.BATCH and job.gpus >= LARGE_GANG_GPUS:
            groups.append(f"batch ≥ {LARGE_GANG_GPUS} GPUs")
        for group in groups:
            self.group_waits.setdefault(group, []).append(seconds)
            if not started:
                self.group_censored[group] += 1

    def preempted(
        self,
        t: float,
        job: Job,
        reason: str,
        for_job: Job | None = None,
        waited: float = 0.0,
    ) -> str:
        """``job`` preempted at ``t`` for ``reason``, for the request of ``for_job``
        (None: a drain) that had waited ``waited`` seconds; what it served
        (:func:`served`)."""
        self.preemptions[reason] += 1
        if reason == "fair_share" and for_job is not None:
            self.fair_share_moves[for_job.project, job.project] += 1
        need = served(for_job, job)
        self.preemptions_by_need[need] += 1
        if for_job is not None:
            self.requester_waits_by_need.setdefault(need, []).append(waited)
        self.preemptions_by_job[job.id] += 1
        if job.min_runtime > 0:
            self.budgeted_preemptions[job.id] += 1
        if job.gpus > self.node_gpus:
            self.multi_node_preemptions += 1
            self.multi_node_preempted_gpus += job.gpus
        _bump(self.preemptions_by_hour.setdefault(reason, []), int(t // HOUR), 1)
        return need

    def regranted(self, after: float, cost_gpu_seconds: float, reason: str, need: str) -> None:
        """A victim preempted for ``reason``, serving ``need`` (:func:`served`), granted
        again ``after`` seconds later; its preemption cost it ``cost_gpu_seconds``."""
        if after <= MUSICAL_CHAIRS:
            self.musical_chairs += 1
            self.musical_chairs_gpu_seconds += cost_gpu_seconds
            self.musical_chairs_by_reason[reason] += 1
            self.musical_chairs_by_need[need] += 1

    def avoided(self, waited: float) -> None:
        """A request that could have preempted waited ``waited`` more seconds instead."""
        self.avoided_preemptions += 1
        self.avoided_wait_seconds.append(waited)

    def waste(self, start: float, end: float, gpus: int, cause: str, what: str) -> None:
        """``gpus`` GPUs held from ``start`` to ``end`` for nothing (``what``: RESTART,
        SINCE_CHECKPOINT or RERUN), counted in the hours they were held."""
        if end <= start:
            return
        self.wasted[(cause, what)] += gpus * (end - start)
        if what != RESTART:
            self.lost_gpu_seconds += gpus * (end - start)
        while start < end:
            hour = int(start // HOUR)
            upto = min(end, (hour + 1) * HOUR)
            _bump(self.wasted_by_hour, hour, gpus * (upto - start))
            start = upto

    def flush(self, t: float) -> None:
        for series in (*self.wanted.values(), *self.held.values()):
            series.flush(t)
        for series in (self.capacity, self.idle, self.busy, self.pending, self.past_budget_held):
            series.flush(t)


def _bump(bins: list, index: int, amount: float) -> None:
    if len(bins) <= index:
        bins.extend([0] * (index + 1 - len(bins)))
    bins[index] += amount


# ---- the summary --------------------------------------------------------------------

WAIT_CLASSES = ("debug", "interactive", "batch 1", "batch 2-8", "batch multi-node", "batch large")


@dataclass(frozen=True, slots=True)
class Owed:
    """One project's owed and delivered GPU-seconds (module docstring)."""

    owed: float
    held: float
    hourly_delivered: float  # sum over hours of min(held, owed)

    @property
    def delivered(self) -> float:
        return min(self.held, self.owed)

    def fraction(self, hourly: bool = False) -> float | None:
        if self.owed <= 0:
            return None
        return (self.hourly_delivered if hourly else self.delivered) / self.owed


def owed_delivered(
    wanted: Mapping[str, Sequence[float]],
    held: Mapping[str, Sequence[float]],
    capacity: Sequence[float],
    entitlements: Mapping[str, float],
) -> dict[str, Owed]:
    """Per project, what it was owed hour by hour and what it got."""
    result = {}
    for project, share in entitlements.items():
        owed = held_total = hourly = 0.0
        for hour, cap in enumerate(capacity):
            got = held[project][hour]
            owe = min(wanted[project][hour], share * cap)
            owed += owe
            held_total += got
            hourly += min(got, owe)
        result[project] = Owed(owed, held_total, hourly)
    return result


def summarise(
    recorder: Recorder,
    *,
    end: float,
    entitlements: Mapping[str, float],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The figures of one run, JSON-able. Measured hours: from the one the
    recorder's warm-up ends in, to ``end``."""
    recorder.flush(end)
    hours = max(1, math.ceil(end / HOUR))
    first = min(hours - 1, int(recorder.warmup // HOUR))

    def measured(series: Hourly) -> list[float]:
        return series.series(hours)[first:]

    capacity = measured(recorder.capacity)
    wanted = {p: measured(recorder.wanted[p]) for p in recorder.projects}
    held = {p: measured(recorder.held[p]) for p in recorder.projects}
    total_capacity = sum(capacity)
    held_total = sum(sum(v) for v in held.values())
    wanted_total = sum(sum(v) for v in wanted.values())
    owed = owed_delivered(wanted, held, capacity, entitlements)
    owed_sum = sum(o.owed for o in owed.values())
    delivered_sum = sum(o.delivered for o in owed.values())
    hourly_sum = sum(o.hourly_delivered for o in owed.values())
    waits = {
        cls: _wait_figures(recorder.waits[cls], recorder.censored[cls])
        for cls in sorted(recorder.waits, key=_class_order)
    }
    groups = {
        group: _wait_figures(values, recorder.group_censored[group])
        for group, values in sorted(recorder.group_waits.items())
    }
    busy_total = sum(measured(recorder.busy))
    wasted_total = sum(_padded(recorder.wasted_by_hour, hours)[first:])
    useful = max(0.0, busy_total - wasted_total)
    # hours in which the projects wanted more GPU-time than the cluster had
    wanted_by_hour = [sum(v) for v in zip(*wanted.values(), strict=True)] if wanted else []
    held_by_hour = [sum(v) for v in zip(*held.values(), strict=True)] if held else []
    crowded = [
        (h, c)
        for h, c, w in zip(held_by_hour, capacity, wanted_by_hour, strict=True)
        if c > 0 and w > c
    ]
    churn = _churn(recorder, hours)
    drains = recorder.drains
    emptied = [d.emptied - d.started for d in drains if d.emptied is not None]
    per_project = {
        p: {
            "entitlement": entitlements[p],
            "owed_gpu_hours": owed[p].owed / HOUR,
            "delivered_gpu_hours": owed[p].delivered / HOUR,
            "delivered_fraction": owed[p].fraction(),
            "hourly_delivered_fraction": owed[p].fraction(hourly=True),
            "held_gpu_hours": owed[p].held / HOUR,
            "wanted_gpu_hours": sum(wanted[p]) / HOUR,
        }
        for p in recorder.projects
    }
    owed_projects = [v for v in per_project.values() if v["owed_gpu_hours"] > 1]
    fractions = [v["delivered_fraction"] for v in owed_projects]
    summary = {
        "waits": waits,
        "occupancy": held_total / total_capacity if total_capacity else 0.0,
        "busy_occupancy": busy_total / total_capacity if total_capacity else 0.0,
        "occupancy_oversubscribed": (
            sum(h for h, _ in crowded) / sum(c for _, c in crowded) if crowded else None
        ),
        "oversubscribed_hours": len(crowded),
        "measured_hours": len(capacity),
        "goodput": useful / total_capacity if total_capacity else 0.0,
        "goodput_of_occupancy": useful / held_total if held_total else None,
        "useful_gpu_hours": useful / HOUR,
        "wasted_gpu_hours": wasted_total / HOUR,
        "wait_groups": groups,
        "demand_ratio": wanted_total / total_capacity if total_capacity else 0.0,
        "owed_delivered": delivered_sum / owed_sum if owed_sum else None,
        "owed_delivered_hourly": hourly_sum / owed_sum if owed_sum else None,
        "worst_project_delivered": min(fractions) if fractions else None,
        "worst_project_delivered_hourly": min(
            (v["hourly_delivered_fraction"] for v in owed_projects), default=None
        ),
        "projects_at_95": sum(1 for f in fractions if f >= 0.95),
        "projects_owed": len(fractions),
        "squatter_idle_gpu_hours": sum(measured(recorder.idle)) / HOUR,
        "preemptions": dict(sorted(recorder.preemptions.items())),
        "preemptions_total": sum(recorder.preemptions.values()),
        "lost_gpu_hours": recorder.lost_gpu_seconds / HOUR,
        "wasted_by_cause": {  # the whole run, warm-up included
            cause: {what: recorder.wasted[(cause, what)] / HOUR for what in WASTE_KINDS}
            for cause in CAUSES
        },
        "preemption_lost_gpu_hours": sum(
            recorder.wasted[(PREEMPTION, what)] for what in WASTE_KINDS
        )
        / HOUR,
        "restart_gpu_hours": sum(recorder.wasted[(c, RESTART)] for c in CAUSES) / HOUR,
        **churn,
        "endings": dict(sorted(recorder.endings.items())),
        "completed": recorder.completed,
        "completed_gpu_hours": recorder.completed_gpu_seconds / HOUR,
        "requeued": recorder.requeued,
        "resubmitted": recorder.resubmitted,
        "drains": len(drains),
        "drains_emptied": len(emptied),
        "drain_hours_p50": _hours(percentile(emptied, 50)),
        "drain_hours_max": _hours(max(emptied) if emptied else None),
        "interventions": recorder.interventions,
        "killed_by_operator": recorder.killed_by_operator,
        "projects": per_project,
        "warmup_hours": first,
        "hourly": {  # every hour, warm-up included
            "capacity_gpus": [c / HOUR for c in recorder.capacity.series(hours)],
            "held_gpus": [
                sum(values) / HOUR
                for values in zip(*(recorder.held[p].series(hours) for p in held), strict=True)
            ],
            "idle_gpus": [v / HOUR for v in recorder.idle.series(hours)],
            "pending_gpus": [v / HOUR for v in recorder.pending.series(hours)],
            "wanted_gpus": [
                sum(values) / HOUR
                for values in zip(*(recorder.wanted[p].series(hours) for p in wanted), strict=True)
            ],
            "busy_gpus": [v / HOUR for v in recorder.busy.series(hours)],
            "wasted_gpus": [v / HOUR for v in _padded(recorder.wasted_by_hour, hours)],
            "preemptions": {
                reason: _padded(counts, hours)
                for reason, counts in sorted(recorder.preemptions_by_hour.items())
            },
        },
        "wait_samples": {cls: _sample(v) for cls, v in recorder.waits.items()},
    }
    if extra:
        summary |= dict(extra)
    return summary


WASTE_KINDS = (RESTART, SINCE_CHECKPOINT, RERUN)


def _wait_figures(values: Sequence[float], not_started: int) -> dict[str, Any]:
    return {
        "count": len(values),
        "not_started": not_started,
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def _churn(recorder: Recorder, hours: int) -> dict[str, Any]:
    """How preemptions fall on jobs and on GPU-time, over the whole run."""
    per_job = recorder.preemptions_by_job
    total = sum(recorder.preemptions.values())
    # every job of the workload counts, those never preempted with 0
    counts = list(per_job.values()) + [0] * max(0, recorder.jobs - len(per_job))
    held = sum(sum(recorder.held[p].series(hours)) for p in recorder.projects) / HOUR
    budget = recorder.preemption_budget
    past_budget = sum(recorder.past_budget_held.series(hours)) / HOUR
    return {
        "preempted_jobs": len(per_job),
        "preemptions_per_job_max": max(counts, default=0),
        "preemptions_per_job_p99": percentile(counts, 99),
        "jobs_preempted_3_or_more": sum(1 for c in per_job.values() if c >= 3),
        "jobs_preempted_more_than_3": sum(1 for c in per_job.values() if c > 3),
        "preemptions_per_1000_gpu_hours": 1000 * total / held if held else None,
        "preemptions_per_completed_job": total / recorder.completed if recorder.completed else None,
        "musical_chairs": recorder.musical_chairs,
        "musical_chairs_share": recorder.musical_chairs / total if total else None,
        "musical_chairs_gpu_hours": recorder.musical_chairs_gpu_seconds / HOUR,
        "musical_chairs_by_reason": dict(sorted(recorder.musical_chairs_by_reason.items())),
        "preemptions_by_need": {
            need: {
                "preemptions": recorder.preemptions_by_need[need],
                "musical_chairs": recorder.musical_chairs_by_need[need],
                "requester_wait_p50": percentile(
                    recorder.requester_waits_by_need.get(need, []), 50
                ),
            }
            for need in NEEDS
            if recorder.preemptions_by_need[need]
        },
        "fair_share_back_and_forth": _back_and_forth(recorder.fair_share_moves),
        "preemption_budget": budget,
        "jobs_at_budget": (
            None
            if budget is None
            else sum(map(recorder.past_budget, recorder.budgeted_preemptions))
        ),
        "held_past_budget_gpu_hours": past_budget,
        "held_past_budget_share": past_budget / held if held else None,
        "multi_node_preemptions": recorder.multi_node_preemptions,
        "multi_node_preempted_gpus": recorder.multi_node_preempted_gpus,
        "avoided_preemptions": recorder.avoided_preemptions,
        "avoided_wait_p50": percentile(recorder.avoided_wait_seconds, 50),
        "avoided_wait_p90": percentile(recorder.avoided_wait_seconds, 90),
    }


def _back_and_forth(moves: Counter) -> int:
    """Fair-share preemptions matched by one the other way between the same two
    projects over the run: each such pair only swapped the two projects' jobs."""
    return sum(min(count, moves[theirs, mine]) for (mine, theirs), count in moves.items())


def _padded(bins: Sequence[float], hours: int) -> list[float]:
    return list(bins[:hours]) + [0] * max(0, hours - len(bins))


def _class_order(cls: str) -> tuple[int, str]:
    return (WAIT_CLASSES.index(cls) if cls in WAIT_CLASSES else len(WAIT_CLASSES), cls)


def _hours(seconds: float | None) -> float | None:
    return None if seconds is None else seconds / HOUR


def _sample(values: Iterable[float], points: int = 200) -> list[float]:
    """Quantiles at ``points`` evenly spaced ranks: enough for a CDF plot, small in JSON."""
    ordered = sorted(values)
    if len(ordered) <= points:
        return ordered
    return [ordered[round(i * (len(ordered) - 1) / (points - 1))] for i in range(points)]
