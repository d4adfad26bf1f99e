"""What the user is told: queue progress while a spawn waits, and why a session ended.

A *notice* is a small JSON-able dict the spawner keeps in its state when its
slice is preempted or ends on the broker's initiative::

    {"slice_id": 12, "project": "vision", "gpus": 1, "state": "preempting" | "ended",
     "reason": "fair_share", "end_reason": "preempted" | "culled_idle" | None,
     "at": 1764441600.0, "protected_until": 1764441000.0}

(a ``culled_idle`` notice, made by the hub and not the broker, adds ``idle``,
``protected`` and ``waiter``: see :func:`cull_notice`).

``at`` is when the session stops (the preemption deadline) or stopped. The
words are made from it when a page is rendered (:func:`describe`), so that they
can improve without touching stored state. :func:`notices_for` feeds the
templates shipped in ``spawner/templates`` (see :data:`TEMPLATE_PATH`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from broker.budget import (
    coming_back_text,
    gpus_kept_to_end,
    kept_text,
    kept_to_end,
    preemptions_left,
)
from broker.units import instead_text, ordinal, share_used

from .culler import CULLED_IDLE, Verdict

TEMPLATE_PATH = str(Path(__file__).with_name("templates"))
"""Add to ``c.JupyterHub.template_paths`` for pages that say why a session ended."""

#: Where the progress bar stands at the grant; the backend's launch fills the rest.
GRANT_PROGRESS = 60
STATE_KEY = "slicebroker"

# Why a running slice was asked to leave (the broker's preempt_reason) ...
_PREEMPT_WHY = {
    "fair_share": (
        "its protected period was over and a request from a project that ranks higher in "
        "fair share (it has used less of its entitlement) needed the GPUs"
    ),
    "priority": (
        "its protected period was over and higher-priority work of the same project needed the GPUs"
    ),
    "debug_lane": "a short debugging session needed the GPUs",
    "unallocated": (
        "it was a free session (protected length 0), which any charged request may preempt"
    ),
    "drain": "its node is being drained for maintenance",
}
# ... and why a slice ended (the broker's end_reason) when it was not preempted.
_END_WHY = {
    "expired": "it reached the maximum runtime of a session",
    "node_down": "its node went down",
    "lost": "the hub stopped renewing its lease (the hub was down or lost contact)",
    "released": "its GPUs were released outside this session (by an administrator?)",
    "cancelled": "the request was withdrawn",
}
_WHAT_TO_DO = {
    "fair_share": (
        "Start a new session when you need one; a longer protected length keeps the GPUs "
        "yours for longer, and sessions of projects that have used less of their share wait less."
    ),
    "priority": "Start a new session, or ask your project to order its work differently.",
    "debug_lane": (
        "Start a new session; batch work past its protected period gives way to debugging."
    ),
    "unallocated": (
        "Choose a protected length above 0 to keep the GPUs for that long (it is charged to "
        "your project)."
    ),
    "expired": "Start a new session if you need more time.",
    "lost": "Start a new session.",
    "released": "Start a new session.",
    "cancelled": "Start a new session.",
    CULLED_IDLE: (
        "Start a new session when you need one; stop your server when you are done, so "
        "that your project stops paying and others get the GPUs."
    ),
}


def clock_time(epoch: float | None) -> str:
    """``14:03:27 UTC`` (with the date when it is not today)."""
    if epoch is None:
        return "an unknown time"
    moment = datetime.fromtimestamp(epoch, UTC)
    today = datetime.fromtimestamp(time.time(), UTC).date()
    if moment.date() == today:
        return moment.strftime("%H:%M:%S UTC")
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def iso_time(epoch: float | None) -> str:
    """ISO 8601 in UTC (``2026-11-29T14:03:27Z``), or empty."""
    if epoch is None:
        return ""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def restoring_text(ended: Mapping[str, Any]) -> str:
    """The first words of a session brought back: "Bringing back your session (slice 12),
    preempted at 12:40:07 UTC:"."""
    why = "its node went down" if ended.get("end_reason") == "node_down" else "preempted"
    at = ended.get("ended_at") or ended.get("preempt_deadline")
    when = f" at {clock_time(at)}" if at else ""
    return f"Bringing back your session (slice {ended.get('id')}), {why}{when}:"


