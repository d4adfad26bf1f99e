"""What a user may ask for (design.md §7): the options form, and user options turned into a request.

Everything here is pure: it takes what the broker said (``GET /projects``,
``GET /nodes``) and what the hub admin offers (:class:`Choices`) and returns
values or HTML. The spawner (:mod:`spawner.mixin`) does the I/O; the form's
layout is a Jinja2 template (:data:`FORM_TEMPLATE`), which the admin may replace.

User options, from the form or from JupyterHub's REST API
(``{"user_options": {...}}``), are::

    {"project": "vision", "gpus": 1, "gpu_type": "h100", "protected": "15m"}

Every key is optional: the project defaults to the admin's ``default_project``
when the user may charge it, else to the user's project that ranks first in
fair share (the one that gets GPUs soonest); ``gpu_type`` empty or absent
means any type; ``protected`` is one of the admin's choices, as a duration
(``"15m"``, ``"1h"``) or seconds, ``0`` being a free session that any
allocated request may preempt.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import ChoiceLoader, Environment, FileSystemLoader, Template
from markupsafe import Markup

from broker.config import format_duration, parse_duration
from broker.units import duration_text, share_used

from .notices import minutes

#: The keys of ``user_options`` the spawner reads.
OPTION_KEYS = ("project", "gpus", "gpu_type", "protected", "restore", "restores")


class OptionsError(Exception):
    """A request the user can fix. ``reason`` is a short label (a metrics label in
    JupyterHub); ``message`` is shown to the user as it is."""

    def __init__(self, reason: str, message: str, html: str = ""):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.html = html


@dataclass(frozen=True, slots=True)
class Choices:
    """What the hub admin offers on the form; durations in seconds."""

    protected: tuple[float, ...] = (900.0, 3600.0, 7200.0, 14400.0, 28800.0, 0.0)
    protected_default: float = 900.0
    gpus: tuple[int, ...] = (1, 2, 4, 8)
    default_gpus: int = 1
    max_gpus: int = 8
    gpu_types: tuple[str, ...] = ()  # offered types; empty: every type the cluster has
    default_project: str = ""
    debug_max: float = 900.0  # protected lengths up to this are labelled "debug"
    idle_protected: float = 3600.0  # a protected session idle this long may be stopped; 0: never
    idle_busy: float = 900.0  # ... past its protection, while a waiting request could use it
    offer_restore: bool = True  # "Bring it back after a preemption" on the form
    project_caps: Mapping[str, int] = field(default_factory=dict)  # most GPUs a project holds

    @property
    def gpu_counts(self) -> tuple[int, ...]:
        """The GPU counts offered: the admin's choices up to ``max_gpus``."""
        return tuple(n for n in self.gpus if 1 <= n <= self.max_gpus)


@dataclass(frozen=True, slots=True)
class ProjectView:
    """A project as the form shows it: its budget position and queue.

    ``used_fraction`` is the project's share of all charged usage in the
    broker's lookback window (``None`` while nobody has used anything);
    compared with ``entitlement`` it says whether the project is over or
    under its fair share. ``fairshare_value`` is the share used (``used_fraction``
    over ``entitlement``, 1 being exactly its share; lower goes first); ``rank`` 1
    is served first.
    """

    name: str
    entitlement: float
    usage: float
    used_fraction: float | None
    fairshare_value: float
    rank: int | None
    pending: int
    gpus_held: int

    @property
    def over_share(self) -> bool:
        return self.used_fraction is not None and self.used_fraction > self.entitlement


@dataclass(frozen=True, slots=True)
class GpuTypeView:
    """One GPU type of the cluster: how many GPUs, how many are free now, and how many
    are on nodes that take no new work (draining, drained or down)."""

    name: str
    total: int
    free: int
    out_of_service: int = 0


@dataclass(frozen=True, slots=True)
class SliceRequest:
    """A checked request: what the spawner asks the broker for."""

    project: str
    gpus: int
    gpu_type: str | None
    min_runtime: float
    restore: bool = False  # bring the session back after a preemption (design.md §3)
    restores: int | None = None  # the ended slice this request brings back


