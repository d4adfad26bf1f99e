"""Extending a running slice's protection (design.md §3, broker.core.extension): from the
later of its end and now, within the caps a new contract has, never for a free, waiting
or preempting slice."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import HOUR, MIN, NOW, pending, running

from broker.config import format_duration
from broker.core.extension import ExtensionRefused, extended_contract
from broker.core.model import Policy, SliceKind, SliceState

POLICY = Policy(max_min_runtime=8 * HOUR, debug_max_gpus=2, debug_max_min_runtime=15 * MIN)


def test_a_protected_slice_is_extended_from_the_end_of_its_protection():
    # granted 2 h ago for 3 h: protected for 1 h more; 30 min more makes 3 h 30 min
    slice_ = running("p", "n0", (0, 1, 2, 3), min_runtime=3 * HOUR)
    contract = extended_contract(slice_, 30 * MIN, NOW, POLICY)
    assert contract.min_runtime == 3.5 * HOUR
    assert contract.resumable == slice_.contract.resumable


def test_a_slice_past_its_protection_is_protected_again_from_now():
    slice_ = running("p", "n0", (0,), min_runtime=HOUR)  # granted 2 h ago: over for 1 h
    assert extended_contract(slice_, 30 * MIN, NOW, POLICY).min_runtime == 2.5 * HOUR


def test_the_policy_s_cap_bounds_an_extension_and_the_refusal_says_the_room_left():
    slice_ = running("p", "n0", (0, 1, 2, 3), min_runtime=7 * HOUR)  # ends in 5 h, 1 h room
    assert extended_contract(slice_, HOUR, NOW, POLICY).min_runtime == 8 * HOUR
    with pytest.raises(ExtensionRefused) as refused:
        extended_contract(slice_, HOUR + 1, NOW, POLICY)
    assert refused.value.describe(format_duration).endswith(
        "above the policy's max_min_runtime (8h); at most 1h more"
    )


def test_a_debug_session_keeps_the_debug_lane_s_short_terms():
    session = running(
        "p", "n0", (0,), kind=SliceKind.INTERACTIVE, min_runtime=10 * MIN, granted_ago=MIN
    )
    assert extended_contract(session, 5 * MIN, NOW, POLICY).min_runtime == 15 * MIN
    with pytest.raises(ExtensionRefused) as refused:
        extended_contract(session, 6 * MIN, NOW, POLICY)
    assert refused.value.cap_name == "a debug session's debug_max_min_runtime"


def test_the_slice_s_own_hard_end_bounds_it_too():
    slice_ = running("p", "n0", (0,), min_runtime=HOUR, max_runtime=3 * HOUR, granted_ago=MIN)
    with pytest.raises(ExtensionRefused) as refused:
        extended_contract(slice_, 2 * HOUR + 1, NOW, POLICY)
    assert refused.value.describe(format_duration).endswith(
        "above the slice's max_runtime (3h); at most 2h more"
    )


@pytest.mark.parametrize(
    ("slice_", "why"),
    [
        (running("p", "n0", (0,), min_runtime=0.0), "is free"),
        (pending("p", 1), "is pending"),
        (
            replace(running("p", "n0", (0,)), state=SliceState.PREEMPTING, preempt_deadline=NOW),
            "is preempting",
        ),
    ],
)
def test_only_a_granted_slice_under_contract_is_extended(slice_, why):
    with pytest.raises(ExtensionRefused, match=why):
        extended_contract(slice_, MIN, NOW, POLICY)


def test_an_extension_of_nothing_is_refused():
    with pytest.raises(ExtensionRefused, match="longer than 0 s"):
        extended_contract(running("p", "n0", (0,)), 0.0, NOW, POLICY)
