"""Where a slice goes: free GPUs per node and the choice of GPUs for a request.

Nodes are kept in buckets by free-GPU count so that a best-fit lookup costs
at most one step per possible count rather than one per node.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable, Mapping

from .model import Node, Placement
from .ordering import placement_key


class FreeGpus:
    """The free GPU indices of every ``ready`` node, changed as the pass decides."""

    def __init__(
        self,
        nodes: Iterable[Node],
        weights: Mapping[str, float],
        taken: Iterable[Placement] = (),
    ):
        """``taken``: GPUs already in use (same as :meth:`take` after, but cheaper)."""
        self.nodes: dict[str, Node] = {n.name: n for n in nodes}
        self.weights = weights
        self.free: dict[str, set[int]] = {
            name: set(range(node.gpu_count)) for name, node in self.nodes.items()
        }
        for placement in taken:
            free = self.free.get(placement.node)
            if free is not None:
                free.difference_update(placement.gpu_indices)
        self.free_total = sum(map(len, self.free.values()))  # free GPUs of every node
        # How many takes and gives moved a GPU so far: what a pass works out from this
        # map (a reservation's plan) holds while the count stays.
        self.changes = 0
        self._most_free = (-1, 0)  # (changes, most_free()) when last worked out
        # Nodes whose set of free GPUs is this map's alone: a copy shares every set
        # until one side changes it (a pass copies the kept map and changes a few).
        self._own: set[str] = set(self.free)
        self.largest: dict[str, int] = {}
        self.total: dict[str, int] = {}
        for node in self.nodes.values():
            gpu_type, count = node.gpu_type, node.gpu_count
            if count > self.largest.get(gpu_type, -1):
                self.largest[gpu_type] = count
            self.total[gpu_type] = self.total.get(gpu_type, 0) + count
        # gpu_type -> free count -> node names, sorted; built in one go, as every
        # pass builds it anew for every node.
        self._buckets: dict[str, list[list[str]]] = {
            gpu_type: [[] for _ in range(largest + 1)] for gpu_type, largest in self.largest.items()
        }
        for name in sorted(self.nodes):
            self._buckets[self.nodes[name].gpu_type][len(self.free[name])].append(name)
        # Any type, cheapest first; the set of types is fixed once built.
        self._cheapest_first = sorted(self._buckets, key=lambda t: (weights.get(t, 1.0), t))

    def copy(self) -> FreeGpus:
        """A free map of its own to change, as this one is now (nodes and weights shared)."""
        other = FreeGpus.__new__(FreeGpus)
        other.nodes, other.weights = self.nodes, self.weights
        other.free = dict(self.free)  # every set shared now: neither side owns one
        other._own, self._own = set(), set()
        other.free_total = self.free_total
        other.changes, other._most_free = self.changes, self._most_free
        other.largest, other.total = dict(self.largest), dict(self.total)
        other._buckets = {t: [list(b) for b in buckets] for t, buckets in self._buckets.items()}
        other._cheapest_first = self._cheapest_first
        return other

    def _bucket(self, gpu_type: str, count: int) -> list[str]:
        buckets = self._buckets.setdefault(gpu_type, [])
        while len(buckets) <= count:
            buckets.append([])
        return buckets[count]

    def _move(self, name: str, before: int) -> None:
        node = self.nodes[name]
        self._bucket(node.gpu_type, before).remove(name)
        insort(self._bucket(node.gpu_type, len(self.free[name])), name)

    def take(self, placements: Iterable[Placement]) -> None:
        """Mark GPUs as used; GPUs already taken or on other nodes are ignored."""
        self._change(placements, set.difference_update)

    def give(self, placements: Iterable[Placement]) -> None:
        """Mark GPUs as free again: only GPUs their node has (a node may have been
        made smaller under the slices that held them)."""
        nodes = self.nodes
        self._change(
            (
                Placement(p.node, tuple(i for i in p.gpu_indices if i < nodes[p.node].gpu_count))
                for p in placements
                if p.node in nodes
            ),
            set.update,
        )

    def _change(self, placements: Iterable[Placement], how) -> None:
        for placement in placements:
            free = self.free.get(placement.node)
            if free is None:
                continue
            if placement.node not in self._own:  # shared with a copy: change its own
                free = self.free[placement.node] = set(free)
                self._own.add(placement.node)
            before = len(free)
            how(free, placement.gpu_indices)
            if len(free) != before:
                self.changes += 1
                self.free_total += len(free) - before
                self._move(placement.node, before)

    def most_free(self) -> int:
        """The most free GPUs on any one node: more than that fit no single node.
        Kept while no GPU moves: a pass asks it of every blocked stretch."""
        changes, most = self._most_free
        if changes == self.changes:
            return most
        most = 0
        for buckets in self._buckets.values():
            for count in range(len(buckets) - 1, most, -1):
                if buckets[count]:
                    most = count
                    break
        self._most_free = (self.changes, most)
        return most

    def types(self, gpu_type: str | None) -> list[str]:
        """GPU types a request may use, cheapest first."""
        if gpu_type is not None:
            return [gpu_type] if gpu_type in self._buckets else []
        return self._cheapest_first

    def fit(self, gpus: int, gpu_type: str | None, gang: bool) -> tuple[Placement, ...] | None:
        """The placement for ``gpus`` GPUs, or None when they are not free now.

        One node when any node could hold the request; otherwise, for ``gang``
        requests only, several nodes at once (:meth:`_fit_gang`).
        """
        best: tuple | None = None
        for t in self.types(gpu_type):
            buckets = self._buckets[t]
            for count in range(gpus, len(buckets)):
                if buckets[count]:
                    node = self.nodes[buckets[count][0]]
                    key = placement_key(count - gpus, self.weights.get(t, 1.0), node)
                    if best is None or key < best:
                        best = key
                    break
        if best is not None:
            name = best[2]
            return (Placement(name, tuple(sorted(self.free[name])[:gpus])),)
        if gang:
            for t in self.types(gpu_type):
                if gpus > self.largest[t]:
                    placements = self._fit_gang(gpus, t)
                    if placements:
                        return placements
        return None

    def _fit_gang(self, gpus: int, gpu_type: str) -> tuple[Placement, ...] | None:
        """Several nodes at once, all or nothing: whole free nodes first (largest,
        then by name), the remainder on the node that fits it best, else on the
        nodes with the most free GPUs."""
        buckets = self._buckets[gpu_type]
        candidates = sorted(
            (name for count, names in enumerate(buckets) if count for name in names),
            key=lambda n: (len(self.free[n]) != self.nodes[n].gpu_count, -len(self.free[n]), n),
        )
        if sum(len(self.free[n]) for n in candidates) < gpus:
            return None
        chosen: list[Placement] = []
        remaining = gpus
        rest: list[str] = []
        for name in candidates:
            node = self.nodes[name]
            if len(self.free[name]) == node.gpu_count and node.gpu_count <= remaining:
                chosen.append(Placement(name, tuple(range(node.gpu_count))))
                remaining -= node.gpu_count
            else:
                rest.append(name)
        if remaining:
            fitting = [n for n in rest if len(self.free[n]) >= remaining]
            if fitting:
                name = min(fitting, key=lambda n: (len(self.free[n]), n))
                chosen.append(Placement(name, tuple(sorted(self.free[name])[:remaining])))
                remaining = 0
            else:
                for name in rest:
                    take = min(remaining, len(self.free[name]))
                    chosen.append(Placement(name, tuple(sorted(self.free[name])[:take])))
                    remaining -= take
                    if not remaining:
                        break
        return tuple(sorted(chosen, key=lambda p: p.node))
