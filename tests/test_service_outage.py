"""A database outage longer than the lease loses no slice (design.md §8): the first
pass after it extends every live lease by the outage's length. Real broker process,
real SQLite file, locked by another process for the outage."""

from __future__ import annotations

import sqlite3
import time

from hubfixtures import wait_until
from servicefixtures import running_service

LEASE = 2.0


def test_a_database_locked_longer_than_the_lease_loses_no_slice(tmp_path):
    with running_service(tmp_path, lease=LEASE, pass_interval=0.5) as service:
        alice = service.token("alice")
        made = service.post(
            "/slices", token=alice, json={"project": "vision", "gpus": 1, "kind": "batch"}
        ).json()
        wait_until(
            lambda: service.get(f"/slices/{made['id']}", token=alice).json()["state"] == "granted",
            30,
            "the grant",
        )
        service.post(f"/slices/{made['id']}/heartbeat", token=alice)

        # Another process takes the database's write lock for three leases' time:
        # the holder cannot heartbeat and no pass can run.
        lock = sqlite3.connect(tmp_path / "broker.sqlite", isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
        locked_at = time.monotonic()
        try:
            # The outage is the test's subject, not a synchronisation: it must last.
            while time.monotonic() - locked_at < 3 * LEASE:
                time.sleep(0.2)
        finally:
            lock.execute("ROLLBACK")
            lock.close()

        wait_until(
            lambda: "extended the leases of 1 live slices" in service.log_text(),
            30,
            "the first pass after the outage",
        )
        after = service.get(f"/slices/{made['id']}", token=alice).json()
        assert after["state"] == "granted", after
        assert after["lease_expires_at"] > time.time()
