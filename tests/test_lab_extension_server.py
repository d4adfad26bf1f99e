"""The Lab extension's server side: ``GET slicebroker/session`` on a real Jupyter server
reading a real broker with the session's own environment, and the idle-warning rule."""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import requests
from gpustandin import StandinGpus
from hubfixtures import wait_until
from labfixtures import JupyterServer, session_environment
from servicefixtures import (
    BUDGET_OF_ONE_CONFIG,
    TEST_CONFIG,
    BrokerService,
    kept_to_its_end,
    running_service,
)

from slicebroker_lab import RESTORE_ENV, session_env
from slicebroker_lab.handlers import cull_warning, session_view

#: A long grace period, so that the test sees the slice while it is preempting.
CONFIG = TEST_CONFIG.replace('grace_period = "2s"', 'grace_period = "5m"')


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerService]:
    with running_service(tmp_path / "broker", config=CONFIG, pass_interval=0.5) as service:
        yield service


@pytest.fixture
def granted(broker: BrokerService) -> tuple[str, dict]:
    """alice's token and her granted interactive slice: 2 GPUs of vision, 10 min protected."""
    token = broker.token("alice")
    reply = broker.post(
        "/slices",
        token=token,
        json={"project": "vision", "gpus": 2, "kind": "interactive", "min_runtime": 600},
    )
    assert reply.status_code == 201, reply.text
    slice_ = reply.json()
    if slice_["state"] != "granted":
        slice_ = broker.get(
            f"/slices/{slice_['id']}", token=token, params={"wait": 10, "state": "pending"}
        ).json()
    assert slice_["state"] == "granted", slice_
    return token, slice_


def test_the_endpoint_shows_the_session_s_slice_from_the_broker(broker, granted, tmp_path):
    token, slice_ = granted
    server = JupyterServer(tmp_path, session_environment(broker, token, slice_["id"]))
    try:
        reply = server.session()
        assert reply.status_code == 200, reply.text
        view = reply.json()
        assert view["slice_id"] == slice_["id"]
        assert (view["project"], view["gpus"], view["gpu_type"]) == ("vision", 2, "h100")
        assert view["nodes"] == [p["node"] for p in slice_["placements"]]
        assert view["state"] == "granted" and view["preempt_deadline"] is None
        assert view["protected_until"] == pytest.approx(slice_["protected_until"])
        assert view["kept_to_end"] is None
        assert 500 < view["protected_until"] - view["now"] <= 600
        assert view["cost"].endswith(" GPU-h") and view["charged_gpu_seconds"] >= 0
        assert view["cull_warning"] is None  # idle for seconds, the limits are in hours
        assert view["broker_pages"] == "/services/slicebroker/"

        # Without the server's token: no answer about the slice.
        assert server.session(token="").status_code == 403

    finally:
        server.stop()


def test_a_preempting_slice_has_its_deadline_and_reason(broker, tmp_path):
    token = broker.token("alice")
    reply = broker.post(
        "/slices",
        token=token,
        json={"project": "vision", "gpus": 1, "kind": "interactive", "min_runtime": 0},
    )
    assert reply.status_code == 201, reply.text
    slice_id = reply.json()["id"]
    slice_ = wait_until(
        lambda: (
            (s := broker.get(f"/slices/{slice_id}", token=token).json())["state"] == "granted" and s
        ),
        20,
        "the grant",
    )
    server = JupyterServer(tmp_path, session_environment(broker, token, slice_id))
    try:
        node = slice_["placements"][0]["node"]
        drained = broker.post(f"/nodes/{node}/drain", token=broker.admin_token, json={})
        assert drained.status_code == 200, drained.text

        def preempting() -> dict | None:
            view = server.session().json()
            return view if view["state"] == "preempting" else None

        view = wait_until(preempting, 30, "the slice to be preempting")
        assert view["preempt_reason"] == "drain"
        assert 0 < view["preempt_deadline"] - view["now"] <= 300

        # The broker goes away: a JSON error, not a traceback.
        broker.stop()
        reply = server.session()
        assert reply.status_code == 502
        assert reply.json()["error"]["code"] == "broker_unavailable"
    finally:
        server.stop()


