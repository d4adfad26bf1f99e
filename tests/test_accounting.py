"""Accounting: window and decayed usage, charges, and reports over a period."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.accounting import (
    ClosedCharges,
    LedgerEntry,
    RunningCharges,
    charge,
    clip,
    decayed_usage,
    entry_usage,
    ledger_entry,
    running_interval,
    usage_by_project,
    usage_rows,
    window_usage,
)
from broker.core.model import Contract, Placement, Slice, SliceKind, SliceState

HOUR = 3600.0
NOW = 1_000_000.0


def entry(start, end, rate=1.0, project="p", user="u", slice_id=1, gpus=1):
    return LedgerEntry(slice_id, project, user, start, end, rate, gpus)


# ---- window -------------------------------------------------------------------

WINDOW_CASES = [
    ("inside the window counts whole", NOW - 50, NOW - 10, 100, 40),
    ("before the window counts nothing", NOW - 300, NOW - 200, 100, 0),
    ("straddling the window start counts its inside", NOW - 150, NOW - 50, 100, 50),
    ("reaching past now counts up to now", NOW - 10, NOW + 90, 100, 10),
    ("starting after now counts nothing", NOW + 1, NOW + 9, 100, 0),
    ("covering the whole window counts the window", NOW - 500, NOW + 500, 100, 100),
    ("an empty interval counts nothing", NOW - 5, NOW - 5, 100, 0),
]


@pytest.mark.parametrize(
    ("start", "end", "window", "expected"),
    [case[1:] for case in WINDOW_CASES],
    ids=[case[0] for case in WINDOW_CASES],
)
def test_window_usage(start, end, window, expected):
    assert window_usage(start, end, 2.0, NOW, window) == pytest.approx(2.0 * expected)


intervals = st.lists(
    st.tuples(st.integers(0, 200), st.integers(0, 60), st.integers(1, 4)), max_size=12
)


@given(intervals, st.integers(0, 260), st.integers(1, 200))
def test_window_usage_equals_a_second_by_second_count(items, now, window):
    entries = [entry(start, start + length, rate) for start, length, rate in items]
    brute = sum(
        rate
        for start, length, rate in items
        for second in range(start, start + length)
        if now - window <= second < now
    )
    total = sum(entry_usage(e, now, window) for e in entries)
    assert total == pytest.approx(brute)
    assert usage_by_project(entries, [], now, window).get("p", 0.0) == pytest.approx(brute)


# ---- decay --------------------------------------------------------------------


def test_one_half_life_of_use_ending_now_weighs_half_of_an_undecayed_h_over_ln2():
    h = 10 * HOUR
    assert decayed_usage(NOW - h, NOW, 1.0, NOW, h) == pytest.approx(h / (2 * math.log(2)))


def test_decayed_use_halves_every_half_life():
    h = HOUR
    now_value = decayed_usage(NOW - 60, NOW, 3.0, NOW, h)
    assert decayed_usage(NOW - 60, NOW, 3.0, NOW + h, h) == pytest.approx(now_value / 2)


def test_a_tiny_interval_decays_without_losing_precision():
    assert decayed_usage(-1e-9, 0.0, 1.0, 0.0, 7 * 24 * HOUR) == pytest.approx(1e-9, rel=1e-9)


def test_decayed_usage_ignores_time_after_now():
    assert decayed_usage(NOW - 10, NOW + 100, 1.0, NOW, HOUR) == pytest.approx(
        decayed_usage(NOW - 10, NOW, 1.0, NOW, HOUR)
    )
    assert decayed_usage(NOW + 1, NOW + 100, 1.0, NOW, HOUR) == 0.0


@settings(deadline=None)
@given(
    st.floats(0, 1000),
    st.floats(0.1, 1000),
    st.floats(0.1, 8),
    st.floats(0, 1500),
    st.floats(10, 2000),
)
def test_decay_closed_form_matches_numeric_integration(start, length, rate, now, half_life):
    end = start + length
    high = min(end, now)
    numeric = 0.0
    if high > start:  # composite Simpson's rule
        steps = 2000
        width = (high - start) / steps

        def f(t):
            return rate * 2 ** (-(now - t) / half_life)

        inner = sum((4 if i % 2 else 2) * f(start + i * width) for i in range(1, steps))
        numeric = width / 3 * (f(start) + inner + f(high))
    closed = decayed_usage(start, end, rate, now, half_life)
    assert closed == pytest.approx(numeric, rel=1e-5, abs=1e-9)


# ---- usage by project -----------------------------------------------------------


def test_running_intervals_count_up_to_now():
    usage = usage_by_project(
        [entry(NOW - 100, NOW - 50, 1.0, project="a")],
        [("b", NOW - 30, 2.0), ("a", NOW - 10, 1.0)],
        NOW,
        window=1000,
    )
    assert usage == pytest.approx({"a": 60.0, "b": 60.0})


def test_usage_by_project_uses_decay_when_a_half_life_is_given():
    usage = usage_by_project([entry(NOW - HOUR, NOW)], [], NOW, window=1.0, half_life=HOUR)
    assert usage["p"] == pytest.approx(HOUR / (2 * math.log(2)))


# ---- charging ---------------------------------------------------------------------

TYPES = {"a0": "h100", "b0": "b200", "x": "mystery"}
WEIGHTS = {"h100": 1.0, "b200": 2.0}


def held(placements, *, min_runtime=HOUR, granted_at=NOW - 100):
    return Slice(
        id=7,
        project="p",
        user="u",
        gpus=sum(len(p.gpu_indices) for p in placements),
        kind=SliceKind.BATCH,
        contract=Contract(min_runtime),
        state=SliceState.GRANTED,
        placements=tuple(placements),
        granted_at=granted_at,
    )


CHARGE_CASES = [
    ("GPUs times weight times seconds", [Placement("b0", (0, 1))], HOUR, 2 * 2.0 * 100),
    ("each placement at its node's weight", [Placement("a0", (0,)), Placement("b0", (3,))], HOUR,
     (1.0 + 2.0) * 100),
    ("an unknown type weighs 1", [Placement("x", (0, 1, 2))], HOUR, 3 * 100),
    ("an unallocated slice is free", [Placement("b0", (0,))], 0.0, 0.0),
]  # fmt: skip


@pytest.mark.parametrize(
    ("placements", "min_runtime", "expected"),
    [case[1:] for case in CHARGE_CASES],
    ids=[case[0] for case in CHARGE_CASES],
)
def test_charge(placements, min_runtime, expected):
    slice_ = held(placements, min_runtime=min_runtime)
    assert charge(slice_, NOW, TYPES, WEIGHTS) == pytest.approx(expected)


def test_a_ledger_entry_covers_grant_to_end_with_the_held_rate():
    got = ledger_entry(held([Placement("b0", (0, 1))]), NOW, TYPES, WEIGHTS)
    assert got == LedgerEntry(7, "p", "u", NOW - 100, NOW, 4.0, 2)
    assert ledger_entry(held([Placement("b0", (0,))], min_runtime=0), NOW, TYPES, WEIGHTS) is None


# ---- reports -----------------------------------------------------------------------


def test_clip_splits_at_the_period_bounds():
    assert clip(entry(0, 100), 20, 50) == entry(20, 50)
    assert clip(entry(0, 100), 100, 200) is None


def test_usage_rows_per_project_and_per_user():
    entries = [
        entry(0, 100, 2.0, project="a", user="x", slice_id=1, gpus=2),
        entry(50, 150, 1.0, project="a", user="y", slice_id=2, gpus=1),
        entry(0, 10, 1.0, project="b", user="x", slice_id=3, gpus=1),
    ]
    by_project = usage_rows(entries, 50, 200)
    assert by_project == [
        {
            "project": "a",
            "since": 50,
            "until": 200,
            "slices": 2,
            "gpu_seconds": pytest.approx(200.0),
            "weighted_gpu_seconds": pytest.approx(200.0),
        }
    ]
    by_user = usage_rows(entries, 0, 200, by="user")
    assert [(r["project"], r["user"], r["weighted_gpu_seconds"]) for r in by_user] == [
        ("a", "x", 200.0),
        ("a", "y", 100.0),
        ("b", "x", 10.0),
    ]


@given(
    st.lists(st.tuples(st.integers(0, 100), st.integers(0, 50), st.integers(1, 3)), max_size=8),
    st.integers(0, 150),
)
def test_adjacent_periods_add_up_to_their_union(items, cut):
    entries = [entry(s, s + n, float(r), gpus=r) for s, n, r in items]

    def total(since, until):
        return sum(row["weighted_gpu_seconds"] for row in usage_rows(entries, since, until))

    assert total(0, cut) + total(cut, 200) == pytest.approx(total(0, 200))
    assert total(0, 200) == pytest.approx(sum(e.weighted_gpu_seconds for e in entries))


# ---- what held slices accrued, kept between calls ------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["grant", "grant", "end", "preempt", "wait", "weights"]),
            st.integers(0, 7),
            st.floats(0, 3 * HOUR),
        ),
        max_size=40,
    )
)
def test_running_charges_kept_between_calls_equal_fresh_ones_and_the_per_slice_sum(steps):
    """Grants, ends, preemptions (a new value of the same slice), time passing the
    window's edge and a change of weights: a kept RunningCharges answers what a
    fresh one answers, to the bit, and what the per-slice sum of usage_by_project
    answers, but for start times rounded to the microsecond. One told which slices
    changed answers the same."""
    window = 2 * HOUR
    node_types = {"n0": "h100", "n1": "b200"}
    weights = {"h100": 1.0, "b200": 2.5}
    kept, told = RunningCharges(), RunningCharges()
    live: dict[int, Slice] = {}
    now = NOW
    for what, which, amount in steps:
        before = dict(live)
        if what == "grant":
            slice_id = 100 + which
            node = "n0" if which % 2 else "n1"
            live[slice_id] = Slice(
                id=slice_id,
                project=f"p{which % 3}",
                user="u",
                gpus=which % 4 + 1,
                kind=SliceKind.BATCH,
                contract=Contract(HOUR, True, None),
                state=SliceState.GRANTED,
                placements=(Placement(node, tuple(range(which % 4 + 1))),),
                granted_at=now - amount,
                submitted_at=now - amount - 1,
            )
        elif what == "end" and live:
            del live[sorted(live)[which % len(live)]]
        elif what == "preempt" and live:
            slice_id = sorted(live)[which % len(live)]
            live[slice_id] = replace(live[slice_id], state=SliceState.PREEMPTING)
        elif what == "wait":
            now += amount
        elif what == "weights":
            weights = {**weights, "b200": 2.5 + which / 8}
        slices = list(live.values())
        got = kept.usage(slices, node_types, weights, now, window)
        assert got == RunningCharges().usage(slices, node_types, weights, now, window)
        changed = {
            i: live.get(i) for i in before.keys() | live.keys() if before.get(i) is not live.get(i)
        }
        assert told.usage(slices, node_types, weights, now, window, changed) == got
        running = [running_interval(s, node_types, weights) for s in slices]
        expected = usage_by_project((), [r for r in running if r], now, window)
        assert got.keys() <= expected.keys()
        for project, amount_expected in expected.items():
            assert got.get(project, 0.0) == pytest.approx(amount_expected, rel=1e-9, abs=1e-4)


def test_running_charges_start_again_when_the_clock_goes_back():
    """A clock stepped back (a service's wall clock can be) refiles everything
    instead of moving slices back out of the window by hand."""
    slice_ = Slice(
        id=1,
        project="p",
        user="u",
        gpus=2,
        kind=SliceKind.BATCH,
        contract=Contract(HOUR, True, None),
        state=SliceState.GRANTED,
        placements=(Placement("n0", (0, 1)),),
        granted_at=NOW - HOUR,
        submitted_at=NOW - HOUR,
    )
    kept = RunningCharges()
    types, weights = {"n0": "h100"}, {"h100": 1.0}
    assert kept.usage([slice_], types, weights, NOW + 2 * HOUR, HOUR) == {"p": 2 * HOUR}
    assert kept.usage([slice_], types, weights, NOW, HOUR) == {"p": 2 * HOUR}
    # half an hour after its grant: 2 GPUs for half an hour, not the whole window
    assert kept.usage([slice_], types, weights, NOW - HOUR / 2, HOUR) == {"p": HOUR}


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["charge", "charge", "wait"]),
            st.integers(0, 5),
            st.floats(0, 3 * HOUR),
            st.floats(0, 3 * HOUR),
        ),
        max_size=40,
    )
)
def test_closed_charges_kept_as_the_window_moves_equal_fresh_ones_and_the_per_entry_sum(steps):
    """Charges added one by one while the window moves on (entries straddling its
    start, then leaving it) give the usage of the same charges added at once, to
    the bit, and the per-entry sum of usage_by_project but for the rounding of
    times to the microsecond."""
    window = 2 * HOUR
    kept = ClosedCharges(window)
    entries: list[LedgerEntry] = []
    now = NOW
    for what, which, ago, length in steps:
        if what == "charge":
            end = now - ago / 4
            added = entry(end - length, end, rate=(which % 3 + 1) * 1.25, project=f"p{which % 2}")
            entries.append(added)
            kept.add(added)
        else:
            now += ago
        got = kept.usage(now)
        fresh = ClosedCharges(window)
        for each in entries:
            fresh.add(each)
        assert got == fresh.usage(now)
        expected = usage_by_project(entries, (), now, window)
        for project in set(got) | set(expected):
            assert got.get(project, 0.0) == pytest.approx(
                expected.get(project, 0.0), rel=1e-9, abs=1e-4
            )


def test_closed_charges_cannot_say_the_usage_before_their_last_move_or_of_a_later_end():
    charges = ClosedCharges(HOUR)
    charges.add(entry(NOW - 2 * HOUR, NOW - HOUR / 2, rate=2.0))
    assert charges.usage(NOW) == {"p": HOUR}  # the half hour inside the window, 2 GPUs
    assert charges.usage(NOW - 60) is None  # the window went back: build again
    charges.add(entry(NOW - 60, NOW + 60))
    assert charges.usage(NOW) is None  # an entry ending after now
