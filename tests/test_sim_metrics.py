"""Metrics on hand-made numbers: percentiles, hourly integrals, owed GPU-hours, wait classes."""

from __future__ import annotations

import pytest

from broker.model import HOUR, SliceKind
from broker.sim.metrics import Hourly, owed_delivered, percentile, wait_class
from broker.sim.workloads import Job


def test_percentile_interpolates_between_ranks():
    assert percentile([], 90) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([0, 10, 20, 30, 40], 50) == 20
    assert percentile([0, 10, 20, 30, 40], 90) == pytest.approx(36)


def test_hourly_integral_splits_at_hour_boundaries():
    series = Hourly()
    series.add(0.5 * HOUR, 4)  # 4 GPUs from 0:30
    series.add(2.25 * HOUR, -4)  # released at 2:15
    series.flush(3 * HOUR)
    assert series.series(3) == [2 * HOUR, 4 * HOUR, 1 * HOUR]


def test_owed_is_entitlement_capped_by_demand_hour_by_hour():
    capacity = [10 * HOUR, 10 * HOUR]
    # a wants 8 GPUs then 2; b wants 10 both hours; each is entitled to half
    wanted = {"a": [8 * HOUR, 2 * HOUR], "b": [10 * HOUR, 10 * HOUR]}
    held = {"a": [3 * HOUR, 2 * HOUR], "b": [7 * HOUR, 8 * HOUR]}
    owed = owed_delivered(wanted, held, capacity, {"a": 0.5, "b": 0.5})
    # a is owed min(8,5)+min(2,5) = 7 and got 5; hour by hour min(3,5)+min(2,2) = 5
    assert owed["a"].owed == 7 * HOUR and owed["a"].fraction() == pytest.approx(5 / 7)
    assert owed["a"].fraction(hourly=True) == pytest.approx(5 / 7)
    # b is owed 5+5 and held 15: fully delivered overall; hour by hour too
    assert owed["b"].owed == 10 * HOUR and owed["b"].fraction() == 1.0
    assert owed["b"].fraction(hourly=True) == 1.0


def test_owed_hour_by_hour_does_not_let_a_burst_make_up_for_a_gap():
    owed = owed_delivered(
        {"a": [5 * HOUR, 5 * HOUR]}, {"a": [0.0, 10 * HOUR]}, [10 * HOUR] * 2, {"a": 0.5}
    )
    assert owed["a"].fraction() == 1.0
    assert owed["a"].fraction(hourly=True) == 0.5


@pytest.mark.parametrize(
    ("job", "cls"),
    [
        (Job(0, 0, "u", "p", 1, 60, SliceKind.INTERACTIVE, 900), "debug"),
        (Job(0, 0, "u", "p", 2, 60, SliceKind.INTERACTIVE, 3600), "interactive"),
        (Job(0, 0, "u", "p", 1, 60, SliceKind.INTERACTIVE, 900, idle=True), "squatter"),
        (Job(0, 0, "u", "p", 1, 60), "batch 1"),
        (Job(0, 0, "u", "p", 8, 60), "batch 2-8"),
        (Job(0, 0, "u", "p", 64, 60), "batch multi-node"),
        (Job(0, 0, "u", "p", 72, 60), "batch large"),
    ],
)
def test_waits_are_reported_by_kind_and_size(job, cls):
    assert wait_class(job, node_gpus=8, cluster_gpus=256) == cls
