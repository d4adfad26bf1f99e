"""The pages' handlers: login, the five pages, their fragments, and the actions.

Who is calling is decided as for the API, by the service's authenticator, from
a token the browser holds in a cookie: JupyterHub's OAuth token in hub mode
(the hub's login, :class:`jupyterhub.services.auth.HubOAuth`), or a broker
token pasted into :class:`LoginHandler`'s form standalone. Every POST carries an
XSRF token bound to the login (the ``X-XSRFToken`` header: the hub's scheme, or
standalone a MAC of the login's token; the login form itself uses tornado's
``_xsrf`` cookie), and actions check roles themselves: a non-admin gets 403, button or not.

Pages are rendered whole on the server (the first paint has the data); each
then polls ``ui/fragment/<page>`` every few seconds, and tornado's ETag lets an
unchanged fragment cost a 304 without a body.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any
from urllib.parse import urlencode

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from tornado import web
from tornado.httputil import HTTPServerRequest

from ... import __version__
from ...core.accounting import usage_csv
from ...errors import BrokerError, Forbidden, InvalidRequest, NotFound
from ...store import Principal
from ..apihandlers.base import (
    MESSAGE_LIMIT,
    bounded,
    describe_error,
    leave_in_flight,
    log_failure,
    parse_json_body,
    slice_id_in_path,
)
from ..apihandlers.common import is_member
from ..apihandlers.nodes import NODE_ACTIONS
from ..apihandlers.projects import put_project
from ..apihandlers.slices import read_alternatives, replace_slice
from ..auth import parse_authorization, token_key
from ..schema import ref, validate
from . import views
from .redirects import is_local_target
from .views import Cluster

#: The cookie holding a standalone login's broker token (signed, HTTP only).
TOKEN_COOKIE = "slicebroker-token"
#: The pages, in menu order: path, title.
PAGES = (
    ("gpus", "My GPUs"),
    ("queue", "Queue"),
    ("projects", "Projects"),
    ("cluster", "Cluster"),
    ("usage", "Usage"),
)
#: Seconds between two refreshes of a page's data.
REFRESH_S = 3
#: The longest date range of the usage page, in days.
MAX_USAGE_DAYS = 92
CSV_COLUMNS = (
    "project", "user", "day", "since", "until", "slices", "gpu_seconds", "weighted_gpu_seconds",
)  # fmt: skip


def login_xsrf_token(secret: bytes, token: str) -> str:
    """A standalone login's XSRF token: a MAC of its broker token under the cookie secret,
    so that it proves the page was this login's (and changes with every restart)."""
    return hmac.new(secret, b"xsrf:" + token_key(token).encode(), hashlib.sha256).hexdigest()


class XsrfRefused(BrokerError):
    """A POST without the page's XSRF token: it may come from another site."""

    status = 403
    code = "xsrf"


