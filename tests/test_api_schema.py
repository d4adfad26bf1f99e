"""The OpenAPI document against the running service, and the reference generated from it.

schemathesis generates requests from ``/api/v1/openapi.json`` (valid and
invalid ones, with a bounded number of examples per operation) and sends them
to a real ``python -m broker.service`` with an admin token: no answer may be a
5xx, every answer must match the document (status, content type, schema), and
every error must have the ``{"error": {"code", "message"}}`` shape.

On top of schemathesis' cases, hypothesis fuzzes every path parameter, query
parameter and body field with unicode-heavy text (other scripts' digits,
control characters, NUL, bidi marks, astral characters) and oversized values
(thousands of digits, tens of kilobytes, bodies over the 1 MiB limit), with the
same acceptance: never a 5xx, the JSON error shape on every error.

The components are the JSON schemas of the models in ``broker.service.schema``,
written in OpenAPI 3.0's dialect; a body that breaks its model is refused in
one line that names the place and the problem.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance
from servicefixtures import REPO_ROOT, BrokerService, running_service

from broker.errors import InvalidRequest
from broker.service.apihandlers import default_handlers
from broker.service.app import BrokerApp
from broker.service.openapi import build_document, markdown
from broker.service.schema import COMPONENTS, REF_PREFIX, ref, validate

#: Examples per operation and generation mode: enough to find mismatches, bounded in time.
MAX_EXAMPLES = 25


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[BrokerService]:
    directory = tmp_path_factory.mktemp("schema")
    # A short max_wait: generated long polls must not hold the run up.
    with running_service(directory, max_wait=0.05, lease=600) as service:
        yield service


@pytest.fixture(scope="module")
def api_schema(service):
    schema = schemathesis.openapi.from_url(service.api_url + "/openapi.json")
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        max_examples=MAX_EXAMPLES,
        deterministic=True,
        with_security_parameters=False,
        allow_x00=True,
        codec="utf-8",
    )
    return schema


def errors_have_the_json_shape(ctx, response, case) -> bool | None:
    if response.status_code < 400:
        return None
    headers = {name.lower(): values for name, values in response.headers.items()}
    content_type = (headers.get("content-type") or [""])[0]
    assert content_type.startswith("application/json"), (
        f"{response.status_code} answered as {content_type!r}"
    )
    body = json.loads(response.content)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message"}, body
    assert all(isinstance(v, str) and v for v in body["error"].values()), body
    return True


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=MAX_EXAMPLES)
def test_the_service_matches_its_openapi_document(case, service):
    case.call_and_validate(
        base_url=service.api_url,
        headers={"Authorization": f"token {service.admin_token}"},
        additional_checks=[errors_have_the_json_shape],
        # Schema-valid requests may still break rules the schema cannot state (an unknown
        # project, more GPUs than the cluster has): those are 400s by design.
        excluded_checks=[positive_data_acceptance],
        timeout=10,
    )


# ---- unicode-heavy and oversized fuzzing ------------------------------------------------

#: Examples per fuzz test: each is one request to a random operation.
FUZZ_EXAMPLES = 300
DOCUMENT = build_document(default_handlers)
#: (method, path template, operation) of every operation of the API.
OPERATIONS = [
    (method.upper(), path, operation)
    for path, methods in DOCUMENT["paths"].items()
    for method, operation in methods.items()
]
#: Strings that have broken parsers: digits of other scripts, superscripts, circled and
#: fullwidth digits, controls, NUL, bidi overrides, a BOM, astral and combining characters.
TRICKY = [
    "\u00b2", "\u2460", "\u0661", "\uff11", "\U0001d7cf", "\u2162", "1\u0301", "\ufeff1",
    "\u0000", "a\u0000", "\n", "a\n", "\r\n", "\t", "\u001b[31m", "\u007f", "\u202e1",
    "\u200b", "\U0001f600", "\ufdfa", " ", "", ".", "..", "%", "%00", "\\", "'", '"', "{}",
]  # fmt: skip
UNICODE = st.text(st.characters(codec="utf-8"), max_size=40)
OVERSIZED = st.one_of(
    st.integers(11, 6000).map(lambda n: "7" * n),  # ids past 2**31 - 1, and past int()'s limit
    st.integers(256, 70_000).map(lambda n: "\u00e9" * n),
    st.text(st.characters(codec="utf-8"), min_size=256, max_size=2000),
)
TEXT = st.one_of(st.sampled_from(TRICKY), UNICODE, OVERSIZED)


def send(service: BrokerService, method: str, path: str, **kwargs: Any) -> requests.Response:
    headers = {"Authorization": f"token {service.admin_token}", **kwargs.pop("headers", {})}
    return service.session.request(
        method, service.api_url + path, headers=headers, timeout=30, **kwargs
    )


def assert_survived(response: requests.Response) -> None:
    """No 5xx; an error has the JSON shape."""
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert response.headers["Content-Type"].startswith("application/json"), response.headers
        error = response.json()["error"]
        assert set(error) == {"code", "message"} and all(error.values()), error
        assert len(error["message"]) <= 1100, "the error echoes too much of the request"


def fill_path(template: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: quote(values[m.group(1)], safe=""), template)


WITH_PATH_PARAMS = [op for op in OPERATIONS if "{" in op[1]]


@settings(deadline=None, max_examples=FUZZ_EXAMPLES, derandomize=True,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(data=st.data())
def test_every_path_parameter_survives_unicode_and_oversized_values(service, data):
    method, template, _ = data.draw(st.sampled_from(WITH_PATH_PARAMS))
    names = re.findall(r"\{(\w+)\}", template)
    values = {name: data.draw(TEXT, label=name) for name in names}
    body = {"share": 1} if method == "PUT" else None
    assert_survived(send(service, method, fill_path(template, values), json=body))


WITH_QUERY = [
    (method, path, op) for method, path, op in OPERATIONS
    if any(p["in"] == "query" for p in op.get("parameters", []))
]  # fmt: skip


@settings(deadline=None, max_examples=FUZZ_EXAMPLES, derandomize=True,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(data=st.data())
def test_every_query_parameter_survives_unicode_and_oversized_values(service, data):
    method, template, operation = data.draw(st.sampled_from(WITH_QUERY))
    query = [p["name"] for p in operation["parameters"] if p["in"] == "query"]
    chosen = data.draw(st.lists(st.sampled_from(query), min_size=1, unique=True))
    params = {name: data.draw(TEXT, label=name) for name in chosen}
    path = fill_path(template, {"id": "1", "name": "vision"})
    assert_survived(send(service, method, path, params=params))


WITH_BODY = [op for op in OPERATIONS if "requestBody" in op[2]]


def body_schema(operation: dict) -> dict:
    ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return DOCUMENT["components"]["schemas"][ref.rsplit("/", 1)[-1]]


@settings(deadline=None, max_examples=FUZZ_EXAMPLES, derandomize=True,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(data=st.data())
def test_every_body_field_survives_unicode_and_oversized_values(service, data):
    method, template, operation = data.draw(st.sampled_from(WITH_BODY))
    fields = list(body_schema(operation)["properties"])
    chosen = data.draw(st.lists(st.sampled_from(fields), min_size=1, unique=True))
    value = st.one_of(TEXT, st.lists(TEXT, max_size=5))
    body = {name: data.draw(value, label=name) for name in chosen}
    # the name is a valid one, so that the body's checks are reached
    path = fill_path(template, {"id": "1", "name": data.draw(st.sampled_from(["vision", "n0"]))})
    assert_survived(send(service, method, path, json=body))


@pytest.mark.parametrize("size", [1024 * 1024 + 1, 3 * 1024 * 1024])
@pytest.mark.parametrize(("method", "template"), [(m, p) for m, p, _ in WITH_BODY])
def test_every_body_over_the_limit_is_a_json_413(service, method, template, size):
    path = fill_path(template, {"name": "vision", "id": "1"})
    body = b'{"share": 1, "pad": "' + b"x" * size + b'"}'
    response = send(service, method, path, data=body)
    assert_survived(response)
    assert response.status_code == 413


def test_the_service_log_shows_no_tracebacks(service):
    assert "Traceback" not in service.log_text()


def test_the_document_is_openapi_3_0(service):
    document = service.get("/openapi.json").json()
    assert document["openapi"] == "3.0.3"
    assert document == build_document(default_handlers)
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            assert "default" in operation["responses"], (method, path)
            assert operation["operationId"], (method, path)


def test_the_api_reference_is_up_to_date():
    expected = markdown(build_document(default_handlers), BrokerApp)
    written = (REPO_ROOT / "docs" / "api.md").read_text()
    assert written == expected, (
        "docs/api.md is out of date: run python -m broker.service.openapi --markdown > docs/api.md"
    )


def test_the_generator_prints_the_reference_and_the_document():
    run = [sys.executable, "-m", "broker.service.openapi"]
    printed = subprocess.run([*run, "--markdown"], capture_output=True, text=True, check=True)
    assert printed.stdout == (REPO_ROOT / "docs" / "api.md").read_text()
    document = subprocess.run(run, capture_output=True, text=True, check=True)
    assert json.loads(document.stdout) == build_document(default_handlers)


def test_the_reference_names_no_local_paths():
    text = (Path(REPO_ROOT) / "docs" / "api.md").read_text()
    assert str(REPO_ROOT) not in text


# ---- the models behind the components -------------------------------------------------


def schema_nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """Every schema object in ``schema``, nested ones included."""
    if isinstance(schema, dict):
        yield schema
        for key, value in schema.items():
            children = value.values() if key == "properties" else [value]
            for child in children:
                yield from schema_nodes(child)
    elif isinstance(schema, list):
        for item in schema:
            yield from schema_nodes(item)


def test_the_components_are_written_in_openapi_3_0():
    """What pydantic writes in JSON Schema 2020-12 and 3.0 lacks (null types, const,
    $defs, siblings of a $ref) never reaches the document."""
    for name, component in COMPONENTS.items():
        for node in schema_nodes(component):
            assert not {"const", "$defs", "title", "default"} & set(node), (name, node)
            assert isinstance(node.get("type", ""), str) and node.get("type") != "null", node
            if "$ref" in node:
                assert set(node) == {"$ref"}, (name, node)
                assert node["$ref"].removeprefix(REF_PREFIX) in COMPONENTS, (name, node)
            if node.get("nullable") and "enum" in node:
                assert None in node["enum"], (name, node)


REQUEST = {"project": "vision", "gpus": 1, "kind": "batch"}


@pytest.mark.parametrize(
    ("component", "body", "message"),
    [
        ("SliceRequest", {**REQUEST, "gpus": True}, "body.gpus must be a whole number, got true"),
        ("SliceRequest", {**REQUEST, "gpus": 1e400}, "body.gpus must be a whole number, got inf"),
        ("SliceRequest", {**REQUEST, "kind": "serial"},
         "body.kind must be 'interactive' or 'batch', got 'serial'"),
        ("SliceRequest", {**REQUEST, "gpu": 1}, "body has an unknown key 'gpu'; expected: "
         "project, gpus, gpu_type, kind, min_runtime, resumable, max_runtime, priority, user, "
         "groups, restores"),
        ("SliceRequest", {"gpus": 1, "kind": "batch"}, "body needs 'project'"),
        ("SliceRequest", {**REQUEST, "min_runtime": "15 pc"},
         "body.min_runtime has an invalid format: '15 pc'"),
        ("SliceRequest", {**REQUEST, "max_runtime": -5}, "body.max_runtime must be >= 0, got -5"),
        ("SliceRequest", {**REQUEST, "groups": ["a", "b\n"]},
         "body.groups[1] holds a control character: 'b\\n'"),
        ("SliceRequest", {**REQUEST, "project": "a\ud800"},
         "body.project is not valid Unicode text"),
        ("ProjectUpdate", {"share": 1, "users": None}, "body.users must not be null"),
        ("ProjectUpdate", {"share": "1"}, "body.share must be a number, got '1'"),
        ("ProjectTree", {"projects": [{"name": "a", "share": 1, "owner": "x"}]},
         "body.projects[0] has an unknown key 'owner'; expected: name, share, parent, users, "
         "groups"),
        ("NodeChange", {"reason": "x" * 1001}, "body.reason is longer than 1000 characters"),
        ("NodeChange", [], "body must be an object, got an array"),
    ],
)  # fmt: skip
def test_a_body_that_breaks_its_model_is_refused_in_one_line(component, body, message):
    with pytest.raises(InvalidRequest) as caught:
        validate(body, ref(component))
    assert str(caught.value) == message


@pytest.mark.parametrize(
    "body",
    [
        REQUEST,
        {**REQUEST, "min_runtime": "1h30m", "max_runtime": 7200, "gpu_type": None},
        {**REQUEST, "user": "alice", "groups": ["team"], "priority": -100, "resumable": None},
    ],
)
def test_a_body_that_keeps_to_its_model_passes(body):
    validate(body, ref("SliceRequest"))


def test_the_service_answers_a_broken_body_with_the_one_line(service):
    response = send(service, "POST", "/slices", json={**REQUEST, "gpus": True})
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "code": "invalid_request",
            "message": "body.gpus must be a whole number, got true",
        }
    }
