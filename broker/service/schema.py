"""The API's schemas, as pydantic models, and the check that holds requests to them.

Every component of ``/openapi.json`` (:mod:`broker.service.openapi`) is the
JSON schema of one model below (:data:`COMPONENTS`, in OpenAPI 3.0's dialect:
:class:`OpenAPI30`), and :func:`validate` holds request bodies to the very same
models, so the document and the handlers cannot drift apart. Parameters are
declared as OpenAPI schemas (:class:`~broker.service.apihandlers.base.Param`);
:func:`validate` checks them with the pydantic type each describes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
)
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import ErrorDetails, core_schema

from ..core.model import EndReason, NodeState, PreemptReason, SliceKind, SliceState
from ..errors import InvalidRequest
from ..orm import DRAIN_ORIGINS
from ..validation import (
    NAME_MAX_LENGTH,
    PRIORITY_MAX,
    PRIORITY_MIN,
    REASON_MAX_LENGTH,
    TEXT_PATTERN,
)

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

#: Exactly the declared types: a boolean is no number, 1.0 no whole number, "2" no
#: number; numbers are finite (JSON's 1e400 reads as infinity).
STRICT = ConfigDict(strict=True, allow_inf_nan=False)


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF_PREFIX + name}


class OpenAPI30(GenerateJsonSchema):
    """JSON schemas as OpenAPI 3.0 writes them: ``nullable`` rather than a null type,
    ``enum`` rather than ``const``; no titles, and no defaults (a description says
    what leaving a key out means)."""

    def nullable_schema(self, schema: core_schema.NullableSchema) -> JsonSchemaValue:
        inner = self.generate_inner(schema["schema"])
        if "$ref" in inner:
            # 3.0 ignores a $ref's siblings: a model that may be null says so in its own
            # component (AccountState).
            return inner
        if "enum" in inner:
            inner = {**inner, "enum": [*inner["enum"], None]}
        return {**inner, "nullable": True}

    def literal_schema(self, schema: core_schema.LiteralSchema) -> JsonSchemaValue:
        json_schema = super().literal_schema(schema)
        if "const" in json_schema:
            json_schema["enum"] = [json_schema.pop("const")]
        return json_schema

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        return self.generate_inner(schema["schema"])

    def model_schema(self, schema: core_schema.ModelSchema) -> JsonSchemaValue:
        json_schema = super().model_schema(schema)
        json_schema.pop("title", None)
        return json_schema

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


# ---- the types of values ---------------------------------------------------------------

#: A user, group, project or GPU type name in a request (the free-text rule of
#: broker.validation: a name with a control character matches no login).
NameText = Annotated[
    str, StringConstraints(min_length=1, max_length=NAME_MAX_LENGTH, pattern=TEXT_PATTERN)
]
#: A reason shown on a node, under the same rule.
ReasonText = Annotated[str, StringConstraints(max_length=REASON_MAX_LENGTH, pattern=TEXT_PATTERN)]
#: Its schema, for the parameters that take one.
NAME_TEXT = TypeAdapter(NameText, config=STRICT).json_schema(schema_generator=OpenAPI30)
#: An account's name where one is made: as the configuration file allows them.
NewName = Annotated[
    str, StringConstraints(min_length=1, max_length=NAME_MAX_LENGTH, pattern=NAME_PATTERN)
]
Share = Annotated[float, Field(ge=MIN_SHARE, le=MAX_SHARE)]
#: Names in an answer.
Names = list[Annotated[str, StringConstraints(min_length=1, max_length=255)]]
Epoch = Annotated[float, Field(description="seconds since the epoch")]
Seconds = Annotated[float, Field(ge=0, description="seconds")]

_DURATION_SECONDS = TypeAdapter(Annotated[float, Field(ge=0)], config=STRICT)
_DURATION_TEXT = TypeAdapter(
    Annotated[str, StringConstraints(max_length=64, pattern=DURATION_PATTERN)], config=STRICT
)


def _duration(value: Any) -> float | str:
    """A number of seconds or a duration text, each held to its own rules (a union
    would answer with the problems of both)."""
    if isinstance(value, str):
        return _DURATION_TEXT.validate_python(value)
    return _DURATION_SECONDS.validate_python(value)


#: Seconds as a number, or text such as ``"90s"``, ``"15m"``, ``"1h30m"``.
Duration = Annotated[
    float | str,
    PlainValidator(_duration),
    WithJsonSchema({"anyOf": [_DURATION_SECONDS.json_schema(), _DURATION_TEXT.json_schema()]}),
]


def duration_field(description: str) -> Any:
    """The field of a duration a request may leave out."""
    return Field(
        None,
        description=description
        + " Seconds (a number) or a duration string such as '90s', '15m', '2h', '1h30m'.",
    )


def _enum(values: Sequence[str]) -> Any:
    return Literal[tuple(values)]


SliceKindName = _enum([k.value for k in SliceKind])
SliceStateName = _enum([s.value for s in SliceState])
EndReasonName = _enum([r.value for r in EndReason])
PreemptReasonName = _enum([r.value for r in PreemptReason])
NodeStateName = _enum([s.value for s in NodeState])
DrainOrigin = _enum(DRAIN_ORIGINS)


# ---- the components ----------------------------------------------------------------------


class ApiObject(BaseModel):
    """A JSON object of the API: exactly its keys (others are refused), each of exactly
    its type. A key that may be left out defaults to None, which is never validated:
    an explicit null is refused unless the key's type allows it."""

    model_config = ConfigDict(**STRICT, extra="forbid")


