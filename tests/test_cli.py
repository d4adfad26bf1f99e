"""``slicebroker`` admin commands over real HTTP against a real broker subprocess.

Each test starts a broker (``tests/servicefixtures.py``) and runs the command
in this process (``broker.cli.main``), except where the test is about the
process itself (one line on stderr, no traceback, the ``slicebroker`` script).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from clihelpers import cli_service, projects_now, run_at_terminal, run_cli
from servicefixtures import (
    REPO_ROOT,
    TEST_CONFIG,
    BrokerService,
    free_port,
    running_service,
    service_env,
)

from broker import cli
from broker.orm import head_revision

#: The test cluster with a GPU weight of 1000, so that a fraction of a second of
#: four GPUs shows in GPU-hours with two decimals.
CONFIG = TEST_CONFIG.replace("h100 = 1.0", "h100 = 1000.0")


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BrokerService]:
    """A broker on :data:`CONFIG`; the CLI's URL and (admin) token in the environment."""
    with cli_service(tmp_path / "broker", monkeypatch, CONFIG) as service:
        yield service


def run_script(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``slicebroker ARGV`` as a process."""
    return subprocess.run(
        [sys.executable, "-m", "broker.cli", *argv],
        env=service_env(env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def submit(service: BrokerService, token: str, project: str, gpus: int, **terms) -> dict:
    body = {"project": project, "gpus": gpus, "kind": "batch", "min_runtime": "1h", **terms}
    answer = service.post("/slices", token=token, json=body)
    assert answer.status_code == 201, answer.text
    return answer.json()


def wait_state(service: BrokerService, slice_id: int, known: str) -> dict:
    """The slice once it left state ``known`` (a long-poll: no sleeping)."""
    params = {"wait": 10, "state": known}
    answer = service.get(f"/slices/{slice_id}", token=service.admin_token, params=params)
    slice_ = answer.json()
    assert slice_["state"] != known, slice_
    return slice_


def wait_queued(service: BrokerService, slice_id: int) -> dict:
    """The pending slice once a pass gave it a queue position (long-polls if none yet)."""
    slice_ = service.get(f"/slices/{slice_id}", token=service.admin_token).json()
    if slice_["queue_position"] is None:  # the next pass will set it: wait for that news
        params = {"wait": 10}
        slice_ = service.get(f"/slices/{slice_id}", token=service.admin_token, params=params).json()
    assert slice_["queue_position"] is not None, slice_
    return slice_


def rows_of(out: str) -> dict[str, list[str]]:
    """A table's rows by their first cell (stripped), cells split on runs of 2+ spaces."""
    rows = {}
    for line in out.splitlines()[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells
    return rows


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


# ---- projects -----------------------------------------------------------------


def test_projects_shows_the_tree_with_usage_fair_share_rank_held_and_pending(service, capsys):
    alice, carol = service.token("alice"), service.token("carol")
    first = submit(service, alice, "vision", 4)
    wait_state(service, first["id"], "pending")
    charged = service.delete(f"/slices/{first['id']}", token=alice).json()["charged_gpu_seconds"]
    assert charged > 0
    held = submit(service, alice, "vision", 4)
    wait_state(service, held["id"], "pending")
    submit(service, carol, "nlp", 8)  # cannot fit while vision holds 4: waits

    status, out, err = run_cli(capsys, "projects")

    assert status == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:7] == [
        "ACCOUNT",
        "SHARE",
        "ENTITLEMENT",
        "USAGE",
        "GPU-h",
        "SHARE",
        "USED",
    ]
    assert [line.split()[0] for line in lines[1:]] == ["lab", "nlp", "vision"]
    assert lines[2].startswith("  nlp") and lines[3].startswith("  vision")  # indented under lab
    rows = rows_of(out)
    # usage = the released slice's charge (plus the held slice's, accruing), in GPU-hours
    share, entitlement, usage, fairshare, rank, gpus_held, pending = rows["vision"][1:8]
    assert (share, entitlement, rank, gpus_held, pending) == ("1", "50.0%", "2", "4", "0")
    assert float(usage) >= round(charged / 3600, 2)
    assert fairshare == "2.00×"  # all usage is vision's; its entitlement is half
    assert rows["nlp"][1:8] == ["1", "50.0%", "0.00", "0.00×", "1", "0", "1"]
    assert rows["nlp"][8] == "users carol; groups nlp-team"
    assert rows["lab"][1:3] == ["1", "100.0%"]


def test_projects_json_is_the_api_answer(service, capsys):
    import json

    status, out, _ = run_cli(capsys, "projects", "--json")
    assert status == 0
    assert [p["name"] for p in json.loads(out)] == ["lab", "nlp", "vision"]


def test_project_set_changes_share_and_members_and_keeps_the_parent(service, capsys):
    status, out, err = run_cli(
        capsys, "project", "set", "vision", "--share", "3", "--users", "alice,dave", "--yes"
    )
    assert status == 0, err
    assert out.splitlines() == [
        "vision: share 1 -> 3; users alice,bob -> alice,dave",
        "ACCOUNT  BEFORE  AFTER  CHANGE (points)",
        "vision    50.0%  75.0%            +25.0",
        "nlp       50.0%  25.0%            -25.0",
        "(1 other account unchanged)",
        "vision: share 3 under lab, entitlement 75.0%; members: users alice,dave",
    ]
    projects = {
        p["name"]: p for p in service.get("/projects", token=service.admin_token).json()["projects"]
    }
    assert projects["vision"]["parent"] == "lab"
    assert projects["vision"]["users"] == ["alice", "dave"]
    assert projects["nlp"]["entitlement"] == pytest.approx(0.25)


def test_project_set_creates_an_account_under_a_parent(service, capsys):
    status, out, err = run_cli(
        capsys,
        "project",
        "set",
        "audio",
        "--share",
        "2",
        "--parent",
        "lab",
        "--groups",
        "sound",
        "-y",
    )
    assert status == 0, err
    assert out.splitlines()[0] == "audio: new account, share 2 under lab"
    assert (
        out.splitlines()[-1] == "audio: share 2 under lab, entitlement 50.0%; members: groups sound"
    )
    status, out, _ = run_cli(capsys, "projects")
    assert rows_of(out)["audio"][1:3] == ["2", "50.0%"]


def test_project_set_adds_and_removes_members_and_keeps_the_rest(service, capsys):
    status, out, err = run_cli(
        capsys, "project", "set", "vision", "--add-user", "dave,erin", "--add-user", "alice",
        "--remove-user", "bob", "--add-group", "cv-team",
    )  # fmt: skip
    assert status == 0, err
    assert out.splitlines() == [  # no entitlement moves: applied without asking
        "vision: users alice,bob -> alice,dave,erin; groups (none) -> cv-team",
        "vision: share 1 under lab, entitlement 50.0%; members: users alice,dave,erin; "
        "groups cv-team",
    ]
    vision = projects_now(service)["vision"]
    assert (vision["share"], vision["parent"]) == (1, "lab")
    assert (vision["users"], vision["groups"]) == (["alice", "dave", "erin"], ["cv-team"])

    status, out, err = run_cli(capsys, "project", "set", "vision", "--remove-user", "bob")
    assert (status, out) == (2, "")
    assert one_error_line(err) == "error: bob is not one of the users of 'vision'"
    status, out, _ = run_cli(capsys, "project", "set", "vision", "--add-user", "alice")
    assert (status, out) == (0, "vision: no change\n")


def test_project_set_without_a_terminal_needs_yes_to_move_entitlements(service, capsys):
    status, out, err = run_cli(capsys, "project", "set", "vision", "--share", "3")
    assert status == 2
    assert one_error_line(err) == (
        "error: not applied: entitlements would change; pass --yes to apply without asking"
    )
    assert "vision    50.0%  75.0%" in out  # the preview was shown
    assert projects_now(service)["vision"]["share"] == 1

    status, out, _ = run_cli(capsys, "project", "set", "vision", "--share", "3", "--dry-run")
    assert status == 0 and out.splitlines()[-1] == "not applied (--dry-run)"
    assert projects_now(service)["vision"]["share"] == 1


def test_project_set_asks_at_a_terminal(service):
    for answer, status, share in (("n\n", 1, 1), ("y\n", 0, 2)):
        done = run_at_terminal(service, answer, "project", "set", "nlp", "--share", "2")
        assert done.returncode == status, done.stderr
        assert (
            "nlp       50.0%  66.7%            +16.7\n"
            "vision    50.0%  33.3%            -16.7\n"
            "(1 other account unchanged)\n"
            "apply? [y/N] "
        ) in done.stdout
        assert projects_now(service)["nlp"]["share"] == share


def test_project_set_moves_an_account_to_the_top_only_when_asked(service, capsys):
    status, _, err = run_cli(capsys, "project", "set", "vision", "--parent", "", "--yes")
    assert status == 2
    assert "pass --top-level" in one_error_line(err)
    assert projects_now(service)["vision"]["parent"] == "lab"

    status, out, err = run_cli(capsys, "project", "set", "vision", "--top-level", "--yes")
    assert status == 0, err
    # vision keeps its half; lab, the only top-level account before, gives up half
    assert out.splitlines()[:5] == [
        "vision: parent lab -> (top)",
        "ACCOUNT  BEFORE  AFTER  CHANGE (points)",
        "vision    50.0%  50.0%             +0.0",
        "lab      100.0%  50.0%            -50.0",
        "(1 other account unchanged)",
    ]
    projects = projects_now(service)
    assert projects["vision"]["parent"] is None
    assert projects["vision"]["entitlement"] == pytest.approx(0.5)
    assert projects["lab"]["entitlement"] == pytest.approx(0.5)


def test_project_set_refuses_a_new_account_without_a_share_or_an_unknown_parent(service, capsys):
    status, _, err = run_cli(capsys, "project", "set", "audio", "--users", "dave")
    assert status == 2
    assert one_error_line(err) == "error: no account 'audio': a new account needs --share"
    status, _, err = run_cli(capsys, "project", "set", "audio", "--share", "1", "--parent", "lb")
    assert status == 2
    assert one_error_line(err) == "error: no account 'lb' to put 'audio' under"
    assert "audio" not in projects_now(service)


# ---- nodes and drains -------------------------------------------------------------


def test_nodes_drain_and_undrain(service, capsys):
    alice = service.token("alice")
    held = wait_state(service, submit(service, alice, "vision", 3)["id"], "pending")
    node = held["placements"][0]["node"]

    status, out, _ = run_cli(capsys, "drain", node, "--reason", "fan failure")
    assert status == 0
    assert out.strip() == (
        f"node {node}: draining (fan failure); 3 GPUs still held, drained once they are given back"
    )
    status, out, _ = run_cli(capsys, "nodes")
    assert status == 0
    rows = rows_of(out)
    assert out.splitlines()[0].split() == [
        "NODE", "TYPE", "GPUS", "HELD", "WEIGHT", "STATE", "BY", "SINCE", "REASON"
    ]  # fmt: skip
    assert rows[node][1:7] == ["h100", "4", "3", "1000", "draining", "admin"]
    assert rows[node][-1] == "fan failure"
    other = ({"n0", "n1"} - {node}).pop()
    assert rows[other][1:7] == ["h100", "4", "0", "1000", "ready", "-"]

    status, out, _ = run_cli(capsys, "undrain", node)
    assert status == 0
    assert out.startswith(f"node {node}: ready")
    nodes = {n["name"]: n for n in service.get("/nodes", token=alice).json()["nodes"]}
    assert nodes[node]["state"] == "ready"


def test_down_ends_the_slices_on_the_node(service, capsys):
    alice = service.token("alice")
    held = wait_state(
        service, submit(service, alice, "vision", 2, resumable=False)["id"], "pending"
    )
    node = held["placements"][0]["node"]
    status, out, _ = run_cli(capsys, "down", node, "--reason", "PSU")
    assert (status, out.strip()) == (0, f"node {node}: down (PSU)")
    assert wait_state(service, held["id"], "granted")["end_reason"] == "node_down"


# ---- queue, slices, release -----------------------------------------------------------


def test_queue_lists_pending_slices_in_fair_share_order(service, capsys):
    alice, carol = service.token("alice"), service.token("carol")
    for _ in range(2):  # fill both nodes for vision
        wait_state(service, submit(service, alice, "vision", 4)["id"], "pending")
    late_vision = submit(service, alice, "vision", 2, priority=5)
    nlp = submit(service, carol, "nlp", 1, min_runtime="30m")
    wait_queued(service, nlp["id"])  # the pass after the last submission has run

    status, out, err = run_cli(capsys, "queue")

    assert status == 0, err
    header, *lines = out.splitlines()
    assert header.split()[:9] == [
        "POS", "SLICE", "PROJECT", "USER", "GPUS", "TYPE", "KIND", "CONTRACT", "PRIO"
    ]  # fmt: skip
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines]
    # nlp has used nothing, vision holds 8 GPUs: nlp first
    assert [c[:9] for c in cells] == [
        ["1", str(nlp["id"]), "nlp", "carol", "1", "any", "batch", "30m", "0"],
        ["2", str(late_vision["id"]), "vision", "alice", "2", "any", "batch", "1h", "5"],
    ]
    assert cells[0][9] == "0.00×"  # nlp's share used
    assert cells[1][9].endswith("×") and float(cells[1][9][:-1]) > 0  # vision's
    assert cells[0][11].startswith("in ")  # an estimated start: when vision's contract ends

    status, out, _ = run_cli(capsys, "queue", "--project", "vision")
    assert [line.split()[2] for line in out.splitlines()[1:]] == ["vision"]