# ---- reading the broker's answers ------------------------------------------------


def project_views(
    rows: Iterable[Mapping[str, Any]], user: str, groups: Iterable[str]
) -> list[ProjectView]:
    """The projects ``user`` (a member of ``groups``) may charge, best ranked first.

    ``rows`` are ``GET /projects``'s; the total usage is summed over the top-level accounts.
    """
    rows = list(rows)
    groups = set(groups)
    total = sum(float(r.get("usage") or 0.0) for r in rows if r.get("parent") is None)
    views = []
    for row in rows:
        if not row.get("is_project"):
            continue
        if user not in (row.get("users") or ()) and groups.isdisjoint(row.get("groups") or ()):
            continue
        usage = float(row.get("usage") or 0.0)
        views.append(
            ProjectView(
                name=row["name"],
                entitlement=float(row.get("entitlement") or 0.0),
                usage=usage,
                used_fraction=usage / total if total > 0 else None,
                fairshare_value=float(row.get("fairshare_value") or 0.0),
                rank=row.get("rank"),
                pending=int(row.get("pending") or 0),
                gpus_held=int(row.get("gpus_held") or 0),
            )
        )
    return sorted(views, key=_rank_key)


def _rank_key(view: ProjectView) -> tuple[int, str]:
    return (view.rank if view.rank is not None else 1 << 30, view.name)


def gpu_type_views(nodes: Iterable[Mapping[str, Any]]) -> list[GpuTypeView]:
    """GPU types of the nodes that take work (``ready``) or will again (``draining``,
    ``drained``), by name: ``total`` GPUs, ``free`` now, and ``out_of_service`` on the
    draining and drained nodes (taking no new work). Down nodes count nowhere."""
    totals: dict[str, list[int]] = {}
    for node in nodes:
        state = node.get("state")
        if state not in ("ready", "draining", "drained") or not node.get("in_config", True):
            continue
        count = int(node.get("gpu_count") or 0)
        entry = totals.setdefault(node["gpu_type"], [0, 0, 0])
        entry[0] += count
        if state == "ready":
            entry[1] += max(count - int(node.get("gpus_held") or 0), 0)
        else:
            entry[2] += count
    return [GpuTypeView(name, *counts) for name, counts in sorted(totals.items())]


def out_of_service(nodes: Iterable[Mapping[str, Any]], gpu_type: str | None = None) -> list[str]:
    """``["test-0 draining (maintenance)", ...]``: the nodes (of ``gpu_type``, if given)
    that take no new work now, with the admin's reason."""
    found = []
    for node in nodes:
        if node.get("state") == "ready" or not node.get("in_config", True):
            continue
        if gpu_type and node.get("gpu_type") != gpu_type:
            continue
        reason = node.get("state_reason")
        found.append(f"{node['name']} {node.get('state')}" + (f" ({reason})" if reason else ""))
    return found


def capacity_note(
    nodes: Sequence[Mapping[str, Any]], gpus: int, gpu_type: str | None = None
) -> str:
    """What draining and down nodes mean for a request of ``gpus`` GPUs (of ``gpu_type``),
    in one or two sentences; empty when every node takes work."""
    out = out_of_service(nodes, gpu_type)
    if not out:
        return ""
    kind = f"{gpu_type} " if gpu_type else ""
    in_service = sum(
        int(n.get("gpu_count") or 0)
        for n in nodes
        if n.get("state") == "ready"
        and n.get("in_config", True)
        and (not gpu_type or n.get("gpu_type") == gpu_type)
    )
    nodes_out = f"Out of service: {', '.join(out)}."
    if in_service == 0:
        return (
            f"{nodes_out} No node with {kind}GPUs takes new work now, so nothing can start "
            "until an admin puts one back in service, and no start can be estimated."
        )
    if in_service < gpus:
        return (
            f"{nodes_out} Only {in_service} {kind}GPUs are in service: a request for {gpus} "
            "waits until more are back, and no start can be estimated."
        )
    return f"{nodes_out} Fewer GPUs than usual take work, so waits may be longer."


