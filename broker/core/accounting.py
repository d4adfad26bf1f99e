"""GPU-time accounting (design.md §3–§4): charges, fair-share usage and usage reports.

Pure functions over ledger intervals; nothing here reads a clock or a database.
All amounts are *weighted* GPU-seconds: GPUs held × the GPU type's weight ×
seconds. An interval's ``rate`` is that product without the seconds, i.e. the
weighted GPU-seconds it accrues per second.
"""

from __future__ import annotations

import csv
import heapq
import io
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from .model import Placement, Slice, changes_add_up


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One held interval of an allocated slice, charged to ``project``.

    ``gpus`` is the plain GPU count behind ``rate`` (0 when unknown); reports use
    it for unweighted GPU-seconds.
    """

    slice_id: int
    project: str
    user: str
    start: float
    end: float
    rate: float
    gpus: int = 0

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def weighted_gpu_seconds(self) -> float:
        return self.rate * self.duration


# ---- usage at a point in time -------------------------------------------------


def window_usage(start: float, end: float, rate: float, now: float, window: float) -> float:
    """What ``[start, end]`` at ``rate`` adds to usage at ``now`` with a hard sliding window.

    The overlap of the interval with ``[now - window, now]``, times the rate; time
    after ``now`` does not count (it has not happened yet).
    """
    low = max(start, now - window)
    high = min(end, now)
    return rate * max(0.0, high - low)


def decayed_usage(start: float, end: float, rate: float, now: float, half_life: float) -> float:
    """What ``[start, end]`` at ``rate`` adds to usage at ``now`` with exponential decay.

    ``∫ rate · 2^(-(now - t) / half_life) dt`` over the part of the interval
    before ``now``, in closed form: ``rate/k · e^(-k(now-high)) · (1 - e^(-k(high-start)))``
    with ``k = ln 2 / half_life``.
    """
    high = min(end, now)
    if high <= start:
        return 0.0
    k = math.log(2.0) / half_life
    # expm1 keeps short intervals exact where 1 - e^-x would cancel to zero.
    return rate / k * math.exp(-k * (now - high)) * -math.expm1(-k * (high - start))


def entry_usage(
    entry: LedgerEntry, now: float, window: float, half_life: float | None = None
) -> float:
    """An entry's contribution at ``now``: decayed when ``half_life`` is set, else windowed."""
    return interval_usage(entry.start, entry.end, entry.rate, now, window, half_life)


def interval_usage(
    start: float, end: float, rate: float, now: float, window: float, half_life: float | None
) -> float:
    """What ``[start, end]`` at ``rate`` adds to usage at ``now`` (see :func:`entry_usage`)."""
    if half_life is not None:
        return decayed_usage(start, end, rate, now, half_life)
    return window_usage(start, end, rate, now, window)


def usage_horizon(window: float, half_life: float | None) -> float:
    """How far back entries can still matter at ``now``.

    With decay, anything older than 40 half-lives weighs under 1e-12 of its
    charge; the store uses this to avoid loading the whole ledger every pass.
    """
    return 40.0 * half_life if half_life is not None else window


def usage_by_project(
    entries: Iterable[LedgerEntry],
    running: Iterable[tuple[str, float, float]],
    now: float,
    window: float,
    half_life: float | None = None,
) -> dict[str, float]:
    """Each project's usage at ``now`` (design.md §4).

    ``entries`` are closed ledger intervals; ``running`` are intervals still
    open, as ``(project, start, rate)`` (:func:`running_interval`), counted up to
    ``now``: a service with thousands of live slices builds no entry for each
    every pass.
    """
    usage: dict[str, float] = {}
    for entry in entries:
        amount = entry_usage(entry, now, window, half_life)
        usage[entry.project] = usage.get(entry.project, 0.0) + amount
    for project, start, rate in running:
        amount = interval_usage(start, now, rate, now, window, half_life)
        usage[project] = usage.get(project, 0.0) + amount
    return usage


