"""Each rule of design.md §4–§6 on small hand-built clusters."""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

import pytest
from builders import HOUR, MIN, NOW, flat_tree, nodes, pending, running, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.candidates import Candidates
from broker.core.fairshare import ProjectTree
from broker.core.incremental import PassState
from broker.core.model import (
    Account,
    Decisions,
    EndReason,
    Node,
    NodeState,
    Placement,
    Policy,
    PreemptReason,
    Queue,
    QueueEntry,
    SliceKind,
    SliceState,
)
from broker.core.ordering import queue_order
from broker.core.preemption import DebugLane, Preemptor
from broker.core.scheduler import schedule
from broker.core.standing import Standings


def granted_ids(decisions):
    return {g.slice_id for g in decisions.grants}


def preempted(decisions):
    return {p.slice_id: p.reason for p in decisions.preemptions}


def test_a_pass_s_queue_reads_as_its_entries_and_equals_them():
    """The pass keeps its queue as plain rows (model.Queue); whoever reads it gets
    QueueEntry values, and it equals the same entries in any sequence."""
    busy = running("a", "n0", tuple(range(8)), granted_ago=60)  # protected
    waiting = pending("b", 8)
    queue = schedule(snapshot(nodes(1), flat_tree("a", "b"), [busy, waiting])).queue
    assert isinstance(queue, Queue) and len(queue) == 1
    entry = queue[0]
    assert type(entry) is QueueEntry and entry[:2] == (waiting.id, 1)
    assert entry.slice_id == waiting.id and entry.position == 1
    assert list(queue) == [entry] and queue[:1] == (entry,)
    assert queue == (entry,) and (entry,) == queue
    assert queue != (entry._replace(position=2),) and queue != (entry, entry)
    # decisions with it hash and compare as decisions with a tuple of its entries
    decisions = Decisions(queue=queue)
    assert decisions == Decisions(queue=(entry,))
    assert hash(decisions) == hash(Decisions(queue=(entry,)))
    assert queue != () and Queue([(1, 1, 0.5, None)]) == Queue([(1, 1, 0.5, None)])


def test_the_stretch_a_pass_passes_over_reads_as_one_entry_per_slice_in_order():
    """A blocked stretch of a project's queue is kept as one part (model.QueueStretch)
    and read as the entries a walk of it one by one would have made."""
    busy = running("a", "n0", tuple(range(8)), granted_ago=60)  # protected
    waiting = [pending("b", 8, submitted_at=NOW - 100 + k) for k in range(5)]
    policy = Policy(max_reservations=0)
    snap = snapshot(nodes(1), flat_tree("a", "b"), [busy, *waiting], policy=policy)
    queue = schedule(snap).queue
    assert isinstance(queue, Queue)
    assert [e[:2] for e in queue] == [(s.id, position) for position, s in enumerate(waiting, 1)]
    assert {e.estimated_start for e in queue} == {None}
    assert len({e.fairshare_value for e in queue}) == 1
    assert queue[3] == tuple(queue)[3] and queue[1:3] == tuple(queue)[1:3]
    assert hash(Decisions(queue=queue)) == hash(Decisions(queue=tuple(queue)))


# ---- fair-share order ---------------------------------------------------


def test_entitlement_is_the_product_of_share_fractions_down_the_path():
    tree = ProjectTree(
        [
            Account("org"),
            Account("A", 7, "org"),
            Account("B", 3, "org"),
            Account("A1", 1, "A"),
            Account("A2", 1, "A"),
        ]
    )
    assert tree.entitlements["A1"] == pytest.approx(0.35)
    assert tree.entitlements["B"] == pytest.approx(0.3)


def test_lower_usage_per_entitlement_goes_first_even_if_submitted_later():
    busy = pending("busy", 8, submitted_at=NOW - 100)
    idle = pending("idle", 8, submitted_at=NOW - 1)
    d = schedule(
        snapshot(nodes(1), flat_tree("busy", "idle"), [busy, idle], usage={"busy": 1000.0})
    )
    assert granted_ids(d) == {idle.id}
    assert [q.slice_id for q in d.queue] == [busy.id]


def test_ranking_is_top_down_a_heavy_subtree_ranks_below_its_sibling():
    accounts = [
        Account("left"),
        Account("right"),
        Account("l1", 1, "left"),
        Account("l2", 1, "left"),
        Account("r1", 1, "right"),
    ]
    tree = ProjectTree(accounts)
    # l2 alone is unused, but its parent "left" is over-served as a whole.
    order = tree.project_order({"l1": 900.0, "l2": 0.0, "r1": 300.0})
    assert order == ["r1", "l2", "l1"]


def test_priority_only_sorts_within_a_project():
    low_usage_low_prio = pending("a", 8, priority=-5)
    high_usage_high_prio = pending("b", 8, priority=50)
    d = schedule(
        snapshot(
            nodes(1),
            flat_tree("a", "b"),
            [low_usage_low_prio, high_usage_high_prio],
            usage={"b": 10.0},
        )
    )
    assert granted_ids(d) == {low_usage_low_prio.id}


def test_within_a_project_higher_priority_then_interactive_then_submit_time():
    first = pending("a", 8, priority=1, submitted_at=NOW - 1)
    interactive = pending("a", 8, kind=SliceKind.INTERACTIVE, submitted_at=NOW - 5)
    batch = pending("a", 8, submitted_at=NOW - 50)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [batch, interactive, first]))
    assert granted_ids(d) == {first.id}
    assert [q.slice_id for q in d.queue] == [interactive.id, batch.id]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from([0.0, HOUR]),  # min_runtime: unallocated or allocated
            st.integers(-2, 2),  # priority
            st.sampled_from(list(SliceKind)),
            st.sampled_from([NOW - 30, NOW - 20, NOW - 10]),
        ),
        max_size=30,
    ),
    st.permutations(["a", "b", "c"]),
)
def test_queue_order_sorts_by_its_five_criteria(traits, ranked):
    backlog = [
        pending(p, min_runtime=m, priority=pr, kind=k, submitted_at=t, id=i)
        for i, (p, m, pr, k, t) in enumerate(traits, start=1)
    ]
    rank = {name: r for r, name in enumerate(ranked)}
    ordered = queue_order(reversed(backlog), rank)
    assert ordered == sorted(
        backlog,
        key=lambda s: (
            not s.allocated,
            rank[s.project],
            -s.priority,
            s.kind is SliceKind.BATCH,
            s.submitted_at,
            s.id,
        ),
    )


