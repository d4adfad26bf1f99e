"""Group commit (design.md §8): writes that queue while the database thread is busy
share one transaction; a write refused after it wrote is undone with the group, which
runs again without it; each is answered only once committed."""

from __future__ import annotations

import asyncio
import threading
import tomllib
from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servicefixtures import TEST_CONFIG
from sqlalchemy import event, text
from sqlalchemy.exc import DBAPIError

from broker.config import parse_config
from broker.errors import Forbidden
from broker.orm import LedgerRow
from broker.service.runner import BrokerRunner
from broker.store import Broker
from broker.store.access import Principal
from broker.store.journal import is_durable, not_durable


@pytest.fixture
async def runner(tmp_path) -> AsyncIterator[BrokerRunner]:
    broker = Broker(
        f"sqlite:///{tmp_path / 'b.sqlite'}",
        parse_config(tomllib.loads(TEST_CONFIG)),
        single_writer=True,
    )
    runner = BrokerRunner(broker, pass_interval=600.0)
    yield runner
    await runner.stop()


def count_events(broker: Broker, name: str) -> list[int]:
    """A counter of the engine's ``name`` events (``commit``, ``rollback``) from now."""
    seen = [0]

    def happened(_connection) -> None:
        seen[0] += 1

    event.listen(broker.journal.engine, name, happened)
    return seen


def count_commits(broker: Broker) -> list[int]:
    return count_events(broker, "commit")


async def while_busy(runner: BrokerRunner, writes) -> list:
    """Queue ``writes`` while the database thread is held, then let it go: they
    queue together, as requests do while a pass or another commit runs."""
    go = threading.Event()
    held = asyncio.ensure_future(runner.run(go.wait))
    tasks = [asyncio.ensure_future(write) for write in writes]
    await asyncio.sleep(0)  # every task has queued its write
    go.set()
    await held
    return await asyncio.gather(*tasks, return_exceptions=True)


def fail_the_next_flush(broker: Broker, error: Exception) -> None:
    """The next flush of a durable write raises ``error`` once it has written."""
    failures = [error]

    def fails_once(_session, _context) -> None:
        if failures:
            raise failures.pop()

    event.listen(broker.journal.sessions, "after_flush", fails_once)


def submit(runner: BrokerRunner, user: str = "alice", project: str = "vision"):
    return runner.write(
        runner.broker.submit, principal=Principal(user), project=project, gpus=1, kind="batch"
    )


async def test_writes_queued_together_share_one_commit(runner):
    commits = count_commits(runner.broker)
    answers = await while_busy(runner, [submit(runner) for _ in range(20)])
    assert [a["state"] for a in answers] == ["pending"] * 20
    assert len({a["id"] for a in answers}) == 20
    assert commits[0] == 1
    assert len(runner.broker.list_slices()) == 20


async def test_a_write_refused_before_it_wrote_leaves_its_group_whole(runner):
    commits, rollbacks = count_commits(runner.broker), count_events(runner.broker, "rollback")
    answers = await while_busy(
        runner, [submit(runner), submit(runner, user="mallory"), submit(runner)]
    )
    assert isinstance(answers[1], Forbidden)
    assert (commits[0], rollbacks[0]) == (1, 0)  # nothing to undo: the group runs once
    assert [a["id"] for a in answers[0::2]] == [1, 2]
    assert [s["user"] for s in runner.broker.list_slices()] == ["alice", "alice"]


async def test_a_failed_commit_fails_every_write_in_it_and_keeps_none(runner):
    def fail(_session) -> None:
        raise RuntimeError("the disk is full")

    event.listen(runner.broker.journal.sessions, "before_commit", fail)
    answers = await while_busy(runner, [submit(runner) for _ in range(3)])
    assert [str(a) for a in answers] == ["the disk is full"] * 3
    event.remove(runner.broker.journal.sessions, "before_commit", fail)
    assert runner.broker.list_slices() == []
    again = await submit(runner)  # the next group starts afresh
    assert again["state"] == "pending"


