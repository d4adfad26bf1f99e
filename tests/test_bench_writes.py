"""The writes benchmark: one request's write, its time and the statements it sends."""

from __future__ import annotations

import json
import os

import pytest

from broker.bench.__main__ import main


def test_each_write_sends_the_statements_it_needs_and_no_more(capsys):
    """On both databases, through the command line: a heartbeat is the write lock
    (SQLite: its BEGIN) and one UPDATE; a granted slice's release the lock, its
    charge, its event and the slice's UPDATE — no savepoint, no read of the row;
    a submission the lock, the slice and its event (the first also reads the
    catalog). Each figure is timed beside the minimal write's."""
    assert main(["writes", "--db", "both", "--count", "10"]) == 0
    report = json.loads(capsys.readouterr().out)
    results = {result["db"]: result for result in report["results"]}
    for db in ("sqlite", "postgresql"):
        result = results[db]
        if "skipped" in result:
            if os.environ.get("CI"):  # CI starts PostgreSQL: a skip there would hide a failure
                pytest.fail(result["skipped"])
            continue
        assert result["heartbeat"]["statements"] == 2, db
        assert result["release"]["statements"] == 4, db
        assert 3 <= result["submit"]["statements"] <= 3.5, db
        assert result["reference"]["statements"] == 3, db
        assert all(result[kind]["median_ms"] > 0 for kind in result if kind != "db")
