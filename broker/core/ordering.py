"""Every ordering the scheduler uses, each one function whose criteria end on a stable id.

Keeping them together makes the policy readable in one place and keeps every
pass deterministic: two slices never compare equal.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

from .model import Node, Slice, SliceKind

# Bound once: on Python 3.11 a member read off its enum class goes through a slow hook.
_INTERACTIVE = SliceKind.INTERACTIVE


def within_project_key(slice_: Slice) -> tuple[int, int]:
    """A project's own order of its work: higher ``priority`` first, then
    interactive before batch (a team never waits behind its own long jobs to debug).

    Used both to order the queue and to decide which of a project's running
    slices its pending slice may preempt (strictly lower key only).
    """
    return (-slice_.priority, 0 if slice_.kind is _INTERACTIVE else 1)


def lapse_order(slice_: Slice) -> tuple[float, int]:
    """Which slices whose lease is over end first when the lapse limit holds some
    back (design.md §8): those whose lease ended longest ago, most likely gone."""
    return (slice_.lease_expires_at or 0.0, slice_.id)


def project_rank(window_order: Iterable[str], over_share: Collection[str]) -> dict[str, int]:
    """Which project's pending work is served first from free GPUs:

    1. projects holding no more than their fair share now (design.md §5.2)
       before those holding more — a grant the preemption rule would take
       back once its protection ends only churns;
    2. the window's fair-share order (:meth:`~broker.core.fairshare.ProjectTree.project_order`),
       which ends on the project name.
    """
    ordered = sorted(window_order, key=lambda name: name in over_share)  # stable: keeps 2.
    return {name: rank for rank, name in enumerate(ordered)}


def within_queue_key(slice_: Slice) -> tuple:
    """A pending slice's place within its project's queue: :func:`queue_order`'s
    criteria 3–5 as one key."""
    return (*within_project_key(slice_), slice_.submitted_at, slice_.id)


def walk_key(slice_: Slice, project_rank: Mapping[str, int]) -> tuple:
    """Where a pending slice comes among the allocated (or the unallocated) ones:
    :func:`queue_order`'s criteria 2–5 as one key (a pass puts the slices it
    requeues in by it, and the resumed pass the requests that join)."""
    return (project_rank[slice_.project], *within_queue_key(slice_))


def queue_order(pending: Iterable[Slice], project_rank: Mapping[str, int]) -> list[Slice]:
    """Pending slices in queue order (design.md §5.1):

    1. allocated before unallocated (unallocated work only backfills),
    2. the project's fair-share rank,
    3. :func:`within_project_key`,
    4. submit time,
    5. slice id.

    A pass does not sort: the index keeps each project's queue by
    :func:`within_queue_key` and joins them in rank order, and a pass puts the
    slices it requeues in by :func:`walk_key`. This is the order they keep,
    which the tests hold them to.
    """
    return sorted(pending, key=lambda s: (not s.allocated, *walk_key(s, project_rank)))


def lane_first(backlog: list[Slice], in_lane: Callable[[Slice], bool]) -> list[Slice]:
    """``backlog`` (in :func:`queue_order`) with the debug sessions the lane admits
    first, each group keeping its order (design.md §5.7).

    The debug lane lets such a session preempt batch work; it first takes free
    GPUs ahead of batch, so that a release serves it instead of a victim.
    ``in_lane`` is asked once per slice, in queue order, and records those it admits.
    """
    first = [s for s in backlog if in_lane(s)]
    if not first:
        return backlog
    chosen = {s.id for s in first}
    return first + [s for s in backlog if s.id not in chosen]


def victim_key(slice_: Slice, project_value: float) -> tuple:
    """Least harm first (design.md §5.3): which running slices to preempt before others.

    1. unallocated slices (they were free and knew it),
    2. the project furthest above its fair share now (highest standing, design.md §4),
    3. the fewest GPUs,
    4. the least work lost: the latest grant or reported checkpoint
       (``Slice.work_at_risk_since``),
    5. slice id.
    """
    return (
        0 if not slice_.allocated else 1,
        -project_value,
        slice_.gpus,
        -slice_.work_at_risk_since,
        slice_.id,
    )


def placement_key(free_after: int, weight: float, node: Node) -> tuple:
    """Which node a slice goes to when several fit.

    1. the fewest GPUs left free on the node afterwards (best fit, so that
       whole free nodes stay whole for large requests),
    2. the cheaper GPU type (only matters for requests of any type),
    3. node name.
    """
    return (free_after, weight, node.name)
