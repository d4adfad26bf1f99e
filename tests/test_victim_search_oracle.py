"""The victim search (design.md §5.3) against a brute-force oracle that shares none of
its code: no candidate lists, indexes or shortcuts, only the slices themselves, the one
preemption rule and every subset of each node's slices.

What any correct search must do, whichever victims it prefers:

- **sound**: every victim sits on the chosen node and the rule allows it, judged with
  what the victims before it already cost its project;
- **enough**: the node's free GPUs and the victims' make the request fit, and the
  placement uses only those;
- **nothing spare**: without any one victim the request no longer fits;
- **complete**: where some set of a node's slices, taken in victim order, is allowed
  by the rule and makes the request fit, the search finds a way (not necessarily that
  one).
"""

from __future__ import annotations

from itertools import combinations

from builders import HOUR, MIN, NOW, nodes, pending, running
from hypothesis import event, given, settings
from test_scheduler import crowded_clusters

from broker.core.candidates import Candidates
from broker.core.fairshare import ProjectTree
from broker.core.model import Account, Policy, Slice, SliceKind
from broker.core.ordering import victim_key
from broker.core.preemption import DebugLane, Preemptor, preempt_reason
from broker.core.standing import Standings

CLUSTER = nodes(4)  # n0..n3, 8 GPUs each, as crowded_clusters draws
POLICY = Policy(debug_lane_fraction=0.25)


def fresh_standings(tree: ProjectTree, slices: list[Slice], requester: Slice) -> Standings:
    wanting = {s.project for s in slices if s.allocated} | {requester.project}
    standings = Standings.now(tree, 32.0, wanting)
    for s in slices:
        if s.allocated:
            standings.record(s.project, float(s.gpus))
    return standings


def allowed_in_order(requester: Slice, victims, standings: Standings, lane: DebugLane) -> bool:
    """Whether the rule allows each of ``victims`` in turn, each judged with what the
    earlier ones of its project already cost that project."""
    lost: dict[str, float] = {}
    for victim in victims:
        before = lost.get(victim.project, 0.0)
        reason = preempt_reason(
            requester,
            victim,
            now=NOW,
            policy=POLICY,
            standings=standings,
            lane=lane,
            weight=1.0,
            lost_before=before,
        )
        if reason is None:
            return False
        if victim.allocated:
            lost[victim.project] = before + victim.gpus
    return True


def gpus_on(slice_: Slice, node: str) -> set[int]:
    return {i for p in slice_.placements if p.node == node for i in p.gpu_indices}


def fits(requester: Slice, node: str, free: set[int], victims) -> bool:
    return len(free) + sum(len(gpus_on(v, node)) for v in victims) >= requester.gpus


def some_set_serves(requester, slices, free, standings, lane) -> str | None:
    """A node on which some set of slices, in victim order, is allowed and enough."""
    for node in CLUSTER:
        if requester.gpu_type not in (None, node.gpu_type) or node.gpu_count < requester.gpus:
            continue
        there = sorted(
            (s for s in slices if gpus_on(s, node.name)),
            key=lambda s: victim_key(s, standings.standing(s.project)),
        )
        node_free = free.get(node.name, set())
        if len(node_free) >= requester.gpus:
            continue  # the search is asked only where free GPUs do not suffice
        for size in range(1, len(there) + 1):
            for chosen in combinations(there, size):
                if fits(requester, node.name, node_free, chosen) and allowed_in_order(
                    requester, chosen, standings, lane
                ):
                    return node.name
    return None


@settings(max_examples=300, deadline=None)
@given(crowded_clusters())
def test_the_victim_search_is_sound_sufficient_minimal_and_complete(cluster):
    accounts, slices, free, requester = cluster
    tree = ProjectTree(accounts)
    lane = DebugLane.for_cluster(32, POLICY)
    preemptor = Preemptor(
        now=NOW,
        policy=POLICY,
        standings=fresh_standings(tree, slices, requester),
        lane=lane,
        nodes={n.name: n for n in CLUSTER},
        weights={},
        candidates=Candidates.of(slices, NOW, POLICY),
    )
    found = preemptor.find(requester, free)
    oracle = fresh_standings(tree, slices, requester)  # the search's own is not read
    event("no way found" if found is None else f"{len(found.victims)} victims")
    if found is None:
        assert some_set_serves(requester, slices, free, oracle, lane) is None
        return
    node = found.placement.node
    victims = [victim for victim, _ in found.victims]
    node_free = free.get(node, set())
    assert victims, "a request that fits the free GPUs is not the search's to answer"
    assert all(gpus_on(v, node) for v in victims)
    assert allowed_in_order(requester, victims, oracle, lane)
    assert fits(requester, node, node_free, victims)
    usable = node_free | {i for v in victims for i in gpus_on(v, node)}
    assert len(found.placement.gpu_indices) == requester.gpus
    assert set(found.placement.gpu_indices) <= usable
    for spare in victims:
        assert not fits(requester, node, node_free, [v for v in victims if v is not spare])


def test_a_larger_victim_is_found_when_smaller_ones_of_its_project_spent_its_margin():
    """d (8 GPUs, share 6.4) may lose its 2-GPU or its 5-GPU job on n0 to a's 6-GPU
    request, not both. Taken in victim order (fewest GPUs first) the 2-GPU one leaves
    d unable to lose the 5-GPU one, which with a's own free GPU alone makes it fit."""
    accounts = [Account("a", 3.0), Account("b", 1.0), Account("c", 1.0), Account("d", 1.0)]
    protected = {"granted_ago": MIN, "min_runtime": HOUR}
    slices = [
        running("d", "n0", (0, 1, 2, 3, 4), kind=SliceKind.INTERACTIVE, min_runtime=900.0),
        running("a", "n0", (5,), min_runtime=0.0),
        running("d", "n0", (6, 7), kind=SliceKind.INTERACTIVE, min_runtime=900.0),
        running("d", "n1", (0,), **protected),
        running("a", "n1", (1, 2), **protected),
        running("b", "n2", tuple(range(8)), **protected),
        running("b", "n3", (0, 1, 2, 3), **protected),
    ]
    requester = pending("a", 6, kind=SliceKind.INTERACTIVE, min_runtime=900.0)
    tree = ProjectTree(accounts)
    preemptor = Preemptor(
        now=NOW,
        policy=POLICY,
        standings=fresh_standings(tree, slices, requester),
        lane=DebugLane.for_cluster(32, POLICY),
        nodes={n.name: n for n in CLUSTER},
        weights={},
        candidates=Candidates.of(slices, NOW, POLICY),
    )
    found = preemptor.find(requester, {})
    assert found is not None and found.placement.node == "n0"
    assert {victim.id for victim, _ in found.victims} == {slices[0].id, slices[1].id}
