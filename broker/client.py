"""An async client of the broker's HTTP API (design.md §8): for the CLI, the batch
runner, the spawner.

One method per route, each returning the parsed JSON answer. It runs on
tornado's :class:`~tornado.httpclient.AsyncHTTPClient`, so it never blocks the
event loop of the process that uses it (a JupyterHub, say).

Errors are one class, :class:`BrokerAPIError`, with the HTTP ``status`` and
the API's ``code`` and ``message``; callers match on ``code`` (or ``status``),
never on the message. A broker that cannot be reached raises
:class:`BrokerUnreachable` (a ``BrokerAPIError`` with ``status`` 0) once the
retries are spent.

Retries: a call that is safe to repeat (every GET, releases, admin changes,
which all set a state rather than add one) is retried with
exponential backoff, a bounded number of times, when the connection fails or
times out, or when a proxy in front of the broker answers 502/503/504. A
submission (``POST /slices``) is retried the same way: each call of
:meth:`BrokerClient.submit` sends one ``Idempotency-Key`` with all its attempts,
so an attempt that reached the broker but whose answer was lost makes no second
slice; the retry answers the first. A heartbeat is not sent again once it may
have reached the broker: the holder's next heartbeat is its retry. A long-poll
is retried only within its wait, each retry asking what is left of it: its
caller (a session's watch, which heartbeats between long-polls) hears back by
the end of the wait and one timeout, not after every retry's whole wait.

:class:`HeartbeatBatcher` sends the heartbeats of many slices held by one
process (a hub's sessions) together, one request per round trip.

The token is sent in the ``Authorization`` header only; it is never logged
and never part of the client's ``repr``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest, HTTPResponse
from tornado.iostream import StreamClosedError

from .errors import BrokerError

log = logging.getLogger(__name__)

URL_ENV = "SLICEBROKER_URL"
TOKEN_ENV = "SLICEBROKER_TOKEN"
API_PREFIX = "/api/v1"

#: Statuses a proxy in front of the broker answers while the broker restarts.
RETRY_STATUSES = frozenset({502, 503, 504})
#: tornado's status for "no HTTP answer" (connection closed, timeout).
NO_RESPONSE = 599
#: The header that makes a retried submission answer the slice its first attempt made.
IDEMPOTENCY_HEADER = "Idempotency-Key"


def new_idempotency_key() -> str:
    """A fresh, unguessable ``Idempotency-Key``."""
    return uuid.uuid4().hex


class BrokerAPIError(BrokerError):
    """An error answer of the broker: HTTP ``status``, the API's ``code`` and ``message``."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status!r}, {self.code!r}, {self.message!r})"


class BrokerUnreachable(BrokerAPIError):
    """No answer from the broker (refused, reset, timed out) after the retries: status 0."""

    def __init__(self, message: str):
        super().__init__(0, "unreachable", message)


