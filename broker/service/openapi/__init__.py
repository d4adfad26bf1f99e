"""The OpenAPI 3.0 document of the broker's API, built from the handlers' declarations.

:func:`build_document` walks the handler list: every route's
:class:`~broker.service.apihandlers.base.Operation` gives its parameters,
request body, responses and security, and the component schemas are those of
:mod:`broker.service.schema` — the same the handlers check requests against.

``python -m broker.service.openapi`` prints the document as JSON;
``python -m broker.service.openapi --markdown`` prints the API reference
(``docs/api.md``). That command lives in :mod:`.__main__`, the only place that
imports the application and the handler list: the handlers import this module,
so it imports none of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from traitlets.config import Configurable

from ... import __version__
from ..auth import ADMIN_SCOPE, AGENT_SCOPE
from ..schema import COMPONENTS, DURATION_PATTERN, REF_PREFIX, ref

if TYPE_CHECKING:  # only for annotations: the handlers import this module
    from ..apihandlers.base import Operation

TITLE = "slicebroker API"
API_PREFIX = "/api/v1"

#: The guide at the top of the reference (and the document's ``info.description``).
GUIDE = f"""\
The broker's JSON API, under `{{base_url}}api/v1`: `/api/v1` when the broker runs
standalone, `/services/<service name>/api/v1` behind JupyterHub's proxy. The
broker serves this document at `{{base_url}}api/v1/openapi.json`.

Start it standalone with `slicebroker serve` (or `python -m broker.service`);
its options are listed [at the end](#service-options).

Every error, whatever the route or status (4xx or 5xx, unknown paths and
methods included), is `{{"error": {{"code": "...", "message": "..."}}}}`; clients
match on `code`, never on `message`. So are the HTTP server's own refusals: a
request that is not valid HTTP/1.1 (both `Content-Length` and
`Transfer-Encoding`, a NUL or a line without a colon in the headers, a bad chunk
size) is `400 bad_request`, and the connection is closed after it. One request
gets no answer at all: headers over 1 MiB make the server close the connection
while the client is still sending (headers over 64 KiB, up to that, are `431
headers_too_large`).

## Request bodies

A body is JSON, parsed strictly, under the same rules on every route and on every
database:

- It is sent as `Content-Type: application/json` (a charset parameter may
  follow); any other type, or none, is `415 unsupported_media_type`. A form or a
  `text/plain` post can come from another site's page; this cannot.
- It is UTF-8 JSON with no key twice in one object: `{{"project": "a", "project":
  "b"}}` is `400 invalid_json` (parsers disagree on which key wins, so a proxy or
  a log could read another request than the broker). `NaN` and `Infinity` are no
  JSON numbers.
- Objects hold exactly their schema's keys, each of exactly its type (`"2"` is no
  number, `1.0` no whole number, `true` neither).
- Free text (names of users, groups, projects and GPU types, at most 255
  characters; a node's `reason`, at most 1000) holds no control character (U+0000
  to U+001F, U+007F to U+009F) and no lone surrogate: `400 invalid_request`,
  naming the field.
- At most 1 MiB (`413 payload_too_large`); headers at most 64 KiB (`431
  headers_too_large`).

## Authentication

Send `Authorization: token <token>` (`Bearer <token>` works too). A request
without a valid token gets `401`; a token that may not do what it asks gets
`403`. `GET /`, `GET /openapi.json` need no token, and `GET /metrics` needs
none when the broker runs with `--BrokerApp.authenticate_metrics=False`.

Who may do what:

