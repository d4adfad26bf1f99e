"""Every route of the API, over real HTTP, against the service's application in-process.

Each test gets a fresh broker on a SQLite file (one test also on PostgreSQL)
served on a real socket of the test's event loop, so that tests can look at
the runner's insides (its long-poll waiters, its passes) while they talk HTTP.
"""

from __future__ import annotations

import asyncio
import csv
import io
import logging
import shutil
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from servicefixtures import TEST_CONFIG, InProcessBroker, Reply, serving_in_process
from sqlalchemy.exc import OperationalError

from broker.config import parse_config
from broker.store import Broker

HOUR = 3600.0


MAX_WAIT = 3.0


@pytest.fixture(scope="session")
def blank_database(tmp_path_factory) -> Path:
    """A SQLite database with the schema and TEST_CONFIG in it, copied by each test:
    quicker than migrating a new one every time."""
    path = tmp_path_factory.mktemp("template") / "broker.sqlite"
    Broker(f"sqlite:///{path}", parse_config(tomllib.loads(TEST_CONFIG))).close()
    return path


@pytest.fixture
async def api(tmp_path, blank_database) -> InProcessBroker:
    path = tmp_path / "broker.sqlite"
    shutil.copyfile(blank_database, path)
    async with serving_in_process(f"sqlite:///{path}", max_wait=MAX_WAIT) as served:
        yield served


@pytest.fixture
def alice(api) -> str:
    return api.token("alice")


@pytest.fixture
def bob(api) -> str:
    return api.token("bob")


@pytest.fixture
def carol(api) -> str:
    return api.token("carol")


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Yield to the event loop until ``condition()`` holds (a state the test waits for)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the condition did not come true")
        await asyncio.sleep(0.001)


async def settled(api) -> None:
    """Wait until the pass that the last change asked for has run: reads are served
    beside the write thread, so they do not wait for it themselves."""
    await until(lambda: not api.runner.pass_requested)
    await api.runner.run(lambda: None)  # queued behind the pass, if one is running


def ok(reply: Reply, status: int = 200) -> dict:
    assert reply.status == status, reply.text
    return reply.json


def error_code(reply: Reply, status: int) -> str:
    assert reply.status == status, reply.text
    body = reply.json
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, reply.text
    return body["error"]["code"]


async def live_requests(api: InProcessBroker) -> list[tuple]:
    """The live slices as their requests and states (what a refused write must not change)."""
    live = ok(await api.call("GET", "/slices", token=api.admin_token, params={"state": "live"}))
    return [
        (s["id"], s["state"], s["project"], s["gpus"], s["min_runtime"]) for s in live["slices"]
    ]


def error_code_message(reply: Reply, status: int) -> str:
    error_code(reply, status)
    return reply.json["error"]["message"]


async def submit(api: InProcessBroker, token: str, **request) -> dict:
    request = {"project": "vision", "gpus": 1, "kind": "batch"} | request
    return ok(await api.call("POST", "/slices", token=token, json=request), 201)


async def granted(api: InProcessBroker, token: str, slice_id: int) -> dict:
    """The slice once it left ``pending`` (a long poll)."""
    reply = await api.call(
        "GET", f"/slices/{slice_id}", token=token, params={"wait": 5, "state": "pending"}
    )
    slice_ = ok(reply)
    assert slice_["state"] == "granted", slice_
    return slice_


# ---- root, whoami -------------------------------------------------------------------


async def test_the_root_shows_the_version_without_a_token(api):
    assert ok(await api.call("GET", "/")) == {"version": "0.1.0", "api": "v1", "role": "leader"}
    assert ok(await api.call("GET", ""))["api"] == "v1"


async def test_whoami_shows_the_caller_and_the_projects_they_may_charge(api, alice):
    assert ok(await api.call("GET", "/whoami", token=alice)) == {
        "name": "alice",
        "kind": "user",
        "groups": [],
        "admin": False,
        "agent": False,
        "projects": ["vision"],
    }
    admin = ok(await api.call("GET", "/whoami", token=api.admin_token))
    assert admin["admin"] and admin["projects"] == ["nlp", "vision"]


async def test_limits_show_the_terms_of_the_cluster_file_and_the_lease(tmp_path):
    capped = TEST_CONFIG.replace('debug_max_gpus = 2', 'debug_max_gpus = 1\n'
                                 'project_gpu_caps = { vision = 3 }')  # fmt: skip
    async with serving_in_process(
        f"sqlite:///{tmp_path / 'b.sqlite'}", config=capped, lease=45
    ) as served:
        assert (await served.call("GET", "/limits")).status == 401
        limits = ok(await served.call("GET", "/limits", token=served.token("alice")))
    assert limits == {
        "lease": 45.0,
        "grace_period": 2.0,
        "max_min_runtime": 8 * 3600.0,
        "debug_max_gpus": 1,
        "debug_max_min_runtime": 900.0,
        "project_gpu_caps": {"vision": 3},
        "preemption_budget": 5,
        "defaults": {
            "interactive": {"min_runtime": 900.0, "resumable": False, "max_runtime": None},
            "batch": {"min_runtime": 3600.0, "resumable": True, "max_runtime": None},
        },
    }


async def test_an_agent_sees_the_projects_a_user_may_charge(api):
    agent = api.token("spawner", agent=True)
    reply = await api.call(
        "GET", "/whoami", token=agent, params=[("user", "erin"), ("group", "nlp-team")]
    )
    assert ok(reply) | {"projects": ok(reply)["projects"]} == {
        "name": "erin",
        "kind": "user",
        "groups": ["nlp-team"],
        "admin": False,
        "agent": False,
        "projects": ["nlp"],
    }


# ---- slices -------------------------------------------------------------------------


async def test_a_request_is_queued_then_granted_with_its_contract(api, alice):
    made = await submit(api, alice, kind="interactive", gpus=2, min_runtime="15m", max_runtime=7200)
    assert made["state"] == "pending" and made["user"] == "alice"
    assert (made["min_runtime"], made["max_runtime"], made["resumable"]) == (900.0, 7200.0, False)
    slice_ = await granted(api, alice, made["id"])
    assert [len(p["gpu_indices"]) for p in slice_["placements"]] == [2]
    assert slice_["protected_until"] == slice_["granted_at"] + 900
    assert slice_["lease_expires_at"] == slice_["granted_at"] + 120


async def test_contract_terms_left_out_come_from_the_configuration(api, alice):
    made = await submit(api, alice, kind="batch")
    assert (made["min_runtime"], made["resumable"], made["max_runtime"]) == (HOUR, True, None)