def test_a_slice_requeued_in_a_pass_comes_in_that_pass_at_its_place_in_the_queue():
    """The pass that requeues a slice (its grace over) queues it where its
    submission puts it: ahead of its project's later requests, not behind them,
    so the GPUs it gave back go to it first."""
    held = running("b", "n0", tuple(range(8)), granted_ago=HOUR / 2)  # protected
    leaving = running("a", "n1", tuple(range(8)), resumable=True, submitted_at=NOW - 3 * HOUR)
    leaving = replace(leaving, state=SliceState.PREEMPTING, preempt_deadline=NOW)
    earlier = pending("a", 8, submitted_at=NOW - 2 * HOUR)
    later = pending("a", 8, submitted_at=NOW - HOUR)
    tree = flat_tree("a", "b")
    decisions = schedule(snapshot(nodes(2), tree, [held, later, leaving, earlier]))
    assert [e.slice_id for e in decisions.endings] == [leaving.id]
    assert [g.slice_id for g in decisions.grants] == [leaving.id]
    assert [e.slice_id for e in decisions.queue] == [earlier.id, later.id]


# ---- placement -----------------------------------------------------------


def test_placement_prefers_the_fullest_node_that_fits_keeping_whole_nodes_free():
    busy = running("a", "n1", (0, 1, 2, 3, 4, 5))
    request = pending("a", 2)
    d = schedule(snapshot(nodes(3), flat_tree("a"), [busy, request]))
    assert d.grants[0].placements == (Placement("n1", (6, 7)),)


def test_gang_slice_takes_whole_nodes_all_or_nothing():
    big = pending("a", 16)
    d = schedule(snapshot(nodes(3), flat_tree("a"), [big]))
    assert [p.node for p in d.grants[0].placements] == ["n0", "n1"]
    partly_busy = running("b", "n0", (0,))
    d = schedule(snapshot(nodes(2), flat_tree("a", "b"), [partly_busy, replace(big, id=99)]))
    assert d.grants == ()


def test_interactive_slice_never_spans_nodes():
    wide = pending("a", 12, kind=SliceKind.INTERACTIVE)
    d = schedule(snapshot(nodes(2), flat_tree("a"), [wide]))
    assert d.grants == ()


def test_requested_gpu_type_is_honoured_and_any_type_prefers_the_cheaper():
    inventory = [Node("h", "h100", 8), Node("b", "b200", 8)]
    want_b200 = pending("a", 1, gpu_type="b200")
    any_type = pending("a", 1)
    for request, node in [(want_b200, "b"), (any_type, "h")]:
        d = schedule(snapshot(inventory, flat_tree("a"), [request], weights={"b200": 2.0}))
        assert d.grants[0].placements[0].node == node


# ---- contracts and preemption -------------------------------------------


def test_protected_slice_is_never_preempted_even_for_a_far_better_ranked_project():
    hog = running("hog", "n0", tuple(range(8)), granted_ago=10 * MIN, min_runtime=HOUR)
    starving = pending("starving", 8, min_runtime=HOUR)
    d = schedule(
        snapshot(nodes(1), flat_tree("hog", "starving"), [hog, starving], usage={"hog": 1e9})
    )
    assert d.preemptions == ()
    assert d.grants == ()


def test_past_protection_slice_of_an_over_served_project_is_preempted_with_grace():
    # hog holds all 8 GPUs against a fair share of 4: a request of starving's
    # fair share (4 GPUs) may take one of its two jobs, which leaves both at
    # their share; one of 8 could not (design.md §5.2).
    hog = running("hog", "n0", (0, 1, 2, 3), granted_ago=2 * HOUR, min_runtime=HOUR)
    rest = running("hog", "n0", (4, 5, 6, 7), granted_ago=MIN, min_runtime=HOUR)
    starving = pending("starving", 4, min_runtime=HOUR)
    policy = Policy(grace_period=90)
    d = schedule(
        snapshot(
            nodes(1),
            flat_tree("hog", "starving"),
            [hog, rest, starving],
            usage={"hog": 1e6},
            policy=policy,
        )
    )
    (p,) = d.preemptions
    assert (p.slice_id, p.reason, p.deadline, p.for_slice) == (
        hog.id,
        PreemptReason.FAIR_SHARE,
        NOW + 90,
        starving.id,
    )
    # the GPUs are promised to the requester, not granted to anyone else meanwhile
    (r,) = d.reservations
    assert r.promised and r.slice_id == starving.id and r.placements[0].node == "n0"


def test_promised_gpus_go_to_the_requester_once_the_grace_period_ends():
    hog = running("hog", "n0", tuple(range(8)), granted_ago=2 * HOUR)
    hog = replace(hog, state=SliceState.PREEMPTING, preempt_deadline=NOW + 30)
    requester = replace(pending("starving", 8), promised=(Placement("n0", tuple(range(8))),))
    other = pending("third", 8)  # better ranked, but the GPUs are promised
    accounts = flat_tree("hog", "starving", "third")
    usage = {"hog": 1e6, "starving": 10.0}
    d = schedule(snapshot(nodes(1), accounts, [hog, requester, other], usage=usage))
    assert d.grants == () and d.reservations[0].promised
    later = snapshot(nodes(1), accounts, [hog, requester, other], usage=usage, now=NOW + 30)
    d = schedule(later)
    assert [e.slice_id for e in d.endings] == [hog.id]
    assert granted_ids(d) == {requester.id}


@pytest.mark.parametrize(
    "now_the_node",
    [
        pytest.param({"gpu_type": "b200"}, id="of another GPU type"),
        pytest.param({"gpu_count": 4}, id="with fewer GPUs"),
    ],
)
def test_a_promise_is_not_kept_on_a_node_an_admin_changed_under_it(now_the_node):
    """A promise made on an h100 node is not granted once the node's GPU type (or
    count) changed: the request queues again and goes where it fits."""
    requester = replace(
        pending("starving", 8, gpu_type="h100"), promised=(Placement("n0", tuple(range(8))),)
    )
    changed = replace(nodes(1)[0], **now_the_node)
    spare = nodes(1, prefix="m")[0]  # an h100 node with 8 free GPUs
    d = schedule(snapshot([changed, spare], flat_tree("starving"), [requester]))
    assert [(g.slice_id, g.placements[0].node) for g in d.grants] == [(requester.id, "m0")]


