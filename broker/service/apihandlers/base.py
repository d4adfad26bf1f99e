"""The base API handler: authentication, JSON in and out, errors as JSON.

Every handler declares its operations (:class:`Operation`): parameters, body
schema, responses and who may call it. The same declarations build the
OpenAPI document and check each request, so the two always agree.

Errors are typed (:class:`~broker.errors.BrokerError` subclasses carrying
``status`` and ``code``) and written by one method, :meth:`APIHandler.write_error`,
as ``{"error": {"code": ..., "message": ...}}``. Unexpected exceptions are
logged with their traceback and answered 500 in the same shape; a traceback is
never sent to a client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sqlalchemy.exc import OperationalError
from tornado import web
from tornado.httputil import HTTPServerRequest

from ...errors import BrokerError, Forbidden, InvalidRequest, NotFound, Unauthorized
from ...orm import DatabaseSchemaError
from ...store import Principal
from ..auth import parse_authorization
from ..schema import NAME_PATTERN, NAME_TEXT, ref, validate

log = logging.getLogger("slicebroker.service")
access_log = logging.getLogger("tornado.access")

#: The largest id a slice can have (a 32-bit signed integer column).
MAX_ID = 2**31 - 1
#: A slice id as a path may give it: ASCII digits, no longer than MAX_ID.
ID_PATTERN = re.compile(rf"[0-9]{{1,{len(str(MAX_ID))}}}", re.ASCII)
#: The most characters of a caller's input an error message or a log line repeats.
ECHO_LIMIT = 200
#: The longest error message answered or logged, in characters.
MESSAGE_LIMIT = 1000
#: The one media type of request bodies.
JSON_MEDIA_TYPE = "application/json"


class MalformedJSON(InvalidRequest):
    code = "invalid_json"


class UnsupportedMediaType(BrokerError):
    status = 415
    code = "unsupported_media_type"


class MethodNotAllowed(BrokerError):
    status = 405
    code = "method_not_allowed"


#: Error codes of statuses tornado raises itself.
HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    500: "internal_error",
    503: "unavailable",
}


# ---- operation declarations -------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """A path or query parameter; ``schema`` is an OpenAPI schema of its value."""

    name: str
    where: str  # "path" or "query"
    schema: Mapping[str, Any]
    description: str = ""
    required: bool = False


@dataclass(frozen=True)
class Operation:
    """One method of one route, as the OpenAPI document shows it and the handler enforces it.

    ``auth``: ``"user"`` (any valid token), ``"admin"`` (admin tokens only),
    ``"none"``, or ``"metrics"`` (a token unless the service's
    ``authenticate_metrics`` is off). ``body`` names the request body's component
    schema. ``ok`` is the success status; ``content`` maps its media types to
    component names (or ``None`` for plain text). ``errors`` lists the error
    statuses it documents besides 401/403 (implied by ``auth``).
    """

    summary: str
    description: str = ""
    auth: str = "user"
    parameters: tuple[Param, ...] = ()
    body: str | None = None
    body_required: bool = True
    ok: int = 200
    ok_description: str = "OK"
    content: Mapping[str, str | None] = field(default_factory=dict)
    errors: tuple[int, ...] = ()
    #: Refused with 503 ``overloaded`` while the database thread is behind (the
    #: runner's ``shed_after``); heartbeats and releases never are: a lost heartbeat
    #: ends a slice, a release frees what the queue waits for.
    shed: bool = True

    def param(self, name: str) -> Param:
        return next(p for p in self.parameters if p.name == name)


ID_PARAM = Param(
    "id",
    "path",
    {"type": "integer", "minimum": 1, "maximum": MAX_ID},
    "the slice's id",
    required=True,
)
NAME_PARAM = Param("name", "path", NAME_TEXT, required=True)
#: An account's name where one is made: as the configuration file allows them.
NEW_NAME_PARAM = Param(
    "name",
    "path",
    {"type": "string", "minLength": 1, "maxLength": 255, "pattern": NAME_PATTERN},
    "letters, digits, '.', '_' and '-', starting with a letter or digit",
    required=True,
)


@dataclass(frozen=True)
class Limits:
    """What a request may weigh, in bytes (see :class:`APIHandler`).

    ``max_header_bytes``: the headers, answered 431 above it (the HTTP server
    reads at most ``max_header_read_bytes`` of headers and drops the connection
    beyond). ``max_body_bytes``: the body, answered 413 above it.
    ``max_drain_bytes``: how much of a body over the limit is still read, so that
    the client is there to read the 413; beyond it the connection is closed.
    """

    max_header_bytes: int = 64 * 1024
    max_header_read_bytes: int = 1024 * 1024
    max_body_bytes: int = 1024 * 1024
    max_drain_bytes: int = 16 * 1024 * 1024


def slice_id_in_path(text: str) -> int:
    """The slice id in a path (the API's or a page's); :class:`NotFound` for anything
    that cannot be one.

    Only ASCII digits, at most as many as :data:`MAX_ID` has: ``str.isdigit``
    and ``int`` also take other scripts' digits (``'١'`` is 1) and superscripts
    (which ``int`` then refuses), and a huge number costs time to convert.
    """
    if ID_PATTERN.fullmatch(text) is None or not 1 <= int(text) <= MAX_ID:
        raise NotFound(f"no slice {bounded(text)!r}")
    return int(text)


# ---- the handler --------------------------------------------------------------------


class InFlight:
    """Counts the requests being handled, so that a stopping service can let them finish."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def idle(self) -> None:
        """Return once no request is being handled."""
        await self._idle.wait()