async def test_the_location_header_names_the_new_slice(api, alice):
    reply = await api.call(
        "POST", "/slices", token=alice, json={"project": "vision", "gpus": 1, "kind": "batch"}
    )
    assert reply.headers["Location"] == f"/api/v1/slices/{reply.json['id']}"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        pytest.param(b"{not json", "invalid_json", id="malformed JSON"),
        pytest.param(b'{"project": "vision", "gpus": NaN, "kind": "batch"}', "invalid_json",
                     id="NaN is not JSON"),
        pytest.param(b"[1, 2]", "invalid_request", id="an array instead of an object"),
        pytest.param(b"", "invalid_request", id="no body"),
        pytest.param(b'{"gpus": 1, "kind": "batch"}', "invalid_request", id="no project"),
        pytest.param(b'{"project": "vision", "gpus": "2", "kind": "batch"}', "invalid_request",
                     id="gpus as text"),
        pytest.param(b'{"project": "vision", "gpus": true, "kind": "batch"}', "invalid_request",
                     id="gpus as a boolean"),
        pytest.param(b'{"project": "vision", "gpus": 1.5, "kind": "batch"}', "invalid_request",
                     id="gpus fractional"),
        pytest.param(b'{"project": "vision", "gpus": 0, "kind": "batch"}', "invalid_request",
                     id="no GPUs"),
        pytest.param(b'{"project": "vision", "gpus": 1, "kind": "serial"}', "invalid_request",
                     id="unknown kind"),
        pytest.param(b'{"project": "vision", "gpus": 1, "kind": "batch", "gpu": 1}',
                     "invalid_request", id="unknown key"),
        pytest.param(b'{"project": "vision", "gpus": 1, "kind": "batch", "min_runtime": "15 pc"}',
                     "invalid_request", id="not a duration"),
        pytest.param(b'{"project": "vision", "gpus": 1, "kind": "batch", "min_runtime": -5}',
                     "invalid_request", id="negative duration"),
        pytest.param(b'{"project": "vision", "gpus": 1, "kind": "batch", "min_runtime": "9h"}',
                     "invalid_request", id="protection above the cap"),
        pytest.param(b'{"project": "vision", "gpus": 9, "kind": "batch"}', "invalid_request",
                     id="more GPUs than the cluster"),
        pytest.param(b'{"project": "vision", "gpus": 1, "kind": "batch", "gpu_type": "tpu"}',
                     "invalid_request", id="unknown GPU type"),
        pytest.param(b'{"project": "atlantis", "gpus": 1, "kind": "batch"}', "invalid_request",
                     id="unknown project"),
        pytest.param(b'{"project": "vision", "gpus": 1, "kind": "batch", "priority": 1000}',
                     "invalid_request", id="priority out of range"),
    ],
)  # fmt: skip
async def test_a_bad_request_is_refused_with_a_json_error(api, alice, body, code):
    reply = await api.call("POST", "/slices", token=alice, body=body)
    assert error_code(reply, 400) == code
    assert ok(await api.call("GET", "/slices", token=alice)) == {"slices": []}


async def test_users_list_only_their_own_slices_and_agents_all(api, alice, bob):
    mine = await submit(api, alice)
    theirs = await submit(api, bob)
    listed = ok(await api.call("GET", "/slices", token=alice))["slices"]
    assert [s["id"] for s in listed] == [mine["id"]]
    assert error_code(await api.call("GET", "/slices", token=alice, params={"user": "bob"}), 403)
    agent = api.token("spawner", agent=True)
    listed = ok(await api.call("GET", "/slices", token=agent, params={"user": "bob"}))["slices"]
    assert [s["id"] for s in listed] == [theirs["id"]]
    everything = ok(await api.call("GET", "/slices", token=agent))["slices"]
    assert [s["id"] for s in everything] == [mine["id"], theirs["id"]]


async def test_list_filters_by_state_and_project(api, alice):
    first = await submit(api, alice)
    second = await submit(api, alice)
    ok(await api.call("DELETE", f"/slices/{first['id']}", token=alice))
    for params, expected in [
        ({"state": "ended"}, [first["id"]]),
        ({"state": "live"}, [second["id"]]),
        ({"project": "nlp"}, []),
        ({"project": "vision"}, [first["id"], second["id"]]),
    ]:
        listed = ok(await api.call("GET", "/slices", token=alice, params=params))["slices"]
        assert [s["id"] for s in listed] == expected, params
    assert error_code(await api.call("GET", "/slices", token=alice, params={"state": "x"}), 400)


@pytest.mark.parametrize("path", ["/slices/999", "/slices/abc", "/slices/0", "/slices/99999999999"])
async def test_a_slice_that_does_not_exist_is_404(api, alice, path):
    assert error_code(await api.call("GET", path, token=alice), 404) == "not_found"


async def test_another_users_slice_looks_like_no_slice(api, alice, bob):
    theirs = await submit(api, bob)
    for method, path in [
        ("GET", ""),
        ("DELETE", ""),
        ("POST", "/heartbeat"),
        ("POST", "/checkpoint"),
        ("GET", "/events"),
    ]:
        reply = await api.call(method, f"/slices/{theirs['id']}{path}", token=alice)
        assert error_code(reply, 404) == "not_found", (method, path)


async def test_a_heartbeat_extends_the_lease(api, alice):
    made = await submit(api, alice)
    before = (await granted(api, alice, made["id"]))["lease_expires_at"]
    beat = ok(await api.call("POST", f"/slices/{made['id']}/heartbeat", token=alice))
    assert beat["lease_expires_at"] > before


async def test_a_hub_heartbeats_many_slices_in_one_request(api, alice, bob):
    first, second = await submit(api, alice), await submit(api, alice)
    theirs = await submit(api, bob)
    before = {s["id"]: (await granted(api, alice if s is not theirs else bob, s["id"]))
              for s in (first, second, theirs)}  # fmt: skip
    ok(await api.call("DELETE", f"/slices/{second['id']}", token=alice))
    asked = [second["id"], theirs["id"], first["id"], 99999, first["id"]]
    answer = ok(await api.call("POST", "/heartbeats", token=alice, json={"slices": asked}))
    # In the order asked, each once; another's slice and no slice alike are not found.
    assert [s["id"] for s in answer["slices"]] == [second["id"], first["id"]]
    assert answer["not_found"] == [theirs["id"], 99999]
    ended, beaten = answer["slices"]
    assert ended["state"] == "ended"  # an ended slice is answered as it is
    assert beaten["lease_expires_at"] > before[first["id"]]["lease_expires_at"]
    shown = ok(await api.call("GET", f"/slices/{theirs['id']}", token=bob))
    assert shown["lease_expires_at"] == before[theirs["id"]]["lease_expires_at"]

    agent = api.token("spawner", agent=True)  # a hub's spawner: every user's slices
    answer = ok(await api.call("POST", "/heartbeats", token=agent, json={"slices": asked}))
    assert [s["id"] for s in answer["slices"]] == [second["id"], theirs["id"], first["id"]]
    assert answer["not_found"] == [99999]
    shown = ok(await api.call("GET", f"/slices/{theirs['id']}", token=bob))
    assert shown["lease_expires_at"] > before[theirs["id"]]["lease_expires_at"]


