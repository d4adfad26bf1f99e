"""Bringing a session back after a preemption (spawner/restore.py): which endings it
follows, and how the hub is asked, over real HTTP to a small stand-in of the hub's
server route (the whole path through a real hub is in test_e2e_hub.py)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port

from spawner.restore import bring_back, ended_by_preemption, restart_options, server_path


@pytest.mark.parametrize(
    ("slice_", "comes_back"),
    [
        ({"state": "ended", "end_reason": "preempted", "preempt_reason": "fair_share"}, True),
        ({"state": "ended", "end_reason": "preempted", "preempt_reason": "drain"}, True),
        ({"state": "preempting", "preempt_reason": "debug_lane"}, True),  # grace over
        ({"state": "ended", "end_reason": "released", "preempt_reason": "priority"}, True),
        ({"state": "ended", "end_reason": "node_down", "preempt_reason": None}, True),
        ({"state": "ended", "end_reason": "released", "preempt_reason": None}, False),  # idle
        ({"state": "ended", "end_reason": "expired", "preempt_reason": None}, False),
        ({"state": "ended", "end_reason": "lost", "preempt_reason": None}, False),
    ],
)
def test_a_session_comes_back_from_a_preemption_or_a_node_down_only(slice_, comes_back):
    assert ended_by_preemption(slice_) is comes_back


def test_the_restart_keeps_the_options_and_names_the_slice_it_restores():
    options = {"project": "vision", "gpus": 2, "restore": True, "restores": 3, "image": "x"}
    assert restart_options(options, 7) == {**options, "restores": 7}
    assert server_path("bob", "") == "/users/bob/server"
    assert server_path("a/b", "lab 1") == "/users/a%2Fb/servers/lab%201"


class _Hub(web.RequestHandler):
    """The hub's server route: 400 ("pending stop") ``busy`` times, then 202."""

    def initialize(self, seen: list, busy: list) -> None:
        self.seen, self.busy = seen, busy

    def post(self, user: str) -> None:
        self.seen.append((user, self.request.headers["Authorization"], self.request.body))
        if self.busy and self.busy[0] > 0:
            self.busy[0] -= 1
            raise web.HTTPError(400, "bob is pending stop")
        if self.busy and self.busy[0] < 0:
            raise web.HTTPError(403)
        self.set_status(202)


@pytest.fixture
async def hub():
    seen: list = []
    busy: list = [0]
    app = web.Application([(r"/hub/api/users/([^/]+)/server", _Hub, {"seen": seen, "busy": busy})])
    sock, port = bind_unused_port()
    server = HTTPServer(app)
    server.add_sockets([sock])
    made: list = []
    user = SimpleNamespace(
        name="bob", new_api_token=lambda **kw: made.append(kw) or f"t{len(made)}"
    )
    spawner = SimpleNamespace(
        user=user,
        name="",
        hub=SimpleNamespace(api_url=f"http://127.0.0.1:{port}/hub/api"),
        _log_name="bob",
    )
    yield SimpleNamespace(spawner=spawner, seen=seen, busy=busy, tokens=made)
    server.stop()


async def test_the_hub_is_asked_again_while_it_finishes_the_stop(hub):
    hub.busy[0] = 2
    options = {"project": "vision", "restores": 7}
    assert await bring_back(hub.spawner, options, logging.getLogger("test"))
    assert len(hub.seen) == 3
    user, auth, body = hub.seen[-1]
    assert (user, auth) == ("bob", "token t1")
    assert json.loads(body) == {"user_options": options}
    # one token of the user's, for starting their own servers only, short-lived
    (token,) = hub.tokens
    assert token["scopes"] == ["servers!user=bob"] and token["expires_in"] <= 300


async def test_a_refusal_other_than_a_pending_stop_ends_it_with_a_log_line(hub, caplog):
    hub.busy[0] = -1
    assert not await bring_back(hub.spawner, {"restores": 7}, logging.getLogger("test"))
    assert len(hub.seen) == 1
    assert "did not start bob again: HTTP 403" in caplog.text


async def test_a_token_the_hub_will_not_make_ends_it_with_a_log_line(hub, caplog):
    def refuse(**_):
        raise ValueError("Not assigning requested scopes servers!user=bob")

    hub.spawner.user.new_api_token = refuse
    assert not await bring_back(hub.spawner, {"restores": 7}, logging.getLogger("test"))
    assert hub.seen == []
    assert "did not start bob again: no token for it (Not assigning" in caplog.text
