"""A session's life cycle: one phase at a time, and the moves between them (design.md §7).

Every hook of the spawner (``start``, ``stop``, ``poll``, ``progress``,
``get_state``/``load_state``) reads the one :class:`Lifecycle` of its spawner::

    idle ─► requesting ─► waiting ─► launching ─► running ─► stopping ─► stopped
                 │            │           │           ▲          │
                 └────────────┴───────────┴─► stopping┘ (stop()) └─► running
                                                         (the backend's stop failed)

- **idle**: nothing asked yet (a new spawner).
- **requesting**: ``start()`` sends the request to the broker.
- **waiting**: the slice waits in the broker's queue.
- **launching**: the slice is granted; the backend starts the server.
- **running**: the server runs on the slice (also a session restored by
  ``load_state`` after a hub restart, until its first poll reconnects it).
- **stopping**: ``stop()`` (or the end of the slice) stops the server, then releases
  the slice.
- **stopped**: the server is gone and the slice released (a spawn that failed or
  was cancelled ends here too). ``start()`` may begin again.

A ``stop()`` before the grant (requesting, waiting) *cancels* the spawn: the slice
is withdrawn and ``start()`` raises a "cancelled" error. A backend whose ``stop()``
fails goes back to running, the slice kept.
"""

from __future__ import annotations

import asyncio
import enum


class Phase(enum.StrEnum):
    """Where a session is in its life cycle (see the module's docstring)."""

    IDLE = "idle"
    REQUESTING = "requesting"
    WAITING = "waiting"
    LAUNCHING = "launching"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


#: The phases a spawn is in while ``start()`` runs.
STARTING = frozenset({Phase.REQUESTING, Phase.WAITING, Phase.LAUNCHING})
#: The phases before the grant: the backend has launched nothing yet.
BEFORE_GRANT = frozenset({Phase.REQUESTING, Phase.WAITING})

#: Phase -> the phases it may move to.
MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.REQUESTING, Phase.RUNNING, Phase.STOPPING}),
    Phase.REQUESTING: frozenset({Phase.WAITING, Phase.STOPPING, Phase.STOPPED}),
    Phase.WAITING: frozenset({Phase.LAUNCHING, Phase.STOPPING, Phase.STOPPED}),
    Phase.LAUNCHING: frozenset({Phase.RUNNING, Phase.STOPPING, Phase.STOPPED}),
    Phase.RUNNING: frozenset({Phase.STOPPING, Phase.STOPPED}),
    Phase.STOPPING: frozenset({Phase.STOPPED, Phase.RUNNING}),
    Phase.STOPPED: frozenset({Phase.REQUESTING, Phase.RUNNING, Phase.STOPPING}),
}


class InvalidMove(RuntimeError):
    """A move the life cycle does not have (a bug in the spawner, never the user's)."""


class Lifecycle:
    """The phase of one spawner, with an event for each move."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        #: A ``stop()`` came before the grant: ``start()`` must end as cancelled.
        self.cancelled = False
        #: Restored by ``load_state`` as running: the first poll asks the broker where
        #: the slice stands.
        self.needs_reconnect = False
        self._moved: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"<Lifecycle {self.phase}{' cancelled' if self.cancelled else ''}>"

    @property
    def starting(self) -> bool:
        """``start()`` runs: requesting, waiting or launching."""
        return self.phase in STARTING

    @property
    def before_grant(self) -> bool:
        """Requesting or waiting: no server has been launched."""
        return self.phase in BEFORE_GRANT

    def move(self, to: Phase) -> Phase:
        """Move to ``to`` (staying put is allowed); the phase left. Raises
        :class:`InvalidMove` for a move the life cycle does not have."""
        left = self.phase
        if to is left:
            return left
        if to not in MOVES[left]:
            raise InvalidMove(f"a session cannot go from {left} to {to}")
        self.phase = to
        if to is Phase.REQUESTING:
            self.cancelled = False
        if to is not Phase.RUNNING:
            self.needs_reconnect = False
        self.pulse()
        return left

    def pulse(self) -> None:
        """Wake whoever waits in :meth:`moved`."""
        if self._moved is not None:
            moved, self._moved = self._moved, None
            moved.set()

    def moved(self) -> asyncio.Event:
        """An event set at the next move (or :meth:`pulse`)."""
        if self._moved is None:
            self._moved = asyncio.Event()
        return self._moved


__all__ = ["BEFORE_GRANT", "MOVES", "STARTING", "InvalidMove", "Lifecycle", "Phase"]