@pytest.mark.parametrize(
    "body",
    [{"slices": []}, {"slices": ["1"]}, {"slices": [0]}, {"slices": [1] * 10_001}, {}],
    ids=["none", "text", "zero", "too-many", "no-list"],
)
async def test_a_heartbeat_of_many_slices_that_names_none_rightly_is_refused(api, alice, body):
    made = await submit(api, alice)
    lease = (await granted(api, alice, made["id"]))["lease_expires_at"]
    if body.get("slices"):
        body = {"slices": [made["id"], *body["slices"]]}
    reply = await api.call("POST", "/heartbeats", token=alice, json=body)
    assert error_code(reply, 400) == "invalid_request"
    assert "slices" in reply.json["error"]["message"]
    shown = ok(await api.call("GET", f"/slices/{made['id']}", token=alice))
    assert shown["lease_expires_at"] == lease  # nothing heartbeated


async def test_a_checkpoint_is_recorded_for_a_held_slice_only(api, alice):
    made = await submit(api, alice)
    held = await granted(api, alice, made["id"])
    assert held["checkpointed_at"] is None
    saved = ok(await api.call("POST", f"/slices/{made['id']}/checkpoint", token=alice))
    assert saved["checkpointed_at"] >= held["granted_at"]
    shown = ok(await api.call("GET", f"/slices/{made['id']}", token=alice))
    assert shown["checkpointed_at"] == saved["checkpointed_at"]
    ok(await api.call("DELETE", f"/slices/{made['id']}", token=alice))
    ended = await api.call("POST", f"/slices/{made['id']}/checkpoint", token=alice)
    assert error_code(ended, 409) == "conflict"
    after = ok(await api.call("GET", f"/slices/{made['id']}", token=alice))
    assert after["checkpointed_at"] == saved["checkpointed_at"]  # the refusal wrote nothing


async def test_a_granted_slice_s_protection_is_extended_within_the_cap(api, alice, bob):
    made = await submit(api, alice, min_runtime="1h")
    held = await granted(api, alice, made["id"])
    path = f"/slices/{made['id']}/protection"
    longer = ok(await api.call("POST", path, token=alice, json={"extend_by": "30m"}))
    assert longer["protected_until"] == held["protected_until"] + 1800
    assert longer["min_runtime"] == 5400 and longer["charged_gpu_seconds"] >= 0
    events = ok(await api.call("GET", f"/slices/{made['id']}/events", token=alice))["events"]
    assert events[-1]["reason"] == "protection extended by 30m"

    # past the 8 h cap: a 409 that says the room left, and nothing written
    refused = await api.call("POST", path, token=alice, json={"extend_by": "7h"})
    assert error_code(refused, 409) == "conflict"
    assert "at most 6h30m more" in refused.json["error"]["message"]
    for body in ({"extend_by": "1x"}, {"extend_by": 60, "why": "x"}, {}):
        assert error_code(await api.call("POST", path, token=alice, json=body), 400)
    assert error_code(await api.call("POST", path, token=bob, json={"extend_by": 60}), 404)
    after = ok(await api.call("GET", f"/slices/{made['id']}", token=alice))
    assert after["protected_until"] == longer["protected_until"]


async def test_deleting_cancels_a_pending_slice_and_releases_a_held_one(api, alice):
    made = await submit(api, alice)
    await granted(api, alice, made["id"])
    released = ok(await api.call("DELETE", f"/slices/{made['id']}", token=alice))
    assert (released["state"], released["end_reason"]) == ("ended", "released")
    assert released["charged_gpu_seconds"] > 0
    again = ok(await api.call("DELETE", f"/slices/{made['id']}", token=alice))
    assert again == released
    kept = await submit(api, alice)
    await granted(api, alice, kept["id"])
    big = await submit(api, alice, gpus=8, min_runtime=60)  # waits: one GPU is held
    assert ok(await api.call("GET", f"/slices/{big['id']}", token=alice))["state"] == "pending"
    cancelled = ok(await api.call("DELETE", f"/slices/{big['id']}", token=alice))
    assert (cancelled["state"], cancelled["end_reason"]) == ("ended", "cancelled")
    assert cancelled["charged_gpu_seconds"] == 0.0 and cancelled["granted_at"] is None


async def test_events_tell_the_slices_story(api, alice):
    made = await submit(api, alice)
    await granted(api, alice, made["id"])
    ok(await api.call("DELETE", f"/slices/{made['id']}", token=alice))
    events = ok(await api.call("GET", f"/slices/{made['id']}/events", token=alice))["events"]
    assert [(e["from_state"], e["to_state"]) for e in events] == [
        (None, "pending"),
        ("pending", "granted"),
        ("granted", "ended"),
    ]
    assert events[1]["reason"].startswith("granted on ")


async def test_an_agent_requests_for_a_user_who_must_be_a_member(api):
    agent = api.token("spawner", agent=True)
    request = {"project": "nlp", "gpus": 1, "kind": "interactive", "min_runtime": "15m"}
    made = await submit(api, agent, **request, user="erin", groups=["nlp-team"])
    assert made["user"] == "erin"
    reply = await api.call("POST", "/slices", token=agent, json=request | {"user": "erin"})
    assert error_code(reply, 403) == "forbidden"


async def test_a_user_may_not_act_for_another_or_claim_a_group(api, alice):
    request = {"project": "nlp", "gpus": 1, "kind": "batch"}
    for extra in ({"user": "bob"}, {"groups": ["nlp-team"]}):
        reply = await api.call("POST", "/slices", token=alice, json=request | extra)
        assert error_code(reply, 403) == "forbidden", extra
    made = await submit(api, alice, user="alice", groups=[])
    assert made["user"] == "alice"


# ---- long polls and deadlines ---------------------------------------------------------


