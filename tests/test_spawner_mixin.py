"""SliceBrokerMixin's life cycle against an in-memory broker and an in-memory backend.

The backend is a minimal spawner (no processes), so these tests show what the
mixin does for any spawner it sits on — the local one now, a Kubernetes one
later: queue, progress, withdrawal on cancel, poll/stop/state, preemption.

Every answer of the in-memory broker is checked against the service's OpenAPI
document, so the fake cannot drift from the real API unnoticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from types import SimpleNamespace
from typing import Any

import pytest
from jupyterhub.spawner import Spawner, SpawnException
from traitlets import Integer, TraitError, default

from broker.client import BrokerAPIError, BrokerUnreachable
from broker.errors import InvalidRequest
from broker.service.apihandlers import default_handlers
from broker.service.openapi import build_document
from broker.service.schema import validate
from spawner import mixin as mixin_module
from spawner.brokerview import BrokerView
from spawner.local import SliceBrokerSpawner
from spawner.mixin import SliceBrokerMixin
from spawner.notices import describe
from spawner.options import SliceRequest

PROJECTS = [
    {
        "name": "root",
        "parent": None,
        "share": 1.0,
        "entitlement": 1.0,
        "is_project": False,
        "usage": 100.0,
        "fairshare_value": 1.0,
        "rank": None,
        "users": [],
        "groups": [],
        "pending": 0,
        "gpus_held": 2,
    },
    {
        "name": "vision",
        "parent": "root",
        "share": 1.0,
        "is_project": True,
        "usage": 80.0,
        "entitlement": 0.5,
        "fairshare_value": 1.6,
        "rank": 2,
        "users": ["alice"],
        "groups": [],
        "pending": 1,
        "gpus_held": 2,
    },
    {
        "name": "nlp",
        "parent": "root",
        "share": 1.0,
        "is_project": True,
        "usage": 20.0,
        "entitlement": 0.5,
        "fairshare_value": 0.4,
        "rank": 1,
        "users": [],
        "groups": ["nlp-team"],
        "pending": 0,
        "gpus_held": 0,
    },
]
NODES = [
    {
        "name": "n0",
        "gpu_type": "h100",
        "gpu_count": 4,
        "weight": 1.0,
        "state": "ready",
        "state_reason": "",
        "state_changed_at": None,
        "in_config": True,
        "drained_by": None,
        "gpus_held": 2,
    }
]
DOCUMENT = build_document(default_handlers)


def as_documented(method: str, path: str, answer: Any) -> Any:
    """``answer`` if it is what the OpenAPI document says ``method path`` answers on
    success; else the test fails, naming where the fake broker drifted."""
    responses = DOCUMENT["paths"][path][method.lower()]["responses"]
    (ok,) = [status for status in responses if status.startswith("2")]
    schema = responses[ok]["content"]["application/json"]["schema"]
    try:
        validate(answer, schema, where=f"{method} {path}")
    except InvalidRequest as err:
        pytest.fail(f"the fake broker's answer breaks the OpenAPI document: {err}")
    return answer


def slice_answer(method: str, path: str, slice_: dict[str, Any]) -> dict[str, Any]:
    return as_documented(method, path, dict(slice_))


async def test_the_fake_broker_is_held_to_the_openapi_document():
    broker = FakeBroker()
    made = await broker.submit("vision", 1, "interactive", user="alice", min_runtime=900.0)
    assert made["state"] == "pending"
    drifted = {k: v for k, v in made.items() if k != "lease_expires_at"}
    with pytest.raises(pytest.fail.Exception, match="lease_expires_at"):
        as_documented("GET", "/slices/{id}", drifted)
    with pytest.raises(pytest.fail.Exception, match="busy"):
        as_documented("GET", "/nodes", {"nodes": [{**NODES[0], "busy": True}]})
    broker.slices[made["id"]]["state"] = "running"  # not a state the API has
    with pytest.raises(pytest.fail.Exception, match="state"):
        await broker.get_slice(made["id"])


#: A broker's terms on its default policy (GET /limits).
LIMITS = {
    "lease": 120.0,
    "grace_period": 60.0,
    "max_min_runtime": 8 * 3600.0,
    "debug_max_gpus": 2,
    "debug_max_min_runtime": 900.0,
    "project_gpu_caps": {},
    "preemption_budget": 5,
    "defaults": {
        "interactive": {"min_runtime": 3600.0, "resumable": False, "max_runtime": None},
        "batch": {"min_runtime": 7200.0, "resumable": True, "max_runtime": None},
    },
}


class FakeBroker:
    """The broker API the mixin uses, in memory. Tests move slices with grant/preempt/end."""

    def __init__(self) -> None:
        self.slices: dict[int, dict[str, Any]] = {}
        self.calls: list[tuple[str, Any]] = []
        self.unreachable = False  # heartbeats get no answer (a broker far behind)
        self.heartbeat_requests: list[list[int]] = []  # the ids of each POST /heartbeats
        self.heartbeats_gate: asyncio.Event | None = None  # holds POST /heartbeats' answers
        self.changed = asyncio.Event()
        self.submit_error: BrokerAPIError | None = None
        self.submit_gate: asyncio.Event | None = None
        self.sooner: dict[int, dict[str, Any]] = {}  # slice id -> its alternatives
        self.limits_answer: dict[str, Any] | None = dict(LIMITS)  # None: no /limits route
        # GET /expected-starts, by (gpu_type, gpus): seconds from now (None: no estimate);
        # None: a broker without the route
        self.expected: dict[tuple[str, int], float | None] | None = None
        self.expected_asked: list[tuple] = []

    def _touch(self) -> None:
        old, self.changed = self.changed, asyncio.Event()
        old.set()

    async def projects(self):
        return as_documented("GET", "/projects", {"projects": PROJECTS})["projects"]

    async def nodes(self):
        return as_documented("GET", "/nodes", {"nodes": NODES})["nodes"]

    async def limits(self):
        if self.limits_answer is None:  # a broker older than the route
            raise BrokerAPIError(404, "not_found", "no such route")
        return as_documented("GET", "/limits", self.limits_answer)

    async def expected_starts(self, project, kind="batch", min_runtime=None, **actor):
        self.expected_asked.append((project, kind, min_runtime, actor))
        if self.expected is None:
            raise BrokerAPIError(404, "not_found", "no such route")
        now = time.time()
        starts = [
            {"gpu_type": t, "gpus": n, "starts_at": None if wait is None else now + wait}
            for (t, n), wait in self.expected.items()
        ]
        body = {
            "now": now,
            "project": project,
            "kind": kind,
            "min_runtime": float(min_runtime or 0),
            "starts": starts,
        }
        return as_documented("GET", "/expected-starts", body)

    async def list_slices(self, *, state=None, project=None, user=None):
        # What a waiting session reads for its page (the queue and the nodes).
        wanted = {"project": project, "user": user}
        listed = [
            dict(s)
            for s in self.slices.values()
            if state in (None, s["state"]) or (state == "live" and s["state"] != "ended")
            if all(value is None or s[key] == value for key, value in wanted.items())
        ]
        return as_documented("GET", "/slices", {"slices": listed})["slices"]

    async def submit(self, project, gpus, kind, **terms):
        self.calls.append(("submit", (project, gpus, kind, terms)))
        if self.submit_gate is not None:
            await self.submit_gate.wait()
        if self.submit_error is not None:
            raise self.submit_error
        slice_id = len(self.slices) + 1
        self.slices[slice_id] = {
            "id": slice_id,
            "project": project,
            "user": terms.get("user"),
            "gpus": gpus,
            "gpu_type": terms.get("gpu_type"),
            "kind": kind,
            "min_runtime": terms.get("min_runtime"),
            "resumable": bool(terms.get("resumable")),
            "max_runtime": terms.get("max_runtime"),
            "priority": terms.get("priority") or 0,
            "state": "pending",
            "end_reason": None,
            "placements": [],
            "submitted_at": time.time(),
            "granted_at": None,
            "protected_until": None,
            "preempt_deadline": None,
            "preempt_reason": None,
            "ended_at": None,
            "lease_expires_at": None,
            "queue_position": None,
            "fairshare_value": None,
            "estimated_start": None,
            "charged_gpu_seconds": 0.0,
            "preemptions": 0,
            "checkpointed_at": None,
            "replaced_by": None,
        }
        return slice_answer("POST", "/slices", self.slices[slice_id])

    async def heartbeat(self, slice_id):
        self.calls.append(("heartbeat", slice_id))
        if self.unreachable:
            raise BrokerUnreachable("POST /slices/{id}/heartbeat: no answer (timed out)")
        return slice_answer("POST", "/slices/{id}/heartbeat", self._get(slice_id))

    async def heartbeats(self, slice_ids):
        self.calls.extend(("heartbeat", slice_id) for slice_id in slice_ids)
        self.heartbeat_requests.append(list(slice_ids))
        if self.unreachable:
            raise BrokerUnreachable("POST /heartbeats: no answer (timed out)")
        if self.heartbeats_gate is not None:
            await self.heartbeats_gate.wait()
        known = [dict(self.slices[i]) for i in slice_ids if i in self.slices]
        missing = [i for i in slice_ids if i not in self.slices]
        return as_documented("POST", "/heartbeats", {"slices": known, "not_found": missing})

    async def get_slice(self, slice_id, **_):
        return slice_answer("GET", "/slices/{id}", self._get(slice_id))

    async def alternatives(self, slice_id):
        self.calls.append(("alternatives", slice_id))
        found = self.sooner.get(slice_id, {"starts_at": None, "alternatives": []})
        body = {"slice_id": slice_id, "now": time.time(), **found}
        return as_documented("GET", "/slices/{id}/alternatives", body)

    async def wait_for_change(self, slice_id, known_state, timeout):
        changed = self.changed
        if self._get(slice_id)["state"] == known_state:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout)
        return slice_answer("GET", "/slices/{id}", self._get(slice_id))

    async def release(self, slice_id):
        self.calls.append(("release", slice_id))
        s = self._get(slice_id)
        if s["state"] == "pending":
            self.end(slice_id, "cancelled")
        elif s["state"] in ("granted", "preempting"):
            self.end(slice_id, "released")
        return slice_answer("DELETE", "/slices/{id}", s)

    def _get(self, slice_id):
        if slice_id not in self.slices:
            raise BrokerAPIError(404, "not_found", f"no slice {slice_id}")
        return self.slices[slice_id]

    # ---- what the scheduler would do ----

    def queue(self, slice_id, position, value=0.5, start=None):
        self.slices[slice_id].update(
            queue_position=position, fairshare_value=value, estimated_start=start
        )
        self._touch()

    def grant(self, slice_id, node="n0", gpus=(1, 2)):
        s = self.slices[slice_id]
        now = time.time()
        s.update(
            state="granted",
            placements=[{"node": node, "gpu_indices": list(gpus)}],
            granted_at=now,
            protected_until=now + (s["min_runtime"] or 0),
            queue_position=None,
        )
        self._touch()

    def preempt(self, slice_id, reason="fair_share", grace=0.2):
        preempted = self.slices[slice_id]
        preempted.update(
            state="preempting",
            preempt_reason=reason,
            preempt_deadline=time.time() + grace,
            preemptions=preempted["preemptions"] + 1,
        )
        self._touch()

    def replace(self, slice_id, **changes):
        """The user took an alternative: the waiting slice is withdrawn for a new one."""
        new_id = len(self.slices) + 1
        self.slices[new_id] = {**self.slices[slice_id], "id": new_id, **changes}
        self.slices[slice_id].update(replaced_by=new_id)
        self.end(slice_id, "cancelled")
        return new_id

    def end(self, slice_id, reason):
        self.slices[slice_id].update(state="ended", end_reason=reason, ended_at=time.time())
        self._touch()

    def released(self) -> list[int]:
        return [arg for name, arg in self.calls if name == "release"]


class MemoryBackend(Spawner):
    """A spawner whose "server" is a flag: what the mixin sits on in these tests."""

    running = False
    launched_env: dict[str, str] | None = None
    stops = 0
    stop_error: Exception | None = None
    launch_gate: asyncio.Event | None = None

    def get_env(self):
        return {}

    async def start(self):
        self.launched_env = self.get_env()
        if self.launch_gate is not None:
            await self.launch_gate.wait()
        self.running = True
        return ("127.0.0.1", 12345)

    async def stop(self, now=False):
        self.stops += 1
        if self.stop_error is not None:
            raise self.stop_error
        self.running = False

    async def poll(self):
        return None if self.running else 0


class GpuSpawner(SliceBrokerMixin, MemoryBackend):
    pass


def user(name="alice", groups=()):
    return SimpleNamespace(
        name=name, groups=[SimpleNamespace(name=g) for g in groups], url=f"/user/{name}/"
    )


@pytest.fixture
def broker():
    return FakeBroker()


@pytest.fixture(autouse=True)
def watcher_never_fails(caplog):
    """A slice watcher that raises logs it, pauses and tries again, so a test would still
    pass, only slower: a fake missing a call the mixin makes must fail instead."""
    yield
    messages = [record.getMessage() for record in caplog.get_records("call")]
    failed = [message for message in messages if message.startswith("Watching")]
    assert not failed, failed


@pytest.fixture
def make(broker, monkeypatch):
    monkeypatch.setattr(mixin_module, "END_WAIT_S", 0.05)
    monkeypatch.setattr(BrokerView, "_views", {})  # each test's broker is a new one

    def make(**traits) -> GpuSpawner:
        traits.setdefault("user", user())
        spawner = GpuSpawner(
            broker_url="http://broker.invalid",
            broker_token="agent",
            heartbeat_interval=0.05,
            queue_refresh_interval=0.02,
            **traits,
        )
        spawner._broker = broker
        return spawner

    return make


async def eventually(check, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def started_and_waiting(spawner, broker, options=None):
    spawner.user_options = options or {"project": "vision", "gpus": 2, "protected": "1h"}
    task = asyncio.ensure_future(spawner.start())
    await eventually(lambda: broker.slices)
    return task, 1


# ---- starting ---------------------------------------------------------------------------


async def test_start_asks_for_a_slice_for_the_user_waits_in_the_queue_then_launches(make, broker):
    spawner = make(user=user("alice", ["nlp-team"]))
    task, slice_id = await started_and_waiting(spawner, broker)
    broker.queue(slice_id, 3, value=1.6, start=time.time() + 600)
    await eventually(
        lambda: any("3rd in the queue" in e["message"] for e in spawner._progress_events)
    )
    assert not task.done()
    assert await spawner.poll() is None  # waiting in the queue counts as running

    broker.grant(slice_id, gpus=(1, 2))
    assert await task == ("127.0.0.1", 12345)

    (_, (project, gpus, kind, terms)), *_ = broker.calls
    assert (project, gpus, kind) == ("vision", 2, "interactive")
    assert terms["user"] == "alice" and terms["groups"] == ["nlp-team"]
    assert terms["min_runtime"] == 3600.0
    assert spawner.launched_env["SLICEBROKER_SLICE_ID"] == "1"
    assert spawner.launched_env["SLICEBROKER_PROJECT"] == "vision"
    assert spawner.launched_env["SLICEBROKER_PROTECTED_UNTIL"].endswith("Z")
    messages = [e["message"] for e in spawner._progress_events]
    assert any("project at 1.60× its share" in m and "in about 10 min" in m for m in messages)
    assert "Granted 2 GPUs on n0 [1, 2]" in messages[-1]
    await spawner.stop()


async def test_after_a_minute_in_the_queue_the_progress_says_what_would_start_it_sooner(
    make, broker
):
    spawner = make()
    task, slice_id = await started_and_waiting(spawner, broker)
    broker.queue(slice_id, 2)
    await eventually(
        lambda: any("2nd in the queue" in e["message"] for e in spawner._progress_events)
    )
    assert ("alternatives", slice_id) not in broker.calls  # not within its first minute
    broker.sooner[slice_id] = {
        "starts_at": None,
        "alternatives": [
            {
                "change": "gpus",
                "fields": {
                    "project": "vision",
                    "gpus": 1,
                    "gpu_type": None,
                    "kind": "interactive",
                    "min_runtime": 3600.0,
                },
                "starts_at": time.time(),
                "gpu_hours": 1.0,
            }
        ],
    }
    broker.slices[slice_id]["submitted_at"] -= 120  # it has waited two minutes now
    broker.queue(slice_id, 2)
    await eventually(
        lambda: any(
            "Start sooner with 1 GPU instead of 2: now (1.00 GPU-h protected)." in e["message"]
            for e in spawner._progress_events
        )
    )
    await spawner.stop()
    with pytest.raises(Exception, match="cancelled"):
        await task


async def test_progress_streams_the_queue_then_the_grant(make, broker):
    spawner = make()
    spawner._spawn_pending = True
    task, slice_id = await started_and_waiting(spawner, broker)
    seen: list[str] = []

    async def read():
        async for event in spawner.progress():
            seen.append(event["message"])

    reader = asyncio.ensure_future(read())
    broker.queue(slice_id, 2)
    await eventually(lambda: any("2nd in the queue" in m for m in seen))
    broker.grant(slice_id)
    await task
    spawner._spawn_pending = False
    spawner._pulse_progress()
    await asyncio.wait_for(reader, 5)

    assert seen[0].startswith("Asking the GPU broker for 2 GPUs (project vision")
    assert any("2nd in the queue" in m for m in seen)
    assert seen[-1].startswith("Granted 2 GPUs")
    await spawner.stop()


async def test_progress_goes_on_with_the_backends_own_events_after_the_grant(make, broker):
    spawner = make()
    spawner.launch_gate = asyncio.Event()  # the backend takes its time to launch
    task, slice_id = await started_and_waiting(spawner, broker)
    broker.grant(slice_id)
    await eventually(lambda: spawner.lifecycle.phase == "launching")

    events = [event async for event in spawner.progress()]
    spawner.launch_gate.set()
    await task

    assert events[-2]["message"].startswith("Granted 2 GPUs") and events[-2]["progress"] == 60
    # JupyterHub's own event (50 of the backend's bar), after the grant's 60.
    assert events[-1] == {"progress": 80, "message": "Spawning server..."}
    await spawner.stop()


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_a_cancelled_or_timed_out_spawn_withdraws_its_request(make, broker, how):
    spawner = make()
    spawner.user_options = {"project": "vision"}
    if how == "cancelled":
        task = asyncio.ensure_future(spawner.start())
        await eventually(lambda: broker.slices)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(spawner.start(), 0.2)

    assert broker.slices[1]["end_reason"] == "cancelled"
    assert broker.released() == [1]
    assert spawner.slice_id is None
    assert await spawner.poll() == 0
    await spawner.stop()  # the hub may still call it: nothing more to release
    assert broker.released() == [1]


async def test_a_spawn_cancelled_while_its_request_is_on_the_way_withdraws_it(make, broker):
    spawner = make()
    spawner.user_options = {"project": "vision"}
    broker.submit_gate = asyncio.Event()
    task = asyncio.ensure_future(spawner.start())
    await eventually(lambda: broker.calls)
    task.cancel()
    await asyncio.sleep(0)
    broker.submit_gate.set()  # the broker makes the slice after all

    with pytest.raises(asyncio.CancelledError):
        await task
    assert broker.slices[1]["end_reason"] == "cancelled"


async def test_a_request_that_ends_while_it_waits_fails_the_spawn_with_the_reason(make, broker):
    spawner = make()
    task, slice_id = await started_and_waiting(spawner, broker)
    broker.end(slice_id, "lost")

    with pytest.raises(SpawnException) as raised:
        await task
    assert "ended before it was granted (lost)" in raised.value.jupyterhub_message


async def test_a_request_replaced_by_an_alternative_is_followed_to_its_grant(make, broker):
    spawner = make()
    task, slice_id = await started_and_waiting(spawner, broker)
    # The user takes "1 GPU instead of 2" on the broker's pages: the broker withdraws
    # the request for a new one in one step, and the spawn waits on for that one.
    new_id = broker.replace(slice_id, gpus=1)
    await eventually(lambda: spawner.slice_id == new_id)
    assert spawner.get_state()["slicebroker"]["slice_id"] == new_id
    await eventually(lambda: ("heartbeat", new_id) in broker.calls)  # it holds the new one
    broker.grant(new_id, gpus=(3,))
    await task
    assert spawner.slice_env()["SLICEBROKER_SLICE_ID"] == str(new_id)
    assert spawner.slice["placements"] == [{"node": "n0", "gpu_indices": [3]}]
    assert slice_id not in broker.released()  # withdrawn by the broker, not by the spawner
    await spawner.stop()
    assert broker.released() == [new_id]


@pytest.mark.parametrize(
    ("status", "code", "expected", "http"),
    [
        (403, "forbidden", "The GPU broker refused the request: not a member", 400),
        (400, "invalid_request", "The GPU broker refused the request: not a member", 400),
        (0, "unreachable", "The GPU broker is not answering", 503),
        (401, "unauthorized", "cannot authenticate with the GPU broker", 500),
    ],
)
async def test_broker_errors_become_messages_for_the_spawn_page(
    make, broker, status, code, expected, http
):
    spawner = make()
    broker.submit_error = BrokerAPIError(status, code, "not a member")
    spawner.user_options = {"project": "vision"}

    with pytest.raises(SpawnException) as raised:
        await spawner.start()
    assert expected in raised.value.jupyterhub_message
    assert raised.value.status_code == http
    assert spawner.slice_id is None


@pytest.mark.parametrize(
    ("options", "reason", "message"),
    [
        ({"project": "nlp"}, "project", "You cannot charge project 'nlp'. Your projects: vision."),
        ({"gpus": 16}, "too_many_gpus", "a session here may have at most 4"),
        ({"gpus": "two"}, "gpus", "must be a whole number"),
        ({"gpu_type": "tpu"}, "gpu_type", "Unknown GPU type 'tpu'; this hub offers: h100."),
        ({"protected": "3h"}, "protected", "Protected length '3h' is not offered"),
    ],
)
async def test_options_a_user_may_not_have_are_refused_with_a_message(
    make, broker, options, reason, message
):
    spawner = make(max_gpus=4)
    with pytest.raises(SpawnException) as raised:
        await spawner.apply_slice_options(options)
    assert raised.value.reason == reason
    assert message in raised.value.jupyterhub_message
    assert not broker.calls


async def test_the_form_offers_what_the_broker_allows_unless_the_admin_offers_less(make, broker):
    # The broker's caps and longest protected period (GET /limits), not a copy in the
    # hub's configuration: with the traits left as they are, the broker's terms apply.
    broker.limits_answer |= {"project_gpu_caps": {"vision": 1}, "max_min_runtime": 7200.0}
    spawner = make(max_gpus=4)
    form = await spawner.slice_options_form()
    assert 'value="vision" data-cap="1"' in form
    assert 'value="4h"' not in form and 'value="2h"' in form
    for options, reason in [
        ({"project": "vision", "gpus": 2}, "project_cap"),
        ({"project": "vision", "protected": "4h"}, "protected"),
    ]:
        with pytest.raises(SpawnException) as raised:
            await spawner.apply_slice_options(options)
        assert raised.value.reason == reason
    # An admin who sets the trait offers that instead (here: more GPUs than the broker
    # caps, which the broker will then refuse itself).
    generous = make(max_gpus=4, project_gpu_caps={"vision": 3})
    assert 'value="vision" data-cap="3"' in await generous.slice_options_form()
    assert not broker.calls


async def test_a_broker_without_limits_leaves_the_admins_terms_standing(make, broker):
    broker.limits_answer = None  # a broker older than GET /limits answers 404
    spawner = make(max_gpus=4)
    form = await spawner.slice_options_form()
    assert "data-cap" not in form and 'value="8h"' in form
    await spawner.apply_slice_options({"project": "vision", "gpus": 4, "protected": "8h"})
    assert spawner.slice_request.gpus == 4


async def test_the_form_says_when_each_size_would_start_for_each_project(make, broker):
    broker.expected = {("h100", 1): 0.0, ("h100", 2): 300.0, ("h100", 4): None}
    spawner = make(user=user("alice", groups=("nlp-team",)), max_gpus=2)
    form = await spawner.slice_options_form()
    # the sizes the form offers only, as words: the line for the project preselected (nlp,
    # the better placed), and each project's own on its option, shown as the choice changes
    line = "Expected start for {} (15 min protected): h100 — 1 GPU now · 2 GPUs in about 5 min."
    assert f'<div class="form-text" id="sb-expected">{line.format("nlp")}</div>' in form
    for project in ("vision", "nlp"):
        assert f'data-expected="{line.format(project)}"' in form
    asked = {(project, kind, protected) for project, kind, protected, _ in broker.expected_asked}
    assert asked == {("vision", "interactive", 900.0), ("nlp", "interactive", 900.0)}
    # asked for the user and their groups, as a submission is
    assert all(
        a["user"] == "alice" and a["groups"] == ["nlp-team"] for *_, a in broker.expected_asked
    )
    # a broker without the route: the form goes without the line
    broker.expected = None
    assert "Expected start" not in await spawner.slice_options_form()


async def test_a_user_with_no_project_is_told_so(make, broker):
    spawner = make(user=user("mallory"))
    with pytest.raises(SpawnException) as raised:
        await spawner.apply_slice_options({"protected": "15m"})
    assert raised.value.reason == "no_project"
    assert "not a member of any project" in raised.value.jupyterhub_message


async def test_applied_options_resolve_the_request_and_leave_the_user_options_as_given(
    make, broker
):
    spawner = make(user=user("alice", ["nlp-team"]))
    spawner.user_options = {"s": ["value"], "i": 5}
    await spawner.apply_slice_options(spawner.user_options)
    # No project given: the user's best-ranked project; the admin's defaults for the rest.
    assert spawner.slice_request == SliceRequest("nlp", 1, None, 900.0)
    assert spawner.user_options == {"s": ["value"], "i": 5}  # round-trips, as the hub has it


# ---- running: poll, stop, state ---------------------------------------------------------------


async def running(spawner, broker):
    task, slice_id = await started_and_waiting(spawner, broker)
    broker.grant(slice_id)
    await task
    return slice_id


async def test_a_server_that_dies_is_reported_stopped_and_its_slice_released(make, broker):
    spawner = make()
    slice_id = await running(spawner, broker)
    await eventually(lambda: ("heartbeat", slice_id) in broker.calls)
    assert await spawner.poll() is None

    spawner.running = False
    assert await spawner.poll() == 0
    assert broker.slices[slice_id]["end_reason"] == "released"
    assert spawner.slice_id is None


async def test_stop_is_idempotent_and_releases_the_slice_once(make, broker):
    spawner = make()
    await spawner.stop()  # never started
    slice_id = await running(spawner, broker)
    await spawner.stop()
    await spawner.stop()

    assert broker.released() == [slice_id]
    assert broker.slices[slice_id]["end_reason"] == "released"
    assert not spawner.running


async def test_heartbeats_come_at_least_three_times_a_lease_whatever_the_trait(make, broker):
    broker.limits_answer |= {"lease": 0.3}  # a broker whose lease was shortened
    spawner = make()
    spawner.heartbeat_interval = 60.0
    task, slice_id = await started_and_waiting(spawner, broker)
    # The first beat comes at once; with the trait's 60 s the second would not come
    # within the test, with a third of the lease it comes every 0.1 s.
    await eventually(lambda: broker.calls.count(("heartbeat", slice_id)) >= 4)
    await spawner.stop()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_hub_s_sessions_heartbeat_their_slices_in_one_request(make, broker):
    broker.heartbeats_gate = asyncio.Event()  # the broker is slow to answer heartbeats
    alice, bob = make(user=user("alice")), make(user=user("bob", ["nlp-team"]))
    alice_starts, _ = await started_and_waiting(alice, broker)
    bob.user_options = {"project": "nlp", "gpus": 1, "protected": "1h"}
    bob_starts = asyncio.ensure_future(bob.start())
    await eventually(lambda: len(broker.slices) == 2)
    await eventually(lambda: len(broker.heartbeat_requests) == 1)
    # While the first request is out, both sessions' next heartbeats gather...
    batcher = alice.broker_view.heartbeats(alice.broker)
    assert bob.broker_view.heartbeats(bob.broker) is batcher
    await eventually(lambda: set(batcher.gathered) == {1, 2})
    broker.heartbeats_gate.set()
    # ... and go to the broker as one.
    await eventually(lambda: [1, 2] in map(sorted, broker.heartbeat_requests))
    for spawner, task in ((alice, alice_starts), (bob, bob_starts)):
        await spawner.stop()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_state_keeps_the_slice_so_a_restarted_hub_reconnects(make, broker):
    first = make()
    slice_id = await running(first, broker)
    state = first.get_state()
    first._cancel_watch()  # the old hub is gone

    second = make()
    second.load_state(state)
    second.running = True  # the server outlived the hub
    beats = broker.calls.count(("heartbeat", slice_id))

    assert state["slicebroker"]["slice_id"] == slice_id
    assert await second.poll() is None
    await eventually(lambda: broker.calls.count(("heartbeat", slice_id)) > beats)
    assert second.slice_env()["SLICEBROKER_SLICE_ID"] == str(slice_id)
    await second.stop()
    assert broker.slices[slice_id]["end_reason"] == "released"


async def test_clear_state_forgets_the_slice_but_keeps_the_notice(make):
    spawner = make()
    spawner.load_state({"slicebroker": {"slice_id": 7, "notice": {"reason": "fair_share"}}})
    spawner.clear_state()

    assert spawner.slice_id is None
    assert spawner.get_state() == {"slicebroker": {"notice": {"reason": "fair_share"}}}


# ---- the broker ending a session -----------------------------------------------------------------


async def test_a_preempted_session_runs_until_its_grace_ends_then_stops_with_a_notice(make, broker):
    spawner = make()
    spawner.orm_spawner = SimpleNamespace(name="", state=None, user_options=None, server=None)
    stopped = []
    spawner.add_poll_callback(lambda: stopped.append(True))
    slice_id = await running(spawner, broker)

    broker.preempt(slice_id, "fair_share", grace=0.3)
    await eventually(lambda: spawner.notice is not None)
    assert spawner.running and spawner.notice["state"] == "preempting"
    # The pages read the stored state: the news is there before the server stops.
    assert spawner.orm_spawner.state["slicebroker"]["notice"]["state"] == "preempting"
    broker.end(slice_id, "preempted")
    await eventually(lambda: stopped)

    assert not spawner.running
    assert spawner.notice["end_reason"] == "preempted" and spawner.notice["reason"] == "fair_share"
    assert broker.released() == []  # the broker ended it; nothing to release
    assert await spawner.poll() == 0
    assert "budget" not in describe(spawner.notice)["text"]  # it does not come back


async def test_a_session_that_comes_back_is_told_what_its_preemption_budget_leaves(make, broker):
    spawner = make()
    slice_id = await running(spawner, broker)
    spawner.restore_chosen = True

    broker.preempt(slice_id, "fair_share", grace=0.3)
    await eventually(lambda: spawner.notice is not None)
    assert describe(spawner.notice)["text"].endswith(
        "This is its 1st preemption of the 5 its budget allows: after 4 more, it comes back "
        "kept to its end."
    )


async def test_heartbeats_that_get_no_answer_are_tried_again_less_and_less_often(
    make, broker, monkeypatch
):
    monkeypatch.setattr(mixin_module, "RETRY_PAUSE_S", 0.02)
    spawner = make()
    spawner.heartbeat_interval = 0.4
    slice_id = await running(spawner, broker)

    def beats():
        return sum(1 for call in broker.calls if call == ("heartbeat", slice_id))

    broker.unreachable = True
    first = beats()
    await eventually(lambda: beats() > first)  # the first one that fails
    failing = beats()
    await asyncio.sleep(1.0)  # a window to count in, not a wait for an event
    # Pauses of 0.02, 0.04, 0.08, 0.16, 0.32 s, then the 0.4 s interval: about five
    # more tries in the second; a fixed 0.02 s pause would have made some fifty.
    assert beats() - failing <= 7
    broker.unreachable = False
    answered = beats()
    await eventually(lambda: beats() > answered + 1)  # answered, then the interval again
    assert spawner.running and broker.slices[slice_id]["state"] == "granted"


async def test_a_session_whose_slice_outlives_its_deadline_stops_anyway(make, broker):
    spawner = make()
    slice_id = await running(spawner, broker)
    broker.preempt(slice_id, "debug_lane", grace=0.1)  # and the broker never ends it

    await eventually(lambda: not spawner.running)
    assert broker.slices[slice_id]["state"] == "ended"
    assert spawner.notice["reason"] == "debug_lane"


async def test_an_expired_session_stops_at_once(make, broker):
    spawner = make()
    slice_id = await running(spawner, broker)
    broker.end(slice_id, "expired")

    await eventually(lambda: not spawner.running)
    assert spawner.notice["end_reason"] == "expired"
    assert spawner.get_state()["slicebroker"]["notice"]["end_reason"] == "expired"


# ---- the local backend's environment ----------------------------------------------------------


@pytest.mark.parametrize(
    ("node_gpus", "placement", "visible"),
    [
        ({}, {"node": "box", "gpu_indices": [2, 3]}, "2,3"),
        ({"box-a100": [4, 5, 6]}, {"node": "box-a100", "gpu_indices": [0, 2]}, "4,6"),
    ],
)
def test_the_local_backend_lists_the_granted_gpus(node_gpus, placement, visible):
    spawner = SliceBrokerSpawner(user=user(), node_gpus=node_gpus)
    spawner.slice = {"id": 4, "project": "vision", "placements": [placement], "protected_until": 0}
    env = spawner.slice_env()

    assert env["CUDA_VISIBLE_DEVICES"] == visible
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["SLICEBROKER_PROTECTED_UNTIL"] == "1970-01-01T00:00:00Z"


def test_the_local_backend_refuses_a_grant_on_another_machine():
    spawner = SliceBrokerSpawner(user=user(), local_nodes=["box"])
    elsewhere = {"placements": [{"node": "other", "gpu_indices": [0]}]}
    here = {"placements": [{"node": "box", "gpu_indices": [0]}]}

    assert "not this machine" in spawner.placement_problem(elsewhere)
    assert spawner.placement_problem(here) is None


def test_the_spawner_defaults_suit_a_queue():
    spawner = SliceBrokerSpawner(user=user())
    assert spawner.start_timeout == 3600
    assert spawner.choices().protected == (900.0, 3600.0, 7200.0, 14400.0, 28800.0, 0.0)
    assert spawner.choices().protected_default == 900.0
    assert callable(spawner.options_form)
    assert spawner.apply_user_options is None  # the admin's: start() resolves the slice's


# ---- stopping a spawn that waits --------------------------------------------------------------


class LocalSpawner(SliceBrokerSpawner):
    """The local-process backend with its signals recorded instead of sent: a signal to
    pid 0 would go to the test run's own process group."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.signals: list[tuple[int, int]] = []

    async def _signal(self, sig: int) -> bool:
        self.signals.append((self.pid, sig))
        return False