class ErrorDetail(ApiObject):
    code: str = Field(description="stable, machine-readable name of the error")
    message: str = Field(description="what went wrong, for people")


class Error(ApiObject):
    """Every 4xx/5xx response has this shape."""

    error: ErrorDetail


class Version(ApiObject):
    version: str
    api: Literal["v1"]
    role: Literal["leader", "standby"] = Field(
        None,
        description="`leader`: this broker serves the API; `standby`: it waits for the "
        "leader lock and answers every other request 503 `standby`",
    )


class Identity(ApiObject):
    name: str
    kind: Literal["user", "service"]
    groups: Names
    admin: bool
    agent: bool = Field(description="may act on behalf of any user (e.g. the JupyterHub spawner)")
    projects: Names = Field(
        description="the projects this identity may charge (every project for admins)"
    )


Seconds = Annotated[float, Field(ge=0)]


class KindTerms(ApiObject):
    min_runtime: Seconds = Field(description="the protected period a request of this kind gets")
    resumable: bool
    max_runtime: Seconds | None = Field(description="its hard end; null: none")


class Limits(ApiObject):
    lease: Seconds = Field(description="how long a heartbeat keeps a slice")
    grace_period: Seconds = Field(description="a preempted slice's time to checkpoint")
    max_min_runtime: Seconds = Field(description="the longest protected period a contract may have")
    debug_max_gpus: Annotated[int, Field(ge=0)] = Field(
        description="the most GPUs of a debug session (the debug lane)"
    )
    debug_max_min_runtime: Seconds = Field(
        description="the longest protected period of a debug session"
    )
    project_gpu_caps: dict[str, Annotated[int, Field(ge=0)]] = Field(
        description="project -> the most GPUs it may hold at once; projects not named have no cap"
    )
    preemption_budget: Annotated[int, Field(ge=1)] | None = Field(
        description="preemptions a slice under contract may suffer (drains aside); a slice "
        "preempted that many times is kept to its end, only a drain or a node going down "
        "ends it early; null: no budget"
    )
    defaults: dict[Literal["interactive", "batch"], KindTerms] = Field(
        description="the contract terms a request of each kind gets when it leaves them out"
    )


class Placement(ApiObject):
    node: str
    gpu_indices: list[Annotated[int, Field(ge=0)]]