def test_slices_filters_by_state_and_user(service, capsys):
    alice, carol = service.token("alice"), service.token("carol")
    granted = wait_state(service, submit(service, alice, "vision", 2)["id"], "pending")
    ended = wait_state(service, submit(service, carol, "nlp", 1)["id"], "pending")
    service.delete(f"/slices/{ended['id']}", token=carol)

    _, out, _ = run_cli(capsys, "slices")
    rows = rows_of(out)
    assert list(rows) == [str(granted["id"])]  # live ones by default
    placement = granted["placements"][0]
    indices = ",".join(map(str, placement["gpu_indices"]))
    assert rows[str(granted["id"])][1:7] == [
        "vision", "alice", "2", "batch", "granted", f"{placement['node']}[{indices}]"
    ]  # fmt: skip

    _, out, _ = run_cli(capsys, "slices", "--state", "all", "--user", "carol")
    rows = rows_of(out)
    assert list(rows) == [str(ended["id"])]
    assert rows[str(ended["id"])][5] == "ended" and rows[str(ended["id"])][-1] == "released"


def test_checkpoint_and_release_a_slice_and_the_release_reports_its_charge(
    service, capsys, monkeypatch
):
    alice = service.token("alice")
    held = wait_state(service, submit(service, alice, "vision", 4)["id"], "pending")
    # A job reports its checkpoint with the slice 'slicebroker run' names in its environment.
    monkeypatch.setenv("SLICEBROKER_SLICE_ID", str(held["id"]))
    status, out, _ = run_cli(capsys, "checkpoint")
    assert status == 0 and out.startswith(f"slice {held['id']}: checkpoint recorded at ")
    saved = service.get(f"/slices/{held['id']}", token=alice).json()["checkpointed_at"]
    assert saved is not None and saved >= held["granted_at"]

    status, out, _ = run_cli(capsys, "release", str(held["id"]))
    assert status == 0
    slice_ = service.get(f"/slices/{held['id']}", token=alice).json()
    assert slice_["end_reason"] == "released"
    hours = slice_["charged_gpu_seconds"] / 3600
    assert out.strip() == f"slice {held['id']}: ended (released), charged {hours:.2f} GPU-h"