class PayloadTooLarge(BrokerError):
    status = 413
    code = "payload_too_large"


class HeadersTooLarge(BrokerError):
    status = 431
    code = "headers_too_large"


@web.stream_request_body
class APIHandler(web.RequestHandler):
    """Base of every API handler. Subclasses set :attr:`operations` and implement them.

    The body is streamed in (:meth:`data_received`) so that the handler, not the
    HTTP server, decides what is too large and can say so: a body over
    ``max_body_bytes`` is read to its end but not kept, then answered 413 in the
    error shape (a client that is still sending would otherwise see its
    connection reset instead of an answer). One announced as longer than
    ``max_drain_bytes`` is answered 413 at once, without being read.
    """

    operations: ClassVar[dict[str, Operation]] = {}

    identity: Principal | None = None
    _counted = False
    _prepared = False
    _body_size = 0

    def initialize(self) -> None:
        self._chunks: list[bytes] = []

    @property
    def runner(self):
        return self.settings["runner"]

    @property
    def broker(self):
        return self.settings["runner"].broker

    @property
    def operation(self) -> Operation | None:
        return self.operations.get(self.request.method.lower())

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.set_header("Cache-Control", "no-store")

    def check_size(self) -> None:
        """Refuse headers or an announced body over the limits (431, 413)."""
        limits = self.settings["limits"]
        header_bytes = sum(len(k) + len(v) + 4 for k, v in self.request.headers.get_all())
        if header_bytes > limits.max_header_bytes:
            raise HeadersTooLarge(
                f"the request's headers are {header_bytes} bytes; the limit is "
                f"{limits.max_header_bytes}"
            )
        announced = self.request.headers.get("Content-Length", "")
        if (
            announced.isascii()
            and announced.isdigit()
            and (len(announced) > 18 or int(announced) > limits.max_drain_bytes)
        ):
            raise PayloadTooLarge(
                f"the body is {bounded(announced, 20)} bytes; the limit is {limits.max_body_bytes}"
            )

    def data_received(self, chunk: bytes) -> None:
        """Keep the body up to the limit; past the drain limit, answer 413 now."""
        limits = self.settings["limits"]
        self._body_size += len(chunk)
        if self._body_size <= limits.max_body_bytes:
            self._chunks.append(chunk)
            return
        self._chunks.clear()
        if self._body_size > limits.max_drain_bytes and not self._finished:
            # A chunked body without end: answer and let the connection close.
            self.send_error(413, exc_info=(PayloadTooLarge, self._too_large(), None))

    def _too_large(self) -> PayloadTooLarge:
        limit = self.settings["limits"].max_body_bytes
        return PayloadTooLarge(f"the body is over {limit} bytes; the limit is {limit}")

    async def prepare(self) -> None:
        self.settings["in_flight"].enter()
        self._counted = True
        self.check_size()
        operation = self.operation
        if operation is None:
            raise MethodNotAllowed(
                f"{self.request.method} is not allowed on {bounded(self.request.path)}"
            )
        if operation.shed:
            self.settings["runner"].check_load()  # before any work of its own is queued
        auth = operation.auth
        if auth == "metrics" and not self.settings.get("authenticate_metrics", True):
            auth = "none"
        if auth == "none":
            self._prepared = True
            return
        token = parse_authorization(self.request.headers.get("Authorization"))
        if token is None:
            raise Unauthorized("authentication required: send 'Authorization: token <token>'")
        self.identity = await self.settings["authenticator"].authenticate(token)
        if self.identity is None:
            raise Unauthorized("invalid or revoked token")
        if auth == "admin" and not self.identity.admin:
            raise Forbidden(
                f"only admins may {operation.summary[0].lower()}{operation.summary[1:]}"
            )
        self._prepared = True

    # ---- input -------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        """The request's JSON body, checked against the operation's schema."""
        operation = self.operation
        assert operation is not None and operation.body is not None
        if self._body_size > self.settings["limits"].max_body_bytes:
            raise self._too_large()
        raw = b"".join(self._chunks)
        if not raw.strip():
            if operation.body_required:
                raise InvalidRequest("a JSON body is required")
            return {}
        data = parse_json_body(raw, self.request.headers.get("Content-Type"))
        validate(data, ref(operation.body), "body")
        return data

    def params(self) -> dict[str, Any]:
        """The operation's query parameters that were given, converted and checked."""
        operation = self.operation
        assert operation is not None
        values: dict[str, Any] = {}
        for param in operation.parameters:
            if param.where != "query":
                continue
            raw = self._query_values(param.name)
            if not raw:
                if param.required:
                    raise InvalidRequest(f"the query parameter {param.name!r} is required")
                continue
            schema = param.schema
            if schema.get("type") == "array":
                value: Any = [_convert(item, schema["items"], param.name) for item in raw]
            else:
                value = _convert(raw[-1], schema, param.name)
            validate(value, schema, f"the query parameter {param.name!r}")
            values[param.name] = value
        return values

    def _query_values(self, name: str) -> list[str]:
        """A query parameter's values exactly as sent (tornado's getters strip them and
        blank out control characters, which would make the checks see another value)."""
        try:
            return [v.decode("utf-8") for v in self.request.query_arguments.get(name, [])]
        except UnicodeDecodeError:
            raise InvalidRequest(f"the query parameter {name!r} is not UTF-8") from None

    def path_param(self, name: str, value: str) -> str:
        """A path parameter, checked against the operation's schema for it."""
        operation = self.operation
        assert operation is not None
        validate(value, operation.param(name).schema, f"the path parameter {name!r}")
        return value

    def slice_id(self, text: str) -> int:
        """The slice id in a path (:func:`slice_id_in_path`)."""
        return slice_id_in_path(text)

    # ---- output ------------------------------------------------------------------

    def write_json(self, data: Any, status: int | None = None) -> None:
        if status is not None:
            self.set_status(status)
        self.finish(json.dumps(data, allow_nan=False, separators=(",", ":")))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        status, code, message = describe_error(exc, status_code, self._reason)
        # A message may quote what the caller sent; it never repeats all of it.
        message = bounded(message, MESSAGE_LIMIT)
        if status == 405:
            message = f"{self.request.method} is not allowed on {bounded(self.request.path)}"
            self.set_header("Allow", ", ".join(m.upper() for m in self.operations))
        self.set_status(status)  # send_error has reset the headers to the defaults: JSON, no-store
        if status == 401:
            self.set_header("WWW-Authenticate", "token")
        retry_after = getattr(exc, "retry_after", None)
        if retry_after is not None:
            self.set_header("Retry-After", str(math.ceil(retry_after)))
        if not self._prepared:
            # Refused before its body was read: tornado closes the connection after this
            # answer, and a client that knows it will not send its next request on it.
            self.set_header("Connection", "close")
        self.finish(json.dumps({"error": {"code": code, "message": message}}))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        log_failure(self.request, typ, value, tb)

    def on_finish(self) -> None:
        leave_in_flight(self)

    def on_connection_close(self) -> None:
        super().on_connection_close()  # fails a body still being streamed in
        waiting = getattr(self, "_waiting", None)
        if waiting is not None and not waiting.done():
            waiting.cancel()
        leave_in_flight(self)


