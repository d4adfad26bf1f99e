"""Time of one scheduling pass on a large synthetic cluster (design.md §5).

Beside it, in the same run: a minimal pass (sort the backlog, best-fit what
fits onto free GPUs, nothing else) as the reference, and the pass from kept
state (:class:`~broker.core.incremental.PassState`) after one change; all three
again from the state the passes settle the first size into (``settled``).
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from operator import attrgetter

from ..core.fairshare import ProjectTree
from ..core.incremental import PassState
from ..core.model import (
    Account,
    Contract,
    Grant,
    Node,
    NodeState,
    Placement,
    Policy,
    Slice,
    SliceKind,
    SliceState,
    Snapshot,
)
from ..core.placement import FreeGpus
from ..core.scheduler import schedule
from ..core.transitions import apply
from ..core.whatif import alternatives, expected_starts, request_shapes

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


def settled(snapshot: Snapshot, step: float = 61.0, most: int = 200) -> tuple[Snapshot, int]:
    """``snapshot`` after passes ``step`` seconds apart, each pass's decisions applied,
    until a pass grants, preempts and ends nothing (at most ``most`` passes): a state
    such as the service is in between two changes, where the synthetic snapshot is
    one that no pass left (it preempts dozens at once). Returns it and the passes."""
    tree = ProjectTree(snapshot.accounts)
    for passes in range(1, most + 1):
        decisions = schedule(snapshot, tree)
        if not (decisions.grants or decisions.preemptions or decisions.endings):
            return snapshot, passes
        applied = apply(
            {s.id: s for s in snapshot.slices},
            {n.name: n for n in snapshot.nodes},
            decisions,
            snapshot.now,
            snapshot.gpu_type_weights,
        )
        snapshot = replace(
            snapshot,
            now=snapshot.now + step,
            slices=tuple(applied.slices[i] for i in sorted(applied.slices)),
            nodes=tuple(applied.nodes[n] for n in sorted(applied.nodes)),
        )
    raise RuntimeError(f"the snapshot did not settle in {most} passes")


def minimal_pass(snapshot: Snapshot) -> list[Grant]:
    """The reference: pending work sorted by submit time, each request best-fit
    onto the free GPUs left (the pass's own free map), no fair share,
    preemption, reservation or queue shown to users."""
    ready = [n for n in snapshot.nodes if n.state is NodeState.READY]
    held = (p for s in snapshot.slices if s.holds_gpus for p in s.placements)
    free = FreeGpus(ready, snapshot.gpu_type_weights, held)
    pending = sorted(
        (s for s in snapshot.slices if s.state is SliceState.PENDING),
        key=attrgetter("submitted_at", "id"),
    )
    grants = []
    for slice_ in pending:
        placements = free.fit(slice_.gpus, slice_.gpu_type, slice_.kind is SliceKind.BATCH)
        if placements is not None:
            free.take(placements)
            grants.append(Grant(slice_.id, placements))
    return grants


def one_change_at_a_time(snapshot: Snapshot, count: int) -> list[Snapshot]:
    """``count`` snapshots, each one change after the one before: a second
    later, a new request submitted, then withdrawn again, and so on."""
    rng = random.Random(2)
    projects = sorted({s.project for s in snapshot.slices})
    next_id = max(s.id for s in snapshot.slices) + 1
    snapshots = []
    current = snapshot
    for i in range(count):
        slices = current.slices
        if i % 2 == 0:
            gpus = rng.choice([1, 2, 4, 8])
            kind = rng.choice(list(SliceKind))
            new = Slice(
                id=next_id,
                project=rng.choice(projects),
                user="user0",
                gpus=gpus,
                kind=kind,
                contract=Contract(HOUR),
                submitted_at=current.now,
            )
            next_id += 1
            slices = (*slices, new)
        else:
            slices = slices[:-1]
        current = replace(current, now=current.now + 1.0, slices=slices)
        snapshots.append(current)
    return snapshots


def _timed(run: Callable[[], object], durations: list[float], cpu: list[float]) -> None:
    started, started_cpu = time.perf_counter(), time.thread_time()
    run()
    durations.append(time.perf_counter() - started)
    cpu.append(time.thread_time() - started_cpu)


def _summary(durations: list[float], cpu: list[float]) -> dict:
    durations, cpu = sorted(durations), sorted(cpu)
    return {
        "median_ms": round(statistics.median(durations) * 1000, 3),
        "p99_ms": round(_p99(durations) * 1000, 3),
        "cpu_median_ms": round(statistics.median(cpu) * 1000, 3),
        "cpu_p99_ms": round(_p99(cpu) * 1000, 3),
    }


def time_passes(snapshot: Snapshot, repeat: int) -> dict:
    """The pass, the minimal reference and the kept-state pass, interleaved so
    that a busy moment of the machine falls on all three alike."""
    tree = ProjectTree(snapshot.accounts)
    changed = one_change_at_a_time(snapshot, repeat)
    kept = PassState(tree)
    schedule(snapshot, index=kept)
    decisions = schedule(snapshot, tree)
    # Everything built so far lives for the whole run: out of the collector's
    # way, as the service does after start-up.
    gc.collect()
    gc.freeze()
    full: tuple[list[float], list[float]] = ([], [])
    minimal: tuple[list[float], list[float]] = ([], [])
    incremental: tuple[list[float], list[float]] = ([], [])
    try:
        for after_one_change in changed:
            _timed(partial(schedule, snapshot, tree), *full)
            _timed(partial(minimal_pass, snapshot), *minimal)
            _timed(partial(schedule, after_one_change, index=kept), *incremental)
    finally:
        gc.unfreeze()
    same = schedule(changed[-1], index=kept) == schedule(changed[-1], tree)
    result = {
        "gpus": sum(n.gpu_count for n in snapshot.nodes),
        "nodes": len(snapshot.nodes),
        "projects": sum(1 for a in snapshot.accounts if a.name.startswith("proj")),
        "slices": len(snapshot.slices),
        "running": sum(1 for s in snapshot.slices if s.holds_gpus),
        "pending": sum(1 for s in snapshot.slices if not s.holds_gpus),
        "repeat": repeat,
        **_summary(*full),
        "minimal": _summary(*minimal),
        "incremental_after_one_change": _summary(*incremental),
        "incremental_same_decisions": same,
        "decisions": {
            "grants": len(decisions.grants),
            "preemptions": len(decisions.preemptions),
            "reservations": len(decisions.reservations),
        },
    }
    for figure in ("median_ms", "p99_ms"):
        result[f"ratio_to_minimal_{figure[:-3]}"] = round(
            result[figure] / result["minimal"][figure], 2
        )
    return result


def time_what_if(snapshot: Snapshot, repeat: int) -> dict:
    """What a waiting request's "start now if…" costs (design.md §5.8), beside the
    pass in the same run: the what-if passes for the first blocked requests."""
    tree = ProjectTree(snapshot.accounts)
    # The service asks from the index its pass keeps; also timed: from none.
    kept = PassState(tree)
    decisions = schedule(snapshot, index=kept)
    granted = {g.slice_id for g in decisions.grants}
    waiting = [s.id for s in snapshot.slices if not s.holds_gpus and s.id not in granted]
    one_pass: tuple[list[float], list[float]] = ([], [])
    what_if: tuple[list[float], list[float]] = ([], [])
    from_scratch: tuple[list[float], list[float]] = ([], [])
    answers = {}
    for slice_id in waiting[:repeat]:
        _timed(partial(schedule, snapshot, tree), *one_pass)
        ask = partial(alternatives, snapshot, slice_id, index=kept)
        _timed(lambda ask=ask, slice_id=slice_id: answers.update({slice_id: ask()}), *what_if)
        _timed(partial(alternatives, snapshot, slice_id, tree=tree), *from_scratch)
    offered = sum(1 for found in answers.values() if found.alternatives)
    result = {
        "requests": len(waiting[:repeat]),
        "with_an_alternative": offered,
        "one_pass": _summary(*one_pass),
        "what_if": _summary(*what_if),
        "what_if_without_kept_index": _summary(*from_scratch),
    }
    result["ratio_to_one_pass_median"] = round(
        result["what_if"]["median_ms"] / result["one_pass"]["median_ms"], 2
    )
    # The form's expected starts: one pass per GPU type and size, for a new request of
    # each project in turn.
    shapes = request_shapes(snapshot.nodes)
    next_id = max((s.id for s in snapshot.slices), default=0) + 1
    template = next(s for s in snapshot.slices if s.kind is SliceKind.INTERACTIVE)
    form: tuple[list[float], list[float]] = ([], [])
    for project in sorted({s.project for s in snapshot.slices})[:repeat]:
        request = replace(template, id=next_id, project=project, state=SliceState.PENDING)
        _timed(partial(expected_starts, snapshot, request, shapes, index=kept), *form)
    result["expected_starts"] = {"shapes": len(shapes), **_summary(*form)}
    result["expected_starts_ratio_to_one_pass_median"] = round(
        result["expected_starts"]["median_ms"] / result["one_pass"]["median_ms"], 2
    )
    return result


def _p99(sorted_values: list[float]) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(0.99 * len(sorted_values)))]


def run(repeat: int = 100, factors: tuple[int, ...] = (1, 8)) -> dict:
    base = Scale()
    results = [time_passes(synthetic_snapshot(base.times(f)), repeat) for f in factors]
    report: dict = {"benchmark": "scheduling_pass", "results": results}
    # The service's case: a state its passes settled, then one change at a time.
    calm, passes = settled(synthetic_snapshot(base))
    report["settled"] = {"passes_to_settle": passes, **time_passes(calm, repeat)}
    # Eight passes each: a tenth as many requests keeps the run's length.
    report["what_if"] = time_what_if(synthetic_snapshot(base), max(3, repeat // 10))
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
