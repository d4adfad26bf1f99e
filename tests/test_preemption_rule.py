"""The one preemption rule and what derives from it (design.md §5.2–§5.3): fair share
now, the shortcuts that must agree with the rule, and no GPU left idle by a
preemption."""

from __future__ import annotations

import itertools
from dataclasses import replace

from builders import HOUR, MIN, NOW, flat_tree, nodes, pending, running, snapshot
from hypothesis import event, given, settings
from hypothesis import strategies as st

from broker.core.candidates import Candidates
from broker.core.fairshare import ProjectTree
from broker.core.model import (
    Account,
    EndReason,
    NodeState,
    Policy,
    PreemptReason,
    SliceKind,
    SliceState,
)
from broker.core.preemption import DebugLane, Preemptor, past_budget, preempt_reason
from broker.core.scheduler import schedule
from broker.core.standing import Standings
from broker.core.transitions import requeued

# ---- fair share now --------------------------------------------------------------------


def test_the_share_of_a_project_that_wants_nothing_goes_to_its_siblings_first():
    tree = ProjectTree(
        [
            Account("org1", 1.0),
            Account("org2", 1.0),
            Account("a", 1.0, "org1"),
            Account("b", 1.0, "org1"),
            Account("c", 1.0, "org2"),
        ]
    )
    both = Standings.now(tree, 16.0, wanting={"a", "b", "c"})
    assert (both.fair["a"], both.fair["b"], both.fair["c"]) == (4.0, 4.0, 8.0)
    # b wants nothing: its half of org1 goes to a, not across to org2.
    idle_b = Standings.now(tree, 16.0, wanting={"a", "c"})
    assert (idle_b.fair["a"], idle_b.fair["b"], idle_b.fair["c"]) == (8.0, 0.0, 8.0)
    # org2 wants nothing: the whole cluster is org1's.
    only_org1 = Standings.now(tree, 16.0, wanting={"a", "b"})
    assert (only_org1.fair["a"], only_org1.fair["b"], only_org1.fair["c"]) == (8.0, 8.0, 0.0)


def test_standing_is_gpus_held_over_fair_share_now():
    standings = Standings.now(ProjectTree(flat_tree("a", "b")), 16.0, wanting={"a", "b"})
    standings.record("a", 12.0)
    assert standings.standing("a") == 1.5
    assert standings.standing("b") == 0.0
    assert standings.standing("a", -4.0) == 1.0
    assert standings.over_share() == {"a"}


def test_whether_a_project_may_take_at_all_is_asked_again_once_holdings_move():
    standings = Standings.now(ProjectTree(flat_tree("a", "b")), 16.0, wanting={"a", "b"})
    standings.record("a", 8.0)
    assert not standings.may_take_at_all("b", "a")  # a holds its share, no more
    standings.record("a", 4.0)
    assert standings.may_take_at_all("b", "a")
    assert standings.may_take_at_all("b", "a") == standings.may_take("b", "a", 0.0, 0.0)