async def test_heartbeats_commit_apart_from_durable_writes(runner):
    made = await submit(runner)
    commits = count_commits(runner.broker)
    beat = runner.write(runner.broker.heartbeat, made["id"])
    answers = await while_busy(runner, [submit(runner), beat, submit(runner)])
    assert [a["id"] for a in answers] == [2, 1, 3]
    assert answers[1]["lease_expires_at"] is not None
    assert commits[0] == 2  # one for the submissions, one for the heartbeat
    # said once, on the Broker's methods: the runner groups by it
    assert [is_durable(m) for m in (Broker.heartbeat, Broker.checkpoint, Broker.release)] == [
        False,
        False,
        True,
    ]


async def test_a_group_of_heartbeats_renews_its_leases_in_one_statement(runner):
    """Heartbeats queued together cost the database one UPDATE, not one each; each
    is answered its own slice, and one refused (another user's slice) is refused
    alone, with nothing written for it."""
    made = [await submit(runner) for _ in range(3)]
    bobs = await submit(runner, user="bob")
    statements: list[str] = []

    def executed(_conn, _cursor, statement, *_args) -> None:
        statements.append(" ".join(statement.split()))

    event.listen(runner.broker.journal.engine, "before_cursor_execute", executed)
    beats = [
        runner.write(runner.broker.heartbeat, m["id"], caller=Principal("alice")) for m in made
    ]
    stranger = runner.write(runner.broker.heartbeat, bobs["id"], caller=Principal("alice"))
    answers = await while_busy(runner, [*beats, stranger])
    event.remove(runner.broker.journal.engine, "before_cursor_execute", executed)
    assert [a["id"] for a in answers[:3]] == [m["id"] for m in made]
    assert len({a["lease_expires_at"] for a in answers[:3]}) == 1  # one renewal, one time
    assert isinstance(answers[3], Forbidden)
    assert sum(s.startswith("UPDATE slices") for s in statements) == 1
    assert runner.broker.get_slice(bobs["id"])["lease_expires_at"] == bobs["lease_expires_at"]
    for answer in answers[:3]:
        assert runner.broker.get_slice(answer["id"]) == answer


async def test_a_group_s_heartbeat_statement_that_fails_fails_each_of_them_and_keeps_nothing(
    runner,
):
    """The heartbeats' one UPDATE fails: each of them is answered the error, the leases
    kept in memory are those the database has (it is read again), and the next
    heartbeat renews as usual."""
    made = [await submit(runner) for _ in range(2)]
    before = {m["id"]: runner.broker.get_slice(m["id"])["lease_expires_at"] for m in made}
    failures = [RuntimeError("the disk is full")]

    def fails_once(_conn, _cursor, statement, *_args) -> None:
        if statement.startswith("UPDATE slices") and failures:
            raise failures.pop()

    event.listen(runner.broker.journal.engine, "before_cursor_execute", fails_once)
    beats = [runner.write(runner.broker.heartbeat, m["id"]) for m in made]
    answers = await while_busy(runner, beats)
    event.remove(runner.broker.journal.engine, "before_cursor_execute", fails_once)
    assert [str(a) for a in answers] == ["the disk is full"] * 2
    assert {i: runner.broker.get_slice(i)["lease_expires_at"] for i in before} == before
    again = await runner.write(runner.broker.heartbeat, made[0]["id"])
    assert runner.broker.get_slice(made[0]["id"]) == again


async def test_heartbeats_whose_commit_fails_keep_no_lease_in_memory(runner):
    """The heartbeats' UPDATE went through and their commit failed: the leases kept
    in memory are those the database has, not the renewed ones."""
    made = [await submit(runner) for _ in range(2)]
    before = {m["id"]: runner.broker.get_slice(m["id"])["lease_expires_at"] for m in made}
    failures = [RuntimeError("the disk is full")]

    def fails_once(_conn) -> None:
        if failures:
            raise failures.pop()

    event.listen(runner.broker.journal.engine, "commit", fails_once)
    answers = await while_busy(runner, [runner.write(runner.broker.heartbeat, i) for i in before])
    event.remove(runner.broker.journal.engine, "commit", fails_once)
    assert [str(a) for a in answers] == ["the disk is full"] * 2
    assert {i: runner.broker.get_slice(i)["lease_expires_at"] for i in before} == before