def notice_from_slice(
    slice_: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]] | None = None,
    budget: int | None = None,
) -> dict[str, Any] | None:
    """The notice a slice in ``preempting`` or (broker-)ended state calls for, else ``None``.

    A slice released or cancelled by its own spawner needs no notice: callers
    make one only for endings they did not ask for. ``nodes`` (the broker's, if
    known) tell whether another node takes new work, for what to do after a
    drain or a node going down; ``budget`` (the broker's preemption budget, for a
    session that comes back after a preemption) how many more it may suffer.
    """
    state = slice_.get("state")
    if state == "preempting":
        at = slice_.get("preempt_deadline")
    elif state == "ended":
        at = slice_.get("ended_at")
    else:
        return None
    return {
        "slice_id": slice_.get("id"),
        "project": slice_.get("project"),
        "gpus": slice_.get("gpus"),
        "state": state,
        "reason": slice_.get("preempt_reason"),
        "end_reason": slice_.get("end_reason"),
        "at": at,
        "protected_until": slice_.get("protected_until"),
        "others_in_service": _others_in_service(slice_, nodes),
        "preemptions": slice_.get("preemptions") or 0,
        "preemptions_left": preemptions_left(slice_, budget),
    }


def _others_in_service(
    slice_: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]] | None
) -> int | None:
    """Nodes in service (``ready``) besides the slice's own; ``None`` when not known."""
    if nodes is None:
        return None
    mine = {p.get("node") for p in slice_.get("placements") or ()}
    return sum(
        1
        for n in nodes
        if n.get("state") == "ready" and n.get("in_config", True) and n["name"] not in mine
    )


def cull_notice(
    slice_: Mapping[str, Any], at: float, idle_seconds: float, rule: Verdict
) -> dict[str, Any]:
    """The notice of a session the hub stopped because it was idle (``culled_idle``)."""
    return {
        "slice_id": slice_.get("id"),
        "project": slice_.get("project"),
        "gpus": slice_.get("gpus"),
        "state": "ended",
        "reason": None,
        "end_reason": CULLED_IDLE,
        "at": at,
        "protected_until": slice_.get("protected_until"),
        "idle": idle_seconds,
        "protected": rule.protected,
        "waiter": rule.waiter,
    }


def minutes(seconds: float) -> str:
    """``42 min`` (or ``1.5 h``) for a span of time."""
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    return f"{max(round(seconds / 60), 1)} min"


def _culled_why(notice: Mapping[str, Any]) -> str:
    idle = minutes(float(notice.get("idle") or 0.0))
    if notice.get("waiter") is None:
        return f"it had been idle for {idle}, the hub's limit for an idle session"
    protected = " (still within its protected period)" if notice.get("protected") else ""
    return f"it had been idle for {idle}{protected} while a waiting request could use its GPUs"