# Two organisations of unequal shares, with unequal siblings in one of them.
ORGS_TREE = ProjectTree(
    [Account(org, share) for org, share in (("org1", 1.0), ("org2", 2.0))]
    + [
        Account(project, share, org)
        for project, share, org in (
            ("a", 1.0, "org1"),
            ("b", 3.0, "org1"),
            ("c", 1.0, "org2"),
            ("d", 1.0, "org2"),
        )
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    held=st.dictionaries(st.sampled_from("abcd"), st.integers(0, 16), min_size=1),
    margin=st.sampled_from([0.0, 0.25, 1.0]),
    moved=st.tuples(st.sampled_from("abcd"), st.integers(-4, 4)),
)
def test_only_projects_above_their_share_may_ever_be_taken_from(held, margin, moved):
    """The victim search asks fair share only of the projects above their share:
    no other project may be taken from, however lenient the question, before and
    after the holdings move."""
    standings = Standings.now(ORGS_TREE, 32.0, wanting=set(held), margin=margin)
    for project, gpus in sorted(held.items()):
        standings.record(project, float(gpus))
    for _ in range(2):
        above = standings.above_share()
        assert above == {p for p in "abcd" if standings.standing(p) > 1.0}
        for mine, theirs, gang in itertools.product("abcd", "abcd", (False, True)):
            if standings.may_take_at_all(mine, theirs, gang):
                assert theirs in above
        standings.record(*moved)


def test_an_overshoot_must_narrow_the_gap():
    # Shares of 12 each: a holds 10 (0.83), b 15 (1.25). An 8-GPU request of a that
    # takes a 1-GPU job of b leaves a at 1.5 and b at 1.17: the gap narrows from
    # 0.42 to 0.33. With b at 14 (1.17) the same move would widen it from 0.33 to
    # 0.42, b still above its share after: refused.
    standings = Standings.now(ProjectTree(flat_tree("a", "b")), 24.0, wanting={"a", "b"})
    standings.record("a", 10.0)
    standings.record("b", 15.0)
    assert standings.may_take("a", "b", 8.0, 1.0)
    standings.record("b", -1.0)
    assert not standings.may_take("a", "b", 8.0, 1.0)


def test_a_partial_preemption_leaves_no_gpu_idle_while_work_waits():
    """A 1-GPU request takes a 4-GPU slice: its 3 other GPUs are promised, in the
    same pass, to the next pending work that fits them."""
    big = running("hog", "n0", (0, 1, 2, 3), granted_ago=2 * HOUR)
    rest = running("hog", "n0", (4, 5, 6, 7), granted_ago=MIN, min_runtime=4 * HOUR)
    debug = pending("starving", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN)
    three = pending("starving", 3, submitted_at=NOW - 5)
    d = schedule(snapshot(nodes(1), flat_tree("hog", "starving"), [big, rest, debug, three]))
    assert [(p.slice_id, p.for_slice) for p in d.preemptions] == [(big.id, debug.id)]
    promised = {r.slice_id: r for r in d.reservations if r.promised}
    assert set(promised) == {debug.id, three.id}
    gpus = [i for r in promised.values() for p in r.placements for i in p.gpu_indices]
    assert sorted(gpus) == [0, 1, 2, 3]  # every GPU the victim frees has a taker
    assert promised[three.id].due_at == d.preemptions[0].deadline
    assert d.grants == ()  # nothing runs on GPUs the victim still holds


# ---- the shortcuts agree with the rule ------------------------------------------------

PROJECTS = ("a", "b", "c")


@st.composite
def clusters(draw):
    """Two 8-GPU nodes filled with running slices of random projects, kinds and
    ages, and a random request."""
    slices = []
    for node in ("n0", "n1"):
        start = 0
        while start < 8:
            size = draw(st.integers(1, 8 - start))
            slices.append(
                running(
                    draw(st.sampled_from(PROJECTS)),
                    node,
                    tuple(range(start, start + size)),
                    granted_ago=draw(st.sampled_from([MIN, 2 * HOUR])),
                    min_runtime=draw(st.sampled_from([0.0, 15 * MIN, HOUR])),
                    kind=draw(st.sampled_from(list(SliceKind))),
                    priority=draw(st.integers(-1, 1)),
                    preemptions=draw(st.integers(0, 4)),  # around the budget of 3
                )
            )
            start += size
    requester = pending(
        draw(st.sampled_from(PROJECTS)),
        draw(st.integers(1, 8)),
        kind=draw(st.sampled_from(list(SliceKind))),
        min_runtime=draw(st.sampled_from([0.0, 15 * MIN, HOUR])),
        priority=draw(st.integers(-1, 1)),
    )
    return slices, requester


LANE_POLICY = Policy(debug_lane_fraction=0.25)  # a lane of 4 GPUs: debug sessions get in


def preemptor_for(
    slices, requester, policy: Policy = LANE_POLICY, margin: float = 0.0
) -> Preemptor:
    tree = ProjectTree(flat_tree(*PROJECTS))
    wanting = {s.project for s in slices if s.allocated}
    if requester.allocated:
        wanting.add(requester.project)
    standings = Standings.now(tree, 16.0, wanting, margin=margin)
    lane = DebugLane.for_cluster(16, policy)
    for s in slices:
        if s.allocated:
            standings.record(s.project, float(s.gpus))
        if s.kind is SliceKind.INTERACTIVE and s.allocated and s.gpus <= policy.debug_max_gpus:
            lane.record(s)
    return Preemptor(
        now=NOW,
        policy=policy,
        standings=standings,
        lane=lane,
        nodes={n.name: n for n in nodes(2)},
        weights={},
        candidates=Candidates.of(slices, NOW, policy),
    )


def rule_says(preemptor: Preemptor, requester, victim) -> PreemptReason | None:
    """The one preemption rule, asked with the preemptor's state and nothing moved."""
    return preempt_reason(
        requester,
        victim,
        now=NOW,
        policy=preemptor.policy,
        standings=preemptor.standings,
        lane=preemptor.lane,
        weight=1.0,
    )


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_hopeless_only_when_the_rule_refuses_every_candidate(cluster):
    slices, requester = cluster
    preemptor = preemptor_for(slices, requester)
    reasons = {
        s.id: rule_says(preemptor, requester, s) for s in preemptor.candidates.slices.values()
    }
    hopeless = preemptor.hopeless(requester)
    event(f"hopeless={hopeless}")
    for reason in set(reasons.values()) - {None}:
        event(f"reason={reason.value}")
    if hopeless:
        assert set(reasons.values()) <= {None}


MARGIN = st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0])


@settings(max_examples=200, deadline=None)
@given(clusters(), st.floats(0, 16), st.floats(0, 16), st.floats(0, 8), st.floats(0, 8), MARGIN)
def test_fair_share_only_gets_harder_as_more_moves(
    cluster, gained, lost, more_gained, more_lost, margin
):
    """The shortcuts ask the rule with nothing moved: sound only if it is monotone,
    with a fair-share margin as without."""
    slices, requester = cluster
    standings = preemptor_for(slices, requester, margin=margin).standings
    for theirs in PROJECTS:
        harder = standings.may_take(
            requester.project, theirs, gained + more_gained, lost + more_lost
        )
        if harder:
            assert standings.may_take(requester.project, theirs, gained, lost)
            assert standings.may_take(requester.project, theirs, 0.0, 0.0)


