"""The pass's state kept between passes (design.md §5): updated by what changed
instead of rebuilt.

:class:`PassState` answers exactly what :func:`~broker.core.scheduler.schedule`
answers for the same snapshot. Between passes it keeps what a pass would
otherwise find by walking or sorting every live slice:

- the backlog in queue order, as one list per project (and allocated or not)
  sorted by the project's own order, submit time and id; a pass joins them in
  the projects' rank instead of sorting the whole backlog;
- the slices that hold GPUs, in id order, and on which nodes;
- what they hold, in whole GPUs (:class:`Holdings`): per project, per project
  and GPU type for fair share, per user in the debug lane — integers, so that
  an index kept for weeks adds up exactly as a fresh one;
- the free map of the ``ready`` nodes as the holders leave it, which a pass
  copies instead of building it from every holder;
- per node, its holders as the release estimates of backfill reservations see
  them (:class:`NodeHolders`), so that a pass asks the preemption rule only of
  holders it could let a request take; and the ready nodes in order of those
  holders' floor (:meth:`PassState.floor_order`), which a gang's reservation
  plan reads instead of sorting every node;
- fair share's answers to "may one project take from another at all" for the
  standings the last pass started from (:attr:`PassState.lenient`), with the
  projects over their share then, which serve a pass that starts from the same
  standings; and the fair shares last worked out, which serve while the same
  projects want GPUs of the same capacity;
- each blocked request's shape as the walk works it out (what decides where
  it may be placed), so that a long blocked queue is not described anew each
  pass;
- when each slice is due to end (max runtime, grace, lease), so that the first
  phase looks only at slices that are due or on a node that went away, and when
  each holder's protection ends: with those, :meth:`PassState.next_wake` tells
  a long-running caller when the next pass has something to do.

It learns what changed by comparing each snapshot's slices with the last one's:
slices are immutable values, so a slice object seen before is unchanged (one
made anew, as from a database row, is compared by value), and only new or
changed ones (submitted, granted, preempted, ended, requeued) are filed again.
A caller that knows which slices changed since the last update (the service's
store follows every write) says so with :meth:`PassState.expect`, and the next
update looks at those alone; at the end of a pass it hands over what the pass
wrote (:meth:`PassState.take_in`), so that the index answers for the slices as
the pass left them.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .candidates import Candidates
from .fairshare import ProjectTree
from .model import (
    Node,
    NodeState,
    Placement,
    Policy,
    Slice,
    SliceKind,
    SliceState,
    Snapshot,
    changes_add_up,
)
from .ordering import within_project_key, within_queue_key
from .placement import FreeGpus
from .preemption import is_debug, past_budget

if TYPE_CHECKING:
    from .resume import Settled


@dataclass
class Holdings:
    """GPUs held by the live slices, in whole GPUs."""

    gpus: dict[str, int] = field(default_factory=dict)  # project -> GPUs (its cap)
    # (project, GPU type) -> GPUs of its allocated slices (its fair share)
    allocated: dict[tuple[str, str], int] = field(default_factory=dict)
    debug: dict[str, int] = field(default_factory=dict)  # user -> GPUs of debug sessions

    def add(self, slice_: Slice, node_types: Mapping[str, str], policy: Policy, sign: int) -> None:
        """Count ``slice_``'s GPUs in (``sign`` 1) or out (-1)."""
        _add(self.gpus, slice_.project, sign * slice_.gpus)
        if slice_.allocated:
            for placement in slice_.placements:
                where = (slice_.project, node_types.get(placement.node, ""))
                _add(self.allocated, where, sign * len(placement.gpu_indices))
        if is_debug(slice_, policy):
            _add(self.debug, slice_.user, sign * slice_.gpus)

    def copy(self) -> Holdings:
        return Holdings(dict(self.gpus), dict(self.allocated), dict(self.debug))


def _add(counts: dict, key: object, change: int) -> None:
    total = counts.get(key, 0) + change
    if total:
        counts[key] = total
    else:
        del counts[key]  # absent and zero are one state, whatever the history


