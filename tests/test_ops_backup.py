"""Backup and restore as ``docs/backup.md`` describes them, on SQLite and PostgreSQL.

A broker runs and holds state (a granted slice, a released one with its charge,
a drained node, tokens); the database is backed up while it runs; the broker
changes more after the backup; then a broker started on the restored copy must
show the state at the backup, charge the same usage, accept the old tokens, and
go on (new slices numbered after the old ones, no GPU held twice).
"""

from __future__ import annotations

import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import _postgres_database
from servicefixtures import TEST_CONFIG, BrokerService, running_service
from sqlalchemy.engine import make_url

from broker import cli
from broker.orm import head_revision, scratch_database

#: Fields of a slice that a restore must bring back as they were.
KEPT = ("id", "project", "user", "gpus", "kind", "state", "placements", "end_reason")
KEPT += ("submitted_at", "granted_at", "min_runtime", "charged_gpu_seconds")


def submit(service: BrokerService, token: str, project: str, gpus: int) -> dict:
    body = {"project": project, "gpus": gpus, "kind": "batch", "min_runtime": "1h"}
    answer = service.post("/slices", token=token, json=body)
    assert answer.status_code == 201, answer.text
    return answer.json()


def granted(service: BrokerService, slice_id: int) -> dict:
    """The slice once a pass granted it (a long-poll on leaving 'pending')."""
    params = {"wait": 10, "state": "pending"}
    slice_ = service.get(f"/slices/{slice_id}", token=service.admin_token, params=params).json()
    assert slice_["state"] == "granted", slice_
    return slice_


def wait_drained(service: BrokerService, node: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        nodes = service.get("/nodes", token=service.admin_token).json()["nodes"]
        if next(n for n in nodes if n["name"] == node)["state"] == "drained":
            return
        time.sleep(0.05)  # polling the API: the pass that drains it runs on its own
    raise AssertionError(f"{node} not drained after {timeout} s")


def state_of(service: BrokerService, until: float) -> dict:
    """What a restore must keep: every slice (fields in :data:`KEPT`, the live slices'
    charge left out: it accrues), nodes, tree, and the ledger's usage up to ``until``."""
    token = service.admin_token
    slices = service.get("/slices", token=token).json()["slices"]  # every state
    usage = service.get(
        "/projects/lab/usage", token=token, params={"since": 0, "until": until, "format": "csv"}
    ).text
    return {
        "slices": [
            {k: s.get(k) for k in KEPT if s["state"] == "ended" or k != "charged_gpu_seconds"}
            for s in slices
        ],
        "nodes": [
            (n["name"], n["state"], n.get("state_reason"))
            for n in service.get("/nodes", token=token).json()["nodes"]
        ],
        # By name: siblings are listed in fair-share order, which moves as charges accrue.
        "projects": sorted(
            (p["name"], p["parent"], p["share"], p.get("users"), p.get("groups"))
            for p in service.get("/projects", token=token).json()["projects"]
        ),
        "usage": usage,
    }


# ---- the two ways to back up and restore ------------------------------------------------


@contextmanager
def sqlite_copy(source_url: str, tmp_path: Path, method: str) -> Iterator[str]:
    """Back up the live SQLite database with ``VACUUM INTO`` or the online backup API
    (what the ``sqlite3`` shell's ``.backup`` runs); restoring is using the copy."""
    source = make_url(source_url).database
    backup = tmp_path / "backup" / "broker.sqlite"
    backup.parent.mkdir()
    with sqlite3.connect(source) as live:
        if method == "vacuum-into":
            live.execute("VACUUM INTO ?", (str(backup),))
        else:
            with sqlite3.connect(backup) as copy:
                live.backup(copy)
    yield f"sqlite:///{backup}"


@contextmanager
def postgres_copy(source_url: str, tmp_path: Path) -> Iterator[str]:
    """``pg_dump --format=custom`` of the live database, ``pg_restore`` into a new one."""
    dump = tmp_path / "broker.dump"
    subprocess.run(
        ["pg_dump", "--format=custom", f"--file={dump}", libpq(source_url)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    with scratch_database("slicebroker_restore") as target:
        subprocess.run(
            ["pg_restore", "--no-owner", "--exit-on-error", f"--dbname={libpq(target)}", dump],
            check=True,
            capture_output=True,
            timeout=120,
        )
        yield target


def libpq(url: str) -> str:
    """The URL as PostgreSQL's own tools read it (no SQLAlchemy driver name)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def live_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of the backend the test's ``method`` backs up."""
    if request.node.callspec.params["method"] != "pg_dump":
        yield f"sqlite:///{tmp_path / 'broker.sqlite'}"
        return
    yield from _postgres_database()


@pytest.mark.parametrize("method", ["vacuum-into", "backup-api", "pg_dump"])
def test_a_restored_backup_brings_back_the_state_at_the_backup(live_url, method, tmp_path, capsys):
    db_url = live_url
    config = TEST_CONFIG.replace("h100 = 1.0", "h100 = 1000.0")  # charges that show
    with running_service(tmp_path / "live", config=config, db_url=db_url) as live:
        alice, carol = live.token("alice"), live.token("carol")
        ended = granted(live, submit(live, alice, "vision", 2)["id"])
        assert live.delete(f"/slices/{ended['id']}", token=alice).status_code == 200
        held = granted(live, submit(live, carol, "nlp", 4)["id"])
        free = {"n0", "n1"} - {held["placements"][0]["node"]}
        drained = sorted(free)[0]
        answer = live.post(
            f"/nodes/{drained}/drain", token=live.admin_token, json={"reason": "fan"}
        )
        assert answer.status_code == 200, answer.text
        wait_drained(live, drained)  # empty: the next pass says so
        until = time.time()
        before = state_of(live, until)
        assert before["usage"].count("\n") == 3  # header, alice's and carol's rows

        # the backup, taken while the broker runs and writes (WAL on SQLite)
        backup = (
            postgres_copy(db_url, tmp_path)
            if method == "pg_dump"
            else sqlite_copy(db_url, tmp_path, method)
        )
        with backup as restored_url:
            # changes after the backup, which the restore must not show
            assert live.delete(f"/slices/{held['id']}", token=carol).status_code == 200
            live.post(f"/nodes/{drained}/undrain", token=live.admin_token)
            live.stop()

            status, out, err = cli.main(["upgrade-db", "--db", restored_url]), *capsys.readouterr()
            assert status == 0, err
            assert out.strip().endswith(f"schema at revision {head_revision()}")

            with running_service(tmp_path / "restored", config=config, db_url=restored_url) as back:
                after = state_of(back, until)
                assert after == before
                assert back.get("/whoami", token=carol).json()["name"] == "carol"
                # the restored broker goes on: new slices are numbered after the old ones,
                # and the slice held at the backup still holds its GPUs, so no GPU twice
                back.post(f"/nodes/{drained}/undrain", token=back.admin_token)
                new = submit(back, alice, "vision", 4)
                assert new["id"] > held["id"]
                new = granted(back, new["id"])
                live_slices = back.get(
                    "/slices", token=back.admin_token, params={"state": "live"}
                ).json()["slices"]
                gpus = [
                    (p["node"], i)
                    for s in live_slices
                    for p in s["placements"]
                    for i in p["gpu_indices"]
                ]
                assert len(gpus) == len(set(gpus)) == 8
                assert {s["id"] for s in live_slices} == {held["id"], new["id"]}
