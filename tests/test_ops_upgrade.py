"""The upgrade and rollback steps of ``docs/install.md``, run as written, on SQLite and
PostgreSQL: ``alembic ... current``, ``alembic ... downgrade REV`` with the installed
migrations, then ``slicebroker upgrade-db`` again, with the data kept throughout."""

from __future__ import annotations

import subprocess
import sys

from servicefixtures import running_service, service_env
from sqlalchemy import text

from broker import cli
from broker.orm import MIGRATIONS_DIR, head_revision, make_engine


def alembic(db_url: str, *argv: str) -> str:
    """``alembic -c <installed migrations>/alembic.ini -x url=URL ARGV``: its standard
    output (its log goes to standard error)."""
    config = MIGRATIONS_DIR / "alembic.ini"
    command = [sys.executable, "-m", "alembic", "-c", str(config), "-x", f"url={db_url}", *argv]
    done = subprocess.run(
        command,
        env=service_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def previous_revision() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    down = ScriptDirectory.from_config(config).get_revision(head_revision()).down_revision
    assert isinstance(down, str)
    return down


def slice_count(db_url: str) -> int:
    engine = make_engine(db_url)
    try:
        with engine.connect() as connection:
            return connection.execute(text("SELECT count(*) FROM slices")).scalar_one()
    finally:
        engine.dispose()


def test_a_rollback_by_alembic_downgrade_and_a_new_upgrade_keep_the_data(db_url, tmp_path, capsys):
    with running_service(tmp_path / "broker", db_url=db_url) as service:
        alice = service.token("alice")
        body = {"project": "vision", "gpus": 2, "kind": "batch", "min_runtime": "1h"}
        held = service.post("/slices", token=alice, json=body).json()
    assert slice_count(db_url) == 1

    assert alembic(db_url, "current").split()[-2:] == [head_revision(), "(head)"]
    older = previous_revision()
    alembic(db_url, "downgrade", older)
    assert alembic(db_url, "current").split()[-1] == older
    assert slice_count(db_url) == 1

    assert cli.main(["upgrade-db", "--db", db_url]) == 0
    assert capsys.readouterr().out.strip().endswith(f"schema at revision {head_revision()}")
    with running_service(tmp_path / "again", db_url=db_url) as service:
        answer = service.get(f"/slices/{held['id']}", token=service.admin_token).json()
    assert (answer["user"], answer["gpus"], answer["state"]) == ("alice", 2, held["state"])