@pytest.mark.parametrize("quick", [120], indirect=True)
async def test_a_long_poll_is_answered_by_the_release_that_frees_gpus(quick):
    # The timer runs a pass only every 60 s, longer than the poll waits: a grant within
    # the wait can only come from the pass that the release itself runs.
    api = quick
    alice, bob, carol = api.token("alice"), api.token("bob"), api.token("carol")
    first = await submit(api, alice, gpus=4)
    second = await submit(api, bob, gpus=4)
    await granted(api, alice, first["id"])
    await granted(api, bob, second["id"])
    waiting = await submit(api, carol, project="nlp", gpus=4)
    await settled(api)  # the pass that queues it
    waiting = ok(await api.call("GET", f"/slices/{waiting['id']}", token=carol))
    assert waiting["state"] == "pending" and waiting["queue_position"] == 1
    poll = asyncio.create_task(
        api.call(
            "GET", f"/slices/{waiting['id']}", token=carol, params={"wait": 30, "state": "pending"}
        )
    )
    await until(lambda: len(api.runner.watchers) == 1)
    ok(await api.call("DELETE", f"/slices/{first['id']}", token=alice))
    answer = ok(await poll)
    assert answer["state"] == "granted"
    assert (
        answer["placements"][0]["node"]
        == ok(await api.call("GET", f"/slices/{first['id']}", token=alice))["placements"][0]["node"]
    )


async def test_a_long_poll_without_state_answers_when_the_queue_position_moves(
    api, alice, bob, carol
):
    held = await submit(api, alice, gpus=8)
    await granted(api, alice, held["id"])
    ahead = await submit(api, bob, gpus=4)
    behind = await submit(api, carol, project="nlp", gpus=4, priority=0)
    await settled(api)
    reply = await api.call("GET", "/slices", token=api.admin_token, params={"state": "pending"})
    positions = {s["id"]: s["queue_position"] for s in ok(reply)["slices"]}
    last, first = sorted(positions, key=positions.get, reverse=True)[:2]
    poll = asyncio.create_task(
        api.call("GET", f"/slices/{last}", token=api.admin_token, params={"wait": 30})
    )
    await until(lambda: len(api.runner.watchers) == 1)
    ok(await api.call("DELETE", f"/slices/{first}", token=api.admin_token))
    moved = ok(await poll)
    assert moved["state"] == "pending" and moved["queue_position"] == positions[last] - 1
    assert {ahead["id"], behind["id"]} == {first, last}


async def test_a_long_poll_without_news_answers_after_the_wait_capped_by_max_wait(api, alice):
    made = await submit(api, alice, gpus=8, min_runtime=60)
    await granted(api, alice, made["id"])
    started = time.monotonic()
    reply = await api.call("GET", f"/slices/{made['id']}", token=alice, params={"wait": 0.3})
    assert ok(reply)["state"] == "granted"
    # At its own wait, not at max_wait (bounds generous for a loaded machine).
    assert 0.3 <= time.monotonic() - started < MAX_WAIT
    started = time.monotonic()
    capped = await api.call(
        "GET", f"/slices/{made['id']}", token=alice, params={"wait": 10_000, "state": "granted"}
    )
    assert ok(capped)["state"] == "granted"
    assert api.max_wait <= time.monotonic() - started < 30  # capped: not 10,000 s


async def test_a_long_poll_on_a_state_already_left_answers_at_once(api, alice):
    made = await submit(api, alice)
    await granted(api, alice, made["id"])
    started = time.monotonic()
    reply = await api.call(
        "GET", f"/slices/{made['id']}", token=alice, params={"wait": 60, "state": "pending"}
    )
    # At once, not after its wait (the bound is generous for a loaded machine).
    assert ok(reply)["state"] == "granted" and time.monotonic() - started < 10
    bad = await api.call("GET", f"/slices/{made['id']}", token=alice, params={"wait": "soon"})
    assert error_code(bad, 400) == "invalid_request"


@pytest.fixture
async def quick(request, tmp_path) -> InProcessBroker:
    """A broker with a 0.5 s grace period (and lease, unless the test's parameter says),
    whose timer would run a pass only every 60 s."""
    lease = getattr(request, "param", 0.5)
    config = TEST_CONFIG.replace('grace_period = "2s"', 'grace_period = "0.5s"')
    url = f"sqlite:///{tmp_path / 'quick.sqlite'}"
    async with serving_in_process(url, config=config, lease=lease, pass_interval=60) as served:
        yield served


async def test_live_slices_and_nodes_are_answered_while_the_database_thread_is_busy(tmp_path):
    """A single writer answers live slices and nodes from its last commit on the event
    loop: a long pass or write on the database thread does not hold them up."""
    url = f"sqlite:///{tmp_path / 'busy.sqlite'}"
    async with serving_in_process(url, single_writer=True, token_cache_max_age=60) as api:
        alice, admin = api.token("alice"), api.admin_token
        made = await granted(api, alice, (await submit(api, alice))["id"])
        ok(await api.call("GET", "/nodes", token=admin))  # both tokens known from here on
        release = threading.Event()
        busy = api.runner.executor.submit(release.wait)
        try:
            got = ok(await api.call("GET", f"/slices/{made['id']}", token=alice, timeout=5))
            listed = ok(await api.call("GET", "/slices", token=alice, params={"state": "live"}))
            nodes = ok(await api.call("GET", "/nodes", token=admin, timeout=5))["nodes"]
            assert not busy.done()  # all answered while the thread was held
        finally:
            release.set()
        assert (got["state"], got["placements"]) == ("granted", made["placements"])
        assert [s["id"] for s in listed["slices"]] == [made["id"]]
        held = {n["name"]: n["gpus_held"] for n in nodes}
        assert held[made["placements"][0]["node"]] == 1
        # Others' slices stay hidden from memory as from the database.
        bob = api.token("bob")
        assert (await api.call("GET", f"/slices/{made['id']}", token=bob)).status == 404


async def test_a_lapsed_lease_ends_the_slice_as_lost_on_time_without_any_request(quick):
    alice = quick.token("alice")
    made = await submit(quick, alice, kind="interactive", min_runtime="15m")
    held = await granted(quick, alice, made["id"])
    # From here no request asks for a pass (reads ask for none): only the lease's own
    # deadline can run one before the 60 s timer. Waited for as the pass that leaves
    # the slice out of the live ones, not counted in passes: on a loaded machine that
    # pass may come before the grant's answer does.
    await until(lambda: quick.runner.remembered(made["id"]) is None, timeout=10.0)
    slice_ = await quick.runner.run(quick.broker.get_slice, made["id"])
    assert (slice_["state"], slice_["end_reason"]) == ("ended", "lost")
    # On time: the lease's own deadline ran the pass, not the 60 s timer (the bound is
    # generous for a loaded machine).
    assert 0 <= slice_["ended_at"] - held["lease_expires_at"] < 2.0