# ---- user options ---------------------------------------------------------------------


def options_from_form(form_data: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """Form fields (lists of strings) to user options: the first value of each known key."""
    options: dict[str, Any] = {}
    for key in OPTION_KEYS:
        values = form_data.get(key) or ()
        if values:
            options[key] = values[0].strip() if isinstance(values[0], str) else values[0]
    return options


def resolve_request(
    options: Mapping[str, Any],
    *,
    projects: Sequence[ProjectView],
    gpu_types: Sequence[GpuTypeView],
    choices: Choices,
) -> SliceRequest:
    """Check ``options`` against what the user may charge and the admin offers.

    ``projects`` are the user's (:func:`project_views`), ``gpu_types`` the
    cluster's. Raises :class:`OptionsError` with a message for the user.
    """
    if not isinstance(options, Mapping):
        raise OptionsError("invalid_options", "Server options must be a JSON object.")
    project = _project(options.get("project"), projects, choices)
    gpus = _gpus(options.get("gpus"), choices)
    cap = choices.project_caps.get(project)
    if cap is not None and gpus > cap:
        raise OptionsError(
            "project_cap",
            f"Project {project} may hold at most {cap} GPU{'s' if cap != 1 else ''} at a "
            f"time; you asked for {gpus}.",
        )
    gpu_type = _gpu_type(options.get("gpu_type"), gpu_types, choices)
    min_runtime = _protected(options.get("protected"), choices)
    restore = _yes(options.get("restore"), "restore")
    if restore and not choices.offer_restore:
        raise OptionsError("restore", "This hub does not bring sessions back after a preemption.")
    restores = options.get("restores")
    if restores is not None:
        restores = _whole(restores)
        if restores is None or restores < 1:
            raise OptionsError(
                "restores", f"restores must name a slice, got {_show(options.get('restores'))}."
            )
    return SliceRequest(
        project=project,
        gpus=gpus,
        gpu_type=gpu_type,
        min_runtime=min_runtime,
        restore=restore,
        restores=restores,
    )


def _yes(value: object, name: str) -> bool:
    """A yes/no option as a form (a checkbox's ``on``) or JSON (``true``) gives it."""
    if value in (None, "", False, "off", "false", "no", "0", 0):
        return False
    if value in (True, "on", "true", "yes", "1", 1):
        return True
    raise OptionsError(name, f"{name} must be yes or no, got {_show(value)}.")


def _project(value: object, projects: Sequence[ProjectView], choices: Choices) -> str:
    names = [p.name for p in projects]
    if not names:
        raise OptionsError(
            "no_project",
            "You are not a member of any project that may use GPUs, so there is no budget "
            "to charge a session to (protected or free). Ask your hub admin to add you, "
            "or one of your groups, to a project.",
        )
    if value in (None, ""):
        if choices.default_project in names:
            return choices.default_project
        return names[0]
    if not isinstance(value, str) or value not in names:
        raise OptionsError(
            "project",
            f"You cannot charge project {_show(value)}. Your projects: {', '.join(names)}.",
        )
    return value


def _gpus(value: object, choices: Choices) -> int:
    offered = choices.gpu_counts
    if value in (None, ""):
        return choices.default_gpus
    number = _whole(value)
    if number is None or number < 1:
        raise OptionsError(
            "gpus", f"The number of GPUs must be a whole number of at least 1, got {_show(value)}."
        )
    if number > choices.max_gpus:
        raise OptionsError(
            "too_many_gpus",
            f"You asked for {number} GPUs; a session here may have at most {choices.max_gpus}.",
        )
    if offered and number not in offered:
        raise OptionsError(
            "gpus",
            f"{number} GPUs is not offered; choose one of: {', '.join(map(str, offered))}.",
        )
    return number


def _gpu_type(value: object, gpu_types: Sequence[GpuTypeView], choices: Choices) -> str | None:
    if value in (None, "", "any"):
        return None
    offered = offered_gpu_types(gpu_types, choices)
    if not isinstance(value, str) or value not in offered:
        known = ", ".join(offered) or "none"
        raise OptionsError(
            "gpu_type", f"Unknown GPU type {_show(value)}; this hub offers: {known}."
        )
    return value


def offered_gpu_types(gpu_types: Sequence[GpuTypeView], choices: Choices) -> list[str]:
    """The GPU types a user may pick: the admin's list, else every type the cluster has."""
    if choices.gpu_types:
        return list(choices.gpu_types)
    return [t.name for t in gpu_types]


def _protected(value: object, choices: Choices) -> float:
    if value in (None, ""):
        return choices.protected_default
    try:
        seconds = parse_duration(value)
    except ValueError:
        seconds = None
    if seconds is None or seconds not in choices.protected:
        offered = ", ".join(format_duration(s) for s in choices.protected)
        raise OptionsError(
            "protected",
            f"Protected length {_show(value)} is not offered; choose one of: {offered}.",
        )
    return seconds


def _whole(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _show(value: object) -> str:
    text = repr(value) if not isinstance(value, str) else f"'{value}'"
    return text if len(text) <= 60 else text[:57] + "...'"


# ---- wording -----------------------------------------------------------------------------


def protected_label(seconds: float, choices: Choices) -> str:
    """How the form names a protected length."""
    if seconds == 0:
        return "0 — free: not charged, but any charged request may preempt it at any time"
    text = duration_text(seconds)
    if seconds <= choices.debug_max:
        return f"{text} — debug: gets a GPU fastest"
    return text


def percent(fraction: float | None) -> str:
    if fraction is None:
        return "—"
    value = 100 * fraction
    return f"{value:.0f}%" if value >= 10 or value == 0 else f"{value:.1f}%"


def budget_position(project: ProjectView) -> str:
    """One line on where the project stands: usage against entitlement, rank, queue."""
    if project.used_fraction is None:
        used = "no GPU time used yet"
    else:
        used = f"used {percent(project.used_fraction)} of GPU time"
        used += " (over its share)" if project.over_share else " (within its share)"
    rank = f"rank {project.rank}" if project.rank is not None else "unranked"
    waiting = f"{project.pending} waiting" if project.pending else "nobody waiting"
    return f"entitled to {percent(project.entitlement)}, {used}; {rank}; {waiting}"


def _short_position(project: ProjectView) -> str:
    rank = f"rank {project.rank}" if project.rank is not None else "unranked"
    used = percent(project.used_fraction) if project.used_fraction is not None else "0%"
    waiting = f"{project.pending} waiting" if project.pending else "nobody waiting"
    return f"{rank} · used {used} (entitled {percent(project.entitlement)}) · {waiting}"


# ---- the form ------------------------------------------------------------------------------

#: The options form's template, looked up first in the admin's directories
#: (``SliceBrokerMixin.options_form_template_paths``), then in :data:`TEMPLATES`.
FORM_TEMPLATE = "slicebroker_options_form.html"
#: The templates shipped with the spawner.
TEMPLATES = str(Path(__file__).with_name("templates"))


@dataclass(frozen=True, slots=True)
class FieldOption:
    """One ``<option>`` of a field: the value sent, the words shown, whether it is
    preselected, and (projects only) the most GPUs the project may hold and when a
    session charged to it would start (:func:`expected_start_text`)."""

    value: str
    label: str
    selected: bool = False
    cap: int | None = None
    expected: str = ""


@dataclass(frozen=True, slots=True)
class BudgetRow:
    """A project's row of the budget table, every cell as the form writes it."""

    name: str
    rank: str
    entitled: str
    used: str
    fairshare: str
    pending: int
    gpus_held: int


def render_form(*, template_paths: Sequence[str] = (), **view: Any) -> str:
    """The options form's HTML (the fields only; JupyterHub adds the ``<form>`` and Start).

    :func:`form_context` computes what the form shows from ``view`` (its arguments); the
    template :data:`FORM_TEMPLATE`, from ``template_paths`` or else the shipped one, lays
    it out.
    """
    return form_template(template_paths).render(form_context(**view))


def form_template(template_paths: Sequence[str] = ()) -> Template:
    """The form's template: the first :data:`FORM_TEMPLATE` in ``template_paths``, else the
    shipped one. Autoescaped; a file edited since the last render is read again."""
    return _environment(tuple(template_paths)).get_template(FORM_TEMPLATE)


@lru_cache(maxsize=16)
def _environment(template_paths: tuple[str, ...]) -> Environment:
    # One environment per search path: it keeps the compiled template between forms.
    loader = ChoiceLoader([FileSystemLoader(list(template_paths)), FileSystemLoader(TEMPLATES)])
    return Environment(loader=loader, autoescape=True, trim_blocks=True, lstrip_blocks=True)


def form_context(
    *,
    projects: Sequence[ProjectView],
    gpu_types: Sequence[GpuTypeView],
    choices: Choices,
    previous: Mapping[str, Any] | None = None,
    notice_html: str = "",
    queue_total: int = 0,
    capacity: str = "",
    queue_url: str = "",
    broker_error: str = "",
    expected: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """What the form's template receives (docs/hub-admin.md lists it).

    ``previous`` (the last user options) preselects values; ``notice_html``
    (why the last session ended) and ``capacity`` (:func:`capacity_note`: draining and
    down nodes) go above the fields; ``queue_url`` links to the broker's queue page;
    ``broker_error`` (the broker could not be asked) replaces the whole form;
    ``expected`` (project -> its ``GET /expected-starts``) says when each size would
    start, for the project chosen (``expected_text``; each project option carries its
    own, which the shipped form shows as the choice changes).
    """
    previous = previous or {}
    texts = {
        name: expected_start_text(answer, choices) for name, answer in (expected or {}).items()
    }
    project_options = _project_options(projects, previous, choices, texts)
    return {
        "expected_text": next((o.expected for o in project_options if o.selected), ""),
        "broker_error": broker_error,
        "notice_html": Markup(notice_html),  # the notice's own HTML, escaped where it is made
        "capacity": capacity,
        "projects": list(projects),
        "project_options": project_options,
        "budget_rows": [_budget_row(p) for p in projects],
        "queue_total": queue_total,
        "queue_text": _queue_text(queue_total),
        "queue_url": queue_url,
        "gpu_options": _gpu_options(choices, previous),
        "capped": bool(choices.project_caps),
        "gpu_type_options": _gpu_type_options(gpu_types, choices, previous),
        "protected_options": _protected_options(choices, previous),
        "idle_rule": idle_rule(choices),
        "restore_checked": _restore_checked(previous),
        "choices": choices,
        "previous": previous,
    }


def _restore_checked(previous: Mapping[str, Any]) -> bool:
    """Whether the form's "bring it back" box starts checked: as the last session had it."""
    try:
        return _yes(previous.get("restore"), "restore")
    except OptionsError:
        return False


def chosen_project(
    projects: Sequence[ProjectView], previous: Mapping[str, Any] | None, choices: Choices
) -> str | None:
    """The project the form preselects: the last one used, else the admin's default,
    else the first the user may charge."""
    names = [p.name for p in projects]
    chosen = (previous or {}).get("project")
    if chosen in names:
        return chosen
    if choices.default_project in names:
        return choices.default_project
    return names[0] if names else None


def expected_start_text(expected: Mapping[str, Any], choices: Choices) -> str:
    """When a new session would start, by GPU type and the sizes the form offers
    (``GET /expected-starts``): "Expected start for vision (1 h protected): h100 — 1
    GPU now · 2 GPUs in about 5 min; b200 — 1 GPU now."."""
    now = float(expected.get("now") or 0.0)
    offered = set(choices.gpu_counts or (choices.default_gpus,))
    by_type: dict[str, list[str]] = {}
    for entry in expected.get("starts") or ():
        if entry["gpus"] not in offered:
            continue
        starts = entry.get("starts_at")
        if starts is None:
            when = "no estimate yet"
        elif starts <= now:
            when = "now"
        else:
            when = f"in about {minutes(starts - now)}"
        plural = "s" if entry["gpus"] != 1 else ""
        by_type.setdefault(entry["gpu_type"], []).append(f"{entry['gpus']} GPU{plural} {when}")
    if not by_type:
        return ""
    protected = duration_text(float(expected.get("min_runtime") or 0.0))
    items = "; ".join(f"{name} — {' · '.join(sizes)}" for name, sizes in by_type.items())
    return f"Expected start for {expected.get('project')} ({protected} protected): {items}."


def _project_options(
    projects: Sequence[ProjectView],
    previous: Mapping[str, Any],
    choices: Choices,
    expected: Mapping[str, str],
) -> list[FieldOption]:
    chosen = chosen_project(projects, previous, choices)
    if chosen is None:
        return []
    caps = choices.project_caps
    return [
        FieldOption(
            value=p.name,
            label=f"{p.name} — {_short_position(p)}",
            selected=p.name == chosen,
            cap=int(caps[p.name]) if p.name in caps else None,
            expected=expected.get(p.name, ""),
        )
        for p in projects
    ]


def _budget_row(project: ProjectView) -> BudgetRow:
    return BudgetRow(
        name=project.name,
        rank=str(project.rank) if project.rank is not None else "—",
        entitled=percent(project.entitlement),
        used=percent(project.used_fraction) + (" ▲" if project.over_share else ""),
        fairshare=share_used(project.fairshare_value, words=False),
        pending=project.pending,
        gpus_held=project.gpus_held,
    )


def _queue_text(queue_total: int) -> str:
    if not queue_total:
        return "Nobody is waiting for GPUs right now."
    return f"{queue_total} request{'s' if queue_total != 1 else ''} waiting in the whole queue."


def _gpu_options(choices: Choices, previous: Mapping[str, Any]) -> list[FieldOption]:
    chosen = _whole(previous.get("gpus"))
    counts = choices.gpu_counts or (choices.default_gpus,)
    if chosen not in counts:
        chosen = choices.default_gpus
    return [FieldOption(value=str(n), label=str(n), selected=n == chosen) for n in counts]


def _gpu_type_options(
    gpu_types: Sequence[GpuTypeView], choices: Choices, previous: Mapping[str, Any]
) -> list[FieldOption]:
    by_name = {t.name: t for t in gpu_types}
    offered = offered_gpu_types(gpu_types, choices)
    chosen = previous.get("gpu_type") or ""
    options = [FieldOption(value="", label="any type", selected=chosen not in offered)]
    for name in offered:
        view = by_name.get(name)
        free = ""
        if view:
            out = f"; {view.out_of_service} on draining nodes" if view.out_of_service else ""
            free = f" ({view.free} of {view.total} free now{out})"
        options.append(FieldOption(value=name, label=name + free, selected=name == chosen))
    return options


def _protected_options(choices: Choices, previous: Mapping[str, Any]) -> list[FieldOption]:
    try:
        chosen = parse_duration(previous.get("protected"))
    except ValueError:
        chosen = None
    if chosen not in choices.protected:
        chosen = choices.protected_default
    return [
        FieldOption(
            value=format_duration(s), label=protected_label(s, choices), selected=s == chosen
        )
        for s in choices.protected
    ]


def idle_rule(choices: Choices) -> str:
    """What the form promises about idle sessions (see :mod:`spawner.culler`)."""
    if choices.idle_protected:
        protected = (
            f"Even while protected, a session idle for {duration_text(choices.idle_protected)} "
            "is stopped if a waiting request could use its GPUs."
        )
    else:
        protected = "A protected session is never stopped for being idle."
    if choices.idle_busy:
        after = (
            f" After its protection, {duration_text(choices.idle_busy)} idle is enough while "
            "a waiting request could use its GPUs."
        )
    else:
        after = ""
    return protected + after