async def test_stopping_a_spawn_that_waits_in_the_queue_signals_no_process(broker):
    spawner = LocalSpawner(
        user=user(),
        broker_url="http://broker.invalid",
        broker_token="agent",
        **dict.fromkeys(("interrupt_timeout", "term_timeout", "kill_timeout"), 0),
    )
    spawner._broker = broker
    task, slice_id = await started_and_waiting(spawner, broker)

    await spawner.stop()

    assert spawner.signals == []
    assert broker.slices[slice_id]["end_reason"] == "cancelled"
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, SpawnException):
        await task


async def test_stopping_a_spawn_that_waits_ends_its_start_as_cancelled_at_once(make, broker):
    spawner = make()
    task, slice_id = await started_and_waiting(spawner, broker)

    await spawner.stop()

    with pytest.raises(SpawnException) as raised:
        await asyncio.wait_for(task, 2)
    assert raised.value.reason == "cancelled"
    assert f"slice {slice_id}" in raised.value.jupyterhub_message
    assert broker.slices[slice_id]["end_reason"] == "cancelled"
    assert not spawner.stops  # no server was launched, so none was stopped
    assert await spawner.poll() == 0


async def test_stopping_a_spawn_whose_request_is_on_the_way_withdraws_it_when_made(make, broker):
    spawner = make()
    spawner.user_options = {"project": "vision"}
    broker.submit_gate = asyncio.Event()
    task = asyncio.ensure_future(spawner.start())
    await eventually(lambda: broker.calls)

    await spawner.stop()
    broker.submit_gate.set()

    with pytest.raises(SpawnException) as raised:
        await asyncio.wait_for(task, 2)
    assert raised.value.reason == "cancelled"
    assert broker.slices[1]["end_reason"] == "cancelled"