def leave_in_flight(handler: Any) -> None:
    """Count ``handler``'s request out of those in flight once, when it finishes or its
    connection closes first: a request the HTTP layer cuts off after its headers (a
    malformed body, say) never finishes, and would hold a stopping service for its
    whole stop timeout."""
    if handler._counted:
        handler._counted = False
        handler.settings["in_flight"].leave()


class NotFoundHandler(APIHandler):
    """Every path no route matches: 404 in the error shape, whatever the method."""

    async def prepare(self) -> None:
        self.check_size()
        raise NotFound(f"no such resource: {bounded(self.request.path)}")


def log_request(handler: web.RequestHandler) -> None:
    """tornado's access log line, with the request's URI bounded: a caller may send one
    of any length, and the log must not repeat it whole."""
    status = handler.get_status()
    level = logging.INFO if status < 400 else logging.WARNING if status < 500 else logging.ERROR
    request = handler.request
    access_log.log(
        level,
        "%d %s %s (%s) %.2fms",
        status,
        request.method,
        bounded(request.uri or ""),
        request.remote_ip,
        1000.0 * request.request_time(),
    )


def log_failure(request: HTTPServerRequest, typ: Any, value: Any, tb: Any) -> None:
    """Log an exception a request ended with. Named errors are the caller's doing: one
    line. The database out of reach: one line. Anything else: a traceback."""
    if isinstance(value, BrokerError | web.HTTPError):
        log.debug(
            "%s %s: %s",
            request.method,
            bounded(request.path),
            bounded(str(value), MESSAGE_LIMIT),
        )
        return
    if isinstance(value, OperationalError | DatabaseSchemaError):
        log.error(
            "database unavailable during %s %s: %s", request.method, request.path, _short(value)
        )
        return
    log.error(
        "uncaught exception in %s %s", request.method, request.path, exc_info=(typ, value, tb)
    )


