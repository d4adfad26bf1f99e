"""The API's shapes: slices, nodes, accounts and project events as dicts, as
design.md §8 shows them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from ..config import ClusterConfig
from ..core.model import Slice
from ..orm import NodeRow, ProjectEventRow, SliceRow
from .rows import HELD_STATES, _accounts, _Costs, _members, _to_slice


def _slice_dict(row: SliceRow, now: float, costs: _Costs) -> dict[str, Any]:
    """A slice as design.md §8 shows it; a held allocated slice's charge accrues to ``now``."""
    view = _row_view(row)
    if row.state in HELD_STATES:
        _accrue(view, _to_slice(row), now, costs)
    return view


def _kept_dict(view: dict[str, Any], slice_: Slice, now: float, costs: _Costs) -> dict[str, Any]:
    """:func:`_slice_dict` of a live slice kept in memory: its view and its value."""
    answer = dict(view)
    if slice_.holds_gpus:
        _accrue(answer, slice_, now, costs)
    return answer


def _accrue(view: dict[str, Any], slice_: Slice, now: float, costs: _Costs) -> None:
    entry = costs.entry(slice_, now)
    view["charged_gpu_seconds"] += entry.weighted_gpu_seconds if entry else 0.0


def _row_view(row: SliceRow) -> dict[str, Any]:
    """A slice as design.md §8 shows it, charged as journaled."""
    granted = row.granted_at
    return {
        "id": row.id,
        "project": row.project,
        "user": row.user,
        "gpus": row.gpus,
        "gpu_type": row.gpu_type,
        "kind": row.kind,
        "min_runtime": row.min_runtime,
        "resumable": row.resumable,
        "max_runtime": row.max_runtime,
        "priority": row.priority,
        "state": row.state,
        "end_reason": row.end_reason,
        "placements": [dict(p) for p in row.placements],
        "submitted_at": row.submitted_at,
        "granted_at": granted,
        "protected_until": None if granted is None else granted + row.min_runtime,
        "preempt_deadline": row.preempt_deadline,
        "preempt_reason": row.preempt_reason,
        "ended_at": row.ended_at,
        "lease_expires_at": row.lease_expires_at,
        "queue_position": row.queue_position,
        "fairshare_value": row.fairshare_value,
        "estimated_start": row.estimated_start,
        "charged_gpu_seconds": row.charged_gpu_seconds,
        "preemptions": row.preemptions,
        "checkpointed_at": row.checkpointed_at,
        "replaced_by": row.replaced_by,
    }


def _node_dict(row: NodeRow, weights: Mapping[str, float], held: int) -> dict[str, Any]:
    return {
        "name": row.name,
        "gpu_type": row.gpu_type,
        "gpu_count": row.gpu_count,
        "weight": weights.get(row.gpu_type, 1.0),
        "state": row.state,
        "state_reason": row.state_reason,
        "state_changed_at": row.state_changed_at,
        "in_config": row.in_config,
        "drained_by": row.drained_by,
        "gpus_held": held,
    }


def _project_event_dict(row: ProjectEventRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "account": row.account,
        "who": row.who,
        "at": row.at,
        "action": row.action,
        "before": row.before,
        "after": row.after,
    }


def _account_states(session: Session) -> dict[str, dict[str, Any]]:
    """Every account as ``{"share", "parent", "users", "groups"}`` (sorted names)."""
    members = _members(session)
    states = {}
    for account in _accounts(session):
        users, groups = members.get(account.name, (set(), set()))
        states[account.name] = {
            "share": account.share,
            "parent": account.parent,
            "users": sorted(users),
            "groups": sorted(groups),
        }
    return states


def _config_states(config: ClusterConfig) -> dict[str, dict[str, Any]]:
    """The cluster file's accounts as :func:`_account_states` shows the database's."""
    states = {}
    for account in config.accounts:
        members = config.members.get(account.name)
        states[account.name] = {
            "share": account.share,
            "parent": account.parent,
            "users": sorted(members.users) if members else [],
            "groups": sorted(members.groups) if members else [],
        }
    return states
