"""The zero-to-jupyterhub example (docs/k8s/) parses and has the shape the chart reads.

The chart turns ``hub.services`` and ``hub.loadRoles`` (dicts keyed by name)
into ``c.JupyterHub.services`` and ``c.JupyterHub.load_roles``, keeps each
service's ``apiToken`` in its ``hub`` Secret as ``hub.services.<name>.apiToken``,
and runs ``hub.extraConfig`` as Python with ``c`` in scope. These tests read the
files as the chart would and check them against JupyterHub's and the broker's
own names, so that a renamed scope or trait breaks here, not in a cluster.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from jupyterhub.app import JupyterHub
from jupyterhub.scopes import scope_definitions
from jupyterhub.services.service import Service
from servicefixtures import REPO_ROOT
from traitlets.config import Config
from traitlets.utils.importstring import import_item

from broker.kube.inventory import KubernetesInventory
from broker.service.app import BrokerApp
from broker.service.auth import ADMIN_SCOPE, AGENT_SCOPE
from spawner.mixin import SliceBrokerMixin

K8S = Path(REPO_ROOT) / "docs" / "k8s"
BROKER = "slicebroker"
#: Scopes the broker and the spawner check or need: the custom scopes, and the
#: access scope JupyterHub's HubAuth requires of every token for the service.
CODE_SCOPES = {ADMIN_SCOPE, AGENT_SCOPE, f"access:services!service={BROKER}"}


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    return yaml.safe_load((K8S / "values.yaml").read_text())


@pytest.fixture(scope="module")
def manifests() -> list[dict[str, Any]]:
    found = []
    for name in ("broker.yaml", "rbac.yaml"):
        found += [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    return found


@pytest.fixture(scope="module")
def hub_config(values, monkeypatch_module) -> Config:
    """``c`` after the chart's ``hub.config`` and every ``hub.extraConfig`` snippet."""
    monkeypatch_module.setenv("SLICEBROKER_TOKEN", "a-token")
    c = Config(values["hub"].get("config", {}))
    for snippet in values["hub"]["extraConfig"].values():
        exec(compile(snippet, "hub.extraConfig", "exec"), {"c": c})
    return c


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def the(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(matches) == 1, (kind, name)
    return matches[0]


def secret_key(env: list[dict[str, Any]] | dict[str, Any], name: str) -> tuple[str, str]:
    """(Secret name, key) an environment variable is read from."""
    entries = env if isinstance(env, list) else [{"name": k, **v} for k, v in env.items()]
    (entry,) = [e for e in entries if e["name"] == name]
    ref = entry["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def known_scope(scope: str, custom: set[str]) -> bool:
    """A JupyterHub scope (with an optional ``!user``, ``!server`` or ``!kind=name``
    filter) or one of the declared custom scopes."""
    base, _, scope_filter = scope.partition("!")
    if base in custom:
        return not scope_filter
    if base not in scope_definitions:
        return False
    return scope_filter in ("", "user", "server") or bool(
        re.fullmatch(r"(user|group|server|service)=[\w.-]+(/[\w.-]+)?", scope_filter)
    )


def test_services_have_the_shape_of_jupyterhub_services(values):
    services = values["hub"]["services"]
    assert isinstance(services, dict)
    traits = set(Service.class_trait_names())
    for name, service in services.items():
        assert isinstance(service, dict), name
        # The chart moves apiToken into its Secret; the rest goes to JupyterHub as is.
        assert isinstance(service["apiToken"], str) and service["apiToken"], name
        unknown = set(service) - {"apiToken"} - traits
        assert not unknown, (name, unknown)
    assert urlparse(services[BROKER]["url"]).port == 8765


def test_custom_scopes_are_declared_and_are_the_codes(hub_config):
    declared = hub_config.JupyterHub.custom_scopes
    assert set(declared) == {ADMIN_SCOPE, AGENT_SCOPE}
    for scope, definition in declared.items():
        assert definition["description"], scope


def test_every_scope_named_exists(values, hub_config):
    custom = set(hub_config.JupyterHub.custom_scopes)
    named = [scope for role in values["hub"]["loadRoles"].values() for scope in role["scopes"]]
    named += values["hub"]["services"][BROKER]["oauth_client_allowed_scopes"]
    for scope in named:
        assert known_scope(scope, custom), scope
    assert set(named) >= CODE_SCOPES
    # The checker itself refuses what does not exist.
    assert not known_scope("delete:gpus", custom)
    assert not known_scope("custom:slicebroker:root", custom)


def test_roles_are_least_privilege_and_name_real_members(values, hub_config):
    roles = values["hub"]["loadRoles"]
    services = set(values["hub"]["services"])
    for name, role in roles.items():
        assert isinstance(role["scopes"], list), name
        assert set(role) <= {"scopes", "users", "groups", "services", "description"}, name
        assert set(role.get("services", ())) <= services, name
    # The broker calls nothing on the hub's API with its own token: it only
    # identifies callers' tokens (GET /hub/api/user with their token), so no role
    # gives it anything, and nobody gets scopes that nothing uses.
    assert not any(BROKER in role.get("services", ()) for role in roles.values())
    everything = {scope for role in roles.values() for scope in role["scopes"]}
    assert not everything & {"admin:users", "list:users", "delete:servers", "read:users"}
    # The agent scope goes to the spawner's service alone, the admin scope to users.
    agents = [r for r in roles.values() if AGENT_SCOPE in r["scopes"]]
    assert [r.get("services") for r in agents] == [["slicebroker-spawner"]]
    assert all(AGENT_SCOPE not in r["scopes"] for r in roles.values() if r.get("users"))


def test_the_spawners_agent_token_is_a_registered_service_token(values, hub_config):
    secret, key = secret_key(values["hub"]["extraEnv"], "SLICEBROKER_TOKEN")
    assert (secret, key) == ("hub", "hub.services.slicebroker-spawner.apiToken")
    service = key.split(".")[2]
    assert service in values["hub"]["services"]
    assert hub_config.SliceBrokerMixin.broker_token == "a-token"  # read from that variable


def test_the_hub_config_names_real_traits(hub_config):
    spawner_class = import_item(hub_config.JupyterHub.spawner_class)
    assert issubclass(spawner_class, SliceBrokerMixin)
    for section, cls in (("SliceBrokerMixin", SliceBrokerMixin), ("JupyterHub", JupyterHub)):
        traits = set(cls.class_trait_names(config=True))
        unknown = set(hub_config[section]) - traits
        assert not unknown, (section, unknown)
    assert hub_config.JupyterHub.cleanup_servers is False
    # The broker's URL as the hub reaches it: the service's address and prefix.
    url = urlparse(hub_config.SliceBrokerMixin.broker_url)
    assert (url.hostname, url.port, url.path) == (BROKER, 8765, f"/services/{BROKER}")


def test_the_spawner_culls_and_the_charts_culler_is_off(values, hub_config):
    assert values["cull"]["enabled"] is False
    # The spawner reads the limits as the rule does: a duration each, none off.
    mixin = SliceBrokerMixin(config=hub_config)
    limits = mixin.cull_limits()
    assert (limits.protected, limits.busy, limits.idle) == (3600.0, 900.0, 3600.0)


def test_singleuser_settings_have_the_charts_shape(values):
    singleuser = values["singleuser"]
    assert isinstance(singleuser["image"]["name"], str) and isinstance(
        singleuser["image"]["tag"], str
    )
    assert singleuser["defaultUrl"] == "/lab"
    # A spawn waits in the queue: the chart's 300 s default would give up on it.
    assert isinstance(singleuser["startTimeout"], int) and singleuser["startTimeout"] >= 1800
    for toleration in singleuser["extraTolerations"]:
        assert set(toleration) <= {"key", "operator", "value", "effect", "tolerationSeconds"}
    (rule,) = singleuser["networkPolicy"]["egress"]
    (peer,) = rule["to"]
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": BROKER}
    assert rule["ports"] == [{"port": 8765, "protocol": "TCP"}]


def test_the_broker_deployment_runs_as_the_hub_service(values, manifests):
    deployment = the(manifests, "Deployment", BROKER)
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == BROKER
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert secret_key(container["env"], "JUPYTERHUB_API_TOKEN") == (
        "hub",
        f"hub.services.{BROKER}.apiToken",
    )
    assert env["JUPYTERHUB_SERVICE_NAME"] == BROKER
    assert env["JUPYTERHUB_SERVICE_PREFIX"] == f"/services/{BROKER}/"
    assert urlparse(env["JUPYTERHUB_SERVICE_URL"]).port == container["ports"][0]["containerPort"]
    # The service account is rbac.yaml's, and the Service is where the hub looks.
    assert (
        pod["spec"]["serviceAccountName"]
        == the(manifests, "ServiceAccount", BROKER)["metadata"]["name"]
    )
    service = the(manifests, "Service", BROKER)
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": BROKER}
    hub_url = urlparse(values["hub"]["services"][BROKER]["url"])
    assert (hub_url.hostname, hub_url.port) == (BROKER, service["spec"]["ports"][0]["port"])


def test_the_broker_command_names_real_options(manifests):
    (container,) = the(manifests, "Deployment", BROKER)["spec"]["template"]["spec"]["containers"]
    assert container["command"][:3] == ["python", "-m", "broker.service"]
    classes = {"BrokerApp": BrokerApp, "KubernetesInventory": KubernetesInventory}
    for option in container["command"][3:]:
        name, _, value = option.removeprefix("--").partition("=")
        section, _, trait = name.partition(".")
        assert trait in classes[section].class_trait_names(config=True), option
        assert value, option
