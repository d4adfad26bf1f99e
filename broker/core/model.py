"""The scheduler's vocabulary (design.md §2–§3): nodes, accounts, slices, contracts, policy.

These are plain immutable values. The scheduling pass reads them from a
:class:`Snapshot` and answers with :class:`Decisions`; it never changes them.
Times are seconds since the epoch (floats), durations are seconds.
"""

from __future__ import annotations

import enum
import operator
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import islice, repeat
from typing import NamedTuple, cast, overload

HOUR = 3600.0
DAY = 24 * HOUR
#: Seconds: the longest time between two of the service's passes by default
#: (``BrokerApp.pass_interval``), and so the simulator's default tick.
PASS_INTERVAL = 5.0


class NodeState(enum.StrEnum):
    """Lifecycle of a node (design.md §6)."""

    READY = "ready"
    DRAINING = "draining"  # no new grants; slices leave as their contracts end
    DRAINED = "drained"  # draining and empty: repair automation may proceed
    DOWN = "down"  # gone: its slices end at once


class SliceKind(enum.StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


class SliceState(enum.StrEnum):
    PENDING = "pending"
    GRANTED = "granted"
    PREEMPTING = "preempting"  # in its grace period; GPUs still held
    ENDED = "ended"


# Bound once: on Python 3.11 reading a member off its enum class goes through the
# enum type's __getattr__ hook (several times slower than a global), and a pass
# asks these of every slice.
_HOLDING = (SliceState.GRANTED, SliceState.PREEMPTING)
_INTERVAL_END = operator.itemgetter(1)


class EndReason(enum.StrEnum):
    RELEASED = "released"  # the holder let it go
    CANCELLED = "cancelled"  # withdrawn before a grant
    EXPIRED = "expired"  # max_runtime reached
    PREEMPTED = "preempted"  # grace period over after a preemption
    NODE_DOWN = "node_down"
    LOST = "lost"  # no heartbeat within the lease


class PreemptReason(enum.StrEnum):
    """Why a running slice was asked to leave; each names the rule that chose it
    (design.md §5, §6)."""

    UNALLOCATED = "unallocated"  # a free slice gave way to an allocated request
    FAIR_SHARE = "fair_share"  # a higher-ranked project needed the GPUs
    PRIORITY = "priority"  # the same project's higher-priority work needed them
    DEBUG_LANE = "debug_lane"  # a short debug session took a batch slice's GPUs
    DRAIN = "drain"  # the node is draining


@dataclass(frozen=True, slots=True)
class Node:
    """A machine with ``gpu_count`` GPUs of one type, indexed ``0..gpu_count-1``."""

    name: str
    gpu_type: str
    gpu_count: int
    state: NodeState = NodeState.READY


@dataclass(frozen=True, slots=True)
class Account:
    """One account in the project tree. Accounts without children are projects."""

    name: str
    share: float = 1.0
    parent: str | None = None


@dataclass(frozen=True, slots=True)
class Contract:
    """What a slice promises and is promised (design.md §3).

    ``min_runtime`` seconds of protection after the grant; 0 makes the slice
    *unallocated*: free and preemptible at any time. ``max_runtime`` is a hard end.
    """

    min_runtime: float
    resumable: bool = False
    max_runtime: float | None = None

    @property
    def allocated(self) -> bool:
        return self.min_runtime > 0


@dataclass(frozen=True, slots=True)
class Placement:
    """GPUs held (or promised) on one node."""

    node: str
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Slice:
    """A request for GPUs and, once granted, their holder.

    ``promised`` is set on a pending slice for which running slices were
    preempted: those GPUs are kept for it until the victims' grace ends.
    ``lease_expires_at`` is when the holder's last heartbeat stops counting
    (``None``: no lease, as in the simulator).
    """

    id: int
    project: str
    user: str
    gpus: int
    kind: SliceKind
    contract: Contract
    gpu_type: str | None = None
    priority: int = 0
    submitted_at: float = 0.0
    state: SliceState = SliceState.PENDING
    placements: tuple[Placement, ...] = ()
    granted_at: float | None = None
    preempt_deadline: float | None = None
    promised: tuple[Placement, ...] = ()
    lease_expires_at: float | None = None
    preemptions: int = 0  # times preempted so far (design.md §5.7: its budget)
    queued_at: float | None = None  # when it last entered the queue; None: at submission
    checkpointed_at: float | None = None  # its holder's last reported checkpoint (§5.3)

    @property
    def work_at_risk_since(self) -> float:
        """Since when a preemption would lose this slice's work: its grant, or a later
        checkpoint its holder reported."""
        return max(self.granted_at or 0.0, self.checkpointed_at or 0.0)

    @property
    def waiting_since(self) -> float:
        """When this request last entered the queue: its submission, or its requeue
        after a preemption (its place in the queue is still ``submitted_at``)."""
        return self.submitted_at if self.queued_at is None else self.queued_at

    @property
    def allocated(self) -> bool:
        return self.contract.min_runtime > 0

    @property
    def protected_until(self) -> float | None:
        if self.granted_at is None:
            return None
        return self.granted_at + self.contract.min_runtime

    @property
    def holds_gpus(self) -> bool:
        return self.state in _HOLDING

    def is_protected(self, now: float) -> bool:
        until = self.protected_until
        return until is not None and now < until

    def ends_at(self) -> float | None:
        """When a granted slice is known to end at the latest, or ``None``."""
        if self.preempt_deadline is not None:
            return self.preempt_deadline
        if self.granted_at is not None and self.contract.max_runtime is not None:
            return self.granted_at + self.contract.max_runtime
        return None


@dataclass(frozen=True, slots=True)
class Policy:
    """Admin-set knobs of the scheduler; every duration in seconds."""

    window: float = 7 * DAY  # lookback window for fair-share usage
    half_life: float | None = None  # exponential decay instead of the hard window
    max_min_runtime: float = 8 * HOUR  # cap on a contract's protected period
    grace_period: float = 60.0  # checkpoint time between preemption and reclaim
    debug_max_gpus: int = 2
    debug_max_min_runtime: float = 15 * 60.0
    debug_lane_fraction: float = 0.05
    # Blocked slices, highest ranked first, for which a backfill reservation is sought.
    max_reservations: int = 8
    project_gpu_caps: Mapping[str, int] = field(default_factory=dict)
    # Free GPUs kept for debug sessions: other work is not placed on free GPUs
    # when that would leave fewer free (design.md §1: a debug GPU in seconds).
    debug_headroom: int = 0
    # Debug sessions the lane admits take free GPUs ahead of batch work (design.md
    # §5.1), so that a release serves them rather than a victim.
    debug_first: bool = False
    # A preempted job's next protected period is this many times its last, up to
    # max_min_runtime (1: as before), so the same job is not taken again and again.
    preemption_backoff: float = 2.0
    # Preemptions a job may suffer; past them it is preempted only by a drain or
    # a node going down (design.md §5.7). None: no budget.
    preemption_budget: int | None = 5
    # A fair-share move is judged as if the request moved its project by at least
    # this many shares (0.5: half a share), so projects near the same standing do
    # not trade small jobs back and forth (design.md §5.7). 0: off.
    fair_share_margin: float = 0.0
    # How long a request waits for natural releases before it may preempt
    # allocated work, per class (design.md §5.7): a preemption costs its victim a
    # restart and its work since the last checkpoint, waiting costs the requester.
    batch_preemption_delay: float = 15 * 60.0
    interactive_preemption_delay: float = 60.0
    debug_preemption_delay: float = 0.0
    # The grace a batch slice gets when a debug session preempts it: debug
    # sessions get a GPU within this, the batch runner checkpoints on SIGTERM.
    debug_grace_period: float = 20.0
    # At most the larger of these many slices, and of this fraction of the leased
    # live slices, are ended `lost` in any minute (design.md §8): many leases
    # lapsing together mean the broker's own trouble (an overload, a network cut)
    # more often than that many holders dying at once. The rest wait for a later
    # pass, and a heartbeat before then keeps them.
    lease_lapse_floor: int = 10
    lease_lapse_fraction: float = 0.05


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one scheduling pass may look at.

    ``usage`` is each project's charged, weighted GPU-seconds in the lookback
    window (or decayed), including what running slices accrued up to ``now``.
    ``slices`` holds the live (pending, granted, preempting) slices only.
    """

    now: float
    nodes: tuple[Node, ...]
    accounts: tuple[Account, ...]
    slices: Sequence[Slice]  # oldest first: a tuple, or a read-only view of the live slices
    usage: Mapping[str, float] = field(default_factory=dict)
    gpu_type_weights: Mapping[str, float] = field(default_factory=dict)
    policy: Policy = field(default_factory=Policy)
    lapsed_last_minute: int = 0  # slices ended `lost` in the minute before ``now``
    # When the broker answered heartbeats late, as (from, to) times in order and
    # apart (design.md §8), and its lease in seconds: a lease does not run out
    # over time the broker itself was behind.
    answered_late: tuple[tuple[float, float], ...] = ()
    lease: float = 0.0

    def weight(self, gpu_type: str) -> float:
        return self.gpu_type_weights.get(gpu_type, 1.0)

    def late_between(self, start: float, end: float) -> float:
        """Seconds of ``start`` to ``end`` during which the broker answered heartbeats late.

        Found by bisection: in an overload every leased slice may ask, and a day of
        late answers that came and went may hold thousands of times."""
        late = self.answered_late
        seconds = 0.0
        for since, to in islice(late, bisect_right(late, start, key=_INTERVAL_END), None):
            if since >= end:
                break
            seconds += min(to, end) - max(since, start)
        return seconds


# ---- decisions ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Grant:
    slice_id: int
    placements: tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class Preemption:
    slice_id: int
    reason: PreemptReason
    deadline: float  # GPUs are reclaimed then
    for_slice: int | None = None  # the request the GPUs are promised to


@dataclass(frozen=True, slots=True)
class Ending:
    slice_id: int
    reason: EndReason
    requeue: bool = False  # resumable batch work goes back to the queue
    # The protected period (min_runtime) of a requeued slice's next run; None: as it was.
    protect_next: float | None = None


@dataclass(frozen=True, slots=True)
class Reservation:
    """GPUs kept for a pending slice.

    ``promised`` reservations follow a preemption and hold until granted;
    the others are backfill reservations (design.md §5.6), recomputed every pass,
    ``due_at`` being when the GPUs are expected to be free.
    """

    slice_id: int
    placements: tuple[Placement, ...]
    promised: bool
    due_at: float | None = None


@dataclass(frozen=True, slots=True)
class NodeChange:
    node: str
    state: NodeState
    reason: str


class QueueEntry(NamedTuple):
    """Where a pending slice stands, as shown to its user (design.md §4).

    A named tuple, not a dataclass: a pass makes one per pending slice, and a
    named tuple is made in less than half the time of a frozen dataclass.
    """

    slice_id: int
    position: int  # 1-based in the whole queue
    fairshare_value: float  # project's share used in the window (1: exactly its share)
    estimated_start: float | None = None


QueueRow = tuple[int, int, float, float | None]  # a QueueEntry's fields, in order
_entry = partial(tuple.__new__, QueueEntry)  # a QueueEntry from a row, without a Python call


class QueueStretch:
    """Pending slices in a row that only take their places in the queue: the rows of
    ``slices[start:stop]``, from ``position`` on, each with ``fairshare_value`` and
    no estimated start. A pass passes over most of a long backlog in such
    stretches; their rows are made when the queue is first read."""

    __slots__ = ("fairshare_value", "position", "slices", "start", "stop")

    def __init__(
        self, slices: Sequence[Slice], start: int, stop: int, position: int, value: float
    ) -> None:
        self.slices, self.start, self.stop = slices, start, stop
        self.position, self.fairshare_value = position, value

    def rows(self) -> Iterator[QueueRow]:
        return zip(
            map(_SLICE_ID, self.slices[self.start : self.stop]),
            range(self.position, self.position + self.stop - self.start),
            repeat(self.fairshare_value),
            repeat(None),
        )


_SLICE_ID = operator.attrgetter("id")


class Queue(Sequence[QueueEntry]):
    """A pass's queue: one plain row per pending slice, each made a
    :class:`QueueEntry` only when read.

    A pass lists every pending slice, and the simulator never reads the list:
    making thousands of named tuples per pass was a tenth of a simulated run,
    and the rows of the long stretches it passes over at once a twentieth
    (:class:`QueueStretch`, made rows when the queue is first read).
    Equal to any sequence of the same entries (a tuple of them included).
    """

    __slots__ = ("_made", "_make", "_parts", "_stretches", "_unmade")

    def __init__(
        self, rows: Sequence[QueueRow | QueueStretch] = (), stretches: Sequence[int] = ()
    ) -> None:
        """``rows``: the queue's rows in order, where the indexes ``stretches`` hold a
        :class:`QueueStretch` each instead."""
        self._parts, self._stretches = rows, stretches
        self._made = None if stretches else cast("Sequence[QueueRow]", rows)
        self._make: Callable[[], Sequence[QueueRow]] | None = None
        self._unmade = 0

    @classmethod
    def later(cls, make: Callable[[], Sequence[QueueRow]], unmade: int = 1) -> Queue:
        """A queue whose rows ``make`` works out when the queue is first read (from
        data that no longer changes: it may be called long after); ``unmade``: how
        many queues that will make, this one's and those it is made from."""
        queue = cls()
        queue._made, queue._make, queue._unmade = None, make, unmade
        return queue

    def unmade(self) -> int:
        """How many queues reading this one would make first (0: its rows are known
        without waiting on another queue's)."""
        return self._unmade if self._make is not None else 0

    def rows(self) -> Sequence[QueueRow]:
        """The queue's plain rows, in order (no entries made)."""
        return self._rows

    @property
    def _rows(self) -> Sequence[QueueRow]:
        if self._made is None and self._make is not None:
            self._made, self._make = self._make(), None  # the data it read can go
        elif self._made is None:
            made: list[QueueRow] = []
            start = 0
            for at in self._stretches:
                made += cast("Sequence[QueueRow]", self._parts[start:at])
                made += cast(QueueStretch, self._parts[at]).rows()
                start = at + 1
            made += cast("Sequence[QueueRow]", self._parts[start:])
            self._made = made
        return self._made

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[QueueEntry]:
        return map(_entry, self._rows)

    @overload
    def __getitem__(self, index: int) -> QueueEntry: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[QueueEntry, ...]: ...
    def __getitem__(self, index: int | slice) -> QueueEntry | tuple[QueueEntry, ...]:
        if isinstance(index, slice):
            return tuple(map(_entry, self._rows[index]))
        return _entry(self._rows[index])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Queue):
            other = other._rows
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self._rows) == len(other) and all(map(operator.eq, self._rows, other))

    def __hash__(self) -> int:
        return hash(tuple(self._rows))

    def __repr__(self) -> str:
        return f"Queue({list(self)!r})"