async def test_a_write_refused_after_it_wrote_is_undone_and_the_others_run_again(db_url):
    """On SQLite and PostgreSQL: a write refused after it had written (its flush
    failed) spoils its group, which is rolled back whole and run again without it;
    the writes before and after it are committed, the kept slices stay whole, and
    no savepoint is ever sent (on PostgreSQL each would be a round trip)."""
    broker = Broker(db_url, parse_config(tomllib.loads(TEST_CONFIG)), single_writer=True)
    runner = BrokerRunner(broker, pass_interval=600.0, grant_at_once=True)
    statements: list[str] = []

    def record(_conn, _cursor, statement, *_args) -> None:
        statements.append(statement)

    try:
        held = await runner.submit(
            broker.submit, principal=Principal("alice"), project="vision", gpus=1, kind="batch"
        )
        assert held["state"] == "granted"
        event.listen(broker.journal.engine, "before_cursor_execute", record)
        rollbacks = count_events(broker, "rollback")
        # The release is written and flushed, then its flush fails: it is undone,
        # and the slice still holds its GPU.
        before = submit(runner)

        def fails_a_charge(session, _context) -> None:
            if any(isinstance(row, LedgerRow) for row in session.new):
                raise RuntimeError("the disk is full")

        event.listen(broker.journal.sessions, "after_flush", fails_a_charge)
        release = runner.write(broker.release, held["id"])
        again = runner.submit(
            broker.submit, principal=Principal("alice"), project="vision", gpus=1, kind="batch"
        )
        answers = await while_busy(runner, [before, release, again])
        event.remove(broker.journal.sessions, "after_flush", fails_a_charge)
        assert str(answers[1]) == "the disk is full"
        assert answers[0]["state"] == "pending" and answers[2]["state"] == "granted"
        assert rollbacks[0] >= 1
        await runner.run_pass()
        live = [held["id"], answers[0]["id"], answers[2]["id"]]
        assert [s["id"] for s in runner.remembered_live()] == live
        assert runner.remembered(held["id"])["state"] == "granted"
        reader = Broker(db_url, parse_config(tomllib.loads(TEST_CONFIG)))
        try:  # what the database has
            assert sorted(s["id"] for s in reader.list_slices(state="live")) == sorted(live)
            assert [e["to_state"] for e in reader.events(held["id"])] == ["pending", "granted"]
            assert len(reader.list_slices()) == 3
        finally:
            reader.close()
        assert not [s for s in statements if "SAVEPOINT" in s]
    finally:
        await runner.stop()


async def test_a_charge_undone_with_its_group_leaves_no_trace_in_the_kept_usage(tmp_path):
    """The window's closed charges follow the live slices' rule: a release whose
    charge was flushed and then undone is not counted by the single writer, whose
    usage stays that of a Broker reading everything from the database."""
    url = f"sqlite:///{tmp_path / 'b.sqlite'}"
    config = parse_config(tomllib.loads(TEST_CONFIG))
    clock = [1_700_000_000.0]
    broker = Broker(url, config, lambda: clock[0], single_writer=True)
    runner = BrokerRunner(broker, pass_interval=600.0, grant_at_once=True)
    reader = Broker(url, config, lambda: clock[0])
    try:
        held = await runner.submit(
            broker.submit, principal=Principal("alice"), project="vision", gpus=1, kind="batch"
        )
        ended = await runner.submit(
            broker.submit, principal=Principal("alice"), project="vision", gpus=1, kind="batch"
        )
        clock[0] += 600.0
        await runner.write(broker.release, ended["id"])  # a charge kept by the writer
        clock[0] += 600.0
        fail_the_next_flush(broker, RuntimeError("the disk is full"))
        release = runner.write(broker.release, held["id"])
        answers = await while_busy(runner, [release])
        assert str(answers[0]) == "the disk is full"
        await runner.run_pass()

        def usage(of: Broker) -> dict:
            return {p["name"]: p["usage"] for p in of.projects()}

        # 600 s charged for the first slice, 1,200 s accrued by the one still held
        assert usage(broker)["vision"] == pytest.approx(1800.0)
        assert usage(broker) == usage(reader)
    finally:
        await runner.stop()
        reader.close()