- **Users** request slices charged to projects they (or one of their groups) are
  members of; see, wait on, heartbeat and release *their own* slices (another
  user's slice answers `404`, exactly as a slice that does not exist); read the
  project tree, the nodes and the metrics, and the usage of their projects.
- **Agents** (e.g. the JupyterHub spawner) do what users do, for any user:
  `POST /slices` with `user` and `groups` charges what that user may charge;
  they see, heartbeat and release every slice and read every project's usage.
- **Admins** do everything: charge any project, `PUT /projects/{{name}}`, drain,
  undrain and down nodes.

A user may name only themselves in `user` and only groups of their own in
`groups`; anything else is `403`.

### Standalone: the broker's own tokens

Tokens are made with `slicebroker token create --user NAME [--admin] [--agent]`
(or `broker.service.auth.create_token(db_url, user, admin=False, agent=False)`)
and shown once: the database keeps only a salted SHA-256 hash. The users listed
in the configuration file's `admins` are admins whatever their token. Standalone
tokens carry no groups, so membership is by user name (agents may pass `groups`).
Revoked tokens stop working within the token cache time (5 s by default).

### As a JupyterHub service: JupyterHub's tokens and scopes

Run by the hub (`c.JupyterHub.services` entry with a `command`), the broker
takes its address and prefix from the hub and identifies every token with the
hub (`GET /hub/api/user`, answers cached for a few seconds): the caller's name
and groups come from JupyterHub. A token must hold
`access:services!service=<service name>` to be let in at all (`403` otherwise);
the custom scopes `{ADMIN_SCOPE}` and `{AGENT_SCOPE}` make it an admin or an
agent. The hub does not enforce custom scopes; the broker does.

```python
# jupyterhub_config.py
import sys

c.JupyterHub.services = [
    {{
        "name": "slicebroker",
        "url": "http://127.0.0.1:8765",
        "command": [
            sys.executable,
            "-m",
            "broker.service",
            "--cluster-file=/etc/slicebroker/cluster.toml",
            "--db-url=sqlite:////var/lib/slicebroker/slicebroker.sqlite",
        ],
    }},
    # the spawner's identity towards the broker (its token goes in the spawner's config)
    {{"name": "slicebroker-spawner", "api_token": "<a long random secret>"}},
]
c.JupyterHub.custom_scopes = {{
    "{ADMIN_SCOPE}": {{"description": "Administer the GPU broker"}},
    "{AGENT_SCOPE}": {{"description": "Request GPU slices on behalf of any user"}},
}}
c.JupyterHub.load_roles = [
    # every user may use the broker (and charge the projects they are members of)
    {{"name": "user", "scopes": ["self", "access:services!service=slicebroker"]}},
    {{
        "name": "slicebroker-admin",
        "users": ["ada"],
        "scopes": ["access:services!service=slicebroker", "{ADMIN_SCOPE}"],
    }},
    {{
        "name": "slicebroker-agent",
        "services": ["slicebroker-spawner"],
        "scopes": ["access:services!service=slicebroker", "{AGENT_SCOPE}"],
    }},
]
```
"""

SECURITY_SCHEME = {
    "type": "apiKey",
    "in": "header",
    "name": "Authorization",
    "description": "`Authorization: token <token>` (or `Bearer <token>`): a broker token "
    "standalone, a JupyterHub token when the broker runs as a hub service.",
}

ERROR_DESCRIPTIONS = {
    400: "the request is invalid (malformed JSON, a key twice, wrong types, unknown keys, "
    "control characters in text, a request that can never be granted)",
    401: "no token, or a token nobody issued",
    403: "the token may not do this",
    404: "no such resource (or another user's slice)",
    409: "the change conflicts with the current state",
    415: "a body not sent as `Content-Type: application/json`",
}
#: Who may call an operation, by its ``auth`` (the ``x-token`` extension of each operation).
TOKEN_NEEDED = {
    "none": "none",
    "user": "any",
    "admin": "admin",
    "metrics": "any (none if authenticate_metrics is off)",
}
DEFAULT_ERROR = "any other error (405 method not allowed, 500 internal error, 503 unavailable)"


def path_regex(path: str) -> str:
    """A tornado route pattern for an OpenAPI path template (``/slices/{id}``)."""
    parts = re.split(r"(\{\w+\})", path)
    return "".join(
        f"(?P<{part[1:-1]}>[^/]+)" if part.startswith("{") else re.escape(part) for part in parts
    )


def build_document(
    handlers: Iterable[tuple[str, type]], prefix: str = API_PREFIX
) -> dict[str, Any]:
    """The OpenAPI 3.0 document of ``handlers`` served under ``prefix`` (``/api/v1``)."""
    paths: dict[str, dict[str, Any]] = {}
    for path, handler in handlers:
        tag = handler.__module__.rsplit(".", 1)[-1]
        for method, operation in handler.operations.items():
            operation_id = f"{method}{handler.__name__.removesuffix('Handler')}"
            paths.setdefault(path, {})[method] = _operation(operation, operation_id, tag)
    return {
        "openapi": "3.0.3",
        "info": {"title": TITLE, "version": __version__, "description": GUIDE},
        "servers": [{"url": prefix}],
        "security": [{"token": []}],
        "paths": paths,
        "components": {
            "schemas": COMPONENTS,
            "securitySchemes": {"token": SECURITY_SCHEME},
        },
    }


def _operation(operation: Operation, operation_id: str, tag: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "operationId": operation_id,
        "tags": [tag],
        "summary": operation.summary,
    }
    if operation.description:
        spec["description"] = operation.description
    if operation.parameters:
        spec["parameters"] = [
            {
                "name": p.name,
                "in": p.where,
                "required": p.required or p.where == "path",
                "schema": dict(p.schema),
                **({"description": p.description} if p.description else {}),
                **({"style": "form", "explode": True} if p.schema.get("type") == "array" else {}),
            }
            for p in operation.parameters
        ]
    if operation.body is not None:
        spec["requestBody"] = {
            "required": operation.body_required,
            "content": {"application/json": {"schema": ref(operation.body)}},
        }
    content = {
        media: {"schema": _media_schema(media, name)} for media, name in operation.content.items()
    }
    responses: dict[str, Any] = {
        str(operation.ok): {"description": operation.ok_description, "content": content}
    }
    statuses = set(operation.errors)
    if operation.body is not None:
        statuses |= {400, 415}
    if operation.auth != "none":
        statuses |= {401, 403}
    for status in sorted(statuses):
        responses[str(status)] = _error_response(ERROR_DESCRIPTIONS[status])
    responses["default"] = _error_response(DEFAULT_ERROR)
    spec["responses"] = responses
    spec["x-token"] = TOKEN_NEEDED[operation.auth]
    if operation.auth == "none":
        spec["security"] = []
    return spec


def _media_schema(media: str, name: str | None) -> dict[str, Any]:
    if name is not None:
        return ref(name)
    return {"type": "object"} if media == "application/json" else {"type": "string"}


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ref("Error")}}}


# ---- markdown -----------------------------------------------------------------------


def markdown(document: Mapping[str, Any], options: type[Configurable] | None = None) -> str:
    """The API reference, for ``docs/api.md``; with ``options`` (the service's
    application class), a table of its options at the end."""
    lines = [
        f"# {document['info']['title']} (v1)",
        "",
        "<!-- Generated by `python -m broker.service.openapi --markdown > docs/api.md`"
        " from the OpenAPI document the broker serves at /api/v1/openapi.json."
        " Do not edit by hand. -->",
        "",
        document["info"]["description"].rstrip(),
        "",
        "## Routes",
        "",
        "| Method | Path | Summary | Token |",
        "|---|---|---|---|",
    ]
    operations = [
        (path, method, spec)
        for path, methods in document["paths"].items()
        for method, spec in methods.items()
    ]
    for path, method, spec in operations:
        lines.append(
            f"| {method.upper()} | [`{path}`](#{_anchor(method, path)}) | {spec['summary']} "
            f"| {_who(spec)} |"
        )
    for path, method, spec in operations:
        lines += _markdown_operation(path, method, spec)
    lines += ["", "## Schemas"]
    for name, schema in document["components"]["schemas"].items():
        lines += _markdown_schema(name, schema)
    if options is not None:
        lines += _markdown_options(options)
    return "\n".join(lines).rstrip() + "\n"


def _markdown_options(app_class: type[Configurable]) -> list[str]:
    """The service's options, from the traitlets of ``app_class``
    (:class:`~broker.service.app.BrokerApp`)."""
    lines = [
        "",
        "## Service options",
        "",
        "Each is `--BrokerApp.<name>=<value>` on the command line of `slicebroker serve` "
        "(`python -m broker.service`); the common ones also have a short form "
        "(`-f`, `--cluster-file`, `--db-url`, `--ip`, `--port`, `--base-url`, `--pass-interval`, "
        "`--lease`, `--max-wait`, `--log-level`, `--upgrade-db`, `--no-authenticate-metrics`).",
        "",
        "| Option | Type | Description |",
        "|---|---|---|",
    ]
    traits = app_class.class_own_traits(config=True)
    for name in sorted(traits):
        trait = traits[name]
        text = " ".join(filter(None, (line.strip() for line in trait.help.splitlines())))
        lines.append(f"| `{name}` | {type(trait).__name__.lower()} | {text} |")
    return lines


def _who(spec: Mapping[str, Any]) -> str:
    return spec.get("x-token", "any")


def _anchor(method: str, path: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", f"{method} {path}".lower()).replace(" ", "-")


def _markdown_operation(path: str, method: str, spec: Mapping[str, Any]) -> list[str]:
    lines = ["", f"### {method.upper()} {path}", "", f"**{spec['summary']}.**"]
    if spec.get("description"):
        lines += ["", spec["description"].strip()]
    lines += ["", f"Token: {_who(spec)}."]
    if spec.get("parameters"):
        lines += ["", "| Parameter | In | Type | Description |", "|---|---|---|---|"]
        for p in spec["parameters"]:
            required = " (required)" if p.get("required") and p["in"] != "path" else ""
            lines.append(
                f"| `{p['name']}` | {p['in']} | {_type(p['schema'])}{required} "
                f"| {p.get('description', '')} |"
            )
    body = spec.get("requestBody")
    if body:
        schema = body["content"]["application/json"]["schema"]
        optional = "" if body.get("required") else " (optional)"
        lines += ["", f"Body{optional}: {_type(schema)}."]
    lines += ["", "Responses:", ""]
    for status, response in spec["responses"].items():
        media = ", ".join(
            f"{_type(c['schema'])} as `{m}`" for m, c in response.get("content", {}).items()
        )
        lines.append(f"- `{status}` {response['description']}: {media}")
    return lines


def _markdown_schema(name: str, schema: Mapping[str, Any]) -> list[str]:
    lines = ["", f"### {name}"]
    if schema.get("description"):
        lines += ["", schema["description"]]
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    lines += ["", "| Field | Type | Required | Description |", "|---|---|---|---|"]
    for key, prop in properties.items():
        lines.append(
            f"| `{key}` | {_type(prop)} | {'yes' if key in required else 'no'} "
            f"| {prop.get('description', '')} |"
        )
    return lines


def _type(schema: Mapping[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].removeprefix(REF_PREFIX)
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema:
        text = " or ".join(_type(option) for option in schema["anyOf"])
    elif schema.get("type") == "array":
        text = f"array of {_type(schema['items'])}"
    elif "enum" in schema:
        text = " \\| ".join(f"`{v}`" for v in schema["enum"] if v is not None)
    elif schema.get("type") == "string" and schema.get("pattern") == DURATION_PATTERN:
        text = "string (duration)"
    else:
        text = schema.get("type", "any")
        bounds = []
        if "minimum" in schema:
            bounds.append(f"{'>' if schema.get('exclusiveMinimum') else '≥'} {schema['minimum']:g}")
        if "maximum" in schema:
            bounds.append(f"≤ {schema['maximum']:g}")
        if bounds and text in ("integer", "number"):
            text += f" ({', '.join(bounds)})"
    if schema.get("nullable"):
        text += " or null"
    return text
