"""Fair-share usage kept incrementally, so that a snapshot costs O(projects), not O(ledger).

Per project, charged usage accrues at a *rate* (weighted GPUs held by its
allocated slices) that changes only when a slice is granted or ends. With a
hard window the usage at ``now`` is ``A(now) - A(now - window)``, where ``A``
is the cumulative charge, a piecewise-linear function kept as breakpoints;
with a half-life it is one decayed number per project, advanced in closed
form. Both agree with :func:`broker.core.accounting.usage_by_project` over the
same ledger (tested).

With a hard window the usages are linear between breakpoints, so the fair-share
order of the projects can be told ahead: :meth:`UsageTracker.order_at` keeps the
order with the time it can first change, and answers from it until then.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable
from itertools import pairwise

from ..core.accounting import LedgerEntry
from ..core.fairshare import ProjectTree

#: How far apart, relative to the usage charged so far, two share values must stay
#: for their order to be told ahead: a million times the rounding of computing them.
_MARGIN = 1e-9


class _Cumulative:
    """``A(t)`` of one project: breakpoints ``(time, A, rate from then on)``."""

    __slots__ = ("cum", "head", "rate", "times")

    def __init__(self) -> None:
        self.times = [-math.inf]
        self.cum = [0.0]
        self.rate = [0.0]
        self.head = 0  # breakpoints before it can no longer matter

    def value(self, t: float) -> float:
        i = bisect_right(self.times, t, self.head) - 1
        if i < 0:
            return 0.0
        start = self.times[i]
        return self.cum[i] + (self.rate[i] * (t - start) if start > -math.inf else 0.0)

    def change(self, t: float, delta: float) -> None:
        cum = self.value(t)
        self.times.append(t)
        self.cum.append(cum)
        self.rate.append(max(0.0, self.rate[-1] + delta))

    def slope(self, now: float, since: float) -> tuple[float, float, float]:
        """How fast ``A(now) - A(since)`` grows, the rate at ``since``, and until when
        it grows so (the next breakpoint after ``since``, moved by ``now - since``;
        none come after ``now``)."""
        i = bisect_right(self.times, since, self.head) - 1
        linear_until = self.times[i + 1] + (now - since) if i + 1 < len(self.times) else math.inf
        return self.rate[-1] - self.rate[i], self.rate[i], linear_until

    def forget_before(self, t: float) -> None:
        while self.head + 1 < len(self.times) and self.times[self.head + 1] <= t:
            self.head += 1
        if self.head > 4096:
            del self.times[: self.head], self.cum[: self.head], self.rate[: self.head]
            self.head = 0


class _Decayed:
    """Usage with exponential decay: ``dU/dt = rate - k·U``, advanced in closed form."""

    __slots__ = ("k", "rate", "since", "usage")

    def __init__(self, half_life: float) -> None:
        self.k = math.log(2.0) / half_life
        self.usage = 0.0
        self.rate = 0.0
        self.since = 0.0

    def value(self, t: float) -> float:
        dt = t - self.since
        if dt <= 0:
            return self.usage
        return self.usage * math.exp(-self.k * dt) + self.rate / self.k * -math.expm1(-self.k * dt)

    def change(self, t: float, delta: float) -> None:
        self.usage = self.value(t)
        self.since = max(self.since, t)
        self.rate = max(0.0, self.rate + delta)


class UsageTracker:
    """Each project's usage at any ``now`` (design.md §4), from grants and ledger entries.

    Call :meth:`open` when an allocated slice is granted and :meth:`close`
    with its ledger entry when it stops holding GPUs; times never go back.
    """

    def __init__(self, projects: Iterable[str], window: float, half_life: float | None = None):
        self.window = window
        self.half_life = half_life
        self._series: dict[str, _Cumulative | _Decayed] = {
            p: (_Decayed(half_life) if half_life is not None else _Cumulative()) for p in projects
        }
        # order_at's last answer: the order and the time before which it holds
        self._order: tuple[tuple[str, ...], float] | None = None

    def open(self, project: str, rate: float, at: float) -> None:
        self._series[project].change(at, rate)
        self._order = None

    def close(self, entry: LedgerEntry) -> None:
        self._series[entry.project].change(entry.end, -entry.rate)
        self._order = None

    def at(self, now: float) -> dict[str, float]:
        usage = {}
        for project, series in self._series.items():
            if isinstance(series, _Cumulative):
                series.forget_before(now - self.window)
                amount = series.value(now) - series.value(now - self.window)
            else:
                amount = series.value(now)
            usage[project] = max(0.0, amount)
        return usage

    def order_at(self, tree: ProjectTree, now: float) -> tuple[str, ...]:
        """``tree.project_order(self.at(now))``, computed only when it may have changed
        since the last call: after a grant or an end, or once the time it could
        first change is reached (:meth:`_steady_until`; at once with a half-life)."""
        kept = self._order
        if kept is not None and now < kept[1]:
            return kept[0]
        usage = self.at(now)
        order = tuple(tree.project_order(usage))
        if self.half_life is None:
            self._order = (order, self._steady_until(tree, usage, now))
        return order

    def _steady_until(self, tree: ProjectTree, usage: dict[str, float], now: float) -> float:
        """A time before which the fair-share order stays what it is at ``now``, with
        no grant or end in between: each account's share value moves linearly until
        a breakpoint leaves the window, so siblings next to each other in the order
        keep it until their values meet. Values closer than the rounding of
        computing them could swap at any moment, unless neither changes at all:
        then ``now``."""
        until = math.inf
        slopes: dict[str, float] = {}
        moving: dict[str, float] = {}
        charged: dict[str, float] = {}
        for project, series in self._series.items():
            assert isinstance(series, _Cumulative)  # no half-life: a hard window
            slope, tail_rate, linear_until = series.slope(now, now - self.window)
            until = min(until, linear_until)
            slopes[project] = slope
            # a project that neither charges nor has charge leaving the window keeps
            # exactly the same computed usage, rounding and all
            moving[project] = float(series.rate[-1] != 0 or tail_rate != 0)
            charged[project] = series.value(now)
        # ProjectTree.share_values: the values project_order ranks by, the same floats
        values = tree.share_values(usage)
        speeds = tree.share_values(slopes)
        scales = tree.share_values(charged)
        moves = tree.subtree_usage(moving)
        for siblings in tree.children.values():
            ranked = sorted(siblings, key=lambda n: (values[n], n))
            for first, second in pairwise(ranked):
                if not moves[first] and not moves[second]:
                    continue
                gap = values[second] - values[first]
                margin = _MARGIN * (1 + scales[first] + scales[second])
                if gap <= margin:
                    return now
                closing = speeds[first] - speeds[second]
                if closing > 0:
                    until = min(until, now + (gap - margin) / closing)
        return until
