"""Preempt only what waiting cannot fix (design.md §5.7): a delay per class, releases
already known, victims above their share, siblings before cousins, a budget per job,
and the debug lane's own limits."""

from __future__ import annotations

from dataclasses import replace

from builders import HOUR, MIN, NOW, flat_tree, nodes, pending, running, snapshot

from broker.core.model import Account, Policy, PreemptReason, SliceKind, SliceState
from broker.core.scheduler import schedule
from broker.core.transitions import preempting, requeued


def hog_and_starving(**requester):
    """``hog`` holds all 8 GPUs of one node in two 4-GPU jobs past protection; the
    ``starving`` project asks for its fair share of 4."""
    hog = [
        running("hog", "n0", (0, 1, 2, 3), min_runtime=HOUR),
        running("hog", "n0", (4, 5, 6, 7), min_runtime=HOUR),
    ]
    return hog, pending("starving", 4, **requester)


def decide(slices, *, accounts=None, policy=None, now=NOW):
    return schedule(
        snapshot(
            nodes(1) if accounts is None else nodes(2),
            accounts or flat_tree("hog", "starving"),
            slices,
            policy=policy,
            now=now,
        )
    )


def test_a_batch_request_waits_its_delay_for_releases_before_it_preempts():
    policy = Policy(batch_preemption_delay=15 * MIN)
    hog, fresh = hog_and_starving(submitted_at=NOW - 5 * MIN)
    d = decide([*hog, fresh], policy=policy)
    assert d.preemptions == () and d.deferred == (fresh.id,)
    # once it has waited its delay with nothing freed, the preemption buys something
    d = decide([*hog, fresh], policy=policy, now=fresh.submitted_at + 15 * MIN)
    assert [p.reason for p in d.preemptions] == [PreemptReason.FAIR_SHARE]
    assert d.deferred == ()


def test_a_notebook_waits_a_shorter_delay_than_batch():
    policy = Policy(batch_preemption_delay=15 * MIN, interactive_preemption_delay=MIN)
    hog, session = hog_and_starving(kind=SliceKind.INTERACTIVE, submitted_at=NOW - 2 * MIN)
    d = decide([*hog, session], policy=policy)
    assert [p.for_slice for p in d.preemptions] == [session.id]


def test_no_preemption_when_a_release_is_due_before_the_grace_would_end():
    # one of hog's jobs ends by its maximum runtime 30 s from now: sooner than the
    # 60 s grace a preemption would give its victim, so the request waits for it
    hog, request = hog_and_starving()
    ending = replace(hog[1], contract=replace(hog[1].contract, max_runtime=2 * HOUR + 30))
    d = decide([hog[0], ending, request], policy=Policy(grace_period=60))
    assert d.preemptions == () and d.deferred == (request.id,)
    # the same job ending in 2 minutes is not worth waiting for
    later = replace(ending, contract=replace(ending.contract, max_runtime=2 * HOUR + 2 * MIN))
    d = decide([hog[0], later, request], policy=Policy(grace_period=60))
    assert len(d.preemptions) == 1


def test_a_project_at_or_under_its_share_is_never_a_fair_share_victim():
    # a holds 4 of 8 (its share exactly), b holds 4 of its own and asks for more;
    # c holds nothing and asks for 4: only b, above its share, is c's victim
    a_job = running("a", "n0", (0, 1, 2, 3), min_runtime=HOUR)
    b_job = running("b", "n0", (4, 5, 6, 7), min_runtime=HOUR)
    b_more = running("b", "n1", tuple(range(8)), min_runtime=HOUR)
    c_request = pending("c", 4)
    d = decide([a_job, b_job, b_more, c_request], accounts=flat_tree("a", "b", "c"))
    victims = {p.slice_id for p in d.preemptions}
    assert victims and a_job.id not in victims
    # with b holding only its share too, c finds no victim at all
    d = decide([a_job, b_job, c_request], accounts=flat_tree("a", "b", "c"))
    assert d.preemptions == ()


