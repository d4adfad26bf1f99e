"""What the hub's sessions read of one broker, shared by all of them, as KubeSpawner's
reflectors share what they read of the Kubernetes API.

One :class:`BrokerView` per broker URL holds:

- the queue view for the idle rule (pending slices, nodes, granted slices), read at
  most once per ``max_age`` for every session of the hub (:meth:`BrokerView.queue`);
- the nodes and the granted slices as last seen, by any read: what the pending page
  and the notices say about draining nodes and protections ending;
- the GPUs of sessions this hub is stopping as idle since the queue view was read
  (``freeing``): the next idle checks count them as free, so that one waiting
  request does not cost every idle session that could serve it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar

#: The three reads of the queue view: pending slices, nodes, granted slices.
QueueRead = Callable[[], Awaitable[tuple[list, list, list]]]


class BrokerView:
    """The hub's shared view of one broker (see the module docstring)."""

    _views: ClassVar[dict[str, BrokerView]] = {}

    def __init__(self) -> None:
        self.nodes_seen: list[dict[str, Any]] | None = None
        self.held_seen: list[dict[str, Any]] = []
        self.freeing: dict[str, int] = {}  # node -> GPUs on their way back
        # (monotonic time, event loop, the read under way or done)
        self._read: tuple[float, asyncio.AbstractEventLoop, asyncio.Future] | None = None

    @classmethod
    def of(cls, broker_url: str) -> BrokerView:
        """The view of the broker at ``broker_url`` (made on first use)."""
        view = cls._views.get(broker_url)
        if view is None:
            view = cls._views[broker_url] = cls()
        return view

    def _fresh(self, max_age: float) -> asyncio.Future | None:
        """The read to share, unless it is older than ``max_age``, of another event
        loop, or failed."""
        if self._read is None:
            return None
        read_at, loop, read = self._read
        if time.monotonic() - read_at >= max_age or loop is not asyncio.get_running_loop():
            return None
        if read.done() and read.exception() is not None:
            return None
        return read

    async def queue(self, read: QueueRead, max_age: float) -> tuple[list, list]:
        """The pending slices and the nodes: the shared read if it is fresh, else a new
        one (``read``), which also forgets the GPUs counted as freeing."""
        shared = self._fresh(max_age)
        if shared is None:
            shared = asyncio.ensure_future(read())
            shared.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._read = (time.monotonic(), asyncio.get_running_loop(), shared)
            self.freeing = {}  # the fresh view shows what the stopped sessions gave back
        pending, nodes, held = await asyncio.shield(shared)
        self.nodes_seen, self.held_seen = nodes, held
        return pending, nodes

    def count_as_freeing(self, slice_: Mapping[str, Any]) -> None:
        """The GPUs of a session being stopped as idle: free for the next idle checks."""
        for placement in slice_.get("placements") or ():
            node = placement["node"]
            self.freeing[node] = self.freeing.get(node, 0) + len(placement.get("gpu_indices") or ())


__all__ = ["BrokerView"]