def test_debug_slice_of_under_used_project_preempts_past_protection_batch_of_over_used():
    batch = running("heavy", "n0", (0, 1, 2, 3), granted_ago=3 * HOUR, min_runtime=HOUR)
    more = running("heavy", "n0", (4, 5, 6, 7), granted_ago=3 * HOUR, min_runtime=4 * HOUR)
    debug = pending("light", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN)
    d = schedule(
        snapshot(nodes(1), flat_tree("heavy", "light"), [batch, more, debug], usage={"heavy": 1e6})
    )
    assert preempted(d) == {batch.id: PreemptReason.FAIR_SHARE}


def test_a_single_large_victim_is_left_alone_by_fair_share_but_not_by_the_debug_lane():
    # Taking all 8 of heavy's GPUs for 1 would leave light above heavy: fair
    # share refuses, and only a debug session may take them.
    batch = running("heavy", "n0", tuple(range(8)), granted_ago=3 * HOUR, min_runtime=HOUR)
    work = pending("light", 1, min_runtime=HOUR)
    debug = pending("light", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN)
    d = schedule(snapshot(nodes(1), flat_tree("heavy", "light"), [batch, work]))
    assert d.preemptions == ()
    d = schedule(snapshot(nodes(1), flat_tree("heavy", "light"), [batch, debug]))
    assert preempted(d) == {batch.id: PreemptReason.DEBUG_LANE}


def heavy_holds(node: str = "n1"):
    """heavy's protected work on a whole node: with light on the other, both hold
    their fair share now, so fair share moves nothing between them."""
    return running("heavy", node, tuple(range(8)), granted_ago=MIN, min_runtime=4 * HOUR)


def test_debug_lane_lets_a_short_session_through_even_from_an_over_served_project():
    batch = running("light", "n0", tuple(range(8)), granted_ago=3 * HOUR)
    debug = pending("heavy", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN)
    d = schedule(snapshot(nodes(2), flat_tree("heavy", "light"), [heavy_holds(), batch, debug]))
    assert preempted(d) == {batch.id: PreemptReason.DEBUG_LANE}


@pytest.mark.parametrize(
    "debug",
    [
        pytest.param(
            pending("heavy", 1, kind=SliceKind.INTERACTIVE, min_runtime=HOUR),
            id="a contract longer than the debug limit is not debugging",
        ),
        pytest.param(
            pending("heavy", 4, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN),
            id="more GPUs than the debug limit is not debugging",
        ),
        pytest.param(
            pending("heavy", 1, min_runtime=15 * MIN),
            id="batch work has no debug lane",
        ),
    ],
)
def test_the_debug_lane_is_only_for_small_short_interactive_sessions(debug):
    batch = running("light", "n0", tuple(range(8)), granted_ago=3 * HOUR)
    d = schedule(snapshot(nodes(2), flat_tree("heavy", "light"), [heavy_holds(), batch, debug]))
    assert d.preemptions == ()


def test_debug_headroom_keeps_free_gpus_from_other_work_for_debug_sessions():
    policy = Policy(debug_headroom=2, debug_lane_fraction=0.5)  # a lane of 4 GPUs
    held = running("a", "n0", (0, 1, 2, 3, 4))  # 3 of 8 GPUs free
    two = pending("a", 2, submitted_at=NOW - 30)
    one = pending("a", 1, submitted_at=NOW - 20)
    free = pending("a", 1, min_runtime=0, submitted_at=NOW - 10)  # unallocated
    debug = pending("b", 2, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN)
    d = schedule(snapshot(nodes(1), flat_tree("a", "b"), [held, two, one, free], policy=policy))
    assert granted_ids(d) == {one.id}  # 2 GPUs would leave 1 free; 1 GPU leaves 2

    d = schedule(snapshot(nodes(1), flat_tree("a", "b"), [held, two, debug], policy=policy))
    assert granted_ids(d) == {debug.id}  # the debug session takes what is kept for it

    d = schedule(snapshot(nodes(1), flat_tree("a", "b"), [held, two, one, free]))
    assert granted_ids(d) == {two.id, one.id}  # without headroom every GPU goes


def test_debug_headroom_is_for_sessions_within_the_lanes_limits():
    # u already holds the lane's per-user limit (2 GPUs): a third debug GPU of
    # theirs is not debug work the headroom is kept for.
    policy = Policy(debug_headroom=2, debug_lane_fraction=0.5)  # a lane of 4 GPUs
    session = running("b", "n0", (0, 1), kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN)
    held = running("a", "n0", (2, 3, 4, 5))
    again = pending("b", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN)
    other = pending("b", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN, user="v")
    d = schedule(snapshot(nodes(1), flat_tree("a", "b"), [session, held, again], policy=policy))
    assert granted_ids(d) == set()
    d = schedule(snapshot(nodes(1), flat_tree("a", "b"), [session, held, other], policy=policy))
    assert granted_ids(d) == {other.id}
    # Behind two held-back sessions of u with the same shape, v's still gets through.
    later = pending("b", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN, submitted_at=NOW)
    busy = replace(policy, max_reservations=0)
    queue = [session, held, again, replace(again, id=later.id + 1), later]
    d = schedule(snapshot(nodes(1), flat_tree("a", "b"), queue, policy=busy))
    assert granted_ids(d) == set()  # later is u's too
    queue[-1] = replace(later, user="v")
    d = schedule(snapshot(nodes(1), flat_tree("a", "b"), queue, policy=busy))
    assert granted_ids(d) == {later.id}


