"""Metrics on hand-made numbers: percentiles, hourly integrals, owed GPU-hours, wait classes."""

from __future__ import annotations

import pytest

from broker.core.model import HOUR, SliceKind
from broker.sim.metrics import (
    DEBUG_SESSION,
    GATHER,
    NO_REQUEST,
    PREEMPTION,
    RESTART,
    SINCE_CHECKPOINT,
    SWAP,
    Hourly,
    Recorder,
    owed_delivered,
    percentile,
    served,
    summarise,
    wait_class,
)
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


def _recorder(jobs: int = 0) -> Recorder:
    rec = Recorder(["a"], warmup=0.0)
    rec.jobs = jobs
    rec.set_capacity(0.0, 10)
    return rec


def test_churn_shows_how_preemptions_fall_on_jobs_and_gpu_hours():
    rec = _recorder(jobs=200)
    worker = Job(0, 0, "u", "a", 10, 7200)
    rec.hold(0.0, worker, 10)  # 10 GPUs held for the 2 hours: 20 GPU-hours
    for job_id, times in ((1, 5), (2, 3), (3, 1)):
        for i in range(times):
            rec.preempted(600.0 * i, Job(job_id, 0, "u", "a", 1, 60), "fair_share")
    rec.preempted(4000.0, Job(4, 0, "u", "a", 1, 60), "debug_lane")
    rec.completed = 40
    s = summarise(rec, end=2 * HOUR, entitlements={"a": 1.0})
    assert s["preemptions_total"] == 10 and s["preempted_jobs"] == 4
    assert s["preemptions_per_job_max"] == 5
    assert s["jobs_preempted_3_or_more"] == 2 and s["jobs_preempted_more_than_3"] == 1
    # 200 jobs, 196 never preempted: the 99th percentile falls among the 1s and 3s
    assert s["preemptions_per_job_p99"] == pytest.approx(percentile([5, 3, 1, 1] + [0] * 196, 99))
    assert s["preemptions_per_1000_gpu_hours"] == pytest.approx(1000 * 10 / 20)
    assert s["preemptions_per_completed_job"] == pytest.approx(10 / 40)
    assert s["hourly"]["preemptions"] == {"debug_lane": [0, 1], "fair_share": [9, 0]}


def test_churn_counts_fair_share_preemptions_matched_by_one_the_other_way():
    rec = Recorder(["a", "b", "c"], warmup=0.0)
    rec.set_capacity(0.0, 10)
    job = {p: Job(i, 0, "u", p, 1, 60) for i, p in enumerate("abc")}
    for mine, theirs in (("a", "b"), ("a", "b"), ("b", "a"), ("a", "c")):
        rec.preempted(0.0, job[theirs], "fair_share", for_job=job[mine])
    rec.preempted(0.0, job["a"], "debug_lane", for_job=job["c"])  # not fair share
    rec.preempted(0.0, job["c"], "fair_share", for_job=None)  # for no request
    s = summarise(rec, end=HOUR, entitlements={"a": 0.4, "b": 0.3, "c": 0.3})
    # a took from b twice and b from a once: one move each way is matched
    assert s["fair_share_back_and_forth"] == 2
    assert s["preemptions"]["fair_share"] == 5


def test_churn_tells_what_each_preemption_served_and_which_came_back_within_the_hour():
    rec = _recorder(jobs=10)
    one, eight = Job(1, 0, "u", "a", 1, 3600), Job(2, 0, "u", "a", 8, 3600)
    session = Job(3, 0, "v", "a", 1, 600, kind=SliceKind.INTERACTIVE, min_runtime=600.0)
    rec.preempted(0.0, one, "debug_lane", for_job=session, waited=0.0)
    rec.regranted(600.0, 0.0, "debug_lane", DEBUG_SESSION)  # back once the session ended
    rec.preempted(0.0, eight, "fair_share", for_job=eight, waited=7200.0)  # 8 for 8
    rec.preempted(0.0, one, "fair_share", for_job=eight, waited=600.0)  # 8 from a 1-GPU job
    rec.preempted(0.0, one, "fair_share", for_job=eight, waited=1800.0)
    rec.regranted(2 * HOUR, 0.0, "fair_share", GATHER)  # back after the hour: no chair
    rec.preempted(0.0, eight, "drain")
    s = summarise(rec, end=HOUR, entitlements={"a": 1.0})
    assert s["preemptions_by_need"] == {
        DEBUG_SESSION: {"preemptions": 1, "musical_chairs": 1, "requester_wait_p50": 0.0},
        SWAP: {"preemptions": 1, "musical_chairs": 0, "requester_wait_p50": 7200.0},
        GATHER: {"preemptions": 2, "musical_chairs": 0, "requester_wait_p50": 1200.0},
        NO_REQUEST: {"preemptions": 1, "musical_chairs": 0, "requester_wait_p50": None},
    }
    assert served(None, one) == NO_REQUEST and served(one, eight) == SWAP


