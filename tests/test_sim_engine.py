"""The engine around the pass: incremental usage, conservation, invariants, determinism."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.accounting import LedgerEntry, usage_by_project
from broker.core.fairshare import ProjectTree
from broker.core.model import (
    DAY,
    HOUR,
    Account,
    EndReason,
    Node,
    NodeState,
    SliceKind,
    SliceState,
)
from broker.sim.engine import SimConfig, Simulation, checkpoint_phase, simulate
from broker.sim.policies import POLICIES, FairShare, Fifo, MultifactorFairShare, StrictPriority
from broker.sim.usage import UsageTracker
from broker.sim.workloads import GeneratorConfig, Job, NodeEvent, Workload, generate

SMALL = GeneratorConfig(days=2, slices=400, users=20, projects=4, programs=2, load=2.0)
TINY = GeneratorConfig(days=1, slices=120, users=10, projects=3, programs=1, load=2.0)


@pytest.fixture(scope="module")
def small():
    return generate(SMALL, seed=3)


@pytest.fixture(scope="module")
def tiny():
    return generate(TINY, seed=3)


# ---- usage kept incrementally equals usage recomputed from the ledger ------------------


def _random_ledger(seed: int) -> tuple[list[LedgerEntry], list[LedgerEntry], float]:
    r = random.Random(seed)
    closed, running = [], []
    for i in range(60):
        start = r.uniform(0, 20 * DAY)
        end = start + r.expovariate(1 / (6 * HOUR))
        entry = LedgerEntry(i, r.choice("abc"), "u", start, end, r.choice([1.0, 2.0, 8.0]))
        closed.append(entry)
    for i in range(5):
        start = r.uniform(18 * DAY, 21 * DAY)
        running.append(LedgerEntry(100 + i, r.choice("abc"), "u", start, start, 4.0))
    return closed, running, 21 * DAY


@pytest.mark.parametrize("half_life", [None, 2 * DAY], ids=["7-day window", "2-day half-life"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_incremental_usage_matches_the_ledger(seed, half_life):
    closed, running, end = _random_ledger(seed)
    tracker = UsageTracker("abc", window=7 * DAY, half_life=half_life)
    # grants and ends in time order, as the engine sees them
    changes = [(e.start, 0, e) for e in closed + running] + [(e.end, 1, e) for e in closed]
    changes.sort(key=lambda c: (c[0], c[1]))
    done = 0
    for at in (5 * DAY, 12 * DAY, 19.5 * DAY, end):
        while done < len(changes) and changes[done][0] <= at:
            _, kind, entry = changes[done]
            if kind == 0:
                tracker.open(entry.project, entry.rate, entry.start)
            else:
                tracker.close(entry)
            done += 1
        ended = [e for e in closed if e.end <= at]
        still_open = [e for e in closed + running if e.start <= at and e not in ended]
        open_now = [(e.project, e.start, e.rate) for e in still_open]
        expected = usage_by_project(ended, open_now, at, 7 * DAY, half_life)
        got = tracker.at(at)
        for project in "abc":
            assert got[project] == pytest.approx(expected.get(project, 0.0), rel=1e-9, abs=1e-6)


_TREE = ProjectTree(
    [
        Account("lab", 2.0),
        Account("dept", 1.0),
        Account("a", 1.0, "lab"),
        Account("b", 3.0, "lab"),
        Account("c", 1.0, "dept"),
        Account("d", 1.0, "dept"),
        Account("e", 2.0),
    ]
)
_CHANGES = st.lists(
    st.tuples(
        st.floats(0, 3 * DAY),  # when, after the change before it
        st.sampled_from("abcde"),
        st.sampled_from([1.0, 2.0, 8.0]),
        st.floats(1, 3 * DAY),  # for how long
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(changes=_CHANGES, looks=st.lists(st.floats(0, 2 * DAY), min_size=1, max_size=8))
def test_the_window_order_told_ahead_is_the_order_computed_again(changes, looks):
    """UsageTracker.order_at answers from the order it kept until the time that
    order can first change: at any time before the next grant or end, it must be
    the order computed from the usage then. A 1-day window, so that charge leaves
    it between changes."""
    tracker = UsageTracker("abcde", window=DAY)
    events: list[tuple[float, int, str, float]] = []
    at = 0.0
    for after, project, rate, length in changes:
        at += after
        events += [(at, 0, project, rate), (at + length, 1, project, rate)]
    events.sort()
    times = [e[0] for e in events] + [events[-1][0] + 3 * DAY if events else 3 * DAY]
    for (when, kind, project, rate), following in zip(events, times[1:], strict=False):
        if kind == 0:
            tracker.open(project, rate, when)
        else:
            tracker.close(LedgerEntry(0, project, "u", when - 1, when, rate))
        for look in sorted(when + offset for offset in looks if when + offset < following):
            told = tracker.order_at(_TREE, look)
            assert told == tuple(_TREE.project_order(tracker.at(look))), look


# ---- whole runs ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_keeps_the_invariants_and_its_books_balance(small, name):
    sim = Simulation(small, POLICIES[name](small.accounts), SimConfig(check=True))
    result = sim.run()
    rec = sim.recorder
    live = list(sim.slices.values())
    held = sum(s.gpus for s in live if s.holds_gpus)
    pending = sum(s.gpus for s in live if s.state is SliceState.PENDING)
    # what the recorder integrated still matches the live state at the end
    assert sum(rec.held[p].value for p in rec.projects) == held
    assert (
        rec.pending.value
        == pending
        == sum(sim.runs[s.id].job.gpus for s in live if s.state is SliceState.PENDING)
    )
    assert sum(rec.wanted[p].value for p in rec.projects) == held + pending
    assert sim.waiting == sum(1 for s in live if s.state is SliceState.PENDING)
    s = result.summary
    assert 0 < s["occupancy"] <= 1.0 + 1e-9
    assert s["completed"] > 0 and result.stats["passes"] > 0
    if name != "fairshare":
        assert s["preemptions_total"] == 0  # baselines never preempt


class _NeverQuiet(FairShare):
    """Our policy, never saying that the next pass would decide nothing."""

    def __call__(self, snapshot, /):
        return replace(super().__call__(snapshot), quiet=None)


def test_passes_left_out_as_quiet_change_nothing_in_the_run(small):
    # A pass that time alone separates from a quiet one is left out (and, with
    # check, run all the same and found to decide nothing): the whole run is the
    # same as with every pass made, for fewer passes.
    left_out = Simulation(small, FairShare(small.accounts), SimConfig(check=True)).run()
    every = Simulation(small, _NeverQuiet(small.accounts), SimConfig()).run()
    assert left_out.stats["quiet_passes"] > 0 and every.stats["quiet_passes"] == 0
    # Most passes left out would have resumed the quiet one (its index keeps what it
    # settled): made, they count as resumed passes.
    assert every.stats["resumed_passes"] > left_out.stats["resumed_passes"] > 0
    assert left_out.stats["passes"] + left_out.stats["quiet_passes"] == every.stats["passes"]
    assert left_out.summary == every.summary


@pytest.mark.parametrize("baseline", [StrictPriority, Fifo, MultifactorFairShare])
def test_a_baselines_passes_left_out_as_quiet_change_nothing_in_the_run(small, baseline):
    # A baseline's pass that decided nothing says so until the first end of a maximum
    # runtime, and its still_quiet adds what else moves its order in time (the
    # Slurm-like one's: the first job of its queue). At the service's 5 s tick, with
    # check every pass left out is run all the same and found to decide nothing.
    expired: list[int] = []

    class Counted(baseline):
        def __call__(self, snapshot, /):
            decisions = super().__call__(snapshot)
            expired.extend(e.slice_id for e in decisions.endings if e.reason is EndReason.EXPIRED)
            return decisions

    class NeverQuiet(baseline):
        def __call__(self, snapshot, /):
            return replace(super().__call__(snapshot), quiet=None)

    # One job runs into its maximum runtime while the next waits for its GPUs.
    overrun = Job(1, 0.0, "u1", "a", 8, duration=10 * HOUR, max_runtime=HOUR)
    waits = Job(2, 60.0, "u1", "a", 8, duration=600.0)
    config = SimConfig(check=True, tick=5, history=True)
    for workload in (small, _one_node([overrun, waits])):
        left_out = Simulation(workload, Counted(workload.accounts), config).run()
        every = Simulation(workload, NeverQuiet(workload.accounts), config).run()
        assert every.stats["quiet_passes"] == 0
        assert left_out.stats["quiet_passes"] > 5 * left_out.stats["passes"]
        assert left_out.stats["passes"] + left_out.stats["quiet_passes"] == every.stats["passes"]
        assert left_out.summary == every.summary
    assert expired  # by the pass at that end, which was made
    assert _history(left_out, "granted")[2] == [HOUR]


def test_the_slurm_like_baseline_passes_when_time_alone_puts_another_job_first():
    # a holds half the node; its 8-GPU job comes first by age and reserves the free
    # half, which b's 4-GPU job could take. Once the 8-GPU job's age is capped, b's
    # fair-share factor (b has used nothing) puts b's job first, at 1014 s: a pass
    # where only time moved grants it (the next tick, 1015 s).
    running = Job(1, 0.0, "ua", "a", 4, duration=10 * HOUR)
    blocked = Job(2, 10.0, "ua", "a", 8, duration=600.0)
    waiting = Job(3, 20.0, "ub", "b", 4, duration=600.0)
    workload = _one_node([running, blocked, waiting], until=4 * HOUR)
    slurm = MultifactorFairShare(workload.accounts, fairshare_weight=8.0, max_age=1000.0)
    result = Simulation(workload, slurm, SimConfig(check=True, tick=5, history=True)).run()
    assert _history(result, "granted")[3] == [1015.0]
    assert result.stats["quiet_passes"] > 100


class _CheckedIndex(FairShare):
    """Ours, asserting at every pass that the slices the engine said changed
    (FairShare.expect) brought the kept index to exactly the snapshot's slices."""

    def __call__(self, snapshot, /):
        decisions = super().__call__(snapshot)
        assert self.kept.slices == {s.id: s for s in snapshot.slices}
        return decisions


