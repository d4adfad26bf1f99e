"""Who could be preempted now (design.md §5.3): the victim indexes, kept between passes.

:class:`Candidates` holds the granted holders past their protection and within
their preemption budget, per node they hold GPUs on and per group the rule
asks about. The index of a long-running caller keeps one, moved by the holders
it files and forgets and by protection ends as time passes; a pass reads it
through a :class:`~broker.core.preemption.Preemptor`, which leaves it as it was.
Filing every candidate anew in each pass that searched was most of the search's
cost on a full cluster.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from .model import Policy, Slice, SliceKind, SliceState

# Bound once: on Python 3.11 a member read off its enum class goes through a slow hook.
_GRANTED, _BATCH_KIND = SliceState.GRANTED, SliceKind.BATCH

#: A group of candidates: a project's allocated ones, all unallocated ones, or
#: all allocated batch ones.
Group = tuple[str, str]
PROJECT = "project"
UNALLOCATED: Group = ("unallocated", "")
BATCH: Group = ("batch", "")


def groups(slice_: Slice) -> tuple[Group, ...]:
    """The groups a candidate belongs to."""
    if not slice_.allocated:
        return (UNALLOCATED,)
    if slice_.kind is _BATCH_KIND:
        return ((PROJECT, slice_.project), BATCH)
    return ((PROJECT, slice_.project),)


class Candidates:
    """The slices someone could preempt at :attr:`at`, indexed for the victim search.

    ``on`` node -> slice id -> (slice, GPUs it holds there); ``gpus_on`` node -> their
    GPUs there; ``nodes_of`` group -> node -> its members' GPUs there (a search
    visits only the nodes of the groups the rule could take from); ``by_project``,
    ``batch`` and ``unallocated`` count them (enough to tell cheaply when a request
    can preempt nothing at all), ``unallocated_on`` node -> unallocated GPUs there.
    """

    def __init__(self) -> None:
        self.at: float | None = None  # None: never brought to a time
        self.slices: dict[int, Slice] = {}
        self.on: dict[str, dict[int, tuple[Slice, int]]] = {}
        self.gpus_on: dict[str, int] = {}
        self.nodes_of: dict[Group, Counter[str]] = {}
        self.by_project: Counter[str] = Counter()
        self.batch = 0
        self.unallocated = 0
        self.unallocated_on: Counter[str] = Counter()

    @classmethod
    def of(cls, running: Iterable[Slice], now: float, policy: Policy) -> Candidates:
        """Those of ``running`` someone could preempt at ``now``."""
        found = cls()
        found.at = now
        for slice_ in running:
            if is_candidate(slice_, now, policy):
                found.add(slice_)
        return found

    def add(self, slice_: Slice) -> None:
        self.slices[slice_.id] = slice_
        for placement in slice_.placements:
            node, gpus = placement.node, len(placement.gpu_indices)
            self.on.setdefault(node, {})[slice_.id] = (slice_, gpus)
            self.gpus_on[node] = self.gpus_on.get(node, 0) + gpus
            self._index(slice_, node, gpus)
        self._count(slice_, 1)

    def remove(self, slice_id: int) -> None:
        slice_ = self.slices.pop(slice_id)
        for placement in slice_.placements:
            node, gpus = placement.node, len(placement.gpu_indices)
            entries = self.on[node]
            del entries[slice_id]
            if not entries:
                del self.on[node], self.gpus_on[node]
            else:
                self.gpus_on[node] -= gpus
            self._index(slice_, node, -gpus)
        self._count(slice_, -1)

    def replace(self, slice_: Slice) -> None:
        """Hold ``slice_`` in place of its earlier self, changed in nothing the
        search reads (its lease)."""
        self.slices[slice_.id] = slice_
        for placement in slice_.placements:
            entries = self.on[placement.node]
            entries[slice_.id] = (slice_, entries[slice_.id][1])

    def copy(self) -> Candidates:
        other = Candidates()
        other.at, other.slices = self.at, dict(self.slices)
        other.on = {node: dict(entries) for node, entries in self.on.items()}
        other.gpus_on = dict(self.gpus_on)
        other.nodes_of = {group: Counter(nodes) for group, nodes in self.nodes_of.items()}
        other.by_project = Counter(self.by_project)
        other.batch, other.unallocated = self.batch, self.unallocated
        other.unallocated_on = Counter(self.unallocated_on)
        return other

    def _count(self, slice_: Slice, step: int) -> None:
        self.by_project[slice_.project] += step
        self.batch += step * (slice_.kind is _BATCH_KIND)
        self.unallocated += step * (not slice_.allocated)

    def _index(self, slice_: Slice, node: str, gpus: int) -> None:
        """Count ``gpus`` (negative: out) of a candidate on ``node`` in its groups."""
        for group in groups(slice_):
            nodes = self.nodes_of.get(group)
            if nodes is None:  # not setdefault: that would build a Counter every time
                nodes = self.nodes_of[group] = Counter()
            tally(nodes, node, gpus)
        if not slice_.allocated:
            tally(self.unallocated_on, node, gpus)


def tally(counts: Counter[str], key: str, change: int) -> None:
    """Add ``change`` to ``counts[key]``, leaving out a key that comes to zero (the
    searches read a node's presence as "has candidates there")."""
    counts[key] += change
    if not counts[key]:
        del counts[key]


def past_budget(slice_: Slice, policy: Policy) -> bool:
    """Whether an allocated slice has been preempted as often as a job may be: it
    is no longer anyone's victim, but a drain's or a node going down (design.md §5.7)."""
    budget = policy.preemption_budget
    return budget is not None and slice_.allocated and slice_.preemptions >= budget


def is_candidate(slice_: Slice, now: float, policy: Policy) -> bool:
    """Whether someone could preempt ``slice_`` at ``now``: granted, past its
    protection and within its preemption budget."""
    return (
        slice_.state is _GRANTED
        and not slice_.is_protected(now)
        and not past_budget(slice_, policy)
    )
