"""Rows and the core's values: the slice states the store groups rows by, a slice
row turned into a :class:`~broker.core.model.Slice` and back, what charging
needs, and the queries that read a whole table."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..core import accounting
from ..core.fairshare import ProjectTree
from ..core.model import Account, Contract, Node, NodeState, Placement, Slice, SliceKind, SliceState
from ..orm import AccountRow, GpuTypeRow, LedgerRow, MemberRow, NodeRow, SliceRow

LIVE_STATES = (SliceState.PENDING, SliceState.GRANTED, SliceState.PREEMPTING)
HELD_STATES = (SliceState.GRANTED, SliceState.PREEMPTING)


class _Costs:
    """What charging needs: each node's GPU type and each type's weight."""

    def __init__(self, node_types: Mapping[str, str] | None = None, weights=None):
        self.node_types: Mapping[str, str] = node_types or {}
        self.weights: Mapping[str, float] = weights or {}

    def entry(self, slice_: Slice, until: float) -> accounting.LedgerEntry | None:
        return accounting.ledger_entry(slice_, until, self.node_types, self.weights)

    def running(self, slice_: Slice) -> tuple[str, float, float] | None:
        """``(project, start, rate)`` of a held slice's charge so far (no entry built)."""
        return accounting.running_interval(slice_, self.node_types, self.weights)


def _write_state(row: SliceRow, slice_: Slice) -> None:
    """Store what a transition of :mod:`broker.core.transitions` changed in a slice."""
    _update(
        row,
        state=slice_.state.value,
        min_runtime=slice_.contract.min_runtime,
        placements=_placement_json(slice_.placements),
        granted_at=slice_.granted_at,
        preempt_deadline=slice_.preempt_deadline,
        promised=_placement_json(slice_.promised),
        lease_expires_at=slice_.lease_expires_at,
        preemptions=slice_.preemptions,
        queued_at=slice_.queued_at,
        checkpointed_at=slice_.checkpointed_at,
    )


def _update(row: SliceRow, **values: Any) -> None:
    for name, value in values.items():
        if getattr(row, name) != value:
            setattr(row, name, value)


def _placements(data: Iterable[Mapping[str, Any]]) -> tuple[Placement, ...]:
    return tuple(Placement(p["node"], tuple(p["gpu_indices"])) for p in data)


def _placement_json(placements: Iterable[Placement]) -> list[dict[str, Any]]:
    return [{"node": p.node, "gpu_indices": list(p.gpu_indices)} for p in placements]


def _to_slice(row: SliceRow) -> Slice:
    return Slice(
        id=row.id,
        project=row.project,
        user=row.user,
        gpus=row.gpus,
        kind=SliceKind(row.kind),
        contract=Contract(row.min_runtime, row.resumable, row.max_runtime),
        gpu_type=row.gpu_type,
        priority=row.priority,
        submitted_at=row.submitted_at,
        state=SliceState(row.state),
        placements=_placements(row.placements),
        granted_at=row.granted_at,
        preempt_deadline=row.preempt_deadline,
        promised=_placements(row.promised),
        lease_expires_at=row.lease_expires_at,
        preemptions=row.preemptions,
        queued_at=row.queued_at,
        checkpointed_at=row.checkpointed_at,
    )


def _ledger_entry(row: LedgerRow) -> accounting.LedgerEntry:
    return accounting.LedgerEntry(
        row.slice_id, row.project, row.user, row.start, row.end, row.gpus * row.weight, row.gpus
    )


def _kind_or_none(kind: object) -> SliceKind | None:
    try:
        return SliceKind(kind)
    except ValueError:
        return None


def _accounts(session: Session) -> list[Account]:
    rows = session.scalars(select(AccountRow).order_by(AccountRow.name))
    return [Account(row.name, row.share, row.parent) for row in rows]


def _tree(session: Session) -> ProjectTree:
    return ProjectTree(_accounts(session))


def _node(row: NodeRow) -> Node:
    return Node(row.name, row.gpu_type, row.gpu_count, NodeState(row.state))


def _weights(session: Session) -> dict[str, float]:
    return dict(session.execute(select(GpuTypeRow.name, GpuTypeRow.weight)).all())


def _members(session: Session) -> dict[str, tuple[set[str], set[str]]]:
    members: dict[str, tuple[set[str], set[str]]] = {}
    for row in session.scalars(select(MemberRow)):
        users, groups = members.setdefault(row.project, (set(), set()))
        (users if row.kind == "user" else groups).add(row.name)
    return members
