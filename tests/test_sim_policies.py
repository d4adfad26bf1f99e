"""Each policy, driven by the simulator, reproduces outcomes computed by hand on tiny workloads.

Times are seconds after ``T0``; every pass runs at the exact event time
(integer times, 1-second quantum) and invariants are checked after each one.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import flat_tree, nodes, pending, running, snapshot
from hypothesis import example, given, settings
from hypothesis import strategies as st

from broker.core.model import Account, Node, NodeState, Placement, Policy, SliceKind
from broker.core.placement import FreeGpus
from broker.sim.engine import SimConfig, Simulation, simulate
from broker.sim.policies import FairShare, Fifo, MultifactorFairShare, StrictPriority, _Fitter
from broker.sim.workloads import Job, NodeEvent, Workload

ACCOUNTS = (Account("a"), Account("b"))
T0 = 1000.0  # the simulated clock's origin is not a time anything happens at


def job(id, submit, project, gpus, duration, **kwargs) -> Job:
    kwargs.setdefault("min_runtime", 60.0)
    return Job(id, T0 + submit, f"user-{project}", project, gpus, float(duration), **kwargs)


def workload(jobs, nodes=1, *, events=(), until=10_000.0) -> Workload:
    """``nodes`` 8-GPU nodes; ``events`` and ``until`` are relative to ``T0``."""
    return Workload(
        name="tiny",
        jobs=tuple(jobs),
        nodes=tuple(Node(f"n{i}", "h100", 8) for i in range(nodes)),
        accounts=ACCOUNTS,
        node_events=tuple(replace(e, at=T0 + e.at) for e in events),
        until=T0 + until,
    )


def run(policy, w, **config):
    config.setdefault("tick", 0)
    return simulate(w, policy, SimConfig(check=True, history=True, **config))


def times(result, what):
    """Job id -> times (after ``T0``) of ``what`` (e.g. "granted") in the run's history."""
    out: dict[int, list[float]] = {}
    for t, event, job_id in result.history:
        if event == what:
            out.setdefault(job_id, []).append(t - T0)
    return out


def first(result, what):
    return {j: ts[0] for j, ts in times(result, what).items()}


# ---- FIFO and strict priority: head-of-line blocking versus skipping ahead -------------

BLOCKING = [
    job(0, 0, "a", 4, 100),  # runs 0-100
    job(1, 10, "a", 8, 50),  # needs the whole node: 100-150
    job(2, 20, "b", 1, 10),  # fits at once, but FIFO keeps it behind job 1
]


def test_fifo_serves_in_submit_order_and_the_head_blocks_the_queue():
    result = run(Fifo(ACCOUNTS), workload(BLOCKING))
    assert first(result, "granted") == {0: 0.0, 1: 100.0, 2: 150.0}
    assert first(result, "released") == {0: 100.0, 1: 150.0, 2: 160.0}
    assert result.summary["preemptions_total"] == 0


def test_strict_priority_skips_what_does_not_fit_and_starts_what_does():
    result = run(StrictPriority(ACCOUNTS, overcommit=1.0), workload(BLOCKING))
    # quotas of 4 GPUs per project; job 1 may start above its quota only
    # when project a holds nothing (its first job is still running until 100)
    assert first(result, "granted") == {0: 0.0, 2: 20.0, 1: 100.0}


def test_strict_priority_quota_holds_back_a_project_even_with_idle_gpus():
    jobs = [
        job(0, 0, "a", 4, 100),
        job(1, 1, "a", 2, 100),  # a is at its quota of 4: waits though 4 GPUs are free
        job(2, 2, "b", 2, 30),
    ]
    result = run(StrictPriority(ACCOUNTS, overcommit=1.0), workload(jobs))
    assert first(result, "granted") == {0: 0.0, 2: 2.0, 1: 100.0}


def test_strict_priority_orders_by_priority_then_submit_time():
    jobs = [
        job(0, 0, "a", 8, 100),
        job(1, 10, "b", 8, 100, priority=0),
        job(2, 20, "b", 8, 100, priority=5),
    ]
    result = run(StrictPriority(ACCOUNTS, overcommit=2.0), workload(jobs))
    assert first(result, "granted") == {0: 0.0, 2: 100.0, 1: 200.0}


# ---- Slurm-like: fair-share factor and the top job's reservation ----------------------