@dataclass(frozen=True, slots=True)
class Quiet:
    """What a pass that decided nothing knows of the next one: over the same slices
    and nodes, a pass before ``until`` (seconds) decides nothing either, as long as
    the window's project order is still ``window_order`` (resume.still_quiet). None:
    a policy that reads no window order and tells itself whether its quiet still
    holds (the simulator's baselines, ``Scheduler.still_quiet``)."""

    until: float
    window_order: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class Decisions:
    grants: tuple[Grant, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    endings: tuple[Ending, ...] = ()
    reservations: tuple[Reservation, ...] = ()
    node_changes: tuple[NodeChange, ...] = ()
    queue: Sequence[QueueEntry] = ()  # a Queue from a pass
    # Requests that could have preempted but wait for releases instead (design.md §5.7).
    deferred: tuple[int, ...] = ()
    # Slices whose lease is over that the pass keeps for a later one: the lapse limit
    # holds them, or their lease ran out only over time the broker answered late.
    lapses_held: tuple[int, ...] = ()
    quiet: Quiet | None = None  # set only when nothing above but the queue was decided
    phase_seconds: Mapping[str, float] = field(default_factory=dict, compare=False)


def changes_add_up(
    known: Mapping[int, object], changed: Mapping[int, Slice | None], count: int
) -> bool:
    """Whether ``known`` (by slice id) with ``changed`` taken in (id -> the slice, None:
    gone) holds ``count`` slices: the check that a list of changes said by a caller
    is whole, before a kept copy takes it in instead of comparing every slice."""
    added = sum(1 for i, s in changed.items() if s is not None and i not in known)
    gone = sum(1 for i, s in changed.items() if s is None and i in known)
    return len(known) + added - gone == count
