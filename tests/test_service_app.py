"""The service's parts on their own: options, tokens, identities, waiters, deadlines, schemas."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from servicefixtures import TEST_CONFIG, make_service, service_env
from traitlets import TraitError

from broker.config import DEMO_CONFIG, load_config
from broker.errors import Forbidden, InvalidRequest
from broker.inventory import InventoryError, LocalInventory, StaticInventory
from broker.kube.inventory import KubernetesInventory
from broker.service.apihandlers.common import acting_identity, charging_principal
from broker.service.app import BrokerApp, main
from broker.service.auth import (
    ADMIN_SCOPE,
    AGENT_SCOPE,
    HubAuthenticator,
    TokenAuthenticator,
    TokenStore,
    Unavailable,
    create_token,
    list_tokens,
    parse_authorization,
    revoke_token,
    revoke_user_tokens,
)
from broker.service.runner import SliceWatchers
from broker.service.schema import COMPONENTS, ref, validate
from broker.slurm.inventory import SlurmInventory
from broker.store import NotYours, Principal
from broker.store.access import _check_owner

# ---- options ---------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    for name in (
        "JUPYTERHUB_API_TOKEN",
        "JUPYTERHUB_SERVICE_URL",
        "JUPYTERHUB_SERVICE_PREFIX",
        "SLICEBROKER_CONFIG",
        "SLICEBROKER_DB_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_standalone_defaults(clean_env):
    app = BrokerApp()
    assert (app.ip, app.port, app.base_url) == ("127.0.0.1", 8765, "/")
    assert app.cluster_file == str(DEMO_CONFIG)
    assert app.db_url == "sqlite:///slicebroker.sqlite"
    assert (app.pass_interval, app.lease, app.max_wait) == (5.0, 120.0, 60.0)
    assert app.authenticate_metrics is True and not app.hub_managed


def test_as_a_hub_service_the_address_and_prefix_come_from_the_hub(clean_env):
    clean_env.setenv("JUPYTERHUB_SERVICE_URL", "http://10.0.0.5:10101")
    clean_env.setenv("JUPYTERHUB_SERVICE_PREFIX", "/services/slicebroker/")
    clean_env.setenv("JUPYTERHUB_API_TOKEN", "secret")
    clean_env.setenv("SLICEBROKER_DB_URL", "postgresql://broker@db/broker")
    app = BrokerApp()
    assert (app.ip, app.port, app.base_url) == ("10.0.0.5", 10101, "/services/slicebroker/")
    assert app.db_url == "postgresql://broker@db/broker"
    assert app.hub_managed


def test_options_from_the_command_line_are_checked(clean_env):
    app = BrokerApp()
    app.parse_command_line(["--port=9000", "--base-url=broker", "--lease=30", "--max-wait=5"])
    assert (app.port, app.base_url, app.lease, app.max_wait) == (9000, "/broker/", 30.0, 5.0)
    with pytest.raises(Exception, match="must be > 0"):
        BrokerApp(pass_interval=0)
    with pytest.raises(Exception, match="port"):
        BrokerApp(port=70000)


@pytest.mark.parametrize(
    ("argv", "environment", "message"),
    [
        (["--lease=0"], {}, "lease must be > 0 seconds, got 0.0"),
        (["--port=70000"], {}, "port must be 0-65535, got 70000"),
        (["--max-wait=-1"], {}, "max_wait must be >= 0 seconds, got -1.0"),
        (["--db-url=mysql://root@db/broker"], {}, "db_url must be a SQLite or PostgreSQL URL"),
        (["--db-url=postgresql://u:hunter2@db:x/b"], {}, "db_url must be a SQLite or PostgreSQL"),
        ([], {"SLICEBROKER_DB_URL": "nonsense"}, "$SLICEBROKER_DB_URL must be a SQLite or"),
    ],
)
def test_a_bad_option_stops_the_service_with_one_line(clean_env, capfd, argv, environment, message):
    for name, value in environment.items():
        clean_env.setenv(name, value)
    if not any(option.startswith("--port") for option in argv):
        argv = [*argv, "--port=0"]
    assert main(argv) == 2
    said = capfd.readouterr().err
    assert message in said and "Traceback" not in said and "hunter2" not in said
    assert len(said.strip().splitlines()) == 1, said


async def test_the_options_reach_the_store_and_its_runner(clean_env, tmp_path):
    app = BrokerApp()
    app.parse_command_line(
        [
            f"--BrokerApp.db_url=sqlite:///{tmp_path}/broker.sqlite",
            "--lease=30",
            "--BrokerApp.late_heartbeat=7",
            "--BrokerApp.db_timeout=9",
            "--BrokerApp.pass_interval=2",
            "--BrokerApp.shed_after=3",
            "--BrokerApp.what_if_share=0.25",
        ]
    )
    broker = app.make_broker(load_config(app.cluster_file))
    runner = app.make_runner(broker)
    try:
        assert (broker.lease, broker.late_answers.late_after) == (30.0, 7.0)
        assert (runner.pass_interval, runner.db_timeout) == (2.0, 9.0)
        assert (runner.shed_after, runner.what_if_share) == (3.0, 0.25)
    finally:
        await runner.stop()


def test_the_inventory_is_chosen_by_entry_point_name_or_by_class(clean_env):
    assert BrokerApp().inventory_class is StaticInventory
    for named in ("kubernetes", "Kubernetes", "broker.kube.inventory.KubernetesInventory"):
        app = BrokerApp()
        app.parse_command_line([f"--BrokerApp.inventory_class={named}"])
        assert app.inventory_class is KubernetesInventory
    assert BrokerApp(inventory_class="nvidia-smi").inventory_class is LocalInventory
    app = BrokerApp(inventory_class=KubernetesInventory)
    app.parse_command_line(["--KubernetesInventory.pod_namespace=jhub-2"])
    inventory = app.make_inventory()
    assert isinstance(inventory, KubernetesInventory) and inventory.pod_namespace == "jhub-2"
    assert BrokerApp(inventory_class="slurm").inventory_class is SlurmInventory
    for not_one in ("lsf", "broker.store.Broker"):
        with pytest.raises(Exception, match="inventory_class"):
            BrokerApp(inventory_class=not_one)


def test_the_old_kubernetes_options_still_work_with_a_warning(clean_env, caplog):
    app = BrokerApp()
    app.parse_command_line(
        ["--BrokerApp.kubernetes_pod_namespace=jhub", "--BrokerApp.kubernetes_reap_min_age=0"]
    )
    inventory = app.make_inventory()
    # Pods cleaned up, nodes still from the file: what these options did alone.
    assert isinstance(inventory, KubernetesInventory) and not inventory.watch_nodes
    assert (inventory.pod_namespace, inventory.reap_min_age) == ("jhub", 0.0)
    warned = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert warned == [
        "BrokerApp.kubernetes_pod_namespace is deprecated: use KubernetesInventory.pod_namespace",
        "BrokerApp.kubernetes_reap_min_age is deprecated: use KubernetesInventory.reap_min_age",
    ]
    app = BrokerApp()
    app.parse_command_line(
        [
            "--BrokerApp.kubernetes_inventory=True",
            "--BrokerApp.kubernetes_api_url=http://old:8001",
            "--KubernetesInventory.api_url=http://new:8001",
        ]
    )
    inventory = app.make_inventory()
    assert inventory.watch_nodes and inventory.api_url == "http://new:8001"  # the new name wins
    with pytest.raises(TraitError, match="namespace name"):
        BrokerApp(kubernetes_pod_namespace="JHub").make_inventory()
    mixed = BrokerApp(inventory_class="nvidia-smi", kubernetes_pod_namespace="jhub")
    with pytest.raises(InventoryError, match="need the Kubernetes inventory, not LocalInventory"):
        mixed.make_inventory()


def test_the_old_config_file_option_names_the_cluster_file_with_a_warning(clean_env, caplog):
    app = BrokerApp()
    app.parse_command_line(["--config-file=old.toml"])
    assert app.cluster_file == "old.toml"
    assert "BrokerApp.config_file is deprecated: use BrokerApp.cluster_file" in caplog.text
    app = BrokerApp()
    app.parse_command_line(["--config-file=old.toml", "--cluster-file=new.toml"])
    assert app.cluster_file == "new.toml"


def test_an_options_file_is_applied_and_the_command_line_wins(clean_env, tmp_path):
    options = tmp_path / "broker_options.py"
    options.write_text(
        "c.BrokerApp.port = 9100\n"
        "c.BrokerApp.lease = 30.0\n"
        "c.BrokerApp.inventory_class = 'kubernetes'\n"
        "c.KubernetesInventory.pod_namespace = 'jhub'\n"
    )
    app = BrokerApp()
    app.initialize(["-f", str(options), "--lease=45"])
    assert (app.port, app.lease, app.inventory_class) == (9100, 45.0, KubernetesInventory)
    assert app.make_inventory().pod_namespace == "jhub"


def test_the_options_file_in_the_working_directory_is_read_by_default(clean_env, tmp_path):
    clean_env.chdir(tmp_path)
    app = BrokerApp()
    app.initialize([])  # none there: nothing read, nothing said
    assert app.port == 8765
    (tmp_path / "slicebroker_config.py").write_text("c.BrokerApp.port = 9200\n")
    app = BrokerApp()
    app.initialize([])
    assert app.port == 9200


def test_a_missing_or_broken_options_file_stops_the_service_with_one_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("c.BrokerApp.port = \n")
    for path, message in [
        (tmp_path / "missing.py", "missing.py: no such file"),
        (broken, "broken.py: SyntaxError"),
    ]:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "broker.service",
                "-f",
                str(path),
                f"--db-url=sqlite:///{tmp_path / 'broker.sqlite'}",
                "--port=0",
            ],
            capture_output=True,
            text=True,
            env=service_env(),
            timeout=60,
        )
        assert run.returncode == 2, run.stderr
        assert message in run.stderr and "Traceback" not in run.stderr


def test_generate_config_writes_every_option_and_the_file_loads_back(clean_env, tmp_path):
    out = tmp_path / "slicebroker_config.py"
    done = subprocess.run(
        [sys.executable, "-m", "broker.cli", "generate-config", "-o", str(out)],
        capture_output=True,
        text=True,
        env=service_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    for cls in (BrokerApp, KubernetesInventory, LocalInventory):
        for name in cls.class_own_traits(config=True):
            assert f"# c.{cls.__name__}.{name} = " in text
    assert "Seconds between two rounds of deleting pods of ended slices" in text
    # Every line commented out: loaded as it is, it changes nothing.
    app = BrokerApp()
    app.initialize(["-f", str(out)])
    assert app.port == 8765 and app.inventory_class is StaticInventory
    # An admin's edit of it is applied.
    edited = text.replace("# c.BrokerApp.port = ", "c.BrokerApp.port = 9300  # ")
    kind = "c.BrokerApp.inventory_class = 'nvidia-smi'  # "
    out.write_text(edited.replace("# c.BrokerApp.inventory_class = ", kind))
    app = BrokerApp()
    app.initialize(["-f", str(out)])
    assert (app.port, app.inventory_class) == (9300, LocalInventory)
    again = subprocess.run(
        [sys.executable, "-m", "broker.cli", "generate-config", "-o", str(out)],
        capture_output=True,
        text=True,
        env=service_env(),
        timeout=60,
    )
    assert again.returncode == 2 and "exists: give --force" in again.stderr
    assert "c.BrokerApp.port = 9300" in out.read_text()  # left as it was


def test_help_exits_zero_and_names_every_option(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for option in ("-f", "--cluster-file", "--db-url", "--ip", "--port", "--base-url", "--lease"):
        assert option in text


def test_a_bad_configuration_stops_the_service_with_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[projects.x]\nshare = 0\n")
    run = subprocess.run(
        [sys.executable, "-m", "broker.service", f"--cluster-file={bad}", "--port=0"],
        capture_output=True,
        text=True,
        env=service_env(),
        timeout=60,
    )
    assert run.returncode == 2
    assert "projects.x.share" in run.stderr and "Traceback" not in run.stderr


def test_sigterm_stops_the_service_and_a_restart_carries_on(tmp_path):
    service = make_service(tmp_path)
    try:
        _stop_and_restart(service)
    finally:
        service.stop()


def _stop_and_restart(service) -> None:
    service.start()
    alice = service.token("alice")
    made = service.post(
        "/slices", token=alice, json={"project": "vision", "gpus": 2, "kind": "batch"}
    ).json()
    held = service.get(f"/slices/{made['id']}", token=alice, params={"wait": 5, "state": "pending"})
    assert held.json()["state"] == "granted"
    service.dump_stacks()  # SIGUSR1: where each thread is, and the service serves on
    log = service.log_text()
    assert re.search(r"app.py\", line \d+ in start\n", log), log[-2000:]  # the threads'
    assert re.search(r"app.py:\d+ in serve\n", log), log[-2000:]  # the tasks'
    assert service.get(f"/slices/{made['id']}", token=alice).status_code == 200
    assert service.stop() == 0
    service.start()
    again = service.get(f"/slices/{made['id']}", token=alice).json()
    assert again["state"] == "granted" and again["placements"] == held.json()["placements"]
    assert again["lease_expires_at"] >= held.json()["lease_expires_at"]  # a fresh lease
    with ThreadPoolExecutor(1) as pool:
        params = {"wait": 30, "state": "granted"}
        poll = pool.submit(service.get, f"/slices/{made['id']}", token=alice, params=params)
        deadline = time.monotonic() + 10
        while "slicebroker_long_polls 1.0" not in service.get("/metrics", token=alice).text:
            assert not poll.done()  # the poll has not reached the service yet
            assert time.monotonic() < deadline, "the long poll never reached the service"
            time.sleep(0.01)
        started = time.monotonic()
        assert service.stop() == 0
        assert poll.result().status_code == 200  # answered, not cut off
        assert time.monotonic() - started < 5


def test_the_service_refuses_a_busy_port(tmp_path):
    first = make_service(tmp_path / "one")
    first.start()
    try:
        second = make_service(tmp_path / "two", port=first.port)
        process = subprocess.run(
            [sys.executable, "-m", "broker.service", *second.args],
            capture_output=True,
            text=True,
            env=second.env,
            timeout=60,
        )
        assert process.returncode == 1 and "cannot listen" in process.stderr
    finally:
        first.stop()


# ---- tokens ------------------------------------------------------------------------------


def test_tokens_are_stored_hashed_and_verified(tmp_path):
    url = f"sqlite:///{tmp_path / 'tokens.sqlite'}"
    token = create_token(url, "alice")
    agent = create_token(url, "spawner", agent=True)
    admin = create_token(url, "root", admin=True)
    store = TokenStore(url)
    try:
        assert (store.verify(token).user, store.verify(token).agent) == ("alice", False)
        assert store.verify(agent).agent and store.verify(admin).admin
        secret = token.split("_", 2)[2]
        for forged in (
            "",
            "sb",
            "sb_1",
            "sb_1_x",
            "xx_1_" + secret,
            token + "x",
            "sb_²_x",
            f"sb_{2**40}_{secret}",
            f"sb_0_{secret}",
        ):
            assert store.verify(forged) is None, forged
    finally:
        store.close()
    listed = list_tokens(url)
    assert [(t.user, t.admin, t.agent) for t in listed] == [
        ("alice", False, False),
        ("spawner", False, True),
        ("root", True, False),
    ]
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.connect() as connection:
        stored = " ".join(r[0] for r in connection.execute(text("SELECT hashed FROM api_tokens")))
    engine.dispose()
    assert token.split("_", 2)[2] not in stored and stored.startswith("sha256$")
    assert revoke_token(url, token) is True and revoke_token(url, token) is False
    assert revoke_user_tokens(url, "spawner") == 1
    assert [t.user for t in list_tokens(url)] == ["root"]


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("token abc", "abc"),
        ("Token abc", "abc"),
        ("Bearer abc", "abc"),
        ("bearer   abc  ", "abc"),
        ("Basic abc", None),
        ("token", None),
        ("", None),
        (None, None),
    ],
)
def test_the_authorization_header(header, token):
    assert parse_authorization(header) == token


# ---- identities ---------------------------------------------------------------------------

ALICE = Principal("alice", frozenset({"cv"}))
AGENT = Principal("spawner", agent=True, kind="service")
ADMIN = Principal("root", admin=True)


@pytest.mark.parametrize(
    ("caller", "user", "groups", "acts_as"),
    [
        pytest.param(ALICE, None, None, ALICE, id="a user acts as themselves"),
        pytest.param(ALICE, "alice", ["cv"], ALICE, id="a user may name themselves"),
        pytest.param(
            ALICE, None, [], Principal("alice", frozenset()), id="a user may drop their groups"
        ),
        pytest.param(AGENT, "erin", ["nlp"], Principal("erin", frozenset({"nlp"})),
                     id="an agent acts for a user, with only the named groups"),
        pytest.param(AGENT, "erin", None, Principal("erin"), id="an agent naming no groups"),
        pytest.param(ADMIN, "erin", None, Principal("erin"), id="an admin acts for a user"),
        pytest.param(AGENT, None, None, AGENT, id="an agent acts as itself"),
    ],
)  # fmt: skip
def test_who_a_request_acts_for(caller, user, groups, acts_as):
    assert acting_identity(caller, user, groups) == acts_as


@pytest.mark.parametrize(
    ("user", "groups"),
    [
        pytest.param("bob", None, id="another user"),
        pytest.param(None, ["nlp"], id="a group of others"),
        pytest.param("alice", ["cv", "nlp"], id="an extra group"),
    ],
)
def test_a_user_may_not_act_for_others(user, groups):
    with pytest.raises(Forbidden):
        acting_identity(ALICE, user, groups)


def test_agents_and_admins_reach_every_slice_and_users_their_own():
    _check_owner(1, "alice", ALICE)
    with pytest.raises(NotYours):
        _check_owner(1, "erin", ALICE)
    for who in (AGENT, ADMIN):
        _check_owner(1, "erin", who)


def test_an_admin_acting_for_a_user_may_charge_any_project_and_an_agent_what_the_user_may():
    erin = Principal("erin", frozenset({"nlp"}))
    assert charging_principal(ADMIN, "erin", ["nlp"]) == replace(erin, admin=True)
    assert charging_principal(AGENT, "erin", ["nlp"]) == erin
    assert charging_principal(ALICE) == ALICE


class FakeHubAuth:
    """Answers as JupyterHub's HubAuth would, from a table of tokens."""

    access_scopes = frozenset({"access:services!service=slicebroker"})
    api_url = "http://hub/hub/api"

    def __init__(self, models):
        self.models = models

    async def user_for_token(self, token, *, sync=True):
        from tornado.web import HTTPError

        if token == "hub-down":
            raise HTTPError(500, "Failed to connect to Hub API")
        return self.models.get(token)


