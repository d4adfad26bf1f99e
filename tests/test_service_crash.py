"""Kill the service with SIGKILL at random moments under load; nothing is lost or doubled.

Two client threads send streams of requests (submit, release, heartbeat, long
poll, list) for three users in two projects, with short contracts so that
grants, preemptions, grace periods, requeues, max runtimes and lost leases all
happen. Meanwhile the service is killed with SIGKILL at a random moment once
it has answered a few requests, and started again, 20 times; the stream then
runs on until it has granted, charged, released and preempted enough for the
checks (counts, not a set time). Afterwards the database must tell a
consistent story:

- every slice a client was told about (201) exists;
- no GPU was ever held by two slices at once (holds rebuilt from slice_events);
- every slice's events follow the state machine and end in its current state;
- charges match held time: each ledger row is a hold of the slice, and each
  slice's charge equals its holds' weighted GPU-seconds, within 1 s.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import requests
from servicefixtures import TEST_CONFIG, BrokerService, make_service
from sqlalchemy import func, select

from broker.orm import READ_ONLY_OPTION, LedgerRow, SliceEventRow, SliceRow, make_engine

KILLS = 20
ANSWERS_PER_LIFE = 6  # requests the service answers after each start before it may be killed
SEED = 20240611

CONFIG = TEST_CONFIG.replace('grace_period = "2s"', 'grace_period = "0.3s"')

#: Transitions a slice may make (``None``: its submission).
TRANSITIONS = {
    (None, "pending"),
    ("pending", "granted"),
    ("pending", "ended"),
    ("granted", "preempting"),
    ("granted", "ended"),
    ("granted", "pending"),
    ("preempting", "ended"),
    ("preempting", "pending"),
}
HELD = ("granted", "preempting")


@dataclass
class Client:
    """Sends a random stream of requests until stopped; remembers what it was told."""

    service: BrokerService
    tokens: dict[str, str]
    rng: random.Random
    created: set[int] = field(default_factory=set)
    answered: int = 0
    failed: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as err:  # reported by the test, not lost with the thread
            self.error = err

    def _run(self) -> None:
        session = requests.Session()
        live: dict[int, str] = {}  # slice id -> user, as far as the client knows
        while not self.stop.is_set():
            try:
                self._one(session, live)
                self.answered += 1
            except requests.RequestException:
                self.failed += 1
                session.close()
                session = requests.Session()
                self.stop.wait(0.02)  # the service is down: do not spin

    def _one(self, session: requests.Session, live: dict[int, str]) -> None:
        rng = self.rng
        user = rng.choice(list(self.tokens))
        headers = {"Authorization": f"token {self.tokens[user]}"}
        url = self.service.api_url
        action = rng.choices(["submit", "release", "beat", "poll", "list"], [5, 3, 3, 1, 1])[0]
        mine = [i for i, owner in live.items() if owner == user]
        if action == "submit" or not mine:
            body = self._request(user)
            reply = session.post(f"{url}/slices", json=body, headers=headers, timeout=3)
            if reply.status_code == 201:
                self.created.add(reply.json()["id"])
                live[reply.json()["id"]] = user
            else:
                assert reply.status_code < 500, reply.text
            return
        slice_id = rng.choice(mine)
        if action == "release":
            reply = session.delete(f"{url}/slices/{slice_id}", headers=headers, timeout=3)
            live.pop(slice_id, None)
        elif action == "beat":
            reply = session.post(f"{url}/slices/{slice_id}/heartbeat", headers=headers, timeout=3)
        elif action == "poll":
            params = {"wait": 0.2}
            reply = session.get(
                f"{url}/slices/{slice_id}", params=params, headers=headers, timeout=3
            )
        else:
            reply = session.get(
                f"{url}/slices", params={"state": "live"}, headers=headers, timeout=3
            )
        assert reply.status_code == 200, reply.text
        if action in ("beat", "poll") and reply.json()["state"] == "ended":
            live.pop(slice_id, None)

    def _request(self, user: str) -> dict:
        rng = self.rng
        project = "nlp" if user == "carol" else "vision"
        kind = rng.choice(["batch", "batch", "interactive"])
        body = {
            "project": project,
            "kind": kind,
            "gpus": rng.choice([1, 1, 2, 4]) if kind == "interactive" else rng.choice([1, 2, 4]),
            "min_runtime": rng.choice([0, 0.3, 0.8, 1.5]),
            "resumable": kind == "batch" and rng.random() < 0.7,
        }
        if rng.random() < 0.6:
            body["max_runtime"] = body["min_runtime"] + rng.choice([0.5, 1.0, 2.0])
        return body


@dataclass
class Hold:
    slice_id: int
    start: float
    gpus: list[tuple[str, int]]
    end: float = math.inf


GRANTED_ON = re.compile(r"(\S+?)\[([\d, ]*)\]")


def _granted_gpus(reason: str) -> list[tuple[str, int]]:
    # The event's reason reads "granted on n0[0, 1], n1[3]" (see Broker._apply).
    where = reason.removeprefix("granted on ")
    return [
        (node, int(index))
        for node, indices in GRANTED_ON.findall(where)
        for index in indices.split(",")
        if index.strip()
    ]


def _read(db_url: str):
    engine = make_engine(db_url)
    try:
        with engine.connect() as connection:
            slices = {row.id: row for row in connection.execute(select(SliceRow)).all()}
            events = connection.execute(select(SliceEventRow).order_by(SliceEventRow.id)).all()
            ledger = connection.execute(select(LedgerRow).order_by(LedgerRow.id)).all()
    finally:
        engine.dispose()
    return slices, events, ledger


def _holds(slices, events) -> dict[int, list[Hold]]:
    """Each slice's holds, rebuilt from its events; checks the state machine on the way."""
    holds: dict[int, list[Hold]] = defaultdict(list)
    last_state: dict[int, str] = {}
    for event in events:
        before = last_state.get(event.slice_id)
        assert before == event.from_state, f"slice {event.slice_id}: {before} then {event}"
        assert (event.from_state, event.to_state) in TRANSITIONS, event
        if event.to_state == "granted" and event.from_state == "pending":
            gpus = _granted_gpus(event.reason)
            assert gpus, event.reason
            holds[event.slice_id].append(Hold(event.slice_id, event.at, gpus))
        elif event.from_state in HELD and event.to_state not in HELD:
            hold = holds[event.slice_id][-1]
            assert hold.end == math.inf
            hold.end = event.at
        last_state[event.slice_id] = event.to_state
    for slice_id, row in slices.items():
        assert last_state.get(slice_id) == row.state, f"slice {slice_id} events disagree"
        open_holds = [h for h in holds[slice_id] if h.end == math.inf]
        if row.state in HELD:
            placed = sorted((p["node"], i) for p in row.placements for i in p["gpu_indices"])
            assert len(open_holds) == 1 and sorted(open_holds[0].gpus) == placed, slice_id
        else:
            assert not open_holds, slice_id
    return holds


