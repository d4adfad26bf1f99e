"""Named errors of the broker. Callers match on the class (and ``code``), never on text."""

from __future__ import annotations


class BrokerError(Exception):
    """Base of every error the broker reports to a caller; ``status`` is the HTTP status."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(BrokerError):
    code = "invalid_request"


class InvalidConfig(BrokerError):
    """The configuration is wrong; ``where`` says which key (e.g. ``projects.ml.share``)."""

    code = "invalid_config"

    def __init__(self, message: str, where: str = ""):
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where


class Unauthorized(BrokerError):
    status = 401
    code = "unauthorized"


class Forbidden(BrokerError):
    status = 403
    code = "forbidden"


class NotFound(BrokerError):
    status = 404
    code = "not_found"


class Conflict(BrokerError):
    status = 409
    code = "conflict"