def test_slurm_like_prefers_the_project_with_less_decayed_usage_over_submit_order():
    jobs = [
        job(0, 0, "b", 8, 100),  # b uses the whole cluster first
        job(1, 50, "b", 8, 100),
        job(2, 60, "a", 8, 100),  # later, but a has used nothing
    ]
    result = run(MultifactorFairShare(ACCOUNTS), workload(jobs))
    assert first(result, "granted") == {0: 0.0, 2: 100.0, 1: 200.0}
    # FIFO serves the same jobs in submit order
    assert first(run(Fifo(ACCOUNTS), workload(jobs)), "granted") == {0: 0.0, 1: 100.0, 2: 200.0}


def test_slurm_like_keeps_the_top_blocked_jobs_nodes_from_later_work():
    jobs = [
        job(0, 0, "b", 4, 100),  # on n0 until 100
        job(1, 1, "a", 16, 50),  # a gang of both nodes: blocked, reserves them
        job(2, 2, "b", 4, 10),  # would fit on either node, but both are reserved
    ]
    w = workload(jobs, nodes=2)
    result = run(MultifactorFairShare(ACCOUNTS), w)
    assert first(result, "granted") == {0: 0.0, 1: 100.0, 2: 150.0}
    # strict priority lets the small job through at once (and the gang still starts at 100)
    greedy = run(StrictPriority(ACCOUNTS, overcommit=2.0), w)
    assert first(greedy, "granted") == {0: 0.0, 2: 2.0, 1: 100.0}


# ---- ours: the real pass ----------------------------------------------------------------


def test_fairshare_a_debug_session_preempts_batch_and_waits_only_the_debug_grace_period():
    jobs = [
        job(0, 0, "b", 8, 1000, resumable=True),  # protected for 60 s, then preemptible
        job(1, 100, "a", 1, 300, kind=SliceKind.INTERACTIVE, min_runtime=900),
    ]
    result = run(FairShare(ACCOUNTS), workload(jobs))
    # preempted at 100, reclaimed at 120 (the 20 s debug grace), session runs 120-420;
    # the batch job, requeued with 1000 - 120 = 880 s left, needs all 8 GPUs again:
    # 420-1300 (the debug lane: fair share alone would not give a 1-GPU request all
    # 8 of b's GPUs)
    assert times(result, "granted") == {0: [0.0, 420.0], 1: [120.0]}
    assert first(result, "preempted (debug_lane)") == {0: 100.0}
    assert first(result, "released") == {1: 420.0, 0: 1300.0}
    s = result.summary
    assert s["waits"]["debug"]["p50"] == 20.0
    assert s["preemptions"] == {"debug_lane": 1} and s["lost_gpu_hours"] == 0.0
    # FIFO makes the session wait for the whole batch job
    assert first(run(Fifo(ACCOUNTS), workload(jobs)), "granted")[1] == 1000.0


def test_fairshare_a_protected_slice_is_not_preempted_before_its_contract_ends():
    jobs = [
        job(0, 0, "b", 4, 5000, min_runtime=3600, resumable=True),
        job(2, 0, "b", 4, 5000, min_runtime=3600, resumable=True),
        job(1, 100, "a", 4, 100, min_runtime=3600),  # a's fair share now: half the node
    ]
    result = run(FairShare(ACCOUNTS), workload(jobs))
    (preempted,) = first(result, "preempted (fair_share)").items()
    assert preempted[0] in (0, 2) and preempted[1] == 3600.0
    assert first(result, "granted") == {0: 0.0, 2: 0.0, 1: 3660.0}


def test_fairshare_drains_need_no_human_baselines_need_one_past_the_deadline():
    jobs = [job(0, 0, "a", 4, 20 * 3600, min_runtime=600, resumable=True)]
    drain = NodeEvent(100.0, "n0", NodeState.DRAINING, repair=3600)
    w = workload(jobs, nodes=2, events=[drain], until=30 * 3600)
    ours = run(FairShare(ACCOUNTS), w, drain_deadline=12 * 3600)
    # preempted when its 600 s contract ends, gone after the grace: drained at 660
    assert first(ours, "preempted (drain)") == {0: 600.0}
    assert times(ours, "granted") == {0: [0.0, 660.0]}  # requeued onto n1 at once
    s = ours.summary
    assert (s["drains"], s["drains_emptied"], s["interventions"]) == (1, 1, 0)
    assert s["drain_hours_max"] == pytest.approx(560 / 3600)
    fifo = run(Fifo(ACCOUNTS), w, drain_deadline=12 * 3600)
    # nothing preempts under FIFO: at 100 s + 12 h an operator ends the job
    assert fifo.summary["interventions"] == 1
    assert first(fifo, "preempted (requeued)") == {0: 100.0 + 12 * 3600}
    assert fifo.summary["drain_hours_max"] == pytest.approx(12.0)