def _check_no_gpu_held_twice(holds: dict[int, list[Hold]]) -> int:
    """Raise unless holds of one GPU never overlap; the number of holds."""
    by_gpu: dict[tuple[str, int], list[Hold]] = defaultdict(list)
    for hold in (h for hs in holds.values() for h in hs):
        for gpu in hold.gpus:
            by_gpu[gpu].append(hold)
    for gpu, gpu_holds in by_gpu.items():
        gpu_holds.sort(key=lambda h: (h.start, h.end))
        for earlier, later in itertools.pairwise(gpu_holds):
            assert later.start >= earlier.end, (
                f"GPU {gpu} held by slices {earlier.slice_id} and {later.slice_id} at once"
            )
    return sum(len(h) for h in holds.values())


def _check_charges(slices, holds, ledger) -> int:
    """Ledger rows are the slice's closed holds; charges are held time × GPUs (weight 1)."""
    rows = defaultdict(list)
    for row in ledger:
        rows[row.slice_id].append(row)
    charged = 0
    for slice_id, slice_row in slices.items():
        closed = [h for h in holds[slice_id] if h.end != math.inf]
        if slice_row.min_runtime == 0:
            assert not rows[slice_id], f"unallocated slice {slice_id} was charged"
            assert slice_row.charged_gpu_seconds == 0
            continue
        entries = sorted(rows[slice_id], key=lambda r: r.start)
        assert len(entries) == len(closed), f"slice {slice_id}: {entries} vs {closed}"
        for entry, hold in zip(entries, closed, strict=True):
            assert abs(entry.start - hold.start) <= 1 and abs(entry.end - hold.end) <= 1
            assert entry.gpus == len(hold.gpus)
            held = (hold.end - hold.start) * len(hold.gpus)
            assert entry.gpu_seconds == pytest.approx(held, abs=len(hold.gpus)), slice_id
        held_total = sum((h.end - h.start) * len(h.gpus) for h in closed)
        assert slice_row.charged_gpu_seconds == pytest.approx(
            held_total, abs=slice_row.gpus * 1.0
        ), slice_id
        charged += len(entries)
    return charged


