"""Idle culling that knows the queue and the budgets (SPEC §7).

An idle GPU session costs its project and, when others wait, blocks them. So
the time a session may sit idle (by the hub's ``last_activity``) shrinks with
the demand for GPUs (:func:`idle_limit`):

1. nobody waits for GPUs: ``timeout`` (default 1 h);
2. requests wait in the broker's queue: ``busy_timeout`` (default 15 min);
3. requests wait and the session's project has used more than its
   entitlement of GPU time in the lookback window: ``over_share_timeout``
   (default 5 min).

Two ways to run it:

- the hub-managed service ``python -m spawner.culler`` (:class:`SliceBrokerCuller`),
  which needs the hub scopes ``list:users``, ``read:users:activity``,
  ``read:servers``, ``delete:servers`` and ``access:services!service=slicebroker``
  (to read the queue from the broker), and nothing else;
- :class:`CullArbiter` as the ``cull_arbiter_hook`` of jupyterhub-idle-culler
  (2.0 or later), where ``--timeout`` is the first limit.

Culling stops the server through the hub; the spawner then releases the slice.
The culler never looks at pending spawns (waiting in the queue costs nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from traitlets import Float, Unicode, Union, default
from traitlets.config import Application

from broker.client import BrokerAPIError, BrokerClient
from broker.config import parse_duration

log = logging.getLogger("slicebroker.culler")

HOUR = 3600.0


def utcnow() -> datetime:
    """Now, aware, in UTC (a module function so that tests can move time)."""
    return datetime.now(UTC)


def parse_time(text: str) -> datetime:
    """A hub timestamp (ISO 8601, ``Z`` or offset) as an aware datetime."""
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Limits:
    """The three idle limits, in seconds; each is capped by the one before."""

    timeout: float = HOUR
    busy_timeout: float = 15 * 60.0
    over_share_timeout: float = 5 * 60.0


def idle_limit(limits: Limits, *, waiting: int, over_share: bool) -> float:
    """Seconds a session may stay idle: ``timeout`` when nobody waits, ``busy_timeout``
    while ``waiting`` requests wait, ``over_share_timeout`` while they wait and the
    session's project is over its share."""
    limit = limits.timeout
    if waiting > 0:
        limit = min(limit, limits.busy_timeout)
        if over_share:
            limit = min(limit, limits.over_share_timeout)
    return limit


@dataclass(frozen=True)
class Demand:
    """What the broker says about demand: requests waiting, projects over their share."""

    waiting: int = 0
    over_share: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_projects(cls, rows: Iterable[Mapping[str, Any]]) -> Demand:
        """From ``GET /projects``: waiting requests, and projects whose share of all
        usage in the window is above their entitlement."""
        rows = list(rows)
        total = sum(float(r.get("usage") or 0.0) for r in rows if r.get("parent") is None)
        waiting = sum(int(r.get("pending") or 0) for r in rows if r.get("is_project"))
        over = frozenset(
            r["name"]
            for r in rows
            if r.get("is_project")
            and total > 0
            and float(r.get("usage") or 0.0) / total > float(r.get("entitlement") or 0.0)
        )
        return cls(waiting, over)

    def limit_for(self, limits: Limits, project: str | None) -> float:
        return idle_limit(limits, waiting=self.waiting, over_share=project in self.over_share)


def session_project(server: Mapping[str, Any]) -> str | None:
    """The project a server's slice is charged to, from its (resolved) user options."""
    options = server.get("user_options") or {}
    project = options.get("project") if isinstance(options, Mapping) else None
    return project if isinstance(project, str) and project else None


# ---- the hub's API ------------------------------------------------------------------------


