"""What the lease lapse limit remembers between passes (design.md §8): how many
slices the passes of the last minute ended ``lost``.

Kept in memory by the process that runs the passes, so that the pass itself
stays a function of its snapshot. A new leader starts counting afresh: at most
one more minute's worth may lapse at the hand-over.
"""

from __future__ import annotations

import logging
from collections import deque

from ..core.model import Decisions, EndReason

log = logging.getLogger("broker.store")

#: The lapse limit's period, in seconds: ``Policy.lease_lapse_floor`` and
#: ``lease_lapse_fraction`` are per this long.
LAPSE_PERIOD_S = 60.0


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
                "%d slices' leases are over but the lease lapse limit keeps them for now "
                "(%d ended lost in the last minute): are heartbeats going unanswered?",
                held,
                self.count(now),
            )
        elif self._held and not held:
            log.info("the lease lapse limit holds no slice any more")
        self._held = held