def _answered(clients: list[Client]) -> int:
    return sum(client.answered for client in clients)


def _until(clients: list[Client], condition: Callable[[], bool], timeout: float = 60) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` s or once a client failed."""
    deadline = time.monotonic() + timeout
    while not condition():
        errors = [client.error for client in clients if client.error is not None]
        assert not errors, errors
        assert time.monotonic() < deadline, f"not reached in {timeout} s"
        time.sleep(0.05)


def _exercised(db_url: str) -> bool:
    """Whether the database shows what the test's checks need: many grants and charges,
    and both releases and preemptions."""
    engine = make_engine(db_url).execution_options(**{READ_ONLY_OPTION: True})
    try:
        with engine.connect() as connection:
            grants = connection.scalar(
                select(func.count()).where(SliceEventRow.to_state == "granted")
            )
            charges = connection.scalar(select(func.count()).select_from(LedgerRow))
            ends = set(connection.scalars(select(SliceRow.end_reason).distinct()))
    finally:
        engine.dispose()
    return grants > 20 and charges > 10 and {"released", "preempted"} <= ends


def test_sigkill_at_random_moments_loses_and_doubles_nothing(tmp_path, db_url):
    rng = random.Random(SEED)
    service = make_service(tmp_path, config=CONFIG, db_url=db_url, lease=2, pass_interval=1)
    tokens = {user: service.token(user) for user in ("alice", "bob", "carol")}
    stop = threading.Event()
    clients = [
        Client(service, {u: tokens[u] for u in users}, random.Random(rng.random()), stop=stop)
        for users in (("alice", "carol"), ("bob", "carol"))
    ]
    threads = [threading.Thread(target=client.run, daemon=True) for client in clients]
    service.start()
    for thread in threads:
        thread.start()
    answered = 0
    try:
        for _ in range(KILLS):
            # Each kill meets load, however slow the machine: the service first answers
            # a few requests after its start, then dies at a random moment.
            target = answered + ANSWERS_PER_LIFE
            _until(clients, lambda target=target: _answered(clients) >= target)
            time.sleep(rng.uniform(0.2, 1.0))  # the random moment of the kill
            service.kill()
            answered = _answered(clients)
            service.start()
        # Run on until the stream has done what the checks below need: counts, not a time.
        _until(clients, lambda: _exercised(db_url), timeout=120)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        service.stop()
    assert [client.error for client in clients] == [None, None]
    assert "Traceback" not in service.log_text()
    answered = _answered(clients)
    failed = sum(client.failed for client in clients)
    assert answered > 100 and failed > 0  # requests did meet the kills

    slices, events, ledger = _read(db_url)
    created = set().union(*(client.created for client in clients))
    assert created <= set(slices), "slices the clients were told about are missing"
    holds = _holds(slices, events)
    granted = _check_no_gpu_held_twice(holds)
    charged = _check_charges(slices, holds, ledger)
    print(f"{len(slices)} slices, {granted} grants, {charged} charged holds, {answered} "
          f"answers, {failed} requests failed on a dead or starting service")  # fmt: skip
    assert granted > 20 and charged > 10  # the run did grant and charge many times
    ends = {row.end_reason for row in slices.values()}
    assert {"released", "preempted"} <= ends, ends  # the stream did exercise the scheduler