def test_the_slices_the_engine_says_changed_are_every_change(small):
    # A pass's decisions and checkpoint reports change slices in place between
    # passes; one the engine did not tell would leave the index behind the snapshot
    # (the index files only what it is told). An arrival or a release left untold
    # changes the count, and the index then compares every slice (PassState.expect).
    config = SimConfig(checkpoint_interval=30 * 60, report_checkpoints=True)
    told = Simulation(small, _CheckedIndex(small.accounts), config).run()
    assert told.stats["passes"] > 100 and told.summary == (
        Simulation(small, FairShare(small.accounts), config).run().summary
    )


def test_the_same_seed_gives_the_same_run_and_another_seed_another(tiny):
    a = simulate(tiny, FairShare(tiny.accounts)).summary
    b = simulate(tiny, FairShare(tiny.accounts)).summary
    assert a == b
    other = generate(TINY, seed=4)
    assert simulate(other, FairShare(other.accounts)).summary != a


def test_coalescing_events_runs_fewer_passes(tiny):
    exact = simulate(tiny, FairShare(tiny.accounts), SimConfig(quantum=1)).stats["passes"]
    coarse = simulate(tiny, FairShare(tiny.accounts), SimConfig(quantum=60)).stats["passes"]
    assert coarse < exact


def test_warmup_leaves_the_first_hours_out(tiny):
    cold = simulate(tiny, FairShare(tiny.accounts)).summary
    warm = simulate(tiny, FairShare(tiny.accounts), SimConfig(warmup=6 * HOUR)).summary
    assert warm["warmup_hours"] == 6
    assert sum(v["count"] for v in warm["waits"].values()) < sum(
        v["count"] for v in cold["waits"].values()
    )
    assert warm["occupancy"] > cold["occupancy"]  # the cluster starts empty