async def test_a_lease_does_not_run_out_while_the_broker_answers_heartbeats_late(tmp_path):
    """A broker that answers heartbeats late may not have read others in time: a lease
    counts only the time it answered on time, so a slice whose lease ran out while the
    broker was behind is kept, and lapses once its holder stays silent for a lease of
    the broker's answering on time (design.md §8)."""
    lease = 3.0  # how late the first pass after the stall may come and still keep it
    url = f"sqlite:///{tmp_path / 'late.sqlite'}"
    async with serving_in_process(url, lease=lease, pass_interval=2, late_heartbeat=0.5) as api:
        alice = api.token("alice")
        answering = await granted(api, alice, (await submit(api, alice))["id"])
        silent = await granted(api, alice, (await submit(api, alice))["id"])
        beat = ok(await api.call("POST", f"/slices/{silent['id']}/heartbeat", token=alice))
        # The database thread held past the silent slice's lease: a heartbeat that
        # comes meanwhile is answered late, and no pass runs. Sent once the thread is
        # held: queued behind a pass, the hold would let the heartbeat (urgent work)
        # go first and answer it on time.
        holding, release = threading.Event(), threading.Event()
        api.runner.executor.submit(lambda: holding.set() or release.wait())
        await until(holding.is_set)
        late_beat = asyncio.ensure_future(
            api.call("POST", f"/slices/{answering['id']}/heartbeat", token=alice, timeout=30)
        )
        late_beats = asyncio.ensure_future(  # a hub's, of many slices: the same rule
            api.call("POST", "/heartbeats", token=alice, json={"slices": [answering["id"]]})
        )
        await asyncio.sleep(lease + 0.5)  # the time the broker is held up: what is measured
        passes = api.runner.passes
        release.set()
        # The first pass after the stall runs as the late answer is written, or before.
        await until(lambda: api.runner.passes > passes)
        kept = await api.runner.run(api.broker.get_slice, silent["id"])
        assert kept["state"] == "granted" and kept["lease_expires_at"] < time.time()
        ok(await late_beat)
        ok(await late_beats)
        registry = api.runner.metrics.registry
        # At least those two (on a loaded machine an earlier heartbeat may be late too).
        assert registry.get_sample_value("slicebroker_heartbeats_answered_late_total") >= 2
        late = api.broker.late_answers.times(time.time())
        assert any(until_ - since >= lease for since, until_ in late)  # held up lease + 0.5 s
        # Silent on: it lapses once the broker has answered on time for a lease since.
        await until(lambda: api.runner.remembered(silent["id"]) is None, timeout=15.0)
        lost = await api.runner.run(api.broker.get_slice, silent["id"])
        assert lost["end_reason"] == "lost"
        assert lost["ended_at"] >= beat["lease_expires_at"] + lease


@pytest.mark.parametrize("quick", [120], indirect=True)
async def test_max_runtime_and_grace_periods_end_on_time(quick):
    alice, carol = quick.token("alice"), quick.token("carol")
    free = await submit(quick, alice, gpus=8, min_runtime=0, resumable=False)
    await granted(quick, alice, free["id"])
    # An allocated request preempts the unallocated slice; its grace ends 0.5 s later.
    short = await submit(quick, carol, project="nlp", gpus=2, min_runtime=0.2, max_runtime=0.6)
    reply = await quick.call(
        "GET", f"/slices/{free['id']}", token=alice, params={"wait": 5, "state": "granted"}
    )
    preempting = ok(reply)
    assert preempting["state"] == "preempting" and preempting["preempt_reason"] == "unallocated"
    reply = await quick.call(
        "GET", f"/slices/{free['id']}", token=alice, params={"wait": 5, "state": "preempting"}
    )
    ended = ok(reply)
    assert ended["end_reason"] == "preempted"
    assert 0 <= ended["ended_at"] - preempting["preempt_deadline"] < 2.0  # timer: 60 s
    held = await granted(quick, carol, short["id"])
    reply = await quick.call(
        "GET", f"/slices/{short['id']}", token=carol, params={"wait": 5, "state": "granted"}
    )
    expired = ok(reply)
    assert expired["end_reason"] == "expired"
    assert 0 <= expired["ended_at"] - (held["granted_at"] + 0.6) < 2.0


async def test_a_failed_pass_is_counted_and_the_next_one_carries_on(api, alice, caplog):
    real_pass, calls = api.broker.run_pass_and_live, []

    def flaky_pass():
        calls.append(None)
        if len(calls) == 1:
            raise OperationalError("SELECT 1", {}, Exception("the database restarted"))
        return real_pass()

    api.broker.run_pass_and_live = flaky_pass
    with caplog.at_level(logging.ERROR):
        first = await submit(api, alice)
        registry = api.runner.metrics.registry
        await until(lambda: registry.get_sample_value("slicebroker_pass_failures_total") == 1)
    assert "database unavailable" in caplog.text and "Traceback" not in caplog.text
    await submit(api, alice)  # the next change runs a pass that works
    await granted(api, alice, first["id"])


async def test_a_burst_of_requests_makes_few_passes(api, alice):
    passes = api.runner.passes
    request = {"project": "vision", "gpus": 1, "kind": "batch", "min_runtime": 60}
    replies = await asyncio.gather(
        *(api.call("POST", "/slices", token=alice, json=request) for _ in range(30))
    )
    assert {r.status for r in replies} == {201}
    await settled(api)
    listed = ok(await api.call("GET", "/slices", token=alice, params={"state": "pending"}))
    assert len(listed["slices"]) == 30 - 8  # the passes ran: 8 GPUs granted
    assert api.runner.passes - passes < 15


# ---- projects -------------------------------------------------------------------------


async def test_projects_show_the_tree_with_fair_share(api, alice):
    projects = ok(await api.call("GET", "/projects", token=alice))["projects"]
    by_name = {p["name"]: p for p in projects}
    assert projects[0]["name"] == "lab"
    assert by_name["vision"]["entitlement"] == pytest.approx(0.5)
    assert by_name["vision"]["users"] == ["alice", "bob"]
    assert by_name["nlp"]["groups"] == ["nlp-team"]
    assert {by_name["vision"]["rank"], by_name["nlp"]["rank"]} == {1, 2}


