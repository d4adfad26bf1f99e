"""A job's preemption budget as people read it (design.md §5.7, rule 5).

After ``preemption_budget`` preemptions a slice under contract is no longer anyone's
victim: only a drain or a node going down ends it early. The broker states the
budget in ``GET /limits`` and each slice's ``preemptions``; every place that shows a
held slice's protection — the pages, the command line, the batch runner, the hub's
pages and Lab — tells from those two, with this module, that the slice is kept to its
end, in the same words.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from typing import Any

from .units import ordinal


def preemptions_left(slice_: Mapping[str, Any], budget: int | None) -> int | None:
    """How many more preemptions ``slice_`` (the API's view) may suffer before it is kept
    to its end; None: no limit (free work has no budget, nor has any slice where the
    policy sets none)."""
    if budget is None or not slice_.get("min_runtime"):
        return None
    return max(budget - (slice_.get("preemptions") or 0), 0)


def kept_to_end(slice_: Mapping[str, Any], budget: int | None) -> bool:
    """Whether ``slice_`` is held and has spent its preemption budget: no one preempts
    it any more (one being preempted already, by a drain or a node going down, is not)."""
    return slice_.get("state") == "granted" and preemptions_left(slice_, budget) == 0


def gpus_kept_to_end(
    slices: Iterable[Mapping[str, Any]], budget: int | None, nodes: Container[str] | None = None
) -> int:
    """GPUs that granted ``slices`` past their budget hold (on ``nodes``, where given):
    GPUs that fair share cannot move."""
    return sum(
        len(place["gpu_indices"])
        for slice_ in slices
        if kept_to_end(slice_, budget)
        for place in slice_.get("placements") or ()
        if nodes is None or place["node"] in nodes
    )


def coming_back_text(times: int, left: int) -> str:
    """For a session that comes back after its ``times``-th preemption, with ``left``
    more that its budget allows: what that means, in words."""
    then = f"after {left} more, it comes back" if left else "it comes back"
    return (
        f"This is its {ordinal(times)} preemption of the {times + left} its budget allows: "
        f"{then} kept to its end."
    )


def kept_text(slice_: Mapping[str, Any]) -> str:
    """What a slice past its budget is promised, in words."""
    times = slice_.get("preemptions") or 0
    return (
        f"kept to its end: preempted {times} time{'' if times == 1 else 's'}, its budget; "
        "only a drain or a node going down ends it early"
    )
