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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sqlalchemy.exc import OperationalError
from tornado import web

from ...errors import BrokerError, Forbidden, InvalidRequest, NotFound, Unauthorized
from ...orm import DatabaseSchemaError
from ..auth import Identity, parse_authorization
from ..schema import NAME_PATTERN, ref, validate

log = logging.getLogger("slicebroker.service")

#: The largest id a slice can have (a 32-bit signed integer column).
MAX_ID = 2**31 - 1


class MalformedJSON(InvalidRequest):
    code = "invalid_json"


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

    def param(self, name: str) -> Param:
        return next(p for p in self.parameters if p.name == name)


ID_PARAM = Param(
    "id",
    "path",
    {"type": "integer", "minimum": 1, "maximum": MAX_ID},
    "the slice's id",
    required=True,
)
NAME_PARAM = Param(
    "name", "path", {"type": "string", "minLength": 1, "maxLength": 255}, required=True
)
#: An account's name where one is made: as the configuration file allows them.
NEW_NAME_PARAM = Param(
    "name",
    "path",
    {"type": "string", "minLength": 1, "maxLength": 255, "pattern": NAME_PATTERN},
    "letters, digits, '.', '_' and '-', starting with a letter or digit",
    required=True,
)


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


class APIHandler(web.RequestHandler):
    """Base of every API handler. Subclasses set :attr:`operations` and implement them."""

    operations: ClassVar[dict[str, Operation]] = {}

    identity: Identity | None = None
    _counted = False

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

    async def prepare(self) -> None:
        self.settings["in_flight"].enter()
        self._counted = True
        operation = self.operation
        if operation is None:
            raise MethodNotAllowed(f"{self.request.method} is not allowed on {self.request.path}")
        auth = operation.auth
        if auth == "metrics" and not self.settings.get("authenticate_metrics", True):
            auth = "none"
        if auth == "none":
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

    # ---- input -------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        """The request's JSON body, checked against the operation's schema."""
        operation = self.operation
        assert operation is not None and operation.body is not None
        raw = self.request.body
        if not raw.strip():
            if operation.body_required:
                raise InvalidRequest("a JSON body is required")
            return {}
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise MalformedJSON(f"the body is not valid JSON: {_short(err)}") from None
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
        """The slice id in a path; :class:`NotFound` for anything that cannot be one."""
        if not text.isdigit() or not 1 <= int(text) <= MAX_ID:
            raise NotFound(f"no slice {text!r}")
        return int(text)

    # ---- output ------------------------------------------------------------------

    def write_json(self, data: Any, status: int | None = None) -> None:
        if status is not None:
            self.set_status(status)
        self.finish(json.dumps(data, allow_nan=False, separators=(",", ":")))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        status, code, message = _describe_error(exc, status_code, self._reason)
        if status == 405:
            message = f"{self.request.method} is not allowed on {self.request.path}"
            self.set_header("Allow", ", ".join(m.upper() for m in self.operations))
        self.set_status(status)
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.set_header("Cache-Control", "no-store")
        if status == 401:
            self.set_header("WWW-Authenticate", "token")
        self.finish(json.dumps({"error": {"code": code, "message": message}}))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        """Named errors are the caller's doing: one line. Anything else: a traceback."""
        if isinstance(value, BrokerError | web.HTTPError):
            log.debug("%s %s: %s", self.request.method, self.request.path, value)
            return
        if isinstance(value, OperationalError | DatabaseSchemaError):
            log.error(
                "database unavailable during %s %s: %s",
                self.request.method,
                self.request.path,
                _short(value),
            )
            return
        log.error(
            "uncaught exception in %s %s", self.request.method, self.request.path,
            exc_info=(typ, value, tb),
        )  # fmt: skip

    def on_finish(self) -> None:
        if self._counted:
            self._counted = False
            self.settings["in_flight"].leave()

    def on_connection_close(self) -> None:
        waiting = getattr(self, "_waiting", None)
        if waiting is not None and not waiting.done():
            waiting.cancel()


class NotFoundHandler(APIHandler):
    """Every path no route matches: 404 in the error shape, whatever the method."""

    async def prepare(self) -> None:
        raise NotFound(f"no such resource: {self.request.path}")


def _describe_error(exc: BaseException | None, status: int, reason: str) -> tuple[int, str, str]:
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
            f"the query parameter {name!r} must be {expected}, got {raw!r}"
        ) from None
    return raw


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _short(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else err.__class__.__name__
    return text if len(text) <= 200 else text[:197] + "..."