# ---- options from the form ----------------------------------------------------------------

FORM = {"project": ["vision"], "gpus": ["2"], "x": ["y"], "multi": ["a", "b"]}


@pytest.mark.parametrize(
    ("options_from_form", "others"),
    [
        (None, {"x": ["y"], "multi": ["a", "b"]}),  # JupyterHub's default: 'passthrough'
        ("passthrough", {"x": ["y"], "multi": ["a", "b"]}),
        ("simple", {"x": "y", "multi": ["a", "b"]}),
        (lambda form: {"x_was": form["x"][0]}, {"x_was": "y"}),
    ],
)
def test_the_admins_options_from_form_reads_the_fields_that_are_not_the_slices(
    make, options_from_form, others
):
    traits = {} if options_from_form is None else {"options_from_form": options_from_form}
    spawner = make(**traits)

    options = spawner.run_options_from_form(FORM)  # a dict, as JupyterHub's contract has it

    assert options == {**others, "project": "vision", "gpus": "2"}
    assert spawner.options_from_query(FORM) == options


# ---- the start timeout ----------------------------------------------------------------------


class QuickBackend(MemoryBackend):
    """A backend with a start timeout of its own (JupyterHub's NeverSpawner has 1 s)."""

    @default("start_timeout")
    def _quick_start(self):
        return 7


