"""The store: the one part of the broker that reads and writes its database.

:class:`Broker` (:mod:`.broker`) is its interface: requests, projects and the
scheduling pass. The other modules hold what it is made of, one job each:

- :mod:`.journal` — transactions under the write lock, group commit, and the
  catalog and live slices a single writer keeps in memory;
- :mod:`.rows` — rows turned into the core's values and back, and whole-table queries;
- :mod:`.views` — the API's shapes of slices, nodes, accounts and project events;
- :mod:`.access` — who may see, change and charge what;
- :mod:`.inventory` — nodes reconciled with the configuration file or a live inventory;
- :mod:`.projects` — the project tree's record and its events.

The names below are what the rest of the broker and its tests import from
``broker.store``.
"""

from .access import NotYours, Principal
from .broker import DEFAULT_LEASE_S, Broker, Schedule
from .inventory import ADMIN_NODE_STATES, OUT_OF_SERVICE
from .journal import IDS_PER_QUERY
from .projects import CONTROL_CHARACTERS, MAX_MEMBER_NAME
from .rows import HELD_STATES, LIVE_STATES, _to_slice, _write_state

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
    "NotYours",
    "Principal",
    "Schedule",
    "_to_slice",
    "_write_state",
]