async def test_heartbeats_commit_before_database_work_queued_ahead_of_them(runner):
    """Under load the database thread's queue holds passes and reads; a heartbeat's
    commit goes before them, so that its lease does not lapse while it waits."""
    held = await submit(runner)
    ran: list[str] = []

    @not_durable
    def heartbeat(broker: Broker, slice_id: int) -> dict:
        ran.append("heartbeat")
        return broker.heartbeat(slice_id)

    on_thread, go = threading.Event(), threading.Event()

    def hold() -> None:
        on_thread.set()
        go.wait()

    busy = asyncio.ensure_future(runner.run(hold))
    while not on_thread.is_set():  # the database thread is busy from here on
        await asyncio.sleep(0.01)
    reads = [asyncio.ensure_future(runner.run(ran.append, f"read {i}")) for i in range(3)]
    await asyncio.sleep(0)  # the reads are queued first
    beat = asyncio.ensure_future(runner.write(heartbeat, runner.broker, held["id"]))
    while not runner._writes[False]:  # queued behind the reads
        await asyncio.sleep(0.01)
    go.set()
    await busy
    await asyncio.gather(*reads)
    assert (await beat)["id"] == held["id"]
    assert ran == ["heartbeat", "read 0", "read 1", "read 2"]


def test_a_write_that_may_be_lost_skips_only_its_own_flush_to_disk(db_url):
    """A not durable write commits without waiting for the disk (PostgreSQL's
    ``synchronous_commit`` off, set with the write lock; SQLite's ``synchronous``
    NORMAL); a durable one, in the same connection afterwards, waits again."""
    broker = Broker(db_url, parse_config(tomllib.loads(TEST_CONFIG)))
    postgres = db_url.startswith("postgresql")
    setting = "SHOW synchronous_commit" if postgres else "PRAGMA synchronous"
    try:
        seen = []
        for durable in (False, True, False):
            with broker.journal.write(durable=durable) as session:
                seen.append(session.connection().exec_driver_sql(setting).scalar())
        assert seen == (["off", "on", "off"] if postgres else [1, 2, 1])
    finally:
        broker.close()


async def test_a_spoiled_group_runs_again_without_writes_nobody_waits_for(runner):
    """A write abandoned while its group ran (its client gave up) is not run again
    when the group is: it never happens, and the others do."""
    held = await submit(runner)
    await runner.run_pass()  # granted: its release writes a charge
    go = threading.Event()
    busy = asyncio.ensure_future(runner.run(go.wait))
    release = asyncio.ensure_future(runner.write(runner.broker.release, held["id"]))
    first, given_up = asyncio.ensure_future(submit(runner)), asyncio.ensure_future(submit(runner))
    await asyncio.sleep(0)  # all three queued together
    queued = list(runner._writes[True])
    assert len(queued) == 3  # else the group under test is not the one built here

    def fails_a_charge(session, _context) -> None:
        if any(isinstance(row, LedgerRow) for row in session.new):
            queued[2].abandoned = True  # its client times out meanwhile
            raise RuntimeError("the disk is full")

    event.listen(runner.broker.journal.sessions, "after_flush", fails_a_charge)
    go.set()
    await busy
    with pytest.raises(RuntimeError, match="the disk is full"):
        await release
    made = await first
    event.remove(runner.broker.journal.sessions, "after_flush", fails_a_charge)
    assert [s["id"] for s in runner.broker.list_slices()] == [held["id"], made["id"]]
    given_up.cancel()


