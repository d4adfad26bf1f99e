"""The embedded default, ``jupyterhub_config.py``, read as JupyterHub reads it."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
from traitlets.config.loader import PyFileConfigLoader

from broker.config import DEMO_CONFIG, load_config

REPO = Path(__file__).resolve().parent.parent
SCOPE_NAME = re.compile(r"^custom:[a-z0-9][a-z0-9_\-\*:]+[a-z0-9_\*]$")  # JupyterHub's rule


def load(tmp_path, monkeypatch, nvidia_smi: str | None = None, **env):
    monkeypatch.chdir(tmp_path)
    for key in (
        "SLICEBROKER_CONFIG",
        "SLICEBROKER_DB_URL",
        "SLICEBROKER_PORT",
        "SLICEBROKER_PORT_OFFSET",
        "SLICEBROKER_DEMO_PASSWORD",
    ):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A stand-in nvidia-smi: the GPUs given, or none (as where no driver is loaded).
    script = bin_dir / "nvidia-smi"
    if nvidia_smi is None:
        script.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    else:
        script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{nvidia_smi}EOF\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return PyFileConfigLoader("jupyterhub_config.py", path=str(REPO)).load_config()


def service(config, name):
    return next(s for s in config.JupyterHub.services if s["name"] == name)


def role(config, name):
    return next(r for r in config.JupyterHub.load_roles if r["name"] == name)


def test_without_gpus_the_hub_runs_the_demo_inventory(tmp_path, monkeypatch, capsys):
    config = load(tmp_path, monkeypatch)
    broker = service(config, "slicebroker")

    assert broker["environment"]["SLICEBROKER_CONFIG"] == str(DEMO_CONFIG)
    assert (
        broker["environment"]["SLICEBROKER_DB_URL"]
        == f"sqlite:///{tmp_path / 'slicebroker.sqlite'}"
    )
    assert broker["command"][1:] == ["-m", "broker.service"]
    assert broker["url"] == "http://127.0.0.1:10101"
    assert config.SliceBrokerMixin.broker_url == "http://127.0.0.1:10101/services/slicebroker"
    assert config.SliceBrokerMixin.max_gpus == 8
    assert config.Spawner.default_url == "/lab"  # sessions open JupyterLab
    # Idle sessions are stopped by the spawner: no culler service stops them unannounced.
    assert {s["name"] for s in config.JupyterHub.services} == {"slicebroker", "slicebroker-spawner"}
    assert "no GPU found with nvidia-smi" in capsys.readouterr().out


def test_with_gpus_the_hub_runs_on_them(tmp_path, monkeypatch):
    smi = "0, NVIDIA H100 80GB HBM3, 81559 MiB\n1, NVIDIA H100 80GB HBM3, 81559 MiB\n"
    config = load(tmp_path, monkeypatch, nvidia_smi=smi)
    cluster_file = service(config, "slicebroker")["environment"]["SLICEBROKER_CONFIG"]
    cluster = load_config(cluster_file)

    assert Path(cluster_file) == tmp_path / "slicebroker-cluster.toml"
    assert [(n.gpu_type, n.gpu_count) for n in cluster.nodes] == [("h100", 2)]
    assert config.SliceBrokerSpawner.local_nodes == [cluster.nodes[0].name]
    assert config.SliceBrokerMixin.max_gpus == 2


def test_the_spawner_acts_with_a_fresh_agent_token_of_a_service_with_the_agent_role(
    tmp_path, monkeypatch
):
    first = load(tmp_path, monkeypatch)
    token = first.SliceBrokerMixin.broker_token

    assert first.JupyterHub.spawner_class == "spawner.local.SimpleSliceBrokerSpawner"
    assert service(first, "slicebroker-spawner")["api_token"] == token and len(token) >= 32
    assert role(first, "slicebroker-agent") == {
        "name": "slicebroker-agent",
        "scopes": ["custom:slicebroker:agent", "access:services!service=slicebroker"],
        "services": ["slicebroker-spawner"],
    }
    (tmp_path / "again").mkdir()
    again = load(tmp_path / "again", monkeypatch)
    assert again.SliceBrokerMixin.broker_token != token


def test_scopes_and_roles(tmp_path, monkeypatch):
    config = load(tmp_path, monkeypatch)

    assert set(config.JupyterHub.custom_scopes) == {
        "custom:slicebroker:admin",
        "custom:slicebroker:agent",
    }
    assert all(SCOPE_NAME.match(name) for name in config.JupyterHub.custom_scopes)
    assert "custom:slicebroker:admin" in role(config, "slicebroker-admin")["scopes"]
    assert role(config, "slicebroker-admin")["users"] == ["admin"]
    assert "access:services!service=slicebroker" in role(config, "user")["scopes"]
    # A session's own token uses the broker as its user (slicebroker run in a terminal).
    assert {"access:services!service=slicebroker", "read:users:groups!user"} <= set(
        role(config, "server")["scopes"]
    )
    services = {s["name"] for s in config.JupyterHub.services}
    for r in config.JupyterHub.load_roles:
        assert set(r.get("services", [])) <= services


def test_demo_users_and_pages(tmp_path, monkeypatch):
    config = load(tmp_path, monkeypatch, SLICEBROKER_DEMO_PASSWORD="s3cret")

    assert config.Authenticator.allowed_users == {"admin", "alice", "bob", "carol", "dave"}
    assert config.Authenticator.admin_users == {"admin"}
    assert config.DummyAuthenticator.password == "s3cret"
    assert config.JupyterHub.cleanup_servers is False
    (templates,) = config.JupyterHub.template_paths
    assert {"not_running.html", "home.html"} <= {p.name for p in Path(templates).iterdir()}
    assert callable(config.JupyterHub.template_vars["slicebroker_notices"])
    assert callable(config.JupyterHub.template_vars["slicebroker_sessions"])


@pytest.mark.parametrize("port", ["10555"])
def test_the_broker_port_and_database_come_from_the_environment(tmp_path, monkeypatch, port):
    config = load(
        tmp_path, monkeypatch, SLICEBROKER_PORT=port, SLICEBROKER_DB_URL="postgresql://db/broker"
    )
    assert service(config, "slicebroker")["url"] == f"http://127.0.0.1:{port}"
    assert (
        service(config, "slicebroker")["environment"]["SLICEBROKER_DB_URL"]
        == "postgresql://db/broker"
    )
    assert config.SliceBrokerMixin.broker_url == f"http://127.0.0.1:{port}/services/slicebroker"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLICEBROKER_PORT": "abc"}, "SLICEBROKER_PORT must be a port number, 0-65535, not 'abc'"),
        ({"SLICEBROKER_PORT": "70000"}, "SLICEBROKER_PORT must be a port number"),
        ({"SLICEBROKER_PORT_OFFSET": "-3"}, "SLICEBROKER_PORT_OFFSET must be a port number"),
        ({"SLICEBROKER_PORT_OFFSET": "60000"}, "puts the broker past port 65535"),
        ({"SLICEBROKER_CONFIG": "BAD"}, "projects.x.share: expected a share"),
    ],
)
def test_a_bad_setting_stops_the_hub_with_one_line(tmp_path, monkeypatch, env, message):
    # JupyterHub shows any other error in its config file as a traceback.
    if env.get("SLICEBROKER_CONFIG") == "BAD":
        bad = tmp_path / "bad.toml"
        bad.write_text("[projects.x]\nshare = 0\n")
        env = {"SLICEBROKER_CONFIG": str(bad)}
    with pytest.raises(SystemExit) as stopped:
        load(tmp_path, monkeypatch, **env)
    assert str(stopped.value.code).startswith("slicebroker: ")
    assert message in str(stopped.value.code) and "\n" not in str(stopped.value.code)
