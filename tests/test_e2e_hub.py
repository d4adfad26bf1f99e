"""End to end: a real JupyterHub with configurable-http-proxy, the broker service and real
single-user processes, driven over HTTP only (design.md §7).

The single-user servers are :mod:`spawner.standin` (a real tornado server that
serves ``/api`` for the hub and ``/env`` for these tests, and starts in a
fraction of a second), except in one test that runs the real
``jupyterhub-singleuser`` (Jupyter Server) to show the spawner works with it.
The cluster is one node of 2 GPUs with 2 s grace periods and a 2 s protected
choice (``tests/hubfixtures.py``). Tests wait by polling the hub or
long-polling the broker, never by sleeping.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hubfixtures import TEST_CLUSTER, HubProcess, proxy_available, wait_until

pytestmark = pytest.mark.skipif(proxy_available() is not None, reason=str(proxy_available()))

REAL_SINGLEUSER = """
c.Spawner.group_overrides = {
    "real": {"groups": ["real-singleuser"], "spawner_override": {"cmd": ["jupyterhub-singleuser"]}}
}
c.JupyterHub.load_groups["real-singleuser"] = {"users": ["gina"]}
c.JupyterHub.load_roles[-1]["scopes"].append("tokens")
"""
CLUSTER = TEST_CLUSTER.replace('"dave", "erin", "frank"', '"dave", "erin", "frank", "gina"')


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = HubProcess(tmp_path_factory.mktemp("hub"), cluster=CLUSTER, extra_config=REAL_SINGLEUSER)
    try:
        yield hub.start()
    finally:
        hub.shutdown()


@pytest.fixture
def clean(hub):
    """Every test starts and ends on an empty cluster."""
    yield hub
    hub.remember_pids()
    for user in hub.users():
        if user.get("servers"):
            hub.stop_server(user["name"], wait=False)
    wait_until(lambda: not hub.slices(state="live"), 30, "every slice to end")
    wait_until(lambda: not any(u.get("servers") for u in hub.users()), 30, "every server to stop")


def gpu_list(slice_):
    return ",".join(str(i) for p in slice_["placements"] for i in p["gpu_indices"])


def fill_cluster(hub, user="dave"):
    """``user`` holds both GPUs under a 15-minute protection; their slice."""
    assert hub.start_server(user, project="systems", gpus=2, protected="15m").status_code in (
        201,
        202,
    )
    hub.wait_ready(user)
    return hub.slice_of(user)


def wait_pending(hub, user):
    def pending():
        slice_ = hub.slice_of(user)
        return (
            slice_ if slice_ and slice_["state"] == "pending" and slice_["queue_position"] else None
        )

    return wait_until(pending, 30, f"{user}'s request to wait in the queue")


def test_a_server_started_through_the_rest_api_sees_the_granted_gpus(clean):
    hub = clean
    response = hub.start_server("alice", project="vision", gpus=1, protected="15m")
    assert response.status_code in (201, 202), response.text
    server = hub.wait_ready("alice")
    slice_ = hub.slice_of("alice")
    env = hub.user_get("alice", "env").json()

    assert slice_["state"] == "granted" and slice_["user"] == "alice"
    home = hub.login("alice").get(f"{hub.url}/hub/home", timeout=10).text
    assert f"1 GPU for project vision on {slice_['placements'][0]['node']}" in home
    assert "protected until" in home
    assert env["CUDA_VISIBLE_DEVICES"] == gpu_list(slice_)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["SLICEBROKER_SLICE_ID"] == str(slice_["id"])
    assert env["SLICEBROKER_PROJECT"] == "vision"
    assert env["SLICEBROKER_PROTECTED_UNTIL"] == time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(slice_["protected_until"])
    )
    assert slice_["protected_until"] == pytest.approx(slice_["granted_at"] + 900)
    # The user options as given; the slice's fields, resolved, in the spawner's state.
    assert server["user_options"] == {"project": "vision", "gpus": 1, "protected": "15m"}
    held = server["state"]["slicebroker"]
    assert held["slice_id"] == slice_["id"]
    assert {k: held["slice"][k] for k in ("project", "gpus", "gpu_type", "min_runtime")} == {
        "project": "vision",
        "gpus": 1,
        "gpu_type": None,
        "min_runtime": 900.0,
    }


def test_stopping_releases_the_slice_and_the_charge_equals_the_held_time(clean):
    hub = clean
    hub.start_server("bob", project="vision", gpus=2, protected="15m")
    hub.wait_ready("bob")
    held = hub.slice_of("bob")

    hub.stop_server("bob")
    ended = hub.broker("GET", f"/slices/{held['id']}")

    assert ended["state"] == "ended" and ended["end_reason"] == "released"
    assert ended["charged_gpu_seconds"] == pytest.approx(
        2 * (ended["ended_at"] - ended["granted_at"]), abs=1e-6
    )
    assert ended["charged_gpu_seconds"] > 0


def test_the_progress_stream_shows_the_queue_position_while_the_cluster_is_full(clean):
    hub = clean
    fill_cluster(hub, "dave")
    assert hub.start_server("erin", project="systems", gpus=1, protected="15m").status_code == 202

    events = hub.progress_events("erin", until=lambda e: "1st in the queue" in e.get("message", ""))
    waiting = wait_pending(hub, "erin")

    queue = [e for e in events if "in the queue" in e.get("message", "")]
    assert queue, events
    assert "1st in the queue" in queue[-1]["message"]
    assert "× its share" in queue[-1]["message"]
    assert "estimated start" in queue[-1]["message"]
    assert "<strong>1st in the queue</strong>" in queue[-1]["html_message"]
    assert waiting["queue_position"] == 1
    home = hub.login("erin").get(f"{hub.url}/hub/home", timeout=10).text
    assert "Waiting for 1 GPU for project systems: 1st in the queue" in home
    assert hub.server("erin")["pending"] == "spawn"
    # poll() says "running" while the request waits: the hub keeps the spawn pending.
    assert hub.server("erin")["ready"] is False


def test_cancelling_a_pending_spawn_withdraws_its_request(clean):
    hub = clean
    fill_cluster(hub, "dave")
    hub.start_server("erin", project="systems", gpus=1, protected="15m")
    waiting = wait_pending(hub, "erin")

    hub.stop_server("erin")
    withdrawn = hub.broker("GET", f"/slices/{waiting['id']}")

    assert withdrawn["state"] == "ended" and withdrawn["end_reason"] == "cancelled"
    assert withdrawn["charged_gpu_seconds"] == 0
    assert hub.slice_of("dave")["state"] == "granted"


def test_a_notebook_past_protection_is_preempted_for_a_higher_ranked_request_and_its_user_sees_why(
    clean,
):
    hub = clean
    # alice and bob (vision) hold the node's 2 GPUs, nlp nothing: bob's GPU for carol
    # leaves both projects at their fair share, a fair-share move; alice's session
    # is still protected.
    hub.start_server("alice", project="vision", gpus=1, protected="15m")
    hub.wait_ready("alice")
    hub.start_server("bob", project="vision", gpus=1, protected="2s")
    hub.wait_ready("bob")
    victim = hub.slice_of("bob")
    bob = hub.login("bob")

    hub.start_server("carol", project="nlp", gpus=1, protected="15m")
    ended = hub.wait_slice(victim["id"], "granted")
    if ended["state"] == "preempting":
        ended = hub.wait_slice(victim["id"], "preempting")
    hub.wait_ready("carol")
    wait_until(lambda: hub.server("bob") is None, 30, "bob's server to stop")
    page = bob.get(f"{hub.url}/user/bob/", timeout=10)
    home = bob.get(f"{hub.url}/hub/home", timeout=10)
    form = bob.get(f"{hub.url}/hub/spawn", timeout=10)
    granted = hub.slice_of("carol")
    events = hub.broker("GET", f"/slices/{victim['id']}/events")["events"]

    assert [e["to_state"] for e in events] == ["pending", "granted", "preempting", "ended"]
    assert ended["preempt_reason"] == "fair_share" and ended["end_reason"] == "preempted"
    assert ended["preempt_deadline"] >= ended["protected_until"]
    assert ended["ended_at"] >= ended["preempt_deadline"]
    assert granted["state"] == "granted" and gpu_list(granted) == gpu_list(victim)
    assert hub.user_get("carol", "env").json()["CUDA_VISIBLE_DEVICES"] == gpu_list(victim)
    # The user sees why, when, and what to do: on the page of the stopped server ...
    assert page.status_code == 424
    assert "Your GPU session was preempted" in page.text
    assert "ranks higher in fair share" in page.text
    assert time.strftime("%H:%M:%S UTC", time.gmtime(ended["ended_at"])) in page.text
    assert "Start a new session" in page.text
    # ... on the home page, and above the options form.
    assert "Your GPU session was preempted" in home.text
    assert 'id="sb-notice"' in form.text and "was preempted" in form.text


def test_errors_a_user_can_fix_are_shown_on_the_spawn_page_and_by_the_api(clean):
    hub = clean
    alice = hub.login("alice")
    form = alice.get(f"{hub.url}/hub/spawn", timeout=10)
    action = re.search(r'id="spawn_form"\s+action="([^"]+)"', form.text).group(1)
    logged = len(hub.log_text())  # what the hub logs from here on
    refused = alice.post(
        hub.url + html.unescape(action),
        data={"project": "nlp", "gpus": "1", "gpu_type": "", "protected": "15m"},
        timeout=30,
    )
    too_many = hub.start_server("alice", project="vision", gpus=5)

    if refused.status_code == 400:
        assert "You cannot charge project &#39;nlp&#39;. Your projects: vision." in refused.text
        assert 'id="sb-project"' in refused.text  # the form again, to correct the choice
    else:
        # Past the hub's slow_spawn_timeout (0.5 s here) the hub shows its pending page
        # and the refusal follows there (a loaded machine); the hub logs it.
        assert refused.status_code == 200, refused.status_code
        nlp = "You cannot charge project 'nlp'"
        wait_until(lambda: nlp in hub.log_text()[logged:], 30, "the hub to log the refusal")
    refusal = "a session here may have at most 2"
    if too_many.status_code == 400:
        assert refusal in too_many.json()["message"]
    else:
        # The hub answers once its slow_spawn_timeout (0.5 s here) is over: on a loaded
        # machine the refusal comes after the answer, and the hub logs it.
        assert too_many.status_code in (201, 202), too_many.text
        wait_until(lambda: refusal in hub.log_text()[logged:], 30, "the hub to log the refusal")
    wait_until(lambda: hub.server("alice") is None, 30, "alice's spawn to be gone")
    assert hub.slices(user="alice", state="live") == []


def test_a_hub_restart_keeps_running_sessions(clean):
    hub = clean
    hub.start_server("frank", project="systems", gpus=1, protected="15m")
    before = hub.wait_ready("frank")
    slice_ = hub.slice_of("frank")
    pid = before["state"]["pid"]

    hub.stop()
    assert _alive(pid)  # the hub stopped, its session's server did not
    hub.start()
    after = hub.wait_ready("frank")
    lease = hub.slice_of("frank")["lease_expires_at"]
    # The reconnected spawner heartbeats again: the lease moves on.
    wait_until(
        lambda: hub.slice_of("frank")["lease_expires_at"] > lease,
        15,
        "a heartbeat after the restart",
    )

    assert after["state"]["pid"] == pid
    assert after["state"]["slicebroker"]["slice_id"] == slice_["id"]
    assert hub.slice_of("frank")["id"] == slice_["id"]
    assert hub.user_get("frank", "env").json()["SLICEBROKER_SLICE_ID"] == str(slice_["id"])
    hub.stop_server("frank")
    assert hub.broker("GET", f"/slices/{slice_['id']}")["end_reason"] == "released"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(
    importlib.util.find_spec("jupyter_server") is None or not Path("/proc").is_dir(),
    reason="needs jupyter_server (jupyterhub-singleuser) and /proc",
)
def test_the_real_jupyterhub_singleuser_runs_on_its_slice(clean):
    hub = clean
    hub.start_server("gina", project="systems", gpus=1, protected="15m")
    server = hub.wait_ready("gina", timeout=60)
    slice_ = hub.slice_of("gina")
    environ = Path(f"/proc/{server['state']['pid']}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in environ if b"=" in item)

    assert env["CUDA_VISIBLE_DEVICES"] == gpu_list(slice_)
    assert env["SLICEBROKER_SLICE_ID"] == str(slice_["id"])
    assert hub.user_get("gina", "api").json()["version"]


@pytest.mark.skipif(shutil.which("slicebroker") is None, reason="slicebroker is not installed")
def test_a_batch_job_past_its_protection_is_preempted_for_a_notebook_of_an_under_used_project(
    clean, tmp_path
):
    hub = clean
    hub.api("POST", "/users", json={"usernames": ["erin"]})
    token = hub.api("POST", "/users/erin/tokens", json={"note": "batch"}).json()["token"]
    env = {
        **os.environ,
        "SLICEBROKER_URL": hub.broker_url.removesuffix("/api/v1"),
        "SLICEBROKER_TOKEN": token,
    }
    job = subprocess.Popen(
        [
            "slicebroker",
            "run",
            "--project",
            "systems",
            "--gpus",
            "2",
            "--min-runtime",
            "2s",
            "--no-resumable",  # the cluster's [defaults.batch] is resumable
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(600)",
        ],
        env=env,
        stdout=open(tmp_path / "job.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    try:
        batch = wait_until(
            lambda: next((s for s in hub.slices(user="erin", state="granted")), None),
            30,
            "the batch job to be granted",
        )
        hub.start_server("carol", project="nlp", gpus=2, protected="15m")
        hub.wait_slice(batch["id"], "granted")
        hub.wait_ready("carol")
        job.wait(30)
        ended = hub.broker("GET", f"/slices/{batch['id']}")
        states = [
            e["to_state"] for e in hub.broker("GET", f"/slices/{batch['id']}/events")["events"]
        ]

        assert states == ["pending", "granted", "preempting", "ended"]
        assert ended["preempt_reason"] in ("fair_share", "debug_lane")
        assert ended["ended_at"] <= ended["preempt_deadline"] + 1.0
        assert hub.slice_of("carol")["state"] == "granted"
        assert "preempt" in (tmp_path / "job.log").read_text()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_a_session_that_asked_to_come_back_is_started_again_in_its_place_after_a_preemption(
    clean,
):
    hub = clean
    hub.start_server("alice", project="vision", gpus=1, protected="15m")
    hub.wait_ready("alice")
    hub.start_server("bob", project="vision", gpus=1, protected="2s", restore=True)
    hub.wait_ready("bob")
    victim = hub.slice_of("bob")
    hub.start_server("carol", project="nlp", gpus=1, protected="15m")
    hub.wait_ready("carol")

    # bob's server stops at the end of its grace, and the hub starts it again at once:
    # a new request, queued in the old one's place, waiting for carol's GPU.
    def restoring():
        mine = hub.slices(user="bob", state="pending")
        return mine[-1] if mine else None

    back = wait_until(restoring, 60, "bob's session to be asked for again")
    ended = hub.broker("GET", f"/slices/{victim['id']}")
    assert (ended["state"], ended["preempt_reason"]) == ("ended", "fair_share")
    assert ended["replaced_by"] == back["id"]
    assert back["submitted_at"] == victim["submitted_at"]  # its place in vision's queue
    events = hub.broker("GET", f"/slices/{back['id']}/events")["events"]
    assert events[0]["reason"] == f"submitted: restores slice {victim['id']}"
    server = wait_until(lambda: hub.server("bob"), 30, "bob's server to be pending again")
    assert server["user_options"]["restores"] == victim["id"]
    assert server["user_options"]["restore"] is True

    # Once carol is done, bob's session runs again, on the same options, knowing what it is.
    hub.stop_server("carol")
    hub.wait_ready("bob")
    env = hub.user_get("bob", "env").json()
    assert env["SLICEBROKER_RESTORES"] == str(victim["id"])
    assert env["SLICEBROKER_PROJECT"] == "vision"
    assert hub.slice_of("bob")["id"] == back["id"]
