"""What the lease rules remember between passes (design.md §8): how many slices
the passes of the last minute ended ``lost`` (the lapse limit), and when the
broker answered heartbeats late (a lease does not run out over that time).

Kept in memory by the process that runs the passes, so that the pass itself
stays a function of its snapshot. A new leader starts counting afresh: at most
one more minute's worth may lapse at the hand-over, and its predecessor's late
answers are covered by the time no pass ran (``Broker._cover_absence``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import MutableSequence

from ..core.model import Decisions, EndReason

log = logging.getLogger("broker.store")

#: The lapse limit's period, in seconds: ``Policy.lease_lapse_floor`` and
#: ``lease_lapse_fraction`` are per this long.
LAPSE_PERIOD_S = 60.0
#: A heartbeat answered this many seconds or more after it came marks the broker as
#: behind (``BrokerApp.late_heartbeat``'s default): a healthy broker answers in
#: milliseconds (p99 23 ms at 500 requests/s, docs/benchmarks-api.md).
LATE_HEARTBEAT_S = 1.0
#: How long late answers are remembered, in seconds: a slice whose lease ran out
#: longer ago than this may lapse over them after all.
LATE_KEPT_S = 24 * 3600.0
#: At most this many separate times of late answers are kept (the oldest go first).
LATE_KEPT_COUNT = 4096
#: A heartbeat still unanswered this many seconds after it came no longer counts as
#: being answered: its request is gone (a database wait times out in seconds), and
#: a ticket left behind must not keep every lease from running out.
ANSWERING_KEPT_S = 600.0


class RecentLapses:
    """Slices ended ``lost`` by recent passes, by when."""

    def __init__(self) -> None:
        self._ended: deque[tuple[float, int]] = deque()  # (when, how many), oldest first
        self._held = 0  # slices the last pass held back, for the log

    def count(self, now: float) -> int:
        """Slices ended ``lost`` in the period before ``now``."""
        while self._ended and self._ended[0][0] <= now - LAPSE_PERIOD_S:
            self._ended.popleft()
        return sum(count for _, count in self._ended)

    def record(self, now: float, decisions: Decisions) -> None:
        """Take in a pass's endings; say so in the log when it first holds lapses back."""
        lost = sum(1 for ending in decisions.endings if ending.reason is EndReason.LOST)
        if lost:
            self._ended.append((now, lost))
        held = len(decisions.lapses_held)
        if held and not self._held:
            log.warning(
                "%d slices' leases are over but the pass keeps them for now (the lease "
                "lapse limit, with %d ended lost in the last minute, or heartbeats the "
                "broker answered late): are heartbeats going unanswered?",
                held,
                self.count(now),
            )
        elif self._held and not held:
            log.info("the pass keeps no slice whose lease is over any more")
        self._held = held


class LateAnswers:
    """When the broker answered heartbeats late (``late_after`` seconds or more after
    they came; 0: never), as (from, to) times in order and apart.

    Noted by the event loop's handlers, read by the pass on the database thread. A
    heartbeat still being answered counts from when it came as soon as it is late:
    the pass that follows a stall may run before the answers held up by it are
    written.
    """

    def __init__(self, late_after: float = LATE_HEARTBEAT_S) -> None:
        self.late_after = late_after
        self._times: deque[tuple[float, float]] = deque(maxlen=LATE_KEPT_COUNT)
        self._answering: dict[int, float] = {}  # ticket -> when its request came
        self._tickets = itertools.count()
        self._lock = threading.Lock()
        self._logged = float("-inf")  # when the log last told of late answers

    def came(self, at: float) -> int:
        """Note a heartbeat that came at ``at`` (epoch seconds); its ticket."""
        with self._lock:
            ticket = next(self._tickets)
            self._answering[ticket] = at
        return ticket

    def answered(self, ticket: int, at: float) -> bool:
        """Note the heartbeat of ``ticket`` answered at ``at``; whether it was late. The
        log says so when a late one begins a new time of them (at most once a minute)."""
        with self._lock:
            came = self._answering.pop(ticket, None)
            if came is None or not 0 < self.late_after < at - came:
                return False
            new = _merge_into(self._times, came, at)
            tell = new and at >= self._logged + LAPSE_PERIOD_S
            if tell:
                self._logged = at
        if tell:
            log.warning(
                "a heartbeat was answered %.1f s after it came: the broker is behind, and "
                "leases do not run out over the time it answers late",
                at - came,
            )
        return True

    def times(self, now: float) -> tuple[tuple[float, float], ...]:
        """The times heartbeats were answered late within ``LATE_KEPT_S`` of ``now``,
        with the time since the first still being answered when that one is late."""
        with self._lock:
            while self._times and self._times[0][1] < now - LATE_KEPT_S:
                self._times.popleft()
            times = list(self._times)
            answering = self._answering
            # Tickets go in the order handlers start, not the order requests came:
            # each is looked at (as many as the connections, a pass every few seconds).
            gone = [t for t, came in answering.items() if came < now - ANSWERING_KEPT_S]
            for ticket in gone:
                del answering[ticket]
            first = min(answering.values(), default=None)
        if first is not None and 0 < self.late_after < now - first:
            _merge_into(times, first, now)
        return tuple(times)


def _merge_into(times: MutableSequence[tuple[float, float]], since: float, until: float) -> bool:
    """Add ``since`` to ``until`` to ``times`` (in order and apart), merged with those it
    overlaps; whether it overlapped none."""
    new = True
    while times and since <= times[-1][1]:
        earlier, later = times.pop()
        since, until, new = min(since, earlier), max(until, later), False
    times.append((since, until))
    return new
