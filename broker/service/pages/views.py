"""What the pages show, made from the broker's read methods' answers (pure functions).

Everything a person reads is decided here — why a request waits, who holds a
GPU, the rows of a usage table, the plots — so that the handlers only fetch
and the templates only lay out. GPU time goes through
:func:`broker.units.gpu_hours`; the templates escape every name.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ...budget import gpus_kept_to_end, kept_text, kept_to_end
from ...core.fairshare import entitlement_moves, entitlements_with
from ...core.model import Account, Policy
from ...errors import InvalidConfig, InvalidRequest
from ...store import Principal
from ...units import HOUR, gpu_hours, instead_text, share_used

DAY = 24 * HOUR
#: How long ended slices stay on My GPUs, in seconds.
RECENT_S = DAY
#: Slices ended within RECENT_S shown at most on My GPUs.
RECENT_MAX = 10


def clock(epoch: float | None) -> str:
    """``2026-11-29 14:03 UTC``, or ``—``."""
    if epoch is None:
        return "—"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M UTC")


def span(seconds: float) -> str:
    """``3 min``, ``1 h 20 min``, ``2 d 4 h`` for a length of time (rounded down)."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def placement_text(slice_: Mapping[str, Any]) -> str:
    """``n0 [0, 1]; n1 [3]``, or ``—`` before a grant."""
    places = slice_.get("placements") or ()
    text = "; ".join(f"{p['node']} [{', '.join(map(str, p['gpu_indices']))}]" for p in places)
    return text or "—"


def is_debug(slice_: Mapping[str, Any], policy: Policy) -> bool:
    """A short, small interactive session (as :func:`broker.core.preemption.is_debug` has it)."""
    return (
        slice_.get("kind") == "interactive"
        and (slice_.get("min_runtime") or 0) > 0
        and slice_["gpus"] <= policy.debug_max_gpus
        and (slice_.get("min_runtime") or 0) <= policy.debug_max_min_runtime
    )


@dataclass(frozen=True)
class Cluster:
    """What the reasons for waiting are judged on: nodes, projects and live slices."""

    nodes: Sequence[Mapping[str, Any]]
    projects: Mapping[str, Mapping[str, Any]]
    live: Sequence[Mapping[str, Any]]
    policy: Policy

    @property
    def pending(self) -> list[Mapping[str, Any]]:
        waiting = [s for s in self.live if s["state"] == "pending"]
        return sorted(waiting, key=lambda s: (s.get("queue_position") or 1 << 30, s["id"]))


def why_waiting(slice_: Mapping[str, Any], cluster: Cluster) -> str:
    """Why a pending slice has not started, in words: no node of its type, nodes out of
    service, its project's cap, the debug lane's cap, or fair share."""
    gpus = slice_["gpus"]
    gpu_type = slice_.get("gpu_type")
    kind = f"{gpu_type} " if gpu_type else ""
    nodes = [n for n in cluster.nodes if n.get("in_config", True)]
    typed = [n for n in nodes if not gpu_type or n["gpu_type"] == gpu_type]
    if not typed:
        return f"No node has {kind}GPUs: this request cannot start until one is added."
    in_service = [n for n in typed if n["state"] == "ready"]
    out = [n for n in typed if n["state"] != "ready"]
    capacity = sum(n["gpu_count"] for n in in_service)
    if capacity < gpus:
        names = ", ".join(
            f"{n['name']} {n['state']}" + (f" ({n['state_reason']})" if n["state_reason"] else "")
            for n in out
        )
        return (
            f"Only {capacity} {kind}GPUs are in service and this request needs {gpus}: "
            f"out of service: {names or 'none'}. It waits until an admin puts a node back."
        )
    project = cluster.projects.get(slice_["project"], {})
    cap = cluster.policy.project_gpu_caps.get(slice_["project"])
    held = project.get("gpus_held", 0)
    if cap is not None and held + gpus > cap:
        return (
            f"Project {slice_['project']} holds {held} GPUs and may hold at most {cap} at a "
            f"time (its cap): this request starts when the project's other work releases GPUs."
        )
    if is_debug(slice_, cluster.policy):
        total = sum(n["gpu_count"] for n in nodes)
        lane = math.ceil(cluster.policy.debug_lane_fraction * total)
        held_by_debug = [
            s for s in cluster.live if s["state"] != "pending" and is_debug(s, cluster.policy)
        ]
        debug_held = sum(s["gpus"] for s in held_by_debug)
        if debug_held + gpus > lane:
            return (
                f"The debug lane is full: short debugging sessions hold {debug_held} of the "
                f"{lane} GPUs they may take from other work."
            )
    position = slice_.get("queue_position")
    value = share_used(slice_.get("fairshare_value"))
    busy = sum(n["gpus_held"] for n in in_service)
    note = f" {len(out)} node(s) of this type are out of service." if out else ""
    budget = cluster.policy.preemption_budget
    kept = gpus_kept_to_end(cluster.live, budget, {n["name"] for n in in_service})
    by_kept = (
        f"{kept} of them by work kept to its end, preempted as many times as its budget allows"
        if kept
        else ""
    )
    if position and position > 1:
        in_use = f"{busy} of {capacity} {kind}GPUs are in use" + (f", {by_kept}" if kept else "")
        return (
            f"Fair share: {position - 1} request(s) go first, from projects that used less "
            f"of their share or submitted earlier (project {slice_['project']}: {value}); "
            f"{in_use}.{note}"
        )
    held = "held under protection or a grace period"
    if kept:
        held = by_kept + ("" if kept >= busy else f", the rest {held}")
    return (
        f"First in line: waiting for {gpus} {kind}GPUs to free up ({busy} of {capacity} in use, "
        f"{held}).{note}"
    )