class NodeHolders:
    """A node's holders as the pass's release estimates see them (``_Pass._estimate``).

    ``known``: when each holder leaves if no one preempts it (its grace deadline
    if it is leaving, else its known end; holders with neither never do),
    earliest first. ``fixed``: the same for holders the rule lets no one take
    (leaving, being preempted, past their preemption budget). ``rivals``: the
    others that are allocated, per project, with ``rival_ends`` their known ends;
    ``unallocated``: the unallocated ones, which any allocated request may take.
    ``batch``: whether a rival is batch work (the debug lane's to take).
    ``open_ended``: per rival project, the GPUs of its holders with no known end;
    ``open_ended_fixed``: the same of the holders no one may take. Unless the rule
    lets a request take them, those GPUs never come back to it.

    ``floor`` and ``latest_end`` bound, for any requester, when the node could be
    wholly free (:func:`whole_node_floor`): each holder leaves at its known end,
    or, if the rule may let someone take it, no sooner than a grace period after
    its protection ends. ``held``: the GPUs they hold.
    """

    __slots__ = (
        "batch",
        "fixed",
        "floor",
        "held",
        "known",
        "latest_end",
        "open_ended",
        "open_ended_fixed",
        "rival_ends",
        "rivals",
        "unallocated",
    )

    def __init__(
        self, holders: list[tuple[Slice, int]], leaving: Mapping[int, float], policy: Policy
    ):
        self.known: list[tuple[float, int]] = []
        self.fixed: list[tuple[float, int]] = []
        self.rivals: dict[str, list[tuple[Slice, int]]] = {}
        self.rival_ends: dict[str, list[tuple[float, int]]] = {}
        self.unallocated: list[tuple[Slice, int]] = []
        self.open_ended: dict[str, int] = {}
        self.open_ended_fixed = 0
        self.batch = False
        self.floor = self.latest_end = -math.inf
        self.held = 0
        grace = policy.grace_period
        for holder, gpus in holders:
            self.held += gpus
            ends = leaving.get(holder.id)
            takeable = (
                ends is None
                and holder.state is SliceState.GRANTED
                and not past_budget(holder, policy)
            )
            if ends is None:
                ends = holder.ends_at()
            if ends is not None:
                self.known.append((ends, gpus))
            end = math.inf if ends is None else ends
            earliest = end
            if takeable:
                protected_until = holder.protected_until
                if protected_until is None:
                    earliest = -math.inf
                elif protected_until + grace < end:
                    earliest = protected_until + grace
            self.floor = max(self.floor, earliest)
            self.latest_end = max(self.latest_end, end)
            if not takeable:
                if ends is not None:
                    self.fixed.append((ends, gpus))
                else:
                    self.open_ended_fixed += gpus
            elif not holder.allocated:
                self.unallocated.append((holder, gpus))
            else:
                if holder.project not in self.rivals:
                    self.rivals[holder.project], self.rival_ends[holder.project] = [], []
                self.rivals[holder.project].append((holder, gpus))
                if ends is not None:
                    self.rival_ends[holder.project].append((ends, gpus))
                else:
                    self.open_ended[holder.project] = self.open_ended.get(holder.project, 0) + gpus
                self.batch = self.batch or holder.kind is SliceKind.BATCH
        self.known.sort()


def whole_node_floor(holders: NodeHolders, now: float, grace: float, unfree: int) -> float:
    """The earliest time at which a node could be wholly free, for any requester:
    a taken holder leaves a grace period after ``now`` at the soonest, an untaken
    one at its known end (a pass's release estimates are never sooner).

    ``unfree``: the node's GPUs that are not free. Where its holders hold more (a
    node made smaller under them), it is free before they have all left: ``now``.
    """
    if holders.held > unfree:
        return now
    return holders_floor(holders, now, now + grace)


def holders_floor(holders: NodeHolders, now: float, soonest: float) -> float:
    """:func:`whole_node_floor` of a node whose holders hold no more than it has:
    ``soonest`` is a grace period from ``now``, the soonest a taken holder leaves."""
    return max(now, holders.floor, min(holders.latest_end, soonest))


class NodeView:
    """A snapshot's nodes as a pass asks of them, worked out once per list of nodes:
    a service's catalog keeps the same list from pass to pass, and each of these
    walks of a large cluster's nodes was a few % of a busy service's CPU."""

    __slots__ = ("_capacity", "by_name", "down", "draining", "listed", "ready", "types", "unready")

    def __init__(self, nodes: tuple[Node, ...]):
        self.listed = nodes
        self.by_name = {node.name: node for node in nodes}  # shared: never to be changed
        self.types = {node.name: node.gpu_type for node in nodes}
        self.ready = [node for node in nodes if node.state is NodeState.READY]
        self.draining = any(node.state is NodeState.DRAINING for node in nodes)
        self.down = [node.name for node in nodes if node.state is NodeState.DOWN]
        self.unready = [node.name for node in nodes if node.state is not NodeState.READY]
        self._capacity: tuple[tuple, float] | None = None

    def capacity(self, weights: Mapping[str, float]) -> float:
        """The ready nodes' weighted GPUs (a GPU type without a weight weighs 1)."""
        key = tuple(sorted(weights.items()))
        if self._capacity is None or self._capacity[0] != key:
            total = sum(node.gpu_count * weights.get(node.gpu_type, 1.0) for node in self.ready)
            self._capacity = (key, total)
        return self._capacity[1]


