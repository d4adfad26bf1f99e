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

import asyncio
import contextlib
import gc
import logging
import os
import re
import signal
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from tornado import web
from tornado.httpserver import HTTPServer
from traitlets import Bool, Float, Integer, Unicode, default, validate
from traitlets.config import Application

from .. import __version__
from ..config import DEMO_CONFIG, load_config
from ..errors import InvalidConfig
from ..orm import DatabaseSchemaError, normalize_url
from ..store import Broker
from .apihandlers import default_handlers
from .apihandlers.base import InFlight, Limits, NotFoundHandler, log_request
from .auth import Authenticator, HubAuthenticator, TokenAuthenticator, TokenStore
from .openapi import path_regex
from .pages import page_routes, page_settings
from .runner import BrokerRunner

if TYPE_CHECKING:
    from ..kube.service import KubernetesTasks

log = logging.getLogger("slicebroker.service")

LOG_FORMAT = "[%(levelname)1.1s %(asctime)s.%(msecs).03d %(name)s] %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
#: The request size limits the service applies.
DEFAULT_LIMITS = Limits()
#: How long requests in flight may take to finish when the service stops.
STOP_TIMEOUT_S = 5.0
#: A Kubernetes namespace name (an RFC 1123 label).
NAMESPACE_PATTERN = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"


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
    app: web.Application, *, idle_timeout: float = 60.0, body_timeout: float = 60.0
) -> HTTPServer:
    """The HTTP server of ``app``, with the limits that keep slow or large requests
    from holding sockets and memory.

    ``idle_timeout``: seconds a connection may take to send a request's headers,
    counted from the end of the previous answer (an idle keep-alive connection is
    closed after it). ``body_timeout``: seconds a request's body may take to
    arrive. The server reads bodies of any announced size, since
    :class:`~broker.service.apihandlers.base.APIHandler` streams them and
    answers 413 itself; headers it reads up to ``max_header_read_bytes``.
    """
    limits: Limits = app.settings["limits"]
    return HTTPServer(
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


class BrokerApp(Application):
    """Serve the broker's HTTP API and run its scheduling loop."""

    name = "slicebroker-serve"
    version = __version__
    description = (
        "Serve the GPU broker's HTTP API (JSON under {base_url}api/v1) and run its "
        "scheduling loop. Standalone it uses its own tokens (slicebroker token create); "
        "launched by JupyterHub as a service it uses JupyterHub's tokens and scopes."
    )
    aliases = {
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

    config_file = Unicode(
        help="""The cluster configuration (TOML): GPU types, nodes, project tree, policy.

        Default: $SLICEBROKER_CONFIG if set, else the demo cluster shipped with the
        package (one node of 8 H100s). See docs/configuration.md.
        """,
    ).tag(config=True)

    @default("config_file")
    def _default_config_file(self) -> str:
        return os.environ.get("SLICEBROKER_CONFIG") or str(DEMO_CONFIG)

    db_url = Unicode(
        help="""The database URL (SQLAlchemy): sqlite:///path/file.sqlite or
        postgresql://user:password@host/db.

        Default: $SLICEBROKER_DB_URL if set, else sqlite:///slicebroker.sqlite (a file
        in the working directory). A blank database is initialised on start.
        """,
    ).tag(config=True)

    @default("db_url")
    def _default_db_url(self) -> str:
        return os.environ.get("SLICEBROKER_DB_URL") or "sqlite:///slicebroker.sqlite"

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
            raise ValueError(f"port must be 0-65535, got {proposal.value}")
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
        5.0,
        help="""Longest time between scheduling passes, in seconds (default 5).

        Passes also run after every change (submit, release, node or project change)
        and at the next contract deadline (end of protection, grace period, max
        runtime, lease expiry), so this only bounds how stale fair-share values get.
        """,
    ).tag(config=True)

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

    upgrade_db = Bool(
        False,
        help="""Migrate an out-of-date database on start instead of refusing to run
        (default: no; `slicebroker upgrade-db` does it by hand).
        """,
    ).tag(config=True)

    kubernetes_inventory = Bool(
        False,
        help="""Take the nodes from the Kubernetes API instead of the configuration
        file, and keep them current with a watch (default: no). GPU nodes,
        cordons, taints and NotReady map to node states as docs/kubernetes.md
        says. Needs the `kubernetes` extra and RBAC to list and watch nodes.
        """,
    ).tag(config=True)

    kubernetes_api_url = Unicode(
        "",
        help="""The Kubernetes API server's URL, used without credentials (e.g. a
        `kubectl proxy`). Default: empty, the pod's service account inside a
        cluster, else the local kubeconfig.
        """,
    ).tag(config=True)

    kubernetes_node_selector = Unicode(
        "",
        help="""A label selector limiting the nodes taken from Kubernetes, e.g.
        `nvidia.com/gpu.present=true` (default: empty, every node; nodes
        without GPUs are left out anyway).
        """,
    ).tag(config=True)

    kubernetes_drained_label = Unicode(
        "slicebroker.io/drained",
        help="""The label (value `true`) put on a Kubernetes node once the broker
        has drained it, so repair automation can proceed; removed when the node
        is back. Empty: no label is written (and no `patch` on nodes is needed).
        """,
    ).tag(config=True)

    kubernetes_report_interval = Float(
        30.0,
        help="""Seconds between two checks for drained nodes to label (default 30).""",
    ).tag(config=True)

    kubernetes_pod_namespace = Unicode(
        "",
        help="""The Kubernetes namespace of the notebook pods (zero-to-jupyterhub: the
        hub's). Pods there labelled `slicebroker.io/slice-id` whose slice has ended
        are deleted: the safety net for a pod the spawner could not stop (hub down,
        state lost, a failed stop). Default: empty, no pod is ever deleted. Works
        with or without `kubernetes_inventory`; needs the `kubernetes` extra and RBAC
        to list and delete pods in the namespace.
        """,
    ).tag(config=True)

    @validate("kubernetes_pod_namespace")
    def _check_namespace(self, proposal):
        if proposal.value and not re.fullmatch(NAMESPACE_PATTERN, proposal.value):
            raise ValueError(
                f"kubernetes_pod_namespace must be a Kubernetes namespace name (lower-case "
                f"letters, digits and '-', at most 63), got {proposal.value!r}"
            )
        return proposal.value

    kubernetes_reap_interval = Float(
        60.0,
        help="""Seconds between two rounds of deleting pods of ended slices (default 60).""",
    ).tag(config=True)

    kubernetes_reap_min_age = Float(
        120.0,
        help="""Seconds a pod must have existed before it may be deleted as the pod of an
        ended slice (default 120), so that a pod being created is never raced.
        """,
    ).tag(config=True)

    @validate(
        "pass_interval",
        "lease",
        "idle_timeout",
        "body_timeout",
        "kubernetes_report_interval",
        "kubernetes_reap_interval",
    )
    def _check_positive(self, proposal):
        if not proposal.value > 0:
            raise ValueError(f"{proposal.trait.name} must be > 0 seconds, got {proposal.value}")
        return proposal.value

    @validate("max_wait", "token_cache_max_age", "kubernetes_reap_min_age")
    def _check_not_negative(self, proposal):
        if not proposal.value >= 0:
            raise ValueError(f"{proposal.trait.name} must be >= 0 seconds, got {proposal.value}")
        return proposal.value

    async def _kubernetes(self, runner: BrokerRunner) -> KubernetesTasks | None:
        """The Kubernetes tasks asked for (inventory and drain reports, pod cleanup), not
        started yet; ``None`` when none is.

        Made before the server listens: importing the Kubernetes client takes about a
        second, during which a listening server would leave requests unanswered.
        """
        if not (self.kubernetes_inventory or self.kubernetes_pod_namespace):
            return None
        from ..kube.service import KubernetesTasks, core_api

        return KubernetesTasks(
            runner,
            await core_api(self.kubernetes_api_url),
            inventory=self.kubernetes_inventory,
            node_selector=self.kubernetes_node_selector,
            drained_label=self.kubernetes_drained_label,
            report_interval=self.kubernetes_report_interval,
            pod_namespace=self.kubernetes_pod_namespace,
            reap_interval=self.kubernetes_reap_interval,
            reap_min_age=self.kubernetes_reap_min_age,
        )

    def _log_kubernetes(self) -> None:
        """Say which Kubernetes tasks run."""
        if self.kubernetes_inventory:
            log.info("nodes from Kubernetes (selector %r)", self.kubernetes_node_selector)
        if self.kubernetes_pod_namespace:
            log.info(
                "deleting pods of ended slices in namespace %s every %g s",
                self.kubernetes_pod_namespace,
                self.kubernetes_reap_interval,
            )

    @property
    def hub_managed(self) -> bool:
        """Whether JupyterHub runs this broker as a service (its API token is set)."""
        return bool(os.environ.get("JUPYTERHUB_API_TOKEN"))

    def initialize(self, argv: Sequence[str] | None = None) -> None:
        super().initialize(argv)
        _setup_logging(self.log_level)

    def start(self) -> int:
        return asyncio.run(self.serve())

    async def serve(self) -> int:
        """Serve until SIGTERM or SIGINT; the exit status."""
        try:
            config = load_config(self.config_file)
        except InvalidConfig as err:
            log.error("%s: %s", self.config_file, err)
            return 2
        database = make_url(normalize_url(self.db_url)).render_as_string(hide_password=True)
        try:
            broker = Broker(
                self.db_url, config, lease=self.lease, upgrade=self.upgrade_db, grant_at_once=True
            )
        except DatabaseSchemaError as err:
            log.error("%s", err)
            return 2
        except SQLAlchemyError as err:
            log.error("cannot open the database %s: %s", database, str(err).splitlines()[0])
            return 1
        runner = BrokerRunner(broker, pass_interval=self.pass_interval)
        try:
            kubernetes = await self._kubernetes(runner)
        except Exception as err:  # the extra not installed, no kubeconfig nor service account
            log.error("cannot set up the Kubernetes client: %s", err)
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
        server = make_server(app, idle_timeout=self.idle_timeout, body_timeout=self.body_timeout)
        try:
            server.listen(self.port, address=self.ip)
        except OSError as err:
            log.error("cannot listen on %s:%s: %s", self.ip, self.port, err)
            if kubernetes is not None:
                await kubernetes.stop()
            await runner.stop()
            authenticator.close()
            return 1
        # What start-up made (modules, configuration, the app) lives all run: keep
        # the collector from scanning it again and again (the pass's p99 came from
        # collections of it).
        gc.collect()
        gc.freeze()
        runner.start()
        if kubernetes is not None:
            kubernetes.start()
            self._log_kubernetes()
        log.info(
            "slicebroker %s serving http://%s:%s%sapi/v1 (config %s, database %s, auth %s)",
            __version__,
            self.ip,
            self.port,
            self.base_url,
            config.source,
            database,
            authenticator.describe(),
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
        server.stop()
        runner.watchers.close()  # long polls answer now
        with contextlib.suppress(TimeoutError):  # requests in flight finish
            await asyncio.wait_for(app.settings["in_flight"].idle(), STOP_TIMEOUT_S)
        await server.close_all_connections()
        if kubernetes is not None:
            await kubernetes.stop()
        await runner.stop()
        authenticator.close()
        return 0

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
            lambda fn: runner.read(fn),
            admins=admins,
            cache_max_age=self.token_cache_max_age,
        )


def _setup_logging(level: int | str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """``slicebroker serve [options]``: serve until stopped; the exit status."""
    app = BrokerApp()
    try:
        app.initialize(argv)
        return app.start()
    except SystemExit as done:  # --help, --version, or a bad option
        return done.code if isinstance(done.code, int) else 0
    except KeyboardInterrupt:
        return 0