def test_a_sibling_under_its_share_is_served_from_its_over_share_sibling_first():
    # org1 (a, b) and org2 (c) each own half of 16 GPUs. a holds 8 of org1's 8 with
    # 1-GPU jobs, so org1 is at its share but b, under its own, is owed 4; c holds
    # its 8 and is at its share: b takes from a, its sibling, never from its cousin c
    accounts = [
        Account("org1"),
        Account("org2"),
        Account("a", parent="org1"),
        Account("b", parent="org1"),
        Account("c", parent="org2"),
    ]
    a_jobs = [running("a", "n0", (i,), min_runtime=HOUR) for i in range(8)]
    c_job = running("c", "n1", tuple(range(8)), min_runtime=HOUR)
    b_request = pending("b", 4)
    d = decide([*a_jobs, c_job, b_request], accounts=accounts)
    victims = {p.slice_id for p in d.preemptions}
    assert len(victims) == 4 and victims <= {s.id for s in a_jobs}


def test_a_fair_share_margin_keeps_small_jobs_from_trading_near_the_same_standing():
    # a and b own half of 16 GPUs each; a holds 6 and asks for 1 more, b holds 10,
    # all 1-GPU jobs past protection. Without a margin a takes one of b's (7 against
    # 9 after the move); with half a share of margin the request is judged as if it
    # moved a by 4 GPUs (10 against 9), and b keeps its job.
    a_jobs = [running("a", "n0", (i,), min_runtime=HOUR) for i in range(6)]
    b_jobs = [running("b", "n0", (i,), min_runtime=HOUR) for i in (6, 7)]
    b_jobs += [running("b", "n1", (i,), min_runtime=HOUR) for i in range(8)]
    request = pending("a", 1)
    slices = [*a_jobs, *b_jobs, request]
    accounts = flat_tree("a", "b")
    d = decide(slices, accounts=accounts)
    assert [(p.reason, p.for_slice) for p in d.preemptions] == [
        (PreemptReason.FAIR_SHARE, request.id)
    ]
    assert decide(slices, accounts=accounts, policy=Policy(fair_share_margin=0.5)).preemptions == ()
    # Further apart (a holds 2, b 14), the same margin lets the small request in.
    b_more = [running("b", "n0", (i,), min_runtime=HOUR) for i in range(2, 6)]
    apart = [*a_jobs[:2], *b_more, *b_jobs, request]
    d = decide(apart, accounts=accounts, policy=Policy(fair_share_margin=0.5))
    assert [p.for_slice for p in d.preemptions] == [request.id]


#: Three programs of one project each, but o1 with two (a and b).
THREE_PROGRAMS = [
    Account("o1"),
    Account("o2"),
    Account("o3"),
    Account("a", parent="o1"),
    Account("b", parent="o1"),
    Account("c", parent="o2"),
    Account("e", parent="o3"),
]
#: A slice granted a minute ago with 8 hours of protection: nobody's victim.
PROTECTED = {"min_runtime": 8 * HOUR, "granted_ago": MIN}