class QuickGpuSpawner(SliceBrokerMixin, QuickBackend):
    pass


class PatientBackend(MemoryBackend):
    start_timeout = Integer(300)  # the trait declared again, with a default of its own


class PatientGpuSpawner(SliceBrokerMixin, PatientBackend):
    pass


def test_the_queue_start_timeout_is_the_default_only_where_the_backend_has_none():
    assert GpuSpawner(user=user()).start_timeout == 3600  # the hub's 60 s is no queue
    assert QuickGpuSpawner(user=user()).start_timeout == 7
    assert QuickGpuSpawner(user=user(), start_timeout=99).start_timeout == 99
    assert PatientGpuSpawner(user=user()).start_timeout == 300


@pytest.mark.parametrize(
    ("traits", "message"),
    [
        ({"heartbeat_interval": 0}, "heartbeat_interval must be > 0 seconds, got 0"),
        ({"broker_timeout": -1}, "broker_timeout must be > 0 seconds, got -1"),
        ({"queue_refresh_interval": float("nan")}, "queue_refresh_interval must be > 0 seconds"),
        ({"cull_interval": -0.5}, "cull_interval must be > 0 seconds, got -0.5"),
        ({"protected_choices": []}, "protected_choices must offer at least one length"),
        ({"protected_choices": ["1h", "soon"]}, "protected_choices: "),
    ],
)
def test_an_admins_bad_interval_or_length_is_refused_by_name(traits, message):
    # Zero or less would heartbeat, poll or check the broker in a tight loop.
    with pytest.raises(TraitError, match=re.escape(message)):
        GpuSpawner(user=user(), **traits)


