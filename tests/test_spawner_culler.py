"""spawner.culler: idle limits that shrink with demand, one sweep, and the idle-culler hook."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from broker.client import BrokerAPIError
from spawner import culler
from spawner.culler import CullArbiter, Demand, Limits, cull_idle, idle_limit

LIMITS = Limits(timeout=3600, busy_timeout=900, over_share_timeout=300)
NOW = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
ROWS = [
    {"name": "org", "parent": None, "is_project": False, "usage": 100.0},
    {
        "name": "vision",
        "parent": "org",
        "is_project": True,
        "usage": 80.0,
        "entitlement": 0.5,
        "pending": 0,
    },
    {
        "name": "nlp",
        "parent": "org",
        "is_project": True,
        "usage": 20.0,
        "entitlement": 0.5,
        "pending": 3,
    },
]


@pytest.mark.parametrize(
    ("waiting", "over_share", "limit"),
    [
        (0, False, 3600),  # nobody waits: the long limit, whatever the budget
        (0, True, 3600),
        (1, False, 900),  # someone waits: shorter
        (5, True, 300),  # someone waits and the project is over its share: shortest
    ],
)
def test_the_idle_limit_shrinks_with_demand_and_budget(waiting, over_share, limit):
    assert idle_limit(LIMITS, waiting=waiting, over_share=over_share) == limit


def test_each_limit_is_capped_by_the_one_before():
    assert idle_limit(Limits(600, 900, 1200), waiting=1, over_share=True) == 600


def test_demand_counts_waiting_requests_and_projects_over_their_share():
    demand = Demand.from_projects(ROWS)
    assert demand.waiting == 3
    assert demand.over_share == {"vision"}
    assert Demand.from_projects([{**r, "usage": 0.0} for r in ROWS]).over_share == frozenset()


def server(idle_minutes, project="vision", **extra):
    last = (NOW - timedelta(minutes=idle_minutes)).isoformat().replace("+00:00", "Z")
    return {
        "ready": True,
        "pending": None,
        "last_activity": last,
        "started": last,
        "user_options": {"project": project},
        **extra,
    }


class FakeHub:
    def __init__(self, users, fail_for=()):
        self.users = users
        self.stopped = []
        self.fail_for = set(fail_for)

    async def ready_users(self):
        return self.users

    async def stop_server(self, user, server_name):
        if user in self.fail_for:
            raise OSError("hub said no")
        self.stopped.append((user, server_name))


class FakeBroker:
    def __init__(self, rows=ROWS, error=None):
        self.rows, self.error = rows, error

    async def projects(self):
        if self.error:
            raise self.error
        return self.rows


async def test_a_sweep_culls_by_each_sessions_limit():
    hub = FakeHub(
        [
            {"name": "alice", "servers": {"": server(6, "vision"), "big": server(20, "vision")}},
            {"name": "carol", "servers": {"": server(10, "nlp")}},
            {"name": "dave", "servers": {"": server(16, "nlp")}},
            {"name": "erin", "servers": {"": server(90, "nlp", pending="spawn")}},
        ]
    )
    culled = await cull_idle(hub, FakeBroker(), LIMITS, now=NOW)

    # vision is over its share while 3 wait: 5 min; nlp is not: 15 min; pending is never culled.
    assert culled == ["alice", "alice/big", "dave"]
    assert hub.stopped == [("alice", ""), ("alice", "big"), ("dave", "")]


async def test_when_the_broker_cannot_be_read_every_session_gets_the_long_limit():
    hub = FakeHub([{"name": "alice", "servers": {"": server(30), "x": server(61)}}])
    culled = await cull_idle(
        hub, FakeBroker(error=BrokerAPIError(0, "unreachable", "down")), LIMITS, now=NOW
    )
    assert culled == ["alice/x"]


async def test_one_failure_does_not_stop_the_sweep():
    hub = FakeHub(
        [
            {"name": "alice", "servers": {"": server(90)}},
            {"name": "bob", "servers": {"": server(90)}},
        ],
        fail_for={"alice"},
    )
    assert await cull_idle(hub, None, LIMITS, now=NOW) == ["bob"]


async def test_the_sweep_reads_the_clock_from_utcnow(monkeypatch):
    monkeypatch.setattr(culler, "utcnow", lambda: NOW + timedelta(hours=2))
    hub = FakeHub([{"name": "alice", "servers": {"": server(0)}}])
    assert await cull_idle(hub, None, LIMITS) == ["alice"]


@pytest.mark.parametrize(
    ("idle_minutes", "project", "culled"),
    [(4, "vision", False), (6, "vision", True), (14, "nlp", False), (16, "nlp", True)],
)
async def test_the_arbiter_hook_applies_the_limits_for_jupyterhub_idle_culler(
    idle_minutes, project, culled
):
    async def demand():
        return Demand.from_projects(ROWS)

    arbiter = CullArbiter(busy_timeout=900, over_share_timeout=300, demand=demand)
    decision = await arbiter(
        inactive=timedelta(minutes=idle_minutes), inactive_limit=3600, server=server(0, project)
    )
    assert decision is culled


async def test_the_arbiter_reads_the_broker_at_most_once_per_cache_period():
    reads = []

    async def demand():
        reads.append(1)
        return Demand()

    arbiter = CullArbiter(demand=demand, cache_seconds=60)
    for _ in range(3):
        assert not await arbiter(inactive=timedelta(minutes=30), inactive_limit=3600, server={})
    assert len(reads) == 1


def test_the_service_reads_durations():
    app = culler.SliceBrokerCuller()
    app.timeout, app.busy_timeout, app.over_share_timeout = "2h", "10m", 120
    assert app.limits() == Limits(7200, 600, 120)