ACCESS = "access:services!service=slicebroker"


async def test_hub_tokens_become_identities_by_scope():
    auth = HubAuthenticator(
        FakeHubAuth(
            {
                "erin": {"kind": "user", "name": "erin", "groups": ["nlp"], "scopes": [ACCESS]},
                "ada": {"name": "ada", "groups": [], "scopes": [ACCESS, ADMIN_SCOPE]},
                "bot": {
                    "kind": "service",
                    "name": "bot",
                    "scopes": ["access:services", AGENT_SCOPE],
                },
                "other": {"kind": "user", "name": "o", "groups": [], "scopes": ["read:users"]},
            }
        )
    )
    assert await auth.authenticate("erin") == Principal("erin", frozenset({"nlp"}))
    assert await auth.authenticate("ada") == Principal("ada", admin=True)
    assert await auth.authenticate("bot") == Principal("bot", agent=True, kind="service")
    assert await auth.authenticate("nobody") is None
    with pytest.raises(Forbidden, match="access:services"):
        await auth.authenticate("other")
    with pytest.raises(Unavailable):
        await auth.authenticate("hub-down")


async def test_requests_with_one_token_wait_for_one_look_up(tmp_path):
    """A client's requests miss the cache together once its answer is too old:
    they share one look-up on the database thread instead of queueing one each."""
    store = TokenStore(f"sqlite:///{tmp_path / 'tokens.sqlite'}")
    token = store.create("erin")
    looked_up: list[str] = []
    go = asyncio.Event()

    async def run(verify):
        looked_up.append("look-up")
        await go.wait()  # the database thread is busy meanwhile
        return verify()

    auth = TokenAuthenticator(store, run, cache_max_age=0.0)
    try:
        asking = [asyncio.ensure_future(auth.authenticate(token)) for _ in range(10)]
        asking += [asyncio.ensure_future(auth.authenticate("sb_1_forged")) for _ in range(3)]
        await asyncio.sleep(0)
        go.set()
        answers = await asyncio.gather(*asking)
        assert answers == [Principal("erin")] * 10 + [None] * 3
        assert looked_up == ["look-up", "look-up"]  # one per token
        # once answered, a later request looks up again (nothing cached: max age 0)
        assert await auth.authenticate(token) == Principal("erin")
        assert len(looked_up) == 3
    finally:
        auth.close()