def test_sooner_says_what_would_start_a_waiting_slice_now(service, capsys):
    alice = service.token("alice")
    for gpus in (3, 4):  # alice holds 7 of the 8 GPUs: one is free
        wait_state(
            service, submit(service, alice, "vision", gpus, min_runtime="8h")["id"], "pending"
        )
    waiting = wait_queued(service, submit(service, alice, "vision", 2)["id"])
    status, out, _ = run_cli(capsys, "sooner", str(waiting["id"]))
    assert status == 0
    header, *rows = [line.split() for line in out.splitlines()]
    assert header == ["#", "INSTEAD", "STARTS", "PROTECTED", "GPU-h"]
    # 1 GPU for its hour of protection, at this cluster's weight of 1000
    assert rows[0] == ["1", "1", "GPU", "now", "1000.00"]
    # a debug session (2 GPUs, 15 min) would get GPUs once alice's protection ends
    assert rows[1:] == [["2", "a", "15m", "debug", "session", "in", "about", "8h", "500.00"]]
    status, out, _ = run_cli(capsys, "sooner", str(waiting["id"] + 1000))
    assert status != 0

    # Taking the first: the request is withdrawn for 1 GPU in one step, and granted.
    status, out, err = run_cli(capsys, "sooner", str(waiting["id"]), "--take", "3")
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and "has 2 alternatives; --take 3 names none" in err
    status, out, _ = run_cli(capsys, "sooner", str(waiting["id"]), "--take", "1")
    assert status == 0
    old = service.get(f"/slices/{waiting['id']}", token=alice).json()
    assert (old["state"], old["end_reason"]) == ("ended", "cancelled")
    assert out.strip().startswith(
        f"slice {waiting['id']} withdrawn for slice {old['replaced_by']}: 1 GPU"
    )
    new = wait_state(service, old["replaced_by"], "pending")
    assert (new["state"], new["gpus"]) == ("granted", 1)
    assert new["submitted_at"] == waiting["submitted_at"]  # its place in the queue kept
    assert old["charged_gpu_seconds"] == 0


