"""End to end: a process inside a session reaches the broker as the session's user
(``SLICEBROKER_URL`` and ``SLICEBROKER_TOKEN`` in its environment), and ``slicebroker
run`` from there charges the user's project — what a Lab terminal does."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hubfixtures import HubProcess, proxy_available, session_environ

pytestmark = pytest.mark.skipif(proxy_available() is not None, reason=str(proxy_available()))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = HubProcess(tmp_path_factory.mktemp("session-broker-hub"))
    try:
        yield hub.start()
    finally:
        hub.shutdown()


def test_a_process_in_a_session_uses_the_broker_as_its_user(hub):
    hub.start_server("alice", project="vision", gpus=1, protected="15m")
    hub.wait_ready("alice")

    # The session's own process asks the broker who it is, with its environment only.
    who = hub.user_get("alice", "broker")
    assert who.status_code == 200, who.text
    assert who.json() | {"projects": None} == {
        "name": "alice",
        "kind": "user",
        "groups": ["demo-users"],  # the server role reads the user's groups
        "admin": False,
        "agent": False,  # the session's token, not the spawner's
        "projects": None,
    }
    assert who.json()["projects"] == ["vision"]

    environ = session_environ(hub.server("alice"))
    assert environ["SLICEBROKER_URL"].endswith("/services/slicebroker")
    assert environ["SLICEBROKER_TOKEN"] == environ["JUPYTERHUB_API_TOKEN"]
    # "Any type" was asked for: the variable names the type granted, and protection ends
    # in ISO 8601 as in batch jobs.
    assert environ["SLICEBROKER_GPU_TYPE"] == "h100"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", environ["SLICEBROKER_PROTECTED_UNTIL"])

    # A batch job submitted from the session (as a terminal would) runs and is charged
    # to alice's project, on the GPU the session leaves free.
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker.cli",
            "run",
            "--project",
            "vision",
            "--gpus",
            "1",
            "--min-runtime",
            "0",
            "--",
            sys.executable,
            "-c",
            "import os; print('ran in', os.environ['SLICEBROKER_PROJECT'])",
        ],
        env={"PATH": environ.get("PATH", ""), **_broker_env(environ)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "ran in vision" in run.stdout
    (job,) = [s for s in hub.slices(user="alice") if s["kind"] == "batch"]
    assert job["project"] == "vision" and job["state"] == "ended"
    hub.stop_server("alice")


def _broker_env(environ: dict[str, str]) -> dict[str, str]:
    return {key: environ[key] for key in ("SLICEBROKER_URL", "SLICEBROKER_TOKEN")}
