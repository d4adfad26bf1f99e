"""The service's engine room: database work off the event loop, and the scheduling loop.

:class:`BrokerRunner` owns the :class:`~broker.store.Broker` and one worker
thread (:mod:`.dbthread`). Every call into the Broker — requests, passes, token
look-ups — runs on that thread, one after another, so the event loop never
blocks on the database and database work in this process is serialised. The
group commit of heartbeats and the look-up of tokens go before other waiting
work: under load a heartbeat must not wait behind seconds of passes and reads
until its lease lapses.

Requests that write (:meth:`BrokerRunner.write`, :meth:`BrokerRunner.change`)
are journaled by group commit: the writes that queued while the thread was
busy run together in one transaction, which is committed once (a write refused
after it had written rolls it back, and the others run again without it); each
request is answered only after that commit (design.md §8). Under
load a commit, and its flush to disk, is shared by many requests; alone, a
request waits for nothing more than its own commit. Requests in flight at the
same time have no order between them, so a group runs its durable writes in one
commit and the writes that may be lost (heartbeats) in another, queued apart.
Reads go through
:meth:`BrokerRunner.read`, which today uses the same thread: reads on threads
of their own (they take no write lock) were measured slower under load, as
they and the event loop then fight for the GIL (docs/benchmarks-api.md).

The scheduling loop (:meth:`BrokerRunner.run_forever`) runs a pass

1. whenever a request changed something (:meth:`BrokerRunner.request_pass`);
   requests arriving while a pass runs are coalesced into one more pass;
2. at the earliest deadline of a live slice — end of protection, end of a
   grace period, ``max_runtime``, lease expiry — so contracts end on time
   without any request (the pass's own index tells it: ``Broker.next_wake``);
3. every ``pass_interval`` seconds otherwise (usage windows slide, other
   processes may share the database).

After every pass, long-poll waiters (:class:`SliceWatchers`) hear which slices
changed, and the runner keeps the pass's list of live slices
(:meth:`BrokerRunner.remembered`), so that a read can still be answered
when the database does not answer in time.

With ``db_timeout`` set, no request waits for the database thread longer than
``db_timeout`` plus :data:`DB_TIMEOUT_SLACK_S`: it is answered 503
(:class:`DatabaseTimeout`) instead, even when the database hangs without
failing the statement; database work still queued by then is dropped.

Nothing here is needed to recover from a crash: the database is the
truth, and a restarted service carries on from it; its first pass extends the
live leases by the time it was away (``Broker.run_pass_and_live``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy.exc import OperationalError

from ..core.model import PASS_INTERVAL, Decisions
from ..errors import BrokerError
from ..store import Broker
from ..store.journal import is_durable
from .dbthread import DatabaseThread
from .metrics import BrokerMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What a long-poll waiter compares: a slice's state and queue position.
SliceKey = tuple[str, int | None]

#: A pass aimed at a deadline runs this long after it, so that "now >= deadline" holds.
DEADLINE_SLACK_S = 0.01
#: Shortest time between the starts of two passes, in seconds. Under load a pass
#: would otherwise follow every change back to back and take half the write
#: thread; waiting this long lets a burst of changes share one pass, at the cost of
#: at most this much more time to a grant.
PASS_GAP_S = 0.05
#: Passes further apart than this many pass intervals mean the broker was away.
USUAL_GAP_PASSES = 3
#: How much longer than ``db_timeout`` a request waits for the database thread: the
#: database's own timeout, when it has one, then fails the statement first.
DB_TIMEOUT_SLACK_S = 1.0
#: What-if answers kept to answer again once the what-if budget is spent: the most
#: recently asked, so one per waiting request and asker of even a large queue.
WHAT_IF_KEPT = 4096
#: Seconds a what-if answer is shared across passes that decided nothing: such a
#: pass leaves what-if passes as they were but for the usage accrued since and the
#: clock, which move estimates slowly; the pending page marks older answers.
WHAT_IF_SHARED_FOR = 60.0


def slice_key(slice_: Mapping[str, Any]) -> SliceKey:
    return slice_["state"], slice_["queue_position"]


class _Keys(Mapping[int, SliceKey]):
    """Each live slice's key (:func:`slice_key`), made only for the slices asked
    about: a pass tells the few watched slices of thousands live."""

    def __init__(self, live: Mapping[int, Mapping[str, Any]]):
        self._live = live

    def __getitem__(self, slice_id: int) -> SliceKey:
        return slice_key(self._live[slice_id])

    def __contains__(self, slice_id: object) -> bool:
        return slice_id in self._live

    def __iter__(self) -> Iterator[int]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)


class SliceWatchers:
    """Long-poll waiters, per slice, woken by news of that slice.

    News is a hint, not the truth: a woken waiter reads the slice again. A
    waiter registers with ``is_news(key)``; :meth:`publish` resolves it when a
    slice's new key (state, queue position) is news to it, or when the key is
    unknown (``None``: the slice left the live set). ``generation`` counts
    publications, so that a waiter can tell whether one raced its read.
    """

    def __init__(self) -> None:
        self._waiters: dict[int, dict[asyncio.Future, Callable[[SliceKey | None], bool]]] = {}
        self.generation = 0
        self.closed = False

    def watch(self, slice_id: int, is_news: Callable[[SliceKey | None], bool]) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if self.closed:
            future.set_result(None)
            return future
        self._waiters.setdefault(slice_id, {})[future] = is_news
        return future

    def close(self) -> None:
        """Wake every waiter for good: the service is stopping."""
        self.closed = True
        for waiters in self._waiters.values():
            for future in waiters:
                if not future.done():
                    future.set_result(None)

    def unwatch(self, slice_id: int, future: asyncio.Future) -> None:
        waiters = self._waiters.get(slice_id)
        if waiters is not None:
            waiters.pop(future, None)
            if not waiters:
                del self._waiters[slice_id]

    def __len__(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    def publish(self, news: Mapping[int, SliceKey], *, complete: bool) -> None:
        """Tell waiters about ``news``. ``complete``: ``news`` lists every live slice,
        so a watched slice missing from it has changed (ended, most likely)."""
        self.generation += 1
        for slice_id, waiters in list(self._waiters.items()):
            if slice_id in news:
                key: SliceKey | None = news[slice_id]
            elif complete:
                key = None
            else:
                continue
            for future, is_news in list(waiters.items()):
                if not future.done() and (key is None or is_news(key)):
                    future.set_result(key)


#: A pass's decisions, the live slices after it (by id) and when the next pass has
#: something to do (epoch seconds; None: nothing timed).
PassOutcome = tuple[Decisions, Mapping[int, dict[str, Any]], float | None]
#: A pass that followed a group commit: its outcome, and the seconds it took.
GroupPass = tuple[Decisions, Mapping[int, dict[str, Any]], float | None, float]


@dataclass(eq=False)
class _Write:
    """A write waiting for its group commit."""

    call: Callable[[], Any]
    durable: bool
    future: asyncio.Future
    #: A submission: a pass follows its group's commit (see :meth:`BrokerRunner.submit`).
    wants_pass: bool = False
    #: Set on the event loop when nobody waits for the answer any more: not run then.
    abandoned: bool = False
    #: Set once committed: whether a pass ran after the write (no other is needed for it).
    passed: bool = False
    #: A heartbeat's ``(slice_id, caller)``: a group's heartbeats are one Broker write.
    heartbeat: tuple[int, Any] | None = None


#: A write's outcome on the database thread: its answer, or its error.
_Answer = tuple[_Write, Any, BaseException | None]


class _GroupSpoiled(Exception):
    """A write of a group commit was refused after it had written: the group is
    rolled back (leaving by this exception) and run again without it."""

    def __init__(self, answers: list[_Answer]):
        super().__init__("a write of the group was refused after it had written")
        self.answers = answers  # the refusals of the write (or heartbeats) that spoiled it


class DatabaseTimeout(BrokerError):
    """The database did not answer within the service's ``db_timeout``."""

    status = 503
    code = "database_unavailable"
    retry_after = 1.0  # seconds: the answer's Retry-After