class SliceRequest(ApiObject):
    project: NameText = Field(
        description="the project to charge; the caller (or `user`) must be a member"
    )
    gpus: Annotated[int, Field(ge=1, le=100000)]
    gpu_type: NameText | None = Field(
        None, description="a GPU type (e.g. h100); any type when left out"
    )
    kind: SliceKindName
    min_runtime: Duration | None = duration_field(
        "Protected period after the grant; 0 makes the slice unallocated (free and "
        "preemptible). Default: the configuration's default for the kind."
    )
    resumable: bool | None = Field(
        None, description="requeue (batch) instead of ending when preempted"
    )
    max_runtime: Duration | None = duration_field(
        "Hard end after the grant. Default: the configuration's default for the kind."
    )
    priority: Annotated[int, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX)] | None = Field(
        None, description="orders slices within the project only; default 0"
    )
    user: NameText | None = Field(
        None,
        description="submit on behalf of this user (agents and admins only; others may "
        "only name themselves)",
    )
    groups: list[NameText] | None = Field(
        None,
        description="the user's groups, for membership (agents and admins only; others "
        "may only repeat their own)",
    )
    restores: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="a session brought back, or a batch command asked for again after a "
        "preemption: the user's slice that a preemption (or its node going down) ended. "
        "The request keeps that slice's place in its project's queue and its preemptions "
        "so far, and a preempted resumable batch slice's next run is protected "
        "preemption_backoff times longer, as the broker's own requeue would; once per "
        "slice (409 after, and for a slice still live or ended otherwise)",
    )


class Slice(ApiObject):
    id: int
    project: str
    user: str
    gpus: int
    gpu_type: str | None
    kind: SliceKindName
    min_runtime: Seconds
    resumable: bool
    max_runtime: Seconds | None
    priority: int
    state: SliceStateName
    end_reason: EndReasonName | None
    placements: list[Placement]
    submitted_at: Epoch
    granted_at: Epoch | None
    protected_until: Epoch | None
    preempt_deadline: Epoch | None
    preempt_reason: PreemptReasonName | None
    ended_at: Epoch | None
    lease_expires_at: Epoch | None
    queue_position: Annotated[int, Field(ge=1)] | None
    fairshare_value: float | None = Field(
        description="while pending: its project's share used at the last pass (its part "
        "of all usage in the window over its entitlement; 1 is exactly its share)"
    )
    estimated_start: Epoch | None
    charged_gpu_seconds: float = Field(
        description="weighted GPU-seconds charged so far (accruing while held)"
    )
    preemptions: int = Field(
        ge=0,
        description="times preempted so far; past the policy's preemption_budget only a "
        "drain or a node going down ends it early",
    )
    checkpointed_at: Epoch | None = Field(
        description="the last checkpoint its holder reported (POST /slices/{id}/checkpoint): "
        "among otherwise equal victims, the one with the least work since its grant or "
        "this checkpoint is preempted first"
    )
    replaced_by: int | None = Field(
        description="the slice that took its place: for a slice withdrawn for one of its "
        "alternatives (POST /slices/{id}/replace), for its holder to follow; for an "
        "ended session, the request that restores it (POST /slices with `restores`)"
    )


class SliceList(ApiObject):
    slices: list[Slice]


#: The most slices one ``POST /heartbeats`` may name.
MAX_HEARTBEATS = 10_000


class HeartbeatBatch(ApiObject):
    slices: list[Annotated[int, Field(ge=1, le=2**31 - 1)]] = Field(
        min_length=1,
        max_length=MAX_HEARTBEATS,
        description="the ids of the slices to heartbeat (a repeated id counts once)",
    )


class HeartbeatAnswers(ApiObject):
    slices: list[Slice] = Field(description="the slices heartbeated, in the order asked")
    not_found: list[int] = Field(
        description="ids asked of which the caller has no slice: nothing was done for them"
    )


class SliceEvent(ApiObject):
    at: Epoch
    from_state: SliceStateName | None
    to_state: SliceStateName
    reason: str


class SliceEventList(ApiObject):
    events: list[SliceEvent]