def test_work_borrowing_reserved_gpus_leaves_the_debug_headroom_alone():
    # n0 is reserved for `large` until its holder ends; n1's one free GPU is the
    # headroom kept for debug sessions. Work that fits on n0's lent GPUs may
    # borrow them whatever the headroom, since it takes no free GPU: when the
    # free GPUs are fewer than the headroom (two), and when best fit would
    # rather have taken the free GPU (one).
    holder = running("a", "n0", (0, 1), granted_ago=0, min_runtime=8 * HOUR, max_runtime=9 * HOUR)
    busy = running("a", "n1", (0, 1, 2), granted_ago=0, min_runtime=8 * HOUR)
    large = pending("b", 4)
    one = pending("c", 1, min_runtime=0)
    two = pending("c", 2, min_runtime=0)
    for headroom, request in ((2, two), (1, one)):
        d = schedule(
            snapshot(
                nodes(2, gpus=4),
                flat_tree("a", "b", "c"),
                [holder, busy, large, request],
                policy=Policy(debug_headroom=headroom),
            )
        )
        assert [r.slice_id for r in d.reservations] == [large.id]
        (grant,) = d.grants
        assert grant.slice_id == request.id
        assert [p.node for p in grant.placements] == ["n0"]


def test_debug_lane_is_capped_by_its_share_of_the_cluster():
    # 4 nodes x 8 GPUs at 3% -> one GPU of lane; one debug session already holds it.
    # heavy holds 17 GPUs against light's 15: fair share moves nothing to heavy.
    holding = running(
        "heavy", "n1", (0,), kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN, granted_ago=MIN
    )
    batch = running("light", "n0", tuple(range(8)), granted_ago=3 * HOUR)
    filler = running("light", "n1", tuple(range(1, 8)), granted_ago=3 * HOUR, min_runtime=4 * HOUR)
    debug = pending("heavy", 1, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN, user="v")
    slices = [heavy_holds("n2"), heavy_holds("n3"), holding, batch, filler, debug]
    policy = Policy(debug_lane_fraction=0.03)
    d = schedule(snapshot(nodes(4), flat_tree("heavy", "light"), slices, policy=policy))
    assert d.preemptions == ()
    wider = Policy(debug_lane_fraction=0.06)  # two GPUs of lane: the session gets through
    d = schedule(snapshot(nodes(4), flat_tree("heavy", "light"), slices, policy=wider))
    assert preempted(d) == {batch.id: PreemptReason.DEBUG_LANE}


def test_within_a_project_an_interactive_session_preempts_its_own_batch_work():
    batch = running("a", "n0", tuple(range(8)), granted_ago=2 * HOUR)
    notebook = pending("a", 1, kind=SliceKind.INTERACTIVE, min_runtime=HOUR)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [batch, notebook]))
    assert preempted(d) == {batch.id: PreemptReason.PRIORITY}


def test_within_a_project_equal_rank_work_does_not_preempt():
    batch = running("a", "n0", tuple(range(8)), granted_ago=2 * HOUR)
    more_batch = pending("a", 1)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [batch, more_batch]))
    assert d.preemptions == ()


def test_unallocated_slice_is_preempted_by_any_allocated_request():
    free_rider = running("best", "n0", tuple(range(8)), granted_ago=MIN, min_runtime=0)
    request = pending("worst", 2, min_runtime=HOUR)
    d = schedule(
        snapshot(nodes(1), flat_tree("best", "worst"), [free_rider, request], usage={"worst": 1e9})
    )
    assert preempted(d) == {free_rider.id: PreemptReason.UNALLOCATED}


def test_unallocated_work_only_fills_gpus_that_allocated_work_does_not_want():
    free_work = pending("a", 8, min_runtime=0, submitted_at=NOW - 500)
    paid_work = pending("z", 4, submitted_at=NOW - 1)
    d = schedule(snapshot(nodes(1), flat_tree("a", "z"), [free_work, paid_work], usage={"z": 1e6}))
    assert granted_ids(d) == {paid_work.id}
    small_free = pending("a", 4, min_runtime=0)
    d = schedule(snapshot(nodes(1), flat_tree("a", "z"), [small_free, paid_work]))
    assert granted_ids(d) == {small_free.id, paid_work.id}


def test_victims_are_the_fewest_and_least_harmful():
    protected = running("c", "n0", (0, 1), granted_ago=MIN)
    older = running("c", "n0", (2, 3), granted_ago=5 * HOUR)
    newer = running("c", "n0", (4, 5), granted_ago=2 * HOUR)
    free_rider = running("c", "n0", (6,), min_runtime=0, granted_ago=MIN)
    idle_gpu = running("c", "n0", (7,), granted_ago=3 * HOUR)
    request = pending("a", 3)
    d = schedule(
        snapshot(
            nodes(1),
            flat_tree("a", "c"),
            [protected, older, newer, free_rider, idle_gpu, request],
            usage={"c": 1e6},
        )
    )
    # Taken in order until 3 GPUs are free: the free rider, the 1-GPU slice, then the pair
    # granted last (least work lost). The 1-GPU slice is then not needed and is put back.
    assert preempted(d) == {
        free_rider.id: PreemptReason.UNALLOCATED,
        newer.id: PreemptReason.FAIR_SHARE,
    }


def test_two_projects_at_their_fair_share_never_preempt_each_other_whatever_their_window():
    """Fair share now, not the window, decides who may take running GPUs: A and B
    each hold their half, so neither takes from the other, however far apart
    their 7-day usage is (the window still orders who is served first)."""
    a_running = running("A", "n0", tuple(range(8)), granted_ago=2 * HOUR)
    b_running = running("B", "n1", tuple(range(8)), granted_ago=2 * HOUR)
    for a_usage, b_usage in [(0.0, 1e7), (1e7, 0.0), (5e5, 5e5 + 1)]:
        usage = {"A": a_usage, "B": b_usage}
        for request in (pending("A", 1), pending("B", 1), pending("A", 8), pending("B", 8)):
            d = schedule(
                snapshot(
                    nodes(2), flat_tree("A", "B"), [a_running, b_running, request], usage=usage
                )
            )
            assert d.preemptions == (), (usage, request.project, request.gpus)


