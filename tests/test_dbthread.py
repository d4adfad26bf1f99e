"""The service's database thread (broker/service/dbthread.py): one at a time, urgent
work before the rest, in order within each."""

from __future__ import annotations

import threading

import pytest

from broker.service.dbthread import DatabaseThread


def test_urgent_work_runs_before_the_work_waiting_and_each_in_its_order():
    thread = DatabaseThread("test-db")
    ran: list[str] = []
    go = threading.Event()
    try:
        busy = thread.submit(go.wait)  # running: everything below waits
        waiting = [thread.submit(ran.append, f"read {i}") for i in range(3)]
        urgent = [thread.submit_urgent(ran.append, f"heartbeat {i}") for i in range(2)]
        go.set()
        for future in (busy, *waiting, *urgent):
            future.result(timeout=10)
        assert ran == ["heartbeat 0", "heartbeat 1", "read 0", "read 1", "read 2"]
    finally:
        thread.shutdown()


def test_errors_reach_the_caller_and_a_stopped_thread_takes_no_more_work():
    thread = DatabaseThread("test-db")
    go = threading.Event()
    busy = thread.submit(go.wait)
    failing = thread.submit(int, "not a number")
    cancelled = thread.submit(go.wait)
    assert cancelled.cancel()  # still waiting: never runs
    dropped = thread.submit(go.wait)
    go.set()
    with pytest.raises(ValueError):
        failing.result(timeout=10)
    busy.result(timeout=10)
    dropped.result(timeout=10)
    thread.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        thread.submit(print)