class PageHandler(HubOAuthenticated, web.RequestHandler):
    """Base of the pages: the caller's identity, XSRF on POST, errors as HTML or JSON."""

    identity: Principal
    _counted = False
    #: Standalone: the token of the caller's login, once it is known to be valid.
    _login_token: str | None = None

    @property
    def hub_auth(self) -> Any:
        return self.settings.get("hub_oauth")

    @property
    def base(self) -> str:
        return self.settings["pages_base"]

    @property
    def runner(self):
        return self.settings["runner"]

    @property
    def broker(self):
        return self.settings["runner"].broker

    @property
    def is_json(self) -> bool:
        return self.request.path.startswith(self.base + "ui/")

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Content-Type-Options", "nosniff")
        self.set_header("Referrer-Policy", "same-origin")
        # Scripts and styles only from this server's static files: nothing inline runs.
        self.set_header(
            "Content-Security-Policy",
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "frame-ancestors 'self'; form-action 'self'",
        )

    def get_current_user(self) -> Principal | None:
        # Set in prepare, asynchronously: never the mixin's blocking look-up.
        return getattr(self, "identity", None)

    @property
    def xsrf_token(self) -> bytes:
        """The page's XSRF token, bound to the login: the hub's scheme in hub mode; standalone,
        a MAC of the login's token (:func:`login_xsrf_token`). Before a login (the login
        form), tornado's, from the ``_xsrf`` cookie."""
        if self.hub_auth is not None:
            return HubOAuthenticated.xsrf_token.fget(self)
        if self._login_token is not None:
            return login_xsrf_token(self.settings["cookie_secret"], self._login_token).encode()
        return web.RequestHandler.xsrf_token.fget(self)

    def check_xsrf_cookie(self) -> None:
        try:
            if self.hub_auth is not None:
                self.hub_auth.check_xsrf_cookie(self)
            elif self._login_token is not None:
                self._check_login_xsrf()
            else:
                web.RequestHandler.check_xsrf_cookie(self)
        except web.HTTPError as err:
            raise XsrfRefused(
                f"{err.log_message}: send the page's XSRF token (X-XSRFToken header)"
            ) from None

    def _check_login_xsrf(self) -> None:
        # Another login's token (with its _xsrf cookie, say) is no proof of this one's page.
        sent = (
            self.get_argument("_xsrf", None)
            or self.request.headers.get("X-Xsrftoken")
            or self.request.headers.get("X-Csrftoken")
        )
        if not sent:
            raise web.HTTPError(403, "'_xsrf' argument missing from POST")
        if not hmac.compare_digest(sent.encode(), self.xsrf_token):
            raise web.HTTPError(403, "XSRF token of another login, or none")

    def get_login_url(self) -> str:
        if self.hub_auth is not None:
            return super().get_login_url()
        return f"{self.base}login?{urlencode({'next': self.request.uri})}"

    def _token(self) -> str | None:
        if self.hub_auth is not None:
            return self.hub_auth.get_token(self) or None
        token = parse_authorization(self.request.headers.get("Authorization"))
        if token is None:
            cookie = self.get_secure_cookie(TOKEN_COOKIE)
            token = cookie.decode("ascii", "replace") if cookie else None
        return token

    async def prepare(self) -> None:
        self.settings["in_flight"].enter()
        self._counted = True
        token = self._token()
        identity = await self.settings["authenticator"].authenticate(token) if token else None
        if identity is None:
            if self.request.method == "GET" and not self.is_json:
                self.redirect(self.get_login_url())
                return
            raise web.HTTPError(401, "log in first")
        self.identity = identity
        self._login_token = token
        if self.request.method not in ("GET", "HEAD"):
            self.check_xsrf_cookie()

    def on_finish(self) -> None:
        leave_in_flight(self)

    def require_admin(self, what: str) -> None:
        if not self.identity.admin:
            raise Forbidden(f"only admins may {what}")

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        # The API's answer to the same error (a database out of reach is 503, not 500).
        exc = kwargs.get("exc_info", (None, None, None))[1]
        status, code, message = describe_error(exc, status_code, self._reason)
        message = bounded(message, MESSAGE_LIMIT)
        self.set_status(status)
        if self.is_json:
            self.set_header("Content-Type", "application/json; charset=UTF-8")
            self.finish(json.dumps({"error": {"code": code, "message": message}}))
            return
        self.finish(self.render_page("error.html", status=status, message=message))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        log_failure(self.request, typ, value, tb)

    def render_page(self, name: str, **context: Any) -> str:
        template = self.settings["pages_templates"].get_template(name)
        identity = getattr(self, "identity", None)
        return template.render(
            base=self.base,
            static=self.static_url,
            identity=identity,
            pages=PAGES,
            version=__version__,
            refresh_ms=REFRESH_S * 1000,
            xsrf=self.xsrf_token.decode("ascii") if identity is not None else "",
            hub=self.hub_auth is not None,
            **context,
        )

    # ---- what each page shows ---------------------------------------------------------

    async def cluster(self) -> Cluster:
        broker = self.broker
        live = await self.runner.read_committed(
            broker.committed_live_slices, broker.list_slices, state="live"
        )
        nodes = await self.runner.read_committed(broker.committed_nodes, broker.nodes)
        projects = await self.runner.read_between_passes(self.broker.projects)
        return Cluster(nodes, {p["name"]: p for p in projects}, live, self.broker.config.policy)

    async def context(self, page: str) -> dict[str, Any]:
        now = time.time()
        if page == "gpus":
            cluster = await self.cluster()
            mine = await self.runner.read(self.broker.list_slices, user=self.identity.name)
            live, ended = views.my_slices(mine, cluster, now)
            waiting = {s["id"]: s for s in mine if s["state"] == "pending"}
            for row in live:
                if row["id"] in waiting:
                    found, _ = await read_alternatives(self.runner, self.identity, row["id"])
                    row["sooner"] = views.sooner_choices(found, waiting[row["id"]])
            return {"live": live, "ended": ended}
        if page == "queue":
            cluster = await self.cluster()
            head = cluster.pending[0] if cluster.pending else None
            return {
                "rows": views.queue_rows(cluster, self.identity),
                "head_why": views.why_waiting(head, cluster) if head else "",
            }
        if page == "cluster":
            cluster = await self.cluster()
            return {"nodes": views.node_rows(cluster, self.identity, now)}
        if page == "projects":
            return await self._projects_context(now)
        if page == "usage":
            return await self._usage_context(now)
        raise NotFound(f"no page {page!r}")

    async def _projects_context(self, now: float) -> dict[str, Any]:
        projects = await self.runner.read_between_passes(self.broker.projects)
        nodes = await self.runner.read(self.broker.nodes)
        policy = self.broker.config.policy
        capacity = sum(n["gpu_count"] * n["weight"] for n in nodes if n["in_config"])
        days = views.day_bounds(now - 6 * views.DAY, now)
        daily = await self._daily_usage(projects, days, by="project")
        charts = []
        for project in projects:
            if not (self.identity.admin or is_member(self.identity, project)):
                continue
            subtree = _subtree(project["name"], projects)
            values = [
                sum(r["weighted_gpu_seconds"] for r in rows if r["project"] in subtree)
                for rows in daily
            ]
            entitled = project["entitlement"] * capacity * views.DAY
            charts.append(
                {
                    "name": project["name"],
                    "svg": views.bar_chart(
                        f"{project['name']}: usage per day, last 7 days",
                        [views.day_label(d[0]) for d in days],
                        values,
                        line=entitled,
                        line_label=f"entitled: {views.gpu_hours(entitled)} per day",
                    ),
                    "entitled": views.gpu_hours(entitled),
                    "total": views.gpu_hours(sum(values)),
                }
            )
        return {
            "rows": views.project_rows(projects, policy),
            "charts": charts,
            "names": sorted(p["name"] for p in projects),
        }

    async def _daily_usage(
        self, projects: list[dict[str, Any]], days: list[tuple[float, float]], by: str
    ) -> list[list[dict[str, Any]]]:
        """Usage rows per day, for every project of the tree (one report per top account)."""
        roots = [p["name"] for p in projects if p["parent"] is None]

        def read() -> list[list[dict[str, Any]]]:
            return [
                [row for root in roots for row in self.broker.usage_report(root, a, b, by=by)]
                for a, b in days
            ]

        return await self.runner.read(read)

    def _usage_range(self, now: float) -> tuple[float, float, str, str]:
        """``(since, until, since text, until text)`` from the query (UTC dates, inclusive)."""
        from datetime import UTC, datetime

        def day(name: str, default: float) -> float:
            text = self.get_query_argument(name, "").strip()
            if not text:
                return default
            try:
                moment = datetime.strptime(text, "%Y-%m-%d").replace(tzinfo=UTC)
            except ValueError:
                problem = f"{name} must be a date (YYYY-MM-DD), got {text[:40]!r}"
                raise InvalidRequest(problem) from None
            return moment.timestamp()

        until = day("until", now) + views.DAY
        since = day("since", now - 6 * views.DAY)
        days = views.day_bounds(since, min(until, now + views.DAY))
        if not days or since >= until:
            raise InvalidRequest("since must not be after until")
        if len(days) > MAX_USAGE_DAYS:
            raise InvalidRequest(f"a usage report covers at most {MAX_USAGE_DAYS} days")
        return days[0][0], days[-1][1], views.day_label(days[0][0]), views.day_label(days[-1][0])

    async def usage_rows(self, now: float) -> tuple[list[dict[str, Any]], list[str], dict]:
        """Project × user × day rows the caller may see, the projects offered, the range."""
        since, until, since_text, until_text = self._usage_range(now)
        projects = await self.runner.read_between_passes(self.broker.projects)
        visible = [
            p["name"]
            for p in projects
            if p["is_project"] and (self.identity.admin or is_member(self.identity, p))
        ]
        chosen = self.get_query_argument("project", "")
        if chosen and chosen not in visible:
            raise Forbidden("only members of a project and admins may read its usage")
        wanted = {chosen} if chosen else set(visible)
        days = views.day_bounds(since, until)
        daily = await self._daily_usage(projects, days, by="user")
        rows = []
        for (start, _end), day_rows in zip(days, daily, strict=True):
            for row in day_rows:
                if row["project"] in wanted:
                    rows.append({**row, "day": views.day_label(start)})
        rows.sort(key=lambda r: (r["project"], r["user"], r["day"]))
        selection = {"since": since_text, "until": until_text, "project": chosen, "days": days}
        return rows, visible, selection

    async def _usage_context(self, now: float) -> dict[str, Any]:
        rows, visible, selection = await self.usage_rows(now)
        days = selection.pop("days")
        labels = [views.day_label(d[0]) for d in days]
        totals = dict.fromkeys(labels, 0.0)
        for row in rows:
            totals[row["day"]] += row["weighted_gpu_seconds"]
        query = urlencode({k: v for k, v in selection.items() if v})
        return {
            "rows": [
                {
                    "project": r["project"],
                    "user": r["user"],
                    "day": r["day"],
                    "slices": r["slices"],
                    "hours": views.gpu_hours(r["gpu_seconds"]),
                    "weighted": views.gpu_hours(r["weighted_gpu_seconds"]),
                }
                for r in rows
            ],
            "visible": visible,
            "selection": selection,
            "total": views.gpu_hours(sum(totals.values())),
            "svg": views.bar_chart(
                "Charged usage per day (weighted)", labels, list(totals.values()), width=640
            ),
            "csv_url": f"{self.base}ui/usage.csv" + (f"?{query}" if query else ""),
            "query": query,
        }