def test_a_fair_share_move_never_goes_back():
    """After A takes GPUs from B, B cannot take them back: the move leaves A at or
    below B's standing, and B's request would put it above A's."""
    b_first = running("B", "n0", tuple(range(4)), granted_ago=2 * HOUR)
    b_second = running("B", "n0", tuple(range(4, 8)), granted_ago=2 * HOUR)
    a_request = pending("A", 4)
    d = schedule(snapshot(nodes(1), flat_tree("A", "B"), [b_first, b_second, a_request]))
    (victim,) = preempted(d)
    assert victim in {b_first.id, b_second.id}
    # A now runs the 4 GPUs past protection; B asks for them again.
    kept = b_second if victim == b_first.id else b_first
    a_running = running("A", "n0", tuple(range(4)) if victim == b_first.id else tuple(range(4, 8)))
    a_running = replace(a_running, granted_at=NOW - 2 * HOUR)
    b_again = pending("B", 4)
    d = schedule(snapshot(nodes(1), flat_tree("A", "B"), [a_running, kept, b_again]))
    assert d.preemptions == ()


# ---- ends of contracts ---------------------------------------------------


def test_max_runtime_ends_a_slice_with_reason_expired():
    capped = running("a", "n0", (0,), granted_ago=HOUR, max_runtime=HOUR)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [capped]))
    assert [(e.slice_id, e.reason) for e in d.endings] == [(capped.id, EndReason.EXPIRED)]


def test_a_slice_whose_lease_ran_out_is_lost_and_its_gpus_are_reused_at_once():
    lost = replace(running("a", "n0", tuple(range(8))), lease_expires_at=NOW - 1)
    waiting = pending("a", 8)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [lost, waiting]))
    assert [(e.slice_id, e.reason) for e in d.endings] == [(lost.id, EndReason.LOST)]
    assert granted_ids(d) == {waiting.id}


def test_the_lapse_limit_ends_the_longest_lapsed_first_and_holds_the_rest():
    """Many leases over at once are more often the broker's trouble than many holders
    gone: a minute ends at most the larger of ``lease_lapse_floor`` and
    ``lease_lapse_fraction`` of the leased slices, those lapsed longest first."""
    holders = [
        replace(running("a", f"n{i // 8}", (i % 8,)), lease_expires_at=NOW + 60) for i in range(40)
    ]
    for k in range(6):  # six lapsed, the sixth longest ago
        holders[k] = replace(holders[k], lease_expires_at=NOW - 1 - k)
    ids = [h.id for h in holders]

    def lapses(policy: Policy, already: int = 0, index: PassState | None = None, now=NOW):
        snap = replace(
            snapshot(nodes(5), flat_tree("a"), holders, policy=policy, now=now),
            lapsed_last_minute=already,
        )
        d = schedule(snap, index=index)
        lost = {e.slice_id for e in d.endings if e.reason is EndReason.LOST}
        return lost, set(d.lapses_held), d.quiet

    # a tenth of 40 leased slices is 4 a minute, more than the floor of 3
    limit = Policy(lease_lapse_floor=3, lease_lapse_fraction=0.1)
    assert lapses(limit) == (set(ids[2:6]), set(ids[:2]), None)
    assert lapses(limit, already=3) == ({ids[5]}, set(ids[:5]), None)
    floor = Policy(lease_lapse_floor=3, lease_lapse_fraction=0.0)
    assert lapses(floor) == (set(ids[3:6]), set(ids[:3]), None)
    assert lapses(Policy())[:2] == (set(ids[:6]), set()), "six are within the floor of 10"
    # A long-running caller's index: a pass that held lapses back is not quiet, so
    # the next one walks them again rather than resuming, and ends them when it may.
    kept = PassState()
    assert lapses(Policy(), already=10, index=kept) == (set(), set(ids[:6]), None)
    assert lapses(Policy(), already=10, index=kept, now=NOW + 1)[1] == set(ids[:6])
    assert lapses(Policy(), already=0, index=kept, now=NOW + 2)[0] == set(ids[:6])


def test_the_lapse_limit_counts_the_leased_slices_as_the_pass_found_them():
    # A resumable job on a node gone down is requeued by the same pass, its lease
    # cleared: it still counts towards the limit the lapsed are judged by (four
    # leased, half of them a minute: two, one of them taken already).
    down = replace(
        running("a", "n0", (0,), resumable=True, kind=SliceKind.BATCH), lease_expires_at=NOW + 60
    )
    calm = replace(running("a", "n1", (0,)), lease_expires_at=NOW + 60)
    first, second = (
        replace(running("a", "n1", (gpu,)), lease_expires_at=NOW - 1) for gpu in (1, 2)
    )
    cluster = [replace(nodes(1)[0], state=NodeState.DOWN), *nodes(2)[1:]]
    policy = Policy(lease_lapse_floor=1, lease_lapse_fraction=0.5)
    snap = replace(
        snapshot(cluster, flat_tree("a"), [down, calm, first, second], policy=policy),
        lapsed_last_minute=1,
    )
    d = schedule(snap)
    assert {(e.slice_id, e.reason) for e in d.endings} == {
        (down.id, EndReason.NODE_DOWN),
        (first.id, EndReason.LOST),
    }
    assert d.lapses_held == (second.id,)


def test_a_lease_does_not_run_out_over_the_time_the_broker_answered_heartbeats_late():
    """A lease counts only the time the broker answered heartbeats on time: one that
    ran out by no more than the time it answered late since the holder's last
    heartbeat is kept for a later pass (design.md §8)."""
    lease = 120.0
    # Leases over 10, 50 and 80 s ago: heartbeated last at NOW - 130, - 170, - 200.
    a, b, c = (
        replace(running("a", "n0", (gpu,)), lease_expires_at=NOW - over)
        for gpu, over in ((0, 10), (1, 50), (2, 80))
    )

    def decided(*late: tuple[float, float]):
        snap = replace(
            snapshot(nodes(1), flat_tree("a"), [a, b, c]), answered_late=late, lease=lease
        )
        d = schedule(snap)
        lost = {e.slice_id for e in d.endings if e.reason is EndReason.LOST}
        return lost, set(d.lapses_held), d.quiet

    everyone = {a.id, b.id, c.id}
    assert decided() == (everyone, set(), None)
    # 10 s late since a's last heartbeat: its lease ran out exactly 10 s ago, so it
    # lapses; 11 s keep it, and the pass is not quiet: a later one looks again.
    assert decided((NOW - 30, NOW - 20)) == (everyone, set(), None)
    assert decided((NOW - 31, NOW - 20)) == ({b.id, c.id}, {a.id}, None)
    # Late answers before a holder's last heartbeat count for nothing.
    assert decided((NOW - 400, NOW - 131))[:2] == (everyone, set())
    # Separate times add up (6 + 5 s for a), clipped to the holder's last lease and
    # now (b, 50 s over, has 11 s of its own, not the 61 the times hold together);
    # a time after now counts for nothing.
    both = ((NOW - 130, NOW - 124), (NOW - 5, NOW + 50), (NOW + 60, NOW + 90))
    assert decided(*both)[:2] == ({b.id, c.id}, {a.id})