# ---- usage ------------------------------------------------------------------------------


def test_usage_table_and_csv_show_the_ledger(service, capsys):
    alice, bob = service.token("alice"), service.token("bob")
    charged = {}
    for user, token in (("alice", alice), ("bob", bob)):
        held = wait_state(service, submit(service, token, "vision", 4)["id"], "pending")
        answer = service.delete(f"/slices/{held['id']}", token=token).json()
        charged[user] = answer["charged_gpu_seconds"]

    status, out, err = run_cli(capsys, "usage", "vision", "--since", "1h", "--until", "now")
    assert status == 0, err
    title, header, *lines = out.splitlines()
    assert title.startswith("usage of vision from ")
    assert header.split() == ["PROJECT", "USER", "SLICES", "GPU-h", "WEIGHTED", "GPU-h"]
    rows = {cells[1] if cells[0] != "total" else "total": cells for cells in map(str.split, lines)}
    for user in ("alice", "bob"):
        assert rows[user][:3] == ["vision", user, "1"]
        assert rows[user][4] == f"{charged[user] / 3600:.2f}"
    assert rows["total"][1] == "2"

    status, out, _ = run_cli(capsys, "usage", "lab", "--csv", "--since", "2h")
    assert status == 0
    parsed = list(csv.DictReader(io.StringIO(out)))
    assert [(r["project"], r["user"]) for r in parsed] == [("vision", "alice"), ("vision", "bob")]
    for row in parsed:
        assert float(row["weighted_gpu_seconds"]) == pytest.approx(charged[row["user"]])
        assert float(row["gpu_seconds"]) == pytest.approx(charged[row["user"]] / 1000)

    status, out, _ = run_cli(capsys, "usage", "lab", "--csv", "--by", "project")
    parsed = list(csv.DictReader(io.StringIO(out)))
    assert [r["project"] for r in parsed] == ["vision"] and "user" not in parsed[0]
    assert float(parsed[0]["weighted_gpu_seconds"]) == pytest.approx(sum(charged.values()))


