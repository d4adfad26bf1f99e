"""The spawner's life cycle (spawner.lifecycle): the moves it has, and the ones it refuses."""

from __future__ import annotations

import pytest

from spawner.lifecycle import InvalidMove, Lifecycle, Phase

A_SESSION = [Phase.REQUESTING, Phase.WAITING, Phase.LAUNCHING, Phase.RUNNING, Phase.STOPPING]


def at(*moves: Phase) -> Lifecycle:
    lifecycle = Lifecycle()
    for phase in moves:
        lifecycle.move(phase)
    return lifecycle


def test_a_session_goes_from_idle_through_each_phase_to_stopped():
    lifecycle = at(*A_SESSION, Phase.STOPPED)
    assert lifecycle.phase is Phase.STOPPED
    assert lifecycle.move(Phase.REQUESTING) is Phase.STOPPED  # and may start again


@pytest.mark.parametrize(
    ("moves", "starting", "before_grant"),
    [
        ([], False, False),
        ([Phase.REQUESTING], True, True),
        ([Phase.REQUESTING, Phase.WAITING], True, True),
        ([Phase.REQUESTING, Phase.WAITING, Phase.LAUNCHING], True, False),
        (A_SESSION[:4], False, False),
    ],
)
def test_starting_and_before_the_grant_follow_the_phase(moves, starting, before_grant):
    lifecycle = at(*moves)
    assert (lifecycle.starting, lifecycle.before_grant) == (starting, before_grant)


@pytest.mark.parametrize(
    ("moves", "refused"),
    [
        ([], Phase.LAUNCHING),  # no grant without a request
        ([Phase.REQUESTING], Phase.RUNNING),  # no server without a launch
        (A_SESSION[:4], Phase.WAITING),  # a running session does not queue again
        (A_SESSION, Phase.REQUESTING),  # a stopping one does not start
    ],
)
def test_moves_the_life_cycle_lacks_are_refused(moves, refused):
    lifecycle = at(*moves)
    with pytest.raises(InvalidMove, match=f"to {refused}"):
        lifecycle.move(refused)


def test_a_failed_backend_stop_goes_back_to_running():
    assert at(*A_SESSION, Phase.RUNNING).phase is Phase.RUNNING


async def test_each_move_sets_the_moved_event_and_a_new_request_clears_a_cancel():
    lifecycle = at(Phase.REQUESTING)
    moved = lifecycle.moved()
    lifecycle.cancelled = True
    lifecycle.move(Phase.STOPPING)
    assert moved.is_set() and not lifecycle.moved().is_set()
    lifecycle.move(Phase.STOPPED)
    lifecycle.move(Phase.REQUESTING)
    assert not lifecycle.cancelled
