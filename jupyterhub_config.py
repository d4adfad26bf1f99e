"""The embedded default (design.md §9): ``jupyterhub -f jupyterhub_config.py`` on one machine.

It starts, besides the hub and its proxy:

- the broker as a hub-managed service on SQLite (``python -m broker.service``),
  reached by the spawner at ``http://127.0.0.1:$SLICEBROKER_PORT/services/slicebroker``
  and by people at ``<hub>/services/slicebroker/`` (web pages, in the Services menu)
  and ``<hub>/services/slicebroker/api/v1``;
- notebook servers (JupyterLab) as local processes, each on the GPUs of its slice;
  the spawner stops idle sessions by the rule in ``spawner.culler``.

The cluster is this machine's GPUs (found with ``nvidia-smi``, written to
``slicebroker-cluster.toml`` in the working directory) with the demo's project
tree, or, without GPUs, the declared demo inventory (``broker/demo.toml``: one
node of 8 H100s, for trying things out). Users log in with the demo password.

Environment it reads (all optional):

- ``SLICEBROKER_CONFIG``: your cluster file instead of the discovered/demo one;
- ``SLICEBROKER_DB_URL``: the broker's database (default ``slicebroker.sqlite`` in the
  state folder);
- ``SLICEBROKER_PORT``: the broker service's port (default 10101 + the offset);
- ``SLICEBROKER_PORT_OFFSET``: added to every port (hub 8000, 8081, proxy API 8001,
  broker 10101), so that a second hub fits on the machine (default 0);
- ``SLICEBROKER_STATE_DIR``: the folder of every file it writes (default: the current one);
- ``SLICEBROKER_DEMO_PASSWORD``: the demo users' password (default printed at start).

Lines marked "REAL DEPLOYMENT" say what a real deployment changes; see docs/hub-admin.md.
"""

import os
import secrets
import sys

from broker.config import load_config
from broker.errors import InvalidConfig
from spawner.inventory import discover
from spawner.notices import TEMPLATE_PATH, template_vars

c = get_config()  # noqa: F821 - JupyterHub's config loader defines it


def stop(message: str) -> None:
    """Stop the hub with one line: JupyterHub shows any other error in its config file
    as a traceback."""
    raise SystemExit(f"slicebroker: {message}")


def port_from_env(name: str, default: int) -> int:
    """``$name`` as a TCP port, or ``default`` where it is not set."""
    text = os.environ.get(name)
    if text is None:
        return default
    if not (text.strip().isdigit() and int(text) <= 65535):
        stop(f"{name} must be a port number, 0-65535, not {text!r}")
    return int(text)


# ---- ports and files: one offset moves every port, one folder holds every file -----------

port_offset = port_from_env("SLICEBROKER_PORT_OFFSET", 0)
if 10101 + port_offset > 65535:
    stop(f"SLICEBROKER_PORT_OFFSET {port_offset} puts the broker past port 65535")
