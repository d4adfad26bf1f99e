"""The broker as a JupyterHub-managed service, behind a real hub and proxy.

A ``jupyterhub`` subprocess (configurable-http-proxy, SQLite, the dummy
authenticator) launches ``python -m broker.service`` from its
``c.JupyterHub.services`` entry; requests go through the hub's proxy to
``/services/slicebroker/api/v1``. Identities come from JupyterHub: user tokens
carry the user's groups; custom scopes make admins and agents; a token without
``access:services!service=slicebroker`` is refused.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from servicefixtures import TEST_CONFIG, free_port, service_env, wait_until_answering

pytestmark = pytest.mark.skipif(
    shutil.which("configurable-http-proxy") is None or shutil.which("jupyterhub") is None,
    reason="needs jupyterhub and configurable-http-proxy (npm install -g configurable-http-proxy)",
)

HUB_CONFIG = """\
import sys

c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {hub_port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_api_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.ConfigurableHTTPProxy.pid_file = "proxy.pid"
c.JupyterHub.db_url = "sqlite:///jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "jupyterhub_cookie_secret"
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allowed_users = {{"erin", "frank", "ada"}}
c.JupyterHub.load_groups = {{"nlp-team": {{"users": ["erin"]}}}}
c.JupyterHub.api_tokens = {{
    "{erin}": "erin",
    "{frank}": "frank",
    "{ada}": "ada",
}}
c.JupyterHub.services = [
    {{
        "name": "slicebroker",
        "url": "http://127.0.0.1:{broker_port}",
        "command": [
            sys.executable, "-m", "broker.service",
            "--config-file={config_file}",
            "--db-url={db_url}",
        ],
    }},
    {{"name": "slicebroker-spawner", "api_token": "{agent}"}},
    {{"name": "outsider", "api_token": "{outsider}"}},
]
c.JupyterHub.custom_scopes = {{
    "custom:slicebroker:admin": {{"description": "Administer the GPU broker"}},
    "custom:slicebroker:agent": {{"description": "Request GPU slices for any user"}},
}}
c.JupyterHub.load_roles = [
    {{"name": "user", "scopes": ["self", "access:services!service=slicebroker"]}},
    {{
        "name": "slicebroker-admin",
        "users": ["ada"],
        "scopes": ["access:services!service=slicebroker", "custom:slicebroker:admin"],
    }},
    {{
        "name": "slicebroker-agent",
        "services": ["slicebroker-spawner"],
        "scopes": ["access:services!service=slicebroker", "custom:slicebroker:agent"],
    }},
]
"""


@dataclass
class Hub:
    url: str  # the broker's API root through the hub's proxy
    tokens: dict[str, str]
    log_path: Path

    def call(self, method: str, path: str, who: str | None, **kwargs) -> requests.Response:
        headers = {"Authorization": f"token {self.tokens[who]}"} if who else {}
        return requests.request(method, self.url + path, headers=headers, timeout=20, **kwargs)


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[Hub]:
    directory = tmp_path_factory.mktemp("hub")
    tokens = {name: secrets.token_hex(24) for name in ("erin", "frank", "ada", "agent", "outsider")}
    (directory / "cluster.toml").write_text(TEST_CONFIG)
    hub_port = free_port()
    (directory / "jupyterhub_config.py").write_text(
        HUB_CONFIG.format(
            hub_port=hub_port,
            hub_api_port=free_port(),
            proxy_api_port=free_port(),
            broker_port=free_port(),
            config_file=directory / "cluster.toml",
            db_url=f"sqlite:///{directory / 'broker.sqlite'}",
            **tokens,
        )
    )
    log_path = directory / "hub.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", "jupyterhub_config.py"],
            cwd=directory,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=service_env(),
        )
    hub = Hub(f"http://127.0.0.1:{hub_port}/services/slicebroker/api/v1", tokens, log_path)
    try:
        wait_until_answering(
            hub.url + "/",
            process,
            lambda: log_path.read_text()[-4000:],
            90.0,
            what="jupyterhub with the broker",
        )
        yield hub
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_a_user_token_is_identified_with_the_users_groups(hub):
    reply = hub.call("GET", "/whoami", "erin")
    assert reply.status_code == 200, reply.text
    assert reply.json() == {
        "name": "erin",
        "kind": "user",
        "groups": ["nlp-team"],
        "admin": False,
        "agent": False,
        "projects": ["nlp"],
    }
    made = hub.call("POST", "/slices", "erin", json={"project": "nlp", "gpus": 1, "kind": "batch"})
    assert made.status_code == 201, made.text
    assert made.json()["user"] == "erin"
    assert made.headers["Location"].startswith("/services/slicebroker/api/v1/slices/")


def test_a_user_may_not_act_for_another(hub):
    body = {"project": "nlp", "gpus": 1, "kind": "batch", "user": "erin", "groups": ["nlp-team"]}
    assert hub.call("POST", "/slices", "frank", json=body).status_code == 403
    body = {"project": "nlp", "gpus": 1, "kind": "batch"}
    assert hub.call("POST", "/slices", "frank", json=body).status_code == 403


def test_an_agent_token_acts_for_a_user(hub):
    me = hub.call("GET", "/whoami", "agent").json()
    assert (me["name"], me["kind"], me["agent"], me["admin"]) == (
        "slicebroker-spawner",
        "service",
        True,
        False,
    )
    body = {"project": "nlp", "gpus": 2, "kind": "interactive", "min_runtime": "15m"}
    made = hub.call(
        "POST", "/slices", "agent", json=body | {"user": "erin", "groups": ["nlp-team"]}
    )
    assert made.status_code == 201, made.text
    assert made.json()["user"] == "erin"
    slice_id = made.json()["id"]
    seen = hub.call("GET", f"/slices/{slice_id}", "erin", params={"wait": 5, "state": "pending"})
    assert seen.json()["state"] == "granted"
    assert hub.call("DELETE", f"/slices/{slice_id}", "agent").json()["end_reason"] == "released"
    refused = hub.call("POST", "/slices", "agent", json=body | {"user": "frank"})
    assert refused.status_code == 403


def test_the_admin_scope_makes_an_admin(hub):
    me = hub.call("GET", "/whoami", "ada").json()
    assert me["admin"] is True and me["projects"] == ["nlp", "vision"]
    assert hub.call("PUT", "/projects/vision", "ada", json={"share": 2}).status_code == 200
    assert hub.call("PUT", "/projects/vision", "erin", json={"share": 3}).status_code == 403


def test_tokens_without_access_to_the_service_are_refused(hub):
    reply = hub.call("GET", "/whoami", "outsider")
    assert reply.status_code == 403, reply.text
    assert reply.json()["error"]["code"] == "forbidden"
    assert hub.call("GET", "/whoami", None).status_code == 401
    hub.tokens["forged"] = secrets.token_hex(24)
    assert hub.call("GET", "/whoami", "forged").status_code == 401


def test_no_token_reaches_the_log(hub):
    log = hub.log_path.read_text()
    assert "slicebroker" in log and "serving" in log
    for who, token in hub.tokens.items():
        assert token not in log, who