def test_a_project_its_siblings_keep_over_share_takes_from_a_cousin_over_share_too():
    # Three organisations of 8 GPUs each on 24. a holds 9 in protected 1-GPU jobs,
    # so o1 is above its share through a while b, under its own 4, asks for 4.
    # Compared as organisations b could take nothing from c (o1 would end above
    # o2); c is above its share in an organisation above its share too, so b may
    # take one of its jobs as a project. Were c's organisation at its share, c
    # would stay out of b's reach.
    accounts = THREE_PROGRAMS
    a_jobs = [running("a", "n0", (i,), **PROTECTED) for i in range(8)]
    a_jobs.append(running("a", "n1", (0,), **PROTECTED))
    e_jobs = [running("e", "n1", (1, 2, 3), **PROTECTED)]
    c_jobs = [
        running("c", "n1", (4, 5, 6, 7), min_runtime=HOUR),
        running("c", "n2", (0, 1, 2, 3), min_runtime=HOUR),
        running("c", "n2", (4, 5, 6, 7), min_runtime=HOUR),
    ]
    b_request = pending("b", 4)
    d = schedule(snapshot(nodes(3), accounts, [*a_jobs, *e_jobs, *c_jobs, b_request]))
    assert [p.reason for p in d.preemptions] == [PreemptReason.FAIR_SHARE]
    assert d.preemptions[0].slice_id in {s.id for s in c_jobs}

    # o2 at its share: c holds 7 (above its own 4), d beside it 1.
    with_d = [*accounts, Account("d", parent="o2")]
    c_jobs[1:] = [running("c", "n2", (0, 1, 2), min_runtime=HOUR)]
    others = [running("d", "n2", (3,), **PROTECTED), running("e", "n2", (4, 5, 6, 7), **PROTECTED)]
    b_request = pending("b", 2)  # c would stay at its share without its 3-GPU job
    d = schedule(snapshot(nodes(3), with_d, [*a_jobs, *e_jobs, *c_jobs, *others, b_request]))
    assert d.preemptions == ()


def test_a_project_at_its_own_share_takes_nothing_from_a_cousin_as_a_project():
    # As above, but b already holds its own 4 of o1's 8 (a the other 8): the
    # exception is for projects under their share, so b's request of 1 takes
    # nothing from c, though c as a project would stay above b after the move.
    accounts = THREE_PROGRAMS
    a_jobs = [running("a", "n0", (i,), **PROTECTED) for i in range(8)]
    b_job = running("b", "n1", (0, 1, 2, 3), **PROTECTED)
    c_jobs = [running("c", "n1", (i,), min_runtime=HOUR) for i in range(4, 8)]
    c_jobs += [running("c", "n2", (i,), min_runtime=HOUR) for i in range(8)]
    e_request = pending("e", 1)  # o3 wants GPUs: each program's share is 8
    b_request = pending("b", 1)
    d = schedule(snapshot(nodes(3), accounts, [*a_jobs, b_job, *c_jobs, e_request, b_request]))
    assert all(p.for_slice != b_request.id for p in d.preemptions)


def lumpy_beside_hog(hog_gpus_on_n3: int):
    """Four projects with fair shares of 12 on 48 GPUs: ``lumpy`` holds one 8-GPU
    job (0.67 of its share), ``hog`` two 8-GPU jobs past protection and
    ``hog_gpus_on_n3`` 1-GPU ones, ``c`` and ``d`` the rest, protected; ``lumpy``
    asks for 8 more."""
    lumpy = running("lumpy", "n0", tuple(range(8)), **PROTECTED)
    hog = [running("hog", n, tuple(range(8)), min_runtime=HOUR) for n in ("n1", "n2")]
    hog += [running("hog", "n3", (i,), **PROTECTED) for i in range(hog_gpus_on_n3)]
    c = [running("c", "n3", tuple(range(4, 8)), **PROTECTED)]
    c += [running("c", "n4", tuple(range(8)), **PROTECTED)]
    d = running("d", "n5", tuple(range(8)), **PROTECTED)
    return [lumpy, *hog, *c, d], pending("lumpy", 8)


def test_work_in_steps_larger_than_the_gap_overshoots_a_project_that_keeps_its_share():
    # hog holds 20 of its 12: lumpy's second 8-GPU job takes it to 16 (1.33) and
    # leaves hog at 12 (1.0), its share. The move overshoots, but the gap narrows
    # from 1.0 to 0.33 and hog keeps its share, so it is allowed.
    accounts = flat_tree("lumpy", "hog", "c", "d")
    slices, request = lumpy_beside_hog(hog_gpus_on_n3=4)
    d = schedule(snapshot(nodes(6), accounts, [*slices, request]))
    hog_8 = {s.id for s in slices if s.project == "hog" and s.gpus == 8}
    assert len(d.preemptions) == 1 and d.preemptions[0].slice_id in hog_8
    assert d.preemptions[0].reason is PreemptReason.FAIR_SHARE

    # With 19, hog would end below its share (11 of 12): lumpy waits for a release.
    slices, request = lumpy_beside_hog(hog_gpus_on_n3=3)
    d = schedule(snapshot(nodes(6), accounts, [*slices, request]))
    assert d.preemptions == ()