def describe_error(exc: BaseException | None, status: int, reason: str) -> tuple[int, str, str]:
    """``(status, code, message)`` answering ``exc`` (``status`` and ``reason``: what
    tornado was about to send); never a traceback's text."""
    if isinstance(exc, BrokerError):
        return exc.status, exc.code, exc.message
    if isinstance(exc, web.HTTPError):
        message = exc.log_message % exc.args if exc.log_message and exc.args else exc.log_message
        return exc.status_code, HTTP_CODES.get(exc.status_code, "error"), message or reason
    if isinstance(exc, OperationalError | DatabaseSchemaError):
        return 503, "database_unavailable", "the database is unavailable; try again shortly"
    if status < 500 and exc is None:
        return status, HTTP_CODES.get(status, "error"), reason
    return 500, "internal_error", "internal error; the broker's log has the details"


def _convert(raw: str, schema: Mapping[str, Any], name: str) -> Any:
    kind = schema.get("type")
    try:
        if kind == "integer":
            return int(raw)
        if kind == "number":
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError(raw)
            return value
        if kind == "boolean":
            if raw.lower() not in ("true", "false"):
                raise ValueError(raw)
            return raw.lower() == "true"
    except ValueError:
        expected = {"integer": "a whole number", "number": "a number"}.get(kind, "true or false")
        raise InvalidRequest(
            f"the query parameter {name!r} must be {expected}, got {bounded(raw, 100)!r}"
        ) from None
    return raw


def bounded(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` cut to ``limit`` characters (with how many were left out), for echoing
    a caller's input in an error or a log line without repeating all of it."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def parse_json_body(raw: bytes, content_type: str | None) -> Any:
    """A request's JSON body, parsed strictly (docs/api.md, "Request bodies").

    The body must be sent as ``application/json`` (:class:`UnsupportedMediaType`
    otherwise: a form or ``text/plain`` post can come from any site's page) and be
    UTF-8 JSON with no key twice in an object (:class:`MalformedJSON`: parsers
    disagree on which of two keys wins, so a proxy or a log could read another
    request than the broker does).
    """
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        sent = f"Content-Type {bounded(content_type, 100)!r}" if content_type else "no Content-Type"
        raise UnsupportedMediaType(
            f"a request body must be JSON sent as Content-Type: {JSON_MEDIA_TYPE}; got {sent}"
        )
    try:
        return json.loads(
            raw.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_unique_keys
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise MalformedJSON(f"the body is not valid JSON: {_short(err)}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"the key {bounded(key, 100)!r} appears twice in one object")
        seen.add(key)
    return dict(pairs)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _short(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else err.__class__.__name__
    return text if len(text) <= 200 else text[:197] + "..."