class AlternativeFields(ApiObject):
    project: str
    gpus: int = Field(ge=1)
    gpu_type: str | None
    kind: Literal["interactive", "batch"]
    min_runtime: Seconds


class Alternative(ApiObject):
    change: Literal["gpus", "gpu_type", "min_runtime", "project", "debug"] = Field(
        description="what differs from the request as it is"
    )
    fields: AlternativeFields  # the request with that change, as POST /slices takes it
    starts_at: Epoch = Field(description="now if it would be granted at once, else its estimate")
    gpu_hours: float = Field(
        description="weighted GPU-hours its protected period commits the project to"
    )


class AlternativeList(ApiObject):
    slice_id: int
    now: Epoch
    starts_at: Epoch | None = Field(description="the request's own estimated start, if any")
    alternatives: list[Alternative] = Field(description="soonest first; empty if none is sooner")


class ExpectedStart(ApiObject):
    gpu_type: str
    gpus: int = Field(ge=1)
    starts_at: Epoch | None = Field(
        description="now if it would be granted at once, else its estimate (null: none)"
    )


class ExpectedStarts(ApiObject):
    now: Epoch
    project: str
    kind: Literal["interactive", "batch"]
    min_runtime: Seconds
    starts: list[ExpectedStart] = Field(
        description="by GPU type, then size: 1, 2, 4, … up to the type's largest node"
    )


class Project(ApiObject):
    name: str
    parent: str | None
    share: float
    entitlement: float = Field(
        description="fraction of the cluster (product of share ratios down the tree)"
    )
    is_project: bool = Field(description="a leaf that runs work (false for parent accounts)")
    usage: float = Field(
        description="weighted GPU-seconds in the lookback window, summed over the subtree"
    )
    fairshare_value: float = Field(
        description="share used: the account's part of all usage in the window over its "
        "entitlement (1 is exactly its share; 0 while nothing is used; lower is served first)"
    )
    rank: Annotated[int, Field(ge=1)] | None
    users: Names
    groups: Names
    pending: int = Field(description="slices waiting (a parent: in its whole subtree)")
    gpus_held: int = Field(description="GPUs held (a parent: in its whole subtree)")


class ProjectList(ApiObject):
    projects: list[Project]


class ProjectUpdate(ApiObject):
    share: Share = Field(
        description="weight among siblings; kept within a range where entitlements "
        "(products of share ratios down the tree) stay well above zero"
    )
    parent: NameText | None = Field(
        None, description="parent account; top level when null or left out"
    )
    users: list[NameText] = Field(None, description="replace the members (users) when given")
    groups: list[NameText] = Field(None, description="replace the members (groups) when given")


class AccountState(ApiObject):
    """An account and its members; null where the account does not exist."""

    model_config = ConfigDict(json_schema_extra={"nullable": True})

    share: float
    parent: str | None
    users: Names
    groups: Names


class ProjectEvent(ApiObject):
    id: int
    account: str
    who: str = Field(
        description="the admin who made the change, or 'file NAME' for the cluster file "
        "that seeded the tree"
    )
    at: Epoch
    action: Literal["seed", "set", "apply", "delete"] = Field(
        description="seed: from the cluster file on the first start; set: "
        "PUT /projects/{name}; apply: PUT /projects; delete: DELETE /projects/{name}"
    )
    before: AccountState | None
    after: AccountState | None


class ProjectEventList(ApiObject):
    events: list[ProjectEvent]


class ProjectTreeEntry(ApiObject):
    """One account of a project tree."""

    name: NewName = Field(
        description="letters, digits, '.', '_' and '-', starting with a letter or digit"
    )
    share: Share = Field(description="weight among siblings")
    parent: NameText | None = Field(
        None, description="parent account; top level when null or left out"
    )
    users: list[NameText] = Field(None, description="the members (users)")
    groups: list[NameText] = Field(None, description="the members (groups)")


class ProjectTree(ApiObject):
    """The whole project tree with its members, as the cluster file's [projects] gives it."""

    projects: list[ProjectTreeEntry]