def describe(notice: Mapping[str, Any]) -> dict[str, str]:
    """``{"title", "text", "html", "what_to_do"}`` for a notice."""
    reason = notice.get("reason")
    end_reason = notice.get("end_reason")
    when = clock_time(notice.get("at"))
    gpus = notice.get("gpus") or 0
    what = (
        f"Your GPU session ({gpus} GPU{'s' if gpus != 1 else ''}, project {notice.get('project')})"
    )
    if reason in _PREEMPT_WHY:
        why = _PREEMPT_WHY[reason]
        key = reason
        if notice.get("state") == "preempting":
            title = "Your GPU session is being preempted"
            text = (
                f"{what} was preempted because {why}. It stops at {when}: save your work "
                "before then."
            )
        else:
            title = "Your GPU session was preempted"
            text = f"{what} was stopped at {when} because {why}."
    elif end_reason == CULLED_IDLE:
        key = CULLED_IDLE
        title = "Your GPU session was stopped as idle"
        text = f"{what} was stopped at {when} because {_culled_why(notice)}."
    else:
        key = end_reason if end_reason in _END_WHY else "released"
        title = "Your GPU session ended"
        text = f"{what} was stopped at {when} because {_END_WHY[key]}."
    if reason in _PREEMPT_WHY:
        text += _budget_text(notice)
    if key in ("drain", "node_down"):
        todo = _after_node_loss(notice.get("others_in_service"))
    else:
        todo = _WHAT_TO_DO[key]
    html = (
        f"<strong>{escape(title)}.</strong> {escape(text)} {escape(todo)}"
        f' <span class="text-muted">(slice {escape(str(notice.get("slice_id")))})</span>'
    )
    return {"title": title, "text": text, "html": html, "what_to_do": todo}


def _budget_text(notice: Mapping[str, Any]) -> str:
    """What the preemption budget still allows, for a notice of a preemption (empty where
    there is no budget, or the notice is older than the count)."""
    left = notice.get("preemptions_left")
    if left is None:
        return ""
    return " " + coming_back_text(notice.get("preemptions") or 0, left)


def _after_node_loss(others: int | None) -> str:
    if others is None:
        return (
            "Start a new session: it is placed on a node in service, or waits in the queue "
            "until one is."
        )
    if others == 0:
        return (
            "No other node takes new sessions now: a new session waits in the queue until an "
            "admin puts a node back in service."
        )
    return "Start a new session: it will be placed on another node."


def notice_alert(notice: Mapping[str, Any] | None) -> str:
    """A Bootstrap alert with the notice, for the options form; empty without a notice."""
    if not notice:
        return ""
    return f'<div class="alert alert-warning" id="sb-notice">{describe(notice)["html"]}</div>'


def notices_for(user: Any) -> dict[str, dict[str, str]]:
    """Why each of ``user``'s servers last ended, by server name, as :func:`describe` says.

    Reads the spawners' stored state (``orm_spawner.state``), so it never
    creates a spawner. Made for ``c.JupyterHub.template_vars`` (called with the
    current user, or ``None`` on pages nobody is logged in to).
    """
    found: dict[str, dict[str, str]] = {}
    orm_spawners = getattr(user, "orm_spawners", None) or {}
    for name, orm_spawner in orm_spawners.items():
        state = getattr(orm_spawner, "state", None) or {}
        notice = (state.get(STATE_KEY) or {}).get("notice")
        if notice:
            found[name] = describe(notice)
    return found


def session_line(slice_: Mapping[str, Any], now: float, budget: int | None = None) -> str | None:
    """One line on a live slice for the hub's home page: what it holds and until when it
    is protected (or that it is kept to its end, past its preemption ``budget``), or where
    it waits; ``None`` for a slice that is over."""
    state = slice_.get("state")
    gpus = slice_.get("gpus") or 0
    kind = slice_.get("gpu_type")
    what = f"{gpus}{f' {kind}' if kind else ''} GPU{'s' if gpus != 1 else ''}"
    project = slice_.get("project")
    if state == "pending":
        position = slice_.get("queue_position")
        where = f"{ordinal(position)} in the queue" if position else "in the queue"
        wait = wait_text(slice_.get("estimated_start"), now)
        return f"Waiting for {what} for project {project}: {where}, estimated start {wait}."
    if state in ("granted", "preempting"):
        nodes = ", ".join(p["node"] for p in slice_.get("placements") or ())
        line = f"{what} for project {project} on {nodes or 'its node'}"
        until = slice_.get("protected_until")
        if state == "preempting":
            line += f", stopping at {clock_time(slice_.get('preempt_deadline'))}"
        elif kept_to_end(slice_, budget):
            line += f", {kept_text(slice_)}"
        elif slice_.get("min_runtime") and until and until > now:
            line += f", protected until {clock_time(until)}"
        else:
            line += ", past its protection: it may be preempted"
        return f"{line}."
    return None


