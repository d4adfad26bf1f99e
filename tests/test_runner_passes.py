"""A submission is granted at once by a pass right after its group commit: the runner
takes that pass in as any pass (metrics, news, the live copy) and runs no second one
for it; one pass serves every submission of a group."""

from __future__ import annotations

import asyncio
import contextlib
import tomllib
from collections.abc import AsyncIterator

import pytest
from servicefixtures import TEST_CONFIG

from broker.config import parse_config
from broker.core.model import Node
from broker.service.runner import BrokerRunner
from broker.store import Broker, Principal
from tests.test_group_commit import while_busy


@pytest.fixture
async def runner(tmp_path) -> AsyncIterator[BrokerRunner]:
    """The service's runner, started, on a SQLite file; deadlines far off (a 2-hour
    lease, 1-hour batch protection) against a timed pass every 10 minutes, so that
    nothing falls due before the loop looks again."""
    broker = Broker(
        f"sqlite:///{tmp_path / 'b.sqlite'}",
        parse_config(tomllib.loads(TEST_CONFIG)),
        lease=7200.0,
        single_writer=True,
    )
    runner = BrokerRunner(broker, pass_interval=600.0, grant_at_once=True)
    runner.start()
    await runner.started()
    yield runner
    await runner.stop()


def submit(runner: BrokerRunner, gpus: int = 1):
    return runner.submit(
        runner.broker.submit,
        principal=Principal("alice"),
        project="vision",
        gpus=gpus,
        kind="batch",
    )


async def test_a_submission_granted_at_once_is_the_pass(runner):
    passes = runner.passes
    made = await submit(runner)
    assert made["state"] == "granted"
    assert runner.passes == passes + 1  # the submission's own pass, taken in
    assert runner.remembered(made["id"])["state"] == "granted"
    assert not runner.pass_requested  # and no second pass asked for it
    # A release is a change: the loop's pass is asked for. Until it runs, what the
    # service remembers for an outage is the pass's map less the released slice.
    await runner.change(runner.broker.release, made["id"])
    assert runner.pass_requested
    assert runner.remembered(made["id"]) is None and runner.remembered_live() == []
    before = runner.passes
    await runner.run_pass()  # the loop's pass, as it will run it: one more
    assert runner.passes == before + 1


async def test_one_pass_after_a_group_commit_serves_all_its_submissions(runner):
    passes = runner.passes
    answers = await while_busy(runner, [submit(runner, gpus=4) for _ in range(3)])
    # Two 4-GPU nodes: the pass grants two and queues the third.
    assert [a["state"] for a in answers] == ["granted", "granted", "pending"]
    assert answers[2]["queue_position"] is not None  # its place, as the pass left it
    assert runner.passes == passes + 1
    assert not runner.pass_requested


async def test_readers_of_a_shared_read_wait_for_one_computation(runner):
    calls: list[int] = []

    def projects() -> list:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the database hiccuped")
        return runner.broker.projects()

    failed = await asyncio.gather(
        *(runner.read_between_passes(projects) for _ in range(5)), return_exceptions=True
    )
    assert [str(answer) for answer in failed] == ["the database hiccuped"] * 5
    answers = await asyncio.gather(*(runner.read_between_passes(projects) for _ in range(20)))
    assert len(calls) == 2  # one failed computation, not kept; then one for twenty readers
    assert all(answer == answers[0] for answer in answers)


def what_if_runner(
    tmp_path, now: list[float], share: float, work: list[float] | None = None
) -> BrokerRunner:
    """A runner on a single writer whose clock is ``now[0]``, with a 1 s interval of
    which what-ifs may take ``share`` (not started: the tests drive its passes). It
    counts the database thread's work as ``work[0]`` seconds, which the computations
    of :func:`what_ifs` move (a sleep would be overshot on a loaded machine)."""
    work = [0.0] if work is None else work
    broker = Broker(
        f"sqlite:///{tmp_path / 'b.sqlite'}",
        parse_config(tomllib.loads(TEST_CONFIG)),
        single_writer=True,
    )
    return BrokerRunner(
        broker,
        pass_interval=1.0,
        what_if_share=share,
        clock=lambda: now[0],
        work_clock=lambda: work[0],
    )


def what_ifs(calls: list[str], work: list[float]):
    """``what_if(name, seconds)``: a computation that takes ``seconds`` of the database
    thread (counted in ``work[0]``) and answers ``"<name> #<how many times it ran>"``."""

    def what_if(name: str, seconds: float):
        def compute() -> str:
            calls.append(name)
            work[0] += seconds  # the work itself, on the database thread
            return f"{name} #{calls.count(name)}"

        return compute

    return what_if


