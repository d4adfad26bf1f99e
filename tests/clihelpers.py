"""Helpers for the ``slicebroker`` CLI tests: a broker the CLI's environment points at, the
command run in this process or at a terminal, and the broker's projects as it has them."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from servicefixtures import BrokerService, running_service, service_env

from broker import cli


@contextmanager
def cli_service(
    directory: Path, monkeypatch: pytest.MonkeyPatch, config: str
) -> Iterator[BrokerService]:
    """A broker on ``config``; the CLI's URL and (admin) token in the environment."""
    with running_service(directory, config=config) as service:
        monkeypatch.setenv("SLICEBROKER_URL", service.url)
        monkeypatch.setenv("SLICEBROKER_TOKEN", service.admin_token)
        yield service


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """``slicebroker ARGV`` in this process: status, stdout, stderr."""
    status = cli.main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def run_at_terminal(service: BrokerService, typed: str, *argv: str) -> subprocess.CompletedProcess:
    """``slicebroker ARGV`` as a process as the admin, its stdin a terminal on which
    ``typed`` is already written (read once the prompt is shown)."""
    env = {"SLICEBROKER_URL": service.url, "SLICEBROKER_TOKEN": service.admin_token}
    controller, terminal = pty.openpty()
    os.write(controller, typed.encode())
    try:
        return subprocess.run(
            [sys.executable, "-m", "broker.cli", *argv],
            env=service_env(env),
            stdin=terminal,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(terminal)
        os.close(controller)


def projects_now(service: BrokerService) -> dict[str, dict]:
    """The broker's projects by name, as an admin reads them."""
    answer = service.get("/projects", token=service.admin_token)
    assert answer.status_code == 200, answer.text
    return {p["name"]: p for p in answer.json()["projects"]}