def test_the_bench_extrapolates_a_short_sample_to_the_month():
    from broker.sim.bench import measure

    row = measure("fifo", slices=6_000, days=30, sample_days=0.5)
    assert row["sample_slices"] >= 100 and row["passes"] > 0  # squatters come on top
    assert row["extrapolated_month_cpu_seconds"] == pytest.approx(row["cpu_seconds"] * 60)


def test_the_bench_times_a_policy_that_is_still_told_what_changed(tiny):
    from broker.sim.bench import _Timed

    ours, baseline = _Timed(FairShare(tiny.accounts)), _Timed(POLICIES["priority"](tiny.accounts))
    assert ours.expect.__self__ is ours.inner  # the engine finds it by getattr
    assert getattr(baseline, "expect", None) is None  # a baseline keeps no index
    told = simulate(tiny, ours, SimConfig()).summary
    assert told == simulate(tiny, FairShare(tiny.accounts), SimConfig()).summary


# ---- what a preemption costs the victim ---------------------------------------------------

ACCOUNTS = (Account("a"), Account("b"))
RESTART, CHECKPOINTS = 300.0, 1800.0
# b's free (min_runtime 0) training job fills the node; at 4000 s a's protected job
# takes it back (60 s grace) and runs 4060-5060; then the training job runs again.
FREE_TRAINING = Job(0, 0.0, "ub", "b", 8, 10_000.0, SliceKind.BATCH, 0.0, resumable=True)
PROTECTED = Job(1, 4000.0, "ua", "a", 8, 1000.0, SliceKind.BATCH, 1000.0)


