"""What would start a waiting request sooner (design.md §5.8): the same pure pass,
asked of the same snapshot with one request changed.

Before a request is made, :func:`expected_starts` asks the same pass when one
like it would start, for each size and GPU type a form offers.

For a pending slice, :func:`alternatives` tries fewer GPUs, another GPU type, a
shorter protected period, another of its user's projects and a debug-length
session, each as one pass of :func:`~broker.core.scheduler.schedule` on the
snapshot with only that request changed, and keeps those that start now or
sooner than the request as it is. Nothing else in the snapshot changes, so
each answer is exactly what the broker would decide if the user chose it now.

Each pass starts from a copy of one index of the snapshot's slices (the
service's kept one where it is given), told that the changed request alone
differs (:meth:`~broker.core.incremental.PassState.expect`), so that only it is
filed: what-if passes differ from the real one in one slice, and filing every
slice again for each was a third of their cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from .fairshare import ProjectTree
from .incremental import PassState
from .model import HOUR, Contract, Decisions, Node, NodeState, Slice, SliceKind, Snapshot
from .preemption import is_debug
from .scheduler import schedule

#: Protected periods a shorter contract is tried with, longest first (seconds); of
#: those that start as soon, the longest is offered.
SHORTER_PROTECTION = (4 * HOUR, 2 * HOUR, HOUR, 15 * 60.0)


@dataclass(frozen=True, slots=True)
class Alternative:
    """One change to a waiting request and what the pass says it would bring.

    ``change`` names what differs (``gpus``, ``gpu_type``, ``min_runtime``,
    ``project``, ``debug``); ``fields`` are the request's fields with that
    change, as ``POST /slices`` takes them; ``starts_at`` is now when it would be
    granted at once, else its estimated start; ``gpu_hours`` is the GPU-time its
    protected period commits the project to (weighted as charged).
    """

    change: str
    fields: dict
    starts_at: float
    gpu_hours: float


@dataclass(frozen=True, slots=True)
class WhatIf:
    """The request as it is (``starts_at`` None: no estimate) and what would be sooner."""

    slice_id: int
    starts_at: float | None
    alternatives: tuple[Alternative, ...]


def alternatives(
    snapshot: Snapshot,
    slice_id: int,
    *,
    projects: Iterable[str] = (),
    tree: ProjectTree | None = None,
    index: PassState | None = None,
    max_passes: int = 8,
) -> WhatIf:
    """What would start pending slice ``slice_id`` sooner, at most ``max_passes`` passes.

    ``projects`` are the other projects its user may charge. ``index``: an index
    of the live slices to start from (left as it was), as kept by the service's
    pass; it brings its own tree. Alternatives are ordered by when they start,
    then by their GPU-hours, then by ``change`` (a stable order); only those
    sooner than the request as it is are kept.
    """
    at, request = next((i, s) for i, s in enumerate(snapshot.slices) if s.id == slice_id)
    base = _base_index(snapshot, tree, index)
    current = _start(schedule(snapshot, index=base), slice_id, snapshot.now)
    found: list[Alternative] = []
    for change, variant in _variants(request, snapshot, projects):
        if max_passes <= 1:
            break
        max_passes -= 1
        slices = (*snapshot.slices[:at], variant, *snapshot.slices[at + 1 :])
        starts = _start(_pass_with(base, snapshot, slices, variant), slice_id, snapshot.now)
        if starts is None or (current is not None and starts >= current):
            continue
        if change == "min_runtime" and any(
            a.change == change and a.starts_at <= starts for a in found
        ):
            continue  # a longer protection starts as soon: shorter buys nothing more
        found.append(Alternative(change, _fields(variant), starts, _gpu_hours(variant, snapshot)))
    found.sort(key=lambda a: (a.starts_at, a.gpu_hours, a.change))
    return WhatIf(slice_id, current, tuple(found))


@dataclass(frozen=True, slots=True)
class ExpectedStart:
    """When a new request of ``gpus`` GPUs of ``gpu_type`` would start: ``now`` if
    granted at once, else the pass's estimate (``None``: it gives none)."""

    gpu_type: str
    gpus: int
    starts_at: float | None