class PassState:
    """The pass's index of the live slices, brought up to date by :meth:`update`."""

    def __init__(self, tree: ProjectTree | None = None):
        """``tree`` may be given to reuse a validated tree, as for ``schedule``;
        without it, the tree is built from the snapshot's accounts when they change."""
        self.tree = tree
        self.fixed_tree = tree is not None
        self.accounts: tuple = ()
        self.nodes = NodeView(())  # the last snapshot's nodes
        # What filing a holder reads besides the slice: a change refiles them all.
        self.node_types: dict[str, str] = {}
        self.policy: Policy | None = None
        self.held = Holdings()
        # The free map of the ready nodes, built when a pass first asks for it and
        # then moved by each holder filed or forgotten; (node, GPU) -> how many
        # holders hold it, so that a GPU is free again only once none does.
        self._free: FreeGpus | None = None
        self._free_for: tuple = ()  # the ready nodes and weights it is for
        self._free_ready: list[Node] | None = None  # the list of them last asked with
        self._holding_gpu: dict[tuple[str, int], int] = {}
        self.slices: dict[int, Slice] = {}
        # (allocated, project) -> that project's pending slices in its queue
        # order, and their sort keys (kept apart so that a pass joins the
        # slices without unpacking pairs).
        self.queues: dict[tuple[bool, str], tuple[list[tuple], list[Slice]]] = {}
        self.holding_ids: list[int] = []  # slices that hold GPUs, in id order
        self.holders: dict[str, set[int]] = {}  # node -> ids of the slices on it
        # The nodes holders are on that a view of the nodes lacks (gone from the
        # snapshot), worked out when ``due`` first asks under that view and dropped
        # when a holder is filed on such a node: a set of every holder's node per pass
        # was most of ``due``'s time.
        self._gone_nodes: tuple[NodeView, list[str]] | None = None
        # node -> its holders as release estimates see them, built when a pass first
        # asks and dropped when a holder there is filed or forgotten
        self._node_holders: dict[str, NodeHolders] = {}
        # Per GPU type, (NodeHolders.floor, node) of the ready nodes, sorted: the order
        # in which a gang's plan asks nodes (floor_order), built when first asked for
        # a list of nodes; a node whose holders changed is put back in place then.
        self._floor_order: dict[str, list[tuple[float, str]]] | None = None
        self._floor_for: NodeView | None = None
        self._floor_of: dict[str, float] = {}  # node -> the floor it is filed under
        self._floor_stale: set[str] = set()
        self._overheld: set[str] = set()  # see floor_order
        self.deadlines: list[tuple[float, int]] = []  # (when due to end, slice id), sorted
        # Per kind of holder (holder_kind), (when a holder's protection ends, slice id),
        # sorted: a pass may preempt then, and quiet_until asks it of each kind
        self.protection_ends_by_kind: dict[HolderKind, list[tuple[float, int]]] = {}
        # Who could be preempted, at the time a pass last asked (victims_at): moved by
        # the holders filed and forgotten, and by protection ends as time passes.
        self._victims = Candidates()
        # The standings a pass started from, fair share's answers to "may one
        # project take from another at all" for them (Standings.lenient), and the
        # projects over their share (Standings.over_share): a pass whose holdings
        # did not move since starts from the same answers.
        self.lenient: tuple[tuple, dict[tuple[str, str, bool], bool], set[str]] | None = None
        # (tree, capacity, wanting projects, margin) and the fair shares they give
        # (Standings.now): most passes change none of them.
        self.fair_shares: tuple[tuple, dict[str, float]] | None = None
        # Pending slice id -> its shape's number (shape_number) as the pass's walk works
        # it out (what decides where it may be placed), dropped when the slice is filed
        # or forgotten.
        self.shapes: dict[int, int] = {}
        self._shape_numbers: dict[tuple, int] = {}  # pending_shape -> its number
        self.promised_ids: set[int] = set()  # pending slices that hold a promise
        # How many allocated debug sessions wait: what a quiet pass's until reads
        # (resume.py). Counted the second time it is asked (an index that lives on),
        # then kept.
        self.debug_waiting: int | None = None
        self._debug_asked = False
        # Slices the next update is told changed (id -> the slice, None: gone), if any.
        self._expected: Mapping[int, Slice | None] | None = None
        # What the last update changed: id -> (the slice before or None, the slice now
        # or None); None when it filed everything anew. A quiet pass's successor
        # reads it to tell whether it may resume (broker/core/resume.py).
        self.changed: dict[int, tuple[Slice | None, Slice | None]] | None = None
        self.settled: Settled | None = None  # what the last pass left to resume from

    def expect(self, changed: Mapping[int, Slice | None] | None) -> None:
        """The next :meth:`update`'s snapshot differs from the last one only in these
        slices (id -> the slice as it is now, None for one no longer live): it files
        them alone instead of comparing every slice. A snapshot that does not add up
        (another count of slices) is taken in whole, as without it; so is one after
        ``expect(None)``."""
        self._expected = changed

    def update(self, snapshot: Snapshot) -> ProjectTree:
        """Take in ``snapshot``: file its new and changed slices, forget the gone.
        Returns the project tree of its accounts."""
        if not self.fixed_tree and (self.tree is None or self.accounts != snapshot.accounts):
            self.tree = ProjectTree(snapshot.accounts)
            self.accounts = snapshot.accounts
            self.settled = None
        # Identity first: a caller that keeps its list of nodes passes the same one,
        # and comparing two thousand nodes (or their types) each pass was 4% of it.
        listed = self.nodes.listed
        if snapshot.nodes is not listed and snapshot.nodes != listed:
            self.nodes = NodeView(tuple(snapshot.nodes))
        node_types = self.nodes.types
        if len(self._shape_numbers) > _SHAPES_KEPT_PER_SLICE * len(self.slices) + 1024:
            self.shapes, self._shape_numbers = {}, {}  # numbered anew as the walk asks
        if (
            node_types is not self.node_types and node_types != self.node_types
        ) or snapshot.policy != self.policy:
            self._clear()
        # Equal ones too: the next pass's same view is then recognised by identity.
        self.node_types, self.policy = node_types, snapshot.policy
        expected, self._expected = self._expected, None
        self.changed = {}
        if not self.slices:
            self._build(snapshot.slices)
            self.changed = None
            return self.tree
        if expected is None or not self._take_expected(expected, len(snapshot.slices)):
            self._take_all(snapshot.slices)
        return self.tree

    def take_in(
        self, changed: Mapping[int, Slice | None] | None, count: int, live: Iterable[Slice]
    ) -> None:
        """The slices a pass just wrote (id -> the slice as it is now, None for one no
        longer live; None: unknown), of ``count`` live slices now: filed at once, so
        that :meth:`next_wake` counts the pass's own decisions. Only a list that does
        not add up has ``live``, every live slice, walked. The next :meth:`update`
        finds these slices filed already."""
        if not self.slices:
            return  # nothing kept yet: the next update builds the index
        before = self.changed
        self.changed = {}
        if changed is None or not self._take_expected(changed, count):
            self._take_all(live)
        if self.changed:
            self.settled = None  # the pass wrote something: nothing to resume from
        self.changed = before

    def _take_all(self, slices: Iterable[Slice]) -> None:
        """Take in ``slices``, every live slice, comparing each with the one kept."""
        known = self.slices
        current: dict[int, Slice] = {}
        added = 0
        for slice_ in slices:
            before = known.get(slice_.id)
            if before is slice_ or (before is not None and before == slice_):
                current[slice_.id] = before  # unchanged: the same object from now on
                continue
            current[slice_.id] = slice_
            if before is None:
                added += 1
                self._file(slice_)
            else:
                self._refile(before, slice_)
            self._changed(before, slice_)
        if len(known) + added != len(current):  # some slices are gone
            for gone in known.keys() - current.keys():
                self._forget(known[gone])
                self._changed(known[gone], None)
        self.slices = current

    def _changed(self, before: Slice | None, after: Slice | None) -> None:
        if self.changed is not None:
            slice_id = (after or before).id  # type: ignore[union-attr]
            first = self.changed.get(slice_id, (before, None))[0]
            self.changed[slice_id] = (first, after)

    def copy(self) -> PassState:
        """An independent index of the same slices: updating either leaves the other
        as it was. A what-if pass starts from a copy instead of filing every slice."""
        other = PassState.__new__(PassState)
        other.__dict__.update(self.__dict__)  # the immutable parts, shared
        other.held = self.held.copy()
        other._free = None if self._free is None else self._free.copy()
        other._holding_gpu = dict(self._holding_gpu)
        other.slices = dict(self.slices)
        other.queues = {
            where: (keys[:], slices[:]) for where, (keys, slices) in self.queues.items()
        }
        other.holding_ids = self.holding_ids[:]
        other.holders = {node: set(ids) for node, ids in self.holders.items()}
        other._node_holders = dict(self._node_holders)
        if self._floor_order is not None:
            other._floor_order = {t: order[:] for t, order in self._floor_order.items()}
        other._floor_of = dict(self._floor_of)
        other._floor_stale = set(self._floor_stale)
        other._overheld = set(self._overheld)
        other.shapes = dict(self.shapes)
        other._shape_numbers = dict(self._shape_numbers)  # either may number anew
        other.promised_ids = set(self.promised_ids)
        other.deadlines = self.deadlines[:]
        other.protection_ends_by_kind = {
            kind: ends[:] for kind, ends in self.protection_ends_by_kind.items()
        }
        other._victims = self._victims.copy()
        other._expected = None  # said of the next snapshot of this index, not a copy's
        return other

    def _take_expected(self, changed: Mapping[int, Slice | None], count: int) -> bool:
        """File the slices ``changed`` says changed; False (and nothing changed here)
        if the result would not hold ``count`` slices, as the snapshot does."""
        slices = self.slices
        if not changes_add_up(slices, changed, count):
            return False
        for slice_id, slice_ in changed.items():
            before = slices.get(slice_id)
            if before is slice_ or (before is not None and before == slice_):
                continue
            if before is not None and slice_ is not None:
                self._refile(before, slice_)
                slices[slice_id] = slice_
            elif before is not None:
                self._forget(before)
                del slices[slice_id]
            elif slice_ is not None:
                self._file(slice_)
                slices[slice_id] = slice_
            self._changed(before, slice_)
        return True

    def _clear(self) -> None:
        self.slices = {}
        self.settled = None
        self.debug_waiting, self._debug_asked = None, False
        self.queues, self.holding_ids, self.holders, self.deadlines = {}, [], {}, []
        self._gone_nodes = None
        self._node_holders, self.shapes, self.promised_ids = {}, {}, set()
        self._floor_order = None
        self._shape_numbers = {}
        self.protection_ends_by_kind = {}
        self._victims = Candidates()
        self.held = Holdings()
        self._free, self._holding_gpu = None, {}
        self.lenient = self.fair_shares = None

    def _build(self, slices: tuple[Slice, ...]) -> None:
        """File ``slices`` into an empty index: each list sorted once, not kept
        sorted one insertion at a time."""
        self.slices = {s.id: s for s in slices}
        self._node_holders, self.shapes, self.promised_ids = {}, {}, set()
        self._floor_order = None
        self._gone_nodes = None
        holding = []
        pending: dict[tuple[bool, str], list[tuple[tuple, Slice]]] = {}
        deadlines = []
        by_kind: dict[HolderKind, list[tuple[float, int]]] = {}
        self.debug_waiting, self._debug_asked = None, False
        for slice_ in self.slices.values():
            if slice_.holds_gpus:
                holding.append(slice_.id)
                for placement in slice_.placements:
                    self.holders.setdefault(placement.node, set()).add(slice_.id)
                self.held.add(slice_, self.node_types, self.policy, 1)
                self._hold(slice_.placements, 1)
                deadlines += ((at, slice_.id) for at in _deadlines(slice_))
                for at in _protection_end(slice_):
                    by_kind.setdefault(holder_kind(slice_, self.policy), []).append((at, slice_.id))
            else:
                where = (slice_.allocated, slice_.project)
                pending.setdefault(where, []).append((within_queue_key(slice_), slice_))
                if slice_.promised:
                    self.promised_ids.add(slice_.id)
                # A slice that holds nothing has no protection, and no deadline
                # but its lease: most of a backlog is skipped without a call.
                if slice_.lease_expires_at is not None:
                    deadlines += ((at, slice_.id) for at in _deadlines(slice_))
        self.holding_ids = sorted(holding)
        self.deadlines = sorted(deadlines)
        for ends in by_kind.values():
            ends.sort()
        self.protection_ends_by_kind = by_kind
        for where, keyed in pending.items():
            keyed.sort(key=lambda pair: pair[0])
            self.queues[where] = ([key for key, _ in keyed], [s for _, s in keyed])

    # -- what a pass asks ----------------------------------------------------

    def due(self, now: float) -> list[int]:
        """Ids of the slices the first phase must look at, in id order: those due
        to end by ``now`` and those holding GPUs on a node that is down or gone
        (of the last snapshot's nodes)."""
        ids = set()
        for at, slice_id in self.deadlines:
            if at > now:
                break
            ids.add(slice_id)
        for name in itertools.chain(self.nodes.down, self._gone()):
            ids.update(self.holders.get(name, ()))
        return sorted(ids)

    def held_where_unready(self) -> set[int]:
        """Ids of the slices holding GPUs on a node that is not ready (draining, down)
        or gone, of the last snapshot's nodes."""
        ids: set[int] = set()
        for name in itertools.chain(self.nodes.unready, self._gone()):
            ids.update(self.holders.get(name, ()))
        return ids

    def _gone(self) -> list[str]:
        """The nodes slices hold GPUs on that the last snapshot does not list."""
        gone = self._gone_nodes
        if gone is None or gone[0] is not self.nodes:
            by_name = self.nodes.by_name
            gone = self._gone_nodes = (self.nodes, [n for n in self.holders if n not in by_name])
        return gone[1]

    def next_wake(self, now: float) -> float | None:
        """When a pass next has something to do for a live slice, after ``now``: the
        earliest end of a protection (its holder may then be preempted), a grace
        period, a maximum runtime or a lease, of the slices as last taken in."""
        times = [at for _, at in self.first_protection_ends(now)]
        deadline = self.next_deadline(now)
        if deadline is not None:
            times.append(deadline)
        return min(times, default=None)

    def next_deadline(self, after: float) -> float | None:
        """The earliest end of a grace period, a maximum runtime or a lease after
        ``after``, of the slices as last taken in."""
        at = bisect_right(self.deadlines, (after, math.inf))
        return self.deadlines[at][0] if at < len(self.deadlines) else None

    def debug_waits(self) -> bool:
        """Whether an allocated debug session waits. The first time, from a walk of the
        backlog; from then on, from a count kept as slices are filed and forgotten."""
        if self.debug_waiting is None:
            waiting = sum(_debug_waiting(slice_, self.policy) for slice_ in self.pending())
            if not self._debug_asked:
                self._debug_asked = True
                return waiting > 0
            self.debug_waiting = waiting
        return self.debug_waiting > 0

    def deadline_at(self, at: float) -> bool:
        """Whether a grace period, a maximum runtime or a lease ends exactly at ``at``."""
        found = bisect_left(self.deadlines, (at, -math.inf))
        return found < len(self.deadlines) and self.deadlines[found][0] == at

    def first_protection_ends(self, after: float) -> Iterator[tuple[HolderKind, float]]:
        """Per kind of holder (:func:`holder_kind`), the first end of a protection
        after ``after``, if any."""
        start = (after, math.inf)
        for kind, ends in self.protection_ends_by_kind.items():
            at = bisect_right(ends, start)
            if at < len(ends):
                yield kind, ends[at][0]

    def victims_at(self, now: float) -> Candidates:
        """Who could be preempted at ``now`` (to read, not to change): the granted
        holders past their protection and within their preemption budget."""
        victims, slices = self._victims, self.slices
        if victims.at is None or now < victims.at:
            assert self.policy is not None  # set before any slice is filed
            victims = self._victims = Candidates.of(self.holding(), now, self.policy)
        elif now > victims.at:
            after = (victims.at, math.inf)
            last = (now, math.inf)
            for kind, ends in self.protection_ends_by_kind.items():
                if may_be_victim(kind):
                    start = bisect_right(ends, after)
                    for _, slice_id in ends[start : bisect_right(ends, last, start)]:
                        victims.add(slices[slice_id])
        victims.at = now
        return victims

    def holding(self) -> Iterator[Slice]:
        """The slices that hold GPUs, in id order."""
        return map(self.slices.__getitem__, self.holding_ids)

    def holdings(self, without: Iterable[Slice] = ()) -> Holdings:
        """What the holders hold, less the slices ``without`` (a copy to change)."""
        held = self.held.copy()
        for slice_ in without:
            if slice_.holds_gpus:
                held.add(slice_, self.node_types, self.policy, -1)
        return held

    def free_map(
        self, ready: list[Node], weights: Mapping[str, float], without: Iterable[Slice] = ()
    ) -> FreeGpus:
        """The free GPUs of the ``ready`` nodes as the holders, less the slices
        ``without``, leave them: a copy to change."""
        weights_key = tuple(sorted(weights.items()))
        if (
            self._free is None
            or weights_key != self._free_for[1]
            or (ready is not self._free_ready and tuple(ready) != self._free_for[0])
        ):
            taken = [Placement(node, (gpu,)) for node, gpu in self._holding_gpu]
            self._free, self._free_for = (
                FreeGpus(ready, weights, taken),
                (tuple(ready), weights_key),
            )
        self._free_ready = ready  # the same list next pass needs no comparing
        free = self._free.copy()
        leaving: dict[tuple[str, int], int] = {}
        for slice_ in without:
            if slice_.holds_gpus:
                for placement in slice_.placements:
                    for gpu in placement.gpu_indices:
                        leaving[placement.node, gpu] = leaving.get((placement.node, gpu), 0) + 1
        free.give(
            Placement(node, (gpu,))
            for (node, gpu), count in leaving.items()
            if self._holding_gpu.get((node, gpu), 0) <= count
        )
        return free

    def _hold(self, placements: tuple[Placement, ...], step: int) -> None:
        """Count ``placements``' GPUs as held (``step`` 1) or given back (-1), and move
        the free map where a GPU's first holder comes or last one goes."""
        counts = self._holding_gpu
        for placement in placements:
            for gpu in placement.gpu_indices:
                key = (placement.node, gpu)
                count = counts.get(key, 0) + step
                if count:
                    counts[key] = count
                else:
                    del counts[key]
                if self._free is not None and count == (1 if step > 0 else 0):
                    change = self._free.take if step > 0 else self._free.give
                    change((Placement(placement.node, (gpu,)),))

    def holders_on(self, node: str) -> list[tuple[Slice, int]]:
        """The slices holding GPUs on ``node``, in id order, with how many each holds there."""
        found = []
        for slice_id in sorted(self.holders.get(node, ())):
            slice_ = self.slices[slice_id]
            for placement in slice_.placements:
                if placement.node == node:
                    found.append((slice_, len(placement.gpu_indices)))
        return found

    def node_holders(self, node: str) -> NodeHolders:
        """``node``'s holders as release estimates see them, with none leaving."""
        found = self._node_holders.get(node)
        if found is None:
            found = self._node_holders[node] = NodeHolders(self.holders_on(node), {}, self.policy)
        return found

    def floor_order(self) -> tuple[dict[str, list[tuple[float, str]]], set[str]]:
        """Per GPU type, ``(floor, node)`` of the ready nodes, sorted, where ``floor``
        is its holders' :attr:`NodeHolders.floor`; and the nodes whose holders hold
        more GPUs than the node has to hold (one made smaller under them). For any
        other node with none leaving, :func:`whole_node_floor` is that floor once it
        is later than a grace period from now: a pass works out the others alone."""
        if self._floor_order is None or self._floor_for is not self.nodes:
            self._floor_for, self._floor_of, self._overheld = self.nodes, {}, set()
            order: dict[str, list[tuple[float, str]]] = {}
            for node in self.nodes.ready:
                order.setdefault(node.gpu_type, []).append((self._file_floor(node), node.name))
            for entries in order.values():
                entries.sort()
            self._floor_order, self._floor_stale = order, set()
        elif self._floor_stale:
            by_name, order = self.nodes.by_name, self._floor_order
            for name in self._floor_stale:
                node = by_name.get(name)
                if node is None or node.state is not NodeState.READY:
                    continue  # not in the order
                entries = order[node.gpu_type]
                del entries[bisect_left(entries, (self._floor_of[name], name))]
                insort(entries, (self._file_floor(node), name))
            self._floor_stale = set()
        return self._floor_order, self._overheld

    def _file_floor(self, node: Node) -> float:
        """``node``'s holders' floor, noted for :meth:`floor_order`."""
        name = node.name
        holders = self.node_holders(name)
        self._floor_of[name] = holders.floor
        held_here = holders.held and sum(
            1 for gpu in range(node.gpu_count) if self._holding_gpu.get((name, gpu))
        )
        if holders.held > held_here:
            self._overheld.add(name)
        else:
            self._overheld.discard(name)
        return holders.floor

    def _holders_changed(self, node: str) -> None:
        """What is kept of ``node``'s holders is out of date."""
        self._node_holders.pop(node, None)
        self._floor_stale.add(node)

    def pending(self) -> Iterator[Slice]:
        """The pending slices, in no particular order."""
        for _, slices in self.queues.values():
            yield from slices

    def waiting(self, without: Container[int] = ()) -> Iterator[str]:
        """The projects with allocated work pending, other than the slices ``without``."""
        if not without:
            return (project for allocated, project in self.queues if allocated)
        return (
            project
            for (allocated, project), (_, queued) in self.queues.items()
            if allocated and any(s.id not in without for s in queued)
        )

    def backlog(self, ranked: Iterator[str], allocated: bool) -> list[Slice]:
        """The pending slices of ``allocated`` work in queue order, for projects
        in rank order (:func:`~broker.core.ordering.queue_order`)."""
        ordered: list[Slice] = []
        for project in ranked:
            queue = self.queues.get((allocated, project))
            if queue is not None:
                ordered += queue[1]
        return ordered

    def shape_number(self, slice_: Slice) -> int:
        """A number for ``slice_``'s :func:`pending_shape`, the same for every slice of
        that shape: the walk compares shapes by number, as a shape's tuple would be
        hashed again at every look-up."""
        assert self.policy is not None  # set before any slice is filed
        shape = pending_shape(slice_, self.policy)
        number = self._shape_numbers.get(shape)
        if number is None:
            number = self._shape_numbers[shape] = len(self._shape_numbers)
        return number

    # -- filing --------------------------------------------------------------

    def _file(self, slice_: Slice) -> None:
        if slice_.holds_gpus:
            insort(self.holding_ids, slice_.id)
            for placement in slice_.placements:
                self.holders.setdefault(placement.node, set()).add(slice_.id)
                self._holders_changed(placement.node)
                if placement.node not in self.nodes.by_name:
                    self._gone_nodes = None
            self.held.add(slice_, self.node_types, self.policy, 1)
            self._hold(slice_.placements, 1)
        else:
            self.shapes.pop(slice_.id, None)
            if slice_.promised:
                self.promised_ids.add(slice_.id)
            keys, slices = self.queues.setdefault((slice_.allocated, slice_.project), ([], []))
            key = within_queue_key(slice_)
            at = bisect_left(keys, key)
            keys.insert(at, key)
            slices.insert(at, slice_)
            if self.debug_waiting is not None:
                self.debug_waiting += _debug_waiting(slice_, self.policy)
        for at in _deadlines(slice_):
            insort(self.deadlines, (at, slice_.id))
        for at in _protection_end(slice_):
            kind = holder_kind(slice_, self.policy)
            insort(self.protection_ends_by_kind.setdefault(kind, []), (at, slice_.id))
            victims_at = self._victims.at
            if may_be_victim(kind) and victims_at is not None and at <= victims_at:
                self._victims.add(slice_)  # already past its protection then

    def _refile(self, before: Slice, after: Slice) -> None:
        """File ``after`` in place of ``before``, the same slice changed. Where only its
        lease moved (a heartbeat: most changes of a busy service), only its deadline
        moves, and what holds the slice itself takes the new one: refiling it whole
        (holders, free map, counts) cost 35 µs a heartbeat at 10,000 live slices."""
        lease = after.lease_expires_at
        if lease == before.lease_expires_at or replace(before, lease_expires_at=lease) != after:
            self._forget(before)
            self._file(after)
            return
        if before.lease_expires_at is not None:
            at = bisect_left(self.deadlines, (before.lease_expires_at, before.id))
            del self.deadlines[at]
        if lease is not None:
            insort(self.deadlines, (lease, after.id))
        if after.holds_gpus:
            for placement in after.placements:  # their summaries hold the slice itself
                self._holders_changed(placement.node)
            if after.id in self._victims.slices:
                self._victims.replace(after)
        else:
            keys, slices = self.queues[(after.allocated, after.project)]
            slices[bisect_left(keys, within_queue_key(after))] = after

    def _forget(self, slice_: Slice) -> None:
        if slice_.holds_gpus:
            del self.holding_ids[bisect_left(self.holding_ids, slice_.id)]
            for placement in slice_.placements:
                self._holders_changed(placement.node)
                held = self.holders[placement.node]
                held.discard(slice_.id)
                if not held:
                    del self.holders[placement.node]
            self.held.add(slice_, self.node_types, self.policy, -1)
            self._hold(slice_.placements, -1)
        else:
            self.shapes.pop(slice_.id, None)
            self.promised_ids.discard(slice_.id)
            where = (slice_.allocated, slice_.project)
            keys, slices = self.queues[where]
            at = bisect_left(keys, within_queue_key(slice_))
            del keys[at], slices[at]
            if not keys:
                del self.queues[where]
            if self.debug_waiting is not None:
                self.debug_waiting -= _debug_waiting(slice_, self.policy)
        for at in _deadlines(slice_):
            del self.deadlines[bisect_left(self.deadlines, (at, slice_.id))]
        for at in _protection_end(slice_):
            kind = holder_kind(slice_, self.policy)
            ends = self.protection_ends_by_kind[kind]
            del ends[bisect_left(ends, (at, slice_.id))]
            if not ends:
                del self.protection_ends_by_kind[kind]
        if slice_.id in self._victims.slices:
            self._victims.remove(slice_.id)