async def test_what_if_reads_past_their_share_of_the_interval_answer_again_as_last_computed(
    tmp_path,
):
    now = [1000.0]
    # A 1 s interval of which what-ifs may take a tenth: 100 ms.
    work = [0.0]
    runner = what_if_runner(tmp_path, now, 0.1, work)
    calls: list[str] = []
    what_if = what_ifs(calls, work)

    def checks(name: str):
        return lambda: f"{name}: checked, nothing computed"

    try:
        answer = await runner.read_what_if(what_if("a", 0.15), "a", checks("a"))
        assert answer == ("a #1", False)
        await submit(runner)  # a change: nothing is shared any more
        # The share is spent: "a" is answered again as it was, "b" (never asked) is
        # checked only; neither is computed.
        assert await runner.read_what_if(what_if("a", 0.0), "a", checks("a")) == ("a #1", True)
        assert await runner.read_what_if(what_if("b", 0.0), "b", checks("b")) == (
            "b: checked, nothing computed",
            True,
        )
        assert calls == ["a"]
        # 0.15 s spent of 0.1 s: 0.05 s owed, earned back at 0.1 s a second.
        now[0] += 0.4  # 0.04 s of it: still owed, nothing computed
        assert await runner.read_what_if(what_if("b", 0.0), "b", checks("b")) == (
            "b: checked, nothing computed",
            True,
        )
        now[0] += 1.1  # paid, and the most credit earned: "b" computed, "a" refreshed
        assert await runner.read_what_if(what_if("b", 0.0), "b", checks("b")) == ("b #1", False)
        assert await runner.read_what_if(what_if("a", 0.0), "a", checks("a")) == ("a #2", False)
        # Time overspent is owed, not forgotten when the next interval starts: 0.25 s
        # spent leaves 0.15 s owed, earned back in 1.5 s.
        await submit(runner)  # a change: nothing shared
        assert await runner.read_what_if(what_if("c", 0.25), "c", checks("c")) == ("c #1", False)
        now[0] += 1.0
        assert await runner.read_what_if(what_if("b", 0.0), "b", checks("b")) == ("b #1", True)
        now[0] += 1.2  # the 0.05 s owed paid, and over half the most earned: refreshed
        assert await runner.read_what_if(what_if("b", 0.0), "b", checks("b")) == ("b #2", False)
    finally:
        await runner.stop()


async def test_what_if_answers_are_shared_across_passes_that_decide_nothing(tmp_path):
    """A what-if pass asks the snapshot the last pass saw: a pass that decided
    nothing leaves it as it was, one that granted does not, and neither does time
    (a minute at most)."""
    now = [1000.0]
    runner = what_if_runner(tmp_path, now, 1.0)
    calls: list[str] = []

    def compute() -> str:
        calls.append("a")
        return f"a #{len(calls)}"

    async def ask() -> tuple[str, bool]:
        return await runner.read_what_if(compute, "a", lambda: "checked")

    try:
        await runner.run_pass()
        assert await ask() == ("a #1", False)
        await runner.run_pass()  # nothing to decide
        now[0] += 30.0
        await runner.run_pass()
        assert await ask() == ("a #1", False) and calls == ["a"]
        # A pass that grants: asked again.
        await runner.write(
            runner.broker.submit,
            principal=Principal("alice"),
            project="vision",
            gpus=1,
            kind="batch",
        )
        assert not runner.pass_requested  # a plain write asks for no pass: the one below
        await runner.run_pass()
        assert await ask() == ("a #2", False)
        # Past a minute, even passes that decide nothing do not share it longer.
        now[0] += 61.0
        await runner.run_pass()
        assert await ask() == ("a #3", False)
        # A change outside a request (an inventory's new nodes) asks for a pass: the
        # answer is not shared across it.
        await runner.run(runner.broker.sync_inventory, [Node("n9", "h100", 8)])
        runner.request_pass()
        assert await ask() == ("a #4", False)
    finally:
        await runner.stop()


async def test_low_on_what_if_credit_first_answers_come_before_refreshes(tmp_path):
    """A request never answered is worth more than a fresher answer to one that has
    one: below half its most, the credit goes to first answers only."""
    now = [1000.0]
    # At most 0.1 s of credit: refreshes need 0.05 s of it.
    work = [0.0]
    runner = what_if_runner(tmp_path, now, 0.1, work)
    what_if = what_ifs([], work)

    try:
        assert await runner.read_what_if(what_if("a", 0.07), "a", list) == ("a #1", False)
        await submit(runner)  # a change: nothing shared
        # About 0.03 s left: "a" has an answer and gets it again; "b" has none yet.
        assert await runner.read_what_if(what_if("a", 0.0), "a", list) == ("a #1", True)
        assert await runner.read_what_if(what_if("b", 0.0), "b", list) == ("b #1", False)
        now[0] += 0.5  # 0.05 s earned back: enough for a refresh
        assert await runner.read_what_if(what_if("a", 0.0), "a", list) == ("a #2", False)
    finally:
        await runner.stop()


async def test_stop_ends_the_loop_even_when_a_call_drops_the_cancellation(tmp_path, monkeypatch):
    # Python 3.11's asyncio.wait_for returns its call's result and drops the
    # cancellation when both come at once; the pass here does so every time.
    broker = Broker(f"sqlite:///{tmp_path / 'b.sqlite'}", parse_config(tomllib.loads(TEST_CONFIG)))
    runner = BrokerRunner(broker, pass_interval=600.0, grant_at_once=True)
    in_pass = asyncio.Event()
    finish = asyncio.get_running_loop().create_future()
    the_pass = runner.run_pass

    async def pass_dropping_the_cancellation():
        in_pass.set()
        with contextlib.suppress(asyncio.CancelledError):
            await finish
        return await the_pass()

    monkeypatch.setattr(runner, "run_pass", pass_dropping_the_cancellation)
    runner.start()
    await in_pass.wait()
    stopping = asyncio.create_task(runner.stop())
    done, _ = await asyncio.wait({stopping}, timeout=10)  # not the timed pass, 600 s away
    assert stopping in done