def _one_node(jobs, events=(), until=20_000.0) -> Workload:
    return Workload("cost", tuple(jobs), (Node("n0", "h100", 8),), ACCOUNTS, events, until=until)


def _history(result, what: str) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for t, event, job_id in result.history:
        if event == what:
            out.setdefault(job_id, []).append(t)
    return out


def _costly(**config) -> SimConfig:
    return SimConfig(
        tick=0, check=True, history=True, restart_cost=RESTART, checkpoint_interval=CHECKPOINTS,
        **config,
    )  # fmt: skip


def test_a_single_preemption_costs_exactly_the_restart_and_the_work_since_the_checkpoint():
    result = simulate(_one_node([FREE_TRAINING, PROTECTED]), FairShare(ACCOUNTS), _costly())
    assert _history(result, "preempted (unallocated)") == {0: [4000.0]}
    assert _history(result, "granted") == {0: [0.0, 5060.0], 1: [4060.0]}
    # it worked 4060 s; checkpoints every 1800 s of work from its phase
    phase = checkpoint_phase(1, 0, CHECKPOINTS)
    lost = 4060.0 if phase > 4060.0 else (4060.0 - phase) % CHECKPOINTS
    # back at 5060: the restart, then the 10,000 s less what it kept
    assert _history(result, "released")[0] == [5060.0 + RESTART + 10_000.0 - (4060.0 - lost)]
    s = result.summary
    assert s["wasted_by_cause"]["preemption"] == pytest.approx(
        {"restart": 8 * RESTART / HOUR, "since checkpoint": 8 * lost / HOUR, "rerun": 0.0}
    )
    assert s["preemption_lost_gpu_hours"] == pytest.approx(8 * (RESTART + lost) / HOUR)
    assert s["lost_gpu_hours"] == pytest.approx(8 * lost / HOUR)
    # useful work is exactly what the two jobs asked for, whatever the phase
    assert s["useful_gpu_hours"] == pytest.approx(8 * 11_000 / HOUR)
    assert s["goodput"] == pytest.approx(8 * 11_000 / (8 * 20_000))
    assert s["goodput"] < s["busy_occupancy"]
    assert s["preempted_jobs"] == 1 and s["preemptions_per_job_max"] == 1


def test_reported_checkpoints_make_the_victim_the_job_with_the_least_unsaved_work():
    # b's two free 4-GPU training jobs, granted at 0 and 600; at 4000 a's protected
    # job takes one. Unreported, the later grant is taken; reported, the later checkpoint.
    first = Job(0, 0.0, "ub", "b", 4, 20_000.0, SliceKind.BATCH, 0.0, resumable=True)
    second = Job(1, 600.0, "ub", "b", 4, 20_000.0, SliceKind.BATCH, 0.0, resumable=True)
    protected = Job(2, 4000.0, "ua", "a", 4, 1000.0, SliceKind.BATCH, 1000.0)
    workload = _one_node([first, second, protected])

    def last_checkpoint(job: Job) -> float:
        phase = checkpoint_phase(1, job.id, CHECKPOINTS)
        return job.submit + phase + (4000.0 - job.submit - phase) // CHECKPOINTS * CHECKPOINTS

    saved_last = max((first, second), key=last_checkpoint)
    assert saved_last is first  # the phases of seed 1: the earlier job saved more recently

    def victim_and_loss(report: bool) -> tuple[int, float]:
        result = simulate(workload, FairShare(ACCOUNTS), _costly(report_checkpoints=report))
        (victim,) = _history(result, "preempted (unallocated)")
        return victim, result.summary["lost_gpu_hours"]

    unreported, lost_unreported = victim_and_loss(False)
    reported, lost_reported = victim_and_loss(True)
    assert (unreported, reported) == (second.id, first.id)
    # it works on through its 60 s grace, then loses what it did since its checkpoint
    assert lost_reported == pytest.approx(4 * (4060.0 - last_checkpoint(first)) / HOUR)
    assert lost_reported < lost_unreported