class ProjectChange(ApiObject):
    account: str
    change: Literal["added", "removed", "changed"]
    before: AccountState | None
    after: AccountState | None


class ProjectChangeList(ApiObject):
    changes: list[ProjectChange]
    applied: bool = Field(description="false for a dry run")


class UsageRow(ApiObject):
    project: str
    user: str = Field(None, description="present when by=user")
    since: Epoch
    until: Epoch
    slices: int
    gpu_seconds: float
    weighted_gpu_seconds: float


class UsageReport(ApiObject):
    project: str
    by: Literal["user", "project"]
    usage: list[UsageRow]


class Node(ApiObject):
    name: str
    gpu_type: str
    gpu_count: int
    weight: float = Field(description="cost units per GPU-second")
    state: NodeStateName
    state_reason: str
    state_changed_at: Epoch | None
    in_config: bool
    drained_by: DrainOrigin | None = Field(
        description="who took the node out of service: an admin (it stays out until an "
        "admin undrains it) or the live inventory (a Kubernetes cordon, undone by an "
        "uncordon); null when nobody did"
    )
    gpus_held: int


class NodeList(ApiObject):
    nodes: list[Node]


class ProtectionExtension(ApiObject):
    extend_by: Duration = Field(
        description="how much longer the slice is protected, from the later of the end "
        "of its protection and now. Seconds (a number) or a duration string such as "
        "'30m'. Bounded as a new contract is: max_min_runtime from the grant (a debug "
        "session's debug_max_min_runtime), and the slice's max_runtime."
    )


class SliceReplacement(ApiObject):
    project: NameText = Field(description="the project to charge; the user must be a member")
    gpus: Annotated[int, Field(ge=1, le=100000)]
    gpu_type: NameText | None = Field(None, description="a GPU type; any type when left out")
    kind: SliceKindName
    min_runtime: Duration | None = duration_field(
        "Protected period after the grant. Default: the configuration's default for the kind."
    )
    groups: list[NameText] | None = Field(
        None,
        description="the slice's user's groups, for membership in a new project (agents "
        "and admins only; others may only repeat their own)",
    )


class NodeChange(ApiObject):
    reason: ReasonText = Field(
        None, description="shown on the node; one line, no control characters"
    )


#: Every component of the document, in the order the reference lists them.
MODELS: dict[str, type[ApiObject]] = {
    model.__name__: model
    for model in (
        Error,
        ErrorDetail,
        Version,
        Identity,
        Limits,
        KindTerms,
        Placement,
        SliceRequest,
        SliceReplacement,
        Slice,
        SliceList,
        HeartbeatBatch,
        HeartbeatAnswers,
        SliceEvent,
        SliceEventList,
        AlternativeFields,
        Alternative,
        AlternativeList,
        ExpectedStart,
        ExpectedStarts,
        Project,
        ProjectList,
        ProjectUpdate,
        AccountState,
        ProjectEvent,
        ProjectEventList,
        ProjectTree,
        ProjectTreeEntry,
        ProjectChange,
        ProjectChangeList,
        UsageRow,
        UsageReport,
        Node,
        NodeList,
        NodeChange,
        ProtectionExtension,
    )
}


def _component(model: type[ApiObject]) -> dict[str, Any]:
    schema = model.model_json_schema(
        ref_template=REF_PREFIX + "{model}", schema_generator=OpenAPI30
    )
    schema.pop("$defs", None)  # the nested models are components of their own
    return schema


COMPONENTS: dict[str, dict[str, Any]] = {name: _component(m) for name, m in MODELS.items()}


# ---- validation -------------------------------------------------------------------


def validate(value: Any, schema: Mapping[str, Any], where: str = "body") -> None:
    """Raise :class:`InvalidRequest` naming the first place where ``value`` breaks
    ``schema``: a component's ``$ref`` or a parameter's schema."""
    key = json.dumps(schema, sort_keys=True)
    try:
        _adapter(key).validate_python(value)
    except ValidationError as err:
        raise InvalidRequest(_message(err.errors(include_url=False)[0], where, schema)) from None


