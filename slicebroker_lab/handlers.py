"""The server extension's routes: the session's GPU slice, and what the session last did.

``GET <base_url>slicebroker/session``: the session's GPU slice, for the Lab extension.

The handler reads the slice from the broker with the session's own token (so it
sees exactly what its owner may see) and answers one JSON object::

    {"slice_id": 7, "project": "vision", "gpus": 2, "gpu_type": "h100",
     "nodes": ["gpu-3"], "state": "granted", "protected_until": 1764575662.0,
     "kept_to_end": null, "preempt_deadline": null, "preempt_reason": null, "end_reason": null,
     "charged_gpu_seconds": 4680.0, "cost": "1.30 GPU-h", "now": 1764573142.5,
     "cull_warning": null, "broker_pages": "/services/slicebroker/"}

Times are epoch seconds; ``now`` is the server's clock, so that the page can
count down without trusting the browser's. ``cull_warning`` is set while the
session, idle, is close to a limit of the hub's idle rule (see
:func:`cull_warning`). ``kept_to_end`` is set, in words, once the slice has been
preempted as many times as the broker's preemption budget allows: no one preempts it
again; ``budget_left``, while a session that comes back is being preempted, what its
budget still allows. Errors have the broker API's shape,
``{"error": {"code": ..., "message": ...}}``: 404 ``no_slice`` when the
session has no slice (not started by the broker's spawner), 502
``broker_unavailable`` when the broker does not answer or refuses. ``activity``
is the answer of the next route; ``extend_protection_by`` the seconds of
protection ``POST slicebroker/protection`` adds (0: not offered).

``GET <base_url>slicebroker/activity``: what the session last did
(:mod:`slicebroker_lab.activity`): its idle seconds, kernels busy, and its GPUs'
utilisation and memory. The hub's spawner reads it for the idle rule, with the
server's own token. ``POST`` with ``{"keep": true}`` is Lab's "Keep my
session": it counts as activity now, and the server logs it.

``POST <base_url>slicebroker/protection``: Lab's "Extend protection": asks the
broker, with the session's token, to protect the slice ``extend_protection_by``
longer (``POST /slices/{id}/protection``); a refusal (past the contract's cap)
comes back as the broker's 409 and its message.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.ioloop import IOLoop, PeriodicCallback
from traitlets import Bool, Float, Unicode
from traitlets.config import Configurable

from broker.budget import coming_back_text, kept_text, kept_to_end, preemptions_left
from broker.client import TOKEN_ENV, URL_ENV, BrokerAPIError, BrokerClient
from broker.units import duration_text, gpu_hours

from . import CULL_ENV, RESTORE_ENV, RESTORES_ENDED_ENV, RESTORES_ENV
from .activity import SessionActivity

SLICE_ENV = "SLICEBROKER_SLICE_ID"
GPU_TYPE_ENV = "SLICEBROKER_GPU_TYPE"
#: Where the broker's web pages are, under the hub's base URL.
PAGES_PATH = "services/slicebroker/"
#: Where the server keeps the broker's preemption budget once read.
BUDGET_KEY = "slicebroker_preemption_budget"


class SliceBrokerLab(Configurable):
    """Settings of the ``slicebroker/session`` endpoint (``c.SliceBrokerLab.*``)."""

    cull_warning = Float(
        600.0,
        help="""Seconds before the session could be stopped as idle from which Lab warns
        (0: never warn). The warning says the session *may* stop: the hub stops it only
        if, by then, a waiting request could use its GPUs (or it is past its protection
        and idle for the longer limit).""",
    ).tag(config=True)

    broker_timeout = Float(
        10.0,
        help="Seconds one read of the slice from the broker may take before Lab is told "
        "the broker is unavailable.",
    ).tag(config=True)

    extend_protection_by = Float(
        1800.0,
        help="""Seconds of protection Lab's idle warning offers to add ("Extend protection
        by 30 min"; 0: not offered). The broker bounds it as a new contract (its
        max_min_runtime from the grant) and says so when it refuses. The session stays
        charged from its grant to its end either way.""",
    ).tag(config=True)

    gpu_sample_interval = Float(
        10.0,
        help="""Seconds between two readings of the session's GPUs (0: never read them, and
        GPU work does not count as activity). Each reading runs NVML or ``nvidia-smi``
        once, in a thread; the driver's utilisation covers its own last 1/6 s to 1 s, so a
        shorter interval catches more of a bursty GPU load, at that cost.""",
    ).tag(config=True)

    gpu_busy_percent = Float(
        1.0,
        help="""Utilisation (percent) at or above which one of the session's GPUs counts
        as busy, and so the session as active. Memory held with nothing running is not
        work. A higher value treats light GPU use (a dashboard, a small model served
        now and then) as idle.""",
    ).tag(config=True)

    use_nvml = Bool(
        True,
        help="""Read the GPUs through NVML (``nvidia-ml-py``) where the driver's library
        loads; else, and when off, through ``nvidia-smi``.""",
    ).tag(config=True)

    nvidia_smi = Unicode(
        "nvidia-smi",
        help="The ``nvidia-smi`` to run where NVML does not load (a name on PATH or a path).",
    ).tag(config=True)


def cull_limits(env: Mapping[str, str]) -> dict[str, float]:
    """The hub's idle limits from the session's environment (seconds; absent or 0: off)."""
    limits = {}
    for name, variable in CULL_ENV.items():
        try:
            limits[name] = max(float(env.get(variable) or 0), 0.0)
        except ValueError:
            limits[name] = 0.0
    return limits


def cull_warning(
    slice_: Mapping[str, Any], now: float, idle: float, limits: Mapping[str, float], lead: float
) -> dict[str, Any] | None:
    """The warning Lab shows before the session may be stopped as idle, or ``None``.

    The session cannot see the queue, so it takes the earliest limit that could
    apply: within the protected period, ``protected`` (the hub uses it only while
    a waiting request could use the GPUs); past it, the shorter of ``busy`` and
    ``idle``. The warning starts ``lead`` seconds before that limit is reached.
    ``idle`` is the server's own idle time, which the hub reads at most a few
    minutes late, so the hub's limit is reached no earlier than this one.
    """
    if lead <= 0 or slice_.get("state") != "granted":
        return None
    until = slice_.get("protected_until")
    protected = bool(slice_.get("min_runtime")) and until is not None and now < until
    if protected:
        candidates = [limits.get("protected", 0.0)]
    else:
        candidates = [limits.get("busy", 0.0), limits.get("idle", 0.0)]
    candidates = [limit for limit in candidates if limit > 0]
    if not candidates:
        return None
    limit = min(candidates)
    left = limit - idle
    if left > lead:
        return None
    left = max(left, 0.0)
    idle_for = f"{round(idle / 60)} min" if idle >= 60 else "less than a minute"
    if protected:
        condition = "if someone is waiting for its GPUs"
    elif limits.get("busy", 0.0) and limit == limits["busy"]:
        condition = "if someone is waiting for its GPUs (later otherwise)"
    else:
        condition = "as idle"
    return {
        "deadline": now + left,
        "idle_seconds": round(idle),
        "limit_seconds": limit,
        "protected": protected,
        "message": f"This session has been idle for {idle_for}. It may be stopped "
        f"{condition} once it has been idle for {duration_text(limit)}. Running a cell, "
        "typing in a terminal or work on its GPUs keeps it, and so does Keep my session. "
        "Save your work.",
    }


def session_view(
    slice_: Mapping[str, Any],
    now: float,
    warning: dict[str, Any] | None,
    env: Mapping[str, str],
    activity: dict[str, Any] | None = None,
    budget: int | None = None,
) -> dict[str, Any]:
    """The answer of ``GET slicebroker/session`` for the broker's ``slice_``.

    A request for "any type" has no ``gpu_type`` in the broker; the spawner names
    the granted type in ``SLICEBROKER_GPU_TYPE``. ``kept_to_end`` says, past the
    broker's preemption ``budget``, that no one preempts the slice any more.
    """
    charged = float(slice_.get("charged_gpu_seconds") or 0.0)
    kept = kept_to_end(slice_, budget)
    comes_back = env.get(RESTORE_ENV) == "1"
    left = preemptions_left(slice_, budget)
    budget_left = (
        coming_back_text(slice_.get("preemptions") or 0, left)
        if comes_back and left is not None and slice_.get("state") == "preempting"
        else None
    )
    return {
        "slice_id": slice_["id"],
        "project": slice_.get("project"),
        "user": slice_.get("user"),
        "gpus": slice_.get("gpus"),
        "gpu_type": slice_.get("gpu_type") or env.get(GPU_TYPE_ENV) or None,
        "nodes": [p["node"] for p in slice_.get("placements") or ()],
        "state": slice_.get("state"),
        "granted_at": slice_.get("granted_at"),
        "protected_until": slice_.get("protected_until") if slice_.get("min_runtime") else None,
        "kept_to_end": kept_text(slice_) if kept else None,
        "preempt_deadline": slice_.get("preempt_deadline"),
        "preempt_reason": slice_.get("preempt_reason"),
        "end_reason": slice_.get("end_reason"),
        "ended_at": slice_.get("ended_at"),
        "charged_gpu_seconds": charged,
        "cost": gpu_hours(charged),
        "now": now,
        "cull_warning": warning,
        "broker_pages": url_path_join(env.get("JUPYTERHUB_BASE_URL") or "/", PAGES_PATH),
        "activity": activity,
        "comes_back": comes_back,
        "budget_left": budget_left,
        "restored": _restored(env),
    }


def _restored(env: Mapping[str, str]) -> dict[str, Any] | None:
    """The ended slice a session brought back restores, as its spawner named it."""
    slice_id = env.get(RESTORES_ENV, "")
    if not slice_id.isdigit():
        return None
    return {"slice_id": int(slice_id), "ended_at": env.get(RESTORES_ENDED_ENV, "")}


class _Handler(APIHandler):
    """A route of this extension: errors in the broker API's shape."""

    # Lab and the hub poll these routes; the polls are not the user's activity (else a
    # session with Lab open in a background tab would never look idle to the server).
    _track_activity = False

    @property
    def activity(self) -> SessionActivity:
        return self.settings["slicebroker_activity"]

    def error(self, status: int, code: str, message: str) -> None:
        self.set_status(status)
        self.finish(json.dumps({"error": {"code": code, "message": message}}))


