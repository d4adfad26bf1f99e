"""When an idle GPU session is stopped (design.md §3 idleness, §7): the rule, as pure functions.

An idle session costs its project and may keep others waiting. The rule keeps
the contract the user chose on the form:

- **protected** (before ``protected_until``): stopped only after
  ``protected`` seconds idle, *and* only while a waiting request could use its
  GPUs now;
- **past its protection** (or free): stopped after ``busy`` seconds idle while
  a waiting request could use its GPUs now, else after ``idle`` seconds
  (the GPU time is charged whether anyone waits or not).

"Could use its GPUs now" (:func:`waiter_for`) means a pending request of a
matching GPU type that does not fit in the GPUs free now but fits once this
session's GPUs are free too, on a node that takes work (``ready``). A request
that cannot run either way — too large, another type, or the only node
draining or down — is never a reason to stop anyone; nor is one that fits in
free GPUs already (it waits for something else, such as its budget or the next pass).
Nor is a request of the session's own user: nobody's session is stopped to make room for
their own request. Sessions already stopped for a request count as freed (``freeing``:
node -> GPUs on their way back), so that the hub stops only as many as the waiting work
can use, not every idle session that could serve it.

The spawner (:mod:`spawner.mixin`) applies the rule to its own session: it
holds the slice and the broker's connection, so it can warn first and record
why the session ended (``culled_idle``), which a culler outside the hub cannot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The end reason the hub records (and shows) for a session stopped by this rule.
CULLED_IDLE = "culled_idle"


@dataclass(frozen=True, slots=True)
class CullLimits:
    """Idle limits in seconds; 0 turns a limit off (never stop for that reason)."""

    idle: float = 3600.0  # past protection, nobody waiting could use the GPUs
    busy: float = 900.0  # past protection, a waiting request could use them now
    protected: float = 3600.0  # protected, a waiting request could use them now


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the rule says about one session now.

    ``limit`` is the idle limit that applies (``None``: the session may idle
    for ever as things stand); ``waiter`` the id of a waiting request that
    could use its GPUs now, if any; ``protected`` whether the session is
    within its protected period.
    """

    limit: float | None
    waiter: int | None
    protected: bool

    def due(self, idle_seconds: float) -> bool:
        return self.limit is not None and idle_seconds >= self.limit

    def left(self, idle_seconds: float) -> float | None:
        """Seconds of idleness left before the session is stopped (``None``: never)."""
        return None if self.limit is None else max(self.limit - idle_seconds, 0.0)


def gpus_by_node(slice_: Mapping[str, Any]) -> Counter[str]:
    """The GPUs a slice holds on each node (its ``placements``)."""
    held: Counter[str] = Counter()
    for placement in slice_.get("placements") or ():
        held[placement["node"]] += len(placement.get("gpu_indices") or ())
    return held


def _by_name(nodes: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {node["name"]: node for node in nodes}


def _free(node: Mapping[str, Any], freeing: Mapping[str, int] | None = None) -> int:
    """GPUs a node could grant now (with those ``freeing`` gives back): none unless it
    takes work."""
    if node.get("state") != "ready" or not node.get("in_config", True):
        return 0
    held = int(node.get("gpus_held") or 0) - (freeing or {}).get(node.get("name"), 0)
    return max(int(node.get("gpu_count") or 0) - max(held, 0), 0)


def waiter_for(
    session: Mapping[str, Any],
    pending: Iterable[Mapping[str, Any]],
    nodes: Sequence[Mapping[str, Any]],
    freeing: Mapping[str, int] | None = None,
    idle_beside: Mapping[str, int] | None = None,
) -> Mapping[str, Any] | None:
    """The first waiting request (queue order) that could run now on ``session``'s GPUs.

    ``session`` is the held slice (``placements``, ``gpus``, ``user``), ``pending``
    the broker's pending slices, ``nodes`` its ``GET /nodes``, ``freeing`` the GPUs
    (node -> count) of sessions already being stopped, ``idle_beside`` those of the
    other sessions on each node that are idle long enough to be stopped for a waiting
    request too: a request that needs this session's GPUs and theirs counts (the
    others follow in the same round, their GPUs then counted as freeing). A request
    fits on one node, or across the ready nodes of its type when it is larger than
    any one of them. The session's own user's requests are left out.
    """
    by_name = _by_name(nodes)
    placements = session.get("placements") or ()
    if not placements:
        return None
    home = by_name.get(placements[0]["node"])
    if home is None or home.get("state") != "ready":
        return None  # freed GPUs on a draining or down node go to nobody
    kind = home.get("gpu_type")
    held = int(session.get("gpus") or 0)
    beside = (idle_beside or {}).get(home["name"], 0)
    owner = session.get("user")
    waiting = sorted(
        (
            p
            for p in pending
            if p.get("id") != session.get("id") and not (owner and p.get("user") == owner)
        ),
        key=lambda p: (p.get("queue_position") or 1 << 30, p.get("id") or 0),
    )
    for request in waiting:
        wanted = request.get("gpu_type")
        if wanted not in (None, "", kind):
            continue
        need = int(request.get("gpus") or 0)
        same_type = [n for n in nodes if n.get("gpu_type") == kind]
        free_total = sum(_free(n, freeing) for n in same_type)
        largest = max((int(n.get("gpu_count") or 0) for n in same_type), default=0)
        if need <= max((_free(n, freeing) for n in same_type), default=0):
            continue  # it fits without this session (or with those being stopped)
        fits_here = need <= _free(home, freeing) + held + beside
        fits_across = need > largest and free_total < need <= free_total + held
        if fits_here or fits_across:
            return request
    return None


def verdict(
    session: Mapping[str, Any],
    now: float,
    limits: CullLimits,
    waiter: Mapping[str, Any] | None,
) -> Verdict:
    """The idle limit that applies to ``session`` (a granted slice) at ``now``."""
    until = session.get("protected_until")
    protected = bool(session.get("min_runtime")) and until is not None and now < until
    waiter_id = waiter.get("id") if waiter else None
    if protected:
        limit = limits.protected if waiter else 0.0
    else:
        limit = limits.busy if waiter else limits.idle
    return Verdict(limit if limit > 0 else None, waiter_id, protected)


__all__ = ["CULLED_IDLE", "CullLimits", "Verdict", "gpus_by_node", "verdict", "waiter_for"]
