"""spawner.culler: the idle rule keeps the contract, and never culls for a request that
cannot run."""

from __future__ import annotations

import pytest

from spawner import notices
from spawner.culler import CULLED_IDLE, CullLimits, verdict, waiter_for

LIMITS = CullLimits(idle=3600, busy=900, protected=1800)
NOW = 1_800_000_000.0


def node(name="n0", gpus=8, held=8, state="ready", gpu_type="h100"):
    return {
        "name": name,
        "gpu_type": gpu_type,
        "gpu_count": gpus,
        "gpus_held": held,
        "state": state,
        "in_config": True,
    }


def session(gpus=2, node_name="n0", protected_for=600.0, min_runtime=3600.0, id=1):
    return {
        "id": id,
        "gpus": gpus,
        "placements": [{"node": node_name, "gpu_indices": list(range(gpus))}],
        "min_runtime": min_runtime,
        "protected_until": NOW + protected_for,
    }


def waiting(gpus=2, gpu_type=None, id=9, position=1):
    return {"id": id, "gpus": gpus, "gpu_type": gpu_type, "queue_position": position}


def test_a_protected_session_is_kept_while_nobody_could_use_its_gpus():
    rule = verdict(session(), NOW, LIMITS, waiter=None)
    assert rule.protected and rule.limit is None
    assert not rule.due(10 * 3600)


def test_a_protected_session_is_culled_only_after_the_protected_idle_limit_with_a_waiter():
    rule = verdict(session(), NOW, LIMITS, waiter=waiting())
    assert rule.protected and rule.waiter == 9
    assert not rule.due(1799) and rule.due(1800)
    assert rule.left(1000) == 800


@pytest.mark.parametrize(
    ("waiter", "limit"), [(None, 3600), (waiting(), 900)], ids=["nobody", "a waiter"]
)
def test_past_its_protection_a_session_gets_the_busy_limit_only_with_a_waiter(waiter, limit):
    rule = verdict(session(protected_for=-1), NOW, LIMITS, waiter=waiter)
    assert not rule.protected and rule.limit == limit


def test_a_free_session_is_never_protected():
    rule = verdict(session(min_runtime=0.0, protected_for=0.0), NOW, LIMITS, waiter=waiting())
    assert not rule.protected and rule.limit == 900


def test_a_zero_limit_turns_culling_off():
    off = CullLimits(idle=0, busy=0, protected=0)
    assert verdict(session(), NOW, off, waiting()).limit is None
    assert verdict(session(protected_for=-1), NOW, off, None).limit is None


def test_a_request_that_fits_with_the_sessions_gpus_is_a_waiter():
    # The node is full: 2 more free GPUs (this session's) let a 2-GPU request run.
    assert waiter_for(session(), [waiting(gpus=2)], [node()])["id"] == 9
    # 6 GPUs held by this session and 2 free: an 8-GPU request fits once it goes.
    assert waiter_for(session(gpus=6), [waiting(gpus=8)], [node(held=6)])["id"] == 9


def test_requests_that_cannot_run_are_never_a_reason():
    full = [node()]
    # Too large even with this session's GPUs.
    assert waiter_for(session(), [waiting(gpus=4)], full) is None
    # Another GPU type.
    assert waiter_for(session(), [waiting(gpu_type="b200")], full) is None
    # The node drains (or is down): freed GPUs would go to nobody.
    for state in ("draining", "down"):
        assert waiter_for(session(), [waiting()], [node(state=state)]) is None
    # It fits in GPUs free now: it waits for something else (its budget, the next pass).
    assert waiter_for(session(), [waiting(gpus=1)], [node(held=7)]) is None
    # The session's own request is not a waiter.
    assert waiter_for(session(), [waiting(id=1)], full) is None


def test_nobody_is_culled_for_their_own_request():
    mine = session() | {"user": "carol"}
    assert waiter_for(mine, [waiting() | {"user": "carol"}], [node()]) is None
    assert waiter_for(mine, [waiting() | {"user": "dave"}], [node()])["id"] == 9


def test_sessions_already_being_stopped_count_as_freed():
    # One 2-GPU request waits on a full node of four idle 2-GPU sessions: the first
    # session stopped for it is enough; the others are no longer needed.
    full = [node(held=8)]
    assert waiter_for(session(id=1), [waiting(gpus=2)], full, freeing={})["id"] == 9
    assert waiter_for(session(id=2), [waiting(gpus=2)], full, freeing={"n0": 2}) is None
    # A 4-GPU request needs two of them: the second is still a waiter, the third is not.
    four = [waiting(gpus=4)]
    assert waiter_for(session(id=2), four, full, freeing={"n0": 2})["id"] == 9
    assert waiter_for(session(id=3), four, full, freeing={"n0": 4}) is None
    # Before anyone is stopped, the other idle sessions on the node count beside this one
    # (they follow in the same round): a 4-GPU request may take two 2-GPU sessions.
    assert waiter_for(session(id=1), four, full, freeing={}) is None
    assert waiter_for(session(id=1), four, full, freeing={}, idle_beside={"n0": 2})["id"] == 9
    assert waiter_for(session(id=1), four, full, freeing={}, idle_beside={"n1": 2}) is None
    # GPUs freed on another node do not help a request that must fit on this one.
    assert waiter_for(session(id=2), [waiting(gpus=2)], full, freeing={"n1": 2})["id"] == 9


def test_the_first_usable_request_in_queue_order_is_named():
    queue = [waiting(gpus=4, id=7, position=1), waiting(gpus=2, id=8, position=2)]
    assert waiter_for(session(), queue, [node()])["id"] == 8


def test_a_request_larger_than_any_node_counts_the_free_gpus_of_its_type_everywhere():
    nodes = [node("n0", gpus=4, held=4), node("n1", gpus=4, held=2)]
    big = waiting(gpus=6)
    assert waiter_for(session(gpus=4), [big], nodes)["id"] == 9
    assert waiter_for(session(gpus=2), [big], nodes) is None  # 2 + 2 free < 6


def test_the_notice_of_a_culled_session_says_why_and_what_to_do():
    rule = verdict(session(), NOW, LIMITS, waiter=waiting())
    notice = notices.cull_notice(session() | {"project": "vision"}, NOW, 1900.0, rule)
    words = notices.describe(notice)
    assert notice["end_reason"] == CULLED_IDLE
    assert words["title"] == "Your GPU session was stopped as idle"
    assert "idle for 32 min (still within its protected period)" in words["text"]
    assert "a waiting request could use its GPUs" in words["text"]
    assert "stop your server when you are done" in words["what_to_do"]

    plain = notices.cull_notice(session(), NOW, 3700.0, verdict(session(), NOW, LIMITS, None))
    assert "the hub's limit for an idle session" in notices.describe(plain)["text"]