def test_a_session_preempted_as_often_as_its_budget_allows_reads_kept_to_its_end(tmp_path):
    with running_service(tmp_path / "broker", config=BUDGET_OF_ONE_CONFIG) as service:
        token = service.token("alice")
        slice_ = kept_to_its_end(service, token)
        server = JupyterServer(tmp_path, session_environment(service, token, slice_["id"]))
        try:
            view = server.session().json()
        finally:
            server.stop()
    assert view["state"] == "granted" and view["slice_id"] == slice_["id"]
    assert view["kept_to_end"] == (
        "kept to its end: preempted 1 time, its budget; only a drain or a node going down "
        "ends it early"
    )


def test_a_session_that_comes_back_is_told_what_its_budget_leaves_while_it_stops(tmp_path):
    config = BUDGET_OF_ONE_CONFIG.replace('grace_period = "2s"', 'grace_period = "5m"')
    with running_service(tmp_path / "broker", config=config, pass_interval=0.5) as service:
        token = service.token("alice")
        body = {"project": "vision", "gpus": 1, "kind": "batch", "min_runtime": 1}
        slice_id = service.post("/slices", token=token, json=body).json()["id"]
        params = {"wait": 10, "state": "pending"}
        held = service.get(f"/slices/{slice_id}", token=token, params=params).json()
        node = held["placements"][0]["node"]
        service.post(f"/nodes/{node}/drain", token=service.admin_token, json={})
        params = {"wait": 10, "state": "granted"}
        stopping = service.get(f"/slices/{slice_id}", token=token, params=params).json()
        assert stopping["state"] == "preempting", stopping
        env = session_environment(service, token, slice_id) | {RESTORE_ENV: "1"}
        server = JupyterServer(tmp_path, env)
        try:
            view = server.session().json()
        finally:
            server.stop()
    assert view["state"] == "preempting" and view["comes_back"] is True
    assert view["budget_left"] == (
        "This is its 1st preemption of the 1 its budget allows: it comes back kept to its end."
    )
    # A session that does not come back is not told of a budget it has no use for.
    assert session_view(stopping, time.time(), None, {}, None, 1)["budget_left"] is None


def test_extend_protection_asks_the_broker_and_passes_its_refusal_on(broker, granted, tmp_path):
    # alice's session is a debug session (2 GPUs, 10 min): at most 15 min of protection
    token, slice_ = granted
    env = session_environment(broker, token, slice_["id"])
    server = JupyterServer(tmp_path, env, ("--SliceBrokerLab.extend_protection_by=300",))
    try:
        assert server.session().json()["extend_protection_by"] == 300
        url = f"{server.url}/slicebroker/protection"
        headers = {"Authorization": f"token {server.token}"}
        extended = requests.post(url, headers=headers, timeout=30)
        assert extended.status_code == 200, extended.text
        assert extended.json()["protected_until"] == slice_["protected_until"] + 300
        assert broker.get(f"/slices/{slice_['id']}", token=token).json()["min_runtime"] == 900

        refused = requests.post(url, headers=headers, timeout=30)
        assert refused.status_code == 409, refused.text
        message = refused.json()["error"]["message"]
        assert "debug_max_min_runtime (15m); at most 0s more" in message
        assert broker.get(f"/slices/{slice_['id']}", token=token).json()["min_runtime"] == 900
    finally:
        server.stop()


def test_a_session_without_a_slice_gets_a_404_in_the_api_shape(broker, tmp_path):
    server = JupyterServer(tmp_path, session_environment(broker, broker.token("alice"), None))
    try:
        reply = server.session()
        assert reply.status_code == 404
        assert reply.json()["error"]["code"] == "no_slice"
    finally:
        server.stop()


def terminal_output(server: JupyterServer, line: str, until: str, timeout: float = 30.0) -> str:
    """What a Lab terminal of ``server`` shows once ``until`` shows, after ``line`` is typed.

    ``until`` must be text the command prints but its typed line does not contain (make
    the shell compute it): the terminal echoes the line, wrapped wherever the prompt and
    the terminal's width put the edge, so the echo cannot be found and cut off reliably.
    """
    import websocket  # websocket-client, as Jupyter's own tests use

    made = requests.post(f"{server.url}/api/terminals", params=server._auth, timeout=30)
    assert made.status_code == 200, made.text
    name = made.json()["name"]
    ws_url = f"ws://127.0.0.1:{server.port}/terminals/websocket/{name}?token={server.token}"
    ws = websocket.create_connection(ws_url, timeout=timeout)
    try:
        ws.send(json.dumps(["stdin", line + "\r"]))
        shown = ""
        deadline = time.monotonic() + timeout
        while until not in shown:
            assert time.monotonic() < deadline, f"the terminal showed: {shown!r}"
            kind, *content = json.loads(ws.recv())
            if kind == "stdout":
                shown += content[0]
        return shown
    finally:
        ws.close()