def sessions_for(user: Any) -> dict[str, str]:
    """A line on each of ``user``'s servers that holds or waits for GPUs, by server name.

    Reads the spawners the hub already has (a live or pending server has one), never
    creating one. Made for ``c.JupyterHub.template_vars``, as :func:`notices_for`.
    """
    found: dict[str, str] = {}
    now = time.time()
    for name, spawner in dict(getattr(user, "spawners", None) or {}).items():
        slice_ = getattr(spawner, "slice", None)
        view = getattr(spawner, "broker_view", None)
        budget = view.preemption_budget if view is not None else None
        line = session_line(slice_, now, budget) if slice_ else None
        if line:
            found[name] = line
    return found


def template_vars() -> dict[str, Any]:
    """What ``c.JupyterHub.template_vars`` needs for the shipped templates."""
    return {"slicebroker_notices": notices_for, "slicebroker_sessions": sessions_for}


# ---- queue progress -----------------------------------------------------------------------


def wait_text(estimated_start: float | None, now: float) -> str:
    if estimated_start is None:
        return "no estimate yet"
    left = estimated_start - now
    if left <= 60:
        return "within a minute"
    if left < 3600:
        return f"in about {round(left / 60)} min"
    return f"in about {left / 3600:.1f} h"


def pages_url(broker_url: str, page: str = "queue") -> str:
    """Where people see one of the broker's web pages: the service's path on the hub
    (``/services/slicebroker/queue``) when the broker is a hub service, else the broker's
    own URL."""
    parsed = urlparse(broker_url)
    root = parsed.path if "/services/" in parsed.path else broker_url
    return f"{root.rstrip('/')}/{page}"


def wait_reason(
    slice_: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]],
    held: Sequence[Mapping[str, Any]],
    now: float,
    budget: int | None = None,
) -> str:
    """Why a pending slice waits, in one sentence: the requests that go first, or the GPUs
    of its type in use, when the first of their protections ends and how many are kept
    to their end past the preemption ``budget`` (``held``: the granted slices). Empty
    when the nodes are not known."""
    gpu_type = slice_.get("gpu_type")
    typed = [
        n
        for n in nodes
        if n.get("state") == "ready"
        and n.get("in_config", True)
        and (not gpu_type or n.get("gpu_type") == gpu_type)
    ]
    if not typed:
        return ""
    kind = f"{gpu_type} " if gpu_type else ""
    capacity = sum(int(n.get("gpu_count") or 0) for n in typed)
    busy = sum(int(n.get("gpus_held") or 0) for n in typed)
    in_use = f"{busy} of {capacity} {kind}GPUs are in use"
    position = slice_.get("queue_position") or 0
    if position > 1:
        ahead = position - 1
        return (
            f"{ahead} request{'s go' if ahead != 1 else ' goes'} first (their projects used "
            f"less of their share, or submitted earlier); {in_use}."
        )
    gpus = slice_.get("gpus") or 0
    names = {n.get("name") for n in typed}
    ends = [
        s["protected_until"]
        for s in held
        if (s.get("protected_until") or 0) > now
        and not kept_to_end(s, budget)
        and any(p.get("node") in names for p in s.get("placements") or ())
    ]
    until = f", held under protection until {clock_time(min(ends))}" if ends else ""
    kept = gpus_kept_to_end(held, budget, names)
    if kept:
        until += (
            f"; {kept} of them by work kept to its end, preempted as many times as its "
            "budget allows"
        )
    return f"Waiting for {gpus} {kind}GPU{'s' if gpus != 1 else ''} to free up: {in_use}{until}."


#: An answer on alternatives older than this (s) says when it was worked out: a busy
#: broker answers again what it last computed (design.md §5.8).
SOONER_STALE_AFTER_S = 60.0