class RunningCharges:
    """What the held slices have accrued in a hard window, per project, kept from
    one call to the next (design.md §4): the running part of
    :func:`usage_by_project` at a cost that follows what changed.

    A held slice adds ``rate × (now − max(start, now − window))``. Slices are
    kept in groups of (project, rate) as integer sums — how many, and their start
    times in microseconds — for those that started inside the window, and a count
    for those that started before it (each adds ``rate × window``); a heap of
    start times moves slices to the second group as the window passes them. The
    sums are exact, so a kept one answers as a fresh one, to the bit; each differs
    from the per-slice sum only by rounding the start times to the microsecond.

    Slices are compared by identity with those of the last call, as the pass's
    index does (:mod:`broker.core.incremental`): only new, changed or gone ones
    are filed again; another window, other GPU types or weights, or a clock that
    went back refile all. A caller that knows which slices changed since the last
    call passes them (``changed``), and those alone are looked at.
    """

    def __init__(self) -> None:
        self._clear()
        self.terms: tuple = ()

    def _clear(self) -> None:
        # slice id -> (the slice, (project, rate), its start in µs) or None if it accrues nothing
        self.slices: dict[int, tuple[Slice, tuple[str, float] | None, int]] = {}
        self.young: dict[tuple[str, float], list[int]] = {}  # group -> [count, Σ start µs]
        self.old: dict[tuple[str, float], int] = {}  # group -> count
        self.aged: set[int] = set()  # ids counted in ``old``
        self.starts: list[tuple[int, int]] = []  # (start µs, id) of young slices, a heap
        self.now_us = -math.inf

    def usage(
        self,
        slices: Collection[Slice],
        node_types: Mapping[str, str],
        weights: Mapping[str, float],
        now: float,
        window: float,
        changed: Mapping[int, Slice | None] | None = None,
    ) -> dict[str, float]:
        """Each project's usage at ``now`` accrued by the held ones of ``slices``;
        ``changed``: the slices that differ from the last call's (id -> the slice,
        None: gone), if the caller knows them. A ``changed`` that does not add up to
        ``slices`` (another count) is ignored."""
        now_us, window_us = round(now * 1e6), round(window * 1e6)
        terms = (dict(node_types), dict(weights), window_us)
        if terms != self.terms or now_us < self.now_us:
            self._clear()
            self.terms = terms
        self.now_us = now_us
        boundary = now_us - window_us
        if not (
            self.slices
            and changed is not None
            and self._take_changed(changed, len(slices), node_types, weights, boundary)
        ):
            self._take_all(slices, node_types, weights, boundary)
        current = self.slices
        while self.starts and self.starts[0][0] <= boundary:
            start, slice_id = heapq.heappop(self.starts)
            entry = current.get(slice_id)
            if entry is None or entry[1] is None or entry[2] != start or slice_id in self.aged:
                continue  # gone or filed again since it was pushed
            self._move(self.young, entry[1], -1, -start)
            self.old[entry[1]] = self.old.get(entry[1], 0) + 1
            self.aged.add(slice_id)
        usage: dict[str, float] = {}
        for (project, rate), (count, starts) in sorted(self.young.items()):
            seconds = (count * now_us - starts) / 1e6
            usage[project] = usage.get(project, 0.0) + rate * seconds
        for (project, rate), count in sorted(self.old.items()):
            usage[project] = usage.get(project, 0.0) + rate * count * window
        return usage

    def _take_all(
        self,
        slices: Iterable[Slice],
        node_types: Mapping[str, str],
        weights: Mapping[str, float],
        boundary: int,
    ) -> None:
        """File what differs from the last call's slices, comparing each of them."""
        known = self.slices
        current: dict[int, tuple] = {}
        for slice_ in slices:
            before = known.get(slice_.id)
            if before is not None and before[0] is slice_:
                current[slice_.id] = before
                continue
            if before is not None:
                self._forget(slice_.id, before)
            current[slice_.id] = self._file(slice_, node_types, weights, boundary)
        for gone in known.keys() - current.keys():
            self._forget(gone, known[gone])
        self.slices = current

    def _take_changed(
        self,
        changed: Mapping[int, Slice | None],
        count: int,
        node_types: Mapping[str, str],
        weights: Mapping[str, float],
        boundary: int,
    ) -> bool:
        """File the slices ``changed`` names; False (nothing changed here) if the
        result would not hold ``count`` slices."""
        known = self.slices
        if not changes_add_up(known, changed, count):
            return False
        for slice_id, slice_ in changed.items():
            before = known.get(slice_id)
            if before is not None and before[0] is slice_:
                continue
            if before is not None:
                self._forget(slice_id, before)
                del known[slice_id]
            if slice_ is not None:
                known[slice_id] = self._file(slice_, node_types, weights, boundary)
        return True

    def _file(
        self,
        slice_: Slice,
        node_types: Mapping[str, str],
        weights: Mapping[str, float],
        boundary: int,
    ) -> tuple[Slice, tuple[str, float] | None, int]:
        interval = running_interval(slice_, node_types, weights) if slice_.holds_gpus else None
        if interval is None:
            return slice_, None, 0
        project, start, rate = interval
        group, start_us = (project, rate), round(start * 1e6)
        if start_us <= boundary:
            self.old[group] = self.old.get(group, 0) + 1
            self.aged.add(slice_.id)
        else:
            self._move(self.young, group, 1, start_us)
            heapq.heappush(self.starts, (start_us, slice_.id))
        return slice_, group, start_us

    def _forget(self, slice_id: int, entry: tuple[Slice, tuple[str, float] | None, int]) -> None:
        group = entry[1]
        if group is None:
            return
        if slice_id in self.aged:
            self.aged.discard(slice_id)
            self.old[group] -= 1
            if not self.old[group]:
                del self.old[group]
        else:
            self._move(self.young, group, -1, -entry[2])

    @staticmethod
    def _move(groups: dict[tuple[str, float], list[int]], group, count: int, starts: int) -> None:
        totals = groups.setdefault(group, [0, 0])
        totals[0] += count
        totals[1] += starts
        if not totals[0]:
            del groups[group]


