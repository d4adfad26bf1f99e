"""Time of one scheduling pass on a large synthetic cluster (design.md §5)."""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass

from ..core.fairshare import ProjectTree
from ..core.model import (
    Account,
    Contract,
    Node,
    Placement,
    Policy,
    Slice,
    SliceKind,
    SliceState,
    Snapshot,
)
from ..core.scheduler import schedule

HOUR = 3600.0
NOW = 1_700_000_000.0


@dataclass(frozen=True)
class Scale:
    nodes: int = 128
    gpus_per_node: int = 8
    projects: int = 40
    slices: int = 3000

    def times(self, factor: int) -> Scale:
        return Scale(self.nodes * factor, self.gpus_per_node, self.projects, self.slices * factor)


def three_level_tree(projects: int, rng: random.Random) -> list[Account]:
    """An organisation of programs of projects; shares drawn from 1..5."""
    programs = max(1, round(projects**0.5))
    accounts = [Account("org")]
    accounts += [Account(f"prog{p}", rng.randint(1, 5), "org") for p in range(programs)]
    accounts += [
        Account(f"proj{i}", rng.randint(1, 5), f"prog{i % programs}") for i in range(projects)
    ]
    return accounts


def synthetic_snapshot(scale: Scale, seed: int = 1) -> Snapshot:
    """A full cluster: running slices packed onto the nodes, the rest pending."""
    rng = random.Random(seed)
    nodes = [Node(f"node{i:05d}", "h100", scale.gpus_per_node) for i in range(scale.nodes)]
    accounts = three_level_tree(scale.projects, rng)
    projects = [a.name for a in accounts if a.name.startswith("proj")]
    slices: list[Slice] = []
    next_id = 1

    def contract() -> Contract:
        return Contract(
            rng.choice([0.0, 900.0, HOUR, 4 * HOUR]),
            rng.random() < 0.5,
            rng.choice([None, None, 8 * HOUR]),
        )

    for node in nodes:
        free = node.gpu_count
        while free and len(slices) < scale.slices // 2:
            gpus = min(free, rng.choice([1, 1, 2, 4, 8]))
            kind = SliceKind.INTERACTIVE if rng.random() < 0.2 else SliceKind.BATCH
            first = node.gpu_count - free
            slices.append(
                Slice(
                    id=next_id,
                    project=rng.choice(projects),
                    user=f"user{rng.randrange(150)}",
                    gpus=gpus,
                    kind=kind,
                    contract=contract(),
                    submitted_at=NOW - rng.uniform(HOUR, 10 * HOUR),
                    state=SliceState.GRANTED,
                    placements=(Placement(node.name, tuple(range(first, first + gpus))),),
                    granted_at=NOW - rng.uniform(0, 6 * HOUR),
                )
            )
            next_id += 1
            free -= gpus
    while len(slices) < scale.slices:
        kind = SliceKind.INTERACTIVE if rng.random() < 0.3 else SliceKind.BATCH
        gpus = rng.choice([1, 1, 1, 2, 4, 8] + ([16, 32] if kind is SliceKind.BATCH else []))
        slices.append(
            Slice(
                id=next_id,
                project=rng.choice(projects),
                user=f"user{rng.randrange(150)}",
                gpus=gpus,
                kind=kind,
                contract=contract(),
                priority=rng.randint(-1, 1),
                submitted_at=NOW - rng.uniform(0, HOUR),
            )
        )
        next_id += 1
    usage = {p: rng.uniform(0, 7 * 24 * HOUR * 8) for p in projects}
    return Snapshot(
        now=NOW,
        nodes=tuple(nodes),
        accounts=tuple(accounts),
        slices=tuple(slices),
        usage=usage,
        policy=Policy(),
    )


def time_passes(snapshot: Snapshot, repeat: int) -> dict:
    tree = ProjectTree(snapshot.accounts)
    durations = []
    cpu = []  # CPU time too: on a shared machine it is steadier than wall time
    decisions = None
    for _ in range(repeat):
        started, started_cpu = time.perf_counter(), time.thread_time()
        decisions = schedule(snapshot, tree)
        durations.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - started_cpu)
    durations.sort()
    cpu.sort()
    assert decisions is not None
    return {
        "gpus": sum(n.gpu_count for n in snapshot.nodes),
        "nodes": len(snapshot.nodes),
        "projects": sum(1 for a in snapshot.accounts if a.name.startswith("proj")),
        "slices": len(snapshot.slices),
        "running": sum(1 for s in snapshot.slices if s.holds_gpus),
        "pending": sum(1 for s in snapshot.slices if not s.holds_gpus),
        "repeat": repeat,
        "median_ms": round(statistics.median(durations) * 1000, 3),
        "p99_ms": round(_p99(durations) * 1000, 3),
        "cpu_median_ms": round(statistics.median(cpu) * 1000, 3),
        "cpu_p99_ms": round(_p99(cpu) * 1000, 3),
        "decisions": {
            "grants": len(decisions.grants),
            "preemptions": len(decisions.preemptions),
            "reservations": len(decisions.reservations),
        },
    }


def _p99(sorted_values: list[float]) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(0.99 * len(sorted_values)))]


def run(repeat: int = 100, factors: tuple[int, ...] = (1, 8)) -> dict:
    base = Scale()
    results = [time_passes(synthetic_snapshot(base.times(f)), repeat) for f in factors]
    report: dict = {"benchmark": "scheduling_pass", "results": results}
    if len(results) >= 2:
        small, large = results[0], results[-1]
        n_ratio = large["slices"] / small["slices"]
        nlogn = n_ratio * math.log(large["slices"]) / math.log(small["slices"])
        report["growth"] = {
            "size_ratio": n_ratio,
            "median_ratio": round(large["median_ms"] / small["median_ms"], 2),
            "n_log_n_ratio": round(nlogn, 2),
        }
    return report