def test_a_lab_terminal_finds_slicebroker_although_its_login_shell_resets_path(broker, tmp_path):
    env = session_environment(broker, broker.token("alice"), None)
    env.update(SHELL="/bin/bash", HOME=str(tmp_path))  # /etc/profile sets PATH anew
    server = JupyterServer(tmp_path, env)
    try:
        # The shell computes both markers, so the echo of the typed line holds neither.
        line = 'command -v slicebroker || echo "NOT-$((40 + 2))-FOUND"; echo "END-$((40 + 2))"'
        shown = terminal_output(server, line, "END-42")
        assert "NOT-42-FOUND" not in shown
        assert os.path.join(os.path.dirname(sys.executable), "slicebroker") in shown
    finally:
        server.stop()


def test_a_session_without_its_broker_token_is_told_which_variable_is_missing(broker, tmp_path):
    env = session_environment(broker, broker.token("alice"), 7)
    del env["SLICEBROKER_TOKEN"]
    server = JupyterServer(tmp_path, env)
    try:
        reply = server.session()
        assert reply.status_code == 404
        error = reply.json()["error"]
        assert error["code"] == "no_slice"
        assert "SLICEBROKER_TOKEN not set" in error["message"]
        assert "SLICEBROKER_URL" not in error["message"]
    finally:
        server.stop()


# ---- what the session last did: kernels, terminals, GPUs -------------------------------


@pytest.fixture(scope="module")
def gpu_session(tmp_path_factory) -> Iterator[tuple[JupyterServer, StandinGpus]]:
    """A session of the broker's (slice 7, GPUs 2 and 3) whose GPUs a stand-in reports,
    read every 0.2 s; no broker: the activity route needs none. One server for the
    module's activity tests: each sets the GPUs' load it needs and waits for its effect."""
    tmp_path = tmp_path_factory.mktemp("gpu-session")
    gpus = StandinGpus(tmp_path / "gpus", count=4)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "SLICEBROKER"))}
    env.update(session_env(env))
    env.update(SLICEBROKER_SLICE_ID="7", CUDA_VISIBLE_DEVICES="2,3", HOME=str(tmp_path))
    args = (
        f"--SliceBrokerLab.nvidia_smi={gpus.program}",
        "--SliceBrokerLab.gpu_sample_interval=0.2",
        "--SliceBrokerLab.use_nvml=False",
    )
    server = JupyterServer(tmp_path, env, args)
    try:
        yield server, gpus
    finally:
        server.stop()


def test_a_busy_gpu_is_activity_and_an_open_tab_is_not(gpu_session):
    server, gpus = gpu_session
    set_at = time.time()
    gpus.set(0, memory_used=40_000)  # a model loaded, nothing running

    def idle_while_a_tab_polls() -> dict | None:
        # What an open Lab tab does: list the files and kernels, read the session.
        requests.get(f"{server.url}/api/contents", params=server._auth, timeout=10)
        requests.get(f"{server.url}/api/kernels", params=server._auth, timeout=10)
        view = server.activity().json()
        # A reading begun after the load was set (one from before may still be fresh).
        sampled_after = (view["gpu_sampled_at"] or 0.0) > set_at
        return view if view["idle_seconds"] >= 1.5 and sampled_after else None

    idle = wait_until(idle_while_a_tab_polls, 30, "the session to idle under an open tab")
    assert idle["gpu_busy"] is False and idle["kernels_busy"] == 0
    assert [g["index"] for g in idle["gpu"]["gpus"]] == [2, 3]
    assert idle["gpu"]["gpus"][0]["memory_used_mib"] == 40_000
    # The server itself counts the tab's requests: it would report the session active.
    status = requests.get(f"{server.url}/api/status", params=server._auth, timeout=10).json()
    server_idle = idle["now"] - datetime.fromisoformat(status["last_activity"]).timestamp()
    assert server_idle < idle["idle_seconds"]

    gpus.set(85)
    busy = wait_until(
        lambda: (v := server.activity().json())["gpu_busy"] and v, 30, "the busy GPUs to show"
    )
    # the busy GPUs are the session's latest activity: later than any before them
    assert busy["now"] - busy["idle_seconds"] > idle["now"] - idle["idle_seconds"]
    assert {g["utilization_percent"] for g in busy["gpu"]["gpus"]} == {85}
    assert busy["gpu"]["source"] == "nvidia-smi"

    gpus.set(0)
    wait_until(
        lambda: server.activity().json()["idle_seconds"] >= 1.0, 30, "idleness to grow again"
    )


