"""The store: the one part of the broker that reads and writes its database.

:class:`Broker` (in :mod:`.broker`) is its interface; the names below are what
the rest of the broker and its tests import from ``broker.store``.
"""

from .broker import (
    ADMIN_NODE_STATES,
    CONTROL_CHARACTERS,
    DEFAULT_LEASE_S,
    HELD_STATES,
    IDS_PER_QUERY,
    LIVE_STATES,
    MAX_MEMBER_NAME,
    OUT_OF_SERVICE,
    Broker,
    Schedule,
    _to_slice,
    _write_state,
)

__all__ = [
    "ADMIN_NODE_STATES",
    "CONTROL_CHARACTERS",
    "DEFAULT_LEASE_S",
    "HELD_STATES",
    "IDS_PER_QUERY",
    "LIVE_STATES",
    "MAX_MEMBER_NAME",
    "OUT_OF_SERVICE",
    "Broker",
    "Schedule",
    "_to_slice",
    "_write_state",
]