# ---- a backend that fails to stop -------------------------------------------------------------


async def test_a_backend_that_fails_to_stop_keeps_its_slice_and_says_so(make, broker, caplog):
    spawner = make()
    slice_id = await running(spawner, broker)
    spawner.stop_error = RuntimeError("the node does not answer")

    with pytest.raises(RuntimeError, match="the node does not answer"):
        await spawner.stop()

    assert broker.released() == [] and broker.slices[slice_id]["state"] == "granted"
    assert spawner.slice_id == slice_id and spawner.lifecycle.phase == "running"
    assert f"slice {slice_id} is kept" in caplog.text
    beats = broker.calls.count(("heartbeat", slice_id))
    await eventually(lambda: broker.calls.count(("heartbeat", slice_id)) > beats)  # still held
    spawner.stop_error = None
    await spawner.stop()  # the next stop works: now the slice goes
    assert broker.released() == [slice_id]


async def test_a_stop_that_comes_with_the_grant_cancels_the_spawn_without_launching(make, broker):
    spawner = make()
    task, slice_id = await started_and_waiting(spawner, broker)
    looked_up = asyncio.Event()
    nodes = broker.nodes

    async def slow_nodes():  # the grant's node lookup, under way when stop() comes
        looked_up.set()
        await asyncio.sleep(0.1)
        return await nodes()

    broker.nodes = slow_nodes
    broker.grant(slice_id)
    await looked_up.wait()
    await spawner.stop()

    with pytest.raises(SpawnException) as raised:
        await asyncio.wait_for(task, 2)
    assert raised.value.reason == "cancelled"
    assert spawner.launched_env is None and spawner.lifecycle.phase == "stopped"
    assert broker.slices[slice_id]["end_reason"] == "released"


