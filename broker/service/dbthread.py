"""The service's one database thread, with urgent work first.

Every read and write of the Broker runs on this one thread (design.md §8), one
at a time. Most work runs in the order it came; work submitted as urgent — the
group commit of heartbeats and the look-up of a token — runs before any work
that is still waiting. Under load the queue may hold seconds of passes and
reads; a heartbeat that waited behind them would let a lease lapse, and a slice
that is running fine would be ended as lost.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_Work = tuple[Future, Callable[..., Any], tuple, dict]


class DatabaseThread(Executor):
    """An executor of one thread that takes urgent work before the rest."""

    def __init__(self, name: str):
        self._urgent: deque[_Work] = deque()
        self._rest: deque[_Work] = deque()
        self._changed = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """``fn(*args, **kwargs)`` after the work already waiting."""
        return self._put(self._rest, fn, args, kwargs)

    def submit_urgent(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """``fn(*args, **kwargs)`` before the work that is not urgent."""
        return self._put(self._urgent, fn, args, kwargs)

    def _put(self, queue: deque[_Work], fn: Callable[..., Any], args: tuple, kwargs: dict):
        future: Future = Future()
        with self._changed:
            if self._stopping:
                raise RuntimeError("the database thread is shut down")
            queue.append((future, fn, args, kwargs))
            self._changed.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._changed:
                while not (self._urgent or self._rest or self._stopping):
                    self._changed.wait()
                if not (self._urgent or self._rest):
                    return  # stopping, and nothing is left
                queue = self._urgent if self._urgent else self._rest
                future, fn, args, kwargs = queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            try:
                result = fn(*args, **kwargs)
            except BaseException as error:  # the caller's to handle, as in any executor
                future.set_exception(error)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more work; the work already waiting still runs unless cancelled."""
        with self._changed:
            self._stopping = True
            if cancel_futures:
                for queue in (self._urgent, self._rest):
                    while queue:
                        queue.popleft()[0].cancel()
            self._changed.notify()
        if wait:
            self._thread.join()