class ActivityHandler(_Handler):
    """``GET``/``POST slicebroker/activity`` (see the module docstring)."""

    @web.authenticated
    def get(self) -> None:
        self.finish(json.dumps(self.activity.view(time.time())))

    @web.authenticated
    def post(self) -> None:
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("keep") is not True:
            self.error(400, "bad_request", 'Send {"keep": true} to keep the session.')
            return
        now = time.time()
        idle = self.activity.view(now)["idle_seconds"]
        self.activity.keep(now)
        self.log.info("slicebroker: the user kept the session after %.0f s idle", idle)
        self.finish(json.dumps(self.activity.view(now)))


class ProtectionHandler(_Handler):
    """``POST slicebroker/protection``: extend the session's protection by
    ``extend_protection_by`` (Lab's idle warning); the session's view, or the broker's
    refusal (409, with the room left) in the API's error shape."""

    @web.authenticated
    async def post(self) -> None:
        config: SliceBrokerLab = self.settings["slicebroker_lab"]
        slice_id = os.environ.get(SLICE_ENV, "")
        if config.extend_protection_by <= 0 or not slice_id.isdigit():
            self.error(404, "no_slice", "This session has no protection to extend.")
            return
        client = BrokerClient(timeout=config.broker_timeout, retries=1)
        try:
            slice_ = await client.extend_protection(int(slice_id), config.extend_protection_by)
        except BrokerAPIError as err:
            status = err.status if 400 <= err.status < 500 else 502
            code = err.code or "broker_unavailable"
            self.error(status, code, f"The GPU broker did not extend it: {err.message}")
            return
        finally:
            client.close()
        self.log.info(
            "slicebroker: protection of slice %s extended to %s",
            slice_id,
            slice_.get("protected_until"),
        )
        now = time.time()
        self.finish(json.dumps(session_view(slice_, now, None, os.environ, None)))


