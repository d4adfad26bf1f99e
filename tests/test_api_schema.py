"""The OpenAPI document against the running service, and the reference generated from it.

schemathesis generates requests from ``/api/v1/openapi.json`` (valid and
invalid ones, with a bounded number of examples per operation) and sends them
to a real ``python -m broker.service`` with an admin token: no answer may be a
5xx, every answer must match the document (status, content type, schema), and
every error must have the ``{"error": {"code", "message"}}`` shape.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance
from servicefixtures import REPO_ROOT, BrokerService, running_service

from broker.service.apihandlers import default_handlers
from broker.service.openapi import build_document, markdown

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
    expected = markdown(build_document(default_handlers))
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
