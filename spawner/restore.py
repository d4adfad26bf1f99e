"""Sessions brought back after a preemption (design.md §3, "Restorable sessions").

A session whose user ticked "Bring it back after a preemption" is started again by
the hub once its server has stopped: with the same options, and ``restores`` naming
the slice that ended, so that the broker queues the new request in the old one's
place. The server starts on the same files (the user's home, or the same volume on
Kubernetes); the kernels start afresh.

The restart goes through the hub's own REST API with a token of the user's, made for
this one call (``servers`` on that user only, expiring in :data:`TOKEN_LIFETIME_S`):
the hub alone knows how to start a server (its proxy route, its pending state), and a
start the user could have made themselves is the only one the hub is asked for.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError

from broker.rounds import Backoff

#: Seconds the one-call token lives: longer than the retries below.
TOKEN_LIFETIME_S = 300
#: Seconds to keep asking while the hub still finishes the stop (it answers 400 then).
RETRY_FOR_S = 120.0


class RestartableServer(Protocol):
    """What a restart needs of the spawner: the hub's user, server name and API."""

    user: Any
    name: str
    hub: Any
    _log_name: str


def ended_by_preemption(slice_: Mapping[str, Any]) -> bool:
    """Whether the session of ``slice_`` (preempting, or ended) comes back from its end:
    a preemption (a drain's included) or its node going down. An idle cull, a release or
    an expiry is not one: a session stopped as idle would queue for GPUs it did not use."""
    return slice_.get("preempt_reason") is not None or slice_.get("end_reason") == "node_down"


def restart_options(user_options: Mapping[str, Any], slice_id: int) -> dict[str, Any]:
    """The options the server is started again with: its own, restoring ``slice_id``."""
    return {**user_options, "restores": slice_id}


def server_path(user: str, server_name: str) -> str:
    """The hub API path of the user's server (the default one when ``server_name`` is '')."""
    base = f"/users/{quote(user, safe='')}"
    return f"{base}/servers/{quote(server_name, safe='')}" if server_name else f"{base}/server"


async def bring_back(
    spawner: RestartableServer,
    options: Mapping[str, Any],
    log: logging.Logger,
    *,
    retry_for: float = RETRY_FOR_S,
) -> bool:
    """Ask the hub to start the server again with ``options``; whether it took the start.

    The hub answers 400 while the stop it is told of is still being finished: asked
    again with backoff for up to ``retry_for`` seconds. Any other refusal is logged and
    ends it (the user can start the session from the hub as always).
    """
    user = spawner.user.name
    try:
        token = spawner.user.new_api_token(
            note=f"slicebroker: bring back {spawner._log_name} after a preemption",
            expires_in=TOKEN_LIFETIME_S,
            scopes=[f"servers!user={user}"],
        )
    except Exception as err:  # the hub's database, or roles that do not allow the scope
        log.error("The hub did not start %s again: no token for it (%s)", spawner._log_name, err)
        return False
    url = spawner.hub.api_url.rstrip("/") + server_path(user, spawner.name)
    body = json.dumps({"user_options": dict(options)})
    backoff = Backoff(initial=0.5, maximum=10.0)
    waited = 0.0
    while True:
        try:
            await AsyncHTTPClient().fetch(
                url,
                method="POST",
                body=body,
                headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
                request_timeout=30,
            )
            log.info("Bringing back %s: the hub is starting it again", spawner._log_name)
            return True
        except HTTPClientError as err:
            text = err.response.body.decode(errors="replace")[:300] if err.response else ""
            if err.code != 400 or waited >= retry_for:
                log.error("The hub did not start %s again: %s %s", spawner._log_name, err, text)
                return False
        except OSError as err:
            if waited >= retry_for:
                log.error("The hub did not start %s again: %s", spawner._log_name, err)
                return False
        except Exception as err:  # nothing to retry: say so, as the task's only report
            log.error("The hub did not start %s again: %s", spawner._log_name, err)
            return False
        pause = backoff.next()
        waited += pause
        await asyncio.sleep(pause)