class Overloaded(BrokerError):
    """More database work waits than ``shed_after`` allows: come back later."""

    status = 503
    code = "overloaded"

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class BrokerRunner:
    """Runs ``broker`` on one worker thread and keeps the schedule going.

    ``pass_interval`` (seconds) is the longest time between passes; ``pass_gap``
    (seconds) the shortest between the starts of two passes. ``db_timeout``
    (seconds, ``None``: unbounded) bounds how long a request waits for the
    database thread (see the module's docstring). ``grant_at_once``: a pass
    follows every group commit that holds a submission (:meth:`submit`); the
    service sets it, tests that drive passes by hand leave it off.
    """

    def __init__(
        self,
        broker: Broker,
        *,
        pass_interval: float = PASS_INTERVAL,
        pass_gap: float = PASS_GAP_S,
        metrics: BrokerMetrics | None = None,
        db_timeout: float | None = None,
        grant_at_once: bool = False,
        what_if_share: float = 0.1,
        shed_after: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        work_clock: Callable[[], float] = time.perf_counter,
    ):
        """``clock`` tells when things happen (what-if credit is earned by it);
        ``work_clock`` measures a what-if read's time on the database thread (seconds)."""
        self.broker = broker
        self._work_clock = work_clock
        self.shed_after = shed_after
        # Work queued for the database thread and not started yet: ticket -> when it
        # was queued (monotonic), oldest first; the thread takes it out as it starts.
        self._queued: dict[int, float] = {}
        self._queued_lock = threading.Lock()
        self._tickets = itertools.count()
        self.grant_at_once = grant_at_once
        self.pass_interval = pass_interval
        # Passes further apart than this mean nobody could heartbeat meanwhile.
        broker.usual_gap = USUAL_GAP_PASSES * pass_interval
        self.pass_gap = pass_gap
        self.db_timeout = db_timeout
        # The live slices as the last pass left them, by id (shared views: never
        # changed here), and as changes since left them (None: no longer live).
        self._live: Mapping[int, dict[str, Any]] = {}
        self._changed_since_pass: dict[int, dict[str, Any] | None] = {}
        self.metrics = metrics or BrokerMetrics()
        self.watchers = SliceWatchers()
        self.executor = DatabaseThread("slicebroker-db")
        self.next_wake: float | None = None  # epoch seconds of the next deadline
        self._wakes_at = 0.0  # epoch seconds at which the loop looks again, at the latest
        self.passes = 0
        self._wanted = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._first_pass = asyncio.Event()
        # Reads shared until the next pass or change: fn -> its computation.
        self._between_passes: dict[Hashable, asyncio.Future] = {}
        # What-if reads shared until a pass decides something or a change (a what-if
        # pass asks the same snapshot as the last one then), since when.
        self._until_decided: dict[Hashable, asyncio.Future] = {}
        self._until_decided_since = 0.0
        # What-if reads: their share of the database thread, as seconds of credit
        # refilled at that rate (at most a pass interval's worth; a computation queued
        # is counted at its estimate, so the credit may go below zero), when it was
        # last refilled, and each key's last answer.
        self.what_if_share = what_if_share
        self._clock = clock
        self._what_if_credit = what_if_share * pass_interval
        self._what_if_refilled_at: float | None = None
        self._what_if_cost = 0.0  # seconds the last one took: the next one's estimate
        self._what_if_last: OrderedDict[Hashable, Any] = OrderedDict()
        # Writes waiting for the next group commit, by durability; the lock guards them
        # and the flags (a commit of that durability queued on the database thread).
        self._writes: dict[bool, list[_Write]] = {True: [], False: []}
        self._writes_lock = threading.Lock()
        self._commit_queued = {True: False, False: False}

    # ---- database work ------------------------------------------------------------

    def _queue(self, call: Callable[[], T]) -> tuple[int, Callable[[], T]]:
        """``call`` counted as waiting for the database thread until it starts there."""
        ticket = next(self._tickets)
        with self._queued_lock:
            self._queued[ticket] = time.monotonic()

        def started() -> T:
            self._unqueue(ticket)
            return call()

        return ticket, started

    def _unqueue(self, ticket: int) -> None:
        with self._queued_lock:
            self._queued.pop(ticket, None)

    def waiting_for(self) -> float:
        """Seconds the oldest work queued for the database thread has waited (0: none)."""
        with self._queued_lock:
            oldest = next(iter(self._queued.values()), None)
        return 0.0 if oldest is None else time.monotonic() - oldest

    def check_load(self) -> None:
        """:class:`Overloaded` while the database thread's queue holds work older than
        ``shed_after`` seconds (0: never): a request refused at once, with when to come
        back, instead of one answered after the queue or not at all."""
        if self.shed_after <= 0:
            return
        waited = self.waiting_for()
        if waited > self.shed_after:
            raise Overloaded(
                f"the broker is busy: its database work has waited {waited:.1f} s; "
                "try again shortly",
                retry_after=max(1.0, waited),
            )

    def heartbeat_came(self, at: float) -> int:
        """Note a heartbeat request that came at ``at`` (epoch seconds); its ticket for
        :meth:`heartbeat_answered`."""
        return self.broker.late_answers.came(at)

    def heartbeat_answered(self, ticket: int) -> None:
        """The heartbeat of ``ticket`` is answered now: past the Broker's ``late_heartbeat``
        (0: never) after it came, the time it took is one the broker answered late, over which no
        lease runs out (design.md §8)."""
        if self.broker.late_answers.answered(ticket, time.time()):
            self.metrics.heartbeats_late.inc()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the database thread, within ``db_timeout`` and
        its slack, else :class:`DatabaseTimeout`."""
        bound = None if self.db_timeout is None else self.db_timeout + DB_TIMEOUT_SLACK_S
        return await self.run_within(bound, fn, *args, **kwargs)

    async def read_urgent(self, fn: Callable[[], T]) -> T:
        """``fn()``, a small read every request waits for (a token's look-up), on the
        database thread before the work that is not urgent (:mod:`.dbthread`)."""
        bound = None if self.db_timeout is None else self.db_timeout + DB_TIMEOUT_SLACK_S
        return await self.run_within(bound, fn, urgent=True)

    async def run_within(
        self,
        seconds: float | None,
        fn: Callable[..., T],
        *args: Any,
        urgent: bool = False,
        **kwargs: Any,
    ) -> T:
        """``fn(*args, **kwargs)`` on the database thread (before the rest if
        ``urgent``); :class:`DatabaseTimeout` unless it is done within ``seconds``
        (``None``: no bound).

        On time-out a call still queued never runs; one already running finishes
        on the thread, and its answer is dropped.
        """
        ticket, started = self._queue(functools.partial(fn, *args, **kwargs))
        submit = self.executor.submit_urgent if urgent else self.executor.submit
        future = asyncio.wrap_future(submit(started))
        future.add_done_callback(lambda _: self._unqueue(ticket))  # also when never run
        if seconds is None:
            return await future
        try:
            async with asyncio.timeout(seconds):
                return await future
        except TimeoutError:
            raise DatabaseTimeout(
                f"the database did not answer within {seconds:g} s; try again shortly"
            ) from None

    def remembered(self, slice_id: int) -> dict[str, Any] | None:
        """Slice ``slice_id`` as the last pass or change left it, if it was live then:
        what a read answers when the database does not."""
        if slice_id in self._changed_since_pass:
            return self._changed_since_pass[slice_id]
        return self._live.get(slice_id)

    def remembered_live(self) -> list[dict[str, Any]]:
        """Every slice live at the last pass or change, oldest first, as then."""
        ids = sorted(set(self._live).union(self._changed_since_pass))
        return [slice_ for slice_ in map(self.remembered, ids) if slice_ is not None]

    def _remember(self, slice_: Mapping[str, Any]) -> None:
        live = slice_.get("state") in ("pending", "granted", "preempting")
        self._changed_since_pass[slice_["id"]] = dict(slice_) if live else None

    async def read(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, which must only read, off the event loop.

        The one place that decides where reads run: now the database thread
        (see the module's docstring), so a read sees every write queued before it.
        """
        return await self.run(fn, *args, **kwargs)

    async def read_committed(
        self, committed: Callable[..., T | None], fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """``committed(*args, **kwargs)``, a Broker's ``committed_*`` read, answered here on
        the event loop from what the last commit left, never queued behind passes and
        writes; where it has no answer, ``fn(*args, **kwargs)`` read as :meth:`read` does.
        A write answered before the read began is in what the last commit left."""
        answer = committed(*args, **kwargs)
        if answer is not None:
            return answer
        return await self.read(fn, *args, **kwargs)

    async def read_between_passes(self, fn: Callable[[], T], key: Hashable | None = None) -> T:
        """``fn()``'s answer, computed once until the next pass or change (per ``key``,
        by default ``fn`` itself).

        For reads that are costly and only move with the schedule, such as the
        project tree with its window usage: between two passes (at most
        ``pass_interval`` apart) it changes only by the usage running slices
        accrue, so many readers share one computation. Readers that arrive while it
        runs wait for that same computation rather than queueing one each; a failed
        one is not kept.
        """
        return await self._shared(self._between_passes, fn, fn if key is None else key)

    async def _shared(self, table: dict[Hashable, asyncio.Future], fn: Callable[[], T],
                      key: Hashable, done: Callable[[], None] | None = None) -> T:  # fmt: skip
        """``fn()``'s answer, one computation per ``key`` while ``table`` keeps it;
        ``done`` is called on the event loop once a computation started here has run."""
        shared = table.get(key)
        if shared is None:
            shared = asyncio.ensure_future(self.read(fn))
            table[key] = shared
            shared.add_done_callback(functools.partial(self._forget_failed, table, key))
            if done is not None:
                shared.add_done_callback(lambda _: done())
        return await asyncio.shield(shared)

    async def read_what_if(
        self, fn: Callable[[], T], key: Hashable, checks_only: Callable[[], T]
    ) -> tuple[T, bool]:
        """A what-if read (alternatives, expected starts: design.md §5.8) and whether its
        answer is stale.

        Shared as :meth:`read_between_passes`, but across passes that decided nothing
        (for at most ``WHAT_IF_SHARED_FOR``): such a pass leaves the snapshot a what-if
        pass asks as it was. And bounded: what-if reads may take ``what_if_share`` of
        the database thread's time, at most a ``pass_interval``'s worth at once. Past
        it, a key never answered gets the answer of ``checks_only`` (the same read's
        permission checks, with nothing computed), stale, until the time spent is
        earned back; a key answered before gets its last answer again, stale, from
        half-way there, so that what is left goes to first answers.
        """
        self._refill_what_if()
        if key in self._until_decided:  # computed or queued on this snapshot: shared
            answer = await self._shared(self._until_decided, fn, key)
        elif key in self._what_if_last and self._what_if_credit < self._refresh_floor():
            # Low on credit, a request without an answer comes first: it is the one
            # that would show nothing at all.
            return self._what_if_last[key], True
        elif self._what_if_credit <= 0:
            return await self.read(checks_only), True
        else:
            counted, settle = self._counted(fn)
            answer = await self._shared(self._until_decided, counted, key, done=settle)
        self._what_if_last[key] = answer
        self._what_if_last.move_to_end(key)
        if len(self._what_if_last) > WHAT_IF_KEPT:
            self._what_if_last.popitem(last=False)  # the longest unasked: its slice is gone
        return answer, False

    def _refresh_floor(self) -> float:
        """Credit below which only first answers are computed: half the most it holds."""
        return self.what_if_share * self.pass_interval / 2

    def _refill_what_if(self) -> None:
        """Earn back what-if credit at ``what_if_share`` seconds per second, up to a
        ``pass_interval``'s worth: time spent in one interval is owed in the next,
        rather than forgotten when a new one starts."""
        now = self._clock()
        earned = 0.0
        if self._what_if_refilled_at is not None:
            earned = max(0.0, now - self._what_if_refilled_at) * self.what_if_share
        most = self.what_if_share * self.pass_interval  # the share may change at run time
        self._what_if_credit = min(most, self._what_if_credit + earned)
        self._what_if_refilled_at = now

    def _counted(self, fn: Callable[[], T]) -> tuple[Callable[[], T], Callable[[], None]]:
        """``fn`` counted against the what-if credit: at the last computation's cost from
        now (reads queued behind it on the database thread see the credit as it will
        be, not as before any of them ran), and the callback that corrects it to its
        own cost once it has run (on the event loop, which alone moves the credit)."""
        estimate = self._what_if_cost
        self._what_if_credit -= estimate
        cost = [estimate]

        def counted() -> T:
            began = self._work_clock()
            try:
                return fn()
            finally:
                cost[0] = self._work_clock() - began

        def settle() -> None:
            self._what_if_cost = cost[0]
            self._what_if_credit -= cost[0] - estimate

        return counted, settle

    @staticmethod
    def _forget_failed(table: dict, key: Hashable, shared: asyncio.Future) -> None:
        if (shared.cancelled() or shared.exception()) and table.get(key) is shared:
            del table[key]

    async def write(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, a Broker write, in the next group commit (see the
        module's docstring) of writes as durable as it is declared (a heartbeat is
        not: :func:`~broker.store.journal.not_durable`); answered once committed."""
        heartbeat = None
        if fn == self.broker.heartbeat and len(args) == 1 and set(kwargs) <= {"caller"}:
            heartbeat = (args[0], kwargs.get("caller"))
        written = await self._written(fn, args, kwargs, is_durable(fn), heartbeat=heartbeat)
        return written.future.result()

    async def _written(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        durable: bool,
        wants_pass: bool = False,
        heartbeat: tuple[int, Any] | None = None,
    ) -> _Write:
        """Queue a write, wait for its commit within ``db_timeout`` and its slack."""
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args, **kwargs)
        write = _Write(
            call, durable, loop.create_future(), wants_pass=wants_pass, heartbeat=heartbeat
        )
        with self._writes_lock:
            self._writes[durable].append(write)
            if not self._commit_queued[durable]:
                self._commit_queued[durable] = True
                # Writes that may be lost (heartbeats) commit before other waiting work:
                # a heartbeat that waits behind passes and reads lets its lease lapse.
                submit = self.executor.submit if durable else self.executor.submit_urgent
                submit(self._queue(functools.partial(self._commit_group, loop, durable))[1])
        bound = None if self.db_timeout is None else self.db_timeout + DB_TIMEOUT_SLACK_S
        try:
            async with asyncio.timeout(bound):
                await asyncio.shield(write.future)
        except TimeoutError:
            write.abandoned = True
            raise DatabaseTimeout(
                f"the database did not answer within {bound:g} s; try again shortly"
            ) from None
        return write

    def _commit_group(self, loop: asyncio.AbstractEventLoop, durable: bool) -> None:
        """On the database thread: run the queued writes as durable as ``durable`` in
        one commit, then hand their answers to the event loop."""
        with self._writes_lock:
            writes, self._writes[durable] = self._writes[durable], []
            self._commit_queued[durable] = False
        group = [w for w in writes if not w.abandoned]
        if group:
            answers = self._run_group(group, durable)
            group_pass = None
            if any(w.wants_pass and error is None for w, _, error in answers):
                answers, group_pass = self._pass_after(answers)
            loop.call_soon_threadsafe(self._answer, answers, group_pass)

    def _pass_after(self, answers: list[_Answer]) -> tuple[list[_Answer], GroupPass | None]:
        """The pass right after a group commit with submissions in it, so that each is
        answered as the pass left it: granted when it fits. One pass serves the whole
        group, however many submissions it holds. Should it fail, they stay pending
        and the loop's next pass takes them."""
        started = time.perf_counter()
        try:
            decisions, live, wake = self._pass_and_live()
        except Exception as err:  # the loop's pass, which the writes ask for, tries again
            self._pass_failed(err)
            return answers, None
        refreshed: list[_Answer] = []
        for write, value, error in answers:
            write.passed = True
            if write.wants_pass and error is None:
                value = live.get(value["id"], value)
            refreshed.append((write, value, error))
        return refreshed, (decisions, live, wake, time.perf_counter() - started)

    def _run_group(self, group: list[_Write], durable: bool) -> list[_Answer]:
        """Run ``group`` in one transaction and commit it. A write refused after it had
        written spoils the transaction: it is rolled back, that write (or the group's
        heartbeats, one write) answered its refusal, and the others run again."""
        refused: list[_Answer] = []
        while group:
            try:
                return refused + self._group_once(group, durable)
            except _GroupSpoiled as spoiled:  # rolled back: again, without the spoiler
                refused += spoiled.answers
                gone = {id(write) for write, _, _ in spoiled.answers}
                # Nobody waits any more for an abandoned write (its client timed out).
                group = [w for w in group if id(w) not in gone and not w.abandoned]
            except Exception as err:  # no commit: none of the group happened
                return refused + [(write, None, err) for write in group]
        return refused

    def _group_once(self, group: list[_Write], durable: bool) -> list[_Answer]:
        """One try of :meth:`_run_group`: the answers, or :class:`_GroupSpoiled`."""
        journal = self.broker.journal
        answers: list[_Answer] = []
        beats = [write for write in group if write.heartbeat is not None]
        with journal.group_commit(durable=durable):
            if beats:
                # The group's heartbeats as one write: their leases in one statement.
                answers += self._heartbeats(beats)
                if journal.group_spoiled:
                    raise _GroupSpoiled(answers)
            for write in group:
                if write.heartbeat is not None:
                    continue
                try:
                    answers.append((write, write.call(), None))
                except Exception as err:  # a refusal: what it wrote is undone
                    if journal.group_spoiled:
                        raise _GroupSpoiled([(write, None, err)]) from None
                    answers.append((write, None, err))
        return answers

    def _heartbeats(self, beats: list[_Write]) -> list[_Answer]:
        """Run heartbeat writes as one :meth:`~broker.store.Broker.heartbeats`; each is
        answered its own slice or refusal, and all the error if the write fails."""
        try:
            values = self.broker.heartbeats([write.heartbeat for write in beats])
        except Exception as err:  # none of them happened (undone with the group if it wrote)
            return [(write, None, err) for write in beats]
        return [
            (write, None, value) if isinstance(value, BaseException) else (write, value, None)
            for write, value in zip(beats, values, strict=True)
        ]

    def _answer(self, answers: list[_Answer], group_pass: GroupPass | None) -> None:
        """On the event loop: take in the pass that followed the group, if one did,
        then answer each write."""
        if group_pass is not None:
            self._passed(*group_pass)
            # That pass ran after every write answered before it: the passes they
            # asked for are done.
            self._wanted.clear()
        for write, value, error in answers:
            if write.abandoned or write.future.done():
                continue
            if error is not None:
                write.future.set_exception(error)
            else:
                write.future.set_result(value)

    async def change(self, fn: Callable[..., dict], *args: Any, **kwargs: Any) -> dict:
        """A request that may change the schedule: write it, tell waiters, ask for a pass.

        A request that a pass followed (its group held a submission) needs no
        other: that pass is taken in as any pass is (:meth:`_passed`), and the loop
        is woken only if it left a deadline sooner than the loop's next timed pass.
        """
        return await self._change(fn, args, kwargs, wants_pass=False)

    async def submit(self, fn: Callable[..., dict], *args: Any, **kwargs: Any) -> dict:
        """A submission: a :meth:`change` whose group commit a pass follows at once, so
        that a slice that fits free GPUs is answered granted, by the pass itself
        (design.md §8), never left to wait for the loop's next pass."""
        return await self._change(fn, args, kwargs, wants_pass=True)

    async def _change(self, fn: Callable[..., dict], args: tuple, kwargs: dict, wants_pass: bool):
        wants_pass = wants_pass and self.grant_at_once
        write = await self._written(fn, args, kwargs, durable=True, wants_pass=wants_pass)
        slice_ = write.future.result()
        self._between_passes.clear()
        self._until_decided.clear()
        soon = self.next_wake is not None and self.next_wake < self._wakes_at
        if not write.passed or soon:
            self.request_pass()
        if isinstance(slice_, dict) and "queue_position" in slice_:
            self._remember(slice_)
            self.watchers.publish({slice_["id"]: slice_key(slice_)}, complete=False)
        return slice_

    # ---- the scheduling loop ------------------------------------------------------

    @property
    def pass_requested(self) -> bool:
        """Whether a pass was asked for and has not started yet."""
        return self._wanted.is_set()

    def request_pass(self) -> None:
        """Ask for a pass soon, after a change (an inventory's nodes, a release outside
        a request); any number of requests before it starts make one pass. What-if
        answers asked of the state before the change are not shared any more."""
        self._until_decided.clear()
        self._wanted.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run_forever())

    async def started(self) -> None:
        """Return once the first pass after start has run (or failed)."""
        await self._first_pass.wait()

    async def stop(self) -> None:
        """Stop the loop, let the running database call finish, close the Broker."""
        if self._task is not None:
            # The loop also checks a flag: Python 3.11's asyncio.wait_for returns its
            # call's result, and drops the cancellation, when both come at once.
            self._stopping = True
            self._wanted.set()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.get_running_loop().run_in_executor(None, self.executor.shutdown, True)
        self.broker.close()

    async def know_projects(self) -> None:
        """Give the metrics the tree's projects, so that their series exist before their
        first event: at start, and after every change of the tree."""
        try:
            projects = await self.read(self.broker.projects)
        except (OperationalError, DatabaseTimeout) as err:
            # The pass that follows fails too, and says so; the next change tries again.
            log.warning("metrics: the projects are not known yet (%s)", str(err).splitlines()[0])
            return
        self.metrics.know_projects(p["name"] for p in projects if p["is_project"])

    async def run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        await self.know_projects()  # before the first pass, which may grant
        while not self._stopping:
            self._wanted.clear()
            started = loop.time()
            await self.run_pass()
            self._first_pass.set()
            delay = self._delay()
            self._wakes_at = time.time() + delay
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wanted.wait()
            # Coalesce bursts: changes arriving within the gap share the next pass.
            await asyncio.sleep(max(0.0, started + self.pass_gap - loop.time()))

    def _delay(self) -> float:
        delay = self.pass_interval
        if self.next_wake is not None:
            delay = min(delay, max(0.0, self.next_wake - time.time()) + DEADLINE_SLACK_S)
        return delay

    async def run_pass(self) -> Decisions | None:
        """One pass, then metrics, the next deadline and news for waiters."""
        started = time.perf_counter()
        try:
            decisions, live, wake = await self.run(self._pass_and_live)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self.next_wake = None
            self._pass_failed(err)
            return None
        self._passed(decisions, live, wake, time.perf_counter() - started)
        return decisions

    def _pass_failed(self, err: Exception) -> None:
        """Count and log a failed pass: one line for an outage, a traceback otherwise."""
        self.metrics.pass_failures.inc()
        if isinstance(err, OperationalError | DatabaseTimeout):
            reason = str(err).splitlines()[0]
            log.error("scheduling pass failed: database unavailable (%s); next try in %g s",
                      reason, self.pass_interval)  # fmt: skip
        else:
            log.error("scheduling pass failed; next try in %g s", self.pass_interval,
                      exc_info=err)  # fmt: skip

    def _passed(
        self,
        decisions: Decisions,
        live: Mapping[int, dict[str, Any]],
        next_wake: float | None,
        seconds: float,
    ) -> None:
        """Take in a pass (:data:`PassOutcome`, and the seconds it took): metrics, the
        live slices, the next deadline, news for waiters."""
        self.passes += 1
        self._between_passes.clear()
        now = self._clock()
        decided = decisions.grants or decisions.preemptions or decisions.endings
        if (
            decided
            or decisions.node_changes
            or now - self._until_decided_since > WHAT_IF_SHARED_FOR
        ):
            self._until_decided.clear()
            self._until_decided_since = now
        self.metrics.record_pass(decisions, live, seconds)
        self.next_wake = next_wake
        self.watchers.publish(_Keys(live), complete=True)
        self._live = live
        self._changed_since_pass.clear()
        if decisions.grants or decisions.preemptions or decisions.endings:
            log.info(
                "pass: %d granted, %d preempted, %d ended, %d waiting (%.1f ms)",
                len(decisions.grants),
                len(decisions.preemptions),
                len(decisions.endings),
                len(decisions.queue),
                1000 * seconds,
            )

    def _pass_and_live(self) -> PassOutcome:
        """On the database thread: a pass and the live slices after it (one
        transaction: no request slips between them), and when the next pass has
        something to do, from the pass's own index (``Broker.next_wake``)."""
        decisions, live = self.broker.run_pass_and_live()
        return decisions, live, self.broker.next_wake(time.time())
