"""Admin changes of the project tree through the API and the CLI against a real broker:
they survive a restart, every change is in the history, apply-config shows the difference
and asks, deleting a project is refused while it is busy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from clihelpers import cli_service, projects_now, run_at_terminal, run_cli
from servicefixtures import TEST_CONFIG, BrokerService


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BrokerService]:
    """A broker on the test cluster; the CLI's URL and admin token in the environment."""
    with cli_service(tmp_path / "broker", monkeypatch, TEST_CONFIG) as service:
        yield service


#: The test cluster's file, changed: vision's share and members, nlp gone, speech new.
CHANGED = (
    TEST_CONFIG.replace('users = ["alice", "bob"]', 'share = 3\nusers = ["alice", "dan"]')
    .replace('[projects.nlp]\nparent = "lab"\nusers = ["carol"]\ngroups = ["nlp-team"]\n', "")
    .replace(
        "[projects.lab]", '[projects.speech]\nparent = "lab"\nusers = ["erin"]\n\n[projects.lab]'
    )
)


def test_admin_changes_survive_a_restart_and_are_in_the_history(service, capsys):
    status, _, err = run_cli(capsys, "project", "set", "nlp", "--share", "2", "--yes")
    assert status == 0, err
    status, _, err = run_cli(capsys, "project", "set", "vision", "--add-user", "dan")
    assert status == 0, err
    service.restart()
    now = projects_now(service)
    assert now["nlp"]["share"] == 2
    assert now["vision"]["users"] == ["alice", "bob", "dan"]
    assert "project tree: from the database (3 accounts)" in service.log_text()

    status, out, err = run_cli(capsys, "history", "--project", "vision")
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["AT", "WHO", "ACTION", "CHANGE"]
    assert "seed" in lines[1] and "+ vision: new account" in lines[1]
    assert lines[2].split()[2:4] == ["root", "set"]
    assert lines[2].endswith("~ vision: users alice,bob -> alice,bob,dan")
    assert len(lines) == 3
    events = service.get("/projects/events", token=service.admin_token).json()["events"]
    assert [(e["account"], e["action"]) for e in events][-2:] == [("nlp", "set"), ("vision", "set")]
    user = service.token("alice")
    assert service.get("/projects/events", token=user).status_code == 403


def test_apply_config_shows_the_difference_and_needs_yes_without_a_terminal(
    service, capsys, tmp_path
):
    changed = tmp_path / "changed.toml"
    changed.write_text(CHANGED)
    status, out, err = run_cli(capsys, "apply-config", str(changed))
    assert status == 2
    assert err.strip() == "error: not applied: no terminal to ask at; pass --yes to apply"
    assert out.splitlines() == [
        "- nlp: removed (share 1 under lab; users carol; groups nlp-team)",
        "+ speech: new account, share 1 under lab; users erin",
        "~ vision: share 1 -> 3; users alice,bob -> alice,dan",
    ]
    assert set(projects_now(service)) == {"lab", "vision", "nlp"}

    status, out, _ = run_cli(capsys, "apply-config", str(changed), "--dry-run")
    assert (
        status == 0 and out.splitlines()[-1] == "3 accounts would change; not applied (--dry-run)"
    )
    status, out, err = run_cli(capsys, "apply-config", str(changed), "--yes")
    assert status == 0, err
    assert out.splitlines()[-1] == "applied: 3 accounts changed"
    now = projects_now(service)
    assert set(now) == {"lab", "vision", "speech"}
    assert (now["vision"]["share"], now["vision"]["users"]) == (3, ["alice", "dan"])
    status, out, _ = run_cli(capsys, "apply-config", str(changed))
    assert (status, out.strip()) == (0, f"the broker's project tree already matches {changed}")
    events = service.get("/projects/events", token=service.admin_token).json()["events"]
    applied = [(e["account"], e["who"]) for e in events if e["action"] == "apply"]
    assert applied == [("nlp", "root"), ("speech", "root"), ("vision", "root")]

    bad = tmp_path / "bad.toml"
    bad.write_text("[projects.a]\nparent = 'nowhere'\n")
    status, _, err = run_cli(capsys, "apply-config", str(bad), "--yes")
    assert status == 2 and err.startswith(f"error: {bad}: ") and len(err.splitlines()) == 1


def test_apply_config_asks_at_a_terminal(service, tmp_path):
    changed = tmp_path / "changed.toml"
    changed.write_text(CHANGED)
    for answer, status, accounts in (
        ("n\n", 1, {"lab", "vision", "nlp"}),
        ("y\n", 0, {"lab", "vision", "speech"}),
    ):
        done = run_at_terminal(service, answer, "apply-config", str(changed))
        assert done.returncode == status, done.stderr
        assert "~ vision: share 1 -> 3; users alice,bob -> alice,dan\napply? [y/N] " in done.stdout
        assert set(projects_now(service)) == accounts


def test_deleting_a_project_is_refused_while_busy_then_accepted(service, capsys):
    token = service.token("carol")
    made = service.post(
        "/slices",
        token=token,
        json={"project": "nlp", "gpus": 1, "kind": "batch", "min_runtime": "1h"},
    )
    assert made.status_code == 201, made.text
    status, _, err = run_cli(capsys, "project", "delete", "nlp")
    assert status == 1
    assert err.strip() == (
        "error: project 'nlp' has 1 live slice; release them first (HTTP 409, conflict)"
    )
    answer = service.delete("/projects/lab", token=service.admin_token)
    assert answer.status_code == 409 and "sub-accounts" in answer.json()["error"]["message"]
    assert service.delete("/projects/nlp", token=token).status_code == 403
    assert service.delete("/projects/nobody", token=service.admin_token).status_code == 404
    released = service.delete(f"/slices/{made.json()['id']}", token=token)
    assert released.status_code == 200, released.text
    status, out, err = run_cli(capsys, "project", "delete", "nlp")
    assert status == 0, err
    assert out.strip() == "deleted nlp: share 1 under lab; users carol; groups nlp-team"
    assert set(projects_now(service)) == {"lab", "vision"}
    service.restart()
    assert set(projects_now(service)) == {"lab", "vision"}