@settings(max_examples=200, deadline=None)
@given(clusters(), st.integers(0, 8), st.integers(0, 4), st.sampled_from([0.25, 0.5, 1.0]))
def test_a_margin_only_holds_back_requests_smaller_than_it(cluster, gained, lost, margin):
    """A request that moves its project by the margin or more is judged as without one,
    but for an overshoot, which must narrow the gap by more than the margin; a
    smaller one is judged as if it moved it by the margin, never more leniently."""
    slices, requester = cluster
    plain = preemptor_for(slices, requester).standings
    held_back = preemptor_for(slices, requester, margin=margin).standings
    mine = requester.project
    step = plain.standing(mine, gained) - plain.standing(mine)
    for theirs in PROJECTS:
        with_margin = held_back.may_take(mine, theirs, gained, lost)
        if step >= margin:
            event(f"a step of the margin or more, allowed={with_margin}")
            overshoots = plain.standing(mine, gained) > plain.standing(theirs, -lost)
            if not overshoots:
                assert with_margin == plain.may_take(mine, theirs, gained, lost)
            elif with_margin:
                assert plain.may_take(mine, theirs, gained, lost)
        elif with_margin:
            gained_margin = margin * plain.fair[mine]
            assert plain.may_take(mine, theirs, max(gained, gained_margin), lost)


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_every_victim_the_search_picks_is_one_the_rule_allows(cluster):
    slices, requester = cluster
    preemptor = preemptor_for(slices, requester)
    found = preemptor.find(requester, {})
    if found is None:
        return
    event(f"victims={len(found.victims)}")
    for taken, (victim, reason) in enumerate(found.victims):
        # The rule itself, asked with nothing moved yet: it gives the first victim's
        # reason exactly, and allows every later one (it only gets harder as GPUs move).
        allowed = rule_says(preemptor, requester, victim)
        assert allowed is not None
        if taken == 0:
            assert allowed is reason
        assert not (victim.allocated and victim.is_protected(NOW))
        assert not past_budget(victim, preemptor.policy)
        if reason is PreemptReason.UNALLOCATED:
            assert not victim.allocated
        if reason is PreemptReason.FAIR_SHARE:
            assert victim.project != requester.project


def test_each_preemption_protects_the_jobs_next_run_longer_up_to_the_cap():
    policy = Policy(max_min_runtime=4 * HOUR)  # preemption_backoff 2 by default
    protected = []
    job = running("a", "n0", tuple(range(8)), min_runtime=HOUR, resumable=True)
    for _ in range(4):
        leaving = replace(job, state=SliceState.PREEMPTING, preempt_deadline=NOW)
        d = schedule(snapshot(nodes(1), flat_tree("a", "b"), [leaving], policy=policy))
        (ending,) = d.endings
        assert (ending.reason, ending.requeue) == (EndReason.PREEMPTED, True)
        protected.append(ending.protect_next)
        job = replace(job, contract=replace(job.contract, min_runtime=ending.protect_next))
    # doubled each time, never past max_min_runtime, so that drains still end in time
    assert protected == [2 * HOUR, 4 * HOUR, 4 * HOUR, 4 * HOUR]
    assert requeued(job, NOW, ending.protect_next).contract.min_runtime == 4 * HOUR


def test_a_node_going_down_and_free_work_keep_their_protection():
    down = running("a", "n0", (0,), min_runtime=HOUR, resumable=True)
    free = running("a", "n1", (0,), min_runtime=0.0, resumable=True)
    free = replace(free, state=SliceState.PREEMPTING, preempt_deadline=NOW)
    cluster = [replace(n, state=NodeState.DOWN) if n.name == "n0" else n for n in nodes(2)]
    d = schedule(snapshot(cluster, flat_tree("a"), [down, free]))
    assert {e.slice_id: e.protect_next for e in d.endings} == {down.id: None, free.id: None}


def test_the_pass_requeues_a_preempted_job_with_its_longer_protection():
    leaving = running("a", "n0", tuple(range(8)), min_runtime=HOUR, resumable=True)
    leaving = replace(leaving, state=SliceState.PREEMPTING, preempt_deadline=NOW)
    d = schedule(snapshot(nodes(1), flat_tree("a", "b"), [leaving]))
    assert [(e.slice_id, e.requeue) for e in d.endings] == [(leaving.id, True)]
    (grant,) = d.grants  # granted again at once: the cluster is free
    assert grant.slice_id == leaving.id


def test_a_backoff_of_one_keeps_the_protection_as_it_was():
    job = running("a", "n0", tuple(range(8)), min_runtime=HOUR, resumable=True)
    leaving = replace(job, state=SliceState.PREEMPTING, preempt_deadline=NOW)
    policy = Policy(preemption_backoff=1.0)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [leaving], policy=policy))
    assert [e.protect_next for e in d.endings] == [HOUR]
