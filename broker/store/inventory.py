"""Node reconciliation: the nodes the configuration file or a live inventory lists
made the database's, and the rules of who sets a node's state (design.md §6)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..core.model import Node, NodeState
from ..orm import DRAINED_BY_ADMIN, DRAINED_BY_INVENTORY, GpuTypeRow, NodeRow
from .rows import _weights

# One logger for the whole store, whichever of its modules logs.
log = logging.getLogger("broker.store")

#: Node states an admin may set; ``drained`` is the scheduler's to declare.
ADMIN_NODE_STATES = (NodeState.READY, NodeState.DRAINING, NodeState.DOWN)
OUT_OF_SERVICE = (NodeState.DRAINING, NodeState.DRAINED)


def _sync_nodes(session: Session, nodes: Iterable[Node], now: float) -> None:
    """Make the nodes those listed (the configuration file's or an inventory's)."""
    rows = {row.name: row for row in session.scalars(select(NodeRow))}
    listed = set()
    for node in nodes:
        listed.add(node.name)
        row = rows.get(node.name)
        if row is None:
            session.add(
                NodeRow(
                    name=node.name,
                    gpu_type=node.gpu_type,
                    gpu_count=node.gpu_count,
                    state=node.state.value,
                    state_changed_at=now,
                    state_reason="added to the configuration",
                    in_config=True,
                )
            )
            continue
        row.gpu_type, row.gpu_count = node.gpu_type, node.gpu_count
        if not row.in_config:
            # Back in the file (or inventory): down only because it had left it.
            _take_reported_state(row, node.state, "back in the configuration", now)
            row.in_config = True
    for name, row in rows.items():
        if name not in listed and row.in_config:
            row.in_config = False
            _take_reported_state(row, NodeState.DOWN, "removed from the configuration", now)


def _take_inventory(session: Session, nodes: list[Node], now: float) -> None:
    """Make the nodes those of a live inventory, by the rules of
    :meth:`~broker.store.Broker.sync_inventory`."""
    known_types = set(_weights(session))
    for node in nodes:
        if node.gpu_type not in known_types:
            session.add(GpuTypeRow(name=node.gpu_type, weight=1.0))
            known_types.add(node.gpu_type)
    _sync_nodes(session, nodes, now)
    rows = {row.name: row for row in session.scalars(select(NodeRow))}
    for node in nodes:
        _take_reported_state(rows[node.name], node.state, "from the inventory", now)


def _set_node(row: NodeRow, state: NodeState, reason: str, now: float) -> None:
    """Set a node's state; the time changes only when the state does."""
    if row.state != state.value:
        log.info("node %s: %s -> %s (%s)", row.name, row.state, state.value, reason)
        if state is NodeState.DRAINED:
            log.warning("node %s is drained: repair may proceed", row.name)
        row.state, row.state_changed_at = state.value, now
    row.state_reason = reason


def _take_reported_state(row: NodeRow, reported: NodeState, reason: str, now: float) -> None:
    """Give a node the state its source (the file, a live inventory) reports, as far
    as the rules allow (design.md §6).

    The source's ``down`` always wins: the node is gone or not ready. Otherwise an
    admin's drain holds (``draining``, ``drained`` once empty) until an admin
    undrains the node. The source's own drain (a cordon) is the source's to undo,
    and a drained node stays drained while the source still says ``draining``.
    """
    current = NodeState(row.state)
    held_by_admin = row.drained_by == DRAINED_BY_ADMIN
    if reported is NodeState.DOWN:
        target = NodeState.DOWN
    elif held_by_admin:
        target = current if current in OUT_OF_SERVICE else NodeState.DRAINING
        reason = f"{reason}; still drained by an admin"
    elif current is NodeState.DRAINED and reported is NodeState.DRAINING:
        target = current
    else:
        target = reported
    if not held_by_admin:
        row.drained_by = DRAINED_BY_INVENTORY if target in OUT_OF_SERVICE else None
    if target is not current:
        _set_node(row, target, reason, now)
