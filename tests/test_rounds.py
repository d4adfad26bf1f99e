"""The loop of background rounds (broker.rounds): it stops when cancelled."""

from __future__ import annotations

import asyncio
import logging

from broker.rounds import Backoff, Rounds


class CountedRounds(Rounds):
    def __init__(self) -> None:
        super().__init__(interval=600.0, backoff=Backoff(), log=logging.getLogger(__name__))
        self.rounds = 0
        self.ran = asyncio.Event()

    async def round_once(self) -> None:
        self.rounds += 1
        self.ran.set()


async def test_a_wake_that_comes_with_the_cancellation_does_not_keep_the_rounds_going():
    # Python 3.11's asyncio.wait_for, waiting out the interval, would return as woken
    # and drop the cancellation: the rounds would go on, unstoppable.
    rounds = CountedRounds()
    task = asyncio.create_task(rounds.run())
    await rounds.ran.wait()  # the first round is done: the loop waits out the interval
    rounds.wake()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert task in done and task.cancelled()
    assert rounds.rounds == 1