def expected_starts(
    snapshot: Snapshot,
    request: Slice,
    shapes: Iterable[tuple[str, int]],
    *,
    tree: ProjectTree | None = None,
    index: PassState | None = None,
) -> tuple[ExpectedStart, ...]:
    """When ``request`` (a new pending slice, not in ``snapshot``) would start as each
    ``(gpu_type, gpus)`` of ``shapes``: one pass each, with it added to the queue as
    submitted now and nothing else changed. ``index`` as for :func:`alternatives`."""
    base = _base_index(snapshot, tree, index)
    base.update(snapshot)
    found = []
    for gpu_type, gpus in shapes:
        asked = replace(request, gpu_type=gpu_type, gpus=gpus, submitted_at=snapshot.now)
        slices = (*snapshot.slices, asked)
        starts = _start(_pass_with(base, snapshot, slices, asked), asked.id, snapshot.now)
        found.append(ExpectedStart(gpu_type, gpus, starts))
    return tuple(found)


def request_shapes(nodes: Iterable[Node]) -> list[tuple[str, int]]:
    """``(gpu_type, gpus)`` a form offers, by type: 1, 2, 4, … and the type's largest
    node, on the nodes that are not down."""
    largest: dict[str, int] = {}
    for node in nodes:
        if node.state is not NodeState.DOWN:
            largest[node.gpu_type] = max(largest.get(node.gpu_type, 0), node.gpu_count)
    shapes = []
    for gpu_type, most in sorted(largest.items()):
        sizes = {1 << power for power in range(most.bit_length()) if 1 << power <= most}
        shapes += [(gpu_type, gpus) for gpus in sorted({*sizes, most})]
    return shapes


def _pass_with(
    base: PassState, snapshot: Snapshot, slices: tuple[Slice, ...], changed: Slice
) -> Decisions:
    """One pass on ``snapshot`` with ``slices`` (its own, but for ``changed``), from a
    copy of ``base`` (an index of ``snapshot``) told that ``changed`` alone differs:
    the copy files that one slice, not every slice compared again."""
    index = base.copy()
    index.expect({changed.id: changed})
    return schedule(replace(snapshot, slices=slices), index=index)


def _base_index(snapshot: Snapshot, tree: ProjectTree | None, index: PassState | None) -> PassState:
    """A copy of ``index``, or a new index on ``tree`` (or the snapshot's own)."""
    if index is not None:
        return index.copy()
    return PassState(tree or ProjectTree(snapshot.accounts))


def _variants(
    request: Slice, snapshot: Snapshot, projects: Iterable[str]
) -> Iterator[tuple[str, Slice]]:
    """The changed requests worth a pass, cheapest change first."""
    if request.gpus > 1:
        for gpus in sorted({request.gpus // 2, 1}, reverse=True):
            yield "gpus", replace(request, gpus=gpus)
    if request.gpu_type is not None:  # a request of any type has no other to try
        for gpu_type in sorted({node.gpu_type for node in snapshot.nodes} - {request.gpu_type}):
            yield "gpu_type", replace(request, gpu_type=gpu_type)
    policy = snapshot.policy
    protected = request.contract.min_runtime
    for shorter in SHORTER_PROTECTION:
        if policy.debug_max_min_runtime < shorter < protected:
            contract = replace(request.contract, min_runtime=shorter)
            yield "min_runtime", replace(request, contract=contract)
    debug = replace(
        request,
        kind=SliceKind.INTERACTIVE,
        gpus=min(request.gpus, policy.debug_max_gpus),
        contract=Contract(policy.debug_max_min_runtime, False, request.contract.max_runtime),
    )
    if not is_debug(request, policy) and is_debug(debug, policy):
        yield "debug", debug
    for project in sorted(set(projects) - {request.project}):
        yield "project", replace(request, project=project)


def _start(decisions: Decisions, slice_id: int, now: float) -> float | None:
    """When the pass says ``slice_id`` starts: now if granted, else its estimate."""
    if any(grant.slice_id == slice_id for grant in decisions.grants):
        return now
    for entry in decisions.queue:
        if entry.slice_id == slice_id:
            return entry.estimated_start
    return None


def _fields(slice_: Slice) -> dict:
    return {
        "project": slice_.project,
        "gpus": slice_.gpus,
        "gpu_type": slice_.gpu_type,
        "kind": slice_.kind.value,
        "min_runtime": slice_.contract.min_runtime,
    }


def _gpu_hours(slice_: Slice, snapshot: Snapshot) -> float:
    """GPU-hours the protected period commits to: on the requested type's weight, or
    the cheapest type's when any type will do."""
    if slice_.gpu_type is not None:
        weight = snapshot.weight(slice_.gpu_type)
    else:
        weight = min((snapshot.weight(n.gpu_type) for n in snapshot.nodes), default=1.0)
    return slice_.gpus * weight * slice_.contract.min_runtime / HOUR