def _subtree(name: str, projects: list[dict[str, Any]]) -> set[str]:
    """``name`` and every account below it."""
    found = {name}
    for project in projects:  # parents come before children
        if project["parent"] in found:
            found.add(project["name"])
    return found


class RootHandler(web.RequestHandler):
    """The service's root: to My GPUs."""

    def get(self) -> None:
        self.redirect(self.settings["pages_base"] + "gpus")


class PageViewHandler(PageHandler):
    """One page, rendered whole."""

    async def get(self, page: str) -> None:
        titles = dict(PAGES)
        context = await self.context(page)
        self.finish(self.render_page(f"{page}.html", page=page, title=titles[page], data=context))


class FragmentHandler(PageHandler):
    """A page's changing part, for the page's own refresh (304 when unchanged)."""

    async def get(self, page: str) -> None:
        if page not in dict(PAGES):
            raise NotFound(f"no page {page!r}")
        context = await self.context(page)
        self.set_header("Content-Type", "text/html; charset=UTF-8")
        self.finish(self.render_page(f"_{page}.html", page=page, data=context))


class ReleaseHandler(PageHandler):
    """Release (or cancel) one of the caller's slices; admins may release any."""

    async def post(self, path_id: str) -> None:
        slice_id = slice_id_in_path(path_id)
        released = await self.runner.change(self.broker.release, slice_id, caller=self.identity)
        verb = "cancelled" if released["end_reason"] == "cancelled" else "released"
        cost = views.gpu_hours(released["charged_gpu_seconds"])
        self.finish({"message": f"Slice {released['id']} {verb}; charged {cost}."})