async def test_an_admin_puts_a_project_and_the_tree_changes(api, alice):
    body = {"share": 3, "parent": "lab", "users": ["dave"]}
    made = ok(await api.call("PUT", "/projects/robotics", token=api.admin_token, json=body))
    assert (made["parent"], made["share"], made["users"]) == ("lab", 3.0, ["dave"])
    assert made["entitlement"] == pytest.approx(0.6)
    dave = api.token("dave")
    assert ok(await api.call("GET", "/whoami", token=dave))["projects"] == ["robotics"]
    bad = await api.call("PUT", "/projects/robotics", token=api.admin_token, json={"share": 0})
    assert error_code(bad, 400) == "invalid_request"
    cycle = {"share": 1, "parent": "vision"}
    assert error_code(
        await api.call("PUT", "/projects/lab", token=api.admin_token, json=cycle), 400
    )
    await submit(api, alice)
    busy = {"share": 1, "parent": "vision"}
    reply = await api.call("PUT", "/projects/vision-sub", token=api.admin_token, json=busy)
    assert error_code(reply, 409) == "conflict"
    assert error_code(await api.call("PUT", "/projects/x", token=alice, json={"share": 1}), 403)


async def test_usage_reports_in_json_and_csv(api, alice, bob):
    for token in (alice, bob):
        made = await submit(api, token)
        await granted(api, token, made["id"])
        ok(await api.call("DELETE", f"/slices/{made['id']}", token=token))
    report = ok(await api.call("GET", "/projects/vision/usage", token=alice))
    assert report["project"] == "vision" and report["by"] == "user"
    assert [(r["user"], r["slices"]) for r in report["usage"]] == [("alice", 1), ("bob", 1)]
    by_project = ok(
        await api.call(
            "GET", "/projects/lab/usage", token=api.admin_token, params={"by": "project"}
        )
    )
    assert [(r["project"], r["slices"]) for r in by_project["usage"]] == [("vision", 2)]
    reply = await api.call(
        "GET",
        "/projects/vision/usage",
        token=alice,
        params={"format": "csv", "since": "2020-01-01T00:00:00Z", "until": str(time.time() + 60)},
    )
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(reply.text)))
    assert [r["user"] for r in rows] == ["alice", "bob"]
    assert float(rows[0]["weighted_gpu_seconds"]) == pytest.approx(
        report["usage"][0]["weighted_gpu_seconds"], abs=0.01
    )
    empty = ok(
        await api.call(
            "GET", "/projects/vision/usage", token=alice, params={"since": 0, "until": 10}
        )
    )
    assert empty["usage"] == []
    for params in ({"since": "yesterday"}, {"since": 10, "until": 0}, {"format": "xml"}):
        reply = await api.call("GET", "/projects/vision/usage", token=alice, params=params)
        assert error_code(reply, 400) == "invalid_request", params


async def test_usage_is_for_members_agents_and_admins(api, alice):
    assert error_code(await api.call("GET", "/projects/nlp/usage", token=alice), 403)
    assert error_code(await api.call("GET", "/projects/atlantis/usage", token=alice), 404)
    assert error_code(await api.call("GET", "/projects/atlantis/usage", token=api.admin_token), 404)
    agent = api.token("spawner", agent=True)
    assert ok(await api.call("GET", "/projects/nlp/usage", token=agent))["usage"] == []


# ---- nodes ----------------------------------------------------------------------------


async def test_an_admin_drains_undrains_and_downs_nodes(api, alice):
    nodes = ok(await api.call("GET", "/nodes", token=alice))["nodes"]
    assert [(n["name"], n["gpu_count"], n["state"]) for n in nodes] == [
        ("n0", 4, "ready"),
        ("n1", 4, "ready"),
    ]
    admin = api.admin_token
    drained = ok(await api.call("POST", "/nodes/n0/drain", token=admin, json={"reason": "fan"}))
    assert (drained["state"], drained["state_reason"], drained["drained_by"]) == (
        "draining",
        "fan",
        "admin",
    )
    undrained = ok(await api.call("POST", "/nodes/n0/undrain", token=admin))
    assert (undrained["state"], undrained["drained_by"]) == ("ready", None)
    held = await submit(api, alice, gpus=4, kind="batch", min_runtime=60)
    held = await granted(api, alice, held["id"])
    node = held["placements"][0]["node"]
    down = ok(await api.call("POST", f"/nodes/{node}/down", token=admin, body=b""))
    assert down["state"] == "down"
    await settled(api)
    # Resumable batch work is requeued, and granted again at once on the other node.
    again = ok(await api.call("GET", f"/slices/{held['id']}", token=alice))
    assert again["state"] == "granted" and again["placements"][0]["node"] != node
    events = ok(await api.call("GET", f"/slices/{held['id']}/events", token=alice))["events"]
    assert any("requeued" in e["reason"] for e in events)
    assert error_code(await api.call("POST", "/nodes/n9/drain", token=admin), 404)
    assert error_code(await api.call("POST", "/nodes/n0/drain", token=alice), 403)
    bad = await api.call("POST", "/nodes/n0/drain", token=admin, json={"reason": 5})
    assert error_code(bad, 400) == "invalid_request"


# ---- metrics, documents, errors ---------------------------------------------------------


async def test_metrics_describe_queues_gpus_usage_and_passes(api, alice):
    made = await submit(api, alice, gpus=2)
    await granted(api, alice, made["id"])
    await submit(api, alice, gpus=8)
    reply = await api.call("GET", "/metrics", token=alice)
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
    text = reply.text
    for line in [
        'slicebroker_queue_length_slices{kind="batch",project="vision"} 1.0',
        'slicebroker_gpus_held{gpu_type="h100",node_state="ready"} 2.0',
        'slicebroker_gpus_free{gpu_type="h100",node_state="ready"} 6.0',
        'slicebroker_project_entitlement_ratio{project="vision"} 0.5',
        'slicebroker_queue_wait_seconds_count{kind="batch",project="vision"} 1.0',
    ]:
        assert line in text, line
    for name in [
        "slicebroker_project_usage_weighted_gpu_seconds",
        "slicebroker_pass_duration_seconds_count",
        'slicebroker_pass_phase_duration_seconds_count{phase="allocate"}',
        "# TYPE slicebroker_preemptions_total counter",
        "# TYPE slicebroker_slice_endings_total counter",
    ]:
        assert name in text, name
    assert error_code(await api.call("GET", "/metrics"), 401) == "unauthorized"


async def test_metrics_may_be_open(tmp_path):
    url = f"sqlite:///{tmp_path / 'open.sqlite'}"
    async with serving_in_process(url, authenticate_metrics=False) as api:
        assert (await api.call("GET", "/metrics")).status == 200