def borrow_traits(slice_: Slice, policy: Policy) -> tuple:
    """What, besides its size, decides whether ``slice_`` may borrow reserved GPUs
    (the pass's ``_may_use_reserved``): its project and rank within it (whether a
    reservation's owner outranks it), whether it has spent its preemption budget
    (then no owner may preempt it), and its contract. The one list both memos of the
    walk key on, so that neither can forget a trait the rule reads."""
    contract = slice_.contract
    return (
        slice_.project,
        within_project_key(slice_),
        past_budget(slice_, policy),
        contract.min_runtime,
        contract.max_runtime,
    )


def pending_shape(slice_: Slice, policy: Policy) -> tuple:
    """What decides whether a pending slice can be placed (where it fits, whether it
    may borrow reserved GPUs) or is under its cap."""
    return (*borrow_traits(slice_, policy), slice_.gpus, slice_.gpu_type, slice_.kind)


#: Shapes numbered per live slice before the numbers start again (shape_number):
#: shapes of slices long gone are not kept for ever.
_SHAPES_KEPT_PER_SLICE = 4


def wake_times(slice_: Slice) -> list[float]:
    """When a pass may have something to do for ``slice_`` (:meth:`PassState.next_wake`,
    for a caller that keeps no index)."""
    return [*_deadlines(slice_), *_protection_end(slice_)]


