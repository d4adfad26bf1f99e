"""docs/install.md's separate broker: started on its own with the hub's variables, registered
with the hub as an external service, it takes a session's own token (what Lab's extension
and ``slicebroker run`` in a terminal use), and ``slicebroker run -- CMD`` with no flags
from the session's environment charges the session's project."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import pytest
import requests
from hubfixtures import TEST_CLUSTER, HubProcess, proxy_available, session_environ, wait_until
from servicefixtures import service_env

#: install.md's step 2: the broker an external service, the hub starts nothing.
EXTERNAL = """
for service in c.JupyterHub.services:
    if service["name"] == "slicebroker":
        service.pop("command")
        service.pop("environment")
        service["api_token"] = os.environ["SB_SERVICE_TOKEN"]
"""


@pytest.fixture(scope="module")
def hub_and_broker(tmp_path_factory) -> Iterator[HubProcess]:
    missing = proxy_available()
    if missing:
        pytest.skip(missing)
    workdir = tmp_path_factory.mktemp("separate-broker")
    service_token = secrets.token_hex(32)
    os.environ["SB_SERVICE_TOKEN"] = service_token  # read by the hub's config
    hub = HubProcess(workdir / "hub", extra_config=EXTERNAL)
    (workdir / "cluster.toml").write_text(TEST_CLUSTER)
    # install.md's step 3: the broker with the hub's variables.
    env = service_env(
        {
            "JUPYTERHUB_API_URL": f"{hub.settings['hub_bind_url']}/hub/api",
            "JUPYTERHUB_API_TOKEN": service_token,
            "JUPYTERHUB_SERVICE_NAME": "slicebroker",
            "JUPYTERHUB_SERVICE_PREFIX": "/services/slicebroker/",
            "JUPYTERHUB_CLIENT_ID": "service-slicebroker",
            "JUPYTERHUB_OAUTH_CALLBACK_URL": "/services/slicebroker/oauth_callback",
        }
    )
    with open(workdir / "broker.log", "wb") as log:
        broker = subprocess.Popen(
            [sys.executable, "-m", "broker.cli", "serve",
             f"--cluster-file={workdir / 'cluster.toml'}",
             f"--db-url=sqlite:///{workdir / 'broker.sqlite'}",
             "--ip=127.0.0.1", f"--port={hub.broker_port}", "--pass-interval=1"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
        )  # fmt: skip
    try:
        hub.start()
        wait_until(
            lambda: requests.get(hub.broker_url + "/", timeout=5).status_code < 500,
            60,
            f"the broker to answer (log: {workdir / 'broker.log'})",
        )
        yield hub
    finally:
        hub.shutdown()
        broker.terminate()
        broker.wait(15)
        os.environ.pop("SB_SERVICE_TOKEN", None)


def test_a_session_of_a_separate_broker_uses_it_with_its_own_token(hub_and_broker):
    hub = hub_and_broker
    assert hub.start_server("alice", project="vision", gpus=1, protected="15m").ok
    hub.wait_ready("alice")
    held = hub.slice_of("alice")

    # The standin's /broker asks the broker who it is, with the session's environment.
    reply = hub.user_get("alice", "broker")
    assert reply.status_code == 200, reply.text
    assert reply.json()["name"] == "alice"
    env = hub.user_get("alice", "env").json()
    assert env["SLICEBROKER_PROJECT"] == "vision"
    assert held["state"] == "granted" and held["user"] == "alice"

    # What a Lab terminal of this session runs: no flags, the session's environment only.
    environ = session_environ(hub.server("alice"))
    run = subprocess.run(
        [sys.executable, "-m", "broker.cli", "run", "--",
         sys.executable, "-c", "import os; print('ran for', os.environ['SLICEBROKER_PROJECT'])"],
        env=environ, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "ran for vision" in run.stdout
    (job,) = [s for s in hub.slices(user="alice") if s["kind"] == "batch"]
    assert (job["project"], job["gpus"], job["state"]) == ("vision", 1, "ended")
    hub.stop_server("alice")