def held_type(slice_: Mapping[str, Any], cluster: Cluster) -> str | None:
    """The GPU type a slice of any type was granted (its nodes'), as Lab names it."""
    names = {p["node"] for p in slice_.get("placements") or ()}
    types = sorted({n["gpu_type"] for n in cluster.nodes if n["name"] in names})
    return ",".join(types) or None


def slice_row(slice_: Mapping[str, Any], cluster: Cluster, now: float) -> dict[str, Any]:
    """A slice as My GPUs shows it."""
    state = slice_["state"]
    protected = slice_.get("protected_until")
    row = {
        "id": slice_["id"],
        "state": state,
        "project": slice_["project"],
        "kind": slice_["kind"],
        "gpus": slice_["gpus"],
        "gpu_type": slice_.get("gpu_type") or held_type(slice_, cluster) or "any",
        "where": placement_text(slice_),
        "protected_until": protected if state in ("granted", "preempting") else None,
        "protected_text": clock(protected) if protected else "—",
        "cost": gpu_hours(slice_.get("charged_gpu_seconds") or 0.0),
        "queue_position": slice_.get("queue_position") if state == "pending" else None,
        "estimated_start": estimated_start_text(slice_, now) if state == "pending" else "—",
        "why": why_waiting(slice_, cluster) if state == "pending" else "",
        "end_reason": slice_.get("end_reason") or "",
        "ended": clock(slice_.get("ended_at")) if state == "ended" else "",
        "action": {"pending": "Cancel", "granted": "Release", "preempting": "Release"}.get(state),
    }
    if state == "preempting":
        row["why"] = (
            f"Being preempted ({slice_.get('preempt_reason') or 'no reason given'}): it stops "
            f"at {clock(slice_.get('preempt_deadline'))}."
        )
    elif kept_to_end(slice_, cluster.policy.preemption_budget):
        row["protected_until"], row["protected_text"] = None, "to its end"
        kept = kept_text(slice_)
        row["why"] = f"{kept[:1].upper()}{kept[1:]}."
    return row


