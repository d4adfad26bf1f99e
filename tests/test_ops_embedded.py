"""The embedded default's ports and files, moved by two variables so that two hubs
fit on one machine (``docs/hub-admin.md``, "The embedded default")."""

from __future__ import annotations

from pathlib import Path

from test_spawner_config import load, service


def ports_and_files(config) -> dict:
    broker = service(config, "slicebroker")
    hub, proxy = config.JupyterHub, config.ConfigurableHTTPProxy
    return {  # a port left unset is JupyterHub's default
        "public": hub.port if "port" in hub else 8000,
        "hub": hub.hub_port if "hub_port" in hub else 8081,
        "proxy_api": proxy.api_url if "api_url" in proxy else "http://127.0.0.1:8001",
        "broker": broker["url"],
        "spawner_to_broker": config.SliceBrokerMixin.broker_url,
        "hub_db": config.JupyterHub.db_url,
        "cookie_secret": config.JupyterHub.cookie_secret_file,
        "proxy_pid": config.ConfigurableHTTPProxy.pid_file,
        "broker_db": broker["environment"]["SLICEBROKER_DB_URL"],
        "cluster": broker["environment"]["SLICEBROKER_CONFIG"],
    }


def test_by_default_the_ports_are_jupyterhubs_and_the_files_in_the_current_folder(
    tmp_path, monkeypatch
):
    got = ports_and_files(load(tmp_path, monkeypatch))
    assert got == {
        "public": 8000,
        "hub": 8081,
        "proxy_api": "http://127.0.0.1:8001",
        "broker": "http://127.0.0.1:10101",
        "spawner_to_broker": "http://127.0.0.1:10101/services/slicebroker",
        "hub_db": f"sqlite:///{tmp_path / 'jupyterhub.sqlite'}",
        "cookie_secret": str(tmp_path / "jupyterhub_cookie_secret"),
        "proxy_pid": str(tmp_path / "jupyterhub-proxy.pid"),
        "broker_db": f"sqlite:///{tmp_path / 'slicebroker.sqlite'}",
        "cluster": got["cluster"],  # the demo file: no GPUs here
    }


def test_an_offset_moves_every_port_and_a_folder_takes_every_file(tmp_path, monkeypatch):
    state = tmp_path / "second-hub"  # made if missing
    config = load(
        tmp_path, monkeypatch, SLICEBROKER_PORT_OFFSET="100", SLICEBROKER_STATE_DIR=str(state)
    )
    got = ports_and_files(config)
    assert (got["public"], got["hub"], got["proxy_api"]) == (8100, 8181, "http://127.0.0.1:8101")
    assert got["broker"] == "http://127.0.0.1:10201"
    assert got["spawner_to_broker"] == "http://127.0.0.1:10201/services/slicebroker"
    files = [got["hub_db"], got["cookie_secret"], got["proxy_pid"], got["broker_db"]]
    assert [Path(f.removeprefix("sqlite:///")).parent for f in files] == [state] * 4
    assert state.is_dir()
    # SLICEBROKER_PORT still names the broker's port outright
    (tmp_path / "x").mkdir()
    config = load(tmp_path / "x", monkeypatch, SLICEBROKER_PORT_OFFSET="100", SLICEBROKER_PORT="9")
    assert service(config, "slicebroker")["url"] == "http://127.0.0.1:9"