# ---- the hub's idle pass ----------------------------------------------------------------


async def sessions_on_a_full_node(make, broker, monkeypatch, held, carol_wants: int) -> dict:
    """Running sessions on n0, full: ``held`` is ``(user, project, GPU indices)`` each,
    in grant order; carol (nlp) waits first in the queue for ``carol_wants`` GPUs.
    The sessions by user."""
    monkeypatch.setattr(BrokerView, "_views", {})
    full = [{**NODES[0], "gpus_held": 4}]
    monkeypatch.setattr(broker, "nodes", lambda: asyncio.sleep(0, full))
    sessions = {}
    for name, project, where in held:
        spawner = make(user=user(name, groups=("nlp-team",)), max_gpus=4)
        spawner.user_options = {"project": project, "gpus": len(where), "protected": "1h"}
        task = asyncio.ensure_future(spawner.start())
        await eventually(lambda s=spawner: s.slice_id is not None)
        broker.grant(spawner.slice_id, gpus=where)
        await task
        sessions[name] = spawner
    waiting = dict(broker.slices[sessions[held[0][0]].slice_id])
    waiting.update(
        id=99, user="carol", project="nlp", gpus=carol_wants, state="pending", placements=[],
        granted_at=None, protected_until=None, queue_position=1,
    )  # fmt: skip
    broker.slices[99] = waiting
    return sessions


