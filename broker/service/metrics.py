"""Prometheus metrics of the broker service (``GET /api/v1/metrics``).

Every metric is named ``slicebroker_*`` and carries its unit in its name.
Counters and histograms are fed by the scheduling loop as passes happen;
gauges describing the present (queues, GPUs, usage) are set from the database
when the endpoint is scraped, so every replica of the service reports the same.
Each :class:`BrokerMetrics` has its own registry.

Every labelled counter and histogram has each label set it can take from the
start, at zero, as the Prometheus client guidelines ask: a series that appears
only at its first event shows that event in neither ``rate()`` nor
``increase()``. Reasons and phases are known in advance; projects are added
(:meth:`BrokerMetrics.know_projects`) before the first pass and whenever the
project tree changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..core.model import Decisions, EndReason, NodeState, PreemptReason, SliceKind
from ..core.resume import RESUME_PHASE

CONTENT_TYPE = CONTENT_TYPE_LATEST

#: Queue waits last from seconds (debug lane) to days (large batch work).
WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 28800, 86400, 604800)
#: A pass takes milliseconds on small clusters, up to seconds on very large queues.
PASS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
#: The phases a pass times (``Decisions.phase_seconds``), in their order.
PASS_PHASES = ("end", "drain", "snapshot", "promises", "allocate", "backfill")
#: Every phase series: a pass walks the phases above, or resumes its quiet predecessor.
PHASE_SERIES = (*PASS_PHASES, RESUME_PHASE)


class BrokerMetrics:
    """The service's metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.leader = Gauge(
            "slicebroker_leader",
            "Whether this broker holds the leader lock (1) or waits as a standby (0); "
            "a standby exports only this.",
            registry=r,
        )
        self.leader.set(1)  # the metrics of a broker that serves: the leader's
        self.queue_length = Gauge(
            "slicebroker_queue_length_slices",
            "Slices waiting for GPUs, by project and kind.",
            ["project", "kind"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "slicebroker_queue_wait_seconds",
            "Time from submission to grant of granted slices, by project and kind.",
            ["project", "kind"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.gpus_held = Gauge(
            "slicebroker_gpus_held",
            "GPUs held by slices, by GPU type and node state.",
            ["gpu_type", "node_state"],
            registry=r,
        )
        self.gpus_free = Gauge(
            "slicebroker_gpus_free",
            "GPUs held by no slice, by GPU type and node state.",
            ["gpu_type", "node_state"],
            registry=r,
        )
        self.window_usage = Gauge(
            "slicebroker_project_usage_weighted_gpu_seconds",
            "Charged usage in the fair-share lookback window (weighted GPU-seconds), "
            "per account (parents sum their subtree).",
            ["project"],
            registry=r,
        )
        self.entitlement = Gauge(
            "slicebroker_project_entitlement_ratio",
            "Each account's entitled fraction of the cluster (0-1).",
            ["project"],
            registry=r,
        )
        self.share_used = Gauge(
            "slicebroker_project_share_used_ratio",
            "Each account's fair-share value: its part of all usage in the lookback window "
            "over its entitlement (1 is exactly its share; lower is served first).",
            ["project"],
            registry=r,
        )
        self.preemptions = Counter(
            "slicebroker_preemptions",
            "Slices asked to leave, by reason (fair_share, priority, debug_lane, "
            "unallocated, drain).",
            ["reason"],
            registry=r,
        )
        self.heartbeats_late = Counter(
            "slicebroker_heartbeats_answered_late",
            "Heartbeat requests (one slice's, or a hub's of many) the broker answered later "
            "than its late_heartbeat after they came (a lease does not run out over that time).",
            registry=r,
        )
        self.endings = Counter(
            "slicebroker_slice_endings",
            "Slices ended (or requeued) by a scheduling pass, by reason.",
            ["reason"],
            registry=r,
        )
        self.gpus_kept = Gauge(
            "slicebroker_gpus_kept_to_end",
            "GPUs held by slices preempted as many times as the policy's preemption_budget "
            "allows, as the last pass left them: no one preempts them again (only a drain or "
            "a node going down ends them early), so fair share cannot move them.",
            registry=r,
        )
        self.lapses_held = Gauge(
            "slicebroker_lease_lapses_held",
            "Slices whose lease is over that the last pass did not end, held back by the "
            "lease lapse limit (policy lease_lapse_floor and lease_lapse_fraction) or "
            "because the broker answered heartbeats late: above zero, heartbeats may be "
            "going unanswered.",
            registry=r,
        )
        self.pass_duration = Histogram(
            "slicebroker_pass_duration_seconds",
            "Wall time of a whole scheduling pass: load, decide and write.",
            buckets=PASS_BUCKETS,
            registry=r,
        )
        self.pass_phase = Histogram(
            "slicebroker_pass_phase_duration_seconds",
            "Time of each phase of the scheduling decision (Decisions.phase_seconds); "
            "a pass that resumed its quiet predecessor instead of walking the queue has "
            "the one phase resume.",
            ["phase"],
            buckets=PASS_BUCKETS,
            registry=r,
        )
        self.long_polls = Gauge(
            "slicebroker_long_polls",
            "Long polls (GET /slices/{id}?wait=...) waiting for news, in this process.",
            registry=r,
        )
        self.pass_failures = Counter(
            "slicebroker_pass_failures",
            "Scheduling passes that failed (the database was unavailable, say).",
            registry=r,
        )

        for reason in PreemptReason:
            self.preemptions.labels(reason=reason.value)
        for ending in EndReason:
            self.endings.labels(reason=ending.value)
        for phase in PHASE_SERIES:
            self.pass_phase.labels(phase=phase)

    def know_projects(self, projects: Iterable[str]) -> None:
        """Create the per-project series of ``projects`` at zero (those already there are
        kept as they are; a project's that left the tree stay until the process ends)."""
        for project in projects:
            for kind in SliceKind:
                self.queue_wait.labels(project=project, kind=kind.value)

    # ---- fed by the scheduling loop -------------------------------------------------

    def record_pass(
        self, decisions: Decisions, live: Mapping[int, Mapping[str, Any]], seconds: float
    ) -> None:
        """Count what a pass decided; ``live`` holds the live slices read right after it."""
        self.pass_duration.observe(seconds)
        self.lapses_held.set(len(decisions.lapses_held))
        for phase, phase_seconds in decisions.phase_seconds.items():
            self.pass_phase.labels(phase=phase).observe(phase_seconds)
        for preemption in decisions.preemptions:
            self.preemptions.labels(reason=preemption.reason.value).inc()
        for ending in decisions.endings:
            self.endings.labels(reason=ending.reason.value).inc()
        for grant in decisions.grants:
            slice_ = live.get(grant.slice_id)
            if slice_ is None or slice_.get("granted_at") is None:
                continue
            waited = max(0.0, slice_["granted_at"] - slice_["submitted_at"])
            self.queue_wait.labels(project=slice_["project"], kind=slice_["kind"]).observe(waited)

    # ---- set at scrape time ---------------------------------------------------------

    def set_state(
        self,
        nodes: Iterable[Mapping[str, Any]],
        projects: Iterable[Mapping[str, Any]],
        pending: Iterable[Mapping[str, Any]],
    ) -> None:
        """Set the gauges from the present state of nodes, projects and the queue."""
        projects = list(projects)
        self.queue_length.clear()
        for project in projects:
            if project["is_project"]:
                for kind in SliceKind:
                    self.queue_length.labels(project=project["name"], kind=kind.value).set(0)
        for slice_ in pending:
            self.queue_length.labels(project=slice_["project"], kind=slice_["kind"]).inc()
        self.window_usage.clear()
        self.entitlement.clear()
        self.share_used.clear()
        for project in projects:
            self.share_used.labels(project=project["name"]).set(project["fairshare_value"])
            self.window_usage.labels(project=project["name"]).set(project["usage"])
            self.entitlement.labels(project=project["name"]).set(project["entitlement"])
        held: dict[tuple[str, str], int] = {}
        free: dict[tuple[str, str], int] = {}
        nodes = list(nodes)
        for gpu_type in {node["gpu_type"] for node in nodes}:
            for state in NodeState:
                held[gpu_type, state.value] = free[gpu_type, state.value] = 0
        for node in nodes:
            key = (node["gpu_type"], node["state"])
            held[key] = held.get(key, 0) + node["gpus_held"]
            free[key] = free.get(key, 0) + max(0, node["gpu_count"] - node["gpus_held"])
        self.gpus_held.clear()
        self.gpus_free.clear()
        for (gpu_type, state), count in held.items():
            self.gpus_held.labels(gpu_type=gpu_type, node_state=state).set(count)
        for (gpu_type, state), count in free.items():
            self.gpus_free.labels(gpu_type=gpu_type, node_state=state).set(count)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