class BrokerClient:
    """The broker API at ``url`` (the broker's base URL, without ``/api/v1``) as ``token``.

    ``url`` and ``token`` default to the ``SLICEBROKER_URL`` and
    ``SLICEBROKER_TOKEN`` environment variables (:class:`ValueError` if neither
    is given). ``timeout`` is the limit of one attempt in seconds (a long-poll
    gets its wait on top). ``retries`` is how many times a call safe to repeat
    is tried again after a connection failure, waiting ``backoff`` seconds,
    then twice that, and so on (at most ``max_backoff``). ``max_clients`` is
    how many requests may be in flight at once (long-polls hold one each).

    Use it from one event loop; :meth:`close` (or ``async with``) frees its connections.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 4,
        backoff: float = 0.25,
        max_backoff: float = 4.0,
        max_clients: int = 10,
    ):
        url = url or os.environ.get(URL_ENV, "")
        token = token or os.environ.get(TOKEN_ENV, "")
        if not url:
            raise ValueError(f"no broker URL: pass one or set {URL_ENV}")
        if not token:
            raise ValueError(f"no API token: pass one or set {TOKEN_ENV}")
        self.url = url.rstrip("/")
        self._token = token
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_clients = max_clients
        self._http: AsyncHTTPClient | None = None

    def __repr__(self) -> str:
        return f"BrokerClient({self.url!r})"

    async def __aenter__(self) -> BrokerClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    # ---- the transport ----------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        idempotent: bool = True,
        timeout: float | None = None,
        parse: bool = True,
        headers: Mapping[str, str] | None = None,
        wait: float | None = None,
    ) -> Any:
        """``method`` on ``{url}/api/v1{path}``; the parsed JSON answer (text if not ``parse``).

        ``params`` left ``None`` are not sent. ``idempotent`` says whether the call
        may be resent after a connection failure (see the module's docstring);
        ``timeout`` replaces the client's for this call; ``headers`` are added.
        ``wait`` makes it a long-poll of that many seconds (the ``wait`` parameter,
        on top of the timeout): a retry asks only what is left of it, and none
        starts once it is over.
        """
        wait_ends = None if wait is None else time.monotonic() + wait
        headers = {
            "Authorization": f"token {self._token}",
            "Accept": "application/json",
            **({"Content-Type": "application/json"} if body is not None else {}),
            **(headers or {}),
        }

        def attempt(delay: float) -> HTTPRequest | None:
            """The request to send in ``delay`` seconds: a retry's (``delay`` above 0)
            is None where a long-poll's wait is over by then."""
            query_params = dict(params or {})
            limit = self.timeout if timeout is None else timeout
            if wait_ends is not None:
                left = wait_ends - time.monotonic() - delay
                if left <= 0 and delay:
                    return None
                query_params["wait"] = _number(round(max(left, 0.0), 3))
                limit += max(left, 0.0)
            query = urlencode({k: v for k, v in query_params.items() if v is not None})
            return HTTPRequest(
                f"{self.url}{API_PREFIX}{path}" + (f"?{query}" if query else ""),
                method=method,
                headers=headers,
                body=None if body is None else json.dumps(body),
                allow_nonstandard_methods=True,  # tornado refuses DELETE/POST bodies otherwise
                connect_timeout=min(limit, self.timeout),
                request_timeout=limit,
            )

        response = await self._fetch(attempt, method, path, idempotent)
        text = response.body.decode("utf-8", "replace") if response.body else ""
        if not parse:
            return text
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            raise BrokerAPIError(
                response.code, "bad_response", f"{method} {path}: the broker's answer is not JSON"
            ) from None

    def _http_client(self) -> AsyncHTTPClient:
        # Made on first use, inside the running event loop it belongs to.
        if self._http is None:
            self._http = AsyncHTTPClient(force_instance=True, max_clients=self.max_clients)
        return self._http

    async def _fetch(
        self,
        attempt: Callable[[float], HTTPRequest | None],
        method: str,
        path: str,
        idempotent: bool,
    ) -> HTTPResponse:
        """The answer to the first of ``attempt``'s requests that gets one, retried as
        the module's docstring says. ``attempt(delay)`` is the request to send in
        ``delay`` seconds; a retry's may be None, where none may start then."""
        what = f"{method} {path}"
        request = attempt(0.0)
        for tries in range(self.retries + 1):
            last = tries == self.retries
            assert request is not None  # the first attempt always goes; a retry checked below
            try:
                return await self._http_client().fetch(request)
            except HTTPClientError as err:
                if err.code == NO_RESPONSE or err.response is None:
                    failure = f"no answer ({err.message or 'connection closed'})"
                    never_sent = False
                elif err.code in RETRY_STATUSES and idempotent:
                    failure = f"HTTP {err.code} from a proxy"
                    never_sent = False
                    if last:
                        raise _api_error(err.response, what) from None
                else:
                    raise _api_error(err.response, what) from None
            except ConnectionRefusedError:
                failure, never_sent = "connection refused", True
            except (OSError, StreamClosedError) as err:
                failure, never_sent = f"connection failed ({err})", False
            if not (idempotent or never_sent):
                raise BrokerUnreachable(
                    f"{what} to the broker at {self.url}: {failure}; "
                    "it may or may not have been applied"
                )
            if last:
                raise BrokerUnreachable(f"cannot reach the broker at {self.url}: {failure}")
            delay = min(self.backoff * 2**tries, self.max_backoff)
            request = attempt(delay)
            if request is None:  # a long-poll whose wait is over: its caller goes on
                raise BrokerUnreachable(
                    f"{what}: no answer from the broker at {self.url} within the wait: {failure}"
                )
            log.warning("%s: %s; retrying in %.2gs", what, failure, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # the loop returns or raises

    # ---- who am I ---------------------------------------------------------------

    async def whoami(self) -> dict[str, Any]:
        """``{name, groups, admin, agent, projects}`` of the token's owner."""
        return await self.request("GET", "/whoami")

    async def limits(self) -> dict[str, Any]:
        """The terms requests are held to (``GET /limits``): lease, grace period, the
        protected period's cap, the debug lane's limits, project caps, defaults per kind."""
        return await self.request("GET", "/limits")

    # ---- slices -------------------------------------------------------------------

    async def submit(
        self,
        project: str,
        gpus: int,
        kind: str = "batch",
        *,
        min_runtime: float | str | None = None,
        gpu_type: str | None = None,
        resumable: bool | None = None,
        max_runtime: float | str | None = None,
        priority: int | None = None,
        user: str | None = None,
        groups: list[str] | None = None,
        idempotency_key: str | None = None,
        restores: int | None = None,
    ) -> dict[str, Any]:
        """Request a slice (``POST /slices``); the new slice, ``pending``.

        Terms left ``None`` are not sent: the broker's defaults for ``kind``
        apply. Durations are seconds or text such as ``"15m"``. ``user`` and
        ``groups`` submit on someone's behalf (agents and admins only).
        ``idempotency_key`` (default: a new random one per call) is sent with
        every attempt; a caller that retries the call itself may pass the same
        key again to get the slice its first call made. ``restores`` brings back a
        session a preemption ended, in its place in the queue.
        """
        body = {
            "project": project,
            "gpus": gpus,
            "kind": kind,
            "min_runtime": min_runtime,
            "gpu_type": gpu_type,
            "resumable": resumable,
            "max_runtime": max_runtime,
            "priority": priority,
            "user": user,
            "groups": groups,
            "restores": restores,
        }
        body = {key: value for key, value in body.items() if value is not None}
        key = idempotency_key or new_idempotency_key()
        return await self.request("POST", "/slices", body, headers={IDEMPOTENCY_HEADER: key})

    async def list_slices(
        self, *, state: str | None = None, project: str | None = None, user: str | None = None
    ) -> list[dict[str, Any]]:
        """Slices matching every filter given (``GET /slices``), oldest first."""
        params = {"state": state, "project": project, "user": user}
        return (await self.request("GET", "/slices", params=params))["slices"]

    async def get_slice(
        self, slice_id: int, *, wait: float | None = None, state: str | None = None
    ) -> dict[str, Any]:
        """The slice; with ``wait`` and ``state``, a long-poll (see :meth:`wait_for_change`)."""
        path = f"/slices/{int(slice_id)}"
        return await self.request("GET", path, params={"state": state}, wait=wait)

    async def wait_for_change(
        self, slice_id: int, known_state: str, timeout: float
    ) -> dict[str, Any]:
        """The slice as soon as its state is not ``known_state``, or after ``timeout`` seconds.

        Long-polls the broker (``GET /slices/{id}?wait=&state=``), so nothing is
        asked while nothing changes; polls again if the broker answered early
        with the state unchanged (a broker may cap its wait). The answer may still
        be in ``known_state`` when the time is up: check ``state``.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            slice_ = await self.get_slice(slice_id, wait=max(left, 0.0), state=known_state)
            if slice_["state"] != known_state or left <= 0 or deadline - time.monotonic() < 0.05:
                return slice_

    async def extend_protection(self, slice_id: int, by: float | str) -> dict[str, Any]:
        """Protect the slice ``by`` longer (seconds or a duration such as ``"30m"``;
        ``POST /slices/{id}/protection``); the slice."""
        body = {"extend_by": by}
        return await self.request(
            "POST", f"/slices/{int(slice_id)}/protection", body, idempotent=False
        )

    async def checkpoint(self, slice_id: int) -> dict[str, Any]:
        """Report that the slice's work is saved now (``POST /slices/{id}/checkpoint``);
        the slice."""
        return await self.request("POST", f"/slices/{int(slice_id)}/checkpoint", {})

    async def heartbeat(self, slice_id: int) -> dict[str, Any]:
        """Extend the slice's lease (``POST /slices/{id}/heartbeat``); the slice.

        Not sent again once it may have reached the broker: one that timed out may
        still be read by a broker that is behind, and the holder's next heartbeat is
        the retry (the lease does not run out while the broker answers late).
        """
        path = f"/slices/{int(slice_id)}/heartbeat"
        return await self.request("POST", path, {}, idempotent=False)

    async def heartbeats(self, slice_ids: Sequence[int]) -> dict[str, Any]:
        """Extend the leases of many slices in one request (``POST /heartbeats``):
        ``{"slices": [...], "not_found": [ids]}``. Not sent again once it may have
        reached the broker, as :meth:`heartbeat`."""
        body = {"slices": [int(slice_id) for slice_id in slice_ids]}
        return await self.request("POST", "/heartbeats", body, idempotent=False)

    async def release(self, slice_id: int) -> dict[str, Any]:
        """Release a held slice or cancel a pending one (``DELETE /slices/{id}``)."""
        return await self.request("DELETE", f"/slices/{int(slice_id)}")

    async def events(self, slice_id: int) -> list[dict[str, Any]]:
        """The slice's state changes, oldest first: ``{at, from_state, to_state, reason}``."""
        return (await self.request("GET", f"/slices/{int(slice_id)}/events"))["events"]

    async def alternatives(self, slice_id: int) -> dict[str, Any]:
        """What would start a waiting slice sooner (``GET /slices/{id}/alternatives``)."""
        return await self.request("GET", f"/slices/{int(slice_id)}/alternatives")

    async def expected_starts(
        self,
        project: str,
        kind: str = "batch",
        min_runtime: float | str | None = None,
        *,
        user: str | None = None,
        groups: Iterable[str] | None = None,
    ) -> dict[str, Any]:
        """When a new request for ``project`` would start, by GPU type and size, before it
        is made (``GET /expected-starts``); an agent names the ``user`` and ``groups``."""
        params = {
            "project": project,
            "kind": kind,
            "min_runtime": None if min_runtime is None else str(min_runtime),
            "user": user,
            "groups": None if groups is None else ",".join(groups),
        }
        return await self.request("GET", "/expected-starts", params=params)

    async def replace(self, slice_id: int, fields: Mapping[str, Any]) -> dict[str, Any]:
        """Withdraw a waiting slice for the same request with ``fields`` (an alternative's
        ``project, gpus, gpu_type, kind, min_runtime``), in one step; the new slice
        (``POST /slices/{id}/replace``). Not retried: a second try would find the
        slice withdrawn by the first."""
        return await self.request(
            "POST", f"/slices/{int(slice_id)}/replace", dict(fields), idempotent=False
        )

    # ---- projects -----------------------------------------------------------------

    async def projects(self) -> list[dict[str, Any]]:
        """The project tree, parents before children (``GET /projects``)."""
        return (await self.request("GET", "/projects"))["projects"]

    async def usage(
        self,
        project: str,
        *,
        since: float | None = None,
        until: float | None = None,
        by: str | None = None,
        format: str = "json",
    ) -> Any:
        """Charged usage of ``project`` in ``[since, until)`` (epoch seconds).

        JSON (parsed) or, with ``format="csv"``, the CSV text as the broker writes it.
        """
        params = {"since": _number(since), "until": _number(until), "by": by, "format": format}
        path = f"/projects/{_segment(project)}/usage"
        return await self.request("GET", path, params=params, parse=format != "csv")

    async def put_project(
        self,
        name: str,
        *,
        share: float,
        parent: str | None = None,
        users: list[str] | None = None,
        groups: list[str] | None = None,
    ) -> dict[str, Any]:
        """Create or change an account (admin): ``PUT /projects/{name}``; the account's row.

        ``parent`` ``None`` makes it a top-level account; ``users``/``groups``
        replace the members when given.
        """
        body: dict[str, Any] = {"share": share, "parent": parent}
        if users is not None:
            body["users"] = users
        if groups is not None:
            body["groups"] = groups
        return await self.request("PUT", f"/projects/{_segment(name)}", body)

    async def delete_project(self, name: str) -> dict[str, Any]:
        """Delete an account (admin): ``DELETE /projects/{name}``; the event recording it."""
        return await self.request("DELETE", f"/projects/{_segment(name)}")

    async def apply_projects(
        self, projects: list[dict[str, Any]], *, dry_run: bool = False
    ) -> dict[str, Any]:
        """Replace the project tree (admin): ``PUT /projects``; ``{"changes", "applied"}``.

        Each project: ``name, share, parent, users, groups``; ``dry_run`` only
        answers the changes.
        """
        params = {"dry_run": "true"} if dry_run else None
        return await self.request("PUT", "/projects", {"projects": projects}, params=params)

    async def project_events(self, project: str | None = None) -> list[dict[str, Any]]:
        """The changes of the project tree, oldest first (admin): ``GET /projects/events``."""
        params = {"project": project} if project is not None else None
        return (await self.request("GET", "/projects/events", params=params))["events"]

    # ---- nodes ----------------------------------------------------------------------

    async def nodes(self) -> list[dict[str, Any]]:
        """Every node with its state and GPUs held (``GET /nodes``)."""
        return (await self.request("GET", "/nodes"))["nodes"]

    async def drain(self, node: str, reason: str | None = None) -> dict[str, Any]:
        """Stop new grants on ``node``; its slices leave as their contracts end (admin)."""
        return await self._node_action(node, "drain", reason)

    async def undrain(self, node: str) -> dict[str, Any]:
        """Put ``node`` back in service (admin)."""
        return await self._node_action(node, "undrain", None)

    async def down(self, node: str, reason: str | None = None) -> dict[str, Any]:
        """Mark ``node`` down: its slices end at once (admin)."""
        return await self._node_action(node, "down", reason)

    async def _node_action(self, node: str, action: str, reason: str | None) -> dict[str, Any]:
        body = {} if reason is None else {"reason": reason}
        return await self.request("POST", f"/nodes/{_segment(node)}/{action}", body)

    # ---- metrics ----------------------------------------------------------------------

    async def metrics(self) -> str:
        """The Prometheus metrics, as text."""
        return await self.request("GET", "/metrics", parse=False)


def _api_error(response: HTTPResponse, what: str) -> BrokerAPIError:
    """The :class:`BrokerAPIError` an error answer stands for."""
    status = response.code
    try:
        error = json.loads(response.body or b"")["error"]
        return BrokerAPIError(status, str(error["code"]), str(error["message"]))
    except (ValueError, KeyError, TypeError):
        reason = response.reason or "error"
        return BrokerAPIError(status, f"http_{status}", f"{what}: HTTP {status} {reason}")


def _segment(name: str) -> str:
    """``name`` quoted as one path segment."""
    return quote(str(name), safe="")


def _number(value: float | None) -> str | None:
    return None if value is None else repr(value)


#: The most slices :class:`HeartbeatBatcher` names in one request (the broker's limit).
MOST_HEARTBEATS = 10_000


class HeartbeatBatcher:
    """The heartbeats of many slices from one event loop, sent together.

    :meth:`beat` of a slice joins the request being gathered; one request is out at
    a time, and the heartbeats asked for while it is out go in the next, sent as it
    is answered. A hub's sessions so cost the broker one heartbeat request per round
    trip however many they are, and fewer, larger ones exactly while the broker
    answers slowly (as a group commit shares one write). Each caller gets its own
    slice, or its own error. A broker without ``POST /heartbeats`` (older than this
    client) is sent one request per slice instead.
    """

    def __init__(self, client: BrokerClient, most: int = MOST_HEARTBEATS) -> None:
        self.client = client
        self.most = most
        self.requests = 0  # requests sent, for the tests and the benchmarks
        self._gathered: dict[int, list[asyncio.Future]] = {}
        self._sending: asyncio.Task | None = None
        self._one_by_one = False

    @property
    def gathered(self) -> list[int]:
        """The slices whose heartbeats wait for the next request."""
        return list(self._gathered)

    async def beat(self, slice_id: int) -> dict[str, Any]:
        """Heartbeat ``slice_id``; the slice, as :meth:`BrokerClient.heartbeat` answers."""
        answered = asyncio.get_running_loop().create_future()
        self._gathered.setdefault(int(slice_id), []).append(answered)
        if self._sending is None or self._sending.done():
            self._sending = asyncio.ensure_future(self._send_gathered())
        return await answered

    async def _send_gathered(self) -> None:
        while self._gathered:
            ids = list(self._gathered)[: self.most]
            batch = {slice_id: self._gathered.pop(slice_id) for slice_id in ids}
            self.requests += 1
            try:
                answers = await self._send(ids)
            except Exception as err:  # every heartbeat of the request failed alike
                answers = dict.fromkeys(ids, err)
            for slice_id, waiting in batch.items():
                answer = answers.get(slice_id) or BrokerAPIError(
                    404, "not_found", f"no slice {slice_id}"
                )
                for future in waiting:
                    if future.done():  # its caller gave up
                        continue
                    if isinstance(answer, BaseException):
                        future.set_exception(answer)
                    else:
                        future.set_result(answer)

    async def _send(self, ids: list[int]) -> dict[int, dict[str, Any] | BaseException]:
        """Each id's slice, or its error; absent: no slice of the caller's."""
        if not self._one_by_one:
            try:
                answer = await self.client.heartbeats(ids)
            except BrokerAPIError as err:
                if err.status != 404:
                    raise
                self._one_by_one = True  # no such route: a broker older than this client
            else:
                return {s["id"]: s for s in answer["slices"]}
        beats = [self.client.heartbeat(slice_id) for slice_id in ids]
        answers = await asyncio.gather(*beats, return_exceptions=True)
        return dict(zip(ids, answers, strict=True))