@functools.cache
def _adapter(schema_json: str) -> TypeAdapter[Any]:
    """The validator of a schema, by its JSON text (a dict is no cache key); each is
    built once: a handful of schemas are declared, and building one is slow."""
    schema = json.loads(schema_json)
    if "$ref" in schema:
        return TypeAdapter(MODELS[schema["$ref"].removeprefix(REF_PREFIX)])
    return TypeAdapter(_parameter_type(schema), config=STRICT)


#: The type of each OpenAPI scalar type.
_SCALARS = {"integer": int, "number": float, "string": str, "boolean": bool}
#: Each OpenAPI constraint a parameter may have, as the Field argument that states it.
_CONSTRAINTS = {
    "minimum": "ge",
    "maximum": "le",
    "minLength": "min_length",
    "maxLength": "max_length",
    "pattern": "pattern",
}


def _parameter_type(schema: Mapping[str, Any]) -> Any:
    """The type a parameter's schema describes: a scalar, one of an enum, or an array."""
    if "enum" in schema:
        kind: Any = _enum(schema["enum"])
    elif schema["type"] == "array":
        kind = list[_parameter_type(schema["items"])]
    else:
        kind = _SCALARS[schema["type"]]
    constraints = {arg: schema[key] for key, arg in _CONSTRAINTS.items() if key in schema}
    return Annotated[kind, Field(**constraints)] if constraints else kind


#: What a value of the wrong type should have been, by pydantic's error type.
_EXPECTED = {
    "int_type": "a whole number",
    "float_type": "a number",
    "finite_number": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "an array",
    "model_type": "an object",
}
#: The sentence for each other error, by pydantic's error type.
_SENTENCES = {
    "literal_error": "{place} must be {expected}, got {value}",
    "string_too_long": "{place} is longer than {max_length} characters",
    "string_pattern_mismatch": "{place} has an invalid format: {value}",
    "string_unicode": "{place} is not valid Unicode text",
    "greater_than_equal": "{place} must be >= {ge:g}, got {value}",
    "less_than_equal": "{place} must be <= {le:g}, got {value}",
}


def _message(error: ErrorDetails, where: str, schema: Mapping[str, Any]) -> str:
    """One line for one of pydantic's errors, naming the place as ``body.groups[1]``."""
    kind, loc, value = error["type"], error["loc"], error["input"]
    if kind == "missing":
        return f"{_place(where, loc[:-1])} needs {loc[-1]!r}"
    if kind == "extra_forbidden":
        known = ", ".join(_keys_at(schema, loc[:-1]))
        return f"{_place(where, loc[:-1])} has an unknown key {loc[-1]!r}; expected: {known}"
    place = _place(where, loc)
    if kind in _EXPECTED:
        if value is None:
            return f"{place} must not be null"
        return f"{place} must be {_EXPECTED[kind]}, got {_describe(value)}"
    if kind == "string_too_short":
        return f"{place} must not be empty" if value == "" else f"{place} is too short"
    if kind == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") == TEXT_PATTERN:
        return f"{place} holds a control character: {_describe(value)}"
    sentence = _SENTENCES.get(kind, "{place}: {message}")
    message = error["msg"][0].lower() + error["msg"][1:]
    return sentence.format(
        place=place, value=_describe(value), message=message, **error.get("ctx", {})
    )


def _place(where: str, loc: Sequence[int | str]) -> str:
    return where + "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in loc)


def _keys_at(schema: Mapping[str, Any], loc: Sequence[int | str]) -> list[str]:
    """The keys of the object at ``loc`` in the model ``schema`` refers to."""
    model = MODELS[schema["$ref"].removeprefix(REF_PREFIX)]
    for step in loc:
        if isinstance(step, str):
            annotation = model.model_fields[step].annotation
            model = next(
                arg
                for arg in (annotation, *get_args(annotation))
                if isinstance(arg, type) and issubclass(arg, BaseModel)
            )
    return list(model.model_fields)


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