def sooner_text(
    found: Mapping[str, Any],
    slice_: Mapping[str, Any],
    most: int = 3,
    asked_at: float | None = None,
) -> str:
    """What would start a waiting request sooner (``GET /slices/{id}/alternatives``), in
    words: "Start sooner with 1 GPU instead of 2: now (1.00 GPU-h protected) · …";
    with ``asked_at``, an answer worked out well before it says when."""
    now = found.get("now") or 0.0
    items = []
    for alternative in list(found.get("alternatives") or ())[:most]:
        starts = alternative["starts_at"]
        when = "now" if starts <= now else f"in about {minutes(starts - now)}"
        what = instead_text(alternative["change"], alternative["fields"], slice_)
        items.append(f"{what}: {when} ({alternative['gpu_hours']:.2f} GPU-h protected)")
    if not items:
        return ""
    text = f"Start sooner with {' · '.join(items)}."
    if asked_at is not None and asked_at - now > SOONER_STALE_AFTER_S:
        text += f" (As the broker worked it out at {clock_time(now)}; it may have changed.)"
    return text


def queue_event(
    slice_: Mapping[str, Any],
    now: float,
    capacity: str = "",
    queue_url: str = "",
    reason: str = "",
    sooner: str = "",
) -> dict[str, Any]:
    """The progress event for a pending slice: queue position, fair-share value, wait,
    ``reason`` (:func:`wait_reason`), ``sooner`` (:func:`sooner_text`) and ``capacity``
    (what draining and down nodes mean for it, from
    :func:`spawner.options.capacity_note`); with ``queue_url``, a link to the queue page."""
    gpus = slice_.get("gpus") or 0
    kind = f" {slice_['gpu_type']}" if slice_.get("gpu_type") else ""
    what = f"{gpus}{kind} GPU{'s' if gpus != 1 else ''} for project {slice_.get('project')}"
    position = slice_.get("queue_position")
    value = slice_.get("fairshare_value")
    where = f"{ordinal(position)} in the queue" if position else "in the queue"
    fair = f"project at {share_used(value)}" if value is not None else "share used pending"
    wait = wait_text(slice_.get("estimated_start"), now)
    message = f"Waiting for {what}: {where}; {fair} (lower goes first); estimated start: {wait}."
    html = (
        f"Waiting for {escape(what)}: <strong>{escape(where)}</strong>; {escape(fair)} "
        f"(lower goes first); estimated start: {escape(wait)}."
    )
    if reason:
        message += f" {reason}"
        html += f' <span id="sb-wait-reason">{escape(reason)}</span>'
    if capacity:
        message += f" {capacity}"
        html += f' <span id="sb-capacity">{escape(capacity)}</span>'
    if sooner:
        message += f" {sooner}"
        html += f' <span id="sb-sooner">{escape(sooner)}</span>'
    if queue_url:
        html += (
            f' <a id="sb-queue-link" href="{escape(queue_url)}" target="_blank">See the queue</a>'
        )
    return {"progress": 20, "message": message, "html_message": html}


def grant_event(slice_: Mapping[str, Any], budget: int | None = None) -> dict[str, Any]:
    """The progress event of a grant: where, and what protects it (``budget``: the
    broker's preemption budget, past which a slice is kept to its end)."""
    places = "; ".join(
        f"{p['node']} [{', '.join(str(i) for i in p['gpu_indices'])}]"
        for p in slice_.get("placements") or ()
    )
    protected = slice_.get("protected_until")
    if kept_to_end(slice_, budget):
        until = kept_text(slice_)
    elif slice_.get("min_runtime"):
        until = f"protected until {clock_time(protected)}"
    else:
        until = "free session: preemptible at any time"
    gpus = slice_.get("gpus") or 0
    return {
        "progress": GRANT_PROGRESS,
        "message": f"Granted {gpus} GPU{'s' if gpus != 1 else ''} on {places} ({until}); "
        "starting the server.",
    }