@pytest.mark.parametrize(
    ("kind", "resumable", "requeue"),
    [
        pytest.param(SliceKind.BATCH, True, True, id="resumable batch goes back to the queue"),
        pytest.param(SliceKind.BATCH, False, False, id="non-resumable batch ends"),
        pytest.param(SliceKind.INTERACTIVE, True, False, id="an interactive session ends"),
    ],
)
def test_at_the_end_of_grace_a_preempted_slice_ends_or_requeues(kind, resumable, requeue):
    leaving = running("a", "n0", (0,), kind=kind, resumable=resumable)
    leaving = replace(leaving, state=SliceState.PREEMPTING, preempt_deadline=NOW)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [leaving]))
    (ending,) = d.endings
    assert (ending.reason, ending.requeue) == (EndReason.PREEMPTED, requeue)


# ---- draining and health -------------------------------------------------


def test_a_draining_node_empties_as_contracts_end_then_reports_drained():
    inventory = [Node("n0", "h100", 8, NodeState.DRAINING), Node("n1", "h100", 8)]
    protected = running("a", "n0", (0, 1), granted_ago=10 * MIN, min_runtime=HOUR)
    past = running("a", "n0", (2, 3), granted_ago=2 * HOUR, min_runtime=HOUR)
    free_rider = running("a", "n0", (4,), granted_ago=MIN, min_runtime=0)
    newcomer = pending("a", 1)
    slices = [protected, past, free_rider, newcomer]
    d = schedule(snapshot(inventory, flat_tree("a"), slices))
    assert preempted(d) == {past.id: PreemptReason.DRAIN, free_rider.id: PreemptReason.DRAIN}
    assert d.grants[0].placements[0].node == "n1"  # no new grants on a draining node
    assert d.node_changes == ()
    # 50 minutes later the protected slice's contract is over too.
    later = NOW + 50 * MIN
    moved = replace(newcomer, state=SliceState.GRANTED, placements=d.grants[0].placements)
    d = schedule(snapshot(inventory, flat_tree("a"), [protected, moved], now=later))
    assert preempted(d) == {protected.id: PreemptReason.DRAIN}
    # once the last slice has gone, the node reports drained
    d = schedule(snapshot(inventory, flat_tree("a"), [], now=later + MIN))
    assert [(c.node, c.state) for c in d.node_changes] == [("n0", NodeState.DRAINED)]


def test_a_down_node_ends_its_slices_at_once_and_resumable_batch_requeues():
    inventory = [Node("n0", "h100", 8, NodeState.DOWN)]
    protected = running("a", "n0", (0,), granted_ago=MIN, resumable=True)
    session = running("a", "n0", (1,), granted_ago=MIN, kind=SliceKind.INTERACTIVE)
    d = schedule(snapshot(inventory, flat_tree("a"), [protected, session]))
    assert {(e.slice_id, e.reason, e.requeue) for e in d.endings} == {
        (protected.id, EndReason.NODE_DOWN, True),
        (session.id, EndReason.NODE_DOWN, False),
    }


# ---- caps and reservations ----------------------------------------------


def test_project_gpu_cap_holds_back_work_beyond_it():
    held = running("a", "n0", (0, 1, 2))
    more = pending("a", 2)
    d = schedule(
        snapshot(nodes(1), flat_tree("a"), [held, more], policy=Policy(project_gpu_caps={"a": 4}))
    )
    assert d.grants == ()


def test_a_large_request_reserves_the_node_that_frees_first_and_small_work_cannot_jump_it():
    # n0 frees at NOW+10min (max runtime); n1 is held with no known end.
    ending_soon = running("a", "n0", tuple(range(6)), granted_ago=0, max_runtime=10 * MIN)
    long_job = running("a", "n1", tuple(range(8)), granted_ago=0, min_runtime=8 * HOUR)
    big = pending("b", 8, submitted_at=NOW - 100)
    small_long = pending("c", 2, min_runtime=2 * HOUR)
    small_short = pending("c", 2, min_runtime=MIN, max_runtime=5 * MIN)
    d = schedule(
        snapshot(
            nodes(2),
            flat_tree("a", "b", "c"),
            [ending_soon, long_job, big, small_long, small_short],
            usage={"a": 1e6, "c": 100.0},
        )
    )
    (reservation,) = [r for r in d.reservations if r.slice_id == big.id]
    assert reservation.due_at == NOW + 10 * MIN and not reservation.promised
    assert reservation.placements == (Placement("n0", (6, 7)),)
    assert granted_ids(d) == {small_short.id}
    entry = {q.slice_id: q for q in d.queue}[big.id]
    assert entry.estimated_start == NOW + 10 * MIN


def test_two_requests_alike_reserve_two_nodes_when_the_first_took_the_free_gpus():
    # n0 frees at NOW+10min, n1 at NOW+20min (max runtimes). The first 8-GPU request
    # reserves n0 and its 2 free GPUs; the 6 n0 frees then serve no other 8-GPU
    # request, so the second, of the same class, reserves n1.
    sooner = running("a", "n0", tuple(range(6)), granted_ago=0, max_runtime=10 * MIN)
    later = running("a", "n1", tuple(range(8)), granted_ago=0, max_runtime=20 * MIN)
    first = pending("b", 8, submitted_at=NOW - 200)
    second = pending("b", 8, submitted_at=NOW - 100)
    d = schedule(
        snapshot(nodes(2), flat_tree("a", "b"), [sooner, later, first, second], usage={"a": 1e6})
    )
    reserved = {r.slice_id: (r.placements[0].node, r.due_at) for r in d.reservations}
    assert reserved == {first.id: ("n0", NOW + 10 * MIN), second.id: ("n1", NOW + 20 * MIN)}