def test_churn_counts_the_jobs_that_spent_their_preemption_budget():
    rec = _recorder(jobs=10)
    rec.preemption_budget = 3
    for job_id, times, min_runtime in ((1, 3, HOUR), (2, 2, HOUR), (3, 4, 0.0)):
        job = Job(job_id, 0, "u", "a", 1, 60, min_runtime=min_runtime)
        for i in range(times):
            rec.preempted(600.0 * i, job, "fair_share")
    s = summarise(rec, end=HOUR, entitlements={"a": 1.0})
    # job 1 spent its budget; job 2 did not; job 3 is free work, which has none
    assert (s["jobs_at_budget"], s["preemption_budget"]) == (1, 3)
    rec.preemption_budget = None  # no budget: nothing to spend
    assert summarise(rec, end=HOUR, entitlements={"a": 1.0})["jobs_at_budget"] is None


def test_churn_counts_gpu_hours_held_past_the_budget_and_multi_node_preemptions():
    rec = _recorder(jobs=3)
    rec.preemption_budget = 2
    spent, fresh = Job(1, 0, "u", "a", 2, 60, min_runtime=HOUR), Job(2, 0, "u", "a", 2, 60)
    gang = Job(3, 0, "u", "a", 16, 60, min_runtime=HOUR)
    for _ in range(2):
        rec.preempted(0.0, spent, "fair_share")
    rec.preempted(0.0, gang, "fair_share")
    rec.hold(0.0, spent, 2)  # granted past its budget: counted for 30 min
    rec.hold(0.0, fresh, 2)  # within it: not counted
    rec.hold(0.0, gang, 16)  # its one preemption left it within its budget
    rec.preempted(600.0, gang, "drain")  # now past it, while holding: still not counted
    rec.hold(600.0, gang, -16)
    rec.hold(1800.0, spent, -2)
    s = summarise(rec, end=HOUR, entitlements={"a": 1.0})
    held = 2 * 0.5 + 2 * 1.0 + 16 * (600 / HOUR)  # every job's GPU-hours in the hour
    assert s["held_past_budget_gpu_hours"] == pytest.approx(1.0)
    assert s["held_past_budget_share"] == pytest.approx(1.0 / held)
    assert (s["multi_node_preemptions"], s["multi_node_preempted_gpus"]) == (2, 32)


def test_occupancy_while_demand_exceeds_capacity_leaves_out_quiet_hours():
    rec = _recorder()
    big, small = Job(0, 0, "u", "a", 20, 3600), Job(1, 0, "u", "a", 5, 3600)
    rec.want(0.0, "a", 20)  # hour 0: 20 wanted, 10 held
    rec.hold(0.0, big, 10)
    rec.want(HOUR, "a", -15)  # hour 1: 5 wanted, 5 held
    rec.hold(HOUR, big, -10)
    rec.hold(HOUR, small, 5)
    s = summarise(rec, end=2 * HOUR, entitlements={"a": 1.0})
    assert s["occupancy"] == pytest.approx(0.75)
    assert s["occupancy_oversubscribed"] == 1.0 and s["oversubscribed_hours"] == 1


def test_goodput_is_held_work_less_what_was_wasted_in_the_hours_it_was_held():
    rec = _recorder()
    rec.hold(0.0, Job(0, 0, "u", "a", 8, 7200), 8)
    rec.waste(0.5 * HOUR, 1.5 * HOUR, 8, PREEMPTION, SINCE_CHECKPOINT)  # 8 GPU-hours
    rec.waste(1.5 * HOUR, 1.75 * HOUR, 8, PREEMPTION, RESTART)  # 2 GPU-hours
    s = summarise(rec, end=2 * HOUR, entitlements={"a": 1.0})
    assert s["hourly"]["wasted_gpus"] == [4.0, 6.0]
    assert s["useful_gpu_hours"] == pytest.approx(16 - 10)
    assert s["goodput"] == pytest.approx(6 / 20) and s["goodput_of_occupancy"] == 6 / 16
    assert s["preemption_lost_gpu_hours"] == 10 and s["restart_gpu_hours"] == 2
    assert s["lost_gpu_hours"] == 8  # progress thrown away, restarts apart