async def test_one_idle_pass_stops_the_largest_idle_session_and_spares_the_rest(
    make, broker, monkeypatch
):
    # n0 is full: bob (1 GPU, granted first) and alice (2 GPUs) idle, and a 1-GPU request
    # waits that either could serve. The pass checks the larger session first: one stop
    # frees the most GPUs, and bob's session is then no longer needed.
    held = (("bob", "nlp", (0,)), ("alice", "vision", (1, 2)))
    sessions = await sessions_on_a_full_node(make, broker, monkeypatch, held, carol_wants=1)
    for spawner in sessions.values():
        monkeypatch.setattr(spawner, "session_idle_seconds", idle_for_two_hours)
    view = sessions["alice"].broker_view
    alices = sessions["alice"].slice_id
    stopped = await view.idle_round(max_age=0)
    assert stopped == [sessions["alice"]]
    await sessions["alice"]._culling
    assert broker.slices[alices]["state"] == "ended"
    assert sessions["bob"].idle_checkable() and id(sessions["bob"]) in view.sessions
    assert id(sessions["alice"]) not in view.sessions
    await sessions["bob"].stop()


async def test_two_idle_sessions_on_one_node_are_stopped_for_a_request_needing_both(
    make, broker, monkeypatch
):
    # n0 (4 GPUs) is full: bob and alice hold 2 GPUs each, and carol waits for 4. Neither
    # session alone frees enough; both idle, so both are stopped for her in one pass.
    # With bob busy, alice alone would not serve her, and nobody is stopped.
    held = (("bob", "nlp", (0, 1)), ("alice", "vision", (2, 3)))
    sessions = await sessions_on_a_full_node(make, broker, monkeypatch, held, carol_wants=4)
    view = sessions["alice"].broker_view

    async def busy(now: float) -> tuple[float, str]:
        return 0.0, "the session"

    monkeypatch.setattr(sessions["bob"], "session_idle_seconds", busy)
    monkeypatch.setattr(sessions["alice"], "session_idle_seconds", idle_for_two_hours)
    assert await view.idle_round(max_age=0) == []

    monkeypatch.setattr(sessions["bob"], "session_idle_seconds", idle_for_two_hours)
    slice_ids = [s.slice_id for s in sessions.values()]
    stopped = await view.idle_round(max_age=0)
    assert sorted(s.user.name for s in stopped) == ["alice", "bob"]
    for spawner in stopped:
        await spawner._culling
    assert [broker.slices[slice_id]["state"] for slice_id in slice_ids] == ["ended", "ended"]


async def idle_for_two_hours(now: float) -> tuple[float, str]:
    return 7200.0, "the session"