state_dir = os.path.abspath(os.environ.get("SLICEBROKER_STATE_DIR", "."))
os.makedirs(state_dir, exist_ok=True)
if port_offset:  # else JupyterHub's own defaults, which a bind_url set later may replace
    c.JupyterHub.port = 8000 + port_offset
    c.JupyterHub.hub_port = 8081 + port_offset
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{8001 + port_offset}"
c.JupyterHub.db_url = "sqlite:///" + os.path.join(state_dir, "jupyterhub.sqlite")
c.JupyterHub.cookie_secret_file = os.path.join(state_dir, "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = os.path.join(state_dir, "jupyterhub-proxy.pid")

# ---- the cluster: GPUs and projects ----------------------------------------------------

cluster_file = os.environ.get("SLICEBROKER_CONFIG")
if cluster_file:
    print(f"slicebroker: cluster configuration {cluster_file} (SLICEBROKER_CONFIG)")
else:
    inventory = discover(os.path.join(state_dir, "slicebroker-cluster.toml"))
    cluster_file = str(inventory.config_path)
    c.SliceBrokerSpawner.node_gpus = inventory.node_gpus
    c.SliceBrokerSpawner.local_nodes = [node.name for node in inventory.nodes]
    print(f"slicebroker: {inventory.describe()}")
try:
    cluster = load_config(cluster_file)
except InvalidConfig as err:
    stop(f"{cluster_file}: {err}")
broker_db = os.environ.get("SLICEBROKER_DB_URL") or "sqlite:///" + os.path.join(
    state_dir, "slicebroker.sqlite"
)
# REAL DEPLOYMENT: your own cluster file (SLICEBROKER_CONFIG) and PostgreSQL, e.g.
# SLICEBROKER_DB_URL=postgresql+psycopg://broker:secret@db.example.org/slicebroker

# ---- the broker, as a hub-managed service -------------------------------------------------

broker_port = port_from_env("SLICEBROKER_PORT", 10101 + port_offset)
broker_service_url = f"http://127.0.0.1:{broker_port}"
broker_url = f"{broker_service_url}/services/slicebroker"
# The spawner's identity with the broker: a service token with the agent role, new at
# every hub start (sessions survive it: the broker checks tokens with the hub).
agent_token = secrets.token_hex(32)

c.JupyterHub.services = [
    {
        "name": "slicebroker",
        "url": broker_service_url,
        "command": [sys.executable, "-m", "broker.service"],
        "environment": {"SLICEBROKER_CONFIG": cluster_file, "SLICEBROKER_DB_URL": broker_db},
        # The web pages (My GPUs, Queue, Projects, Cluster, Usage) in the Services menu;
        # login through the hub without a consent page. The login's token carries the
        # broker admin scope (admins only: the hub grants a user only scopes they hold)
        # and the user's groups (project membership through groups).
        "display": True,
        "oauth_no_confirm": True,
        "oauth_client_allowed_scopes": ["custom:slicebroker:admin", "read:users:groups!user"],
    },
    {"name": "slicebroker-spawner", "api_token": agent_token},
]
c.JupyterHub.custom_scopes = {
    "custom:slicebroker:admin": {
        "description": "Administer the GPU broker: projects, nodes, every slice."
    },
    "custom:slicebroker:agent": {
        "description": "Act for any user with the GPU broker (the spawner's scope)."
    },
}
BROKER_ACCESS = "access:services!service=slicebroker"
c.JupyterHub.load_roles = [
    # Everyone may use the broker's API with their own token (slicebroker CLI, batch jobs).
    {"name": "user", "scopes": ["self", BROKER_ACCESS]},
    # A session's own token (its $JUPYTERHUB_API_TOKEN, also its $SLICEBROKER_TOKEN) may
    # use the broker as its owner, groups included: `slicebroker run` from a Lab terminal.
    {
        "name": "server",
        "scopes": [
            "users:activity!user",
            "access:servers!server",
            "read:users:groups!user",
            BROKER_ACCESS,
        ],
    },
    {
        "name": "slicebroker-agent",
        "scopes": ["custom:slicebroker:agent", BROKER_ACCESS],
        "services": ["slicebroker-spawner"],
    },
    {
        "name": "slicebroker-admin",
        "scopes": ["custom:slicebroker:admin", BROKER_ACCESS],
        "users": sorted(cluster.admins | {"admin"}),
    },
]

# ---- the spawner ------------------------------------------------------------------------------

# Every server runs as the hub's user in /tmp/<name>: the demo users have no system accounts.
c.JupyterHub.spawner_class = "spawner.local.SimpleSliceBrokerSpawner"
# REAL DEPLOYMENT on one machine with system accounts: each server as its user.
# c.JupyterHub.spawner_class = "slicebroker"
c.SliceBrokerMixin.broker_url = broker_url
c.SliceBrokerMixin.broker_token = agent_token
c.SliceBrokerMixin.protected_choices = ["15m", "1h", "2h", "4h", "8h", "0"]
c.SliceBrokerMixin.protected_default = "15m"
c.SliceBrokerMixin.max_gpus = max((node.gpu_count for node in cluster.nodes), default=1)
# Idle sessions (see docs/hub-admin.md, "Idle sessions"): past their protection, stopped
# after 1 h idle, or 15 min while a waiting request could use their GPUs; within it, only
# after 1 h idle and only while a waiting request could use their GPUs.
c.SliceBrokerMixin.cull_idle_timeout = "1h"
c.SliceBrokerMixin.cull_idle_busy = "15m"
c.SliceBrokerMixin.cull_idle_protected = "1h"
c.Spawner.start_timeout = 3600  # waiting in the queue is part of start
c.Spawner.default_url = "/lab"
if os.geteuid() == 0:
    # The servers run as the hub's user; Jupyter Server refuses root unless told.
    c.Spawner.args = ["--ServerApp.allow_root=True"]
# Send people to the progress page (queue position) after 2 s rather than 10 s.
c.JupyterHub.tornado_settings = {"slow_spawn_timeout": 2}

# Sessions outlive a hub restart: the new hub reconnects to them and their slices.
c.JupyterHub.cleanup_servers = False

# Pages that tell users why the broker ended their session.
c.JupyterHub.template_paths = [TEMPLATE_PATH]
c.JupyterHub.template_vars = template_vars()

# ---- users ------------------------------------------------------------------------------------

demo_users = sorted(
    set().union(*(members.users for members in cluster.members.values())) | {"admin"}
)
c.JupyterHub.authenticator_class = "dummy"
password = os.environ.get("SLICEBROKER_DEMO_PASSWORD")
if not password:
    password = "slicebroker-demo"
    print(
        f"slicebroker: demo users {', '.join(demo_users)} log in with the password "
        f"{password!r} (set SLICEBROKER_DEMO_PASSWORD to change it)"
    )
c.DummyAuthenticator.password = password
c.Authenticator.allowed_users = set(demo_users)
c.Authenticator.admin_users = {"admin"}
c.JupyterHub.load_groups = {"demo-users": {"users": demo_users}}
# REAL DEPLOYMENT: a real authenticator (OAuthenticator, LDAP, PAM, ...) and groups that
# match the projects' `groups`, e.g.
# c.JupyterHub.authenticator_class = "github"