# ---- the scheduling loop's helpers -----------------------------------------------------------


async def test_waiters_wake_on_news_only():
    watchers = SliceWatchers()
    baseline = ("pending", 3)
    moved = watchers.watch(1, lambda key: key != baseline)
    other = watchers.watch(2, lambda key: key[0] != "pending")
    watchers.publish({1: baseline, 2: ("pending", 1)}, complete=False)
    assert not moved.done() and not other.done()
    watchers.publish({1: ("pending", 2)}, complete=False)
    assert moved.result() == ("pending", 2) and not other.done()
    watchers.publish({}, complete=True)  # slice 2 left the live set: it ended
    assert other.result() is None
    watchers.unwatch(1, moved)
    watchers.unwatch(2, other)
    assert len(watchers) == 0 and watchers.generation == 3


# ---- schemas --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"project": "p", "gpus": 1, "kind": "batch"}, None),
        ({"project": "p", "gpus": 1, "kind": "batch", "min_runtime": "1h30m"}, None),
        ({"project": "p", "gpus": 1, "kind": "batch", "min_runtime": None}, None),
        ({"project": "p", "gpus": 1, "kind": "batch", "min_runtime": "1 day"}, "min_runtime"),
        ({"project": "p", "gpus": 1}, "needs 'kind'"),
        ({"project": "", "gpus": 1, "kind": "batch"}, "body.project must not be empty"),
        ({"project": "p", "gpus": 1, "kind": "batch", "groups": ["a", 1]}, "body.groups[1]"),
        ({"project": "p", "gpus": 1, "kind": "batch", "x": 1}, "unknown key 'x'"),
        ({"project": "p", "gpus": 1e400, "kind": "batch"}, "whole number"),
    ],
)
def test_the_request_schema(value, problem):
    if problem is None:
        validate(value, ref("SliceRequest"))
    else:
        with pytest.raises(InvalidRequest, match=problem.replace("[", r"\[")):
            validate(value, ref("SliceRequest"))


def test_every_component_is_a_closed_object_listing_its_required_keys():
    for name, schema in COMPONENTS.items():
        assert schema["type"] == "object" and schema["additionalProperties"] is False, name
        assert set(schema.get("required", ())) <= set(schema["properties"]), name


def test_the_test_configuration_parses():
    import tomllib

    from broker.config import parse_config

    assert parse_config(tomllib.loads(TEST_CONFIG)).admins == {"root"}


def test_an_unreachable_database_stops_the_service_with_one_line(tmp_path):
    url = "postgresql://broker:hunter2@127.0.0.1:1/broker"
    run = subprocess.run(
        [sys.executable, "-m", "broker.service", f"--db-url={url}", "--port=0"],
        capture_output=True,
        text=True,
        env=service_env(),
        timeout=60,
    )
    assert run.returncode == 1
    assert "cannot open the database" in run.stderr and "Traceback" not in run.stderr
    assert "hunter2" not in run.stderr