def test_a_project_at_its_share_overshoots_no_one():
    # lumpy holds 24 of 12 in 8-GPU jobs, hog its 12 and asks for 8 more: taking one
    # of lumpy's would narrow the gap (2.0 - 1.0 to 1.67 - 1.33), but hog is not
    # under its share, so only a move that keeps it at or below lumpy is allowed.
    lumpy = [running("lumpy", f"n{i}", tuple(range(8)), min_runtime=HOUR) for i in range(3)]
    hog = [running("hog", "n3", (i,), **PROTECTED) for i in range(8)]
    hog += [running("hog", "n4", (i,), **PROTECTED) for i in range(4)]
    c = [running("c", "n4", tuple(range(4, 8)), **PROTECTED)]
    c += [running("c", "n5", tuple(range(8)), **PROTECTED)]
    d_fresh = pending("d", 1, submitted_at=NOW)  # wants GPUs, within its delay
    request = pending("hog", 8)
    accounts = flat_tree("lumpy", "hog", "c", "d")
    d = schedule(snapshot(nodes(6), accounts, [*lumpy, *hog, *c, d_fresh, request]))
    assert d.preemptions == ()


def test_a_shape_is_gathered_from_one_nodes_one_gpu_holders():
    # hog holds both nodes, twice its share; its 1-GPU jobs past protection sit six
    # on n0 and two on n1, beside protected ones: a 4-GPU request takes four of
    # n0's, never a scattered set it could not use
    protected = {"min_runtime": 8 * HOUR, "granted_ago": MIN}
    hog_n0 = [running("hog", "n0", (i,), min_runtime=HOUR) for i in range(6)]
    kept_n0 = running("hog", "n0", (6, 7), **protected)
    hog_n1 = [running("hog", "n1", (i,), min_runtime=HOUR) for i in range(2)]
    kept_n1 = running("hog", "n1", tuple(range(2, 8)), **protected)
    request = pending("starving", 4)
    d = decide([*hog_n0, kept_n0, *hog_n1, kept_n1, request], accounts=flat_tree("hog", "starving"))
    victims = {p.slice_id for p in d.preemptions}
    assert len(victims) == 4 and victims <= {s.id for s in hog_n0}
    (promise,) = [r for r in d.reservations if r.slice_id == request.id]
    assert [p.node for p in promise.placements] == ["n0"]


def test_a_project_is_not_taken_below_its_share_by_more_victims_than_the_last():
    # hog holds 8 against a share of 5.3 (three projects want GPUs on 16): each
    # victim of a 4-GPU request is judged with what the earlier ones cost hog, so
    # the third leaves it at 5 of 5.3 and a fourth is refused
    hog_jobs = [running("hog", "n0", (i,), min_runtime=HOUR) for i in range(8)]
    other = running("other", "n1", tuple(range(8)), min_runtime=8 * HOUR, granted_ago=MIN)
    request = pending("starving", 4)
    accounts = flat_tree("hog", "starving", "other")
    d = decide([*hog_jobs, other, request], accounts=accounts)
    assert d.preemptions == ()
    # a 3-GPU request is served from the same jobs
    smaller = pending("starving", 3)
    d = decide([*hog_jobs, other, smaller], accounts=accounts)
    assert len(d.preemptions) == 3


def test_a_job_past_its_preemption_budget_is_nobodys_victim_but_a_drains():
    policy = Policy(preemption_budget=3)
    hog, request = hog_and_starving()
    spent = [replace(job, preemptions=3) for job in hog]
    d = decide([*spent, request], policy=policy)
    assert d.preemptions == ()
    # one preemption left: it may be taken once more
    d = decide([replace(spent[0], preemptions=2), spent[1], request], policy=policy)
    assert [p.slice_id for p in d.preemptions] == [spent[0].id]
    # no budget at all: both are candidates again
    d = decide([*spent, request], policy=Policy(preemption_budget=None))
    assert len(d.preemptions) == 1