async def test_a_write_whose_statement_fails_spoils_its_group_even_before_it_wrote(db_url):
    """A statement the database refuses leaves PostgreSQL's transaction aborted, even
    a read: the group is run again without that write, so the writes around it are
    committed, not lost with the aborted transaction (on both databases)."""
    broker = Broker(db_url, parse_config(tomllib.loads(TEST_CONFIG)), single_writer=True)
    runner = BrokerRunner(broker, pass_interval=600.0)

    def fails_to_read() -> None:
        with broker.journal.write() as session:
            session.execute(text("SELECT * FROM no_such_table"))  # refused: writes nothing

    try:
        answers = await while_busy(
            runner, [submit(runner), runner.write(fails_to_read), submit(runner)]
        )
        assert isinstance(answers[1], DBAPIError)
        assert answers[0]["state"] == answers[2]["state"] == "pending"
        reader = Broker(db_url, parse_config(tomllib.loads(TEST_CONFIG)))
        try:
            assert sorted(s["id"] for s in reader.list_slices()) == sorted(
                [answers[0]["id"], answers[2]["id"]]
            )
        finally:
            reader.close()
    finally:
        await runner.stop()


# One group's writes, each of a kind: a submission; another user's, refused before
# it writes; a release; a release whose charge fails once written; a write whose
# read the database refuses.
GROUP_STEPS = st.lists(
    st.sampled_from(["submit", "stranger", "release", "charge fails", "read fails"]),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=GROUP_STEPS)
def test_a_group_commits_exactly_the_writes_it_answers_done(db_url, steps):
    """Whatever a group holds, the database ends with the writes answered done and
    none of those refused, and the single writer's kept slices answer as a Broker
    that reads them (on both databases)."""
    asyncio.run(_run_one_group(db_url, steps))


async def _run_one_group(db_url: str, steps: list[str]) -> None:
    config = parse_config(tomllib.loads(TEST_CONFIG))
    clock = [1_700_000_000.0]  # one instant: both Brokers charge held slices to it
    broker = Broker(db_url, config, lambda: clock[0], single_writer=True)
    runner = BrokerRunner(broker, pass_interval=600.0)
    reader = Broker(db_url, config, lambda: clock[0])
    try:
        releases = [step for step in steps if step in ("release", "charge fails")]
        held = [await submit(runner) for _ in releases]
        await runner.run_pass()
        doomed = {s["id"] for s, step in zip(held, releases, strict=True) if step == "charge fails"}

        def fails_a_doomed_charge(session, _context) -> None:
            if any(isinstance(r, LedgerRow) and r.slice_id in doomed for r in session.new):
                raise RuntimeError("the disk is full")

        def fails_to_read() -> None:
            with broker.journal.write() as session:
                session.execute(text("SELECT * FROM no_such_table"))

        to_release = iter(held)
        writes = []
        for step in steps:
            if step == "submit":
                writes.append(submit(runner))
            elif step == "stranger":
                writes.append(submit(runner, user="mallory"))
            elif step == "read fails":
                writes.append(runner.write(fails_to_read))
            else:
                writes.append(runner.write(broker.release, next(to_release)["id"]))
        before = {s["id"] for s in reader.list_slices()}
        event.listen(broker.journal.sessions, "after_flush", fails_a_doomed_charge)
        answers = await while_busy(runner, writes)
        event.remove(broker.journal.sessions, "after_flush", fails_a_doomed_charge)
        expected = {
            "submit": dict, "stranger": Forbidden, "release": dict,
            "charge fails": RuntimeError, "read fails": DBAPIError,
        }  # fmt: skip
        for step, answer in zip(steps, answers, strict=True):
            assert isinstance(answer, expected[step]), (step, answer)
        # New rows: exactly the submissions answered done.
        made = {a["id"] for step, a in zip(steps, answers, strict=True) if step == "submit"}
        states = {s["id"]: s["state"] for s in reader.list_slices()}
        assert set(states) - before == made
        for slice_ in held:
            assert states[slice_["id"]] == ("granted" if slice_["id"] in doomed else "ended")
        assert broker.list_slices() == reader.list_slices()
    finally:
        for live in reader.list_slices(state="live"):  # the next example: an empty cluster
            reader.release(live["id"])
        await runner.stop()
        reader.close()