class SessionHandler(_Handler):
    """``GET slicebroker/session``: the session's slice (see the module docstring)."""

    async def _preemption_budget(self, client: BrokerClient) -> int | None:
        """The broker's preemption budget (``GET /limits``), read once: the first time a
        slice of this session was preempted."""
        if BUDGET_KEY not in self.settings:
            limits = await client.limits()
            self.settings[BUDGET_KEY] = limits.get("preemption_budget")
        return self.settings[BUDGET_KEY]

    @web.authenticated
    async def get(self) -> None:
        config: SliceBrokerLab = self.settings["slicebroker_lab"]
        env = os.environ
        slice_id = env.get(SLICE_ENV, "")
        if not slice_id.isdigit():
            self.error(404, "no_slice", f"This session has no GPU slice ({SLICE_ENV} is not set).")
            return
        unset = " and ".join(name for name in (URL_ENV, TOKEN_ENV) if not env.get(name))
        if unset:
            self.error(404, "no_slice", f"This session cannot reach the broker ({unset} not set).")
            return
        client = BrokerClient(timeout=config.broker_timeout, retries=1)
        try:
            slice_ = await client.get_slice(int(slice_id))
            budget = await self._preemption_budget(client) if slice_.get("preemptions") else None
        except BrokerAPIError as err:
            self.log.warning("slicebroker: reading slice %s: %s", slice_id, err.message)
            if err.status == 0 or err.status >= 500:
                message = f"The GPU broker is not answering: {err.message}"
            else:
                message = f"The GPU broker refused to show the slice: {err.message}"
            self.error(502, "broker_unavailable", message)
            return
        finally:
            client.close()
        now = time.time()
        # Kernels, terminals and the GPU, not the API calls (Lab's polls): the hub's idleness.
        activity = self.activity.view(now)
        warning = cull_warning(
            slice_, now, activity["idle_seconds"], cull_limits(env), config.cull_warning
        )
        view = session_view(slice_, now, warning, env, activity, budget)
        extendable = slice_.get("state") == "granted" and bool(slice_.get("min_runtime"))
        view["extend_protection_by"] = config.extend_protection_by if extendable else 0.0
        self.finish(json.dumps(view))


def setup_handlers(serverapp: Any) -> None:
    """Register the routes on ``serverapp``'s web application, with their settings, and
    start reading the session's GPUs (a session of the broker's only)."""
    web_app = serverapp.web_app
    config = web_app.settings["slicebroker_lab"] = SliceBrokerLab(parent=serverapp)
    activity = SessionActivity.for_server(web_app.settings, config)
    web_app.settings["slicebroker_activity"] = activity
    base = web_app.settings["base_url"]
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base, "slicebroker", "session"), SessionHandler),
            (url_path_join(base, "slicebroker", "activity"), ActivityHandler),
            (url_path_join(base, "slicebroker", "protection"), ProtectionHandler),
        ],
    )
    if config.gpu_sample_interval > 0 and os.environ.get(SLICE_ENV, "").isdigit():
        told = False

        async def sample() -> None:
            nonlocal told
            reading = await activity.sample_gpus(time.time())
            if reading.problem and not told:
                told = True  # once: a session without a driver says so, not at every reading
                serverapp.log.info("slicebroker: GPUs not read: %s", reading.problem)

        PeriodicCallback(sample, config.gpu_sample_interval * 1000).start()
        IOLoop.current().add_callback(sample)
