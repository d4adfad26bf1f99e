"""``slicebroker serve``: the broker as an HTTP service (standalone or a JupyterHub service).

:class:`BrokerApp` wires options to the pieces: the cluster configuration and
the database make a :class:`~broker.store.Broker`; a
:class:`~broker.service.runner.BrokerRunner` runs it off the event loop and
keeps the schedule going; an authenticator (the broker's own tokens, or
JupyterHub's when ``JUPYTERHUB_API_TOKEN`` is set) identifies callers; the
tornado application serves the handlers of :mod:`broker.service.apihandlers`
under ``{base_url}api/v1``.

Run by JupyterHub as a hub-managed service (``c.JupyterHub.services`` entry with
a ``command``), it takes its address from ``JUPYTERHUB_SERVICE_URL`` and its
prefix from ``JUPYTERHUB_SERVICE_PREFIX``.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import logging
import os
import signal
import sys
from collections.abc import Iterable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from jupyterhub.traitlets import EntryPointType
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from tornado import web
from traitlets import Bool, Float, Integer, TraitError, Unicode, default, observe, validate
from traitlets.config import Application

from .. import __version__
from ..config import DEMO_CONFIG, ClusterConfig, load_config
from ..core.model import PASS_INTERVAL
from ..errors import InvalidConfig
from ..inventory import (
    ENTRY_POINT_GROUP,
    Inventory,
    InventoryError,
    LocalInventory,
    StaticInventory,
)
from ..kube.inventory import KubernetesInventory
from ..orm import DatabaseSchemaError, normalize_url
from ..slurm.inventory import SlurmInventory
from ..store import Broker
from ..store.lapses import LATE_HEARTBEAT_S
from ..traits import seconds_above_zero, seconds_not_negative
from .apihandlers import default_handlers
from .apihandlers.base import InFlight, Limits, NotFoundHandler, log_request
from .auth import Authenticator, HubAuthenticator, TokenAuthenticator, TokenStore
from .httpserver import JSONErrorServer
from .leader import AppSwitch, Leadership, leader_lock, standby_app
from .openapi import path_regex
from .pages import page_routes, page_settings
from .runner import BrokerRunner

LOG_FORMAT = "[%(levelname)1.1s %(asctime)s.%(msecs).03d %(name)s] %(message)s"
#: The loggers the service's console handler serves: the broker's modules, request
#: logs (tornado.access), the hub's client library, database migrations.
LOGGERS = ("slicebroker", "broker", "tornado", "jupyterhub", "alembic")
#: The request size limits the service applies.
DEFAULT_LIMITS = Limits()
#: How long requests in flight may take to finish when the service stops.
STOP_TIMEOUT_S = 5.0
#: Options that moved to :class:`~broker.kube.inventory.KubernetesInventory`:
#: the old ``BrokerApp`` name -> the new one. The old names still work for one
#: release, with a warning.
MOVED_TO_KUBERNETES = {
    "kubernetes_inventory": "watch_nodes",
    "kubernetes_api_url": "api_url",
    "kubernetes_node_selector": "node_selector",
    "kubernetes_drained_label": "drained_label",
    "kubernetes_report_interval": "report_interval",
    "kubernetes_pod_namespace": "pod_namespace",
    "kubernetes_reap_interval": "reap_interval",
    "kubernetes_reap_min_age": "reap_min_age",
}


def make_app(
    runner: BrokerRunner,
    authenticator: Authenticator,
    *,
    base_url: str = "/",
    max_wait: float = 60.0,
    authenticate_metrics: bool = True,
    handlers: Iterable[tuple[str, type]] = default_handlers,
    limits: Limits = DEFAULT_LIMITS,
    hub_oauth: Any = None,
) -> web.Application:
    """The tornado application serving ``handlers`` under ``{base_url}api/v1``, and the
    web pages under ``base_url`` (logging in through the hub with ``hub_oauth``)."""
    handlers = list(handlers)
    prefix = base_url.rstrip("/") + "/api/v1"
    routes: list[tuple[str, Any]] = page_routes(base_url)
    for path, handler in handlers:
        pattern = path_regex(prefix) + ("/?" if path == "/" else path_regex(path))
        routes.append((pattern, handler))
    return web.Application(
        routes,
        default_handler_class=NotFoundHandler,
        log_function=log_request,
        runner=runner,
        authenticator=authenticator,
        max_wait=max_wait,
        authenticate_metrics=authenticate_metrics,
        in_flight=InFlight(),
        api_prefix=prefix,
        api_handlers=handlers,
        limits=limits,
        **page_settings(base_url, hub_oauth),
    )


def make_server(
    app: web.Application | AppSwitch, *, idle_timeout: float = 60.0, body_timeout: float = 60.0
) -> JSONErrorServer:
    """The HTTP server of ``app`` (its own refusals as JSON too), with the limits that
    keep slow or large requests from holding sockets and memory.

    ``idle_timeout``: seconds a connection may take to send a request's headers,
    counted from the end of the previous answer (an idle keep-alive connection is
    closed after it). ``body_timeout``: seconds a request's body may take to
    arrive. The server reads bodies of any announced size, since
    :class:`~broker.service.apihandlers.base.APIHandler` streams them and
    answers 413 itself; headers it reads up to ``max_header_read_bytes``.
    """
    limits: Limits = app.settings["limits"]
    return JSONErrorServer(
        app,
        idle_connection_timeout=idle_timeout,
        body_timeout=body_timeout,
        max_header_size=limits.max_header_read_bytes,
        # The handlers keep at most max_body_bytes and refuse past max_drain_bytes.
        max_body_size=2**62,
    )


def _service_url() -> tuple[str | None, int | None]:
    url = os.environ.get("JUPYTERHUB_SERVICE_URL")
    if not url:
        return None, None
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return parsed.hostname, port


def database_url(url: str, name: str) -> str:
    """``url`` if it is a SQLite or PostgreSQL URL, else a :class:`TraitError` naming
    the option it came from: checked as it is set, in one line, never a traceback
    from the first connection. The URL itself is not repeated: it may hold a password."""
    try:
        backend = make_url(url).get_backend_name()
    except (ArgumentError, ValueError):  # not a URL, or a port that is no number
        backend = None
    if backend not in ("sqlite", "postgresql", "postgres"):
        raise TraitError(
            f"{name} must be a SQLite or PostgreSQL URL (sqlite:///path/file.sqlite, "
            "postgresql://user:password@host/db)"
        )
    return url


class BrokerApp(Application):
    """Serve the broker's HTTP API and run its scheduling loop."""

    name = "slicebroker-serve"
    version = __version__
    description = (
        "Serve the GPU broker's HTTP API (JSON under {base_url}api/v1) and run its "
        "scheduling loop. Standalone it uses its own tokens (slicebroker token create); "
        "launched by JupyterHub as a service it uses JupyterHub's tokens and scopes."
    )
    classes = [StaticInventory, LocalInventory, KubernetesInventory, SlurmInventory]
    # A broken options file stops the service instead of being skipped.
    raise_config_file_errors = Bool(True)
    aliases = {
        "f": "BrokerApp.options_file",
        "cluster-file": "BrokerApp.cluster_file",
        "config-file": "BrokerApp.config_file",
        "db-url": "BrokerApp.db_url",
        "ip": "BrokerApp.ip",
        "port": "BrokerApp.port",
        "base-url": "BrokerApp.base_url",
        "pass-interval": "BrokerApp.pass_interval",
        "lease": "BrokerApp.lease",
        "max-wait": "BrokerApp.max_wait",
        "idle-timeout": "BrokerApp.idle_timeout",
        "body-timeout": "BrokerApp.body_timeout",
        "log-level": "Application.log_level",
    }
    flags = {
        "upgrade-db": (
            {"BrokerApp": {"upgrade_db": True}},
            "Migrate an out-of-date database on start (back it up first).",
        ),
        "no-authenticate-metrics": (
            {"BrokerApp": {"authenticate_metrics": False}},
            "Serve /metrics without a token.",
        ),
    }

    @default("log_level")
    def _default_log_level(self) -> int:
        return logging.INFO

    @default("log_format")
    def _default_log_format(self) -> str:
        return LOG_FORMAT

    @default("log")
    def _default_log(self) -> logging.Logger:
        return logging.getLogger("slicebroker.service")

    def get_default_logging_config(self) -> dict[str, Any]:
        """Application's console handler (``log_format``, ``log_level``), also for the
        loggers of the broker's modules, tornado (requests), the hub's client
        library and database migrations."""
        config = super().get_default_logging_config()
        level = logging.getLevelName(self.log_level)
        config["loggers"] = {name: {"level": level, "handlers": ["console"]} for name in LOGGERS}
        return config

    options_file = Unicode(
        "slicebroker_config.py",
        help="""A Python file of these options, as JupyterHub's jupyterhub_config.py:
        `c.BrokerApp.port = 9000`, `c.KubernetesInventory.pod_namespace = "jhub"`.
        `slicebroker generate-config` writes one with every option and its help.
        Options on the command line win over the file's.

        Default: slicebroker_config.py in the working directory, when there is one.
        """,
    ).tag(config=True)

    cluster_file = Unicode(
        help="""The cluster file (TOML): GPU types, nodes, project tree, policy.

        Default: $SLICEBROKER_CONFIG if set, else the demo cluster shipped with the
        package (one node of 8 H100s). See docs/configuration.md.
        """,
    ).tag(config=True)

    @default("cluster_file")
    def _default_cluster_file(self) -> str:
        return os.environ.get("SLICEBROKER_CONFIG") or str(DEMO_CONFIG)

    config_file = Unicode("", help="Deprecated: use cluster_file (--cluster-file).").tag(
        config=True
    )

    @observe("config_file")
    def _config_file_moved(self, change) -> None:
        if not change.new:
            return
        self.log.warning("BrokerApp.config_file is deprecated: use BrokerApp.cluster_file")
        if self.cluster_file == self._default_cluster_file():  # the new name wins
            self.cluster_file = change.new

    db_url = Unicode(
        help="""The database URL (SQLAlchemy): sqlite:///path/file.sqlite or
        postgresql://user:password@host/db.

        Default: $SLICEBROKER_DB_URL if set, else sqlite:///slicebroker.sqlite (a file
        in the working directory). A blank database is initialised on start.
        """,
    ).tag(config=True)

    @default("db_url")
    def _default_db_url(self) -> str:
        from_environment = os.environ.get("SLICEBROKER_DB_URL")
        if from_environment:
            return database_url(from_environment, "$SLICEBROKER_DB_URL")
        return "sqlite:///slicebroker.sqlite"

    @validate("db_url")
    def _check_db_url(self, proposal):
        return database_url(proposal.value, "db_url")

    ip = Unicode(
        help="""The address to listen on.

        Default: the host of $JUPYTERHUB_SERVICE_URL when JupyterHub runs the broker as
        a service, else 127.0.0.1 (this machine only).
        """,
    ).tag(config=True)

    @default("ip")
    def _default_ip(self) -> str:
        return _service_url()[0] or "127.0.0.1"

    port = Integer(
        help="""The TCP port to listen on.

        Default: the port of $JUPYTERHUB_SERVICE_URL when JupyterHub runs the broker as
        a service, else 8765.
        """,
    ).tag(config=True)

    @default("port")
    def _default_port(self) -> int:
        return _service_url()[1] or 8765

    @validate("port")
    def _check_port(self, proposal):
        if not 0 <= proposal.value <= 65535:
            raise TraitError(f"port must be 0-65535, got {proposal.value}")
        return proposal.value

    base_url = Unicode(
        help="""The URL prefix the API is served under ({base_url}api/v1).

        Default: $JUPYTERHUB_SERVICE_PREFIX (e.g. /services/slicebroker/) when JupyterHub
        runs the broker as a service, else /.
        """,
    ).tag(config=True)

    @default("base_url")
    def _default_base_url(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVICE_PREFIX") or "/"

    @validate("base_url")
    def _check_base_url(self, proposal):
        return "/" + proposal.value.strip("/") + "/" if proposal.value.strip("/") else "/"

    pass_interval = Float(
        PASS_INTERVAL,
        help="""Longest time between scheduling passes, in seconds (default 5; the
        simulator's default tick too, so that what admins simulate is what runs).

        Passes also run after every change (submit, release, node or project change)
        and at the next contract deadline (end of protection, grace period, max
        runtime, lease expiry), so this only bounds how stale fair-share values get.
        """,
    ).tag(config=True)

    what_if_share = Float(
        0.1,
        help="""Share of the database thread's time that what-if reads (a waiting
        request's alternatives, the form's expected starts) may take, 0-1 (default
        0.1), earned back at that rate and at most one pass interval's worth at once.
        Each is a few passes, shared until a pass decides something or a change (a
        minute at most); past the share, one asked before is answered again as last
        computed (from half-way, so that what is left goes to first answers), and one
        never asked with its checks only (nothing computed), both marked
        ``Slicebroker-Stale: true``, until the time is earned back. Higher:
        fresher alternatives for more waiting users, and less of the thread for
        submissions and passes.""",
    ).tag(config=True)

    @validate("what_if_share")
    def _check_what_if_share(self, proposal):
        if not 0 < proposal.value <= 1:
            raise TraitError(f"what_if_share must be in (0, 1], got {proposal.value!r}")
        return proposal.value

    lease = Float(
        120.0,
        help="""How long a heartbeat keeps a slice alive, in seconds (default 120).

        A granted slice (or a waiting one that was heartbeated) whose holder does not
        heartbeat within this time ends with reason `lost`. After a restart or a
        database outage (no pass for 3 pass intervals), every live lease is first
        extended by the time the broker was away, so its own trouble costs nobody a
        slice; a broker in a crash loop still lets a dead holder's lease run out.
        """,
    ).tag(config=True)

    max_wait = Float(
        60.0,
        help="""Cap on a long poll (GET /slices/{id}?wait=...), in seconds (default 60).

        Keep it below the timeouts of proxies between clients and the broker.
        """,
    ).tag(config=True)

    authenticate_metrics = Bool(
        True,
        help="""Whether GET /api/v1/metrics needs a token (default: yes).

        Turn off to let Prometheus scrape without one.
        """,
    ).tag(config=True)

    idle_timeout = Float(
        60.0,
        help="""Seconds a client connection may take to send a request's headers, and may
        stay idle between requests, before it is closed (default 60). Bounds how long
        a slow or half-sent request holds a socket.
        """,
    ).tag(config=True)

    body_timeout = Float(
        60.0,
        help="""Seconds a request's body may take to arrive before the connection is
        closed (default 60).
        """,
    ).tag(config=True)

    token_cache_max_age = Float(
        5.0,
        help="""How long an identified token is remembered, in seconds (default 5).

        Revoked tokens (and JupyterHub role changes) take effect within this time.
        """,
    ).tag(config=True)

    shed_after = Float(
        2.0,
        help="""How long, in seconds, the oldest database work may have waited before the
        broker refuses new requests at once (default 2; 0: never): 503 `overloaded` with
        `Retry-After`, instead of answering after the queue (or `database_unavailable`
        at `db_timeout`). Heartbeats and releases are never refused so: a lost
        heartbeat ends a slice, and a release frees what the queue waits for. Lower
        sheds sooner and keeps the answers it gives faster; higher refuses less in a
        burst.
        """,
    ).tag(config=True)

    late_heartbeat = Float(
        LATE_HEARTBEAT_S,
        help="""How long after it came, in seconds, a heartbeat may be answered before
        the broker counts itself as behind (default 1; 0: never; a healthy broker
        answers in milliseconds). A lease does not run out over the time the broker answers
        heartbeats late: an overloaded broker would otherwise end live sessions whose
        heartbeats it could not read in time. Lower counts milder overloads too, and
        keeps a dead holder's GPUs that much longer; higher ends more sessions in an
        overload.
        """,
    ).tag(config=True)

    db_timeout = Float(
        10.0,
        help="""How long one database statement may wait, in seconds (default 10): SQLite's
        busy timeout; PostgreSQL's connect timeout and statement timeout (lock waits
        included). A request whose database work does not finish within this (plus
        1 s) is answered 503 `database_unavailable`, even when the database hangs.
        """,
    ).tag(config=True)

    standby_poll_interval = Float(
        0.5,
        help="""How often a standby tries the leader lock, in seconds (default 0.5).

        One broker per database leads (docs/persistence.md); another started on the
        same database waits as a standby and takes over within about this long after
        the leader's lock is released (at its death, on PostgreSQL when its
        connection ends). A leader checks its lock as often.
        """,
    ).tag(config=True)

    upgrade_db = Bool(
        False,
        help="""Migrate an out-of-date database on start instead of refusing to run
        (default: no; `slicebroker upgrade-db` does it by hand).
        """,
    ).tag(config=True)

    inventory_class = EntryPointType(
        default_value=StaticInventory,
        klass=Inventory,
        entry_point_group=ENTRY_POINT_GROUP,
        help="""Where the nodes come from: `static` (the cluster file's nodes, the
        default), `nvidia-smi` (this machine's GPUs), `kubernetes` (the cluster's GPU
        nodes, watched), or any Inventory class (`module.Class`). Each has its own
        options, e.g. `c.KubernetesInventory.pod_namespace`; see docs/configuration.md.
        """,
    ).tag(config=True)

    # The options below moved to KubernetesInventory; kept for one release.
    kubernetes_inventory = Bool(False, help="Deprecated: use inventory_class = 'kubernetes'.").tag(
        config=True
    )
    kubernetes_api_url = Unicode("", help="Deprecated: use KubernetesInventory.api_url.").tag(
        config=True
    )
    kubernetes_node_selector = Unicode(
        "", help="Deprecated: use KubernetesInventory.node_selector."
    ).tag(config=True)
    kubernetes_drained_label = Unicode(
        "slicebroker.io/drained", help="Deprecated: use KubernetesInventory.drained_label."
    ).tag(config=True)
    kubernetes_report_interval = Float(
        30.0, help="Deprecated: use KubernetesInventory.report_interval."
    ).tag(config=True)
    kubernetes_pod_namespace = Unicode(
        "", help="Deprecated: use KubernetesInventory.pod_namespace."
    ).tag(config=True)
    kubernetes_reap_interval = Float(
        60.0, help="Deprecated: use KubernetesInventory.reap_interval."
    ).tag(config=True)
    kubernetes_reap_min_age = Float(
        120.0, help="Deprecated: use KubernetesInventory.reap_min_age."
    ).tag(config=True)

    _check_positive = validate(
        "pass_interval",
        "lease",
        "idle_timeout",
        "body_timeout",
        "db_timeout",
        "standby_poll_interval",
    )(seconds_above_zero)
    _check_not_negative = validate(
        "max_wait", "token_cache_max_age", "shed_after", "late_heartbeat"
    )(seconds_not_negative)

    def make_inventory(self) -> Inventory:
        """The inventory asked for, configured from this app's configuration.

        The deprecated ``BrokerApp.kubernetes_*`` options, where set, configure a
        :class:`~broker.kube.inventory.KubernetesInventory` (the new names win
        over the old); with ``kubernetes_inventory`` off it only cleans up pods.
        Raises :class:`~broker.inventory.InventoryError` when they are mixed
        with another inventory, ``TraitError`` for a bad value.
        """
        moved: dict[str, Any] = {}
        for old, new in MOVED_TO_KUBERNETES.items():
            if getattr(self, old) != self.trait_defaults(old):
                instead = (
                    "BrokerApp.inventory_class = 'kubernetes'"
                    if new == "watch_nodes"
                    else f"KubernetesInventory.{new}"
                )
                self.log.warning("BrokerApp.%s is deprecated: use %s", old, instead)
                if new not in self.config.KubernetesInventory:
                    moved[new] = getattr(self, old)
        inventory_class = self.inventory_class
        if moved and inventory_class is StaticInventory:
            inventory_class = KubernetesInventory
            moved.setdefault("watch_nodes", False)
        if moved and not issubclass(inventory_class, KubernetesInventory):
            raise InventoryError(
                f"the BrokerApp.kubernetes_* options need the Kubernetes inventory, "
                f"not {inventory_class.__name__}"
            )
        return inventory_class(parent=self, **moved)

    @property
    def hub_managed(self) -> bool:
        """Whether JupyterHub runs this broker as a service (its API token is set)."""
        return bool(os.environ.get("JUPYTERHUB_API_TOKEN"))

    def initialize(self, argv: Sequence[str] | None = None) -> None:
        """Options from the command line, then the options file (the command line wins).

        Raises :class:`OptionsFileError` for a missing or broken options file.
        """
        self.parse_command_line(argv)
        path = Path(self.options_file)
        if not path.is_file():
            if "options_file" in self.cli_config.get("BrokerApp", {}):
                raise OptionsFileError(f"{path}: no such file")
            return
        try:
            self.load_config_file(path.name, path=str(path.parent))
        except Exception as err:  # a syntax error or an exception raised in the file
            raise OptionsFileError(f"{path}: {type(err).__name__}: {err}") from None

    def make_broker(self, config: ClusterConfig) -> Broker:
        """The store, on this app's database and with its lease options; the single
        writer, as the leader it is made for (design.md §8)."""
        return Broker(
            self.db_url,
            config,
            lease=self.lease,
            late_heartbeat=self.late_heartbeat,
            upgrade=self.upgrade_db,
            db_timeout=self.db_timeout,
            single_writer=True,  # it holds the leader lock (design.md §8)
        )

    def make_runner(self, broker: Broker) -> BrokerRunner:
        """What drives ``broker`` with this app's pass, what-if and shedding options."""
        return BrokerRunner(
            broker,
            pass_interval=self.pass_interval,
            db_timeout=self.db_timeout,
            grant_at_once=True,
            what_if_share=self.what_if_share,
            shed_after=self.shed_after,
        )

    def start(self) -> int:
        return asyncio.run(self.serve())

    async def serve(self) -> int:
        """Serve until SIGTERM or SIGINT; the exit status."""
        try:
            config = load_config(self.cluster_file)
        except InvalidConfig as err:
            self.log.error("%s: %s", self.cluster_file, err)
            return 2
        database = make_url(normalize_url(self.db_url)).render_as_string(hide_password=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # `kill -USR1 PID` logs where each task waits and writes every thread's stack to
        # standard error (the threads' even when the loop is stuck): where a broker that
        # does not answer, or does not stop, is waiting (docs/troubleshooting.md).
        loop.add_signal_handler(signal.SIGUSR1, log_tasks)
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
        # One broker per database leads; another waits here as a standby, serving
        # its role and 503s, until the leader's lock is released.
        leadership = Leadership(
            leader_lock(self.db_url, self.db_timeout), self.standby_poll_interval
        )
        switch = AppSwitch(standby_app(self.base_url, leadership, {"limits": DEFAULT_LIMITS}))
        server = make_server(switch, idle_timeout=self.idle_timeout, body_timeout=self.body_timeout)
        listening = False
        try:
            leading = await leadership.try_acquire()
        except (OSError, SQLAlchemyError) as err:
            self.log.error("cannot open the database %s: %s", database, str(err).splitlines()[0])
            return 1
        if not leading:
            try:
                server.listen(self.port, address=self.ip)
            except OSError as err:
                self.log.error("cannot listen on %s:%s: %s", self.ip, self.port, err)
                return 1
            listening = True
            if not await leadership.acquire(stop):
                server.stop()
                await server.close_all_connections()
                await leadership.release()
                return 0
        try:
            broker = self.make_broker(config)
        except DatabaseSchemaError as err:
            self.log.error("%s", err)
            return 2
        except SQLAlchemyError as err:
            self.log.error("cannot open the database %s: %s", database, str(err).splitlines()[0])
            return 1
        runner = self.make_runner(broker)
        try:
            inventory = self.make_inventory()
            await inventory.setup(runner)
        except (InventoryError, TraitError) as err:
            self.log.error("inventory: %s", err)
            await runner.stop()
            return 2
        authenticator = self._authenticator(runner, config.admins)
        app = make_app(
            runner,
            authenticator,
            base_url=self.base_url,
            max_wait=self.max_wait,
            authenticate_metrics=self.authenticate_metrics,
            hub_oauth=self._hub_oauth(),
        )
        switch.app = app  # a standby's server answers as the leader from now on
        try:
            if not listening:
                server.listen(self.port, address=self.ip)
        except OSError as err:
            self.log.error("cannot listen on %s:%s: %s", self.ip, self.port, err)
            await inventory.stop()
            await runner.stop()
            authenticator.close()
            return 1
        # What start-up made (modules, configuration, the app) lives all run: keep
        # the collector from scanning it again and again (the pass's p99 came from
        # collections of it).
        gc.collect()
        gc.freeze()
        runner.start()
        inventory.start()
        watch = asyncio.create_task(leadership.watch(stop))
        if listening:
            self.log.info(
                "leader: took over after %.1f s as standby (state rebuilt from the database)",
                leadership.waited_s,
            )
        self.log.info(
            "slicebroker %s serving http://%s:%s%sapi/v1 (config %s, %s, database %s, auth %s)",
            __version__,
            self.ip,
            self.port,
            self.base_url,
            config.source,
            inventory.describe(),
            database,
            authenticator.describe(),
        )
        await stop.wait()
        watch.cancel()
        self.log.info("stopping")
        server.stop()
        runner.watchers.close()  # long polls answer now
        in_flight = app.settings["in_flight"]
        try:  # requests in flight finish
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await in_flight.idle()
        except TimeoutError:
            self.log.warning(
                "stopping: %d requests still unanswered after %.0f s; closing their connections",
                in_flight.count,
                STOP_TIMEOUT_S,
            )
        await server.close_all_connections()
        await inventory.stop()
        await runner.stop()
        authenticator.close()
        await leadership.release()
        return 0 if leadership.role == "leader" else 1  # 1: another broker took the lock

    def _hub_oauth(self) -> Any:
        """The hub's OAuth login for the web pages, when JupyterHub runs the broker."""
        if not self.hub_managed:
            return None
        from jupyterhub.services.auth import HubOAuth

        return HubOAuth(cache_max_age=self.token_cache_max_age)

    def _authenticator(self, runner: BrokerRunner, admins: Iterable[str]) -> Authenticator:
        if self.hub_managed:
            return HubAuthenticator.from_environment(self.token_cache_max_age)
        return TokenAuthenticator(
            TokenStore(self.db_url),
            runner.read_urgent,
            admins=admins,
            cache_max_age=self.token_cache_max_age,
        )


def log_tasks() -> None:
    """Log every asyncio task of the running loop with the chain of awaits it waits in."""
    tasks = asyncio.all_tasks()
    lines = [f"{len(tasks)} tasks, where each waits:"]
    for task in tasks:
        lines.append(f"task {task.get_name()}:")
        awaited: Any = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is None:  # a future or a finished coroutine: the chain's end
                lines.append(f"  awaiting {awaited!r}"[:200])
                break
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    logging.getLogger("slicebroker.service").warning("%s", "\n".join(lines))


class OptionsFileError(Exception):
    """The options file is missing or cannot be loaded."""


def main(argv: Sequence[str] | None = None) -> int:
    """``slicebroker serve [options]``: serve until stopped; the exit status."""
    app = BrokerApp()
    try:
        app.initialize(argv)
        return app.start()
    except OptionsFileError as err:
        app.log.error("%s", err)
        return 2
    except TraitError as err:  # an option's default read from the environment
        app.log.critical("Bad config: %s", err)
        return 2
    except SystemExit as done:  # --help, --version, or a bad option
        code = done.code if isinstance(done.code, int) else 0
        # traitlets stops on an option's bad value (its "Bad config" line) with status
        # 1; a configuration to fix is status 2 here, as an unknown option is.
        return 2 if code == 1 else code
    except KeyboardInterrupt:
        return 0


def generate_config(argv: Sequence[str] | None = None) -> int:
    """``slicebroker generate-config [-o FILE] [--force]``: write an options file with every
    option of the service and of the installed inventories, commented out, with its help."""
    parser = argparse.ArgumentParser(
        prog="slicebroker generate-config", description=generate_config.__doc__
    )
    parser.add_argument(
        "-o", "--output", default="slicebroker_config.py", help="the file to write; - prints it"
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = parser.parse_args(argv)
    app = BrokerApp()
    app.classes = [BrokerApp, *installed_inventories()]
    text = app.generate_config_file()
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    path = Path(args.output)
    if path.exists() and not args.force:
        print(f"{path} exists: give --force to overwrite it", file=sys.stderr)
        return 2
    try:
        path.write_text(text)
    except OSError as err:
        print(f"cannot write {path}: {err.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


def installed_inventories() -> list[type[Inventory]]:
    """The inventory classes of the ``slicebroker.inventories`` entry points that load."""
    classes: list[type[Inventory]] = []
    for entry_point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            cls = entry_point.load()
        except Exception:  # a broken plugin leaves the others listed
            continue
        if isinstance(cls, type) and issubclass(cls, Inventory) and cls not in classes:
            classes.append(cls)
    return classes