def test_same_snapshot_gives_the_same_decisions():
    slices = [pending("a", 3), pending("b", 5), running("a", "n0", (0, 1), granted_ago=3 * HOUR)]
    snap = snapshot(nodes(2), flat_tree("a", "b"), slices, usage={"a": 5.0})
    assert schedule(snap) == schedule(snap)


def test_gpus_lent_from_a_reservation_are_lent_only_once():
    # n0 is reserved for the large request; two free (unallocated) requests may
    # borrow its free GPUs, but not the same ones.
    holder = running("a", "n0", (0, 1), granted_ago=0, min_runtime=8 * HOUR, max_runtime=9 * HOUR)
    large = pending("b", 4)
    first = pending("c", 2, min_runtime=0)
    second = pending("c", 2, min_runtime=0)
    d = schedule(
        snapshot(nodes(1, gpus=4), flat_tree("a", "b", "c"), [holder, large, first, second])
    )
    assert [r.slice_id for r in d.reservations] == [large.id]
    assert granted_ids(d) == {first.id}


def test_a_share_whose_entitlement_underflows_is_rejected():
    from broker.errors import InvalidConfig

    accounts = [Account("a", 1e300), Account("b", 1e-300), Account("b1", 1e-300, "b")]
    accounts += [Account("b2", 1e300, "b")]
    with pytest.raises(InvalidConfig, match="entitlement rounds to 0"):
        ProjectTree(accounts)


def test_a_requeued_slice_is_granted_again_in_the_same_pass_when_gpus_are_free():
    leaving = running("a", "n0", (0,), resumable=True)
    leaving = replace(leaving, state=SliceState.PREEMPTING, preempt_deadline=NOW)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [leaving]))
    assert [(e.slice_id, e.requeue) for e in d.endings] == [(leaving.id, True)]
    assert granted_ids(d) == {leaving.id}


def test_a_slice_granted_at_time_zero_still_expires():
    capped = replace(running("a", "n0", (0,), max_runtime=HOUR), granted_at=0.0)
    d = schedule(snapshot(nodes(1), flat_tree("a"), [capped], now=HOUR))
    assert [e.reason for e in d.endings] == [EndReason.EXPIRED]


def test_a_gang_reservation_that_falls_due_preempts_the_holders_of_its_nodes():
    # Gangs do not preempt to fit, but once every holder of the nodes reserved
    # for one may be preempted, the reservation is honoured.
    first = running("heavy", "n0", tuple(range(8)), granted_ago=3 * HOUR)
    second = running("heavy", "n1", tuple(range(8)), granted_ago=3 * HOUR)
    gang = pending("light", 16)
    d = schedule(
        snapshot(nodes(2), flat_tree("heavy", "light"), [first, second, gang], usage={"heavy": 1e7})
    )
    assert set(preempted(d)) == {first.id, second.id}
    (promise,) = [r for r in d.reservations if r.promised]
    assert promise.slice_id == gang.id
    assert [(p.node, len(p.gpu_indices)) for p in promise.placements] == [("n0", 8), ("n1", 8)]


def test_a_gang_waits_without_preempting_while_a_holder_is_protected():
    first = running("heavy", "n0", tuple(range(8)), granted_ago=3 * HOUR)
    protected = running("heavy", "n1", tuple(range(8)), granted_ago=MIN)
    gang = pending("light", 16)
    d = schedule(
        snapshot(
            nodes(2), flat_tree("heavy", "light"), [first, protected, gang], usage={"heavy": 1e7}
        )
    )
    assert d.preemptions == ()
    (reservation,) = d.reservations
    assert not reservation.promised and reservation.due_at == protected.protected_until + 60


def test_a_reservation_counts_on_the_holders_fair_share_lets_it_take_whatever_their_size():
    # c (share 1 of 4) may take a's 1- and 3-GPU jobs (a stays at or above its
    # share of 12 after losing them) but not its 8-GPU one. Asked first (n0 comes
    # first), the big job's refusal must not stand for the small ones on n1.
    big = running("a", "n0", tuple(range(8)))
    small = [running("a", "n1", (i,)) for i in range(5)] + [running("a", "n1", (5, 6, 7))]
    waiting = pending("c", 4, submitted_at=NOW)  # too new to preempt: it plans
    tree = flat_tree("a", "c", shares={"a": 3.0})
    d = schedule(snapshot(nodes(2), tree, [big, *small, waiting]))
    assert d.preemptions == ()
    (reservation,) = d.reservations
    assert reservation.placements[0].node == "n1" and reservation.due_at == NOW + 60


def test_a_reservation_counts_on_its_own_projects_lower_priority_holders_only():
    # The holder on n0 outranks the request; on n1 one does not, and the other
    # is being preempted (its GPUs are free at its deadline, whoever asks).
    outranks = running("a", "n0", tuple(range(8)), priority=1)
    below = running("a", "n1", (0, 1, 2, 3), priority=-1)
    leaving = replace(
        running("a", "n1", (4, 5, 6, 7), priority=1),
        state=SliceState.PREEMPTING,
        preempt_deadline=NOW + 30,
    )
    waiting = pending("a", 8, submitted_at=NOW)
    d = schedule(snapshot(nodes(2), flat_tree("a"), [outranks, below, leaving, waiting]))
    assert d.preemptions == ()
    (reservation,) = d.reservations
    assert reservation.placements[0].node == "n1" and reservation.due_at == NOW + 60


# ---- the victim indexes ----------------------------------------------------------


def allowed_in_order(preemptor, requester, subset, weight):
    """``subset``'s victims with their reasons, if the rule allows each in turn,
    judged with what the earlier ones cost its project; else None."""
    chosen, lost = [], {}
    for victim, gpus in subset:
        before = lost.get(victim.project, 0.0)
        reason = preemptor.reason(requester, victim, weight, before)
        if reason is None:
            return None
        chosen.append((victim, reason, gpus))
        if victim.allocated:
            lost[victim.project] = before + victim.gpus * weight
    return chosen


