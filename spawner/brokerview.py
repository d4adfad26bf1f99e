"""What the hub's sessions read of one broker, shared by all of them, as KubeSpawner's
reflectors share what they read of the Kubernetes API.

One :class:`BrokerView` per broker URL holds:

- the queue view for the idle rule (pending slices, nodes, granted slices), read at
  most once per ``max_age`` for every session of the hub (:meth:`BrokerView.queue`);
- the nodes and the granted slices as last seen, by any read: what the pending page
  and the notices say about draining nodes and protections ending;
- the terms the broker holds requests to (``GET /limits``: project caps, the debug
  lane's limits, the longest protected period, the lease, the preemption budget), as
  last read with the form's
  view of the cluster, so that the form offers what the broker allows instead of a
  copy of its configuration;
- the GPUs of sessions this hub is stopping as idle since the queue view was read
  (``freeing``): the next idle checks count them as free, so that one waiting
  request does not cost every idle session that could serve it;
- the hub's running sessions, and one periodic idle pass over all of them (as
  jupyterhub-idle-culler makes one pass over a hub's servers), instead of a task per
  session (:meth:`BrokerView.idle_round`);
- the heartbeats of all the hub's slices, sent together
  (:meth:`BrokerView.heartbeats`): one request per round trip to the broker, however
  many sessions the hub runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar, Protocol

from broker.client import BrokerAPIError, BrokerClient, HeartbeatBatcher

from .culler import gpus_by_node

#: The three reads of the queue view: pending slices, nodes, granted slices.
QueueRead = Callable[[], Awaitable[tuple[list, list, list]]]


class IdleSession(Protocol):
    """What the idle pass needs of a session (a spawner of the mixin)."""

    cull_interval: float
    slice: dict[str, Any] | None
    slice_id: int | None
    log: Any

    def idle_checkable(self) -> bool: ...

    async def read_queue(self) -> tuple[list, list, list]: ...

    async def session_idle_seconds(self, now: float) -> tuple[float | None, str]: ...

    def idle_for_a_waiter(self, idle: float, now: float) -> bool: ...

    def idle_check(
        self,
        pending: list,
        nodes: list,
        idle: float | None,
        source: str,
        now: float,
        idle_beside: Mapping[str, int] | None = None,
    ) -> bool: ...


class BrokerView:
    """The hub's shared view of one broker (see the module docstring)."""

    _views: ClassVar[dict[str, BrokerView]] = {}

    def __init__(self) -> None:
        self.nodes_seen: list[dict[str, Any]] | None = None
        self.held_seen: list[dict[str, Any]] = []
        self.limits: dict[str, Any] | None = None  # None: not read yet (or no /limits)
        self.freeing: Counter[str] = Counter()  # node -> GPUs on their way back
        # (monotonic time, event loop, the read under way or done)
        self._read: tuple[float, asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self.sessions: dict[int, IdleSession] = {}  # id(spawner) -> the running session
        self._idle_task: asyncio.Task | None = None
        self._heartbeats: tuple[asyncio.AbstractEventLoop, HeartbeatBatcher] | None = None

    @property
    def preemption_budget(self) -> int | None:
        """Preemptions past which a slice is kept to its end, as the limits last read say
        (None: no budget, or not read yet)."""
        return (self.limits or {}).get("preemption_budget")

    def heartbeats(self, client: BrokerClient) -> HeartbeatBatcher:
        """The hub's heartbeats to this broker on this event loop, sent together by
        ``client`` (the asking spawner's: every spawner's client is the hub's agent)."""
        loop = asyncio.get_running_loop()
        if self._heartbeats is None or self._heartbeats[0] is not loop:
            self._heartbeats = (loop, HeartbeatBatcher(client))
        batcher = self._heartbeats[1]
        batcher.client = client
        return batcher

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
            self.freeing = Counter()  # the fresh view shows what the stopped sessions gave back
        pending, nodes, held = await asyncio.shield(shared)
        self.nodes_seen, self.held_seen = nodes, held
        return pending, nodes

    # ---- the idle pass -------------------------------------------------------------------

    def watch_idle(self, session: IdleSession) -> None:
        """Check ``session`` in the idle pass from now on (started with the first one)."""
        self.sessions[id(session)] = session
        task = self._idle_task
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            self._idle_task = asyncio.ensure_future(self._idle_rounds())

    def unwatch_idle(self, session: IdleSession) -> None:
        self.sessions.pop(id(session), None)

    async def _idle_rounds(self) -> None:
        """Every ``cull_interval`` (the shortest of the sessions'), one idle round; ends
        when no session is left to watch."""
        while self.sessions:
            interval = min(s.cull_interval for s in self.sessions.values())
            await asyncio.sleep(interval)  # a check interval, not a synchronisation
            try:
                await self.idle_round(interval / 2)
            except Exception:  # one bad round must not end the hub's culling
                for session in list(self.sessions.values())[:1]:
                    session.log.exception("The idle round failed")

    async def idle_round(self, max_age: float) -> list[IdleSession]:
        """Check every running session against the idle rule once; the sessions it
        started stopping.

        The queue is read once for all. Sessions holding the most GPUs are checked
        first: when one stop serves a waiting request, its GPUs count as freeing and the
        smaller sessions that could also have served it are kept (fewest sessions
        stopped). The sessions' own activity is read concurrently.
        """
        running = [s for s in list(self.sessions.values()) if s.idle_checkable()]
        if not running:
            return []
        try:
            pending, nodes = await self.queue(running[0].read_queue, max_age)
        except BrokerAPIError as err:
            running[0].log.warning("Idle checks: the broker's queue not read: %s", err.message)
            return []
        now = time.time()
        reads = await asyncio.gather(*(s.session_idle_seconds(now) for s in running))
        checks = sorted(
            zip(running, reads, strict=True),
            key=lambda check: (-int((check[0].slice or {}).get("gpus") or 0), check[0].slice_id),
        )
        # GPUs per node of the sessions idle long enough to go for a waiting request: a
        # request larger than any one of them may be served by several on one node.
        idle_enough = {
            id(session): gpus_by_node(session.slice or {})
            for session, (idle, _) in checks
            if idle is not None and session.idle_for_a_waiter(idle, now)
        }
        idle_gpus = sum(idle_enough.values(), Counter())
        return [
            session
            for session, (idle, source) in checks
            if session.idle_check(
                pending,
                nodes,
                idle,
                source,
                now,
                idle_gpus - idle_enough[id(session)] if id(session) in idle_enough else None,
            )
        ]

    def count_as_freeing(self, slice_: Mapping[str, Any]) -> None:
        """The GPUs of a session being stopped as idle: free for the next idle checks."""
        self.freeing.update(gpus_by_node(slice_))


__all__ = ["BrokerView"]
