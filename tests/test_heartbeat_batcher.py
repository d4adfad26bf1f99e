"""HeartbeatBatcher: a process's heartbeats of many slices go to the broker together.

Its gathering is tested here on a client that answers from memory, under the
test's control (when each request is answered); the real route behind it is
tested in test_client.py and test_api.py.
"""

from __future__ import annotations

import asyncio

import pytest

from broker.client import BrokerAPIError, BrokerUnreachable, HeartbeatBatcher


class HeldClient:
    """A client whose ``POST /heartbeats`` answers wait for the test's ``answer()``."""

    def __init__(self, slices: set[int], route: bool = True) -> None:
        self.slices = slices
        self.route = route
        self.sent: list[list[int]] = []  # ids of each POST /heartbeats
        self.singles: list[int] = []  # ids of each POST /slices/{id}/heartbeat
        self.failure: Exception | None = None
        self._answers: asyncio.Queue[None] = asyncio.Queue()

    def answer(self) -> None:
        self._answers.put_nowait(None)

    async def heartbeats(self, ids):
        if not self.route:
            raise BrokerAPIError(404, "not_found", "no such resource: /api/v1/heartbeats")
        self.sent.append(list(ids))
        await self._answers.get()
        if self.failure is not None:
            raise self.failure
        found = [{"id": i, "state": "granted"} for i in ids if i in self.slices]
        return {"slices": found, "not_found": [i for i in ids if i not in self.slices]}

    async def heartbeat(self, slice_id):
        self.singles.append(slice_id)
        if slice_id not in self.slices:
            raise BrokerAPIError(404, "not_found", f"no slice {slice_id}")
        return {"id": slice_id, "state": "granted"}


async def sent(client: HeldClient, count: int) -> None:
    """Yield to the batcher until ``client`` has been sent ``count`` requests."""
    for _ in range(100):
        if len(client.sent) >= count:
            return
        await asyncio.sleep(0)
    pytest.fail(f"{len(client.sent)} requests sent, not {count}")


async def test_heartbeats_asked_while_one_request_is_out_go_together_in_the_next():
    client = HeldClient({1, 2, 3, 4})
    batcher = HeartbeatBatcher(client)
    first = asyncio.ensure_future(batcher.beat(1))
    await sent(client, 1)
    later = [asyncio.ensure_future(batcher.beat(i)) for i in (2, 3, 4, 2)]
    for _ in range(3):  # time for the beats, and any request they would send, to run
        await asyncio.sleep(0)
    assert client.sent == [[1]]  # one request out at a time
    client.answer()
    assert (await first)["id"] == 1
    await sent(client, 2)
    assert client.sent == [[1], [2, 3, 4]]  # a slice asked twice is named once
    client.answer()
    assert [(await beat)["id"] for beat in later] == [2, 3, 4, 2]
    assert batcher.requests == 2


async def test_each_caller_gets_its_own_answer_or_error():
    client = HeldClient({1})
    batcher = HeartbeatBatcher(client, most=2)
    beats = [asyncio.ensure_future(batcher.beat(i)) for i in (1, 7, 1, 8, 9)]
    gone = beats.pop(2)
    await sent(client, 1)
    gone.cancel()  # a caller that gives up leaves the others their answers
    client.answer()
    await sent(client, 2)
    client.answer()
    answers = await asyncio.gather(*beats, return_exceptions=True)
    assert client.sent == [[1, 7], [8, 9]]  # at most ``most`` a request
    assert answers[0] == {"id": 1, "state": "granted"}
    assert [(a.status, a.code) for a in answers[1:]] == [(404, "not_found")] * 3
    assert gone.cancelled()


async def test_a_request_that_fails_fails_its_heartbeats_and_the_next_goes_out():
    client = HeldClient({1, 2})
    batcher = HeartbeatBatcher(client)
    client.failure = BrokerUnreachable("POST /heartbeats: no answer (timed out)")
    failed = asyncio.ensure_future(batcher.beat(1))
    await sent(client, 1)
    waiting = asyncio.ensure_future(batcher.beat(2))
    client.answer()
    with pytest.raises(BrokerUnreachable):
        await failed
    client.failure = None
    await sent(client, 2)
    client.answer()
    assert (await waiting)["id"] == 2


async def test_a_broker_without_the_route_is_sent_one_heartbeat_per_slice():
    client = HeldClient({1, 2}, route=False)
    batcher = HeartbeatBatcher(client)
    answers = await asyncio.gather(*(batcher.beat(i) for i in (1, 2, 3)), return_exceptions=True)
    assert [a["id"] for a in answers[:2]] == [1, 2]
    assert answers[2].status == 404
    assert client.singles == [1, 2, 3]
    await batcher.beat(1)
    assert client.singles == [1, 2, 3, 1] and client.sent == []  # it does not ask again