def test_parse_time_reads_dates_durations_and_epochs():
    now = 1_700_000_000.0
    assert cli.parse_time("now", now) == now
    assert cli.parse_time("7d", now) == now - 7 * 86400
    assert cli.parse_time("1h30m", now) == now - 5400
    assert cli.parse_time("1699990000", now) == 1_699_990_000
    assert cli.parse_time("2023-11-14T22:13:20Z", now) == now
    assert cli.parse_time("2023-11-14T22:13:20+00:00", now) == now
    with pytest.raises(ValueError, match="invalid time 'yesterday'"):
        cli.parse_time("yesterday", now)


# ---- errors: one line, the right status -------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["release", "not-a-number"], "argument ID: expected a whole number >= 1"),
        (["checkpoint"], "no slice: give its ID or set SLICEBROKER_SLICE_ID"),
        (["project", "set", "x", "--parent", ""], "pass --top-level to move the account"),
        (["project", "set", "x", "--parent", "a", "--top-level"], "not allowed with argument"),
        (["project", "set", "x", "--users", "a", "--add-user", "b"], "--users replaces the list"),
        (["project", "set", "x", "--add-group", "g", "--remove-group", "g"], "g: both added"),
        (["project", "set", "x", "--share", "-1"], "expected a number > 0, got '-1'"),
        (["usage", "lab", "--since", "last tuesday"], "invalid time 'last tuesday'"),
        (["run", "--project", "p", "--gpus", "1", "--min-runtime", "1x", "--", "true"], "1x"),
        (["run", "--project", "p", "--gpus", "1", "--min-runtime", "1h"], "no command to run"),
        (["nodes", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(argv, expected, capsys, monkeypatch):
    monkeypatch.delenv("SLICEBROKER_SLICE_ID", raising=False)
    monkeypatch.setenv("SLICEBROKER_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("SLICEBROKER_TOKEN", "x")
    status, _, err = run_cli(capsys, *argv)
    assert status == 2
    assert expected in one_error_line(err)


def test_no_url_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.delenv("SLICEBROKER_URL", raising=False)
    status, _, err = run_cli(capsys, "projects", "--token", "x")
    assert status == 2
    assert "no broker URL" in one_error_line(err)


def test_unreachable_broker_is_one_line_status_1():
    port = free_port()  # nothing listens there
    done = run_script("nodes", "--url", f"http://127.0.0.1:{port}", "--token", "x")
    assert done.returncode == 1
    line = one_error_line(done.stderr)
    assert line == f"error: cannot reach the broker at http://127.0.0.1:{port}: connection refused"
    assert done.stdout == ""


def test_api_errors_are_one_line_status_1(service):
    env = {"SLICEBROKER_URL": service.url, "SLICEBROKER_TOKEN": "sb_1_wrong"}
    done = run_script("projects", env=env)
    assert done.returncode == 1
    assert "(HTTP 401, unauthorized)" in one_error_line(done.stderr)

    env["SLICEBROKER_TOKEN"] = service.token("alice")
    done = run_script("drain", "n0", env=env)
    assert done.returncode == 1
    assert "(HTTP 403, forbidden)" in one_error_line(done.stderr)
    assert service.get("/nodes", token=service.admin_token).json()["nodes"][0]["state"] == "ready"

    env["SLICEBROKER_TOKEN"] = service.admin_token
    done = run_script("usage", "nowhere", env=env)
    assert done.returncode == 1
    assert one_error_line(done.stderr) == "error: no project 'nowhere' (HTTP 404, not_found)"

    done = run_script("drain", "n9", env=env)
    assert (done.returncode, one_error_line(done.stderr)) == (
        1,
        "error: no node 'n9' (HTTP 404, not_found)",
    )


# ---- local commands -----------------------------------------------------------------------


def test_upgrade_db_creates_the_schema_and_token_create_prints_a_working_token(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'fresh.sqlite'}"
    status, out, err = run_cli(capsys, "upgrade-db", "--db", url)
    assert status == 0, err
    assert out.strip() == f"{url}: schema at revision {head_revision()}"

    status, out, err = run_cli(capsys, "token", "create", "--user", "root", "--db", url)
    assert status == 0, err
    token = out.strip()
    assert len(out.splitlines()) == 1 and token.startswith("sb_")

    with running_service(tmp_path / "svc", db_url=url) as service:
        whoami = service.get("/whoami", token=token).json()
    assert (whoami["name"], whoami["admin"]) == ("root", True)  # root is a configured admin


def test_upgrade_db_on_a_bad_url_is_one_line_status_1(tmp_path, capsys):
    status, _, err = run_cli(capsys, "upgrade-db", "--db", "nosuchdb://x")
    assert status == 1
    assert one_error_line(err).startswith("error: cannot upgrade")

    status, _, err = run_cli(capsys, "token", "create", "--user", "a")
    assert status == 2
    assert "no database" in one_error_line(err)


def test_token_revoke_revokes_one_token_or_every_token_of_a_user(tmp_path, capsys):
    uncached = ["--BrokerApp.token_cache_max_age=0"]  # revocations show at once
    with running_service(tmp_path / "svc", extra_args=uncached) as service:
        url = service.db_url
        first, second, bob = service.token("alice"), service.token("alice"), service.token("bob")

        def whoami(token: str) -> int:
            return service.get("/whoami", token=token).status_code

        status, out, err = run_cli(capsys, "token", "revoke", first, "--db", url)
        assert (status, out, err) == (0, "revoked 1 token\n", "")
        assert (whoami(first), whoami(second), whoami(bob)) == (401, 200, 200)

        status, _, err = run_cli(capsys, "token", "revoke", first, "--db", url)
        assert status == 1
        assert one_error_line(err) == f"error: no such token in {url}"

        status, out, err = run_cli(capsys, "token", "revoke", "--user", "alice", "--db", url)
        assert (status, out, err) == (0, "revoked 1 token of alice\n", "")
        assert (whoami(second), whoami(bob)) == (401, 200)
        status, out, _ = run_cli(capsys, "token", "revoke", "--user", "alice", "--db", url)
        assert (status, out) == (0, "revoked 0 tokens of alice\n")

    for argv in ([], [bob, "--user", "bob"], ["--id", "1", "--user", "bob"], ["--id", "x"]):
        status, _, err = run_cli(capsys, "token", "revoke", *argv, "--db", url)
        assert status == 2
        assert "see 'slicebroker token revoke --help'" in one_error_line(err)


def test_token_list_shows_every_token_without_its_secret_and_revoke_takes_its_number(
    tmp_path, capsys
):
    uncached = ["--BrokerApp.token_cache_max_age=0"]
    with running_service(tmp_path / "svc", extra_args=uncached) as service:
        url = service.db_url
        alice = service.token("alice")
        _, spawner, _ = run_cli(capsys, "token", "create", "--user", "hub", "--agent", "--db", url)
        spawner = spawner.strip()

        status, out, err = run_cli(capsys, "token", "list", "--json", "--db", url)
        assert status == 0, err
        tokens = json.loads(out)
        assert [(t["user"], t["agent"], t["admin"]) for t in tokens][-2:] == [
            ("alice", False, False),
            ("hub", True, False),
        ]
        number = {t["user"]: t["id"] for t in tokens}
        assert spawner.startswith(f"sb_{number['hub']}_")
        status, out, _ = run_cli(capsys, "token", "list", "--user", "hub", "--db", url)
        header, row = out.splitlines()
        assert header.split() == ["ID", "USER", "KIND", "ADMIN", "CREATED"]
        assert row.split()[:4] == [str(number["hub"]), "hub", "agent", "no"]
        # The secret is all after "sb_<id>_": it may hold "_" itself, and a fragment after
        # its last "_" can be a character or two that the table holds anyway.
        assert spawner.split("_", 2)[2] not in out and alice.split("_", 2)[2] not in out

        status, out, err = run_cli(
            capsys, "token", "revoke", "--id", str(number["hub"]), "--db", url
        )
        assert (status, out, err) == (0, f"revoked token {number['hub']}\n", "")
        assert service.get("/whoami", token=spawner).status_code == 401
        assert service.get("/whoami", token=alice).status_code == 200
        status, _, err = run_cli(capsys, "token", "revoke", "--id", str(number["hub"]), "--db", url)
        assert status == 1
        assert one_error_line(err) == f"error: no token {number['hub']} in {url}"


def test_serve_passes_every_option_to_the_service(tmp_path):
    config = tmp_path / "cluster.toml"
    config.write_text(TEST_CONFIG)
    db = f"sqlite:///{tmp_path / 'broker.sqlite'}"
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker.cli",
            "serve",
            f"--config-file={config}",
            f"--BrokerApp.db_url={db}",
            "--ip=127.0.0.1",
            f"--BrokerApp.port={port}",
            "--log-level=WARN",
        ],
        env=service_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        service = BrokerService(port, db, config, tmp_path / "log", [], {}, process=process)
        service.wait_until_up(30)
        token = service.token("root", admin=True)
        assert service.get("/whoami", token=token).json()["name"] == "root"
    finally:
        process.terminate()
        process.wait(10)
    assert process.returncode == 0


def test_serve_help_is_the_service_help():
    done = run_script("serve", "--help")
    assert done.returncode == 0
    assert "--pass-interval=<Float>" in done.stdout
    assert "Equivalent to: [--BrokerApp.pass_interval]" in done.stdout


# ---- defects an admin met: one line and the right status, never a traceback -------------


def test_a_broker_url_without_a_scheme_is_a_usage_error(capsys):
    status, out, err = run_cli(capsys, "nodes", "--url", "127.0.0.1:18501", "--token", "x")
    assert (status, out) == (2, "")
    assert one_error_line(err).startswith("error: invalid broker URL '127.0.0.1:18501'")


def test_token_commands_refuse_a_missing_database_unless_create(tmp_path, capsys):
    typo = tmp_path / "brokr.sqlite"
    url = f"sqlite:///{typo}"
    status, out, err = run_cli(capsys, "token", "create", "--user", "root", "--db", url)
    assert (status, out) == (2, "")
    assert one_error_line(err) == (
        f"error: no database at {typo}: check the path, or pass --create to make a new one"
    )
    status, _, err = run_cli(capsys, "token", "list", "--db", url)
    assert status == 2
    assert one_error_line(err) == f"error: no database at {typo}: check the path"
    assert not typo.exists()  # nothing was made on the way

    status, out, err = run_cli(capsys, "token", "create", "--user", "root", "--create", "--db", url)
    assert status == 0, err
    assert out.startswith("sb_1_") and typo.exists()
    status, out, _ = run_cli(capsys, "token", "list", "--db", url)
    assert status == 0 and out.splitlines()[1].split()[:2] == ["1", "root"]


def test_token_commands_refuse_a_database_without_the_schema(tmp_path, capsys):
    import sqlite3

    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as connection:
        connection.execute("CREATE TABLE unrelated (x INTEGER)")
    url = f"sqlite:///{other}"
    status, _, err = run_cli(capsys, "token", "create", "--user", "root", "--db", url)
    assert status == 2
    assert one_error_line(err) == (
        f"error: {url} is not a slicebroker database: check the URL, "
        "run 'slicebroker upgrade-db' or pass --create"
    )


def test_a_missing_database_directory_is_named(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'no-such-dir' / 'broker.sqlite'}"
    expected = f"error: cannot open {url}: the directory {tmp_path / 'no-such-dir'} does not exist"
    for argv in (["upgrade-db"], ["token", "create", "--user", "a", "--create"]):
        status, out, err = run_cli(capsys, *argv, "--db", url)
        assert (status, out) == (2, "")
        assert one_error_line(err) == expected


def test_upgrade_db_says_clearly_that_the_database_is_newer_than_the_code(tmp_path, capsys):
    import sqlite3

    file = tmp_path / "broker.sqlite"
    url = f"sqlite:///{file}"
    assert run_cli(capsys, "upgrade-db", "--db", url)[0] == 0
    with sqlite3.connect(file) as connection:
        connection.execute("UPDATE alembic_version SET version_num = '0099'")

    status, out, err = run_cli(capsys, "upgrade-db", "--db", url)

    assert (status, out) == (1, "")
    line = one_error_line(err)
    assert (
        f"is at schema revision 0099, unknown to this slicebroker (which expects {head_revision()})"
        in line
    )
    assert line.endswith(
        "Upgrade the slicebroker package, or restore a backup made before the upgrade."
    )
    with sqlite3.connect(file) as connection:
        assert connection.execute("SELECT version_num FROM alembic_version").fetchall() == [
            ("0099",)
        ]


def test_a_closed_pipe_ends_the_command_quietly(tmp_path):
    import os

    config = tmp_path / "cluster.toml"
    config.write_text(TEST_CONFIG)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written: `| head -0`
    try:
        done = subprocess.run(
            [sys.executable, "-m", "broker.cli", "check-config", str(config)],
            env=service_env(),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (cli.BROKEN_PIPE, "")


def test_demo_config_prints_the_installed_demo_file(tmp_path, capsys):
    from broker.config import DEMO_CONFIG

    status, out, err = run_cli(capsys, "demo-config")
    assert (status, err) == (0, "")
    assert out == DEMO_CONFIG.read_text() and "[[nodes]]" in out
    saved = tmp_path / "cluster.toml"
    saved.write_text(out)
    assert run_cli(capsys, "check-config", str(saved))[0] == 0

    status, out, _ = run_cli(capsys, "demo-config", "--path")
    assert status == 0 and Path(out.strip()) == DEMO_CONFIG and DEMO_CONFIG.is_file()


def test_an_empty_usage_report_keeps_its_period(service, capsys):
    status, out, err = run_cli(
        capsys, "usage", "nlp", "--since", "2025-03-01", "--until", "2025-03-02T12:00"
    )
    assert status == 0, err
    title, _, total = out.splitlines()
    assert title == "usage of nlp from 2025-03-01 00:00 to 2025-03-02 12:00"
    assert total.split() == ["total", "0", "0.00", "0.00"]

    status, out, _ = run_cli(capsys, "usage", "nlp", "--until", "2025-03-02")
    assert out.splitlines()[0] == "usage of nlp in the lookback window to 2025-03-02 00:00"


def test_every_command_the_documentation_names_is_one_the_cli_has():
    parser = cli.build_parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    texts = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    named = {
        (path.name, match)
        for path in texts
        for match in re.findall(r"`slicebroker\s+([a-z][a-z-]*)", path.read_text())
    }
    assert len(named) > 50  # the pages do name the commands
    assert {(page, name) for page, name in named if name not in commands.choices} == set()