class HubAPI:
    """The few hub API calls the culler makes, as the token's owner."""

    def __init__(self, url: str, token: str, *, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self._token = token
        self.timeout = timeout
        self._http = AsyncHTTPClient(force_instance=True)

    def close(self) -> None:
        self._http.close()

    async def _fetch(self, method: str, url: str, body: Any = None) -> Any:
        request = HTTPRequest(
            url,
            method=method,
            headers={
                "Authorization": f"token {self._token}",
                "Accept": "application/jupyterhub-pagination+json",
            },
            body=None if body is None else json.dumps(body),
            allow_nonstandard_methods=True,
            request_timeout=self.timeout,
        )
        response = await self._http.fetch(request)
        return json.loads(response.body) if response.body else None

    async def ready_users(self) -> list[dict[str, Any]]:
        """Users with a ready server (``GET /users?state=ready``), every page."""
        url: str | None = f"{self.url}/users?state=ready"
        users: list[dict[str, Any]] = []
        while url:
            page = await self._fetch("GET", url)
            if isinstance(page, list):  # a hub without pagination
                return users + page
            users.extend(page["items"])
            following = (page.get("_pagination") or {}).get("next")
            url = following["url"] if following else None
        return users

    async def stop_server(self, user: str, server_name: str) -> None:
        path = f"/users/{quote(user, safe='')}/server"
        if server_name:
            path = f"/users/{quote(user, safe='')}/servers/{quote(server_name, safe='')}"
        await self._fetch("DELETE", self.url + path)


# ---- one sweep --------------------------------------------------------------------------


async def demand_from(broker: BrokerClient | None) -> Demand | None:
    """The broker's demand, or ``None`` when it cannot be read."""
    if broker is None:
        return None
    try:
        return Demand.from_projects(await broker.projects())
    except BrokerAPIError as err:
        log.warning("cannot read the queue from the broker (%s)", err.message)
        return None


async def cull_idle(
    hub: HubAPI,
    broker: BrokerClient | None,
    limits: Limits,
    *,
    now: datetime | None = None,
) -> list[str]:
    """Stop every ready server idle for longer than its limit; the ``user/server`` names stopped.

    When the broker cannot be read, every session gets the longest limit
    (``timeout``): the culler is never harsher than it can justify. One
    server's failure is logged and the sweep goes on.
    """
    demand = await demand_from(broker)
    if demand is None:
        demand = Demand()
    now = now or utcnow()
    culled = []
    for user in await hub.ready_users():
        for server_name, server in (user.get("servers") or {}).items():
            if server.get("pending") or not server.get("ready"):
                continue
            last = server.get("last_activity") or server.get("started")
            if not last:
                continue
            inactive = (now - parse_time(last)).total_seconds()
            project = session_project(server)
            limit = demand.limit_for(limits, project)
            name = f"{user['name']}/{server_name}" if server_name else user["name"]
            if inactive < limit:
                continue
            log.info(
                "culling %s: idle %.0f s >= %.0f s (%d waiting, project %s%s)",
                name,
                inactive,
                limit,
                demand.waiting,
                project,
                " over its share" if project in demand.over_share else "",
            )
            try:
                await hub.stop_server(user["name"], server_name)
            except Exception as err:
                log.error("culling %s failed: %s", name, err)
                continue
            culled.append(name)
    return culled


# ---- jupyterhub-idle-culler's hook ---------------------------------------------------------


class CullArbiter:
    """A ``cull_arbiter_hook`` for jupyterhub-idle-culler::

        # idle_culler_config.py
        from spawner.culler import CullArbiter
        c.IdleCuller.cull_arbiter_hook = CullArbiter(busy_timeout=900, over_share_timeout=300)

    The culler's ``--timeout`` is the limit when nobody waits; the others
    apply while requests wait (see :func:`idle_limit`). The broker is read with
    ``broker_url``/``token`` (default: ``$SLICEBROKER_URL`` and the culler's own
    ``$JUPYTERHUB_API_TOKEN``, whose role needs ``access:services!service=slicebroker``)
    at most every ``cache_seconds``. Run the culler with ``--cull-every`` at most
    half the shortest limit.
    """

    def __init__(
        self,
        *,
        busy_timeout: float = 15 * 60.0,
        over_share_timeout: float = 5 * 60.0,
        broker_url: str | None = None,
        token: str | None = None,
        cache_seconds: float = 10.0,
        demand: Callable[[], Awaitable[Demand | None]] | None = None,
    ):
        self.busy_timeout = busy_timeout
        self.over_share_timeout = over_share_timeout
        self.cache_seconds = cache_seconds
        self._broker_url = broker_url
        self._token = token
        self._read_demand = demand or self._from_broker
        self._cached: tuple[float, Demand | None] | None = None

    async def _from_broker(self) -> Demand | None:
        url = self._broker_url or os.environ.get("SLICEBROKER_URL", "")
        token = self._token or os.environ.get("JUPYTERHUB_API_TOKEN", "")
        if not url or not token:
            log.warning("CullArbiter: no broker URL or token; culling by the plain timeout")
            return None
        async with BrokerClient(url, token, retries=1) as broker:
            return await demand_from(broker)

    async def demand(self) -> Demand | None:
        clock = time.monotonic()
        if self._cached is None or clock - self._cached[0] >= self.cache_seconds:
            self._cached = (clock, await self._read_demand())
        return self._cached[1]

    async def __call__(self, *, inactive, inactive_limit, server, **_kwargs) -> bool:
        demand = await self.demand() or Demand()
        limits = Limits(float(inactive_limit), self.busy_timeout, self.over_share_timeout)
        return inactive.total_seconds() >= demand.limit_for(limits, session_project(server))


# ---- the service ------------------------------------------------------------------------------


def _seconds(value: float | str) -> float:
    return parse_duration(value)


class SliceBrokerCuller(Application):
    """Stop idle GPU sessions, sooner while others wait (``python -m spawner.culler``)."""

    name = "slicebroker-culler"
    description = __doc__.split("\n\n")[0]
    aliases = {
        "url": "SliceBrokerCuller.url",
        "broker-url": "SliceBrokerCuller.broker_url",
        "timeout": "SliceBrokerCuller.timeout",
        "busy-timeout": "SliceBrokerCuller.busy_timeout",
        "over-share-timeout": "SliceBrokerCuller.over_share_timeout",
        "cull-every": "SliceBrokerCuller.cull_every",
        "log-level": "Application.log_level",
    }

    url = Unicode(help="The hub's API URL. Default: $JUPYTERHUB_API_URL.").tag(config=True)

    @default("url")
    def _url_default(self) -> str:
        return os.environ.get("JUPYTERHUB_API_URL", "http://127.0.0.1:8081/hub/api")

    broker_url = Unicode(
        help="The broker's base URL (without /api/v1). Default: $SLICEBROKER_URL. Empty: "
        "the queue is not known and every session gets `timeout`."
    ).tag(config=True)

    @default("broker_url")
    def _broker_url_default(self) -> str:
        return os.environ.get("SLICEBROKER_URL", "")

    timeout = Union(
        [Float(), Unicode()],
        default_value=HOUR,
        help="Idle limit when nobody waits for GPUs (seconds or a duration such as '1h').",
    ).tag(config=True)
    busy_timeout = Union(
        [Float(), Unicode()],
        default_value=15 * 60.0,
        help="Idle limit while requests wait in the broker's queue (seconds or a duration).",
    ).tag(config=True)
    over_share_timeout = Union(
        [Float(), Unicode()],
        default_value=5 * 60.0,
        help="Idle limit while requests wait, for sessions of projects that used more than "
        "their entitlement in the lookback window (seconds or a duration).",
    ).tag(config=True)
    cull_every = Union(
        [Float(), Unicode()],
        default_value=60.0,
        help="Seconds between sweeps (or a duration); at most half the shortest limit.",
    ).tag(config=True)

    def limits(self) -> Limits:
        return Limits(
            _seconds(self.timeout), _seconds(self.busy_timeout), _seconds(self.over_share_timeout)
        )

    def start(self) -> None:
        asyncio.run(self.run())

    async def run(self) -> None:
        token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
        if not token:
            raise SystemExit("slicebroker-culler: $JUPYTERHUB_API_TOKEN is not set")
        hub = HubAPI(self.url, token)
        broker = BrokerClient(self.broker_url, token, retries=1) if self.broker_url else None
        limits, every = self.limits(), _seconds(self.cull_every)
        self.log.info(
            "culling idle sessions every %g s: after %g s, %g s while others wait, %g s for "
            "projects over their share",
            every,
            limits.timeout,
            limits.busy_timeout,
            limits.over_share_timeout,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        while not stop.is_set():
            try:
                await cull_idle(hub, broker, limits)
            except Exception:
                self.log.exception("culling sweep failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
        hub.close()
        if broker is not None:
            broker.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, format="[%(levelname)1.1s %(asctime)s %(name)s] %(message)s"
    )
    SliceBrokerCuller.launch_instance(argv)


if __name__ == "__main__":
    main()
