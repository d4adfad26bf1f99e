"""Fair-share usage kept incrementally, so that a snapshot costs O(projects), not O(ledger).

Per project, charged usage accrues at a *rate* (weighted GPUs held by its
allocated slices) that changes only when a slice is granted or ends. With a
hard window the usage at ``now`` is ``A(now) - A(now - window)``, where ``A``
is the cumulative charge, a piecewise-linear function kept as breakpoints;
with a half-life it is one decayed number per project, advanced in closed
form. Both agree with :func:`broker.core.accounting.usage_by_project` over the
same ledger (tested).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable

from ..core.accounting import LedgerEntry


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

    def open(self, project: str, rate: float, at: float) -> None:
        self._series[project].change(at, rate)

    def close(self, entry: LedgerEntry) -> None:
        self._series[entry.project].change(entry.end, -entry.rate)

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