class ReplaceHandler(PageHandler):
    """Take one of a waiting slice's alternatives: the request is withdrawn and asked
    again with those terms in one step (``POST /slices/{id}/replace``)."""

    async def post(self, path_id: str) -> None:
        slice_id = slice_id_in_path(path_id)
        body = _json_body(self.request)
        validate(body, ref("SliceReplacement"), "body")
        new = await replace_slice(self.runner, self.identity, slice_id, body)
        self.finish({"message": f"Slice {slice_id} withdrawn; slice {new['id']} asks instead."})


class NodeActionHandler(PageHandler):
    """An admin's drain, undrain or down of a node."""

    async def post(self, name: str, action: str) -> None:
        self.require_admin(f"{action} nodes")
        body = _json_body(self.request)
        validate(body, ref("NodeChange"), "body")
        node = await self.runner.change(
            self.broker.set_node_state, name, NODE_ACTIONS[action].value, body.get("reason") or ""
        )
        self.finish({"message": f"Node {node['name']} is {node['state']}."})


class ProjectActionHandler(PageHandler):
    """An admin's change to an account: share, parent, members, as ``PUT /projects/{name}``.

    Unlike the API's ``PUT`` (which replaces the account: no parent is the top level),
    the form leaves an existing account's parent as it is when Parent is blank, as it
    does users and groups; ``"top_level": true`` moves it to the top, said out loud.
    With ``"preview": true`` nothing is changed: the answer lists the entitlements the
    change would move (before, after), for the form to ask first.
    """

    async def post(self, name: str) -> None:
        self.require_admin("change projects")
        body = _json_body(self.request)
        validate(name, {"type": "string", "minLength": 1, "maxLength": 255}, "the name")
        top_level = body.pop("top_level", False)
        preview = body.pop("preview", False)
        validate(top_level, {"type": "boolean"}, "top_level")
        validate(preview, {"type": "boolean"}, "preview")
        validate(body, ref("ProjectUpdate"), "body")
        if top_level and body.get("parent"):
            raise InvalidRequest("choose a parent or the top level, not both")
        rows = await self.runner.read(self.broker.projects)
        if not top_level and "parent" not in body:
            current = next((row for row in rows if row["name"] == name), None)
            if current is not None:
                body["parent"] = current["parent"]
        if preview:
            self.finish({"changes": views.entitlement_changes(rows, name, body)})
            return
        project = await put_project(self.runner, name, body, self.identity.name)
        self.finish({"message": f"Project {project['name']} saved."})