def scan_every_node(preemptor, requester, free):
    """The victim search without its indexes: every node, the rule asked of every
    candidate in victim order (design.md §5.3), or, where earlier victims spent
    what a project could lose, the fewest candidates it allows in that order; the
    best node by its score."""
    if not requester.allocated:
        return None
    best = None
    for name in preemptor.candidates.on:
        entries = preemptor.on(name)
        node = preemptor.nodes.get(name)
        if node is None or node.gpu_count < requester.gpus:
            continue
        if requester.gpu_type is not None and node.gpu_type != requester.gpu_type:
            continue
        need = requester.gpus - len(free.get(name, ()))
        if need <= 0:
            continue
        weight = preemptor.weights.get(node.gpu_type, 1.0)
        chosen, lost, freed = [], {}, 0
        for victim, gpus in entries:
            before = lost.get(victim.project, 0.0)
            reason = preemptor.reason(requester, victim, weight, before)
            if reason is not None:
                chosen.append((victim, reason, gpus))
                if victim.allocated:
                    lost[victim.project] = before + victim.gpus * weight
                freed += gpus
                if freed >= need:
                    break
        else:
            subsets = (
                subset
                for size in range(1, len(entries) + 1)
                for subset in combinations(entries, size)
                if sum(gpus for _, gpus in subset) >= need
            )
            found = (allowed_in_order(preemptor, requester, sub, weight) for sub in subsets)
            chosen = next((c for c in found if c is not None), None)
            if chosen is None:
                continue
            freed = sum(gpus for _, _, gpus in chosen)
        for taken in reversed(chosen[:-1]):
            if freed - taken[2] >= need:
                chosen.remove(taken)
                freed -= taken[2]
        score = (sum(1 for v, _, _ in chosen if v.allocated), len(chosen), freed, name)
        if best is None or score < best[0]:
            best = (score, [(v, r) for v, r, _ in chosen])
    return best


@st.composite
def crowded_clusters(draw):
    """Four 8-GPU nodes, some GPUs free, the rest held by slices of random
    projects, contracts, kinds and ages; and a random request."""
    projects = ("a", "b", "c", "d")
    slices = []
    free = {}
    for node in ("n0", "n1", "n2", "n3"):
        start = draw(st.integers(0, 3))
        free[node] = set(range(start))
        while start < 8:
            size = draw(st.integers(1, 8 - start))
            slices.append(
                running(
                    draw(st.sampled_from(projects)),
                    node,
                    tuple(range(start, start + size)),
                    granted_ago=draw(st.sampled_from([MIN, 2 * HOUR, 3 * HOUR])),
                    min_runtime=draw(st.sampled_from([0.0, 15 * MIN, HOUR])),
                    kind=draw(st.sampled_from(list(SliceKind))),
                    priority=draw(st.integers(-1, 1)),
                )
            )
            start += size
    requester = pending(
        draw(st.sampled_from(projects)),
        draw(st.integers(1, 8)),
        kind=draw(st.sampled_from(list(SliceKind))),
        min_runtime=draw(st.sampled_from([0.0, 15 * MIN, HOUR])),
        priority=draw(st.integers(-1, 1)),
    )
    shares = {p: draw(st.sampled_from([1.0, 2.0, 3.0])) for p in projects}
    return flat_tree(*projects, shares=shares), slices, free, requester


@settings(max_examples=300, deadline=None)
@given(crowded_clusters())
def test_the_indexed_victim_search_picks_what_a_scan_of_every_node_picks(cluster):
    accounts, slices, free, requester = cluster
    tree = ProjectTree(accounts)
    policy = Policy(debug_lane_fraction=0.25)
    wanting = {s.project for s in slices if s.allocated} | {requester.project}
    standings = Standings.now(tree, 32.0, wanting)
    lane = DebugLane.for_cluster(32, policy)
    for s in slices:
        if s.allocated:
            standings.record(s.project, float(s.gpus))
    preemptor = Preemptor(
        now=NOW,
        policy=policy,
        standings=standings,
        lane=lane,
        nodes={n.name: n for n in nodes(4)},
        weights={},
        candidates=Candidates.of(slices, NOW, policy),
    )
    expected = scan_every_node(preemptor, requester, free)
    found = preemptor.find(requester, free)
    if expected is None:
        assert found is None
    else:
        assert found is not None
        assert found.placement.node == expected[0][3]
        assert [(v.id, r) for v, r in found.victims] == [(v.id, r) for v, r in expected[1]]


def test_a_lower_priority_request_of_the_owner_s_project_borrows_what_an_equal_one_may_not():
    # n0 is reserved for `owner` (priority 1) until `holder` ends. `equal` (priority 1,
    # same shape as `lower`) may not borrow the reserved GPUs: the owner could not
    # preempt it when they fall due. `lower` (priority 0) may, as the owner outranks it.
    # The tail's shortcut for shapes found blocked must not skip it for `equal`.
    holder = running("b", "n0", (0, 1), granted_ago=0, min_runtime=8 * HOUR, max_runtime=2 * HOUR)
    owner = pending("a", 4, priority=1, submitted_at=NOW - 3 * HOUR)
    equal = pending("a", 2, priority=1, min_runtime=10 * MIN, submitted_at=NOW - 2 * HOUR)
    lower = pending("a", 2, priority=0, min_runtime=10 * MIN)
    d = schedule(
        snapshot(
            nodes(1, gpus=4),
            flat_tree("a", "b"),
            [holder, owner, equal, lower],
            policy=Policy(max_reservations=1),
        )
    )
    assert [r.slice_id for r in d.reservations] == [owner.id]
    assert granted_ids(d) == {lower.id}


def test_a_request_within_its_preemption_budget_borrows_what_one_past_it_may_not():
    # As above, with priorities equal: the first request of the shape has spent its
    # preemption budget, so the owner could never preempt it and it may not borrow;
    # the next, fresh, may.
    holder = running("b", "n0", (0, 1), granted_ago=0, min_runtime=8 * HOUR, max_runtime=2 * HOUR)
    owner = pending("a", 4, kind=SliceKind.INTERACTIVE, submitted_at=NOW - 3 * HOUR)
    spent = pending("a", 2, min_runtime=10 * MIN, preemptions=5, submitted_at=NOW - 2 * HOUR)
    fresh = pending("a", 2, min_runtime=10 * MIN)
    d = schedule(
        snapshot(
            nodes(1, gpus=4),
            flat_tree("a", "b"),
            [holder, owner, spent, fresh],
            policy=Policy(max_reservations=1, preemption_budget=5),
        )
    )
    assert [r.slice_id for r in d.reservations] == [owner.id]
    assert granted_ids(d) == {fresh.id}
