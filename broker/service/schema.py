"""The API's JSON schemas, and the checks that hold requests to them.

The component schemas below are published as they are in ``/openapi.json``
(:mod:`broker.service.openapi`), and request bodies and query parameters are
checked against the very same schemas by :func:`validate`, so the document and
the handlers cannot drift apart. :func:`validate` understands the subset of
OpenAPI 3.0 schemas used here: ``type`` (with ``nullable``), ``enum``,
``properties``/``required``/``additionalProperties``, ``items``, ``minimum``/
``maximum`` (with 3.0's boolean ``exclusiveMinimum``), ``minLength``/
``maxLength``, ``pattern``, ``minItems``/``maxItems``, ``anyOf`` and ``$ref``
to a component.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import Any

from ..core.model import EndReason, NodeState, PreemptReason, SliceKind, SliceState
from ..errors import InvalidRequest
from ..orm import DRAIN_ORIGINS
from ..validation import PRIORITY_MAX, PRIORITY_MIN

REF_PREFIX = "#/components/schemas/"

#: What ``parse_duration`` reads as text: a number of seconds, or parts such as ``1h30m``.
DURATION_PATTERN = (
    r"^\s*(?:(?:\d+(?:\.\d*)?|\.\d+)|(?:\s*(?:\d+(?:\.\d*)?|\.\d+)\s*[smhdwSMHDW])+)\s*$"
)
#: The broker's account names (as ``broker.config`` accepts them in the file).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
#: Shares an admin may set through the API.
MIN_SHARE = 1e-6
MAX_SHARE = 1e6


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF_PREFIX + name}


def _nullable(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


def _enum(values: list[str], *, nullable: bool = False, description: str = "") -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "enum": [*values, *([None] if nullable else [])]}
    if nullable:
        schema["nullable"] = True
    if description:
        schema["description"] = description
    return schema


def _obj(
    properties: Mapping[str, Any], required: list[str] | None = None, description: str = ""
) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": dict(properties),
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    if description:
        schema["description"] = description
    return schema


EPOCH = {"type": "number", "description": "seconds since the epoch"}
EPOCH_OR_NULL = _nullable(EPOCH)
SECONDS = {"type": "number", "minimum": 0, "description": "seconds"}
STRINGS = {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 255}}
#: Text without control characters: a name with one matches no login (its user would
#: silently lose access) and PostgreSQL refuses NUL in text.
TEXT_PATTERN = r"^[^\u0000-\u001f\u007f]*$"
#: A user, group, project or GPU type name in a request.
NAME_TEXT = {"type": "string", "minLength": 1, "maxLength": 255, "pattern": TEXT_PATTERN}
#: A list of user or group names in a request.
NAMES = {"type": "array", "items": NAME_TEXT}


def duration(description: str, *, nullable: bool = False) -> dict[str, Any]:
    """Seconds as a number, or text such as ``"90s"``, ``"15m"``, ``"1h30m"``."""
    schema: dict[str, Any] = {
        "anyOf": [
            {"type": "number", "minimum": 0},
            {"type": "string", "pattern": DURATION_PATTERN, "maxLength": 64},
        ],
        "description": description
        + " Seconds (a number) or a duration string such as '90s', '15m', '2h', '1h30m'.",
    }
    if nullable:
        schema["nullable"] = True
    return schema


COMPONENTS: dict[str, dict[str, Any]] = {
    "Error": _obj(
        {
            "error": _obj(
                {
                    "code": {
                        "type": "string",
                        "description": "stable, machine-readable name of the error",
                    },
                    "message": {"type": "string", "description": "what went wrong, for people"},
                },
                ["code", "message"],
            )
        },
        ["error"],
        "Every 4xx/5xx response has this shape.",
    ),
    "Version": _obj(
        {
            "version": {"type": "string"},
            "api": {"type": "string", "enum": ["v1"]},
            "role": _enum(
                ["leader", "standby"],
                description="`leader`: this broker serves the API; `standby`: it waits "
                "for the leader lock and answers every other request 503 `standby`",
            ),
        },
        ["version", "api"],
    ),
    "Identity": _obj(
        {
            "name": {"type": "string"},
            "kind": _enum(["user", "service"]),
            "groups": STRINGS,
            "admin": {"type": "boolean"},
            "agent": {
                "type": "boolean",
                "description": "may act on behalf of any user (e.g. the JupyterHub spawner)",
            },
            "projects": {
                **STRINGS,
                "description": "the projects this identity may charge (every project for admins)",
            },
        },
        ["name", "kind", "groups", "admin", "agent", "projects"],
    ),
    "Placement": _obj(
        {
            "node": {"type": "string"},
            "gpu_indices": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        },
        ["node", "gpu_indices"],
    ),
    "SliceRequest": _obj(
        {
            "project": {
                "type": "string",
                "minLength": 1,
                "maxLength": 255,
                "pattern": TEXT_PATTERN,
                "description": "the project to charge; the caller (or `user`) must be a member",
            },
            "gpus": {"type": "integer", "minimum": 1, "maximum": 100000},
            "gpu_type": {
                "type": "string",
                "minLength": 1,
                "maxLength": 255,
                "pattern": TEXT_PATTERN,
                "nullable": True,
                "description": "a GPU type (e.g. h100); any type when left out",
            },
            "kind": _enum([k.value for k in SliceKind]),
            "min_runtime": duration(
                "Protected period after the grant; 0 makes the slice unallocated (free and "
                "preemptible). Default: the configuration's default for the kind.",
                nullable=True,
            ),
            "resumable": {
                "type": "boolean",
                "nullable": True,
                "description": "requeue (batch) instead of ending when preempted",
            },
            "max_runtime": duration(
                "Hard end after the grant. Default: the configuration's default for the kind.",
                nullable=True,
            ),
            "priority": {
                "type": "integer",
                "minimum": PRIORITY_MIN,
                "maximum": PRIORITY_MAX,
                "nullable": True,
                "description": "orders slices within the project only; default 0",
            },
            "user": {
                "type": "string",
                "minLength": 1,
                "maxLength": 255,
                "pattern": TEXT_PATTERN,
                "nullable": True,
                "description": "submit on behalf of this user (agents and admins only; "
                "others may only name themselves)",
            },
            "groups": {
                **NAMES,
                "nullable": True,
                "description": "the user's groups, for membership (agents and admins only; "
                "others may only repeat their own)",
            },
        },
        ["project", "gpus", "kind"],
    ),
    "Slice": _obj(
        {
            "id": {"type": "integer"},
            "project": {"type": "string"},
            "user": {"type": "string"},
            "gpus": {"type": "integer"},
            "gpu_type": _nullable({"type": "string"}),
            "kind": _enum([k.value for k in SliceKind]),
            "min_runtime": SECONDS,
            "resumable": {"type": "boolean"},
            "max_runtime": _nullable(SECONDS),
            "priority": {"type": "integer"},
            "state": _enum([s.value for s in SliceState]),
            "end_reason": _enum([r.value for r in EndReason], nullable=True),
            "placements": {"type": "array", "items": ref("Placement")},
            "submitted_at": EPOCH,
            "granted_at": EPOCH_OR_NULL,
            "protected_until": EPOCH_OR_NULL,
            "preempt_deadline": EPOCH_OR_NULL,
            "preempt_reason": _enum([r.value for r in PreemptReason], nullable=True),
            "ended_at": EPOCH_OR_NULL,
            "lease_expires_at": EPOCH_OR_NULL,
            "queue_position": _nullable({"type": "integer", "minimum": 1}),
            "fairshare_value": _nullable({"type": "number"}),
            "estimated_start": EPOCH_OR_NULL,
            "charged_gpu_seconds": {
                "type": "number",
                "description": "weighted GPU-seconds charged so far (accruing while held)",
            },
        },
        [
            "id",
            "project",
            "user",
            "gpus",
            "gpu_type",
            "kind",
            "min_runtime",
            "resumable",
            "max_runtime",
            "priority",
            "state",
            "end_reason",
            "placements",
            "submitted_at",
            "granted_at",
            "protected_until",
            "preempt_deadline",
            "preempt_reason",
            "ended_at",
            "lease_expires_at",
            "queue_position",
            "fairshare_value",
            "estimated_start",
            "charged_gpu_seconds",
        ],
    ),
    "SliceList": _obj(
        {"slices": {"type": "array", "items": ref("Slice")}},
        ["slices"],
    ),
    "SliceEvent": _obj(
        {
            "at": EPOCH,
            "from_state": _enum([s.value for s in SliceState], nullable=True),
            "to_state": _enum([s.value for s in SliceState]),
            "reason": {"type": "string"},
        },
        ["at", "from_state", "to_state", "reason"],
    ),
    "SliceEventList": _obj(
        {"events": {"type": "array", "items": ref("SliceEvent")}},
        ["events"],
    ),
    "Project": _obj(
        {
            "name": {"type": "string"},
            "parent": _nullable({"type": "string"}),
            "share": {"type": "number"},
            "entitlement": {
                "type": "number",
                "description": "fraction of the cluster (product of share ratios down the tree)",
            },
            "is_project": {
                "type": "boolean",
                "description": "a leaf that runs work (false for parent accounts)",
            },
            "usage": {
                "type": "number",
                "description": "weighted GPU-seconds in the lookback window, summed over "
                "the subtree",
            },
            "fairshare_value": {"type": "number", "description": "usage / entitlement"},
            "rank": _nullable({"type": "integer", "minimum": 1}),
            "users": STRINGS,
            "groups": STRINGS,
            "pending": {"type": "integer", "description": "slices waiting"},
            "gpus_held": {"type": "integer"},
        },
        [
            "name",
            "parent",
            "share",
            "entitlement",
            "is_project",
            "usage",
            "fairshare_value",
            "rank",
            "users",
            "groups",
            "pending",
            "gpus_held",
        ],
    ),
    "ProjectList": _obj(
        {"projects": {"type": "array", "items": ref("Project")}},
        ["projects"],
    ),
    "ProjectUpdate": _obj(
        {
            "share": {
                "type": "number",
                "minimum": MIN_SHARE,
                "maximum": MAX_SHARE,
                "description": "weight among siblings; kept within a range where entitlements "
                "(products of share ratios down the tree) stay well above zero",
            },
            "parent": {
                "type": "string",
                "minLength": 1,
                "maxLength": 255,
                "pattern": TEXT_PATTERN,
                "nullable": True,
                "description": "parent account; top level when null or left out",
            },
            "users": {**NAMES, "description": "replace the members (users) when given"},
            "groups": {**NAMES, "description": "replace the members (groups) when given"},
        },
        ["share"],
    ),
    "AccountState": _nullable(
        _obj(
            {
                "share": {"type": "number"},
                "parent": _nullable({"type": "string"}),
                "users": STRINGS,
                "groups": STRINGS,
            },
            ["share", "parent", "users", "groups"],
            "an account and its members; null where the account does not exist",
        )
    ),
    "ProjectEvent": _obj(
        {
            "id": {"type": "integer"},
            "account": {"type": "string"},
            "who": {
                "type": "string",
                "description": "the admin who made the change, or 'file NAME' for the "
                "cluster file that seeded the tree",
            },
            "at": EPOCH,
            "action": _enum(
                ["seed", "set", "apply", "delete"],
                description="seed: from the cluster file on the first start; set: "
                "PUT /projects/{name}; apply: PUT /projects; delete: DELETE /projects/{name}",
            ),
            "before": ref("AccountState"),
            "after": ref("AccountState"),
        },
        ["id", "account", "who", "at", "action", "before", "after"],
    ),
    "ProjectEventList": _obj(
        {"events": {"type": "array", "items": ref("ProjectEvent")}},
        ["events"],
    ),
    "ProjectTree": _obj(
        {
            "projects": {
                "type": "array",
                "items": _obj(
                    {
                        "name": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 255,
                            "pattern": NAME_PATTERN,
                        },
                        "share": {"type": "number", "minimum": MIN_SHARE, "maximum": MAX_SHARE},
                        "parent": {**NAME_TEXT, "nullable": True},
                        "users": NAMES,
                        "groups": NAMES,
                    },
                    ["name", "share"],
                ),
            }
        },
        ["projects"],
        "the whole project tree with its members, as the cluster file's [projects] gives it",
    ),
    "ProjectChange": _obj(
        {
            "account": {"type": "string"},
            "change": _enum(["added", "removed", "changed"]),
            "before": ref("AccountState"),
            "after": ref("AccountState"),
        },
        ["account", "change", "before", "after"],
    ),
    "ProjectChangeList": _obj(
        {
            "changes": {"type": "array", "items": ref("ProjectChange")},
            "applied": {"type": "boolean", "description": "false for a dry run"},
        },
        ["changes", "applied"],
    ),
    "UsageRow": _obj(
        {
            "project": {"type": "string"},
            "user": {"type": "string", "description": "present when by=user"},
            "since": EPOCH,
            "until": EPOCH,
            "slices": {"type": "integer"},
            "gpu_seconds": {"type": "number"},
            "weighted_gpu_seconds": {"type": "number"},
        },
        ["project", "since", "until", "slices", "gpu_seconds", "weighted_gpu_seconds"],
    ),
    "UsageReport": _obj(
        {
            "project": {"type": "string"},
            "by": _enum(["user", "project"]),
            "usage": {"type": "array", "items": ref("UsageRow")},
        },
        ["project", "by", "usage"],
    ),
    "Node": _obj(
        {
            "name": {"type": "string"},
            "gpu_type": {"type": "string"},
            "gpu_count": {"type": "integer"},
            "weight": {"type": "number", "description": "cost units per GPU-second"},
            "state": _enum([s.value for s in NodeState]),
            "state_reason": {"type": "string"},
            "state_changed_at": EPOCH_OR_NULL,
            "in_config": {"type": "boolean"},
            "drained_by": _enum(
                list(DRAIN_ORIGINS),
                nullable=True,
                description="who took the node out of service: an admin (it stays out until "
                "an admin undrains it) or the live inventory (a Kubernetes cordon, undone by "
                "an uncordon); null when nobody did",
            ),
            "gpus_held": {"type": "integer"},
        },
        [
            "name",
            "gpu_type",
            "gpu_count",
            "weight",
            "state",
            "state_reason",
            "state_changed_at",
            "in_config",
            "drained_by",
            "gpus_held",
        ],
    ),
    "NodeList": _obj(
        {"nodes": {"type": "array", "items": ref("Node")}},
        ["nodes"],
    ),
    "NodeChange": _obj(
        {"reason": {"type": "string", "maxLength": 1000, "description": "shown on the node"}},
    ),
}


# ---- validation -------------------------------------------------------------------


def validate(value: Any, schema: Mapping[str, Any], where: str = "body") -> None:
    """Raise :class:`InvalidRequest` naming the first place where ``value`` breaks ``schema``."""
    problem = _problem(value, schema, where)
    if problem is not None:
        raise InvalidRequest(problem)


_TYPES = {
    "object": (lambda v: isinstance(v, dict), "an object"),
    "array": (lambda v: isinstance(v, list), "an array"),
    "string": (lambda v: isinstance(v, str), "a string"),
    "boolean": (lambda v: isinstance(v, bool), "true or false"),
    "integer": (lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
    "number": (
        lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
        "a number",
    ),
}


@functools.cache
def _pattern(pattern: str) -> re.Pattern[str]:
    """``pattern`` as JSON Schema (ECMA 262) reads it: a final ``$`` is the end of the
    text, where Python's ``$`` also matches before a final newline (``"a\\n"``)."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"
    return re.compile(pattern)


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _problem(value: Any, schema: Mapping[str, Any], where: str) -> str | None:
    if "$ref" in schema:
        return _problem(value, COMPONENTS[schema["$ref"].removeprefix(REF_PREFIX)], where)
    if value is None:
        return None if schema.get("nullable") else f"{where} must not be null"
    if "anyOf" in schema:
        problems = [_problem(value, option, where) for option in schema["anyOf"]]
        if all(problems):
            return next(p for p in problems if p)
        return None
    kind = schema.get("type")
    if kind is not None:
        check, name = _TYPES[kind]
        if not check(value):
            return f"{where} must be {name}, got {_describe(value)}"
    if "enum" in schema and value not in schema["enum"]:
        choices = ", ".join(str(v) for v in schema["enum"] if v is not None)
        return f"{where} must be one of {choices}; got {_describe(value)}"
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return f"{where} must not be empty" if not value else f"{where} is too short"
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return f"{where} is longer than {schema['maxLength']} characters"
        if "pattern" in schema and not _pattern(schema["pattern"]).search(value):
            return f"{where} has an invalid format: {_describe(value)}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema:
            low = schema["minimum"]
            if schema.get("exclusiveMinimum") and not value > low:
                return f"{where} must be > {low:g}, got {value!r}"
            if value < low:
                return f"{where} must be >= {low:g}, got {value!r}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{where} must be <= {schema['maximum']:g}, got {value!r}"
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            return f"{where} needs at least {schema['minItems']} items"
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            return f"{where} has more than {schema['maxItems']} items"
        items = schema.get("items")
        if items is not None:
            for index, item in enumerate(value):
                problem = _problem(item, items, f"{where}[{index}]")
                if problem:
                    return problem
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return f"{where} needs {key!r}"
        if schema.get("additionalProperties") is False:
            for key in value:
                if key not in properties:
                    known = ", ".join(properties)
                    return f"{where} has an unknown key {key!r}; expected: {known}"
        for key, item in value.items():
            if key in properties:
                problem = _problem(item, properties[key], f"{where}.{key}")
                if problem:
                    return problem
    return None
