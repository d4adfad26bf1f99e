"""Backfill with reservations (design.md §5.6): large requests do not starve behind small ones.

For a high-ranked request that does not fit now, the GPUs expected to free
up first are reserved for it; later work may use reserved GPUs only if it
will be gone before the reservation is due.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence

from .model import Contract, Node, Placement, Reservation, Slice, SliceKind

#: A node's expected releases for one requester: (time, GPUs freed) pairs, earliest first.
Releases = Callable[[str], Sequence[tuple[float, int]]]
#: Per GPU type, each node with a time no sooner than which it could be wholly
#: free, whoever asks: ``(floor, node)`` pairs in order.
Floors = Mapping[str, Iterable[tuple[float, str]]]


def plan(
    requester: Slice,
    *,
    nodes: Mapping[str, Node],
    free: Mapping[str, set[int]],
    releases: Releases,
    now: float,
    whole_node_floors: Floors | None = None,
    most_freed: Callable[[str], int | None] | None = None,
) -> Reservation | None:
    """A reservation of the GPUs that free up soonest for ``requester``, or None
    when no release time is known.

    A single-node request waits for the node on which enough GPUs free up
    first; a batch request larger than any node waits for whole nodes, earliest
    first (other work never spans nodes: it gets no reservation). Ties go to the
    node name. ``releases`` tells, per node, when its holders are expected to
    give back how many GPUs to this requester; ``whole_node_floors``, if given,
    ``nodes`` by a time no sooner than which each could be wholly free, so that a
    gang asks a large cluster's nodes in that order and only until the earliest
    are known. ``most_freed``, if given, bounds per node the GPUs that could ever be
    free for ``requester``, free ones included (None: no bound), so that a gang
    asks no releases of a node that can never be wholly free for it.
    """
    eligible = [
        n for n in nodes.values() if requester.gpu_type is None or n.gpu_type == requester.gpu_type
    ]
    if not eligible:
        return None
    largest = max(n.gpu_count for n in eligible)
    if requester.gpus > largest and requester.kind is not SliceKind.BATCH:
        return None  # only batch work spans nodes; a session waits for a node it fits
    if not takes_whole_nodes(requester, largest):
        best: tuple[float, str] | None = None
        for node in eligible:
            if node.gpu_count < requester.gpus:
                continue
            due = _time_to_free(node, requester.gpus, free, releases, now)
            if due is not None and (best is None or (due, node.name) < best):
                best = (due, node.name)
        if best is None:
            return None
        due, name = best
        return Reservation(
            requester.id, (Placement(name, tuple(sorted(free.get(name, ())))),), False, due
        )

    def due_of(name: str) -> float | None:
        node = nodes[name]
        if most_freed is not None:
            bound = most_freed(name)
            if bound is not None and bound < node.gpu_count:
                return None
        return _time_to_free(node, node.gpu_count, free, releases, now)

    by_type: dict[str, list[tuple[float, str]]] = {}
    if whole_node_floors is None:
        for node in eligible:
            due = due_of(node.name)
            if due is not None:
                by_type.setdefault(node.gpu_type, []).append((due, node.name))
    else:
        for gpu_type, candidates in whole_node_floors.items():
            if requester.gpu_type is None or gpu_type == requester.gpu_type:
                by_type[gpu_type] = _earliest_whole_nodes(candidates, requester.gpus, nodes, due_of)
    best_gang: tuple[float, str, list[str]] | None = None
    for gpu_type, times in by_type.items():
        times.sort()
        taken: list[str] = []
        count = 0
        for due, name in times:
            taken.append(name)
            count += nodes[name].gpu_count
            if count >= requester.gpus:
                if best_gang is None or (due, gpu_type) < best_gang[:2]:
                    best_gang = (due, gpu_type, taken)
                break
    if best_gang is None:
        return None
    due, _, names = best_gang
    placements = tuple(Placement(name, tuple(sorted(free.get(name, ())))) for name in sorted(names))
    return Reservation(requester.id, placements, False, due)


def takes_whole_nodes(requester: Slice, largest: int) -> bool:
    """Whether :func:`plan` reserves whole nodes for ``requester``, the largest of
    the nodes of its GPU type holding ``largest`` GPUs."""
    return requester.kind is SliceKind.BATCH and requester.gpus > largest


def _earliest_whole_nodes(
    candidates: Sequence[tuple[float, str]],
    gpus: int,
    nodes: Mapping[str, Node],
    due_of: Callable[[str], float | None],
) -> list[tuple[float, str]]:
    """``(due, node)`` of the nodes ``candidates`` names, earliest first, as far as
    the first ones holding ``gpus`` GPUs between them (all of them if they never
    do); the rest may be left out.

    ``candidates`` are ``(floor, node)`` pairs in order, no node due before its
    floor: once the nodes found due before the next floor hold ``gpus``, no node
    yet to be asked can come before them.
    """
    found: list[tuple[float, str]] = []  # a heap, of nodes not yet known to come first
    first: list[tuple[float, str]] = []
    held = 0
    for floor, name in candidates:
        while found and found[0] < (floor, name):
            entry = heapq.heappop(found)
            first.append(entry)
            held += nodes[entry[1]].gpu_count
            if held >= gpus:
                return first
        due = due_of(name)
        if due is not None:
            heapq.heappush(found, (due, name))
    return first + sorted(found)


def _time_to_free(
    node: Node,
    gpus: int,
    free: Mapping[str, set[int]],
    releases: Releases,
    now: float,
) -> float | None:
    """When ``gpus`` GPUs of ``node`` will be free, if the holders' ends are known."""
    available = len(free.get(node.name, ()))
    if available >= gpus:
        return now
    for at, held in releases(node.name):
        available += held
        if available >= gpus:
            return max(at, now)
    return None


def outlasts(contract: Contract, now: float, grace: float, due: float) -> bool:
    """Whether work under ``contract`` granted at ``now`` would still hold its GPUs
    when a reservation falls ``due``: its protection and a grace period run past
    that time, and no maximum runtime ends it by then. Such work may borrow none of
    the reservation's GPUs (the first test of every borrow)."""
    return now + contract.min_runtime + grace > due and (
        contract.max_runtime is None or now + contract.max_runtime > due
    )