class ClosedCharges:
    """What closed ledger entries add to usage in a hard window, per project, kept as
    entries are added and as the window moves on (design.md §4): the closed part of
    :func:`usage_by_project` without a walk over every entry of the window.

    An entry adds ``rate × (end − max(start, now − window))`` while it ends inside
    the window. Entries are kept in groups of (project, rate), in microseconds: a
    sum of lengths for those wholly inside the window, a count and a sum of ends
    for those that straddle its start; two heaps move them on as the window
    passes their start, then their end. The sums are exact, so entries added one
    by one over time and the same entries added at once give the same usage.
    """

    def __init__(self, window: float):
        self.window_us = round(window * 1e6)
        self.boundary = -math.inf  # the window's start in µs, as last moved to
        self.latest_end = -math.inf  # µs
        self.inside: dict[tuple[str, float], int] = {}  # group -> Σ (end − start)
        self.straddling: dict[tuple[str, float], list[int]] = {}  # group -> [count, Σ end]
        # (start, n, end, group) of entries inside; (end, n, group) of those straddling
        self._starts: list[tuple[int, int, int, tuple[str, float]]] = []
        self._ends: list[tuple[int, int, tuple[str, float]]] = []
        self._added = 0

    def add(self, entry: LedgerEntry) -> None:
        start, end = round(entry.start * 1e6), round(entry.end * 1e6)
        if end <= max(start, self.boundary):
            return  # nothing held, or already out of the window
        group = (entry.project, entry.rate)
        self._added += 1
        self.latest_end = max(self.latest_end, end)
        if start <= self.boundary:
            self._straddle(group, end)
        else:
            self.inside[group] = self.inside.get(group, 0) + (end - start)
            heapq.heappush(self._starts, (start, self._added, end, group))

    def usage(self, now: float) -> dict[str, float] | None:
        """Each project's usage at ``now``; None where the kept sums cannot say it
        (a clock gone back, an entry ending after ``now``): build them again."""
        now_us = round(now * 1e6)
        boundary = now_us - self.window_us
        if boundary < self.boundary or self.latest_end > now_us:
            return None
        self.boundary = boundary
        while self._starts and self._starts[0][0] <= boundary:
            start, _, end, group = heapq.heappop(self._starts)
            _less(self.inside, group, end - start)
            if end > boundary:
                self._straddle(group, end)
        while self._ends and self._ends[0][0] <= boundary:
            end, _, group = heapq.heappop(self._ends)
            counted = self.straddling[group]
            counted[0] -= 1
            counted[1] -= end
            if not counted[0]:
                del self.straddling[group]
        usage: dict[str, float] = {}
        for (project, rate), held in sorted(self.inside.items()):
            usage[project] = usage.get(project, 0.0) + rate * (held / 1e6)
        for (project, rate), (count, ends) in sorted(self.straddling.items()):
            usage[project] = usage.get(project, 0.0) + rate * ((ends - count * boundary) / 1e6)
        return usage

    def _straddle(self, group: tuple[str, float], end: int) -> None:
        counted = self.straddling.setdefault(group, [0, 0])
        counted[0] += 1
        counted[1] += end
        heapq.heappush(self._ends, (end, self._added, group))


def _less(sums: dict, key: object, amount: int) -> None:
    left = sums[key] - amount
    if left:
        sums[key] = left
    else:
        del sums[key]


