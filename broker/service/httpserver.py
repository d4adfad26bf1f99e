"""The HTTP server, whose own refusals are JSON too (docs/api.md, "Errors").

tornado answers a request it cannot parse (a header line with a NUL, both
``Content-Length`` and ``Transfer-Encoding``, a bad chunk size, a start line
that is no HTTP/1.x) before any handler sees it, with a bare
``HTTP/1.1 400 Bad Request`` and no body. :class:`JSONErrorServer` gives each
connection's stream a thin wrapper that sends, in that answer's place, a 400 in
the API's error shape, naming what tornado found wrong, then lets tornado close
the connection as it would have.

One refusal stays without an answer: headers longer than the server reads
(``Limits.max_header_read_bytes``, 1 MiB) make tornado's stream close the
socket itself while the client is still sending, and no answer written then
would reach a client whose unread bytes make the close a reset.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tornado import httputil, iostream
from tornado.httpserver import HTTPServer

#: What tornado writes for a request it cannot parse (tornado.http1connection).
BARE_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\n\r\n"
#: The most characters of tornado's reason an answer repeats.
REASON_LIMIT = 200


def bad_request_answer(reason: str) -> bytes:
    """A whole HTTP answer: 400 in the API's error shape, closing the connection."""
    message = f"the request is not valid HTTP/1.1: {reason[:REASON_LIMIT]}"
    body = json.dumps({"error": {"code": "bad_request", "message": message}}).encode()
    head = (
        "HTTP/1.1 400 Bad Request\r\n"
        "Content-Type: application/json; charset=UTF-8\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


class JSONErrorStream:
    """An :class:`~tornado.iostream.IOStream` as tornado's HTTP layer uses it, but for
    the bare 400, which becomes :func:`bad_request_answer`."""

    def __init__(self, stream: iostream.IOStream):
        self._stream = stream

    def write(self, data: bytes | memoryview) -> Any:
        if len(data) == len(BARE_BAD_REQUEST) and bytes(data) == BARE_BAD_REQUEST:
            # tornado writes it while handling the parse error: that error is the reason.
            error = sys.exc_info()[1]
            reason = str(error) if isinstance(error, httputil.HTTPInputError) else "malformed"
            data = bad_request_answer(reason or "malformed")
        return self._stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class JSONErrorServer(HTTPServer):
    """tornado's HTTP server, each connection's stream wrapped in :class:`JSONErrorStream`."""

    def handle_stream(self, stream: iostream.IOStream, address: tuple) -> None:
        # The wrapper is no SSLIOStream, so tornado would take a TLS connection for plain
        # HTTP: the broker serves plain HTTP only (TLS ends at the proxy in front of it).
        super().handle_stream(JSONErrorStream(stream), address)  # type: ignore[arg-type]