class UsageCsvHandler(PageHandler):
    """The usage page's rows as formula-safe CSV (the API's CSV writer)."""

    async def get(self) -> None:
        rows, _visible, selection = await self.usage_rows(time.time())
        self.set_header("Content-Type", "text/csv; charset=UTF-8")
        name = f"usage-{selection['since']}-{selection['until']}.csv"
        self.set_header("Content-Disposition", f'attachment; filename="{name}"')
        self.finish(usage_csv(rows, CSV_COLUMNS))


class LoginHandler(PageHandler):
    """Standalone: a form taking a broker token, kept in a signed HTTP-only cookie."""

    async def prepare(self) -> None:
        if self.hub_auth is not None:  # the hub logs people in
            self.redirect(f"{self.base}gpus")
            return
        if self.request.method == "POST":
            self.check_xsrf_cookie()

    def get(self) -> None:
        self.finish(self.render_login(""))

    def render_login(self, problem: str) -> str:
        return self.render_page(
            "login.html",
            title="Log in",
            problem=problem,
            next=self._next(),
            xsrf_form=self.xsrf_form_html(),
        )

    def _next(self) -> str:
        # Exactly as sent (not stripped): only pages of this service, never an open redirect.
        target = self.get_argument("next", "", strip=False)
        return target if is_local_target(target, self.base) else f"{self.base}gpus"

    async def post(self) -> None:
        token = self.get_body_argument("token", "").strip()
        try:
            identity = await self.settings["authenticator"].authenticate(token) if token else None
        except BrokerError as err:
            identity, problem = None, err.message
        else:
            problem = "" if identity else "That token is not valid (or was revoked)."
        if identity is None:
            self.set_status(403)
            self.finish(self.render_login(problem))
            return
        self.set_secure_cookie(
            TOKEN_COOKIE, token, expires_days=None, httponly=True, samesite="Strict", path=self.base
        )
        self.redirect(self._next())


class LogoutHandler(PageHandler):
    async def prepare(self) -> None:
        pass

    def get(self) -> None:
        if self.hub_auth is not None:
            hub = self.hub_auth
            self.clear_cookie(hub.cookie_name, path=hub.cookie_path)
            self.redirect(self.hub_auth.hub_host + self.hub_auth.hub_prefix + "logout")
            return
        self.clear_cookie(TOKEN_COOKIE, path=self.base)
        self.redirect(f"{self.base}login")


class OAuthCallbackHandler(HubOAuthCallbackHandler):
    """The end of the hub's OAuth login (hub mode)."""

    @property
    def hub_auth(self) -> Any:
        return self.settings["hub_oauth"]


def _json_body(request: HTTPServerRequest) -> dict[str, Any]:
    """A page action's body, under the API's rules (an empty one is an empty object)."""
    if not request.body.strip():
        return {}
    body = parse_json_body(request.body, request.headers.get("Content-Type"))
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body


def page_routes(base: str) -> list[tuple[str, type]]:
    """The pages' routes under ``base`` (``/`` or ``/services/slicebroker/``)."""
    names = "|".join(name for name, _ in PAGES)
    return [
        (f"{base}", RootHandler),
        (f"{base}({names})", PageViewHandler),
        (f"{base}ui/fragment/([a-z]+)", FragmentHandler),
        (f"{base}ui/slices/([0-9]{{1,10}})/release", ReleaseHandler),
        (f"{base}ui/slices/([0-9]{{1,10}})/replace", ReplaceHandler),
        (f"{base}ui/nodes/([^/]+)/({'|'.join(NODE_ACTIONS)})", NodeActionHandler),
        (f"{base}ui/projects/([^/]+)", ProjectActionHandler),
        (f"{base}ui/usage.csv", UsageCsvHandler),
        (f"{base}login", LoginHandler),
        (f"{base}logout", LogoutHandler),
        (f"{base}oauth_callback", OAuthCallbackHandler),
    ]