def test_keep_my_session_is_activity_now_and_logged(gpu_session):
    server, gpus = gpu_session
    gpus.set(0)
    wait_until(lambda: server.activity().json()["idle_seconds"] >= 1.0, 30, "some idleness")
    kept = server.activity(json={"keep": True})
    assert kept.status_code == 200, kept.text
    assert kept.json()["idle_seconds"] < 1.0 and kept.json()["kept_at"]
    assert "the user kept the session after" in server.log_path.read_text()

    refused = server.activity(json={"keep": "yes"})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "bad_request"


def execute(server: JupyterServer, kernel_id: str, code: str) -> None:
    """Send ``code`` to the kernel to execute, without waiting for it."""
    import websocket  # websocket-client, as Jupyter's own tests use

    ws_url = f"ws://127.0.0.1:{server.port}/api/kernels/{kernel_id}/channels?token={server.token}"
    ws = websocket.create_connection(ws_url, timeout=30)
    header = {
        "msg_id": secrets.token_hex(8),
        "session": secrets.token_hex(8),
        "username": "test",
        "msg_type": "execute_request",
        "version": "5.3",
    }
    content = {"code": code, "silent": False, "store_history": False, "allow_stdin": False}
    message = {"header": header, "parent_header": {}, "metadata": {}, "content": content}
    ws.send(json.dumps({**message, "channel": "shell", "buffers": []}))
    ws.close()


def test_a_kernel_executing_in_silence_keeps_the_session_active(gpu_session):
    server, _ = gpu_session
    made = requests.post(f"{server.url}/api/kernels", params=server._auth, timeout=60)
    assert made.status_code == 201, made.text
    kernel_id = made.json()["id"]
    execute(server, kernel_id, "import time; time.sleep(30)")  # a loop that prints nothing
    busy = wait_until(
        lambda: (v := server.activity().json())["kernels_busy"] == 1 and v, 60, "a busy kernel"
    )
    assert busy["idle_seconds"] == 0.0
    time_of_busy = busy["now"]
    later = wait_until(
        lambda: (v := server.activity().json())["now"] >= time_of_busy + 1.5 and v, 30, "time"
    )
    assert later["kernels_busy"] == 1 and later["idle_seconds"] == 0.0
    requests.post(
        f"{server.url}/api/kernels/{kernel_id}/interrupt", params=server._auth, timeout=30
    )


# ---- the idle warning -------------------------------------------------------------------

NOW = 1_000_000.0
LIMITS = {"idle": 3600.0, "busy": 900.0, "protected": 1800.0}


def granted_slice(protected_for: float) -> dict:
    return {"state": "granted", "min_runtime": 600, "protected_until": NOW + protected_for}


def test_a_protected_session_is_warned_before_the_protected_limit():
    slice_ = granted_slice(3000)
    assert cull_warning(slice_, NOW, 1800 - 601, LIMITS, 600) is None
    warning = cull_warning(slice_, NOW, 1800 - 300, LIMITS, 600)
    assert warning["protected"] and warning["limit_seconds"] == 1800
    assert warning["deadline"] == NOW + 300
    assert "idle for 25 min" in warning["message"]
    assert "if someone is waiting for its GPUs" in warning["message"]


def test_past_protection_the_shorter_limit_counts_and_off_limits_never_warn():
    slice_ = granted_slice(-1)
    warning = cull_warning(slice_, NOW, 800, LIMITS, 600)
    assert warning["limit_seconds"] == 900 and not warning["protected"]
    assert warning["deadline"] == NOW + 100
    off = {"idle": 0.0, "busy": 0.0, "protected": 0.0}
    assert cull_warning(slice_, NOW, 10**6, off, 600) is None
    assert cull_warning(slice_, NOW, 800, LIMITS, 0) is None  # warnings turned off
    # Past the limit: the deadline is now, not in the past.
    assert cull_warning(slice_, NOW, 5000, LIMITS, 600)["deadline"] == NOW


def test_only_a_granted_slice_is_warned():
    slice_ = {**granted_slice(-1), "state": "preempting"}
    assert cull_warning(slice_, NOW, 5000, LIMITS, 600) is None