def _debug_waiting(slice_: Slice, policy: Policy | None) -> int:
    """1 for an allocated debug session waiting, else 0."""
    return int(policy is not None and slice_.allocated and is_debug(slice_, policy))


#: What quiet_until asks of a holder beside its node (resume.py): its project, whether
#: it is allocated, batch work, past its preemption budget, and granted.
HolderKind = tuple[str, bool, bool, bool, bool]


def holder_kind(slice_: Slice, policy: Policy) -> HolderKind:
    """``slice_``'s :data:`HolderKind` under ``policy``."""
    return (
        slice_.project,
        slice_.allocated,
        slice_.kind is SliceKind.BATCH,
        past_budget(slice_, policy),
        slice_.state is SliceState.GRANTED,
    )


def may_be_victim(kind: HolderKind) -> bool:
    """Whether a holder of ``kind`` is a candidate once past its protection (as
    :func:`~broker.core.candidates.is_candidate` says of a slice): granted and
    within its preemption budget."""
    _, _, _, spent, granted = kind
    return granted and not spent


def _protection_end(slice_: Slice) -> list[float]:
    """When a holder's protection ends (-inf: it has none; nothing: it holds nothing)."""
    if not slice_.holds_gpus:
        return []
    until = slice_.protected_until
    return [-math.inf if until is None else until]


def _deadlines(slice_: Slice) -> list[float]:
    """When the first phase of a pass must look at ``slice_`` (the tests of
    ``end_finished``, each as the time from which it holds)."""
    times = []
    if slice_.holds_gpus:
        max_runtime = slice_.contract.max_runtime
        if max_runtime is not None:
            if slice_.granted_at is not None:
                times.append(slice_.granted_at + max_runtime)
            elif max_runtime <= 0:
                times.append(-math.inf)  # counted from whenever the pass runs: due at once
        if slice_.preempt_deadline is not None:
            times.append(slice_.preempt_deadline)
    if slice_.lease_expires_at is not None:
        times.append(slice_.lease_expires_at)
    return times