def test_each_preemption_counts_and_a_requeued_victim_waits_its_delay_again():
    job = running("hog", "n0", (0, 1, 2, 3), min_runtime=HOUR, resumable=True)
    leaving = preempting(job, NOW)
    assert leaving.preemptions == 1
    back = requeued(leaving, NOW + 5)
    assert (back.state, back.preemptions, back.waiting_since) == (
        SliceState.PENDING,
        1,
        NOW + 5,
    )
    assert back.submitted_at == job.submitted_at  # its place in the queue is kept
    # starving took the node with two 4-GPU jobs: the victim may take one back by
    # fair share, but only once it has waited its delay again since its requeue
    takers = [
        running("starving", "n0", gpus, min_runtime=MIN, granted_ago=2 * MIN)
        for gpus in ((0, 1, 2, 3), (4, 5, 6, 7))
    ]
    policy = Policy(batch_preemption_delay=15 * MIN)
    d = decide([*takers, back], policy=policy, now=NOW + 6 * MIN)
    assert d.preemptions == () and d.deferred == (back.id,)
    d = decide([*takers, back], policy=policy, now=NOW + 16 * MIN)
    assert [p.for_slice for p in d.preemptions] == [back.id]


def test_a_debug_session_preempts_batch_with_the_short_debug_grace():
    policy = Policy(grace_period=60, debug_grace_period=20, debug_lane_fraction=0.25)
    batch = running("hog", "n0", tuple(range(8)), min_runtime=HOUR)
    session = pending("hog", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN)
    d = decide([batch, session], policy=policy)
    (p,) = d.preemptions
    assert p.deadline == NOW + 20  # the batch runner checkpoints on SIGTERM
    (promise,) = d.reservations
    assert promise.due_at == NOW + 20


def test_a_notebook_preempted_for_a_debug_session_keeps_the_full_grace():
    policy = Policy(grace_period=60, debug_grace_period=20)
    notebook = running("hog", "n0", tuple(range(8)), kind=SliceKind.INTERACTIVE, priority=-1)
    session = pending("hog", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN)
    d = decide([notebook, session], policy=policy)
    (p,) = d.preemptions
    assert p.reason is PreemptReason.PRIORITY and p.deadline == NOW + 60


def test_the_debug_lane_takes_no_batch_gpus_once_it_is_full():
    # a lane of 1 GPU (5% of 8, rounded up) already held by a's debug session: a
    # second debug session of a may not take b's batch GPUs through the lane, and
    # fair share refuses too (a gaining 1 while b loses 7 would put a above b)
    held = running("a", "n0", (0,), kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN, user="x")
    batch = running("b", "n0", tuple(range(1, 8)), min_runtime=HOUR)
    session = pending("a", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN, user="y")
    accounts = flat_tree("a", "b")
    d = schedule(snapshot(nodes(1), accounts, [held, batch, session]))
    assert d.preemptions == ()
    # with room in the lane, the same session gets in at once
    roomy = Policy(debug_lane_fraction=0.25)
    d = schedule(snapshot(nodes(1), accounts, [held, batch, session], policy=roomy))
    assert [(p.slice_id, p.reason) for p in d.preemptions] == [(batch.id, PreemptReason.DEBUG_LANE)]