def test_without_a_cost_model_the_preempted_job_keeps_all_its_work():
    config = SimConfig(tick=0, check=True, history=True)
    result = simulate(_one_node([FREE_TRAINING, PROTECTED]), FairShare(ACCOUNTS), config)
    assert _history(result, "released")[0] == [5060.0 + 10_000.0 - 4060.0]
    assert result.summary["preemption_lost_gpu_hours"] == 0.0
    assert result.summary["goodput"] == pytest.approx(result.summary["busy_occupancy"])


def test_checkpoint_phases_are_per_job_reproducible_and_within_the_interval():
    phases = [checkpoint_phase(1, job_id, CHECKPOINTS) for job_id in range(200)]
    assert phases == [checkpoint_phase(1, job_id, CHECKPOINTS) for job_id in range(200)]
    assert all(0 <= p < CHECKPOINTS for p in phases)
    assert len(set(phases)) == 200 and phases != [checkpoint_phase(2, j, 1800) for j in range(200)]


def test_a_restart_after_a_node_failure_is_charged_to_the_failure():
    down = NodeEvent(4000.0, "n0", NodeState.DOWN, repair=600.0)
    w = _one_node([FREE_TRAINING], events=(down,))
    result = simulate(w, FairShare(ACCOUNTS), _costly())
    lost = (4000.0 - checkpoint_phase(1, 0, CHECKPOINTS)) % CHECKPOINTS  # the phase is < 4000
    assert _history(result, "granted") == {0: [0.0, 4600.0]}
    assert _history(result, "released")[0] == [4600.0 + RESTART + 10_000.0 - (4000.0 - lost)]
    s = result.summary
    assert s["wasted_by_cause"]["failure"] == pytest.approx(
        {"restart": 8 * RESTART / HOUR, "since checkpoint": 8 * lost / HOUR, "rerun": 0.0}
    )
    assert s["preemption_lost_gpu_hours"] == 0.0


def test_debug_waits_are_split_by_the_users_cap():
    def session(job_id, at, user, gpus):
        return Job(job_id, at, user, "a", gpus, 300.0, SliceKind.INTERACTIVE, 900.0)

    jobs = [
        session(0, 0.0, "ann", 2),  # within the cap of 2 GPUs
        session(1, 10.0, "ann", 1),  # ann would have 3 in flight: beyond
        session(2, 20.0, "bob", 1),  # bob's first: within
        session(3, 400.0, "ann", 2),  # ann's first two have ended: within again
    ]
    result = simulate(_one_node(jobs, until=2000.0), FairShare(ACCOUNTS), SimConfig(tick=0))
    groups = result.summary["wait_groups"]
    assert groups["debug within cap"]["count"] == 3
    assert groups["debug beyond cap"]["count"] == 1
    assert result.summary["waits"]["debug"]["count"] == 4


def test_work_an_operator_ends_on_an_overdue_drain_is_charged_to_the_operator():
    drain = NodeEvent(1000.0, "n0", NodeState.DRAINING, repair=600.0)
    w = _one_node([FREE_TRAINING], events=(drain,), until=30_000.0)
    result = simulate(w, POLICIES["fifo"](ACCOUNTS), _costly(drain_deadline=3000.0))
    # FIFO never preempts: at 4000 s an operator ends the job; drained, it is back at 4600
    assert result.summary["interventions"] == 1
    assert _history(result, "granted") == {0: [0.0, 4600.0]}
    lost = (4000.0 - checkpoint_phase(1, 0, CHECKPOINTS)) % CHECKPOINTS
    assert result.summary["wasted_by_cause"]["operator"] == pytest.approx(
        {"restart": 8 * RESTART / HOUR, "since checkpoint": 8 * lost / HOUR, "rerun": 0.0}
    )
    assert result.summary["preemption_lost_gpu_hours"] == 0.0