async def test_the_openapi_document_needs_no_token(api):
    document = ok(await api.call("GET", "/openapi.json"))
    assert document["openapi"].startswith("3.0")
    assert document["servers"] == [{"url": "/api/v1"}]
    assert "/slices/{id}" in document["paths"]


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/nowhere", 404, "not_found"),
        ("GET", "/slices/1/nowhere", 404, "not_found"),
        ("PATCH", "/slices", 405, "method_not_allowed"),
        ("DELETE", "/projects", 405, "method_not_allowed"),
        ("PROPFIND", "/slices", 405, "method_not_allowed"),
    ],
)
async def test_unknown_routes_and_methods_answer_json_errors(
    api, alice, method, path, status, code
):
    assert error_code(await api.call(method, path, token=alice), status) == code


async def test_paths_outside_the_api_answer_json_errors(api):
    reply = await api.call("GET", "/../../favicon.ico")
    assert error_code(reply, 404) == "not_found"


async def test_an_unexpected_failure_is_logged_and_answered_500_in_json(api, alice, caplog):
    def broken():
        raise RuntimeError("the disk caught fire")

    api.broker.projects = broken
    with caplog.at_level(logging.ERROR):
        reply = await api.call("GET", "/projects", token=alice)
    assert error_code(reply, 500) == "internal_error"
    assert "fire" not in reply.text and "Traceback" not in reply.text
    assert any(r.exc_info and "fire" in str(r.exc_info[1]) for r in caplog.records)


async def test_an_unavailable_database_is_503_in_json(api, alice):
    def unreachable():
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    api.broker.nodes = unreachable
    reply = await api.call("GET", "/nodes", token=alice)
    assert error_code(reply, 503) == "database_unavailable"


async def test_a_revoked_token_stops_working(api):
    token = api.token("alice")
    assert (await api.call("GET", "/whoami", token=token)).status == 200
    assert api.store.revoke(token)
    assert error_code(await api.call("GET", "/whoami", token=token), 401) == "unauthorized"


async def test_bearer_tokens_work_and_other_schemes_do_not(api):
    token = api.token("alice")
    for header, status in [(f"Bearer {token}", 200), (f"Basic {token}", 401), ("token", 401)]:
        reply = await _call_with_header(api, header)
        assert reply.status == status, header


async def _call_with_header(api: InProcessBroker, header: str) -> Reply:
    from tornado.httpclient import AsyncHTTPClient

    response = await AsyncHTTPClient().fetch(
        api.api_url + "/whoami", headers={"Authorization": header}, raise_error=False
    )
    return Reply(response.code, response.headers, response.body.decode())


# ---- both databases ----------------------------------------------------------------------


async def test_the_slice_lifecycle_on_every_database(db_url):
    async with serving_in_process(db_url) as api:
        alice = api.token("alice")
        made = await submit(api, alice, gpus=2)
        await granted(api, alice, made["id"])
        ok(await api.call("POST", f"/slices/{made['id']}/heartbeat", token=alice))
        released = ok(await api.call("DELETE", f"/slices/{made['id']}", token=alice))
        assert released["end_reason"] == "released"
        report = ok(await api.call("GET", "/projects/vision/usage", token=alice))
        assert report["usage"][0]["weighted_gpu_seconds"] == pytest.approx(
            released["charged_gpu_seconds"]
        )


# ---- what would start a waiting slice sooner ---------------------------------------


async def test_a_waiting_slice_is_told_what_would_start_it_now(api, alice, bob):
    # alice holds 3 GPUs of n0 and all of n1: one GPU is free, her 2-GPU request waits
    for gpus in (3, 4):
        held = await submit(api, alice, gpus=gpus, min_runtime="8h")
        await granted(api, alice, held["id"])
    waiting = await submit(api, alice, gpus=2, min_runtime="1h")
    await settled(api)
    found = ok(await api.call("GET", f"/slices/{waiting['id']}/alternatives", token=alice))
    assert found["slice_id"] == waiting["id"] and found["starts_at"] is None
    best = found["alternatives"][0]
    assert best["change"] == "gpus" and best["starts_at"] == found["now"]
    assert best["fields"] == {
        "project": "vision",
        "gpus": 1,
        "gpu_type": None,
        "kind": "batch",
        "min_runtime": 3600.0,
    }
    assert best["gpu_hours"] == 1.0
    # another user sees no such slice; a granted one has nothing to offer
    assert (
        error_code(await api.call("GET", f"/slices/{waiting['id']}/alternatives", token=bob), 404)
        == "not_found"
    )
    done = ok(await api.call("GET", f"/slices/{held['id']}/alternatives", token=alice))
    assert done["alternatives"] == []


async def test_before_a_request_is_made_it_is_told_when_each_size_would_start(api, alice, carol):
    # alice holds 3 GPUs of n0 and all of n1 for 8 h: one GPU is free
    for gpus in (3, 4):
        held = await submit(api, alice, gpus=gpus, min_runtime="8h")
        await granted(api, alice, held["id"])
    await settled(api)
    before = [
        (s["id"], s["state"]) for s in ok(await api.call("GET", "/slices", token=alice))["slices"]
    ]
    found = ok(
        await api.call(
            "GET", "/expected-starts?project=vision&kind=batch&min_runtime=1h", token=alice
        )
    )
    assert (found["project"], found["kind"], found["min_runtime"]) == ("vision", "batch", 3600.0)
    starts = {(e["gpu_type"], e["gpus"]): e["starts_at"] for e in found["starts"]}
    assert list(starts) == [("h100", 1), ("h100", 2), ("h100", 4)]
    assert starts["h100", 1] == found["now"]  # the free GPU
    # 2 and 4 GPUs wait for alice's own protected work to end, in about 8 h
    for gpus in (2, 4):
        assert starts["h100", gpus] is None or starts["h100", gpus] > found["now"] + 7 * 3600
    # asking writes nothing
    after = ok(await api.call("GET", "/slices", token=alice))["slices"]
    assert [(s["id"], s["state"]) for s in after] == before
    # only a member may ask for a project; terms no request may have are refused
    refused = await api.call("GET", "/expected-starts?project=vision", token=carol)
    assert error_code(refused, 403) == "forbidden"
    for query in ("kind=nap", "min_runtime=soon", "min_runtime=99h"):
        bad = await api.call("GET", f"/expected-starts?project=vision&{query}", token=alice)
        assert error_code(bad, 400)


