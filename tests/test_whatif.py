"""What would start a waiting request sooner (design.md §5.8): each alternative is
the one that wins in a case of its own, and none is offered that is not sooner."""

from __future__ import annotations

from dataclasses import replace

from builders import HOUR, MIN, NOW, flat_tree, nodes, pending, running, snapshot

from broker.core.model import Node, Policy, SliceKind
from broker.core.whatif import alternatives, expected_starts


def protected(project, node, gpus, **kwargs):
    """A slice holding ``gpus`` on ``node`` under protection for hours yet."""
    return running(project, node, gpus, min_runtime=8 * HOUR, granted_ago=MIN, **kwargs)


def changes(what_if):
    return [(a.change, a.fields, a.starts_at) for a in what_if.alternatives]


def test_fewer_gpus_start_now_where_one_is_free():
    request = pending("a", 2)
    snap = snapshot(nodes(1), flat_tree("a"), [protected("a", "n0", tuple(range(7))), request])
    found = alternatives(snap, request.id)
    assert found.starts_at is None  # nothing frees up that the pass knows of
    (best, *_) = found.alternatives
    assert (best.change, best.fields["gpus"], best.starts_at) == ("gpus", 1, NOW)
    assert best.gpu_hours == 1.0  # 1 GPU for its hour of protection


def test_another_gpu_type_starts_now_on_its_free_node():
    cluster = [Node("h0", "h100", 8), Node("b0", "b200", 8)]
    request = pending("a", 1, gpu_type="h100")
    snap = snapshot(
        cluster,
        flat_tree("a"),
        [protected("a", "h0", tuple(range(8))), request],
        weights={"b200": 2.0},
    )
    found = alternatives(snap, request.id)
    assert changes(found)[0][:1] == ("gpu_type",)
    (best,) = [a for a in found.alternatives if a.change == "gpu_type"]
    assert (best.fields["gpu_type"], best.starts_at, best.gpu_hours) == ("b200", NOW, 2.0)


def test_a_shorter_protection_may_use_gpus_kept_for_a_larger_request():
    # the node's holder ends in 3 h by its maximum runtime; the project's 8-GPU job
    # has the node reserved from then. A 2-GPU job of lower priority protected for
    # 8 h would outlast the reservation; protected for 2 h, it is gone in time
    holder = protected("p", "n0", (0, 1, 2, 3), max_runtime=MIN + 3 * HOUR)
    big = pending("p", 8, priority=1)
    request = pending("p", 2, min_runtime=8 * HOUR)
    snap = snapshot(nodes(1), flat_tree("p"), [holder, big, request])
    found = alternatives(snap, request.id)
    shorter = [a for a in found.alternatives if a.change == "min_runtime"]
    assert [(a.fields["min_runtime"], a.starts_at) for a in shorter] == [(2 * HOUR, NOW)]


def test_another_project_of_the_user_starts_now_where_this_one_is_capped():
    policy = Policy(project_gpu_caps={"a": 1})
    request = pending("a", 1)
    slices = [running("a", "n0", (0,), min_runtime=8 * HOUR, granted_ago=MIN), request]
    snap = snapshot(nodes(1), flat_tree("a", "b"), slices, policy=policy)
    found = alternatives(snap, request.id, projects=["a", "b"])
    assert changes(found) == [
        (
            "project",
            {"project": "b", "gpus": 1, "gpu_type": None, "kind": "batch", "min_runtime": HOUR},
            NOW,
        )
    ]
    # without another project to charge, nothing is offered
    assert alternatives(snap, request.id).alternatives == ()


def test_a_debug_length_session_gets_in_through_the_debug_lane():
    batch = running("b", "n0", tuple(range(8)), min_runtime=HOUR)
    request = pending("a", 1, kind=SliceKind.INTERACTIVE, min_runtime=HOUR)
    snap = snapshot(nodes(1), flat_tree("a", "b"), [batch, request])
    found = alternatives(snap, request.id)
    assert found.starts_at is None
    debug = [a for a in found.alternatives if a.change == "debug"]
    assert [(a.fields["min_runtime"], a.starts_at) for a in debug] == [
        (15 * MIN, NOW + Policy().debug_grace_period)
    ]


def test_nothing_is_offered_that_is_not_sooner_and_the_passes_are_bounded():
    # the request starts now as it is: no alternative can beat it
    request = pending("a", 2, gpu_type="h100", min_runtime=8 * HOUR)
    snap = snapshot(nodes(1), flat_tree("a", "b"), [request])
    assert alternatives(snap, request.id, projects=["b"]).alternatives == ()
    # one pass is the request itself: no alternative is tried at all
    blocked = replace(request, gpus=9)
    snap = snapshot(nodes(1), flat_tree("a", "b"), [blocked])
    assert alternatives(snap, blocked.id, max_passes=1).alternatives == ()


def test_before_a_request_is_made_each_shape_is_asked_of_the_same_pass():
    # b holds 6 of n0's 8 GPUs under protection, a whole b200 node is free; a's new
    # request would start now on 1 or 2 h100s or 8 b200s, while 4 h100s wait
    cluster = [Node("n0", "h100", 8), Node("b0", "b200", 8)]
    held = protected("b", "n0", tuple(range(6)))
    snap = snapshot(cluster, flat_tree("a", "b"), [held], weights={"b200": 2.0})
    request = replace(pending("a", 1), id=held.id + 1)
    shapes = [("h100", 1), ("h100", 2), ("h100", 4), ("b200", 8)]
    found = {(e.gpu_type, e.gpus): e.starts_at for e in expected_starts(snap, request, shapes)}
    assert found[("h100", 1)] == found[("h100", 2)] == found[("b200", 8)] == NOW
    assert found[("h100", 4)] is None or found[("h100", 4)] > NOW
    assert snap.slices == (held,)  # the snapshot asked is left as it was