def my_slices(
    mine: Iterable[Mapping[str, Any]], cluster: Cluster, now: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(live, recently ended)`` rows of a user's slices."""
    mine = list(mine)
    live = [slice_row(s, cluster, now) for s in mine if s["state"] != "ended"]
    ended = [s for s in mine if s["state"] == "ended" and (s.get("ended_at") or 0) > now - RECENT_S]
    ended.sort(key=lambda s: s.get("ended_at") or 0, reverse=True)
    return live, [slice_row(s, cluster, now) for s in ended[:RECENT_MAX]]


def entitlement_changes(
    rows: Sequence[Mapping[str, Any]], name: str, body: Mapping[str, Any]
) -> list[dict[str, str]]:
    """The entitlements a change to account ``name`` (a ``ProjectUpdate`` body) would
    move, ``name``'s first, each ``{name, before, after}`` as percentages; empty when
    none moves. :class:`InvalidRequest` for a tree that would not be valid."""
    accounts = [Account(row["name"], row["share"], row["parent"]) for row in rows]
    changed = Account(name, body["share"], body.get("parent"))
    try:
        after = entitlements_with(accounts, changed)
    except InvalidConfig as err:
        raise InvalidRequest(f"cannot change {name!r}: {err}") from None
    before = {row["name"]: row["entitlement"] for row in rows}
    moved = sorted(entitlement_moves(before, after), key=lambda n: (n != name, n))
    return [
        {
            "name": n,
            "before": "—" if n not in before else f"{100 * before[n]:.1f}%",
            "after": f"{100 * after[n]:.1f}%",
        }
        for n in moved
    ]


def sooner_choices(found: Mapping[str, Any], request: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What would start a waiting request sooner (``GET /slices/{id}/alternatives``), as
    My GPUs offers it: a button each, saying what changes, when it would start and what
    its protected period commits, that posts the alternative's terms to replace it."""
    now = found.get("now") or time.time()
    choices = []
    for alternative in found.get("alternatives") or ():
        starts = alternative["starts_at"]
        choices.append(
            {
                "text": instead_text(alternative["change"], alternative["fields"], request),
                "when": "now" if starts <= now else f"in about {span(starts - now)}",
                "cost": gpu_hours(alternative["gpu_hours"] * HOUR),
                "body": json.dumps(alternative["fields"], sort_keys=True),
            }
        )
    return choices


def estimated_start_text(slice_: Mapping[str, Any], now: float) -> str:
    """When a waiting slice should start, as My GPUs and the Queue page say it."""
    estimated = slice_.get("estimated_start")
    if estimated is None:
        return "no estimate yet"
    return f"{clock(estimated)} (in {span(estimated - now)})"


def queue_rows(cluster: Cluster, viewer: Principal) -> list[dict[str, Any]]:
    """The queue in pass order; others' requests show no user or id unless the viewer
    is an admin."""
    rows = []
    now = time.time()
    for slice_ in cluster.pending:
        visible = viewer.admin or slice_["user"] == viewer.name
        project = cluster.projects.get(slice_["project"], {})
        rows.append(
            {
                "position": slice_.get("queue_position") or "—",
                "id": slice_["id"] if visible else None,
                "user": slice_["user"] if visible else "another user",
                "mine": slice_["user"] == viewer.name,
                "project": slice_["project"],
                "gpus": slice_["gpus"],
                "gpu_type": slice_.get("gpu_type") or "any",
                "kind": slice_["kind"],
                "fairshare": share_used(project.get("fairshare_value"), words=False),
                "waited": span(now - slice_["submitted_at"]),
                "estimated_start": estimated_start_text(slice_, now),
            }
        )
    return rows


def node_rows(cluster: Cluster, viewer: Principal, now: float) -> list[dict[str, Any]]:
    """Each node with one cell per GPU: who holds it, protected, preemptible, kept to its
    end (past its preemption budget), leaving or past its lease (``lapsed``: no heartbeat
    in time), and for how long."""
    holders: dict[tuple[str, int], Mapping[str, Any]] = {}
    for slice_ in cluster.live:
        if slice_["state"] == "pending":
            continue
        for place in slice_.get("placements") or ():
            for index in place["gpu_indices"]:
                holders[(place["node"], index)] = slice_
    rows = []
    for node in cluster.nodes:
        cells = []
        for index in range(node["gpu_count"]):
            slice_ = holders.get((node["name"], index))
            if slice_ is None:
                cells.append({"index": index, "free": True})
                continue
            protected = slice_.get("protected_until")
            visible = viewer.admin or slice_["user"] == viewer.name
            lease = slice_.get("lease_expires_at")
            if slice_["state"] == "preempting":
                status, until = "leaving", slice_.get("preempt_deadline")
            elif lease is not None and lease <= now:
                status, until = "lapsed", None  # ends as the lease lapse limit allows
            elif kept_to_end(slice_, cluster.policy.preemption_budget):
                status, until = "kept", None
            elif protected is not None and protected > now:
                status, until = "protected", protected
            else:
                status, until = "preemptible", None
            cells.append(
                {
                    "index": index,
                    "free": False,
                    "project": slice_["project"],
                    "user": slice_["user"] if visible else "another user",
                    "kind": slice_["kind"],
                    "status": status,
                    "label": "kept to its end" if status == "kept" else status,
                    "until": until,
                    "left": span(until - now) if until else "",
                }
            )
        rows.append(
            {
                "name": node["name"],
                "gpu_type": node["gpu_type"],
                "state": node["state"],
                "reason": node.get("state_reason") or "",
                "by": node.get("drained_by") or "",
                "since": clock(node.get("state_changed_at")),
                "in_config": node.get("in_config", True),
                "held": node["gpus_held"],
                "cells": cells,
            }
        )
    return rows


def project_rows(projects: Sequence[Mapping[str, Any]], policy: Policy) -> list[dict[str, Any]]:
    """The project tree as rows, with depth for indentation."""
    depth: dict[str | None, int] = {None: -1}
    rows = []
    for project in projects:
        depth[project["name"]] = depth.get(project["parent"], -1) + 1
        rows.append(
            {
                "name": project["name"],
                "parent": project["parent"] or "",
                "depth": depth[project["name"]],
                "share": f"{project['share']:g}",
                "entitlement": f"{100 * project['entitlement']:.1f}%",
                "usage": gpu_hours(project["usage"]),
                "fairshare": share_used(project["fairshare_value"], words=False),
                "rank": project["rank"] or "—",
                "is_project": project["is_project"],
                "users": ", ".join(project["users"]),
                "groups": ", ".join(project["groups"]),
                "pending": project["pending"],
                "held": project["gpus_held"],
                "cap": policy.project_gpu_caps.get(project["name"], "none"),
            }
        )
    return rows


def day_bounds(first: float, last: float) -> list[tuple[float, float]]:
    """UTC days ``[start, end)`` covering ``first`` to ``last`` (at most 366)."""
    start = datetime.fromtimestamp(first, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    day = start.timestamp()
    days = []
    while day < last and len(days) < 366:
        days.append((day, day + DAY))
        day += DAY
    return days


def day_label(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d")


def bar_chart(
    title: str,
    labels: Sequence[str],
    values: Sequence[float],
    *,
    line: float | None = None,
    line_label: str = "",
    width: int = 360,
    height: int = 150,
) -> str:
    """An SVG bar chart of GPU-seconds per label (drawn in GPU-hours), with an optional
    horizontal reference ``line`` (GPU-seconds). Returns markup whose every text is escaped."""
    from html import escape

    top = max([*values, line or 0.0, 1e-9])
    left, bottom, right, head = 48, 22, 8, 18
    plot_w, plot_h = width - left - right, height - bottom - head
    step = plot_w / max(len(values), 1)
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>',
        f'<text x="{left}" y="12" class="axis">{escape(gpu_hours(top))} max</text>',
        f'<line x1="{left}" y1="{head + plot_h}" x2="{width - right}" y2="{head + plot_h}" '
        'class="base"/>',
    ]
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        h = plot_h * value / top
        x = left + i * step + step * 0.15
        parts.append(
            f'<rect x="{x:.1f}" y="{head + plot_h - h:.1f}" width="{step * 0.7:.1f}" '
            f'height="{h:.1f}" class="bar"><title>{escape(label)}: {escape(gpu_hours(value))}'
            "</title></rect>"
        )
        if len(values) <= 10 or i % max(1, len(values) // 7) == 0:
            parts.append(
                f'<text x="{x:.1f}" y="{height - 6}" class="axis">{escape(label[5:])}</text>'
            )
    if line is not None:
        y = head + plot_h - plot_h * line / top
        parts.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" class="line">'
            f"<title>{escape(line_label)}</title></line>"
        )
    parts.append("</svg>")
    return "".join(parts)