@pytest.mark.parametrize("policy", [FairShare(ACCOUNTS), Fifo(ACCOUNTS)], ids=["ours", "fifo"])
def test_a_node_going_down_ends_its_work_and_the_user_starts_again(policy):
    jobs = [job(0, 0, "a", 8, 1000)]  # not resumable
    down = NodeEvent(400.0, "n0", NodeState.DOWN, repair=600)
    result = run(policy, workload(jobs, events=[down]))
    # lost 400 s of 8 GPUs; resubmitted at once, it waits for the repair at 1000
    assert first(result, "node_down") == {0: 400.0}
    assert times(result, "granted") == {0: [0.0, 1000.0]}
    assert first(result, "released") == {0: 2000.0}
    assert result.summary["lost_gpu_hours"] == pytest.approx(8 * 400 / 3600)
    assert result.summary["resubmitted"] == 1


def test_fairshare_an_idle_session_past_its_contract_gives_way_to_a_better_ranked_project():
    # b holds the whole cluster (two nodes): its idle session and a long, protected job.
    squatter = job(0, 0, "b", 8, 86_400, kind=SliceKind.INTERACTIVE, min_runtime=3600, idle=True)
    busy = job(2, 0, "b", 8, 86_400, min_runtime=8 * 3600)
    worker = job(1, 600, "a", 8, 100)  # a's fair share now: one node
    w = workload([squatter, busy, worker], nodes=2, until=20_000)
    ours = run(FairShare(ACCOUNTS), w)
    assert first(ours, "granted") == {0: 0.0, 2: 0.0, 1: 3660.0}
    assert ours.summary["squatter_idle_gpu_hours"] == pytest.approx(8 * 3660 / 3600)
    fifo = run(Fifo(ACCOUNTS), w)
    assert 1 not in first(fifo, "granted")  # still waiting when the run ends
    assert fifo.summary["waits"]["batch 2-8"]["not_started"] == 1


# ---- preempt only what waiting cannot fix (design.md §5.7) ------------------------------

TWO_HOLDERS = [
    job(0, 0, "b", 4, 300, resumable=True),  # b holds the node in two jobs until 300
    job(1, 0, "b", 4, 300, resumable=True),
    job(2, 100, "a", 4, 100),  # a, owed half the node, asks once b's are past protection
]


def test_fairshare_waits_for_a_release_due_within_its_delay_and_counts_it_avoided():
    result = run(FairShare(ACCOUNTS, Policy(batch_preemption_delay=900)), workload(TWO_HOLDERS))
    # b's jobs end at 300, before a has waited its 15 minutes: nobody is preempted
    assert first(result, "granted")[2] == 300.0
    s = result.summary
    assert s["preemptions_total"] == 0
    assert (s["avoided_preemptions"], s["avoided_wait_p50"]) == (1, 200.0)
    assert s["musical_chairs"] == 0


def test_fairshare_tells_a_gathered_shape_from_a_swap_and_counts_its_victims_back():
    # b holds the node as eight 1-GPU jobs; a asks for 2 GPUs: two of them go, and
    # both are back once a's 100 s of work end
    holders = [job(i, 0, "b", 1, 300, resumable=True) for i in range(8)]
    jobs = [*holders, job(8, 100, "a", 2, 100)]
    result = run(FairShare(ACCOUNTS, Policy(batch_preemption_delay=0)), workload(jobs), tick=0)
    assert len(first(result, "preempted (fair_share)")) == 2
    assert result.summary["preemptions_by_need"] == {
        "gather": {"preemptions": 2, "musical_chairs": 2, "requester_wait_p50": 0.0}
    }


def test_fairshare_preempts_when_its_wait_ends_without_waiting_for_another_event():
    # b's jobs now run until 3000; no event falls between a's request and then, and
    # the service passes every few seconds: a preempts the moment its 900 s are up.
    long_holders = [
        replace(TWO_HOLDERS[0], duration=3000.0),
        replace(TWO_HOLDERS[1], duration=3000.0),
    ]
    jobs = [*long_holders, TWO_HOLDERS[2]]
    result = run(FairShare(ACCOUNTS, Policy(batch_preemption_delay=900)), workload(jobs))
    assert first(result, "preempted (fair_share)") == {0: 1000.0}
    assert first(result, "granted")[2] == 1060.0  # after the victim's 60 s grace
    # a's 4 GPUs for a 4-GPU victim: a swap, asked for after the 900 s a waited
    swap = result.summary["preemptions_by_need"]["swap"]
    assert (swap["preemptions"], swap["requester_wait_p50"]) == (1, 900.0)


