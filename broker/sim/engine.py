"""The discrete-event engine: one simulated clock, an event heap, and the policy under test.

State is plain model values — live :class:`~broker.core.model.Slice` and
:class:`~broker.core.model.Node` objects — moved forward only by
:func:`broker.core.transitions.apply` (for a policy's decisions and for an
operator's) and :func:`broker.core.transitions.end_slice` (for a holder letting
go). Events sit in a heap keyed by ``(time, seq)``; the events of one
``quantum`` are handled together, then, if anything changed, the engine
builds a :class:`~broker.core.model.Snapshot` (usage kept incrementally by a
:class:`~broker.sim.usage.UsageTracker`) and calls the policy once.

What users and the cluster do around the scheduler is modelled here:

- a granted job runs for its remaining work and then releases its slice; an
  idle session (a squatter) holds its GPUs for its whole stay, doing nothing;
- preempted work: a resumable batch slice is requeued by the pass and keeps
  its progress up to its last checkpoint (every ``checkpoint_interval`` of
  work, at a phase drawn per job), and must restart (``restart_cost``) before
  it works again; a
  non-resumable batch job loses everything and its user submits it again; an
  interactive session ends and its user starts a new one for the time they
  still wanted; an idle session is simply gone;
- node events: ``down`` (the pass ends its slices) and ``draining``; a node
  is repaired and ``ready`` again some hours after it is down or drained. A
  drain that has not emptied ``drain_deadline`` after it began needs a human:
  an operator ends what still runs there (counted as an intervention).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.accounting import held_rate
from ..core.fairshare import ProjectTree
from ..core.model import (
    HOUR,
    PASS_INTERVAL,
    Contract,
    Decisions,
    Ending,
    EndReason,
    Node,
    NodeState,
    PreemptReason,
    Quiet,
    Slice,
    SliceKind,
    SliceState,
    Snapshot,
)
from ..core.preemption import preemption_delay
from ..core.resume import RESUME_PHASE
from ..core.transitions import apply, end_slice, requeued_when_ended
from .metrics import (
    FAILURE,
    OPERATOR,
    PREEMPTION,
    RERUN,
    RESTART,
    SINCE_CHECKPOINT,
    Drain,
    Recorder,
    is_debug,
    summarise,
)
from .policies import Scheduler
from .usage import UsageTracker
from .workloads import Job, NodeEvent, Workload

MIN = 60.0

# Event kinds (same-time events are handled in the order they were pushed).
_NODE, _REPAIR, _FINISH, _INTERVENE, _WAKE, _CHECK, _TICK = range(7)
_KIND_NAMES = ("node", "repair", "release", "intervention", "deadline", "protection end", "tick")
# Events that change no slice or node: the pass looks again only because time moved.
_TIMED = frozenset((_WAKE, _CHECK, _TICK))


@dataclass(frozen=True)
class SimConfig:
    """How the world around the scheduler behaves; durations in seconds.

    ``quantum``: the events of each quantum are handled together, then one
    pass runs at its end (0: a pass at every distinct event time).
    ``tick``: while work is pending, a pass at least this often (fair share
    drifts as usage accrues): by default the service's own pass interval, so a
    run passes when the service would (the passes where only time moved since a
    quiet one are left out); a request the pass let wait before preempting also
    gets a pass when that wait ends.
    ``drain_deadline``: after this, a drain that has not emptied needs an operator.

    What a preempted (or failed) resumable job pays: ``checkpoint_interval``
    is how often it checkpoints, in seconds of work, from a phase in
    ``[0, interval)`` drawn per job from ``seed``; it loses its work since the
    last checkpoint (0: it checkpoints continuously and loses nothing).
    ``restart_cost`` is the seconds it then spends restarting (loading,
    warm-up) on its GPUs before it works again. ``report_checkpoints``: each
    resumable job tells the broker of every checkpoint (``checkpointed_at``),
    so that victims are chosen by their work since it (design.md §5.3). The defaults here charge
    nothing (the tests' hand-computed cases); the command line charges
    5 min and 30 min.
    ``resubmit``: users start preempted non-resumable work again.
    ``check``: assert the invariants of design.md §5 after every pass (slow).
    ``until``: the end of the run (default: the workload's). ``warmup``: the
    start of the measured period — the cluster starts empty, so its first
    hours say little about a loaded cluster. ``history``: keep a log of what
    happened to each job (:attr:`Result.history`), for tests and debugging.
    """

    quantum: float = 1.0
    tick: float = PASS_INTERVAL
    drain_deadline: float = 12 * HOUR
    checkpoint_interval: float = 0.0
    restart_cost: float = 0.0
    report_checkpoints: bool = False
    seed: int = 1
    resubmit: bool = True
    check: bool = False
    until: float | None = None
    warmup: float = 0.0
    history: bool = False


@dataclass(slots=True)
class _Run:
    """One request in flight: the job behind a slice and how much it still needs."""

    job: Job
    work: float  # seconds of work asked for by this request
    remaining: float  # seconds of work still to do
    requested_at: float
    waited: bool = False
    overhead: float = 0.0  # seconds of restart before the work goes on, at the next grant
    overhead_cause: str = PREEMPTION  # what made the restart necessary
    within_cap: bool | None = None  # debug sessions: within the user's cap when asked
    # The last preemption that chose it as a victim (not a drain): when, and the
    # GPU-seconds it cost (work since the checkpoint, then the restart).
    preempted_at: float | None = None
    preempted_for: str = ""  # that preemption's reason
    preempted_need: str = ""  # and what it served (metrics.served)
    preemption_cost: float = 0.0
    deferred_at: float | None = None  # first pass that let it wait instead of preempt


@dataclass
class Result:
    policy: str
    workload: str
    summary: dict[str, Any]
    stats: dict[str, Any] = field(default_factory=dict)
    # (time, what, job id) for each request, grant, preemption, requeue and end
    history: list[tuple[float, str, int]] = field(default_factory=list)


class InvariantBroken(AssertionError):
    """A pass broke an invariant of design.md §5 (only raised with ``SimConfig.check``)."""


class Simulation:
    """One policy on one workload. :meth:`run` it once."""

    def __init__(
        self,
        workload: Workload,
        scheduler: Scheduler,
        config: SimConfig | None = None,
        *,
        log: Callable[[str], None] | None = None,
    ):
        self.workload = workload
        self.scheduler = scheduler
        self.config = config or SimConfig()
        self.log = log
        self.until = self.config.until if self.config.until is not None else workload.end
        self.tree = ProjectTree(workload.accounts)
        self.weights = dict(workload.gpu_type_weights)
        self.node_types = {n.name: n.gpu_type for n in workload.nodes}
        self.nodes: dict[str, Node] = {n.name: n for n in workload.nodes}
        self.slices: dict[int, Slice] = {}
        self._promise_holders: set[int] = set()  # of self.slices, from the last apply
        self.runs: dict[int, _Run] = {}
        self.waiting = 0  # pending slices
        self.usage = UsageTracker(
            self.tree.projects, scheduler.policy.window, scheduler.policy.half_life
        )
        gpus_per_node = max((n.gpu_count for n in workload.nodes), default=8)
        self.recorder = Recorder(
            self.tree.projects,
            node_gpus=gpus_per_node,
            cluster_gpus=workload.capacity,
            warmup=self.config.warmup,
        )
        self.recorder.jobs = len(workload.jobs)
        self.recorder.preemption_budget = scheduler.policy.preemption_budget
        self.recorder.set_capacity(0.0, self._capacity())
        self.debug_gpus: dict[str, int] = {}  # debug GPUs each user has in flight
        self._phases: dict[int, float] = {}  # job id -> checkpoint phase
        # (next checkpoint, slice id, its grant): what report_checkpoints tells the broker
        self._checkpoints: list[tuple[float, int, float]] = []
        self.drains: dict[str, Drain] = {}  # open drains by node
        self.repair_after: dict[str, float] = {}
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = itertools.count()
        self._ids = itertools.count(1)
        self._tick_due: float | None = None
        self._ending_cause = PREEMPTION  # whom work ended now by a preemption is charged to
        self._nodes_tuple: tuple[Node, ...] | None = None
        # What the last pass said of the next (Decisions.quiet), and whom it deferred
        self._quiet: Quiet | None = None
        self._quiet_deferred: set[int] = set()
        # Slices changed since the policy last looked (id -> the slice, None: gone), told
        # to a policy that keeps an index (FairShare.expect) instead of its comparing
        # every live slice, as the service tells its own.
        self._changed: dict[int, Slice | None] = {}
        self._expect = getattr(self.scheduler, "expect", None)
        self.history: list[tuple[float, str, int]] | None = [] if self.config.history else None
        self.stats: dict[str, Any] = {
            "passes": 0,
            "quiet_passes": 0,  # passes left out: time alone moved, nothing would change
            "resumed_passes": 0,  # passes that resumed a quiet one instead of walking
            "pass_seconds": 0.0,
            "max_pass_seconds": 0.0,
            "phase_seconds": {},
            "events": 0,
            "changes_by_event": {},  # events that made the policy look again, by kind
            "max_waiting": 0,
        }
        for event in workload.node_events:
            self._push(event.at, _NODE, event)

    # ---- the loop ----------------------------------------------------------------

    def run(self) -> Result:
        started, cpu = time.perf_counter(), time.process_time()
        jobs, next_job, heap = self.workload.jobs, 0, self._heap
        quantum = self.config.quantum
        changes = self.stats["changes_by_event"]
        while True:
            first = heap[0][0] if heap else math.inf
            if next_job < len(jobs) and jobs[next_job].submit < first:
                first = jobs[next_job].submit
            if first > self.until or first == math.inf:
                break
            at = min(math.ceil(first / quantum) * quantum, self.until) if quantum > 0 else first
            at = max(at, first)
            changed = moved = False  # moved: an event changed a slice or a node
            while True:
                arrival = jobs[next_job].submit if next_job < len(jobs) else math.inf
                event = heap[0][0] if heap else math.inf
                if min(arrival, event) > at:
                    break
                self.stats["events"] += 1
                if arrival <= event:
                    job = jobs[next_job]
                    next_job += 1
                    self.now = job.submit
                    self._request(job.submit, job, job.duration)
                    changed, moved = True, True
                    changes["arrival"] = changes.get("arrival", 0) + 1
                else:
                    t, _, kind, a, b = heapq.heappop(heap)
                    self.now = t
                    if self._handle(t, kind, a, b):
                        changed = True
                        moved = moved or kind not in _TIMED
                        name = _KIND_NAMES[kind]
                        changes[name] = changes.get(name, 0) + 1
            self.now = at
            if changed:
                self._pass(at, timed_only=not moved)
        self._finish_run()
        self.stats["wall_seconds"] = time.perf_counter() - started
        self.stats["cpu_seconds"] = time.process_time() - cpu
        summary = summarise(
            self.recorder,
            end=self.until,
            entitlements={p: self.tree.entitlements[p] for p in self.tree.projects},
            extra={
                "capacity_gpus": self.workload.capacity,
                "nodes": len(self.workload.nodes),
                "jobs": len(self.workload.jobs),
                "offered_load": self.workload.offered_load(),
                "days": self.until / (24 * HOUR),
            },
        )
        return Result(
            self.scheduler.name, self.workload.name, summary, dict(self.stats), self.history or []
        )

    def _say(self, t: float, message: str) -> None:
        """A log line stamped with the simulated time (day and time of day)."""
        if self.log is not None:
            day, rest = divmod(t, 24 * HOUR)
            clock = time.strftime("%H:%M:%S", time.gmtime(rest))
            self.log(f"[{self.workload.name} {self.scheduler.name} d{int(day)} {clock}] {message}")

    def _note(self, t: float, what: str, job: Job) -> None:
        if self.history is not None:
            self.history.append((t, what, job.id))

    def _push(self, at: float, kind: int, a: Any = None, b: Any = None) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, a, b))

    def _handle(self, t: float, kind: int, a: Any, b: Any) -> bool:
        """Handle one event at ``t``; whether the policy should look again."""
        if kind == _FINISH:
            return self._release(t, a, b)
        if kind == _WAKE:
            return True
        if kind == _CHECK:  # a contract's protected period ended
            return self.waiting > 0 or bool(self.drains)
        if kind == _TICK:
            self._tick_due = None
            return self.waiting > 0
        if kind == _NODE:
            return self._node_event(t, a)
        if kind == _REPAIR:
            return self._repair(t, a)
        if kind == _INTERVENE:
            return self._intervene(t, a, b)
        raise ValueError(f"unknown event kind {kind}")

    # ---- users ------------------------------------------------------------------------

    def _request(self, t: float, job: Job, work: float) -> None:
        slice_id = next(self._ids)
        self.slices[slice_id] = self._changed[slice_id] = Slice(
            id=slice_id,
            project=job.project,
            user=job.user,
            gpus=job.gpus,
            kind=job.kind,
            contract=Contract(job.min_runtime, job.resumable, job.max_runtime),
            gpu_type=job.gpu_type,
            priority=job.priority,
            submitted_at=t,
        )
        run = self.runs[slice_id] = _Run(job, work, work, t)
        if is_debug(job):
            in_flight = self.debug_gpus.get(job.user, 0) + job.gpus
            self.debug_gpus[job.user] = in_flight
            run.within_cap = in_flight <= self.scheduler.policy.debug_max_gpus
        self._note(t, "request", job)
        self.waiting += 1
        self.stats["max_waiting"] = max(self.stats["max_waiting"], self.waiting)
        self.recorder.want(t, job.project, job.gpus)
        self.recorder.queue(t, job.gpus)

    def _release(self, t: float, slice_id: int, granted_at: float) -> bool:
        """The job is done (or the squatter leaves): its holder lets the slice go."""
        slice_ = self.slices.get(slice_id)
        if slice_ is None or slice_.granted_at != granted_at or not slice_.holds_gpus:
            return False  # ended or requeued meanwhile
        entry = end_slice(slice_, t, self.node_types, self.weights)
        if entry is not None:
            self.usage.close(entry)
        del self.slices[slice_id]
        self._changed[slice_id] = None
        run = self._forget(slice_id)
        job = run.job
        self._segment(t, run, slice_)
        self.recorder.hold(t, job, -job.gpus)
        self.recorder.want(t, job.project, -job.gpus)
        self.recorder.endings[EndReason.RELEASED.value] += 1
        self._note(t, "released", job)
        if not job.idle:
            self.recorder.completed += 1
            self.recorder.completed_gpu_seconds += job.gpus * run.work
        return True

    def _forget(self, slice_id: int) -> _Run:
        """The request behind ``slice_id`` is over: stop tracking it."""
        run = self.runs.pop(slice_id)
        if run.within_cap is not None:
            self.debug_gpus[run.job.user] -= run.job.gpus
        return run

    def _segment(self, t: float, run: _Run, slice_: Slice) -> float:
        """A grant of ``run`` ends at ``t``: charge the restart it spent; its seconds of work."""
        if slice_.granted_at is None:
            return 0.0
        start = slice_.granted_at
        restarted = min(start + run.overhead, t)
        self.recorder.waste(start, restarted, run.job.gpus, run.overhead_cause, RESTART)
        return t - restarted

    def _phase(self, job: Job) -> float:
        """Seconds of work before ``job``'s first checkpoint after each (re)start."""
        phase = self._phases.get(job.id)
        if phase is None:
            interval = self.config.checkpoint_interval
            phase = self._phases[job.id] = checkpoint_phase(self.config.seed, job.id, interval)
        return phase

    def _since_checkpoint(self, job: Job, worked: float) -> float:
        """Seconds of the last ``worked`` that a job loses: those since its last checkpoint."""
        interval = self.config.checkpoint_interval
        if interval <= 0:
            return 0.0
        phase = self._phase(job)
        return worked if worked < phase else (worked - phase) % interval

    def _report_checkpoints(self, now: float) -> bool:
        """The checkpoints made by ``now``, as their jobs report them to the broker;
        whether any was."""
        due, reported = self._checkpoints, False
        while due and due[0][0] <= now:
            at, slice_id, granted_at = heapq.heappop(due)
            slice_ = self.slices.get(slice_id)
            if slice_ is None or slice_.granted_at != granted_at or not slice_.holds_gpus:
                continue  # ended or requeued since: its next grant has checkpoints of its own
            self.slices[slice_id] = self._changed[slice_id] = replace(slice_, checkpointed_at=at)
            heapq.heappush(due, (at + self.config.checkpoint_interval, slice_id, granted_at))
            reported = True
        return reported

    # ---- the cluster ----------------------------------------------------------------

    def _capacity(self) -> int:
        usable = (NodeState.READY, NodeState.DRAINING)
        return sum(n.gpu_count for n in self.nodes.values() if n.state in usable)

    def _set_node(self, t: float, name: str, state: NodeState) -> None:
        self.nodes[name] = replace(self.nodes[name], state=state)
        self._nodes_tuple = None
        self.recorder.set_capacity(t, self._capacity())

    def _node_event(self, t: float, event: NodeEvent) -> bool:
        state = self.nodes[event.node].state
        if event.state is NodeState.DOWN:
            if state is NodeState.DOWN:
                return False
            drain = self.drains.pop(event.node, None)
            if drain is not None:
                drain.interrupted = True
            self._set_node(t, event.node, NodeState.DOWN)
            self._push(t + event.repair, _REPAIR, event.node)
            self._say(t, f"node {event.node} is down")
            return True
        if event.state is NodeState.DRAINING:
            if state is not NodeState.READY:
                return False
            drain = Drain(event.node, t)
            self.recorder.drains.append(drain)
            self.drains[event.node] = drain
            self.repair_after[event.node] = event.repair
            self._set_node(t, event.node, NodeState.DRAINING)
            self._push(t + self.config.drain_deadline, _INTERVENE, event.node, drain)
            self._say(t, f"node {event.node} is draining")
            return True
        raise ValueError(f"node events are 'down' or 'draining', not {event.state}")

    def _repair(self, t: float, name: str) -> bool:
        if self.nodes[name].state not in (NodeState.DOWN, NodeState.DRAINED):
            return False
        self._set_node(t, name, NodeState.READY)
        self._say(t, f"node {name} is repaired and ready")
        return True

    def _intervene(self, t: float, name: str, drain: Drain) -> bool:
        """A drain past its deadline: an operator negotiates and ends what still runs."""
        if self.drains.get(name) is not drain or self.nodes[name].state is not NodeState.DRAINING:
            return False
        holders = [
            s
            for s in self.slices.values()
            if s.holds_gpus and any(p.node == name for p in s.placements)
        ]
        if not holders:
            return False
        drain.intervened = True
        self._say(t, f"drain of {name} overdue: an operator ends {len(holders)} slice(s)")
        self.recorder.interventions += 1
        self.recorder.killed_by_operator += len(holders)
        reason = EndReason.PREEMPTED
        endings = tuple(
            Ending(s.id, reason, requeued_when_ended(s.kind, s.contract.resumable, reason))
            for s in sorted(holders, key=lambda s: s.id)
        )
        self._ending_cause = OPERATOR
        try:
            self._commit(t, Decisions(endings=endings))
        finally:
            self._ending_cause = PREEMPTION
        return True

    # ---- the policy -----------------------------------------------------------------------

    def _pass(self, now: float, timed_only: bool = False) -> None:
        """Call the policy at ``now`` and commit what it decides. ``timed_only``: no
        event since the last pass changed a slice or a node; if that pass decided
        nothing and said until when nothing changes (``Decisions.quiet``), this one is
        left out (``quiet_passes``; checked against the policy with ``check``)."""
        if self._checkpoints and self._report_checkpoints(now):
            timed_only = False
        snapshot = None
        quiet = self._quiet
        if not timed_only or quiet is None:
            still_quiet = False
        elif quiet.window_order is None:
            snapshot = self._snapshot(now)
            still_quiet = self.scheduler.still_quiet(quiet, snapshot)
        else:
            # Quiet's own terms, with the window's order told from the usage kept
            # (UsageTracker.order_at), not computed again at every tick
            still_quiet = (
                now < quiet.until and self.usage.order_at(self.tree, now) == quiet.window_order
            )
        if still_quiet:
            self.stats["quiet_passes"] += 1
            if self.config.check:
                if snapshot is None:
                    snapshot = self._snapshot(now)
                assert self.scheduler.still_quiet(quiet, snapshot), "the policy says it changed"
                check_quiet(self._quiet_deferred, self.scheduler(snapshot))
            self._tick(now)
            return
        if snapshot is None:
            snapshot = self._snapshot(now)
        if self._expect is not None:
            self._expect(self._changed)
            self._changed = {}
        started = time.perf_counter()
        decisions = self.scheduler(snapshot)
        elapsed = time.perf_counter() - started
        stats = self.stats
        stats["passes"] += 1
        stats["pass_seconds"] += elapsed
        stats["max_pass_seconds"] = max(stats["max_pass_seconds"], elapsed)
        phases = stats["phase_seconds"]
        for phase, seconds in decisions.phase_seconds.items():
            phases[phase] = phases.get(phase, 0.0) + seconds
        stats["resumed_passes"] += RESUME_PHASE in decisions.phase_seconds
        if self.config.check:
            check_decisions(snapshot, decisions)
        self._commit(now, decisions)
        self._quiet, self._quiet_deferred = decisions.quiet, set(decisions.deferred)
        self._tick(now)

    def _snapshot(self, now: float) -> Snapshot:
        if self._nodes_tuple is None:
            self._nodes_tuple = tuple(self.nodes.values())
        return Snapshot(
            now=now,
            nodes=self._nodes_tuple,
            accounts=self.workload.accounts,
            slices=tuple(self.slices.values()),
            usage=self.usage.at(now),
            gpu_type_weights=self.weights,
            policy=self.scheduler.policy,
        )

    def _tick(self, now: float) -> None:
        """While work waits, a pass at least every ``tick`` seconds."""
        if self.waiting and self._tick_due is None and self.config.tick > 0:
            self._tick_due = now + self.config.tick
            self._push(self._tick_due, _TICK)

    def _commit(self, now: float, decisions: Decisions) -> None:
        """Apply ``decisions`` at ``now`` and do the bookkeeping each change implies."""
        requeued_from = {
            e.slice_id: self.slices[e.slice_id] for e in decisions.endings if e.requeue
        }
        applied = apply(
            self.slices,
            self.nodes,
            decisions,
            now,
            self.weights,
            self._promise_holders,
            in_place=True,
        )
        self._promise_holders = applied.promise_holders
        for slice_id in applied.changed:
            self._changed[slice_id] = self.slices.get(slice_id)
        for entry in applied.charges:
            self.usage.close(entry)
        reasons = {e.slice_id: e.reason for e in decisions.endings}
        for slice_, reason in applied.ended:
            self._ended(now, slice_, reason)
        for slice_ in applied.requeued:
            self._requeued(now, requeued_from[slice_.id], reasons[slice_.id])
        for slice_id in decisions.deferred:
            run = self.runs[slice_id]
            if run.deferred_at is None:
                run.deferred_at = now
                # The service passes every few seconds, so it preempts for this
                # request as soon as its wait ends; a pass then here does the same.
                request = self.slices[slice_id]
                waited_until = request.waiting_since + preemption_delay(
                    request, self.scheduler.policy
                )
                if waited_until > now:
                    self._push(waited_until, _WAKE)
        for preemption in decisions.preemptions:
            run = self.runs[preemption.slice_id]
            job = run.job
            for_job, waited = None, 0.0
            if preemption.for_slice is not None:
                requester = self.runs[preemption.for_slice]
                requester.deferred_at = None  # it preempted after all
                for_job = requester.job
                waited = now - self.slices[preemption.for_slice].waiting_since
            need = self.recorder.preempted(now, job, preemption.reason.value, for_job, waited)
            if preemption.reason is not PreemptReason.DRAIN:
                run.preempted_at = now
                run.preempted_for = preemption.reason.value
                run.preempted_need = need
            self._note(now, f"preempted ({preemption.reason.value})", job)
            self._push(preemption.deadline, _WAKE)
        for grant in decisions.grants:
            self._granted(now, self.slices[grant.slice_id])
        if decisions.node_changes:
            self._nodes_tuple = None
            for change in decisions.node_changes:
                if change.state is NodeState.DRAINED:
                    drain = self.drains.pop(change.node, None)
                    if drain is not None:
                        drain.emptied = now
                        self._say(
                            now, f"node {change.node} drained after {now - drain.started:.0f} s"
                        )
                    repair = self.repair_after.pop(change.node, 4 * HOUR)
                    self._push(now + repair, _REPAIR, change.node)
            self.recorder.set_capacity(now, self._capacity())

    def _granted(self, now: float, slice_: Slice) -> None:
        run = self.runs[slice_.id]
        job = run.job
        self.waiting -= 1
        self.recorder.queue(now, -job.gpus)
        self.recorder.hold(now, job, job.gpus)
        self._note(now, "granted", job)
        if run.deferred_at is not None:
            self.recorder.avoided(now - run.deferred_at)
            run.deferred_at = None
        if run.preempted_at is not None:
            cost = run.preemption_cost + run.overhead * job.gpus
            self.recorder.regranted(
                now - run.preempted_at, cost, run.preempted_for, run.preempted_need
            )
            run.preempted_at = None
        if not run.waited:
            run.waited = True
            self.recorder.waited(
                job, run.requested_at, now - run.requested_at, within_cap=run.within_cap
            )
        if slice_.allocated:
            rate = held_rate(slice_.placements, self.node_types, self.weights)
            self.usage.open(slice_.project, rate, now)
        self._push(now + run.overhead + run.remaining, _FINISH, slice_.id, now)
        config = self.config
        reports = config.report_checkpoints and config.checkpoint_interval > 0
        if reports and slice_.contract.resumable:
            first = now + run.overhead + self._phase(job)
            heapq.heappush(self._checkpoints, (first, slice_.id, now))
        if slice_.contract.min_runtime > 0:
            self._push(now + slice_.contract.min_runtime, _CHECK)
        if slice_.contract.max_runtime is not None:
            self._push(now + slice_.contract.max_runtime, _WAKE)

    def _ended(self, now: float, slice_: Slice, reason: EndReason) -> None:
        """A slice the policy (or an operator) ended without requeueing it."""
        run = self._forget(slice_.id)
        job = run.job
        self.recorder.endings[reason.value] += 1
        self._note(now, reason.value, job)
        worked = 0.0
        if slice_.holds_gpus:
            worked = self._segment(now, run, slice_)
            self.recorder.hold(now, job, -job.gpus)
        else:
            self.waiting -= 1
            self.recorder.queue(now, -job.gpus)
        self.recorder.want(now, job.project, -job.gpus)
        if job.idle or reason not in (EndReason.PREEMPTED, EndReason.NODE_DOWN):
            return
        if job.kind is SliceKind.BATCH:
            cause = FAILURE if reason is EndReason.NODE_DOWN else self._ending_cause
            self.recorder.waste(now - worked, now, job.gpus, cause, RERUN)
            again = run.work  # from the start
        else:
            again = run.remaining - worked  # the rest of the session
        if self.config.resubmit and again > 0:
            self.recorder.resubmitted += 1
            self._request(now, job, again)

    def _requeued(self, now: float, slice_: Slice, reason: EndReason) -> None:
        """A resumable slice back in the queue, with its progress up to its last
        checkpoint and a restart to do before it works again."""
        run = self.runs[slice_.id]
        job = run.job
        worked = self._segment(now, run, slice_)
        lost = self._since_checkpoint(job, worked)
        cause = FAILURE if reason is EndReason.NODE_DOWN else self._ending_cause
        self.recorder.waste(now - lost, now, job.gpus, cause, SINCE_CHECKPOINT)
        run.remaining = max(1.0, run.remaining - (worked - lost))
        run.preemption_cost = lost * job.gpus
        run.overhead, run.overhead_cause = self.config.restart_cost, cause
        self.recorder.requeued += 1
        self.recorder.endings[f"{reason.value} (requeued)"] += 1
        self._note(now, f"{reason.value} (requeued)", job)
        self.recorder.hold(now, job, -job.gpus)
        self.recorder.queue(now, job.gpus)
        self.waiting += 1

    def _finish_run(self) -> None:
        end = self.until
        for slice_id, run in self.runs.items():
            if not run.waited:
                waited = max(0.0, end - run.requested_at)
                self.recorder.waited(
                    run.job, run.requested_at, waited, started=False, within_cap=run.within_cap
                )
            elif self.slices[slice_id].holds_gpus:
                self._segment(end, run, self.slices[slice_id])  # restarts under way


def checkpoint_phase(seed: int, job_id: int, interval: float) -> float:
    """Seconds of work, in ``[0, interval)``, before a job's first checkpoint after a
    (re)start; drawn per job, so that every policy sees the same one."""
    return random.Random(f"{seed}:checkpoints:{job_id}").random() * interval


# ---- invariants ------------------------------------------------------------------------


def check_quiet(deferred: set[int], decisions: Decisions) -> None:
    """A pass left out as quiet (``Decisions.quiet``), run all the same: it must decide
    nothing, and defer only requests the last pass deferred already."""
    acted = decisions.grants or decisions.preemptions or decisions.endings
    newly_deferred = not deferred.issuperset(decisions.deferred)
    if acted or decisions.node_changes or decisions.quiet is None or newly_deferred:
        raise AssertionError(f"a pass left out as quiet decides {decisions}")


def check_decisions(snapshot: Snapshot, decisions: Decisions) -> None:
    """design.md §5's invariants for one pass: after it, a GPU is held or promised by
    at most one slice, grants are on ``ready`` nodes, and no protected slice is
    preempted."""
    live = {s.id: s for s in snapshot.slices}
    ended = {e.slice_id for e in decisions.endings}
    states = {n.name: n.state for n in snapshot.nodes}
    held: dict[tuple[str, int], int] = {}

    def take(slice_id: int, placements) -> None:
        for p in placements:
            for i in p.gpu_indices:
                other = held.setdefault((p.node, i), slice_id)
                if other != slice_id:
                    raise InvariantBroken(
                        f"GPU {p.node}:{i} held by slices {other} and {slice_id} at {snapshot.now}"
                    )

    for s in snapshot.slices:
        if s.holds_gpus and s.id not in ended:
            take(s.id, s.placements)
    for grant in decisions.grants:
        for p in grant.placements:
            if states[p.node] is not NodeState.READY:
                raise InvariantBroken(
                    f"slice {grant.slice_id} granted on {p.node} ({states[p.node]})"
                )
        take(grant.slice_id, grant.placements)
    for preemption in decisions.preemptions:
        victim = live[preemption.slice_id]
        if victim.allocated and victim.is_protected(snapshot.now):
            raise InvariantBroken(f"protected slice {victim.id} preempted at {snapshot.now}")
        if victim.state is not SliceState.GRANTED:
            raise InvariantBroken(f"slice {victim.id} preempted twice")


def simulate(workload: Workload, scheduler: Scheduler, config: SimConfig | None = None) -> Result:
    """Run ``scheduler`` on ``workload`` and return its figures."""
    return Simulation(workload, scheduler, config).run()