async def test_past_the_what_if_budget_answers_are_stale_and_the_checks_still_hold(
    api, alice, bob, carol
):
    for gpus in (3, 4):
        held = await submit(api, alice, gpus=gpus, min_runtime="8h")
        await granted(api, alice, held["id"])
    waiting = await submit(api, alice, gpus=2, min_runtime="1h")
    await settled(api)
    api.runner.what_if_share = 1e-9  # the first computation spends the whole share
    url = f"/slices/{waiting['id']}/alternatives"
    first = await api.call("GET", url, token=alice)
    assert ok(first)["alternatives"] and first.headers.get("Slicebroker-Stale") is None
    # A change (bob is granted the last GPU) drops the shared answer; the
    # share stays spent.
    await granted(api, bob, (await submit(api, bob))["id"])
    again = await api.call("GET", url, token=alice)
    assert again.headers["Slicebroker-Stale"] == "true"
    assert ok(again) == ok(first)  # the last answer, not a new computation
    assert error_code(await api.call("GET", url, token=bob), 404) == "not_found"
    form = await api.call("GET", "/expected-starts?project=vision&kind=batch", token=alice)
    assert form.headers["Slicebroker-Stale"] == "true"
    assert ok(form)["starts"] == []  # never asked: checked, nothing computed
    refused = await api.call("GET", "/expected-starts?project=vision", token=carol)
    assert error_code(refused, 403) == "forbidden"


async def test_a_waiting_slice_is_replaced_by_an_alternative_in_one_step_or_not_at_all(
    api, alice, bob
):
    for gpus in (3, 4):  # alice holds 7 of the 8 GPUs: her 2-GPU request waits
        await granted(api, alice, (await submit(api, alice, gpus=gpus, min_runtime="8h"))["id"])
    waiting = await submit(api, alice, gpus=2, min_runtime="1h")
    ok(await api.call("POST", f"/slices/{waiting['id']}/heartbeat", token=alice))
    await settled(api)
    before = await live_requests(api)
    one_gpu = {"project": "vision", "gpus": 1, "kind": "batch", "min_runtime": 3600}
    url = f"/slices/{waiting['id']}/replace"
    refused = [
        (bob, one_gpu, 404),  # not his: as if there were none
        (alice, {**one_gpu, "project": "nlp"}, 403),  # a project she may not charge
        (alice, {**one_gpu, "gpus": 64}, 400),  # can never be granted
        (alice, {**one_gpu, "color": "red"}, 400),  # not a field
    ]
    for token, body, status in refused:
        error_code(await api.call("POST", url, token=token, json=body), status)
    # each refusal wrote nothing: no new slice, the request still waiting as it was
    assert await live_requests(api) == before

    reply = await api.call("POST", url, token=alice, json=one_gpu)
    new = ok(reply, 201)
    assert reply.headers["Location"].endswith(f"/slices/{new['id']}")
    assert (new["gpus"], new["user"], new["submitted_at"]) == (1, "alice", waiting["submitted_at"])
    assert new["lease_expires_at"] is not None  # the lease the old one had
    old = ok(await api.call("GET", f"/slices/{waiting['id']}", token=alice))
    assert (old["state"], old["end_reason"], old["replaced_by"]) == (
        "ended",
        "cancelled",
        new["id"],
    )
    assert (await granted(api, alice, new["id"]))["gpus"] == 1
    events = ok(await api.call("GET", f"/slices/{waiting['id']}/events", token=alice))["events"]
    assert events[-1]["reason"] == f"cancelled: replaced by slice {new['id']}"
    # once not waiting, there is nothing to replace
    again = await api.call("POST", url, token=alice, json=one_gpu)
    assert "not waiting" in error_code_message(again, 409)


async def test_a_restore_of_a_slice_no_preemption_ended_is_refused_with_json(api, alice, bob):
    held = await submit(api, alice)
    await granted(api, alice, held["id"])
    released = await submit(api, alice)
    ok(await api.call("DELETE", f"/slices/{released['id']}", token=alice))

    def story(slices):  # what a refusal could have changed: slices, states, successors
        return [(s["id"], s["state"], s["replaced_by"]) for s in slices]

    before = story(ok(await api.call("GET", "/slices", token=alice))["slices"])
    for token, restores, status, code in (
        (alice, held["id"], 409, "conflict"),  # still live
        (alice, released["id"], 409, "conflict"),  # released by its holder
        (bob, held["id"], 404, "not_found"),  # another user's
        (alice, "12", 400, "invalid_request"),
    ):
        body = {"project": "vision", "gpus": 1, "kind": "interactive", "restores": restores}
        reply = await api.call("POST", "/slices", token=token, json=body)
        assert error_code(reply, status) == code
    assert story(ok(await api.call("GET", "/slices", token=alice))["slices"]) == before


async def test_an_overloaded_broker_refuses_at_once_all_but_heartbeats_and_releases(tmp_path):
    """While the database thread's oldest work has waited past ``shed_after``, a read
    or a submission is answered 503 ``overloaded`` with ``Retry-After`` at once; a
    heartbeat and a release wait their turn and are answered. Once the queue is
    worked off, requests are served again."""
    async with serving_in_process(f"sqlite:///{tmp_path / 'b.sqlite'}", shed_after=0.2) as api:
        alice = api.token("alice")
        request = {"project": "vision", "gpus": 1, "kind": "batch"}
        held = ok(await api.call("POST", "/slices", token=alice, json=request), 201)
        kept = ok(await api.call("POST", "/slices", token=alice, json=request), 201)
        go = threading.Event()
        busy = asyncio.ensure_future(api.runner.run(go.wait))  # the database thread is held
        behind = asyncio.ensure_future(api.runner.run(lambda: None))  # work queued behind it
        try:
            while api.runner.waiting_for() <= 0.2:
                await asyncio.sleep(0.02)
            for method, path, body in (
                ("GET", f"/slices/{held['id']}", None),
                ("POST", "/slices", request),
                ("GET", "/projects", None),
            ):
                refused = await api.call(method, path, token=alice, json=body)
                assert refused.status == 503, (method, path, refused.body)
                assert refused.json["error"]["code"] == "overloaded"
                assert int(refused.headers["Retry-After"]) >= 1
            beat = asyncio.ensure_future(
                api.call("POST", f"/slices/{held['id']}/heartbeat", token=alice)
            )
            release = asyncio.ensure_future(
                api.call("DELETE", f"/slices/{kept['id']}", token=alice)
            )
            # both reach the broker while it is still behind: in flight, or refused
            while api.in_flight.count < 2 and not (beat.done() or release.done()):
                await asyncio.sleep(0.01)
        finally:
            go.set()
            await busy
            await behind
        assert ok(await beat)["id"] == held["id"]  # answered after the queue, not refused
        assert ok(await release)["state"] == "ended"
        assert ok(await api.call("GET", f"/slices/{held['id']}", token=alice))["id"] == held["id"]