def test_fairshare_counts_a_victim_granted_again_within_the_hour_as_musical_chairs():
    policy = Policy(batch_preemption_delay=0)
    config = SimConfig(check=True, history=True, tick=0, restart_cost=30)
    simulation = Simulation(workload(TWO_HOLDERS), FairShare(ACCOUNTS, policy), config)
    result = simulation.run()
    # a preempts one of b's jobs at once and runs 160-260 after the 60 s grace;
    # the victim is back on the node at 260: the preemption bought a 140 s shorter
    # wait, at the price of a restart and the work since the victim's checkpoint
    assert first(result, "preempted (fair_share)") == {0: 100.0}
    assert times(result, "granted")[0] == [0.0, 260.0]
    s = result.summary
    assert (s["musical_chairs"], s["musical_chairs_share"]) == (1, 1.0)
    assert s["musical_chairs_by_reason"] == {"fair_share": 1}
    assert s["preemptions_by_need"] == {
        "swap": {"preemptions": 1, "musical_chairs": 1, "requester_wait_p50": 0.0}
    }
    assert s["musical_chairs_gpu_hours"] == pytest.approx(4 * 30 / 3600)  # its restart
    assert s["avoided_preemptions"] == 0
    # a took from b, and b never from a: no fair-share move was taken back
    assert simulation.recorder.fair_share_moves == {("a", "b"): 1}
    assert s["fair_share_back_and_forth"] == 0


# ---- the baselines' walk: a shape that found no place is not looked for again ----------

_REQUESTS = st.lists(
    st.tuples(
        st.integers(1, 16),  # GPUs
        st.sampled_from([None, "h100", "a100"]),  # GPU type
        st.sampled_from([SliceKind.BATCH, SliceKind.INTERACTIVE]),
        st.booleans(),  # on a misfit, take some free GPUs as a reservation would
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@example(  # a session that finds no node, then batch work of its size that spans two
    sizes=[("h100", 8), ("h100", 8)],
    requests=[(12, None, SliceKind.INTERACTIVE, False), (12, None, SliceKind.BATCH, False)],
)
@given(
    sizes=st.lists(st.tuples(st.sampled_from(["h100", "a100"]), st.integers(1, 8)), max_size=5),
    requests=_REQUESTS,
)
def test_a_baselines_pass_finds_the_places_a_walk_asking_every_job_would(sizes, requests):
    """Within a baseline's pass free GPUs only shrink, so ``_Fitter`` answers each job as
    asking the free map again would (``FreeGpus.fit``), shapes it remembers included."""
    nodes = [Node(f"n{i}", gpu_type, count) for i, (gpu_type, count) in enumerate(sizes)]
    free = FreeGpus(nodes, {"h100": 1.0, "a100": 0.5})
    fit = _Fitter(free)
    for i, (gpus, gpu_type, kind, reserve) in enumerate(requests):
        s = pending("a", gpus, kind=kind, gpu_type=gpu_type, id=i)
        asked = free.fit(gpus, gpu_type, kind is SliceKind.BATCH)
        assert fit(s) == asked
        if asked is not None:
            free.take(asked)
        elif reserve and free.free_total:
            node = max(free.free, key=lambda name: (len(free.free[name]), name))
            free.take([Placement(node, tuple(sorted(free.free[node])))])


@settings(max_examples=100, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from([0.0, 3600.0, 86400.0, 8 * 86400.0, 9 * 86400.0]),  # waited
        ),
        max_size=12,
    ),
    usage=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.floats(0, 1e6), max_size=3),
)
def test_the_slurm_like_pass_with_nothing_free_keeps_the_heads_its_sorted_queue_shows(jobs, usage):
    """No GPU free: the pass does not sort its queue, yet keeps what a quiet pass keeps,
    each project's first job and the first of all, as order_key's order has them."""
    now = 10 * 86400.0
    holder = running("a", "n0", tuple(range(8)))
    waiting = [
        pending(project, submitted_at=now - waited, id=100 + i)
        for i, (project, waited) in enumerate(jobs)
    ]
    accounts = flat_tree("a", "b", "c")
    policy = MultifactorFairShare(accounts)
    decisions = policy(snapshot(nodes(1), accounts, [holder, *waiting], usage=usage, now=now))
    assert decisions.quiet is not None and not decisions.grants
    key = policy.order_key(policy.factors(usage), now)
    ordered = sorted(waiting, key=lambda s: key(s.project, s.submitted_at, s.id))
    heads: dict[str, tuple[float, int]] = {}
    for s in ordered:
        heads.setdefault(s.project, (s.submitted_at, s.id))
    assert set(policy._heads) == {(project, *head) for project, head in heads.items()}
    assert policy._first == (ordered[0].id if ordered else None)