def running_interval(
    slice_: Slice, node_types: Mapping[str, str], weights: Mapping[str, float]
) -> tuple[str, float, float] | None:
    """``(project, start, rate)`` of a held slice's charge so far, as :func:`ledger_entry`
    would give it for any ``until``; None where nothing is owed."""
    if not slice_.allocated or slice_.granted_at is None or not slice_.placements:
        return None
    return slice_.project, slice_.granted_at, held_rate(slice_.placements, node_types, weights)


# ---- charging a slice ----------------------------------------------------------


def held_rate(
    placements: Iterable[Placement],
    node_types: Mapping[str, str],
    weights: Mapping[str, float],
) -> float:
    """Weighted GPUs held: per placement, GPUs × the weight of its node's type (default 1.0)."""
    return sum(
        len(p.gpu_indices) * weights.get(node_types.get(p.node, ""), 1.0) for p in placements
    )


def ledger_entry(
    slice_: Slice,
    until: float,
    node_types: Mapping[str, str],
    weights: Mapping[str, float],
) -> LedgerEntry | None:
    """The charge for ``slice_``'s held interval from its grant to ``until``.

    ``None`` when nothing is owed: the slice is unallocated (``min_runtime == 0``
    is free, design.md §3) or holds no GPUs.
    """
    interval = running_interval(slice_, node_types, weights)
    if interval is None:
        return None
    project, start, rate = interval
    return LedgerEntry(
        slice_id=slice_.id,
        project=project,
        user=slice_.user,
        start=start,
        end=max(until, start),
        rate=rate,
        gpus=sum(len(p.gpu_indices) for p in slice_.placements),
    )


def charge(
    slice_: Slice,
    until: float,
    node_types: Mapping[str, str],
    weights: Mapping[str, float],
) -> float:
    """Weighted GPU-seconds owed for ``slice_``'s held interval up to ``until`` (0 if free)."""
    entry = ledger_entry(slice_, until, node_types, weights)
    return entry.weighted_gpu_seconds if entry is not None else 0.0


# ---- reports over a period -------------------------------------------------------


def clip(entry: LedgerEntry, since: float, until: float) -> LedgerEntry | None:
    """The part of ``entry`` inside ``[since, until)``, or ``None`` if there is none."""
    start, end = max(entry.start, since), min(entry.end, until)
    if end <= start:
        return None
    return replace(entry, start=start, end=end)


ReportBy = Literal["project", "user"]


def usage_rows(
    entries: Iterable[LedgerEntry],
    since: float,
    until: float,
    *,
    by: ReportBy = "project",
) -> list[dict[str, Any]]:
    """Usage in ``[since, until)`` per project (or per project and user), as flat rows.

    Intervals are split at the period bounds, so adjacent periods add up to
    their union. Each row has ``project`` (and ``user``), ``since``, ``until``,
    ``slices`` (distinct slices), ``gpu_seconds`` (plain) and
    ``weighted_gpu_seconds`` — ready for ``csv.DictWriter`` or JSON. Rows are
    sorted by project, then user.
    """
    totals: dict[tuple[str, ...], dict[str, Any]] = {}
    for entry in entries:
        part = clip(entry, since, until)
        if part is None:
            continue
        key = (part.project, part.user) if by == "user" else (part.project,)
        row = totals.get(key)
        if row is None:
            row = {"project": part.project}
            if by == "user":
                row["user"] = part.user
            row |= {"since": since, "until": until, "slices": set(), "gpu_seconds": 0.0}
            row["weighted_gpu_seconds"] = 0.0
            totals[key] = row
        row["slices"].add(part.slice_id)
        row["gpu_seconds"] += part.gpus * part.duration
        row["weighted_gpu_seconds"] += part.weighted_gpu_seconds
    rows = []
    for key in sorted(totals):
        row = totals[key]
        rows.append(row | {"slices": len(row["slices"])})
    return rows


#: First characters that make a spreadsheet read a text cell as a formula (OWASP's
#: CSV injection list, with the fullwidth forms some spreadsheets also take).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\n", "\uff1d", "\uff0b", "\uff0d", "\uff20")


def csv_cell(value: Any) -> Any:
    """``value`` as a CSV cell that no spreadsheet runs: text starting like a formula
    gets a leading ``'``, which spreadsheets show as text and do not evaluate.
    Numbers are left alone (a negative number is a number, not a formula)."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def usage_csv(rows: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """Usage rows as CSV text with a header: text cells quoted and made formula-safe
    (:func:`csv_cell`), numbers as they are."""
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_NONNUMERIC, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([csv_cell(row.get(column, "")) for column in columns])
    return out.getvalue()