def test_with_debug_first_a_session_the_lane_admits_takes_a_free_gpu_before_batch():
    # one GPU free, b's batch request ranks first in fair share (b holds nothing): with
    # debug_first the debug session of a, over its share, takes the free GPU instead of a
    # victim's, and b's request waits for the next release (design.md §5.1)
    policy = Policy(debug_lane_fraction=0.25, debug_first=True)
    held = running("a", "n0", tuple(range(7)), min_runtime=HOUR)
    batch = pending("b", 1, submitted_at=NOW - 2 * HOUR)
    session = pending("a", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN, user="x")
    d = schedule(snapshot(nodes(1), flat_tree("a", "b"), [held, batch, session], policy=policy))
    assert [g.slice_id for g in d.grants] == [session.id]
    # by default (debug_first off) the free GPU goes to b's request, first in fair share
    default = replace(policy, debug_first=False)
    d = schedule(snapshot(nodes(1), flat_tree("a", "b"), [held, batch, session], policy=default))
    assert batch.id in {g.slice_id for g in d.grants}
    # a session past the lane's per-user cap keeps its place in the queue behind b's
    second = running("a", "n0", (6,), kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN, user="x")
    first = replace(held, placements=(replace(held.placements[0], gpu_indices=tuple(range(6))),))
    capped = replace(policy, debug_max_gpus=1)
    d = schedule(
        snapshot(nodes(1), flat_tree("a", "b"), [first, second, batch, session], policy=capped)
    )
    assert batch.id in {g.slice_id for g in d.grants}
    assert session.id not in {g.slice_id for g in d.grants}


def test_a_victim_that_just_checkpointed_is_taken_before_one_with_hours_of_unsaved_work():
    # Two 4-GPU hog jobs past protection: the one granted later has less work since its
    # grant, unless the other reported a checkpoint since (design.md §5.3, victim_key 4)
    older = running("hog", "n0", (0, 1, 2, 3), min_runtime=HOUR, granted_ago=5 * HOUR)
    newer = running("hog", "n0", (4, 5, 6, 7), min_runtime=HOUR, granted_ago=3 * HOUR)
    request = pending("starving", 4)
    d = decide([older, newer, request])
    assert [p.slice_id for p in d.preemptions] == [newer.id]

    saved = replace(older, checkpointed_at=NOW - MIN)
    d = decide([saved, newer, request])
    assert [p.slice_id for p in d.preemptions] == [older.id]
    # a checkpoint before the grant (an earlier run's) saves nothing of this run
    stale = replace(older, checkpointed_at=NOW - 6 * HOUR)
    d = decide([stale, newer, request])
    assert [p.slice_id for p in d.preemptions] == [newer.id]


def test_a_pass_that_lets_a_request_wait_says_when_its_wait_ends():
    # The simulator leaves out passes before a quiet pass's ``until`` that nothing but
    # time separates from it: the end of the request's delay must bound it.
    policy = Policy(batch_preemption_delay=15 * MIN)
    hog, fresh = hog_and_starving(submitted_at=NOW - 5 * MIN)
    d = decide([*hog, fresh], policy=policy)
    assert d.deferred == (fresh.id,) and d.quiet is not None
    assert d.quiet.until == fresh.submitted_at + 15 * MIN
    assert decide([*hog, fresh], policy=policy, now=d.quiet.until - 1).preemptions == ()
    assert decide([*hog, fresh], policy=policy, now=d.quiet.until).preemptions != ()


def test_a_pass_says_when_a_holder_it_could_take_leaves_its_protection():
    # Both of hog's jobs are protected for 10 more minutes; the starving request has
    # waited long: the pass decides nothing until the first protection ends.
    hog, request = hog_and_starving(submitted_at=NOW - HOUR)
    young = [replace(s, granted_at=NOW - 50 * MIN) for s in hog]
    d = decide([*young, request])
    assert d.preemptions == () and d.quiet is not None
    assert d.quiet.until == NOW + 10 * MIN
    assert decide([*young, request], now=d.quiet.until).preemptions != ()
    # the protection of a holder whose project is under its share (a large one)
    # ends sooner, but the request may not take it: it bounds nothing
    accounts = [Account("hog"), Account("starving"), Account("large", 10.0)]
    under = running("large", "n1", tuple(range(8)), min_runtime=HOUR, granted_ago=55 * MIN)
    d = decide([*young, under, request], accounts=accounts)
    assert d.preemptions == () and d.quiet is not None
    assert d.quiet.until == NOW + 10 * MIN
